// Chunked prefill of the Llama decoder: T prompt tokens a pass over the weights.
// Declarations and float64 references: kernels/llama_prefill.py.
//
// The chunk: device-side int32 chunk[3] = [p0, n, cond]: the chunk's first
// position, its valid tokens (1..T; a partial last chunk has fewer) and the
// prefill loop's condition.  Every kernel reads p0 and n from device memory, so
// one captured chunk serves every chunk of a prompt.  Activations are [T, width]
// fp32 row-major, row t = the token at position p0 + t; rows t >= n are
// computed like the others (each row is independent of the others in every
// kernel but attention) and never reach the cache.
//
//   pf_embed<T,B>           hidden[t] = float(embed[tokens[p0 + t]]) (t < n), 0 (t >= n)
//   pf_qkv_rope<K,HD,HQ,HKV,T,PB,WR,WK,NB>
//                           qkv[t] = [rope(q) | rope(k) | v] of RMSNorm(hidden[t]) * norm_w;
//                           k and v of t < n appended (bf16) to the layer's cache at p0 + t
//   pf_attn<HD,G,T,NW>      out[t] = causal GQA attention of query t over cache entries 0..p0+t
//   pf_matmul_residual<K,KC,T,RT,WR,WK,NB>
//                           out[t] = residual[t] + W @ x[t]          (O and down projections)
//   pf_gate_up_silu<K,T,RT,WR,WK,NB>
//                           act[t] = silu(gate . xn[t]) * (up . xn[t]), xn = RMSNorm(hidden[t]) * norm_w
//   prefill_start, prefill_step    the loop's control (one thread)
//   prefill_finish          the last valid row to h_last, and the decode state for the LM head
//
// The projections (one structure, chunk_gemm below): each weight row is read
// once from memory a chunk and multiplied with all T activation rows on the
// tensor cores (mma.sync m16n8k16, bf16 in, fp32 accumulate).  The activations
// are fp32, so each is split into two bf16 terms, hi = bf16(x) and lo =
// bf16(x - hi), and both are multiplied: x is represented to ~2^-17 relative,
// the weights exactly, so the result is fp32-accurate, not bf16-rounded (the
// decode kernels' fp32 dots are the reference).  A CTA owns RT tiles of 16
// weight rows; its W = WR*WK warps split the tiles WR ways and the reduction
// dimension WK ways; partial sums meet in shared memory and are added in warp
// order (deterministic).  The activations are staged in shared memory once per
// CTA (KC columns at a time) as bf16 hi/lo in the mma's B-fragment order; the
// weights stream from global memory straight into A fragments, NB 32-column
// steps in flight a warp, the first NB issued before griddepcontrol.wait.
//
// Fragment order: lane (g = lane/4, c = lane%4) loads 16 bytes (8 consecutive
// columns 8c..8c+7 of a 32-column step) of rows g and g+8 of a tile.  The
// mma's k index is a permutation of the columns (a dot product does not care),
// the same for A and B: in k-step s (0, 1) the lane's A registers are
// (row g, words 2s and 2s+1) and (row g+8, same), its B registers the same
// words of its token's 8 columns.
//
// Measurements, and what was tried: docs/llama.md ("Kernel measurements").
//
// Errors (llama_common.cuh's sticky word): pf_embed ORs ERR_TOKEN for a valid
// row whose token is outside [0, vocab) or whose position is outside the token
// buffer (the row is not written); pf_qkv_rope ORs ERR_POS when a valid row's
// position is outside [0, cap) (nothing of that row is appended); pf_attn
// writes NaN to the rows of such positions, as attn_decode does.
#include <cuda_bf16.h>

#include "llama_common.cuh"

