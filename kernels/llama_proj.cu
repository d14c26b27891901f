// The projection kernels of the Llama decode step (batch 1): bf16 weights in
// Hugging Face layout [out_features, in_features], fp32 activations, fp32
// accumulation.  Declarations and float64 references: kernels/llama_proj.py.
//
//   embed_gather<B>            hidden[D] = float(embed[token]), token read on the device
//   rms_qkv_rope<K,HD,HQ,HKV,W,CH>
//                              RMSNorm(hidden) * norm_w folded into w_qkv; RoPE on q and k;
//                              q fp32 out, k and v appended (bf16) to the layer's cache at pos
//   matvec_residual<K,NR,CH,W,RPC>
//                              out[N] = residual + W[N, K] @ x   (O and down projections)
//   rms_gate_up_silu<K,CH,W,PPC>
//                              act[I] = silu(gate_j . xn) * (up_j . xn), xn = RMSNorm(hidden) * norm_w
//   rms_lm_head_argmax<K,NR,CH,W,RPC>
//                              logits[V] = W[V, K] @ xn, and token = argmax(logits) (torch.argmax);
//                              a non-finite logit sets the error word
//
// Shape of every projection (one structure, llama_common.cuh's RowStream): a
// warp owns groups of NR weight rows and streams them in chunks of CH 16-byte
// loads per lane per row, two chunks in flight; the first two are issued before
// griddepcontrol.wait (weights never depend on the previous kernel), the
// activation is staged once per CTA in shared memory after the wait (with the
// RMSNorm's weight multiplied in and sum(x^2) taken on the way, as
// kernels/fused.cu measured best), and the epilogue runs per group.  Every
// kernel calls griddepcontrol.launch_dependents first: the next kernel's CTAs
// may start streaming their weights as soon as SMs free up.  Launched without
// PDL the wait is a no-op.
//
// Measurements, and what was tried: docs/llama.md ("Kernel measurements").
//
// Device-side values (token, pos) are read after the wait and bound-checked;
// an out-of-range value writes nothing it would index with and ORs a bit into
// the int32 error word (llama::ERR_TOKEN, llama::ERR_POS), as a non-finite logit
// does (llama::ERR_LOGITS); the word is sticky, the host zeroes it and tests it
// after a generation.
//
// Shapes: K (every row length) a multiple of 8; a K that 256 CH does not divide
// streams a partial last chunk (llama_common.cuh's RowStream), and x is staged
// in dynamic shared memory past 40 KB (llama::x_stage): K up to ~56K.
#include "llama_common.cuh"

using llama::RowStream;

// -- embed_gather --------------------------------------------------------------
// hidden fp32 [D] (B elements a CTA, D = gridDim.x * B), embed bf16 [vocab, D],
// token int32 [1], error int32 [1].  token outside [0, vocab): hidden is left
// as it was and error |= ERR_TOKEN.
template <int B>
__global__ void __launch_bounds__(B / 8)
embed_gather(float* __restrict__ hidden, const __nv_bfloat16* __restrict__ embed, const int* __restrict__ token,
             int* __restrict__ error, int vocab) {
    static_assert(B % 8 == 0 && B <= 8192, "B must be a multiple of 8, at most 8192");
    llama::pdl_launch_dependents();
    llama::pdl_wait();
    const int t = __ldcg(token);
    if (t < 0 || t >= vocab) {
        if (blockIdx.x == 0 && threadIdx.x == 0) atomicOr(error, llama::ERR_TOKEN);
        return;
    }
    const size_t d = (size_t)gridDim.x * B;
    const size_t e = (size_t)blockIdx.x * B + threadIdx.x * 8;
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(embed + (size_t)t * d + e));
    float4* o = reinterpret_cast<float4*>(hidden + e);
    o[0] = make_float4(llama::bf16_lo(v.x), llama::bf16_hi(v.x), llama::bf16_lo(v.y), llama::bf16_hi(v.y));
    o[1] = make_float4(llama::bf16_lo(v.z), llama::bf16_hi(v.z), llama::bf16_lo(v.w), llama::bf16_hi(v.w));
}

