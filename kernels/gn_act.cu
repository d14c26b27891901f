// Fused Conv2D -> GroupNorm -> activation, launch 2 of 2 (launch 1: conv2d_gn.cu).
//
// CTA (n, chunk) first merges the partial statistics of image n, which the
// conv kernel left per (tile, image segment, group-in-tile): 8 lanes a group,
// in a fixed order and a fixed tree (GroupPartials, groupnorm.cuh), so the
// result is deterministic.  That gives each group's mean and rstd; gamma and
// beta fold into a scale and shift per channel (shared memory).  Then the CTA
// streams its rows once, 16 bytes at a time: z = act(y * scale + shift), in
// place or into another buffer.
#include <cuda_fp16.h>

#include "groupnorm.cuh"

// 8 consecutive elements <-> floats (one 16-byte access for half, two for float)
__device__ __forceinline__ void load8(const __half* p, float* f) {
    const uint4 v = __ldcg(reinterpret_cast<const uint4*>(p));
    const __half2* h = reinterpret_cast<const __half2*>(&v);
    #pragma unroll
    for (int i = 0; i < 4; ++i) { const float2 a = __half22float2(h[i]); f[2 * i] = a.x; f[2 * i + 1] = a.y; }
}
__device__ __forceinline__ void load8(const float* p, float* f) {
    const float4 a = __ldcg(reinterpret_cast<const float4*>(p)), b = __ldcg(reinterpret_cast<const float4*>(p) + 1);
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w; f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
}
constexpr int kApplyThreads = 256;
constexpr int kMaxChannels = 4096;  // kernels/conv.py: MAX_CHANNELS
constexpr int kPrefetch = 4;        // 16-byte vectors of y per thread read before the statistics merge

// Grid (N, chunks): CTA (n, chunk) normalizes rows [chunk * rows_per, +rows_per) of image n.
// stats: per conv CTA (mt, nt, ks) a [2 segments][GS] block of float2 (mean, M2); only ks = KS - 1 is read.
//
// The kernel is a chain of memory latencies, not a bandwidth problem (a few MB at
// N = 1), so it is ordered to pay as few of them as it can.  Before the conv may
// be read: gamma and beta into shared memory, and where every partial lies.
// After: the partials' loads first (the merge waits on them), then the CTA's
// first kPrefetch vectors of y per thread, all in flight before anything waits.
// Measured on the H100 (graph replays, C=320-1280, N=1-2): one warp a group, y
// read after the merge: 15.0-21.0 us a launch; the partials' addresses worked
// out after the wait and merged lane by lane with Chan's formula: see docs/conv.md.
template <int ACT, typename YT, typename OT>
__device__ __forceinline__ void gn_apply(OT* z, const YT* y, const float* __restrict__ stats,
                                         const float* __restrict__ gamma, const float* __restrict__ beta,
                                         float eps, int HW, int C, int G, int TM, int TN, int NTILES, int KS,
                                         int GS, int rows_per) {
    __shared__ __align__(16) float sh[2 * kMaxChannels];   // gamma -> scale[C], beta -> shift[C] (C % 8 == 0)
    float* scale = sh;
    float* shift = sh + C;
    const int n = blockIdx.x, cpg = C / G;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int vecs = C / 8;
    const int r0 = blockIdx.y * rows_per;
    const int total = min(rows_per, HW - r0) * vecs;   // 8-element vectors of this CTA
    const size_t base = ((size_t)n * HW + r0) * C;

    for (int c = threadIdx.x; c < C; c += kApplyThreads) {   // not the conv's output: before the wait
        scale[c] = gamma[c];
        shift[c] = beta[c];
    }
    // A warp merges 4 groups at once, 8 lanes each; the first 32 groups' partials
    // are addressed now, any further ones after the wait.
    const float2* st = reinterpret_cast<const float2*>(stats);
    const int sub = lane & 7, per_round = 4 * (kApplyThreads / 32);
    const int g_first = warp * 4 + (lane >> 3);
    GroupPartials first(st, n, g_first, g_first < G, HW, cpg, TM, TN, NTILES, KS, GS, sub);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");   // launched with PDL: the conv (y, stats) is done here
#endif
    first.load();
    float f[kPrefetch][8];
    #pragma unroll
    for (int v = 0; v < kPrefetch; ++v) {
        const int i = threadIdx.x + v * kApplyThreads;
        if (i < total) load8(y + base + (size_t)(i / vecs) * C + (i % vecs) * 8, f[v]);
    }
    __syncthreads();   // gamma and beta are in shared memory

    auto fold = [&](const GroupPartials& gp, int g) {   // the group's mean and rstd into its scale and shift
        float mean, m2;
        gp.merge(mean, m2);
        if (g < G) {
            const float rstd = rsqrtf(fmaxf(m2 * gp.inv_count, 0.f) + eps);
            for (int c = g * cpg + sub; c < (g + 1) * cpg; c += 8) {
                const float sc = scale[c] * rstd;
                shift[c] -= mean * sc;
                scale[c] = sc;
            }
        }
    };
    fold(first, g_first);
    for (int g = g_first + per_round; g - (lane >> 3) < G; g += per_round) {   // warp-uniform
        GroupPartials more(st, n, g, g < G, HW, cpg, TM, TN, NTILES, KS, GS, sub);
        more.load();
        fold(more, g);
    }
    __syncthreads();

    #pragma unroll
    for (int v = 0; v < kPrefetch; ++v) {
        const int i = threadIdx.x + v * kApplyThreads;
        if (i < total) {
            const int c = (i % vecs) * 8;
            normalize8<ACT>(f[v], scale + c, shift + c);
            store8(z + base + (size_t)(i / vecs) * C + c, f[v]);
        }
    }
    for (int i = threadIdx.x + kPrefetch * kApplyThreads; i < total; i += kApplyThreads) {
        const int c = (i % vecs) * 8;
        const size_t off = base + (size_t)(i / vecs) * C + c;
        float rest[8];
        load8(y + off, rest);
        normalize8<ACT>(rest, scale + c, shift + c);
        store8(z + off, rest);
    }
}

