// Sampling the next token on the device: temperature, top-k, top-p, a seeded counter-based RNG.
//
// sample<C>(part, logits, token, state, step, vocab, temperature, top_k, top_p, seed)
//   part    fp32 [B, 2C+4]  scratch, one row per CTA; its partition ([1, 2C+4] tiles) sets the grid (B
//                           CTAs, each a slice of ceil(V/B) <= 1024 logits); contents unspecified
//   logits  fp32 [V]
//   token   int32 [1]       written: the sampled token id, always in [0, V)
//   state   int32 [1]       zero before the first launch; the finishing CTA resets it (graph replays work)
//   step    int32 [1]       the draw counter read on the device (pass the position buffer: every step draws
//                           fresh numbers, and a replay over the same positions redraws the same tokens)
//   vocab   int32           V;  temperature, top_k, top_p: as in Hugging Face;  seed: uint64
//
// What is sampled (the NumPy reference in llama_attn.py implements the same, in float64):
//   * temperature <= 0 or top_k == 1: greedy, the argmax (lowest index on ties);
//   * else with x = logits: keep x >= tau_k, tau_k the top_k-th largest logit (top_k = 0 or >= V: all;
//     ties at the threshold are all kept, as Hugging Face's TopKLogitsWarper does); then, if top_p < 1,
//     keep x >= tau_p, tau_p the largest value whose kept mass sum_{x >= tau_p} exp((x - max)/T) reaches
//     top_p times the mass of the top-k set (at least the maximum survives);
//   * the draw among the survivors is Gumbel-max: argmax_i x_i / T + g_i (lowest index on ties), with
//     g_i = -log(-log(u_i)), u_i = (2 * (r_i >> 9) + 1) / 2^24 and r_i the first word of
//     Philox-4x32-10 (Random123) with counter (i, step, 0, 0) and key (seed & 0xffffffff, seed >> 32).
//     Gumbel-max samples exactly softmax(x/T) restricted to the survivors, needs no normalisation and
//     no prefix sum, and gives each token the same noise whatever top_k/top_p are.
// Reproducible: no float reduction depends on timing.  Masses are 64-bit fixed point (2^40 * exp2(...),
// integer atomics); float sums use fixed trees.
//
// How (one kernel, B CTAs of 1024 threads, the last CTA to finish completes the work):
//   greedy: every CTA's argmax -> the last CTA's argmax over B.  Pure temperature (no top-k/top-p):
//   every CTA's Gumbel-max over its slice -> the last CTA's max over B: one pass over the logits.
//   Otherwise every CTA sorts its slice (bitonic, registers + shared memory) and writes its C largest
//   (value, index) plus (max, sum exp((x - max)/T)); the last CTA radix-selects tau_k and tau_p on the
//   B*C candidates (4 rounds of 8 bits, counts or fixed-point masses) and draws.  The candidates are
//   exact above E = the largest C-th value of the CTAs that had more than C logits; if a threshold falls
//   at or below E (top_k larger than the candidates cover, or a nucleus reaching that far: flat logits
//   with top_p < 1 and no top_k), the last CTA redoes the selection on all V logits (exact, slower: four
//   reads of the logits from L2 per threshold by one CTA).
//
// Measurements, and what was tried: docs/llama.md ("Kernel measurements").
//
// PDL: the logits come from the previous kernel and the step from an earlier one, so everything is
// read after griddepcontrol.wait; the dependents are released at the start (they wait for the token).
#include "llama_common.cuh"