// -- rms_qkv_rope ----------------------------------------------------------------
// q fp32 [HQ*HD] (its partition sets the grid: G CTAs), hidden fp32 [K], norm_w
// bf16 [K], w_qkv bf16 [(HQ + 2 HKV) * HD, K] (q, k, v rows), inv_freq fp32
// [HD/2], pos int32 [1], k_cache and v_cache bf16 [HKV, cap, HD] (this layer's
// slices; written), error int32 [1] (written), eps.
// Work unit: a RoPE pair, rows (h*HD + i, h*HD + i + HD/2) of head h, i < HD/2
// (v heads are paired the same way, unrotated); the P = (HQ + 2 HKV) HD / 2 pairs
// are cut into G equal runs, one a CTA, a warp taking every W-th pair of it.
// RoPE (Hugging Face rotate_half): angle = float(pos) * inv_freq[i] in fp32,
// sincosf; q'[i] = q[i] cos - q[i+HD/2] sin, q'[i+HD/2] = q[i+HD/2] cos + q[i] sin.
// pos outside [0, cap): q is still written, k and v are not, error |= ERR_POS.
template <int K, int HD, int HQ, int HKV, int W, int CH, int NB>
__global__ void __launch_bounds__(32 * W, llama::min_ctas(W))
rms_qkv_rope(float* __restrict__ q, const float* __restrict__ hidden, const __nv_bfloat16* __restrict__ norm_w,
             const __nv_bfloat16* __restrict__ w_qkv, const float* __restrict__ inv_freq, const int* __restrict__ pos_p,
             __nv_bfloat16* __restrict__ k_cache, __nv_bfloat16* __restrict__ v_cache, int* __restrict__ error,
             float eps, int cap) {
    static_assert(HD % 2 == 0, "HD must be even");
    constexpr int HALF = HD / 2, P = (HQ + 2 * HKV) * HALF;
    float4 *xlo, *xhi;
    llama::x_stage<K>(xlo, xhi);
    __shared__ float scratch[W];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int per_cta = P / gridDim.x, first = blockIdx.x * per_cta + warp;
    const int groups = warp < per_cta ? (per_cta - warp + W - 1) / W : 0;
    const uint4* w = reinterpret_cast<const uint4*>(w_qkv);
    auto row_ptr = [&](int k, int r) {
        const int p = first + k * W, h = p / HALF, i = p - h * HALF;
        return w + (size_t)(h * HD + i + r * HALF) * (K / 8);
    };
    RowStream<2, CH, K, NB> s;
    llama::StageX<K, 32 * W, true> sx;
    llama::pdl_launch_dependents();
    s.prefetch(row_ptr, groups * s.C, lane);
    sx.load_g(norm_w);
    llama::pdl_wait();
    const int pos = __ldcg(pos_p);
    sx.issue(hidden);
    const float rs = rsqrtf(sx.commit(xlo, xhi, scratch) / K + eps);
    const bool pos_ok = pos >= 0 && pos < cap;
    if (!pos_ok && blockIdx.x == 0 && threadIdx.x == 0) atomicOr(error, llama::ERR_POS);
    auto finish = [&](int k, const float (&acc)[2]) {
        if (lane != 0) return;
        const int p = first + k * W, h = p / HALF, i = p - h * HALF;
        const float x0 = acc[0] * rs, x1 = acc[1] * rs;
        float y0 = x0, y1 = x1;
        if (h < HQ + HKV) {
            float sn, cs;
            sincosf((float)pos * __ldg(inv_freq + i), &sn, &cs);
            y0 = x0 * cs - x1 * sn;
            y1 = x1 * cs + x0 * sn;
        }
        if (h < HQ) {
            q[h * HD + i] = y0;
            q[h * HD + i + HALF] = y1;
        } else if (pos_ok) {
            const bool is_k = h < HQ + HKV;
            __nv_bfloat16* cache = is_k ? k_cache : v_cache;
            const size_t at = ((size_t)(h - HQ - (is_k ? 0 : HKV)) * cap + pos) * HD + i;
            cache[at] = __float2bfloat16_rn(y0);
            cache[at + HALF] = __float2bfloat16_rn(y1);
        }
    };
    s.run(row_ptr, finish, groups * s.C, xlo, xhi, lane);
}