namespace llama_pf {

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

using llama::pdl_launch_dependents;
using llama::pdl_wait;

// the linear CTA index of a grid (x, y) whose y axis counts the tiles of the output's columns
__device__ __forceinline__ int cta_index() { return blockIdx.x * gridDim.y + blockIdx.y; }

__device__ __forceinline__ void mma_bf16(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned word(const uint4& u, int i) {
    return i == 0 ? u.x : i == 1 ? u.y : i == 2 ? u.z : u.w;
}

// two floats as one bf16 pair (the first in the low half: the lower column)
__device__ __forceinline__ unsigned pack2(float a, float b) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const unsigned*>(&v);
}

__device__ __forceinline__ void unpack8(const uint4& u, float* f) {
    f[0] = llama::bf16_lo(u.x); f[1] = llama::bf16_hi(u.x); f[2] = llama::bf16_lo(u.y); f[3] = llama::bf16_hi(u.y);
    f[4] = llama::bf16_lo(u.z); f[5] = llama::bf16_hi(u.z); f[6] = llama::bf16_lo(u.w); f[7] = llama::bf16_hi(u.w);
}

__device__ __forceinline__ float rest(float x) { return x - __bfloat162float(__float2bfloat16_rn(x)); }

// Stage columns [k0, k0 + KC) of the T rows of x [T, K] (times the norm weight g when NORM)
// into hi/lo B fragments: for 32-column step j and token t, the 16 bytes of column group c
// (8 columns) at hi[(j*T + t)*4 + c] (lo likewise).  A warp stages 8 rows at once (lane: row
// lane/4, group lane%4), so its 32 stores are 512 contiguous bytes (no bank conflict); the
// W/(T/8) warps of a row group take every (W/(T/8))-th step.  With NORM each warp leaves its
// partial sum(x^2) of its 8 rows in ss[warp*8 + row] (row_ss adds them; K == KC: whole rows).
template <int K, int KC, int T, int W, bool NORM>
__device__ __forceinline__ void stage_x(uint4* hi, uint4* lo, float* ss, const float* __restrict__ x, int k0,
                                        const __nv_bfloat16* __restrict__ g) {
    constexpr int RG = T / 8, KSN = W / RG, KB = KC / 32;
    static_assert(W % RG == 0, "the warps must cover the T/8 row groups evenly");
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int t = (warp % RG) * 8 + (lane >> 2), c = lane & 3;
    const float* xr = x + (size_t)t * K + k0 + 8 * c;
    float s = 0.f;
    #pragma unroll 4
    for (int kb = warp / RG; kb < KB; kb += KSN) {
        const float4* x4 = reinterpret_cast<const float4*>(xr + kb * 32);
        float4 a = __ldcg(x4), b = __ldcg(x4 + 1);
        if (NORM) {
            s += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w + b.x * b.x + b.y * b.y + b.z * b.z + b.w * b.w;
            const uint4 gv = __ldg(reinterpret_cast<const uint4*>(g + k0 + kb * 32 + 8 * c));
            a = make_float4(a.x * llama::bf16_lo(gv.x), a.y * llama::bf16_hi(gv.x), a.z * llama::bf16_lo(gv.y),
                            a.w * llama::bf16_hi(gv.y));
            b = make_float4(b.x * llama::bf16_lo(gv.z), b.y * llama::bf16_hi(gv.z), b.z * llama::bf16_lo(gv.w),
                            b.w * llama::bf16_hi(gv.w));
        }
        const int at = (kb * T + t) * 4 + c;
        hi[at] = make_uint4(pack2(a.x, a.y), pack2(a.z, a.w), pack2(b.x, b.y), pack2(b.z, b.w));
        lo[at] = make_uint4(pack2(rest(a.x), rest(a.y)), pack2(rest(a.z), rest(a.w)), pack2(rest(b.x), rest(b.y)),
                            pack2(rest(b.z), rest(b.w)));
    }
    if (NORM) {
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        s += __shfl_xor_sync(0xffffffffu, s, 2);
        if (c == 0) ss[warp * 8 + (lane >> 2)] = s;
    }
}

// sum(x^2) of row t from stage_x's per-warp partials, added in warp order (deterministic)
template <int T, int W>
__device__ __forceinline__ float row_ss(const float* ss, int t) {
    constexpr int RG = T / 8;
    float v = 0.f;
    #pragma unroll
    for (int k = 0; k < W / RG; ++k) v += ss[(k * RG + t / 8) * 8 + t % 8];
    return v;
}

// The CTA's RT*16 weight rows times the T staged activation rows, reduced over all of K.
// rowbase(rt): the first weight row of tile rt (its rows are rowbase .. rowbase + 15).
// Result: red[(wk*R + r)*T + t] = the partial sum of warp slice wk for CTA row r
// (r = rt*16 + row in tile) and token t; the caller adds the WK slices (after the
// __syncthreads at the end).  smem: hi, lo [KC*T/8 uint4 each], ss [8 W] (NORM).
template <int K, int KC, int T, int RT, int WR, int WK, int NB, bool NORM, class RowBase>
__device__ __forceinline__ void chunk_gemm(float* red, float* ss, uint4* hi, uint4* lo, const float* __restrict__ x,
                                           const __nv_bfloat16* __restrict__ g, const __nv_bfloat16* __restrict__ w,
                                           const RowBase& rowbase) {
    static_assert(T % 8 == 0, "T must be a multiple of 8");
    static_assert(RT % WR == 0, "WR must divide RT");
    static_assert(K % KC == 0 && KC % (32 * WK) == 0, "KC must divide K and be a multiple of 32*WK");
    static_assert(!NORM || KC == K, "the RMSNorm needs the whole row staged at once (KC == K)");
    constexpr int W = WR * WK, NT = T / 8, RW = RT / WR, R = RT * 16;
    constexpr int KBW = KC / 32 / WK;           // 32-column steps a warp takes in a slice
    constexpr int ITEMS = (K / KC) * KBW;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int wr = warp % WR, wk = warp / WR;
    const int gq = lane >> 2, c = lane & 3;
    const uint4* w4 = reinterpret_cast<const uint4*>(w);

    int base[RW];
    #pragma unroll
    for (int i = 0; i < RW; ++i) base[i] = rowbase(wr + i * WR);

    auto load = [&](uint4 (&t)[RW][2], int item) {
        const int s = item / KBW, j = item - s * KBW;
        const int col = s * KC + (wk * KBW + j) * 32 + 8 * c;
        #pragma unroll
        for (int i = 0; i < RW; ++i) {
            const uint4* p = w4 + ((size_t)(base[i] + gq) * K + col) / 8;
            t[i][0] = __ldcs(p);
            t[i][1] = __ldcs(p + (size_t)K);  // row + 8: 8 rows of K/8 vectors further
        }
    };

    float acc[RW][NT][4];
    #pragma unroll
    for (int i = 0; i < RW; ++i)
        #pragma unroll
        for (int n = 0; n < NT; ++n)
            #pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][n][e] = 0.f;

    uint4 buf[NB][RW][2];
    #pragma unroll
    for (int b = 0; b < NB; ++b)
        if (b < ITEMS) load(buf[b], b);
    pdl_wait();
    stage_x<K, KC, T, W, NORM>(hi, lo, ss, x, 0, g);
    __syncthreads();

    auto compute = [&](const uint4 (&t)[RW][2], int item) {
        const int s = item / KBW, j = item - s * KBW;
        const int kb = wk * KBW + j;
        uint4 bh[NT], bl[NT];
        #pragma unroll
        for (int n = 0; n < NT; ++n) {
            const int at = (kb * T + n * 8 + gq) * 4 + c;
            bh[n] = hi[at];
            bl[n] = lo[at];
        }
        #pragma unroll
        for (int i = 0; i < RW; ++i)
            #pragma unroll
            for (int st = 0; st < 2; ++st) {
                const unsigned a0 = word(t[i][0], 2 * st), a1 = word(t[i][1], 2 * st);
                const unsigned a2 = word(t[i][0], 2 * st + 1), a3 = word(t[i][1], 2 * st + 1);
                #pragma unroll
                for (int n = 0; n < NT; ++n) {
                    mma_bf16(acc[i][n], a0, a1, a2, a3, word(bh[n], 2 * st), word(bh[n], 2 * st + 1));
                    mma_bf16(acc[i][n], a0, a1, a2, a3, word(bl[n], 2 * st), word(bl[n], 2 * st + 1));
                }
            }
    };

    #pragma unroll 1
    for (int it = 0; it < ITEMS; it += NB) {
        #pragma unroll
        for (int b = 0; b < NB; ++b) {
            const int item = it + b;
            if (item < ITEMS) {
                if (K != KC && item % KBW == 0 && item > 0) {  // the next slice of x (every warp in step)
                    __syncthreads();
                    stage_x<K, KC, T, W, false>(hi, lo, ss, x, (item / KBW) * KC, g);
                    __syncthreads();
                }
                compute(buf[b], item);
                if (item + NB < ITEMS) load(buf[b], item + NB);
            }
        }
    }

    // C fragment: (row gq, tokens 2c, 2c+1) and (row gq + 8, same) of tile i, token tile n
    #pragma unroll
    for (int i = 0; i < RW; ++i) {
        const int r = (wr + i * WR) * 16 + gq;
        #pragma unroll
        for (int n = 0; n < NT; ++n) {
            const int t = n * 8 + 2 * c;
            red[(wk * R + r) * T + t] = acc[i][n][0];
            red[(wk * R + r) * T + t + 1] = acc[i][n][1];
            red[(wk * R + r + 8) * T + t] = acc[i][n][2];
            red[(wk * R + r + 8) * T + t + 1] = acc[i][n][3];
        }
    }
    __syncthreads();
}

template <int WK, int R, int T>
__device__ __forceinline__ float reduced(const float* red, int r, int t) {
    float v = 0.f;
    #pragma unroll
    for (int k = 0; k < WK; ++k) v += red[(k * R + r) * T + t];
    return v;
}

// dynamic shared memory layout of the projections: hi, lo, red, ss
template <int KC, int T>
__device__ __forceinline__ void smem_parts(uint4*& hi, uint4*& lo, float*& red, float*& ss, int red_floats) {
    extern __shared__ uint4 smem[];
    hi = smem;
    lo = smem + KC * T / 8;
    red = reinterpret_cast<float*>(lo + KC * T / 8);
    ss = red + red_floats;
}

__device__ __forceinline__ void read_chunk(const int* chunk, int T, int& p0, int& n) {
    p0 = __ldcg(chunk);
    n = min(max(__ldcg(chunk + 1), 0), T);
}

}  // namespace llama_pf

