// The token model's layer in two kernels instead of four (issue 7):
//
//   rms_matvec:  out[n] = rsqrt(mean(x^2) + eps) * dot(w[n, :], x * g)   (RMSNorm folded into Q)
//   matvec_add:  out[n] = residual[n] + dot(w[n, :], x)                  (residual add folded into O)
//
// Memory-bound on the weights (d = 2048: 16 MB fp32 or 8 MB bf16 per call), so
// the structure is the one of matvec: one warp per weight row, BN rows per
// block, each lane issuing BK independent 16-byte weight loads before it uses
// any.  The weights never depend on the previous kernel, so they are loaded
// *before* griddepcontrol.wait: launched with programmatic dependent launch
// (PDL), a kernel streams its weights while the previous one finishes.  Its
// inputs (x, residual) are read only after the wait, through L2 (ld.cg), into
// shared memory once per block.  Without PDL the wait is a no-op.
//
// After the wait, everything is on the critical path between two kernels, so
// it is kept to one L2 round trip: each block stages x (times g, for the
// RMSNorm) in shared memory and sums x^2 on the way (one block reduction), and
// the residual is read right after the wait, beside x, not after the dot
// product.  Measured on the H100 (22 layers, d = 2048, graph + PDL, replays
// back to back, us/token): each warp re-reading g and summing x^2 itself, and
// the residual read at the end: fp32 279.4, bf16 201.3; staged once per block:
// fp32 268.8, bf16 181.6.
#include <cuda_bf16.h>

