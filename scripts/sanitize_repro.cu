// The standalone kernels of scripts/sanitize_repro.py (declared there, with their NumPy
// references): llama::StageX alone, the same pattern without llama_common.cuh, and
// kernels correct by construction for the device-loop question.
#include "llama_common.cuh"

// llama::StageX alone, as rms_qkv_rope uses it: norm weight before the wait, x after
// it, commit (stores, warp sums, the CTA barrier); then the staged x * g and sum(x^2)
// written out.  DYN: the stage in dynamic shared memory (llama::x_stage past 40 KB).
template <int K, int W, int PDL, int MINB, int DYN>
__global__ void __launch_bounds__(32 * W, MINB)
stage_only(float* __restrict__ ss, float* __restrict__ staged, const float* __restrict__ x,
           const __nv_bfloat16* __restrict__ g) {
    float4 *lo, *hi;
    if constexpr (DYN != 0) {
        extern __shared__ float4 dyn_stage[];
        lo = dyn_stage;
        hi = dyn_stage + K / 8;
    } else {
        __shared__ float4 s_lo[K / 8], s_hi[K / 8];
        lo = s_lo;
        hi = s_hi;
    }
    __shared__ float scratch[W];
    llama::StageX<K, 32 * W, true> sx;
    if (PDL) llama::pdl_launch_dependents();
    sx.load_g(g);
    if (PDL) llama::pdl_wait();
    sx.issue(x);
    const float total = sx.commit(lo, hi, scratch);
    if (threadIdx.x == 0) ss[blockIdx.x] = total;
    float4* out = reinterpret_cast<float4*>(staged + (size_t)blockIdx.x * K);
    for (int q = threadIdx.x; q < K / 8; q += 32 * W) {
        out[2 * q] = lo[q];
        out[2 * q + 1] = hi[q];
    }
}

// Kernels correct by construction, for the loop question: every thread of the CTA
// reaches the one barrier, converged (probe_bar); no barrier, no shared memory (probe_nobar).
template <int T>
__global__ void probe_bar(float* __restrict__ out, const float* __restrict__ x) {
    __shared__ float s[T];
    s[threadIdx.x] = x[threadIdx.x];
    __syncthreads();
    out[(size_t)blockIdx.x * T + threadIdx.x] = s[T - 1 - threadIdx.x];
}

template <int T>
__global__ void probe_nobar(float* __restrict__ out, const float* __restrict__ x) {
    out[(size_t)blockIdx.x * T + threadIdx.x] = x[T - 1 - threadIdx.x];
}

// The pattern alone: threads past Q skip the loop body (continue), every thread joins
// the warp reduction, lane 0 stores its warp's sum (predicated), then the CTA barrier.
template <int T, int Q, int PDL>
__global__ void cont_sum(float* __restrict__ out, float* __restrict__ staged, const float* __restrict__ x) {
    __shared__ float stage[Q];
    __shared__ float scratch[T / 32];
    if (PDL) llama::pdl_launch_dependents();
    if (PDL) llama::pdl_wait();
    float ss = 0.f;
    #pragma unroll
    for (int i = 0; i < (Q + T - 1) / T; ++i) {
        const int q = threadIdx.x + i * T;
        if (q >= Q) continue;
        const float v = x[q];
        ss += v * v;
        stage[q] = v;
    }
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = ss;
    __syncthreads();
    if (threadIdx.x == 0) {
        float t = 0.f;
        for (int w = 0; w < T / 32; ++w) t += scratch[w];
        out[blockIdx.x] = t;
    }
    for (int q = threadIdx.x; q < Q; q += T) staged[(size_t)blockIdx.x * Q + q] = stage[Q - 1 - q];
}