// -- pf_embed -------------------------------------------------------------------------------
// hidden fp32 [T, D] (tile [T, B]: grid (1, D/B)), embed bf16 [vocab, D], tokens int32 [ntok],
// chunk int32 [3], error int32 [1], vocab, ntok.  Row t < n: embed[tokens[p0 + t]]; a token or a
// position out of range leaves the row unwritten and ORs ERR_TOKEN.  Rows t >= n: zero.
template <int T, int B>
__global__ void __launch_bounds__(B / 8)
pf_embed(float* __restrict__ hidden, const __nv_bfloat16* __restrict__ embed, const int* __restrict__ tokens,
         const int* __restrict__ chunk, int* __restrict__ error, int vocab, int ntok) {
    static_assert(B % 8 == 0 && B <= 8192, "B must be a multiple of 8, at most 8192");
    llama_pf::pdl_launch_dependents();
    llama_pf::pdl_wait();
    int p0, n;
    llama_pf::read_chunk(chunk, T, p0, n);
    const size_t d = (size_t)gridDim.y * B;
    const size_t e = (size_t)blockIdx.y * B + threadIdx.x * 8;
    for (int t = 0; t < T; ++t) {
        float4* o = reinterpret_cast<float4*>(hidden + t * d + e);
        if (t >= n) {
            o[0] = o[1] = make_float4(0.f, 0.f, 0.f, 0.f);
            continue;
        }
        const int p = p0 + t;
        const int tok = p >= 0 && p < ntok ? __ldcg(tokens + p) : -1;
        if (tok < 0 || tok >= vocab) {
            if (blockIdx.y == 0 && threadIdx.x == 0) atomicOr(error, llama::ERR_TOKEN);
            continue;
        }
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(embed + (size_t)tok * d + e));
        o[0] = make_float4(llama::bf16_lo(v.x), llama::bf16_hi(v.x), llama::bf16_lo(v.y), llama::bf16_hi(v.y));
        o[1] = make_float4(llama::bf16_lo(v.z), llama::bf16_hi(v.z), llama::bf16_lo(v.w), llama::bf16_hi(v.w));
    }
}