// -- matvec_residual --------------------------------------------------------------
// out fp32 [N] (RPC rows a CTA), x fp32 [K], w bf16 [N, K], residual fp32 [N]:
// out = residual + w @ x.  The W warps are KS slices of W/KS row warps: row warp
// v takes groups of NR consecutive rows, every (W/KS)-th group of its CTA's rows,
// and slice s of it streams columns [s K/KS, (s+1) K/KS) of them (KS > 1 keeps
// more bytes in flight a warp when a CTA has few long rows); the slices' partial
// sums meet in shared memory and are added in slice order after the stream.  The
// residual slice is loaded after the wait beside x, in the same round trip.
template <int K, int NR, int CH, int W, int RPC, int KS, int NB>
__global__ void __launch_bounds__(32 * W, llama::min_ctas(W))
matvec_residual(float* __restrict__ out, const float* __restrict__ x, const __nv_bfloat16* __restrict__ w_,
                const float* __restrict__ residual) {
    static_assert(RPC % NR == 0, "RPC must be a multiple of NR");
    static_assert(KS >= 1 && W % KS == 0 && K % KS == 0, "KS must divide W and K");
    constexpr int G = RPC / NR, WR = W / KS, KP = K / KS, T = 32 * W, RP = (RPC + T - 1) / T;
    float4 *xlo, *xhi;
    llama::x_stage<K>(xlo, xhi);
    __shared__ float res[RPC];
    __shared__ float part[KS > 1 ? KS * RPC : 1];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, slice = warp % KS, rw = warp / KS;
    const int groups = rw < G ? (G - rw + WR - 1) / WR : 0;
    const size_t row0 = (size_t)blockIdx.x * RPC;
    const uint4* w = reinterpret_cast<const uint4*>(w_) + slice * (KP / 8);
    auto row_ptr = [&](int k, int r) { return w + (row0 + (size_t)(rw + k * WR) * NR + r) * (K / 8); };
    RowStream<NR, CH, KP, NB> s;
    llama::StageX<K, T, false> sx;
    llama::pdl_launch_dependents();
    s.prefetch(row_ptr, groups * s.C, lane);
    llama::pdl_wait();
    float rv[RP];
    #pragma unroll
    for (int i = 0; i < RP; ++i) {
        const int at = threadIdx.x + i * T;
        if (RPC % T == 0 || at < RPC) rv[i] = __ldcg(residual + row0 + at);
    }
    sx.issue(x);
    #pragma unroll
    for (int i = 0; i < RP; ++i) {
        const int at = threadIdx.x + i * T;
        if (RPC % T == 0 || at < RPC) res[at] = rv[i];
    }
    sx.commit(xlo, xhi, nullptr);
    auto finish = [&](int k, const float (&acc)[NR]) {
        if (lane < NR) {
            const int local = (rw + k * WR) * NR + lane;
            float v = acc[0];
            #pragma unroll
            for (int r = 1; r < NR; ++r) v = lane == r ? acc[r] : v;
            if (KS == 1) {
                out[row0 + local] = res[local] + v;
            } else {
                part[slice * RPC + local] = v;
            }
        }
    };
    s.run(row_ptr, finish, groups * s.C, xlo + slice * (KP / 8), xhi + slice * (KP / 8), lane);
    if (KS > 1) {
        __syncthreads();
        for (int i = threadIdx.x; i < RPC; i += T) {
            float v = res[i];
            #pragma unroll
            for (int j = 0; j < KS; ++j) v += part[j * RPC + i];
            out[row0 + i] = v;
        }
    }
}

// -- rms_gate_up_silu ----------------------------------------------------------------
// act fp32 [I] (PPC a CTA, I = gridDim.x * PPC), hidden fp32 [K], norm_w bf16 [K],
// w_gate_up bf16 [2I, K] (row j gate j, row I + j up j), eps:
// act[j] = silu(g) * u, g = rs * gate_j . (x * norm_w), u likewise, rs = rsqrt(mean(x^2) + eps).
// A warp streams gate row j and up row j together.
template <int K, int CH, int W, int PPC>
__global__ void __launch_bounds__(32 * W, llama::min_ctas(W))
rms_gate_up_silu(float* __restrict__ act, const float* __restrict__ hidden, const __nv_bfloat16* __restrict__ norm_w,
                 const __nv_bfloat16* __restrict__ w_gate_up, float eps) {
    float4 *xlo, *xhi;
    llama::x_stage<K>(xlo, xhi);
    __shared__ float scratch[W];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int groups = warp < PPC ? (PPC - warp + W - 1) / W : 0;
    const size_t inter = (size_t)gridDim.x * PPC, j0 = (size_t)blockIdx.x * PPC + warp;
    const uint4* w = reinterpret_cast<const uint4*>(w_gate_up);
    auto row_ptr = [&](int k, int r) { return w + (j0 + (size_t)k * W + r * inter) * (K / 8); };
    RowStream<2, CH, K> s;
    llama::StageX<K, 32 * W, true> sx;
    llama::pdl_launch_dependents();
    s.prefetch(row_ptr, groups * s.C, lane);
    sx.load_g(norm_w);
    llama::pdl_wait();
    sx.issue(hidden);
    const float rs = rsqrtf(sx.commit(xlo, xhi, scratch) / K + eps);
    auto finish = [&](int k, const float (&acc)[2]) {
        if (lane == 0) {
            const float g = acc[0] * rs, u = acc[1] * rs;
            act[j0 + (size_t)k * W] = g / (1.f + expf(-g)) * u;
        }
    };
    s.run(row_ptr, finish, groups * s.C, xlo, xhi, lane);
}