// CTAS: the CTAs an SM may hold, 2 or 3 (kernels/conv.py, apply_ctas_per_sm, picks).
// Under PDL the apply CTAs take the SMs the conv's CTAs leave and wait there, set
// up, for the conv to end: 3 a SM lets more of them be waiting; 2 packs fewer on
// the SMs that free first.  __launch_bounds__ holds a thread to 80 registers for 3
// (no spills); for 2 the launch pads the shared memory (APPLY_PAD_BYTES).

// Out of place: z (fp16 or fp32) from y.  z is the partitioned output: [N, chunks, rows_per * C].
template <int ACT, typename YT, typename OT, int CTAS>
__global__ void __launch_bounds__(kApplyThreads, CTAS)
gn_act_apply(OT* z, const YT* y, const float* stats, const float* gamma, const float* beta, float eps,
             int HW, int C, int G, int TM, int TN, int NTILES, int KS, int GS, int rows_per) {
    gn_apply<ACT, YT, OT>(z, y, stats, gamma, beta, eps, HW, C, G, TM, TN, NTILES, KS, GS, rows_per);
}

// In place: each element of y is read, then overwritten, by the same thread.
template <int ACT, typename YT, int CTAS>
__global__ void __launch_bounds__(kApplyThreads, CTAS)
gn_act_apply_inplace(YT* y, const float* stats, const float* gamma, const float* beta, float eps,
                     int HW, int C, int G, int TM, int TN, int NTILES, int KS, int GS, int rows_per) {
    gn_apply<ACT, YT, YT>(y, y, stats, gamma, beta, eps, HW, C, G, TM, TN, NTILES, KS, GS, rows_per);
}

// The U-Net block's residual: out = a + b, fp16, 8 elements (16 bytes) per thread.
extern "C" __global__ void __launch_bounds__(kApplyThreads)
add_f16(__half* out, const __half* a, const __half* b) {
    const size_t i = ((size_t)blockIdx.x * kApplyThreads + threadIdx.x) * 8;
    float fa[8], fb[8];
    load8(a + i, fa);
    load8(b + i, fb);
    #pragma unroll
    for (int k = 0; k < 8; ++k) fa[k] += fb[k];
    store8(out + i, fa);
}