// -- pf_qkv_rope -------------------------------------------------------------------------------
// qkv fp32 [T, (HQ + 2 HKV) HD] (tile [T, 32 PB]: one CTA a tile), hidden fp32 [T, K], norm_w bf16
// [K], w_qkv bf16 [(HQ + 2 HKV) HD, K], inv_freq fp32 [HD/2], chunk int32 [3], k_cache and v_cache
// bf16 [HKV, cap, HD] (this layer's; written), error int32 [1] (written), eps, cap.
// CTA b owns PB blocks of 16 RoPE pairs (rows h*HD + i and h*HD + i + HD/2 of head h, i < HD/2,
// for 16 consecutive i): tile 2j holds block j's first rows, tile 2j+1 its second.  Epilogue:
// y = rs_t * (w . (x_t * norm_w)), rotated (q and k heads) by the angle float(p0 + t) * inv_freq[i]
// (sincosf, Hugging Face's rotate_half); every row t is written to qkv, rows t < n with
// p0 + t in [0, cap) also to the cache at p0 + t.
template <int K, int HD, int HQ, int HKV, int T, int PB, int WR, int WK, int NB>
__global__ void __launch_bounds__(32 * WR * WK, 1)
pf_qkv_rope(float* __restrict__ qkv, const float* __restrict__ hidden, const __nv_bfloat16* __restrict__ norm_w,
            const __nv_bfloat16* __restrict__ w_qkv, const float* __restrict__ inv_freq,
            const int* __restrict__ chunk, __nv_bfloat16* __restrict__ k_cache, __nv_bfloat16* __restrict__ v_cache,
            int* __restrict__ error, float eps, int cap) {
    static_assert(HD % 32 == 0, "HD/2 must be a multiple of 16 (a tile of pairs)");
    constexpr int HALF = HD / 2, RT = 2 * PB, R = RT * 16, WIDTH = (HQ + 2 * HKV) * HD, NTH = 32 * WR * WK;
    const int b0 = llama_pf::cta_index() * PB;  // the CTA's first pair block
    uint4 *hi, *lo;
    float *red, *ss;
    llama_pf::smem_parts<K, T>(hi, lo, red, ss, WK * R * T);
    llama_pf::pdl_launch_dependents();
    auto rowbase = [&](int rt) {
        const int p = (b0 + rt / 2) * 16, h = p / HALF, i = p - h * HALF;
        return h * HD + i + (rt & 1) * HALF;
    };
    llama_pf::chunk_gemm<K, K, T, RT, WR, WK, NB, true>(red, ss, hi, lo, hidden, norm_w, w_qkv, rowbase);
    int p0, n;
    llama_pf::read_chunk(chunk, T, p0, n);
    if (llama_pf::cta_index() == 0 && threadIdx.x == 0 && n > 0 && (p0 < 0 || p0 + n > cap))
        atomicOr(error, llama::ERR_POS);
    for (int e = threadIdx.x; e < PB * 16 * T; e += NTH) {
        const int t = e / (PB * 16), lp = e - t * (PB * 16), j = lp / 16, r = lp % 16;
        const float rs = rsqrtf(llama_pf::row_ss<T, WR * WK>(ss, t) / K + eps);
        const float x0 = llama_pf::reduced<WK, R, T>(red, 2 * j * 16 + r, t) * rs;
        const float x1 = llama_pf::reduced<WK, R, T>(red, (2 * j + 1) * 16 + r, t) * rs;
        const int p = (b0 + j) * 16 + r, h = p / HALF, i = p - h * HALF;
        const int pos = p0 + t;
        float y0 = x0, y1 = x1;
        if (h < HQ + HKV) {
            float sn, cs;
            sincosf((float)pos * __ldg(inv_freq + i), &sn, &cs);
            y0 = x0 * cs - x1 * sn;
            y1 = x1 * cs + x0 * sn;
        }
        float* row = qkv + (size_t)t * WIDTH + h * HD + i;
        row[0] = y0;
        row[HALF] = y1;
        if (h >= HQ && t < n && pos >= 0 && pos < cap) {
            const bool is_k = h < HQ + HKV;
            __nv_bfloat16* cache = is_k ? k_cache : v_cache;
            const size_t at = ((size_t)(h - HQ - (is_k ? 0 : HKV)) * cap + pos) * HD + i;
            cache[at] = __float2bfloat16_rn(y0);
            cache[at + HALF] = __float2bfloat16_rn(y1);
        }
    }
}

