// Fused Conv2D -> GroupNorm -> activation, launch 1 of 2 (issue 6; launch 2 is gn_act.cu).
//
// conv2d_gn_stats: a CUTLASS 2.x implicit-GEMM fprop (fp16 NHWC activations,
// KRSC filters, fp32 accumulation, SM80 mma.sync tensor ops, which run on
// sm_90), bias added in the epilogue (CUTLASS's C operand with stride 0), y
// written in fp16 (or fp32).  Then, in the same kernel, the CTA re-reads the
// tile it just wrote (L2-hot) and stores GroupNorm partial statistics of the
// values as stored: for each image segment of its rows (a tile holds rows of
// at most two images, since H*W >= tile M) and each group its channels touch,
// (mean, M2).  Deterministic: a fixed summation order, no atomics.  With
// serial split-K only the last slice (which writes the final y) does this.
//
// CUTLASS's Params (its host-side argument block) cannot be built on the host
// without nvcc, but its constructor is CUTLASS_HOST_DEVICE: conv2d_params runs
// it once per problem shape on one GPU thread and writes the bytes to a device
// buffer, pointers null.  Each conv CTA copies that blob into shared memory
// and fills in this launch's pointers, so the pointers may change between
// launches (and graph node updates) without rebuilding anything.
#include <cutlass/cutlass.h>
#include <cutlass/conv/kernel/default_conv2d_fprop.h>
#include <cutlass/conv/conv2d_problem_size.h>
#include <cutlass/epilogue/thread/linear_combination.h>
#include <cutlass/gemm/threadblock/threadblock_swizzle.h>

#include "groupnorm.cuh"

constexpr int kBlobBytes = 1024;  // the device buffer the Params blob lives in (kernels/conv.py: BLOB_BYTES)

template <typename YT, int TM, int TN, int TK, int WM, int WN, int STAGES>
struct ConvConfig {
    using Element = cutlass::half_t;
    using Layout = cutlass::layout::TensorNHWC;
    static constexpr int kVec = 16 / sizeof(YT);          // elements of y per 16-byte access
    using Epilogue = cutlass::epilogue::thread::LinearCombination<YT, kVec, float, float>;
    using Kernel = typename cutlass::conv::kernel::DefaultConv2dFprop<
        Element, Layout, Element, Layout, YT, Layout, float,
        cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80,
        cutlass::gemm::GemmShape<TM, TN, TK>, cutlass::gemm::GemmShape<WM, WN, TK>,
        cutlass::gemm::GemmShape<16, 8, 16>, Epilogue,
        cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<1>, STAGES,
        cutlass::arch::OpMultiplyAdd, cutlass::conv::IteratorAlgorithm::kOptimized>::Kernel;
    using Params = typename Kernel::Params;
    static constexpr int kThreads = Kernel::kThreadCount;
    static_assert(sizeof(Params) + 8 <= kBlobBytes, "the Params blob outgrew its buffer");
    static_assert(sizeof(Params) % 4 == 0, "Params are copied in 4-byte words");
};

// The Params blob of one problem shape (pointers null).  Its last 8 bytes
// report sizeof(Params) and sizeof(SharedStorage) so a test can hold the
// host's shared-memory formula to the truth.
template <typename YT, int TM, int TN, int TK, int WM, int WN, int STAGES>
__global__ void conv2d_params(unsigned char* blob, int n, int h, int w, int c, int k, int r, int s,
                              int pad, int split_k) {
    using Cfg = ConvConfig<YT, TM, TN, TK, WM, WN, STAGES>;
    using K = typename Cfg::Kernel;
    using Layout = typename Cfg::Layout;
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const int p = h + 2 * pad - r + 1, q = w + 2 * pad - s + 1;
    cutlass::conv::Conv2dProblemSize problem(n, h, w, c, k, r, s, p, q, pad, pad, 1, 1, 1, 1,
                                             cutlass::conv::Mode::kCrossCorrelation, split_k, 1);
    typename K::Arguments args(
        problem,
        {nullptr, Layout::packed({n, h, w, c})},
        {nullptr, Layout::packed({k, r, s, c})},
        {nullptr, Layout::Stride(0)},            // C = the bias, broadcast over every output pixel
        {nullptr, Layout::packed({n, p, q, k})},
        {1.0f, 1.0f},                             // y = 1 * acc + 1 * bias
        cutlass::conv::SplitKMode::kSerial);
    typename K::Params params(args, nullptr);
    const unsigned char* src = reinterpret_cast<const unsigned char*>(&params);
    for (int i = 0; i < (int)sizeof(params); ++i) blob[i] = src[i];
    reinterpret_cast<int*>(blob + kBlobBytes - 8)[0] = (int)sizeof(params);
    reinterpret_cast<int*>(blob + kBlobBytes - 8)[1] = (int)sizeof(typename K::SharedStorage);
}

