// Fused Conv2D -> GroupNorm -> activation, launch 1 of 2, Hopper path (issue 6;
// launch 2 is gn_act.cu; the CUTLASS 2.x path for other GPUs and shapes is conv2d_gn.cu).
//
// An implicit-GEMM fprop written for sm_90a: y[M = N*H*W, K] = im2col(x)[M, R*S*C] . w^T + bias,
// fp16 in, fp32 accumulation in WGMMA (warpgroup MMA, the instruction that feeds
// Hopper's tensor cores at full rate; CUTLASS 2.x's mma.sync reaches about half of it).
//
// * Mainloop: one k-block is 64 channels of one filter tap, so each A row is
//   128 contiguous bytes of x (an input pixel, or zeros in the padding) and each
//   B row 128 contiguous bytes of w (KRSC).  Every thread gathers 16-byte pieces
//   with cp.async (zero-fill for padding and for rows past M or K) into a ring of
//   STAGES shared-memory stages laid out in WGMMA's 128-byte swizzle; each of
//   the TM/64 warpgroups multiplies its 64 rows by the TN columns with
//   wgmma.m64nTNk16, both operands read straight from shared memory.  Loads run
//   STAGES-2 k-blocks ahead; one wgmma batch stays in flight across iterations.
// * Split-K (grid z = slices): each slice stores its fp32 accumulators to a
//   workspace; the CTA that arrives last at the tile's counter adds all slices
//   in slice order (deterministic whoever is last), resets the counter for the
//   next launch, and runs the epilogue.  Nothing is atomic but the counter.
// * Epilogue: acc + bias, rounded to y's type, staged in shared memory; from
//   there it leaves in coalesced 16-byte stores, and the GroupNorm partials of
//   the values as stored are computed from the same shared tile (no re-read of
//   y), per image segment and channel with shifted sums, then merged per group
//   (gn_partials.cuh).  Deterministic: fixed orders, no float atomics.
#include <cuda_fp16.h>
#include <cuda/std/utility>
#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <cute/arch/mma_sm90_gmma_ext.hpp>

#include "gn_partials.cuh"