// -- pf_attn ----------------------------------------------------------------------------------
// out fp32 [T, HKV*G*HD] (tile [1, G*HD]: grid (T, HKV), CTA (t, h)), qkv fp32 [T, (HKV*G + 2 HKV) HD]
// (q of token t at row t, head j at j*HD), k and v bf16 [HKV, cap, HD] (this layer's), chunk int32
// [3], cap.  Row t < n: out[t, j] = sum_{s <= p0+t} softmax_s(q_tj . k[j/G, s] / sqrt(HD)) v[j/G, s]
// for the G query heads j of KV head h; a position outside [0, cap): NaN.  Rows t >= n: 0.
// NW warps split the entries (each lane group of HD/8 lanes one entry, every query head of the
// group at once: K and V rows read once a CTA); per-lane online softmax, merged over lanes and warps.
// Everything is read after griddepcontrol.wait: the entries of this chunk were just appended.
template <int HD, int G, int T, int NW>
__global__ void __launch_bounds__(32 * NW)
pf_attn(float* __restrict__ out, const float* __restrict__ qkv, const __nv_bfloat16* __restrict__ kc,
        const __nv_bfloat16* __restrict__ vc, const int* __restrict__ chunk, int cap) {
    static_assert(HD == 64 || HD == 128, "head dim 64 or 128");
    static_assert(G >= 1 && G <= 8, "1 to 8 query heads per KV head");
    constexpr int LP = HD / 8, PPW = 32 / LP, NTH = 32 * NW;
    constexpr float LOG2E = 1.4426950408889634f;
    __shared__ float s_acc[NW][G][HD];
    __shared__ float s_m[NW][G], s_l[NW][G];
    const int t = blockIdx.x, h = blockIdx.y, hkv = gridDim.y;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, dl = lane % LP, pg = lane / LP;
    const int qw = (hkv * G + 2 * hkv) * HD;
    float* o = out + (size_t)t * hkv * G * HD + (size_t)h * G * HD;
    llama_pf::pdl_launch_dependents();
    llama_pf::pdl_wait();
    int p0, n;
    llama_pf::read_chunk(chunk, T, p0, n);
    if (t >= n) {
        for (int i = tid; i < G * HD; i += NTH) o[i] = 0.f;
        return;
    }
    const int pos = p0 + t;
    if (pos < 0 || pos >= cap) {
        for (int i = tid; i < G * HD; i += NTH) o[i] = __int_as_float(0x7fc00000);
        return;
    }
    const float qs = rsqrtf((float)HD) * LOG2E;  // scores in log2 units
    float qr[G][8], acc[G][8], m[G], l[G];
    #pragma unroll
    for (int g = 0; g < G; ++g) {
        const float4* q4 = reinterpret_cast<const float4*>(qkv + (size_t)t * qw + (h * G + g) * HD + dl * 8);
        const float4 a = __ldcg(q4), b = __ldcg(q4 + 1);
        qr[g][0] = a.x * qs; qr[g][1] = a.y * qs; qr[g][2] = a.z * qs; qr[g][3] = a.w * qs;
        qr[g][4] = b.x * qs; qr[g][5] = b.y * qs; qr[g][6] = b.z * qs; qr[g][7] = b.w * qs;
        m[g] = -INFINITY;
        l[g] = 0.f;
        #pragma unroll
        for (int e = 0; e < 8; ++e) acc[g][e] = 0.f;
    }
    const uint4* kh = reinterpret_cast<const uint4*>(kc + (size_t)h * cap * HD);
    const uint4* vh = reinterpret_cast<const uint4*>(vc + (size_t)h * cap * HD);
    // a warp-uniform trip count (the shuffles need every lane); a lane group past pos skips the update
    #pragma unroll 4
    for (int s0 = warp * PPW; s0 <= pos; s0 += NW * PPW) {
        const int s = s0 + pg;
        const bool in = s <= pos;
        const uint4 ku = in ? __ldcg(kh + (size_t)s * LP + dl) : make_uint4(0, 0, 0, 0);
        const uint4 vu = in ? __ldcg(vh + (size_t)s * LP + dl) : make_uint4(0, 0, 0, 0);
        float kf[8], vf[8];
        llama_pf::unpack8(ku, kf);
        llama_pf::unpack8(vu, vf);
        #pragma unroll
        for (int g = 0; g < G; ++g) {
            float d = 0.f;
            #pragma unroll
            for (int e = 0; e < 8; ++e) d = fmaf(qr[g][e], kf[e], d);
            #pragma unroll
            for (int x = LP / 2; x > 0; x >>= 1) d += __shfl_xor_sync(0xffffffffu, d, x);
            if (!in) continue;
            const float mn = fmaxf(m[g], d);
            const float a = m[g] == -INFINITY ? 0.f : exp2f(m[g] - mn), p = exp2f(d - mn);
            l[g] = l[g] * a + p;
            #pragma unroll
            for (int e = 0; e < 8; ++e) acc[g][e] = fmaf(p, vf[e], acc[g][e] * a);
            m[g] = mn;
        }
    }
    // the lane groups of a warp (LP lanes apart), then the warps through shared memory
    #pragma unroll
    for (int g = 0; g < G; ++g) {
        #pragma unroll
        for (int x = LP; x < 32; x <<= 1) {
            const float m2 = __shfl_xor_sync(0xffffffffu, m[g], x), l2 = __shfl_xor_sync(0xffffffffu, l[g], x);
            const float mn = fmaxf(m[g], m2);
            const float a = m[g] == -INFINITY ? 0.f : exp2f(m[g] - mn);
            const float b = m2 == -INFINITY ? 0.f : exp2f(m2 - mn);
            l[g] = l[g] * a + l2 * b;
            #pragma unroll
            for (int e = 0; e < 8; ++e) {
                const float x2 = __shfl_xor_sync(0xffffffffu, acc[g][e], x);
                acc[g][e] = acc[g][e] * a + x2 * b;
            }
            m[g] = mn;
        }
        if (pg == 0) {
            #pragma unroll
            for (int e = 0; e < 8; ++e) s_acc[warp][g][dl * 8 + e] = acc[g][e];
            if (dl == 0) {
                s_m[warp][g] = m[g];
                s_l[warp][g] = l[g];
            }
        }
    }
    __syncthreads();
    for (int i = tid; i < G * HD; i += NTH) {
        const int g = i / HD, d = i % HD;
        float mn = -INFINITY;
        #pragma unroll
        for (int w = 0; w < NW; ++w) mn = fmaxf(mn, s_m[w][g]);
        float lsum = 0.f, a = 0.f;
        #pragma unroll
        for (int w = 0; w < NW; ++w) {
            const float f = s_m[w][g] == -INFINITY ? 0.f : exp2f(s_m[w][g] - mn);
            lsum += s_l[w][g] * f;
            a += s_acc[w][g][d] * f;
        }
        o[i] = a / lsum;
    }
}

