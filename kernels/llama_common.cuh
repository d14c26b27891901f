// Shared device helpers of the Llama decode kernels: PDL, warp reductions,
// bf16 16-byte weight loads and the streaming row loop of the projections.
#pragma once
#include <cuda_bf16.h>

namespace llama {

// Error bits of the int32 error word the kernels OR into (sticky: the host zeroes it).
constexpr int ERR_TOKEN = 1;   // embed_gather: token < 0 or >= vocab (hidden not written)
constexpr int ERR_POS = 2;     // rms_qkv_rope: pos < 0 or >= cap (k and v not appended)

// CTAs of W warps a SM the register budget is sized for: 16 warps (<= 128
// registers a thread) keep every CTA of a one-wave grid resident at once.
__host__ __device__ constexpr int min_ctas(int w) { return w >= 16 ? 1 : 16 / w; }

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

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

// The activation vector x [K] staged once per CTA in shared memory, split so that
// a warp's 32 lanes read 32 consecutive float4 (no bank conflicts): for the 8
// elements of 16-byte group q, lo[q] holds 0-3 and hi[q] 4-7.  With a norm weight
// g, the stage holds x * g and returns sum(x^2) over the CTA (for the RMSNorm).
// Reads x through L2 (ld.cg): the previous kernel wrote it while this one ran.
template <int K, bool NORM>
__device__ __forceinline__ float stage_x(float4* lo, float4* hi, float* scratch, const float* __restrict__ x,
                                         const __nv_bfloat16* __restrict__ g) {
    const float4* x4 = reinterpret_cast<const float4*>(x);
    const uint4* g8 = reinterpret_cast<const uint4*>(g);
    float ss = 0.f;
    for (int q = threadIdx.x; q < K / 8; q += blockDim.x) {
        float4 a = __ldcg(x4 + 2 * q), b = __ldcg(x4 + 2 * q + 1);
        if (NORM) {
            const uint4 gv = __ldg(g8 + q);
            ss += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w + b.x * b.x + b.y * b.y + b.z * b.z + b.w * b.w;
            a = make_float4(a.x * bf16_lo(gv.x), a.y * bf16_hi(gv.x), a.z * bf16_lo(gv.y), a.w * bf16_hi(gv.y));
            b = make_float4(b.x * bf16_lo(gv.z), b.y * bf16_hi(gv.z), b.z * bf16_lo(gv.w), b.w * bf16_hi(gv.w));
        }
        lo[q] = a;
        hi[q] = b;
    }
    if (NORM) {
        ss = warp_sum(ss);
        if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = ss;
    }
    __syncthreads();
    float total = 0.f;
    if (NORM) {
        for (int i = 0; i < (int)(blockDim.x >> 5); ++i) total += scratch[i];
    }
    return total;
}

// A warp streams the rows of its groups (NR rows each, dotted with x together)
// chunk by chunk: CH 16-byte loads per lane per row per chunk, C = K / (256 CH)
// chunks per row.  Two register buffers (a, b) alternate: the loads of item t+2
// are issued as soon as item t is consumed, so 1-2 items are always in flight.
// prefetch() issues the first two items; a kernel calls it before
// griddepcontrol.wait (weights never depend on the previous kernel) and run()
// after staging x.  RowPtr(k, r): the first 16-byte vector of row r of the
// warp's k-th group; Finish(k, acc): the warp-reduced dot products of group k
// (every lane holds them).
template <int NR, int CH, int K>
struct RowStream {
    static_assert(K % (256 * CH) == 0, "K must be a multiple of 256 * CH");
    static constexpr int C = K / (256 * CH);
    uint4 a[NR][CH], b[NR][CH];

    template <class RowPtr>
    __device__ __forceinline__ static void load(uint4 (&t)[NR][CH], const RowPtr& rp, int item, int lane) {
        const int k = item / C, c = item - (item / C) * C;
        #pragma unroll
        for (int r = 0; r < NR; ++r) {
            const uint4* p = rp(k, r) + c * (CH * 32) + lane;
            #pragma unroll
            for (int j = 0; j < CH; ++j) t[r][j] = __ldcs(p + j * 32);
        }
    }

    template <class RowPtr>
    __device__ __forceinline__ void prefetch(const RowPtr& rp, int items, int lane) {
        if (items > 0) load(a, rp, 0, lane);
        if (items > 1) load(b, rp, 1, lane);
    }

    template <class RowPtr, class Finish>
    __device__ __forceinline__ void step(uint4 (&t)[NR][CH], int item, int items, const RowPtr& rp,
                                         const Finish& fin, const float4* lo, const float4* hi, int lane,
                                         float (&acc)[NR]) {
        const int c = item % C;
        #pragma unroll
        for (int j = 0; j < CH; ++j) {
            const int q = c * (CH * 32) + j * 32 + lane;
            const float4 xl = lo[q], xh = hi[q];
            #pragma unroll
            for (int r = 0; r < NR; ++r) acc[r] = dot8(t[r][j], xl, xh, acc[r]);
        }
        if (item + 2 < items) load(t, rp, item + 2, lane);
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
        for (int t = 0; t < items; t += 2) {
            step(a, t, items, rp, fin, lo, hi, lane, acc);
            if (t + 1 < items) step(b, t + 1, items, rp, fin, lo, hi, lane, acc);
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