// -- rms_lm_head_argmax -----------------------------------------------------------------
// logits fp32 [Vp >= vocab] (RPC rows a CTA; rows >= vocab, the tail of the last
// CTA, get -inf), hidden fp32 [K], norm_w bf16 [K], w bf16 [vocab, K] (the tied
// embedding), token int32 [1] (written), work uint64 [2] (zero before the first
// launch; left zero by each), error int32 [1], eps, vocab.
// logits[v] = rs * w[v] . (x * norm_w); token = the first index of the largest
// logit (NaN counts as largest, like torch.argmax).  Each CTA folds its rows into
// one 64-bit key (llama::argmax_key) and atomicMax-es it into work[0]; the last
// CTA to count itself in work[1] takes the key, writes the token and zeroes both
// words, so that the next launch (a graph replay) starts clean.  A NaN or
// infinite logit (a NaN weight, an overflow) ORs ERR_LOGITS into error: the
// token is still written, and the host refuses the generation.
template <int K, int NR, int CH, int W, int RPC>
__global__ void __launch_bounds__(32 * W, llama::min_ctas(W))
rms_lm_head_argmax(float* __restrict__ logits, const float* __restrict__ hidden,
                   const __nv_bfloat16* __restrict__ norm_w, const __nv_bfloat16* __restrict__ w_,
                   int* __restrict__ token, unsigned long long* __restrict__ work, int* __restrict__ error, float eps,
                   int vocab) {
    static_assert(RPC % NR == 0, "RPC must be a multiple of NR");
    constexpr int G = RPC / NR;
    float4 *xlo, *xhi;
    llama::x_stage<K>(xlo, xhi);
    __shared__ float scratch[W];
    __shared__ unsigned long long best[W];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int groups = warp < G ? (G - warp + W - 1) / W : 0;
    const int row0 = blockIdx.x * RPC;
    const uint4* w = reinterpret_cast<const uint4*>(w_);
    auto row_ptr = [&](int k, int r) {
        const int row = min(row0 + (warp + k * W) * NR + r, vocab - 1);  // the tail reads a valid row
        return w + (size_t)row * (K / 8);
    };
    RowStream<NR, CH, K> s;
    llama::StageX<K, 32 * W, true> sx;
    llama::pdl_launch_dependents();
    s.prefetch(row_ptr, groups * s.C, lane);
    sx.load_g(norm_w);
    llama::pdl_wait();
    sx.issue(hidden);
    const float rs = rsqrtf(sx.commit(xlo, xhi, scratch) / K + eps);
    unsigned long long mine = 0ull;
    bool bad = false;  // a non-finite logit among this lane's rows
    auto finish = [&](int k, const float (&acc)[NR]) {
        if (lane < NR) {
            const int row = row0 + (warp + k * W) * NR + lane;
            float v = acc[0];
            #pragma unroll
            for (int r = 1; r < NR; ++r) v = lane == r ? acc[r] : v;
            v *= rs;
            if (row < vocab) {
                logits[row] = v;
                bad |= !(fabsf(v) <= 3.402823466e38f);  // NaN or +-inf
                const unsigned long long key = llama::argmax_key(v, (unsigned)row);
                mine = key > mine ? key : mine;
            } else {
                logits[row] = __int_as_float(0xff800000);  // -inf
            }
        }
    };
    s.run(row_ptr, finish, groups * s.C, xlo, xhi, lane);
    if (__any_sync(0xffffffffu, bad) && lane == 0) atomicOr(error, llama::ERR_LOGITS);
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned long long other = __shfl_xor_sync(0xffffffffu, mine, o);
        mine = other > mine ? other : mine;
    }
    if (lane == 0) best[warp] = mine;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int i = 1; i < W; ++i) mine = best[i] > mine ? best[i] : mine;
        atomicMax(work, mine);
        __threadfence();
        if (atomicAdd(work + 1, 1ull) == gridDim.x - 1) {  // the last CTA: every key is in
            __threadfence();
            const unsigned long long key = atomicExch(work, 0ull);
            *token = (int)(0xffffffffu - (unsigned)(key & 0xffffffffull));
            atomicExch(work + 1, 0ull);
        }
    }
}