namespace llama_sample {

// NVRTC has no <cmath>: infinity from its bits
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

using llama::pdl_launch_dependents;  // kernels/llama_common.cuh
using llama::pdl_wait;

constexpr int NT = 1024;                   // threads per CTA
constexpr int MAXCAND = 4096;              // B*C candidates at most (32 KB of shared memory)
constexpr float LOG2E = 1.4426950408889634f;
constexpr float FIXED = 1099511627776.f;   // 2^40: masses are <= 1 each, V <= 2^20 of them (< 2^64)

// order-preserving key of a float (NaN lowest); -0 is canonicalised to +0 by the caller (x + 0.f)
__device__ __forceinline__ unsigned ord(float x) {
    const unsigned b = __float_as_uint(x);
    if (x != x) return 0u;
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ uint4 philox(uint4 c, uint2 k) {
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        const unsigned hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
        const unsigned hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
        c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
        k.x += 0x9E3779B9u;
        k.y += 0xBB67AE85u;
    }
    return c;
}

__device__ __forceinline__ float gumbel(int i, unsigned step, uint2 key) {
    const unsigned r = philox(make_uint4((unsigned)i, step, 0u, 0u), key).x;
    const float u = (float)(2u * (r >> 9) + 1u) * 5.9604644775390625e-8f;  // 2^-24: exact, in (0, 1)
    return -logf(-logf(u));
}

__device__ __forceinline__ unsigned long long fixed_mass(float x, float mx, float c) {
    return (unsigned long long)__float2ull_rn(exp2f((x - mx) * c) * FIXED);
}

struct Best { unsigned key; int idx; };

__device__ __forceinline__ Best better(Best a, Best b) {
    return (a.key > b.key || (a.key == b.key && a.idx < b.idx)) ? a : b;
}

// the best (largest key, then lowest index) over the CTA, returned to every thread
__device__ Best block_best(Best v, Best* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        Best w{__shfl_xor_sync(0xffffffffu, v.key, o), __shfl_xor_sync(0xffffffffu, v.idx, o)};
        v = better(v, w);
    }
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = red[lane];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            Best w{__shfl_xor_sync(0xffffffffu, v.key, o), __shfl_xor_sync(0xffffffffu, v.idx, o)};
            v = better(v, w);
        }
        if (lane == 0) red[0] = v;
    }
    __syncthreads();
    return red[0];
}

// sums over the CTA in a fixed tree (deterministic), returned to every thread
template <typename T>
__device__ T block_sum(T v, T* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = red[lane];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0) red[0] = v;
    }
    __syncthreads();
    const T r = red[0];
    __syncthreads();
    return r;
}

// The selection source of the fallback: all V logits, read through L2.
struct Source {
    const float* val;
    int n;
    __device__ float v(int j) const { return __ldcg(val + j) + 0.f; }
};

struct Shared {
    unsigned long long hist[256];
    Best best[32];
    unsigned long long sum64[32];
    float sumf[32];
    unsigned sel[2];
    unsigned long long above;
    int pick;
    int last;
};

// The largest key tau >= lo with weight{key >= tau, key >= lo} >= target, weight = 1 (MASS false) or the
// fixed-point mass; lo if the whole weight falls short.  Radix select, 8 bits a round.
template <bool MASS>
__device__ unsigned radix_select(const Source& src, unsigned long long target, unsigned lo, float mx, float c,
                                 Shared& sh) {
    const int tid = threadIdx.x, lane = tid & 31;
    unsigned prefix = 0;
    unsigned long long above = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        const unsigned hi_mask = shift == 24 ? 0u : (0xffffffffu << (shift + 8));
        for (int b = tid; b < 256; b += NT) sh.hist[b] = 0;
        __syncthreads();
        // lanes adding to the same bin are summed first, one atomic per bin and warp: a few bins
        // hold most logits, and same-address shared atomics serialise (1.3 ms a draw without this)
        for (int base = 0; base < src.n; base += NT) {
            const int j = base + tid;
            unsigned bin = 0xffffffffu;
            unsigned long long w = 0;
            if (j < src.n) {
                const float x = src.v(j);
                const unsigned key = ord(x);
                if (key >= lo && (key & hi_mask) == prefix) {
                    bin = (key >> shift) & 255u;
                    w = MASS ? fixed_mass(x, mx, c) : 1ull;
                }
            }
            const unsigned peers = __match_any_sync(0xffffffffu, bin);
            unsigned long long sum = __popc(peers);
            if (MASS) {
                sum = 0;
#pragma unroll
                for (int t = 0; t < 32; ++t) {
                    const unsigned long long wt = __shfl_sync(0xffffffffu, w, t);
                    sum += (peers >> t) & 1u ? wt : 0ull;
                }
            }
            if (bin != 0xffffffffu && lane == __ffs(peers) - 1) atomicAdd(&sh.hist[bin], sum);
        }
        __syncthreads();
        if (tid < 32) {  // lane L holds bins 255-8L .. 248-8L (descending)
            unsigned long long h[8], s = 0;
#pragma unroll
            for (int e = 0; e < 8; ++e) { h[e] = sh.hist[255 - 8 * lane - e]; s += h[e]; }
            unsigned long long incl = s;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const unsigned long long t = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += t;
            }
            const unsigned long long before = above + incl - s;
            const bool mine = before < target && before + s >= target;
            const unsigned found = __ballot_sync(0xffffffffu, mine);
            if (mine) {
                unsigned long long cum = before;
                int e = 0;
                for (; e < 7; ++e) {
                    if (cum + h[e] >= target) break;
                    cum += h[e];
                }
                sh.sel[0] = 255 - 8 * lane - e;
                sh.above = cum;
            }
            if (lane == 0) sh.sel[1] = found != 0u;
        }
        __syncthreads();
        if (!sh.sel[1]) return lo;  // only in the first round: everything >= lo is kept
        prefix |= sh.sel[0] << shift;
        above = sh.above;
        __syncthreads();
    }
    return prefix;
}