// -- pf_matmul_residual -------------------------------------------------------------------------
// out fp32 [T, N] (tile [T, 16 RT]), x fp32 [T, K], w bf16 [N, K], residual fp32 [T, N]:
// out[t] = residual[t] + w @ x[t].  x is staged KC columns at a time (K = 8192 does not fit at once).
template <int K, int KC, int T, int RT, int WR, int WK, int NB>
__global__ void __launch_bounds__(32 * WR * WK, 1)
pf_matmul_residual(float* __restrict__ out, const float* __restrict__ x, const __nv_bfloat16* __restrict__ w,
                   const float* __restrict__ residual) {
    constexpr int R = RT * 16, NTH = 32 * WR * WK;
    const int row0 = llama_pf::cta_index() * R;
    const int nrows = gridDim.x * gridDim.y * R;
    uint4 *hi, *lo;
    float *red, *ss;
    llama_pf::smem_parts<KC, T>(hi, lo, red, ss, WK * R * T);
    llama_pf::pdl_launch_dependents();
    auto rowbase = [&](int rt) { return row0 + rt * 16; };
    llama_pf::chunk_gemm<K, KC, T, RT, WR, WK, NB, false>(red, ss, hi, lo, x, nullptr, w, rowbase);
    for (int e = threadIdx.x; e < R * T; e += NTH) {
        const int t = e / R, r = e - t * R;
        const size_t at = (size_t)t * nrows + row0 + r;
        out[at] = __ldcg(residual + at) + llama_pf::reduced<WK, R, T>(red, r, t);
    }
}