// Minimum resident blocks per SM for the register budget.  Measured on the H100
// (22 layers, d = 2048, graph + PDL, us/token): 1 block -> fp32 291, bf16 212;
// 2 blocks (64 registers, so the next kernel's blocks could sit beside this
// one's) -> fp32 308-403, bf16 248-275: fewer loads in flight cost more than
// the overlap gained.  -DFUSED_MIN_BLOCKS=2 reproduces it.
//
// Also measured (H100, 2026-11-21, same bench): weights streamed into shared
// memory by the copy engine (one cp.async.bulk per row, an mbarrier per block,
// BN = 8 fp32 / 16 bf16 rows, ~72 KB a block so three blocks share an SM and
// the next kernel's blocks can start their copies early): fp32 411 -> 347
// us/token with PDL, bf16 359 -> 418, against 306 and 222 for the kernels
// below in the same run.  Dropped.
//
// Also measured (H100, 2026-11-21; graph replays back to back, CUDA events,
// us/token; these kernels with PDL: fp32 281-284, bf16 201): the whole layer
// stack as ONE persistent cooperative kernel, a grid barrier between matvecs
// instead of a kernel boundary, 128 blocks of 16 math warps.
//   (a) next weights prefetched into registers before the barrier: fp32
//       348-362, bf16 246.  A warp reaches the barrier only once its loads
//       have issued, and the barrier thread's fence waits for its own loads.
//   (b) a copy warp streaming weights through a 6-13-stage shared-memory ring
//       (cp.async.bulk, mbarriers), running ahead across barriers, a separate
//       barrier warp with no loads: fp32 326, bf16 220 (one copy per row per
//       stage: 297-790, the copy warp the bottleneck; one 16 KB copy per stage
//       of whole rows: 326 whatever the depth).  With the barrier compiled out
//       (wrong results, streaming alone): fp32 282, bf16 185 -- the stream is
//       no faster than these kernels' (~2.6 TB/s for fp32) and the barrier
//       still costs ~1 us a phase.
// Dropped.  What is left between these kernels and the floor is the read rate
// itself, not launch gaps.
//
// Also measured (H100, 2026-11-21, replays back to back; these kernels before
// the x staging above: fp32 279, bf16 200):
//   (c) each kernel prefetching the NEXT matrix into L2 (prefetch.global.L2,
//       with or without evict_last, or one cp.async.bulk.prefetch.L2 per row
//       or per block): fp32 314-321, bf16 215-226 -- slower: the prefetch
//       competes with this kernel's own reads and the total bytes do not shrink;
//   (d) weights through cp.async (LDGSTS) into shared memory, no registers held,
//       so 2-4 kernels' blocks fit an SM beside each other and the next ones
//       stream while this one finishes: fp32 293-395, bf16 232-359.
//   (e) the persistent stack again, now with these kernels' x staging, the next
//       phase's row prefetched into registers after the dot product and a 17th,
//       load-free warp running the grid barrier (named barriers hand over):
//       correct, bit-identical, but fp32 326 / bf16 215 against 264 / 177 for
//       the two-kernel graph in the same run (no input copy in either).
//   Co-residency never paid here: every variant that lets the next kernel's
//   blocks in early (including 64-register builds of these kernels) was slower.
// Dropped.
//
// Measured again in session 6 (H100, graph replays back to back, CUDA events,
// us/token; these kernels with PDL in the same runs: bf16 177.6-179.1, fp32
// 264.5-265.5; floors 122.6 / 245.1 at the 3.01 TB/s copy rate):
//   - the bound: a plain read kernel streams the 369 MB at 3.07 TB/s (120 us),
//     and these kernels with griddepcontrol.wait compiled out (wrong results,
//     no dependency) run bf16 in 138.9 us.  So the chain of 44 kernels streams
//     fine; the ~40 us left is the dependency: after the wait, x comes back
//     through L2 under a saturated memory system, and each SM only starts the
//     next matrix's loads once its block of this one exits.
//   - block shapes (BN, BK, min blocks per SM) for bf16: 16/8/1 178.4 (these),
//     8/8/1 188.2, 8/8/2 188.5, 16/4/1 186.8, 16/8/2 212.4, 4/8/4 200.3, 32/4/1
//     223.5, 32/8/1 245.0 (64 blocks, so two kernels on disjoint SM halves).
//   - the PDL trigger at the end of the kernel instead of the start: 222.4.
//   - the persistent stack once more, written afresh (one block per SM, a copy
//     warp keeping a 6-13 x 16 KB ring full with one 1 KB cp.async.bulk per row
//     chunk, at most 1-12 stages in flight): with a counter grid barrier
//     bf16 220-227, fp32 279-330; with the phase outputs as 8-byte (value, tag)
//     pairs (NCCL's LL protocol: no fence, no counter) bf16 229-265, fp32
//     331-372.  Traced with clock64 (per phase, H100): the copy warp is 12-14 us
//     ahead, the ring full; the math warps' critical path is ~5 us a phase (the
//     fence before the barrier arrive ~2 us, the L2 round trips for x ~0.5-2
//     us, even the register-only dot product ~1.3 us) against 2.8 us of
//     streaming: every global access on the critical path pays the latency of
//     a memory system kept full by the stream.
// Dropped.  bf16 stays at ~1.45x its floor.
#ifndef FUSED_MIN_BLOCKS
#define FUSED_MIN_BLOCKS 1
#endif

#include <deviceop/pdl.cuh>

// A 16-byte vector of weights and its elements as floats.
template <typename W> struct WeightVec;
template <> struct WeightVec<float> {
    using T = float4;
    static constexpr int N = 4;
    __device__ static void unpack(const float4& v, float* f) { f[0] = v.x; f[1] = v.y; f[2] = v.z; f[3] = v.w; }
};
template <> struct WeightVec<__nv_bfloat16> {
    using T = uint4;
    static constexpr int N = 8;
    __device__ static void unpack(const uint4& v, float* f) {
        const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
        #pragma unroll
        for (int i = 0; i < 4; ++i) { const float2 p = __bfloat1622float2(h[i]); f[2 * i] = p.x; f[2 * i + 1] = p.y; }
    }
};