// The fallback: top-k / top-p thresholds by radix select over all V logits, then the Gumbel draw.
__device__ int select_all(const Source& src, int V, int top_k, float top_p, float mx, float c, float invT,
                          unsigned step, uint2 key, Shared& sh) {
    const int tid = threadIdx.x;
    const bool use_k = top_k > 0 && top_k < V;
    const unsigned tau_k = use_k ? radix_select<false>(src, (unsigned long long)top_k, 0u, mx, c, sh) : 0u;
    unsigned tau = tau_k;
    if (top_p < 1.f) {
        unsigned long long z = 0;
        for (int j = tid; j < src.n; j += NT) {
            const float x = src.v(j);
            if (ord(x) >= tau_k) z += fixed_mass(x, mx, c);
        }
        z = block_sum<unsigned long long>(z, sh.sum64);
        const double t = ceil((double)top_p * (double)z);
        tau = radix_select<true>(src, t < 1.0 ? 1ull : (unsigned long long)t, tau_k, mx, c, sh);
    }
    Best b{0u, 0x7fffffff};
    for (int j = tid; j < src.n; j += NT) {
        const float x = src.v(j);
        if (ord(x) >= tau) b = better(b, Best{ord(x * invT + gumbel(j, step, key)), j});
    }
    return block_best(b, sh.best).idx;
}

// The same on the candidates, sorted (value desc, index asc) in comp[0, np): -1 when they cannot
// decide (a threshold at or below ek, their exactness bound), else the token.
__device__ int select_sorted(const unsigned long long* comp, int np, unsigned ek, int V, int top_k, float top_p,
                             float mx, float c, float invT, unsigned long long z_all, unsigned step, uint2 key,
                             Shared& sh) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    auto key_of = [&](int j) { return (unsigned)(comp[j] >> 32); };
    auto idx_of = [&](int j) { return (int)(0xffffffffu - (unsigned)(comp[j] & 0xffffffffu)); };
    auto val_of = [&](unsigned k) { return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k); };
    unsigned cnt = 0;  // real candidates (the padding, 0, sorts last)
    for (int j = tid; j < np; j += NT) cnt += comp[j] != 0ull;
    const int nv = (int)block_sum<unsigned>(cnt, reinterpret_cast<unsigned*>(sh.sum64));
    const bool use_k = top_k > 0 && top_k < V;
    int nk = nv;  // the kept prefix
    unsigned tau = 0;
    if (use_k) {
        if (top_k > nv || key_of(top_k - 1) <= ek) return -1;
        tau = key_of(top_k - 1);
    }
    auto prefix_len = [&](unsigned t) {  // candidates with key >= t (a prefix: they are sorted)
        unsigned m = 0;
        for (int j = tid; j < nv; j += NT) m += key_of(j) >= t;
        return (int)block_sum<unsigned>(m, reinterpret_cast<unsigned*>(sh.sum64));
    };
    if (use_k) nk = prefix_len(tau);
    if (top_p < 1.f) {
        // inclusive scan of the fixed-point masses over the kept prefix; thread t owns PER consecutive
        constexpr int PER = MAXCAND / NT;
        unsigned long long w[PER], local = 0;
#pragma unroll
        for (int e = 0; e < PER; ++e) {
            const int j = tid * PER + e;
            w[e] = j < nk ? fixed_mass(val_of(key_of(j)), mx, c) : 0ull;
            local += w[e];
        }
        unsigned long long incl = local;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const unsigned long long t = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += t;
        }
        __syncthreads();
        if (lane == 31) sh.sum64[warp] = incl;
        __syncthreads();
        if (warp == 0) {
            unsigned long long v = sh.sum64[lane], vi = v;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const unsigned long long t = __shfl_up_sync(0xffffffffu, vi, o);
                if (lane >= o) vi += t;
            }
            sh.sum64[lane] = vi - v;  // exclusive: the warps before
            if (lane == 31) sh.above = vi;  // the total
        }
        __syncthreads();
        const unsigned long long total = sh.above;
        const unsigned long long z = use_k ? total : z_all;  // the candidates hold the whole top-k set
        const double td = ceil((double)top_p * (double)z);
        const unsigned long long target = td < 1.0 ? 1ull : (unsigned long long)td;
        if (tid == 0) sh.pick = -1;
        __syncthreads();
        unsigned long long cum = sh.sum64[warp] + incl - local;