__device__ __forceinline__ void load_vec(const cutlass::half_t* p, float* f) {   // 8 halves
    const uint4 v = __ldcg(reinterpret_cast<const uint4*>(p));
    const __half2* h = reinterpret_cast<const __half2*>(&v);
    #pragma unroll
    for (int i = 0; i < 4; ++i) { const float2 a = __half22float2(h[i]); f[2 * i] = a.x; f[2 * i + 1] = a.y; }
}
__device__ __forceinline__ void load_vec(const float* p, float* f) {             // 4 floats
    const float4 v = __ldcg(reinterpret_cast<const float4*>(p));
    f[0] = v.x; f[1] = v.y; f[2] = v.z; f[3] = v.w;
}

// Partial statistics of the tile rows [m0, m0 + TM) x channels [n0, n0 + TN) of y [M, K].
// out (float2, this CTA's slot): [2 segments][GS groups] of (mean, M2); the
// counts follow from the geometry and are recomputed by the apply kernel.
template <typename YT, int TM, int TN, int NT>
__device__ __forceinline__ void tile_stats(const YT* y, float2* out, float* smem,
                                           int m0, int n0, int M, int K, int HW, int cpg, int GS) {
    constexpr int V = 16 / sizeof(YT);
    constexpr int CG = TN / V;            // 16-byte vectors per tile row
    constexpr int RL = NT / CG;           // rows read in parallel
    static_assert(NT % CG == 0, "the threads must cover a tile row in 16-byte vectors");
    const int t = threadIdx.x, cg = t % CG, rl = t / CG;
    const int m_end = min(m0 + TM, M);
    const int boundary = min((m0 / HW + 1) * HW, m_end);  // the first row of the second image, if any
    const int c0 = n0 + cg * V;
    const bool cvalid = c0 < K;           // K % V == 0: a vector is all in or all out
    // Shifted sums per channel and segment, the shift being the segment's first
    // row: M2 = S2 - S1^2/n then cancels little even when |mean| >> std.
    float shift[2][V], s1[2][V], s2[2][V];
    #pragma unroll
    for (int sg = 0; sg < 2; ++sg) {
        const int row = sg == 0 ? m0 : boundary;
        if (cvalid && row < m_end) load_vec(y + (size_t)row * K + c0, shift[sg]);
        else {
            #pragma unroll
            for (int i = 0; i < V; ++i) shift[sg][i] = 0.f;
        }
        #pragma unroll
        for (int i = 0; i < V; ++i) s1[sg][i] = s2[sg][i] = 0.f;
    }
    if (cvalid) {
        // unrolled so that several rows' loads are in flight at once (the loop is L2-latency bound)
        #pragma unroll 4
        for (int row = m0 + rl; row < m_end; row += RL) {
            float f[V];
            load_vec(y + (size_t)row * K + c0, f);
            if (row < boundary) {
                #pragma unroll
                for (int i = 0; i < V; ++i) { const float d = f[i] - shift[0][i]; s1[0][i] += d; s2[0][i] += d * d; }
            } else {
                #pragma unroll
                for (int i = 0; i < V; ++i) { const float d = f[i] - shift[1][i]; s1[1][i] += d; s2[1][i] += d * d; }
            }
        }
    }
    // smem: [RL][2][TN] (S1, S2), then each channel adds its RL rows in a fixed order.
    #pragma unroll
    for (int sg = 0; sg < 2; ++sg)
        #pragma unroll
        for (int i = 0; i < V; ++i) {
            float* d = smem + ((rl * 2 + sg) * TN + cg * V + i) * 2;
            d[0] = s1[sg][i];
            d[1] = s2[sg][i];
        }
    float* chan = smem + RL * 2 * TN * 2;   // [2][TN] (mean, M2) per channel
    __syncthreads();
    for (int e = t; e < 2 * TN; e += NT) {
        const int sg = e / TN, c = e % TN;
        const int rows = sg == 0 ? boundary - m0 : m_end - boundary;
        float a = 0.f, b = 0.f;
        for (int j = 0; j < RL; ++j) {
            const float* d = smem + ((j * 2 + sg) * TN + c) * 2;
            a += d[0];
            b += d[1];
        }
        float sh = 0.f;
        if (rows > 0 && n0 + c < K) sh = (float)y[(size_t)(sg == 0 ? m0 : boundary) * K + n0 + c];
        const float md = rows > 0 ? a / rows : 0.f;
        chan[e * 2] = sh + md;
        chan[e * 2 + 1] = rows > 0 ? fmaxf(b - a * md, 0.f) : 0.f;
    }
    __syncthreads();
    channels_to_groups(chan, out, TN, n0, K, cpg, GS, boundary - m0, m_end - boundary, NT);
}