// -- pf_gate_up_silu ---------------------------------------------------------------------------
// act fp32 [T, I] (tile [T, 8 RT]: the CTA's PPC = 8 RT gate/up pairs), hidden fp32 [T, K], norm_w
// bf16 [K], w_gate_up bf16 [2I, K] (row j gate j, row I + j up j), eps:
// act[t, j] = silu(gate_j . xn_t) * (up_j . xn_t), xn_t = rs_t * hidden[t] * norm_w.
// Tiles 0 .. RT/2-1 hold the CTA's gate rows, tiles RT/2 .. RT-1 its up rows.
template <int K, int T, int RT, int WR, int WK, int NB>
__global__ void __launch_bounds__(32 * WR * WK, 1)
pf_gate_up_silu(float* __restrict__ act, const float* __restrict__ hidden, const __nv_bfloat16* __restrict__ norm_w,
                const __nv_bfloat16* __restrict__ w_gate_up, float eps) {
    static_assert(RT % 2 == 0, "RT must be even (gate tiles, then as many up tiles)");
    constexpr int R = RT * 16, PPC = R / 2, NTH = 32 * WR * WK;
    const int j0 = llama_pf::cta_index() * PPC;
    const int inter = gridDim.x * gridDim.y * PPC;
    uint4 *hi, *lo;
    float *red, *ss;
    llama_pf::smem_parts<K, T>(hi, lo, red, ss, WK * R * T);
    llama_pf::pdl_launch_dependents();
    auto rowbase = [&](int rt) { return rt < RT / 2 ? j0 + rt * 16 : inter + j0 + (rt - RT / 2) * 16; };
    llama_pf::chunk_gemm<K, K, T, RT, WR, WK, NB, true>(red, ss, hi, lo, hidden, norm_w, w_gate_up, rowbase);
    for (int e = threadIdx.x; e < PPC * T; e += NTH) {
        const int t = e / PPC, j = e - t * PPC;
        const float rs = rsqrtf(llama_pf::row_ss<T, WR * WK>(ss, t) / K + eps);
        const float g = llama_pf::reduced<WK, R, T>(red, j, t) * rs;
        const float u = llama_pf::reduced<WK, R, T>(red, PPC + j, t) * rs;
        act[(size_t)t * inter + j0 + j] = g / (1.f + expf(-g)) * u;
    }
}