namespace convwg {

using cute::SM90::GMMA::Major;

template <int TN> struct Gmma;   // D[64 x TN] (fp32) += A[64 x 16] B[16 x TN]^T, fp16, both K-major in smem
template <> struct Gmma<64>  { using Op = cute::SM90::GMMA::MMA_64x64x16_F32F16F16_SS<Major::K, Major::K>; };
template <> struct Gmma<128> { using Op = cute::SM90::GMMA::MMA_64x128x16_F32F16F16_SS<Major::K, Major::K>; };
template <> struct Gmma<160> { using Op = cute::SM90::GMMA::MMA_64x160x16_F32F16F16_SS<Major::K, Major::K>; };
template <> struct Gmma<256> { using Op = cute::SM90::GMMA::MMA_64x256x16_F32F16F16_SS<Major::K, Major::K>; };

template <class Op, int... I>
__device__ __forceinline__ void gmma(uint64_t da, uint64_t db, float* d, cuda::std::integer_sequence<int, I...>) {
    Op::fma(da, db, d[I]..., cute::SM90::GMMA::ScaleOut::One);
}

// The shared-memory descriptor of a K-major operand in the 128-byte swizzle:
// rows of 64 fp16 (128 B), 8-row atoms 1024 B apart.  The tile must start on a
// 1024-byte boundary (the swizzle is a function of the address bits).
__device__ __forceinline__ uint64_t sw128_desc(uint32_t smem_addr) {
    return (uint64_t)((smem_addr & 0x3FFFF) >> 4)   // start address, 16-byte units
         | (uint64_t)1 << 16                          // leading byte offset: unused for swizzled K-major
         | (uint64_t)(1024 >> 4) << 32                // stride byte offset: 8 rows x 128 B
         | (uint64_t)1 << 62;                         // layout: 128-byte swizzle
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// Row r's 16-byte chunk j of a 128-byte-swizzled tile
__device__ __forceinline__ uint32_t swizzled(uint32_t tile, int r, int j) {
    return tile + r * 128 + ((j ^ (r & 7)) << 4);
}

__device__ __forceinline__ void store2(__half* p, float a, float b) {
    *reinterpret_cast<__half2*>(p) = __floats2half2_rn(a, b);
}
__device__ __forceinline__ void store2(float* p, float a, float b) { *reinterpret_cast<float2*>(p) = make_float2(a, b); }
__device__ __forceinline__ float2 load2(const __half* p) { return __half22float2(*reinterpret_cast<const __half2*>(p)); }
__device__ __forceinline__ float2 load2(const float* p) { return *reinterpret_cast<const float2*>(p); }

template <typename YT, int TM, int TN, int STAGES>
struct Shape {
    static constexpr int kThreads = TM * 2;                    // TM / 64 warpgroups
    static constexpr int kStageBytes = (TM + TN) * 128;         // A then B, 64 fp16 of K per row
    static constexpr int kAcc = TN / 2;                         // fp32 accumulators per thread
    static constexpr int kRowBytes = TN * (int)sizeof(YT) + 16; // staged output row (padded: no bank conflicts)
    static constexpr int kSlices = kThreads / (TN / 2);         // row slices of the statistics pass
    static constexpr int kEpilogueBytes = TM * kRowBytes + (kSlices * 2 + 2) * TN * 2 * 4;
    static constexpr int kMain = STAGES * kStageBytes;
    static constexpr int kSmem = (kMain > kEpilogueBytes ? kMain : kEpilogueBytes) + 1024;  // + alignment slack
    static_assert(TM % 64 == 0 && TN % 16 == 0 && STAGES >= 3, "tile shape");
    static_assert((TM * 8) % kThreads == 0 && (TN * 8) % kThreads == 0, "loaders cover the tile evenly");
    static_assert(kSlices >= 1, "one thread per channel pair at least");
    static_assert(kStageBytes % 1024 == 0 && (TM * 128) % 1024 == 0, "swizzle atoms stay 1024-byte aligned");
};

}  // namespace convwg

// y [N*H*W, K] = conv(x [N,H,W,C], w [K,R,R,C]) + bias (stride 1, padding pad), and the
// GroupNorm partials of every tile (with_stats).  Grid (M tiles, K tiles, split-K slices);
// stats [MT, NT, KS * 2 * GS * 2]: the final values go to the last slice's slot.
// Needs C % 64 == 0, K % 8 == 0, H*W >= TM (checked by kernels/conv.py).
template <typename YT, int TM, int TN, int STAGES>
__global__ void __launch_bounds__(TM * 2, 1)
conv2d_gn_stats_wgmma(float* stats, YT* y, const __half* x, const __half* w, const YT* bias, float* partials,
                      int* counters, int n, int h, int wd, int c, int k, int r, int pad, int cpg, int gs,
                      int with_stats) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using S = convwg::Shape<YT, TM, TN, STAGES>;
    constexpr int NT = S::kThreads;
    constexpr int A_PER = TM * 8 / NT, B_PER = TN * 8 / NT;   // 16-byte pieces per thread per stage
    // The apply kernel (launched with PDL) may start now: its CTAs take SM room
    // this grid leaves free and wait in griddepcontrol.wait for this grid to end.
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    uint32_t dynamic_smem;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dynamic_smem));
    if (dynamic_smem < S::kSmem) __trap();   // the host's formula (WgmmaTile.shared_bytes) fell behind kSmem

    extern __shared__ unsigned char smem_raw[];
    const uint32_t smem_base = ((uint32_t)__cvta_generic_to_shared(smem_raw) + 1023u) & ~1023u;
    unsigned char* smem = smem_raw + (smem_base - (uint32_t)__cvta_generic_to_shared(smem_raw));

    const int t = threadIdx.x, hw = h * wd, M = n * hw, KG = r * r * c;
    const int m0 = blockIdx.x * TM, n0 = blockIdx.y * TN;
    const int slices = gridDim.z, z = blockIdx.z, kb_total = KG / 64;
    const int kb_begin = (int)((long long)kb_total * z / slices), kb_end = (int)((long long)kb_total * (z + 1) / slices);
    const int kt = kb_end - kb_begin;

    // Each thread loads 16-byte piece j of rows row0 + i * NT/8 of A and B.
    const int j = t % 8, row0 = t / 8;
    int a_off[A_PER], a_p[A_PER], a_q[A_PER];
    #pragma unroll
    for (int i = 0; i < A_PER; ++i) {
        const int m = m0 + row0 + i * (NT / 8);
        const int img = m / hw, pix = m - img * hw, p = pix / wd, q = pix - p * wd;
        a_off[i] = ((img * h + p) * wd + q) * c + j * 8;
        a_p[i] = m < M ? p : -(1 << 20);   // rows past M read nothing (zeros)
        a_q[i] = q;
    }
    const __half* w_row[B_PER];
    bool b_ok[B_PER];
    #pragma unroll
    for (int i = 0; i < B_PER; ++i) {
        const int kout = n0 + row0 + i * (NT / 8);
        b_ok[i] = kout < k;
        w_row[i] = w + (size_t)(b_ok[i] ? kout : 0) * KG + j * 8;
    }
    auto load_stage = [&](int stage, int kb) {
        const int tap = kb * 64 / c, c0 = kb * 64 - tap * c, rr = tap / r, dy = rr - pad, dx = tap - rr * r - pad;
        const uint32_t a_tile = smem_base + stage * S::kStageBytes, b_tile = a_tile + TM * 128;
        const int shift = (dy * wd + dx) * c + c0;
        #pragma unroll
        for (int i = 0; i < A_PER; ++i) {
            const int ih = a_p[i] + dy, iw = a_q[i] + dx;
            const bool ok = (unsigned)ih < (unsigned)h && (unsigned)iw < (unsigned)wd;
            convwg::cp_async16(convwg::swizzled(a_tile, row0 + i * (NT / 8), j), ok ? x + a_off[i] + shift : x, ok);
        }
        #pragma unroll
        for (int i = 0; i < B_PER; ++i)
            convwg::cp_async16(convwg::swizzled(b_tile, row0 + i * (NT / 8), j), w_row[i] + kb * 64, b_ok[i]);
    };

    float acc[S::kAcc];
    #pragma unroll
    for (int i = 0; i < S::kAcc; ++i) acc[i] = 0.f;
    const int wg = t / 128;

    #pragma unroll
    for (int s = 0; s < STAGES - 2; ++s) {
        if (s < kt) load_stage(s, kb_begin + s);
        convwg::cp_async_commit();
    }
    #pragma unroll 1
    for (int i = 0; i < kt; ++i) {
        convwg::cp_async_wait<STAGES - 3>();                         // this thread's pieces of k-block i landed
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // visible to wgmma (the async proxy)
        __syncthreads();                                              // everyone's landed; wgmma(i-2) retired
        if (i + STAGES - 2 < kt) load_stage((i + STAGES - 2) % STAGES, kb_begin + i + STAGES - 2);
        convwg::cp_async_commit();
        const uint32_t a_tile = smem_base + (i % STAGES) * S::kStageBytes + wg * 64 * 128, b_tile = a_tile - wg * 64 * 128 + TM * 128;
        const uint64_t da = convwg::sw128_desc(a_tile), db = convwg::sw128_desc(b_tile);
        #pragma unroll
        for (int a = 0; a < S::kAcc; ++a) cute::warpgroup_fence_operand(acc[a]);
        cute::warpgroup_arrive();
        #pragma unroll
        for (int kk = 0; kk < 4; ++kk)   // 4 x k16; +32 bytes = +2 in the descriptor's 16-byte units
            convwg::gmma<typename convwg::Gmma<TN>::Op>(da + 2 * kk, db + 2 * kk, acc,
                                                        cuda::std::make_integer_sequence<int, S::kAcc>{});
        cute::warpgroup_commit_batch();
        cute::warpgroup_wait<1>();
        #pragma unroll
        for (int a = 0; a < S::kAcc; ++a) cute::warpgroup_fence_operand(acc[a]);
    }
    cute::warpgroup_wait<0>();
    #pragma unroll
    for (int a = 0; a < S::kAcc; ++a) cute::warpgroup_fence_operand(acc[a]);
    convwg::cp_async_wait<0>();

    const int tile_id = blockIdx.x * gridDim.y + blockIdx.y;
    if (slices > 1) {
        // [tile][slice][kAcc / 4][NT] float4: each warp writes 512 contiguous bytes
        float4* ws = reinterpret_cast<float4*>(partials) + (size_t)tile_id * slices * (S::kAcc / 4) * NT;
        #pragma unroll
        for (int a = 0; a < S::kAcc / 4; ++a)
            ws[((size_t)z * (S::kAcc / 4) + a) * NT + t] = make_float4(acc[4 * a], acc[4 * a + 1], acc[4 * a + 2], acc[4 * a + 3]);
        __threadfence();
        __syncthreads();
        __shared__ int last;
        if (t == 0) last = atomicAdd(counters + tile_id, 1) == slices - 1;
        __syncthreads();
        if (!last) return;
        __threadfence();
        #pragma unroll
        for (int a = 0; a < S::kAcc; ++a) acc[a] = 0.f;
        // Every slice's tile from the workspace (this one's too), added in slice order
        // whichever arrived last; a slice's loads are all in flight at once.
        for (int s = 0; s < slices; ++s) {
            #pragma unroll
            for (int a = 0; a < S::kAcc / 4; ++a) {
                const float4 v = __ldcg(ws + ((size_t)s * (S::kAcc / 4) + a) * NT + t);
                acc[4 * a] += v.x; acc[4 * a + 1] += v.y; acc[4 * a + 2] += v.z; acc[4 * a + 3] += v.w;
            }
        }
        if (t == 0) counters[tile_id] = 0;   // ready for the next launch (graph replays)
    }

    // Epilogue: acc + bias -> y's type -> the staged tile [TM][TN] (row stride kRowBytes).
    __syncthreads();   // every warpgroup is done with the pipeline's shared memory
    const int lane = t % 32, warp_row = wg * 64 + (t % 128) / 32 * 16 + lane / 4;
    #pragma unroll
    for (int b = 0; b < TN / 8; ++b) {
        const int col = b * 8 + (lane % 4) * 2;
        float b0 = 0.f, b1 = 0.f;
        if (n0 + col < k) { const float2 bb = convwg::load2(bias + n0 + col); b0 = bb.x; b1 = bb.y; }
        YT* r0 = reinterpret_cast<YT*>(smem + warp_row * S::kRowBytes) + col;
        YT* r1 = reinterpret_cast<YT*>(smem + (warp_row + 8) * S::kRowBytes) + col;
        convwg::store2(r0, acc[4 * b] + b0, acc[4 * b + 1] + b1);
        convwg::store2(r1, acc[4 * b + 2] + b0, acc[4 * b + 3] + b1);
    }
    __syncthreads();
    constexpr int V = 16 / sizeof(YT), RV = TN / V;   // 16-byte vectors per tile row
    const int m_end = min(m0 + TM, M);
    for (int e = t; e < TM * RV; e += NT) {
        const int row = e / RV, col = (e % RV) * V;
        if (m0 + row < m_end && n0 + col < k)
            *reinterpret_cast<uint4*>(y + (size_t)(m0 + row) * k + n0 + col) =
                *reinterpret_cast<const uint4*>(smem + row * S::kRowBytes + col * sizeof(YT));
    }
    if (!with_stats) return;

    // Per channel and image segment: shifted sums over the rows (shift = the
    // segment's first row, so M2 = S2 - S1^2/n cancels little when |mean| >> std).
    const int boundary = min((m0 / hw + 1) * hw, m_end);
    float* scratch = reinterpret_cast<float*>(smem + TM * S::kRowBytes);   // [kSlices][2][TN] (S1, S2)
    float* chan = scratch + S::kSlices * 2 * TN * 2;                        // [2][TN] (mean, M2)
    const int cp = t % (TN / 2), sl = t / (TN / 2);
    if (sl < S::kSlices) {
        float sh[2][2], s1[2][2] = {}, s2[2][2] = {};
        #pragma unroll
        for (int sg = 0; sg < 2; ++sg) {
            const int row = (sg == 0 ? m0 : boundary) - m0;
            const float2 v = row < m_end - m0 ? convwg::load2(reinterpret_cast<const YT*>(smem + row * S::kRowBytes) + 2 * cp)
                                              : make_float2(0.f, 0.f);
            sh[sg][0] = v.x; sh[sg][1] = v.y;
        }
        #pragma unroll 4
        for (int row = sl; row < m_end - m0; row += S::kSlices) {   // unrolled: several loads in flight
            const float2 v = convwg::load2(reinterpret_cast<const YT*>(smem + row * S::kRowBytes) + 2 * cp);
            if (m0 + row < boundary) {   // branches, not an index: the sums stay in registers
                const float d0 = v.x - sh[0][0], d1 = v.y - sh[0][1];
                s1[0][0] += d0; s2[0][0] += d0 * d0; s1[0][1] += d1; s2[0][1] += d1 * d1;
            } else {
                const float d0 = v.x - sh[1][0], d1 = v.y - sh[1][1];
                s1[1][0] += d0; s2[1][0] += d0 * d0; s1[1][1] += d1; s2[1][1] += d1 * d1;
            }
        }
        #pragma unroll
        for (int sg = 0; sg < 2; ++sg)
            #pragma unroll
            for (int u = 0; u < 2; ++u) {
                float* d = scratch + ((sl * 2 + sg) * TN + 2 * cp + u) * 2;
                d[0] = s1[sg][u];
                d[1] = s2[sg][u];
            }
    }
    __syncthreads();
    for (int e = t; e < 2 * TN; e += NT) {   // slices in a fixed order
        const int sg = e / TN, col = e % TN;
        const int rows = sg == 0 ? boundary - m0 : m_end - boundary;
        float a = 0.f, b = 0.f;
        for (int s = 0; s < S::kSlices; ++s) {
            const float* d = scratch + ((s * 2 + sg) * TN + col) * 2;
            a += d[0];
            b += d[1];
        }
        const float shv = rows > 0 ? (float)reinterpret_cast<const YT*>(smem + ((sg == 0 ? m0 : boundary) - m0) * S::kRowBytes)[col]
                                   : 0.f;
        const float md = rows > 0 ? a / rows : 0.f;
        chan[e * 2] = shv + md;
        chan[e * 2 + 1] = rows > 0 ? fmaxf(b - a * md, 0.f) : 0.f;
    }
    __syncthreads();
    float2* out = reinterpret_cast<float2*>(stats) + ((size_t)tile_id * slices + (slices - 1)) * 2 * gs;
    channels_to_groups(chan, out, TN, n0, k, cpg, gs, boundary - m0, m_end - boundary);
#endif
}