template <typename W, int BN, int BK, int K, bool NORM, bool RESIDUAL>
__device__ __forceinline__ void fused_matvec(float* __restrict__ out, const float* __restrict__ x,
                                             const float* __restrict__ g, const W* __restrict__ w,
                                             const float* __restrict__ residual, float eps) {
    using V = WeightVec<W>;
    using VT = typename V::T;
    constexpr int E = V::N;          // weights per 16-byte load
    constexpr int STEP = 32 * BK;    // loads per warp step
    static_assert(K % (E * STEP) == 0, "K must be a multiple of 32 * BK * (16 / sizeof(W))");
    static_assert(BN >= 1 && BN <= 32, "BN must be in [1, 32] (one warp per row)");
    __shared__ float4 xs[K / 4];     // x, or x * g for the RMSNorm
    __shared__ float partial[BN];    // per-warp sums of x^2
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const size_t row = (size_t)blockIdx.x * BN + warp;
    const VT* wv = reinterpret_cast<const VT*>(w + row * K);

    pdl_launch_dependents();         // the next kernel may start streaming its own weights
    VT wr[BK];
    #pragma unroll
    for (int j = 0; j < BK; ++j) wr[j] = __ldcs(wv + j * 32 + lane);   // in flight across the wait
    pdl_wait();                      // the previous kernel's output (x, residual) is complete from here on
    float res = 0.f;
    if (RESIDUAL && lane == 0) res = __ldcg(residual + row);
    const float4* x4 = reinterpret_cast<const float4*>(x);
    float ss = 0.f;
    for (int i = threadIdx.x; i < K / 4; i += 32 * BN) {
        float4 v = __ldcg(x4 + i);
        if (NORM) {
            ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
            const float4 gv = __ldg(reinterpret_cast<const float4*>(g) + i);
            v = make_float4(v.x * gv.x, v.y * gv.y, v.z * gv.z, v.w * gv.w);
        }
        xs[i] = v;
    }
    if (NORM) {
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        if (lane == 0) partial[warp] = ss;
    }
    __syncthreads();
    if (NORM) {
        ss = 0.f;
        #pragma unroll
        for (int i = 0; i < BN; ++i) ss += partial[i];
    }

    float acc = 0.f;
    #pragma unroll 1
    for (int base = 0; base < K / E; base += STEP) {
        if (base) {
            #pragma unroll
            for (int j = 0; j < BK; ++j) wr[j] = __ldcs(wv + base + j * 32 + lane);
        }
        #pragma unroll
        for (int j = 0; j < BK; ++j) {
            float wf[E];
            V::unpack(wr[j], wf);
            const int e0 = (base + j * 32 + lane) * E;  // first element of this load
            #pragma unroll
            for (int q = 0; q < E; q += 4) {
                const float4 xv = xs[(e0 + q) / 4];
                acc += wf[q] * xv.x + wf[q + 1] * xv.y + wf[q + 2] * xv.z + wf[q + 3] * xv.w;
            }
        }
    }
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        acc += __shfl_xor_sync(0xffffffffu, acc, o);
    }
    if (lane == 0) out[row] = (NORM ? acc * rsqrtf(ss / K + eps) : acc) + res;
}

template <int BN, int BK, int K>
__global__ void __launch_bounds__(32 * BN, FUSED_MIN_BLOCKS)
rms_matvec_f32(float* out, const float* x, const float* g, const float* w, float eps) {
    fused_matvec<float, BN, BK, K, true, false>(out, x, g, w, nullptr, eps);
}

template <int BN, int BK, int K>
__global__ void __launch_bounds__(32 * BN, FUSED_MIN_BLOCKS)
rms_matvec_bf16(float* out, const float* x, const float* g, const __nv_bfloat16* w, float eps) {
    fused_matvec<__nv_bfloat16, BN, BK, K, true, false>(out, x, g, w, nullptr, eps);
}

template <int BN, int BK, int K>
__global__ void __launch_bounds__(32 * BN, FUSED_MIN_BLOCKS)
matvec_add_f32(float* out, const float* x, const float* w, const float* residual) {
    fused_matvec<float, BN, BK, K, false, true>(out, x, nullptr, w, residual, 0.f);
}

template <int BN, int BK, int K>
__global__ void __launch_bounds__(32 * BN, FUSED_MIN_BLOCKS)
matvec_add_bf16(float* out, const float* x, const __nv_bfloat16* w, const float* residual) {
    fused_matvec<__nv_bfloat16, BN, BK, K, false, true>(out, x, nullptr, w, residual, 0.f);
}