// -- control ------------------------------------------------------------------------------------
// chunk = [0, min(T, prompt_len), 1]: the first chunk.
extern "C" __global__ void prefill_start(int* __restrict__ chunk, int prompt_len, int chunk_len) {
    llama_pf::pdl_wait();
    chunk[0] = 0;
    chunk[1] = min(chunk_len, prompt_len);
    chunk[2] = 1;
}

// After a chunk: the next one ([p0 + T, min(T, prompt_len - p0 - T), 1]), or, after the last,
// cond = 0 with p0 and n left as they were (prefill_finish reads the last chunk's n).
extern "C" __global__ void prefill_step(int* __restrict__ chunk, int prompt_len, int chunk_len) {
    llama_pf::pdl_wait();
    const int next = chunk[0] + chunk_len;
    if (next < prompt_len) {
        chunk[0] = next;
        chunk[1] = min(chunk_len, prompt_len - next);
    } else {
        chunk[2] = 0;
    }
}

// h_last fp32 [D] (one CTA) = hidden[n - 1] of the last chunk (NaN when n is outside [1, T]), and the
// decode state [pos, cond, cur, generated] = [prompt_len - 1, 1, tokens[prompt_len - 1], 0]: the LM
// head and the control step (llama_step) that follow then append the first generated token at
// prompt_len exactly as after the token-by-token ingestion of the prompt's last token.
template <int T>
__global__ void __launch_bounds__(256)
prefill_finish(float* __restrict__ h_last, const float* __restrict__ hidden, const int* __restrict__ chunk,
               int* __restrict__ state, const int* __restrict__ tokens, int prompt_len, int d) {
    llama_pf::pdl_launch_dependents();
    llama_pf::pdl_wait();
    const int n = __ldcg(chunk + 1);
    const bool ok = n >= 1 && n <= T;
    for (int i = threadIdx.x; i < d; i += blockDim.x)
        h_last[i] = ok ? __ldcg(hidden + (size_t)(n - 1) * d + i) : __int_as_float(0x7fc00000);
    if (threadIdx.x == 0) {
        state[0] = prompt_len - 1;
        state[1] = 1;
        state[2] = __ldcg(tokens + prompt_len - 1);
        state[3] = 0;
    }
}