// y [N*P*Q, K] = conv(x, w) + bias; with with_stats, the partials of every tile.
// Grid: (m tiles, n tiles, split-K slices), as CUTLASS's identity swizzle expects;
// the stats tensor [MT, NT, KS * 2 * GS * 2] partitioned by [1, 1, 2 * GS * 2] gives it.
template <typename YT, int TM, int TN, int TK, int WM, int WN, int STAGES>
__global__ void __launch_bounds__(ConvConfig<YT, TM, TN, TK, WM, WN, STAGES>::kThreads)
conv2d_gn_stats(float* stats, YT* y, const cutlass::half_t* x, const cutlass::half_t* w, const YT* bias,
                const unsigned char* blob, int* semaphore, int HW, int cpg, int GS, int with_stats) {
    using Cfg = ConvConfig<YT, TM, TN, TK, WM, WN, STAGES>;
    using K = typename Cfg::Kernel;
    using Params = typename Cfg::Params;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ __align__(16) int params_raw[sizeof(Params) / 4];
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    // The apply kernel (launched with PDL) may start now: its CTAs take SM room
    // this grid leaves free and wait in griddepcontrol.wait for this grid to end.
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    for (int i = threadIdx.x; i < (int)(sizeof(Params) / 4); i += blockDim.x)
        params_raw[i] = __ldg(reinterpret_cast<const int*>(blob) + i);
    __syncthreads();
    Params& p = *reinterpret_cast<Params*>(params_raw);
    if (threadIdx.x == 0) {
        p.ptr_A = x;
        p.ptr_B = w;
        p.ptr_C = const_cast<YT*>(bias);
        p.ptr_D = y;
        p.semaphore = semaphore;
    }
    __syncthreads();
    K op;
    op(p, *reinterpret_cast<typename K::SharedStorage*>(smem_raw));
    if (!with_stats || blockIdx.z != gridDim.z - 1) return;  // split-K: the last slice holds the final y
    __syncthreads();  // the tile is written and visible to this CTA; shared memory is free again
    float2* out = reinterpret_cast<float2*>(stats) +
                  (((size_t)blockIdx.x * gridDim.y + blockIdx.y) * gridDim.z + blockIdx.z) * 2 * GS;
    tile_stats<YT, TM, TN, Cfg::kThreads>(y, out, reinterpret_cast<float*>(smem_raw), blockIdx.x * TM,
                                          blockIdx.y * TN, p.implicit_gemm_problem_size.m(),
                                          p.implicit_gemm_problem_size.n(), HW, cpg, GS);
}