#pragma unroll
        for (int e = 0; e < PER; ++e) {
            if (cum < target && cum + w[e] >= target) sh.pick = tid * PER + e;  // one crossing
            cum += w[e];
        }
        __syncthreads();
        const int jp = sh.pick;
        if (jp < 0 || key_of(jp) <= ek) return -1;  // the nucleus reaches past the candidates
        tau = key_of(jp);
        nk = prefix_len(tau);
    }
    Best b{0u, 0x7fffffff};
    for (int j = tid; j < nk; j += NT) {
        const int i = idx_of(j);
        b = better(b, Best{ord(val_of(key_of(j)) * invT + gumbel(i, step, key)), i});
    }
    return block_best(b, sh.best).idx;
}

}  // namespace llama_sample

template <int C>
__global__ void __launch_bounds__(1024, 1)
sample(float* __restrict__ part, const float* __restrict__ logits, int* __restrict__ token, int* __restrict__ state,
       const int* __restrict__ step_p, int V, float temperature, int top_k, float top_p, unsigned long long seed) {
    using namespace llama_sample;
    static_assert(C >= 1 && C <= 1024, "C: 1 to 1024 candidates per CTA");
    constexpr int W = 2 * C + 4;  // a row of part
    __shared__ Shared sh;
    __shared__ union {
        unsigned long long sorted[NT];
        unsigned long long cand[MAXCAND];  // (key, ~index) of the candidates, sorted by the last CTA
    } buf;

    const int tid = threadIdx.x, B = gridDim.x, b = blockIdx.x;
    const int SL = (V + B - 1) / B;  // <= 1024 (the declaration checks)
    const int i = b * SL + tid;
    const bool valid = tid < SL && i < V;
    const bool greedy = !(temperature > 0.f) || top_k == 1;
    const bool full = (top_k <= 0 || top_k >= V) && !(top_p < 1.f);
    const float invT = 1.f / temperature, c = invT * LOG2E;
    const uint2 key = make_uint2((unsigned)seed, (unsigned)(seed >> 32));

    pdl_launch_dependents();
    pdl_wait();  // the logits (previous kernel) and the step (an earlier one) are complete from here on
    const unsigned step = (unsigned)__ldcg(step_p);
    const float x = valid ? __ldcg(logits + i) + 0.f : -INFINITY;
    float* const row = part + (size_t)b * W;

    if (greedy || full) {
        Best v{0u, 0x7fffffff};
        if (valid) v = Best{ord(greedy ? x : x * invT + gumbel(i, step, key)), i};
        v = block_best(v, sh.best);
        if (tid == 0) { row[0] = __uint_as_float(v.key); row[1] = __int_as_float(v.idx); }
    } else {
        // bitonic sort, descending, of (key, ~index): value desc, then index asc
        unsigned long long e = valid ? ((unsigned long long)ord(x) << 32) | (0xffffffffu - (unsigned)i) : 0ull;
        for (int k = 2; k <= NT; k <<= 1) {
            for (int j = k >> 1; j > 0; j >>= 1) {
                unsigned long long o;
                if (j >= 32) {
                    buf.sorted[tid] = e;
                    __syncthreads();
                    o = buf.sorted[tid ^ j];
                    __syncthreads();
                } else {
                    o = __shfl_xor_sync(0xffffffffu, e, j);
                }
                const bool lower = (tid & j) == 0, desc = (tid & k) == 0;
                e = (lower == desc) ? (e > o ? e : o) : (e < o ? e : o);
            }
        }
        if (tid == 0) sh.sel[0] = (unsigned)(e >> 32);
        __syncthreads();
        const unsigned top = sh.sel[0];
        // the maximum as a float, from its key (keys of valid entries are > 0 unless NaN)
        const unsigned tb = (top & 0x80000000u) ? (top & 0x7fffffffu) : ~top;
        const float mb = top == 0u ? -INFINITY : __uint_as_float(tb);  // 0: no logit (or NaN)
        if (tid < C) {
            const bool real = e != 0ull;
            const unsigned kk = (unsigned)(e >> 32);
            const unsigned vb = (kk & 0x80000000u) ? (kk & 0x7fffffffu) : ~kk;
            row[tid] = real ? __uint_as_float(vb) : -INFINITY;
            row[C + tid] = __int_as_float(real ? (int)(0xffffffffu - (unsigned)(e & 0xffffffffu)) : -1);
        }
        const float sb = block_sum<float>(valid && mb != -INFINITY ? exp2f((x - mb) * c) : 0.f, sh.sumf);
        if (tid == 0) { row[2 * C] = mb; row[2 * C + 1] = sb; }
    }

    // the last CTA to finish completes the work (threadFenceReduction's protocol)
    __threadfence();
    __syncthreads();
    if (tid == 0) sh.last = atomicAdd(state, 1) == B - 1;
    __syncthreads();
    if (!sh.last) return;
    __threadfence();

    int tok = 0;
    if (greedy || full) {
        Best v{0u, 0x7fffffff};
        if (tid < B) {
            const float* r = part + (size_t)tid * W;
            v = Best{__float_as_uint(__ldcg(r)), __float_as_int(__ldcg(r + 1))};
        }
        tok = block_best(v, sh.best).idx;
    } else {
        const int n = B * C;
        int np = 1;
        while (np < n) np <<= 1;
        for (int j = tid; j < np; j += NT) {
            unsigned long long e = 0ull;
            if (j < n) {
                const float* r = part + (size_t)(j / C) * W;
                const int ix = __float_as_int(__ldcg(r + C + j % C));
                if (ix >= 0) e = ((unsigned long long)ord(__ldcg(r + j % C) + 0.f) << 32) | (0xffffffffu - (unsigned)ix);
            }
            buf.cand[j] = e;
        }
        // the maximum, the exactness bound E, and the total mass from the per-CTA (max, sum)
        Best mxb{0u, 0x7fffffff}, eb{0u, 0x7fffffff};
        float mt = -INFINITY, st = 0.f;
        if (tid < B) {
            const float* r = part + (size_t)tid * W;
            mt = __ldcg(r + 2 * C);
            st = __ldcg(r + 2 * C + 1);
            if (mt != -INFINITY) mxb = Best{ord(mt), 0};
            const int len = min(SL, V - tid * SL);
            if (len > C) eb = Best{ord(__ldcg(r + C - 1) + 0.f), 0};
        }
        const unsigned mkey = block_best(mxb, sh.best).key;
        const unsigned ek = block_best(eb, sh.best).key;
        const unsigned mbits = (mkey & 0x80000000u) ? (mkey & 0x7fffffffu) : ~mkey;
        const float mx = __uint_as_float(mbits);
        const float zf = block_sum<float>(tid < B && mt != -INFINITY ? st * exp2f((mt - mx) * c) : 0.f, sh.sumf);
        const unsigned long long z_all = __float2ull_rn(zf * FIXED);
        // bitonic sort of the candidates, descending, in shared memory (each pair once a stage)
        for (int k = 2; k <= np; k <<= 1) {
            for (int j = k >> 1; j > 0; j >>= 1) {
                for (int t = tid; t < np / 2; t += NT) {
                    const int a = (t / j) * 2 * j + (t % j), bb = a + j;
                    const unsigned long long x = buf.cand[a], y = buf.cand[bb];
                    if ((x < y) == ((a & k) == 0)) { buf.cand[a] = y; buf.cand[bb] = x; }
                }
                __syncthreads();
            }
        }
        tok = select_sorted(buf.cand, np, ek, V, top_k, top_p, mx, c, invT, z_all, step, key, sh);
        if (tok < 0) tok = select_all(Source{logits, V}, V, top_k, top_p, mx, c, invT, step, key, sh);
    }
    if (tid == 0) {
        *token = tok >= 0 && tok < V ? tok : 0;
        *state = 0;  // ready for the next launch (ordered by the kernel boundary)
    }
}
