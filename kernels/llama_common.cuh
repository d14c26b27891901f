// Shared device helpers of the Llama decode kernels: PDL, warp reductions,
// bf16 16-byte weight loads and the streaming row loop of the projections.
#pragma once
#include <cuda_bf16.h>

#include <deviceop/pdl.cuh>

namespace llama {

// Error bits of the int32 error word the kernels OR into (sticky: the host zeroes it).
constexpr int ERR_TOKEN = 1;   // embed_gather: token < 0 or >= vocab (hidden not written)
constexpr int ERR_POS = 2;     // rms_qkv_rope: pos < 0 or >= cap (k and v not appended)
constexpr int ERR_LOGITS = 4;  // rms_lm_head_argmax: a logit is NaN or infinite (the token is not valid)

// CTAs of W warps a SM the register budget is sized for: 16 warps (<= 128
// registers a thread) keep every CTA of a one-wave grid resident at once.
__host__ __device__ constexpr int min_ctas(int w) { return w >= 16 ? 1 : 16 / w; }

using ::pdl_launch_dependents;  // deviceop/pdl.cuh
using ::pdl_wait;

__device__ __forceinline__ float warp_sum(float v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float bf16_lo(unsigned u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float bf16_hi(unsigned u) { return __uint_as_float(u & 0xffff0000u); }

// 8 bf16 weights (one 16-byte load) times 8 floats (lo: elements 0-3, hi: 4-7).
__device__ __forceinline__ float dot8(const uint4& w, const float4& lo, const float4& hi, float acc) {
    acc = fmaf(bf16_lo(w.x), lo.x, acc);
    acc = fmaf(bf16_hi(w.x), lo.y, acc);
    acc = fmaf(bf16_lo(w.y), lo.z, acc);
    acc = fmaf(bf16_hi(w.y), lo.w, acc);
    acc = fmaf(bf16_lo(w.z), hi.x, acc);
    acc = fmaf(bf16_hi(w.z), hi.y, acc);
    acc = fmaf(bf16_lo(w.w), hi.z, acc);
    acc = fmaf(bf16_hi(w.w), hi.w, acc);
    return acc;
}

// The activation vector x [K] staged once per CTA of T threads in shared memory,
// split so that a warp's 32 lanes read 32 consecutive float4 (no bank
// conflicts): for the 8 elements of 16-byte group q, lo[q] holds 0-3 and hi[q]
// 4-7.  With a norm weight g, the stage holds x * g and commit() returns
// sum(x^2) over the CTA (for the RMSNorm).  In three steps, because everything
// after griddepcontrol.wait is on the critical path between two kernels:
// load_g() before the wait (g is a weight); issue() right after it, every load
// of x issued before any is used (one L2 round trip, not one per loop trip; the
// caller issues its other post-wait loads beside them); commit() stores,
// synchronises the CTA and reduces.  x is read through L2 (ld.cg): the previous
// kernel wrote it while this one ran.
template <int K, int T, bool NORM>
struct StageX {
    static constexpr int Q = K / 8, PER = (Q + T - 1) / T;
    uint4 g[NORM ? PER : 1];
    float4 a[PER], b[PER];

    __device__ __forceinline__ static bool mine(int i) { return Q % T == 0 || (int)threadIdx.x + i * T < Q; }

    __device__ __forceinline__ void load_g(const __nv_bfloat16* __restrict__ gw) {
        if (NORM) {
            #pragma unroll
            for (int i = 0; i < PER; ++i)
                if (mine(i)) g[i] = __ldg(reinterpret_cast<const uint4*>(gw) + threadIdx.x + i * T);
        }
    }

    __device__ __forceinline__ void issue(const float* __restrict__ x) {
        const float4* x4 = reinterpret_cast<const float4*>(x);
        #pragma unroll
        for (int i = 0; i < PER; ++i) {
            if (mine(i)) {
                const int q = threadIdx.x + i * T;
                a[i] = __ldcg(x4 + 2 * q);
                b[i] = __ldcg(x4 + 2 * q + 1);
            }
        }
    }

    __device__ __forceinline__ float commit(float4* lo, float4* hi, float* scratch) {
        float ss = 0.f;
        #pragma unroll
        for (int i = 0; i < PER; ++i) {
            if (!mine(i)) continue;
            float4 u = a[i], v = b[i];
            if (NORM) {
                const uint4 gv = g[i];
                ss += u.x * u.x + u.y * u.y + u.z * u.z + u.w * u.w + v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
                u = make_float4(u.x * bf16_lo(gv.x), u.y * bf16_hi(gv.x), u.z * bf16_lo(gv.y), u.w * bf16_hi(gv.y));
                v = make_float4(v.x * bf16_lo(gv.z), v.y * bf16_hi(gv.z), v.z * bf16_lo(gv.w), v.w * bf16_hi(gv.w));
            }
            const int q = threadIdx.x + i * T;
            lo[q] = u;
            hi[q] = v;
        }
        if (NORM) {
            ss = warp_sum(ss);
            if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = ss;
        }
        __syncthreads();
        float total = 0.f;
        if (NORM) {
            #pragma unroll
            for (int i = 0; i < T / 32; ++i) total += scratch[i];
        }
        return total;
    }
};

// Where a projection stages x (xlo and xhi, 4 K bytes together): static shared
// memory up to X_STATIC_MAX bytes, the kernel's dynamic shared memory beyond it
// (the declaration asks for 4 K bytes then, and the launch opts in past 48 KB),
// so that K is bounded by the 227 KB a CTA may have on sm_90, not by the 48 KB
// of static shared memory (Llama-3.1-8B's down projection: K = 14336, 56 KB).
constexpr int X_STATIC_MAX = 40 * 1024;

template <int K>
__device__ __forceinline__ void x_stage(float4*& lo, float4*& hi) {
    if constexpr (4 * K > X_STATIC_MAX) {
        extern __shared__ float4 x_dynamic[];
        lo = x_dynamic;
        hi = x_dynamic + K / 8;
    } else {
        __shared__ float4 x_lo[K / 8], x_hi[K / 8];
        lo = x_lo;
        hi = x_hi;
    }
}

// A warp streams the rows of its groups (NR rows each, dotted with x together)
// chunk by chunk: CH 16-byte loads per lane per row per chunk, C = ceil(K / (256 CH))
// chunks per row (K: the length of the row segment a warp streams, a multiple of
// 8).  When 256 CH does not divide K (TAIL: SmolLM2's 576), the last chunk is
// partial: a lane past the row loads no weights and reads no x (both count as
// zero); otherwise the guards are compile-time true and vanish.  NB register
// buffers rotate: the loads of item t+NB are issued as soon as item t is
// consumed, so NB-1 to NB items are always in flight.  prefetch() issues the
// first NB items; a kernel calls it before griddepcontrol.wait (weights never
// depend on the previous kernel) and run() after staging x.  RowPtr(k, r): the
// first 16-byte vector of row r of the warp's k-th group; Finish(k, acc): the
// warp-reduced dot products of group k (every lane holds them).  lo/hi: the
// staged x at the segment's first element.
template <int NR, int CH, int K, int NB = 2>
struct RowStream {
    static_assert(K % 8 == 0 && K > 0, "K must be a positive multiple of 8 (16-byte loads of bf16)");
    static_assert(NB >= 1 && NB <= 8, "NB must be in [1, 8]");
    static constexpr int Q = K / 8;                         // 16-byte vectors of a row segment
    static constexpr int C = (Q + CH * 32 - 1) / (CH * 32);
    static constexpr bool TAIL = Q % (CH * 32) != 0;
    uint4 buf[NB][NR][CH];

    // vector q of the segment exists (always, unless TAIL)
    __device__ __forceinline__ static bool in_row(int q) { return !TAIL || q < Q; }

    template <class RowPtr>
    __device__ __forceinline__ static void load(uint4 (&t)[NR][CH], const RowPtr& rp, int item, int lane) {
        const int k = item / C, c = item - (item / C) * C;
        #pragma unroll
        for (int r = 0; r < NR; ++r) {
            const uint4* p = rp(k, r) + c * (CH * 32) + lane;
            #pragma unroll
            for (int j = 0; j < CH; ++j)
                t[r][j] = in_row(c * (CH * 32) + j * 32 + lane) ? __ldcs(p + j * 32) : make_uint4(0u, 0u, 0u, 0u);
        }
    }

    template <class RowPtr>
    __device__ __forceinline__ void prefetch(const RowPtr& rp, int items, int lane) {
        #pragma unroll
        for (int i = 0; i < NB; ++i)
            if (items > i) load(buf[i], rp, i, lane);
    }

    template <class RowPtr, class Finish>
    __device__ __forceinline__ void step(uint4 (&t)[NR][CH], int item, int items, const RowPtr& rp,
                                         const Finish& fin, const float4* lo, const float4* hi, int lane,
                                         float (&acc)[NR]) {
        const int c = item % C;
        #pragma unroll
        for (int j = 0; j < CH; ++j) {
            const int q = c * (CH * 32) + j * 32 + lane;
            const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
            const float4 xl = in_row(q) ? lo[q] : zero, xh = in_row(q) ? hi[q] : zero;
            #pragma unroll
            for (int r = 0; r < NR; ++r) acc[r] = dot8(t[r][j], xl, xh, acc[r]);
        }
        if (item + NB < items) load(t, rp, item + NB, lane);
        if (c == C - 1) {
            #pragma unroll
            for (int r = 0; r < NR; ++r) acc[r] = warp_sum(acc[r]);
            fin(item / C, acc);
            #pragma unroll
            for (int r = 0; r < NR; ++r) acc[r] = 0.f;
        }
    }

    template <class RowPtr, class Finish>
    __device__ __forceinline__ void run(const RowPtr& rp, const Finish& fin, int items, const float4* lo,
                                        const float4* hi, int lane) {
        float acc[NR];
        #pragma unroll
        for (int r = 0; r < NR; ++r) acc[r] = 0.f;
        #pragma unroll 1
        for (int t = 0; t < items; t += NB) {
            #pragma unroll
            for (int i = 0; i < NB; ++i)
                if (t + i < items) step(buf[i], t + i, items, rp, fin, lo, hi, lane, acc);
        }
    }
};

// (value, index) as one 64-bit key whose unsigned order is torch.argmax's: larger
// values first, NaN above everything, -0 == +0, and among equals the lowest index.
__device__ __forceinline__ unsigned long long argmax_key(float v, unsigned idx) {
    unsigned u;
    if (v != v) {
        u = 0xffffffffu;
    } else {
        u = v == 0.f ? 0u : __float_as_uint(v);
        u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    }
    return ((unsigned long long)u << 32) | (unsigned long long)(0xffffffffu - idx);
}

}  // namespace llama
