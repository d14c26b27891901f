// Fused Conv2D -> GroupNorm -> activation, launch 1 of 2, Hopper path (issue 6;
// launch 2 is gn_act.cu; the CUTLASS 2.x path for other GPUs and shapes is conv2d_gn.cu).
//
// An implicit-GEMM fprop written for sm_90a: y[M = N*H*W, K] = im2col(x)[M, R*S*C] . w^T + bias,
// fp16 in, fp32 accumulation in WGMMA (warpgroup MMA, the instruction that feeds
// Hopper's tensor cores at full rate; CUTLASS 2.x's mma.sync reaches about half of it).
//
// * Mainloop: one k-block is 64 channels of one filter tap, so each A row is
//   128 contiguous bytes of x (an input pixel, or zeros in the padding) and each
//   B row 128 contiguous bytes of w (KRSC).  The TMA unit copies both tiles into
//   a ring of STAGES shared-memory stages laid out in WGMMA's 128-byte swizzle;
//   each of the TM/64 warpgroups multiplies its 64 rows by the TN columns with
//   wgmma.m64nTNk16, both operands read straight from shared memory.  Where the
//   image width lets A be one TMA box (LOADS = 2) the loads are warp-specialized:
//   one extra producer warp refills each stage as soon as every consumer warp's
//   wgmma reading it has retired (a full and an empty mbarrier per stage), so the
//   consumers never wait at a CTA-wide barrier.  Otherwise (LOADS = 1) every
//   thread gathers A with cp.async, loads run STAGES-2 k-blocks ahead, and a
//   __syncthreads per k-block recycles the stages.
// * Split-K (grid z = slices): the slices of one tile form a thread-block cluster.
//   Each leaves its fp32 accumulators in its own shared memory; after a cluster
//   barrier slice z adds rows [z R, z R + R) of every slice's tile through
//   distributed shared memory (in slice order: deterministic) and runs the
//   epilogue on those rows; the last slice merges the slices' GroupNorm partials.
//   No global workspace, no atomics, the epilogue split S ways.  Where the
//   tiles' clusters would not all fit the GPU at once (the H100 holds 30
//   clusters of 4, so C=1280 16x16 N=2 at 128x160 x 4 slices, 32 tiles, would
//   run in two rounds) the same kernel launched without clusters
//   (workspace_split) meets its slices in a global workspace instead: the last
//   slice of a tile to arrive adds every slice's tile, in slice order, and runs
//   the whole epilogue.
// * Epilogue: acc + bias, rounded to y's type, staged in shared memory; from
//   there it leaves in coalesced 16-byte stores, and the GroupNorm partials of
//   the values as stored are computed from the same shared tile (no re-read of
//   y), per image segment and channel with shifted sums, then merged per group
//   (groupnorm.cuh).  Deterministic: fixed orders, no float atomics.
//
// Measured on the H100 (bare conv, graph replays, us; docs/conv.md has the rest):
// before the cluster split-K, the last-arriving slice added every slice's tile
// from a global workspace and ran the whole epilogue alone: at C=1280 16x16 N=2
// (128x160, 4 slices) the mainloop alone took 22.3, with the epilogue but no
// fix-up 27.5, the whole kernel 41.9; with the producer warp 35.1.
#include <cuda_fp16.h>
#include <cuda/std/utility>
#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <cute/arch/mma_sm90_gmma_ext.hpp>

#include "groupnorm.cuh"

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

// -- operands through TMA (tensor memory access) -----------------------------------------
//
// One thread asks the TMA unit for a whole box (a 128-row A tile, a TN-row B tile),
// which lands in the 128-byte swizzle WGMMA reads and completes on the stage's
// mbarrier.  Measured on the H100 (C=320 64x64 N=1, wg128x160 split 2, bare conv,
// graph replays): every thread gathering 16-byte pieces with cp.async, A and B,
// 27.4 us; B by TMA 26.0; A and B by TMA 24.2-24.5 (docs/conv.md has the rest).
// With B by TMA and A's loads compiled out the kernel ran 19.5 us, with B's 24.8:
// the per-thread gather, not L2's bandwidth, was what cost.  So weight tiles
// shared by a cluster (TMA multicast, 2 or 4 CTAs along M) bought nothing: 26.6 /
// 43 us with a relaxed cluster barrier per k-block, 42 / 68 us with a
// release/acquire one.
__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    asm volatile("{\n\t.reg .pred done;\n"
                 "WAIT:\n\tmbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "\t@!done bra WAIT;\n}" ::"r"(bar), "r"(parity) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// A barrier of the CTA's first NT threads (the consumers; named barrier 1):
// the producer warp, which has its own path, is not waited for.
template <int NT>
__device__ __forceinline__ void csync() { asm volatile("bar.sync 1, %0;" ::"n"(NT) : "memory"); }

// Thread-block cluster barrier: every thread of every CTA of the cluster arrives
// (release) and waits (acquire); the call must be warp-uniform.
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ unsigned cluster_size() {
    unsigned n;
    asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
    return n;
}
// The address of *p in the shared memory of the cluster's CTA `rank` (a generic
// pointer: plain loads and stores reach it through distributed shared memory)
template <typename T>
__device__ __forceinline__ T* cluster_map(T* p, int rank) {
    uint64_t r;
    asm volatile("mapa.u64 %0, %1, %2;" : "=l"(r) : "l"(p), "r"(rank));
    return reinterpret_cast<T*>(r);
}

// The box of the tensor map at these coordinates (innermost first; out of the
// tensor's bounds reads zeros) into dst, completing on bar.
__device__ __forceinline__ void tma_load(uint32_t dst, const void* tmap, uint32_t bar, int c0, int c1) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
                 ::"r"(dst), "l"(tmap), "r"(bar), "r"(c0), "r"(c1) : "memory");
}
__device__ __forceinline__ void tma_load(uint32_t dst, const void* tmap, uint32_t bar, int c0, int c1, int c2, int c3) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%3, %4, %5, %6}], [%2];"
                 ::"r"(dst), "l"(tmap), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
}

// Tensor map `which` (0: x, 1: w) of this launch, pointing at `ptr`; the whole warp
// calls it.  The plan encoded a template of each once on the host (shape, strides,
// box, swizzle: kernels/conv.py); each CTA keeps its own copies in the workspace
// (`tmaps`: the 2 templates, 2 maps per CTA, then 2 tags per CTA) with the address
// patched in on the device, so a new x or w -- a graph parameter update included --
// needs nothing from the host.  Steady state: the tag already names ptr, one load.
__device__ __forceinline__ const void* tensor_map(unsigned char* tmaps, int which, const void* ptr) {
    __shared__ __align__(128) unsigned int scratch[32];
    const int lane = threadIdx.x & 31;
    const int ctas = gridDim.x * gridDim.y * gridDim.z;
    const int slot = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    unsigned char* map = tmaps + 128 * (2 + 2 * slot + which);
    unsigned long long* tag = reinterpret_cast<unsigned long long*>(tmaps + 256 * (1 + ctas)) + 2 * slot + which;
    const unsigned long long want = (unsigned long long)ptr;
    if (__ldcg(tag) != want) {   // the same address for every lane: a uniform branch
        __syncwarp();
        scratch[lane] = __ldcg(reinterpret_cast<const unsigned int*>(tmaps + 128 * which) + lane);
        __syncwarp();
        if (lane == 0)
            asm volatile("tensormap.replace.tile.global_address.shared::cta.b1024.b64 [%0], %1;"
                         ::"r"(smem_u32(scratch)), "l"(want) : "memory");
        __syncwarp();
        asm volatile("tensormap.cp_fenceproxy.global.shared::cta.tensormap::generic.release.gpu.sync.aligned"
                     " [%0], [%1], 128;" ::"l"(map), "r"(smem_u32(scratch)) : "memory");
        if (lane == 0) *tag = want;
    }
    asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;" ::"l"(map) : "memory");
    return map;
}

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

template <typename ST, int TM, int TN, int STAGES>
struct Shape {   // ST: the type the output tile is staged in (y's type, or float for the one-launch kernel)
    static constexpr int kThreads = TM * 2;                    // TM / 64 warpgroups (the consumers)
    static constexpr int kStageBytes = (TM + TN) * 128;         // A then B, 64 fp16 of K per row
    static constexpr int kAcc = TN / 2;                         // fp32 accumulators per thread
    static constexpr int kRowBytes = TN * (int)sizeof(ST) + 16; // staged output row (padded: no bank conflicts)
    static constexpr int kSlices = kThreads / (TN / 2);         // row slices of the statistics pass
    // [kSlices][2][TN] (S1, S2) scratch, [2][TN] (mean, M2), [2][TN] scale and shift
    static constexpr int kScratchBytes = (kSlices * 2 + 4) * TN * 2 * 4;
    // staged tile, then the scratch
    static constexpr int kEpilogueBytes = TM * kRowBytes + kScratchBytes;
    // split-K in a cluster: this slice's fp32 tile (read by the others), the staged
    // rows of this slice (at most TM / 2), the scratch, and the last slice's inbox of
    // every slice's group partials ([8 slices][2][GS <= TN + 1] float2)
    static constexpr int kAccRowBytes = TN * 4 + 16;
    static constexpr int kAccBytes = TM * kAccRowBytes;
    static constexpr int kInboxBytes = 8 * 2 * (TN + 1) * 8;
    static constexpr int kClusterEpilogueBytes = kAccBytes + TM / 2 * kRowBytes + kScratchBytes + kInboxBytes;
    static constexpr int kMain = STAGES * kStageBytes;
    static constexpr int kMax1 = kMain > kEpilogueBytes ? kMain : kEpilogueBytes;
    static constexpr int kSmem = (kMax1 > kClusterEpilogueBytes ? kMax1 : kClusterEpilogueBytes) + 1024;  // + alignment
    static_assert(TM % 64 == 0 && TN % 16 == 0 && STAGES >= 3, "tile shape");
    static_assert((TM * 8) % kThreads == 0 && (TN * 8) % kThreads == 0, "loaders cover the tile evenly");
    static_assert(kSlices >= 1, "one thread per channel pair at least");
    static_assert(kStageBytes % 1024 == 0 && (TM * 128) % 1024 == 0, "swizzle atoms stay 1024-byte aligned");
    static_assert(kAccBytes % 16 == 0 && kRowBytes % 16 == 0 && kScratchBytes % 16 == 0, "16-byte aligned regions");
};

// The shared memory, aligned to 1024 bytes; traps if the launch gave less than
// kSmem (the host's formula, WgmmaTile.shared_bytes, fell behind).
template <int kSmem>
__device__ __forceinline__ unsigned char* aligned_smem(unsigned char* raw, uint32_t& base) {
    uint32_t dynamic_smem;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dynamic_smem));
    if (dynamic_smem < kSmem) __trap();
    const uint32_t raw_addr = (uint32_t)__cvta_generic_to_shared(raw);
    base = (raw_addr + 1023u) & ~1023u;
    return raw + (base - raw_addr);
}

// Split-K slice blockIdx.z of gridDim.z takes k-blocks [kb_begin, kb_begin + kt).
__device__ __forceinline__ void slice_kblocks(int kb_total, int& kb_begin, int& kt) {
    kb_begin = (int)((long long)kb_total * blockIdx.z / gridDim.z);
    kt = (int)((long long)kb_total * (blockIdx.z + 1) / gridDim.z) - kb_begin;
}

// k-block kb (64 channels of one filter tap): its first channel and the tap's offset.
__device__ __forceinline__ void tap_of(int kb, int c, int r, int pad, int& c0, int& dy, int& dx) {
    const int tap = kb * 64 / c, rr = tap / r;
    c0 = kb * 64 - tap * c;
    dy = rr - pad;
    dx = tap - rr * r - pad;
}

// One k-block of this warpgroup's 64 x TN accumulators from the stage at `stage`
// (A: TM rows, then B: TN rows); leaves this batch in flight and retires the previous.
template <int TM, int TN>
__device__ __forceinline__ void mma_kblock(float* acc, uint32_t stage, int wg) {
    using S = Shape<float, TM, TN, 3>;
    const uint64_t da = sw128_desc(stage + wg * 64 * 128), db = sw128_desc(stage + TM * 128);
    #pragma unroll
    for (int a = 0; a < S::kAcc; ++a) cute::warpgroup_fence_operand(acc[a]);
    cute::warpgroup_arrive();
    #pragma unroll
    for (int kk = 0; kk < 4; ++kk)   // 4 x k16; +32 bytes = +2 in the descriptor's 16-byte units
        gmma<typename Gmma<TN>::Op>(da + 2 * kk, db + 2 * kk, acc, cuda::std::make_integer_sequence<int, S::kAcc>{});
    cute::warpgroup_commit_batch();
    cute::warpgroup_wait<1>();
    #pragma unroll
    for (int a = 0; a < S::kAcc; ++a) cute::warpgroup_fence_operand(acc[a]);
}

template <int TN>
__device__ __forceinline__ void mma_drain(float* acc) {
    cute::warpgroup_wait<0>();
    #pragma unroll
    for (int a = 0; a < TN / 2; ++a) cute::warpgroup_fence_operand(acc[a]);
}

// acc (this thread's part of the CTA's TM x TN fp32 tile) = im2col(x) . w^T over
// this split-K slice's share of the R*S*C / 64 k-blocks; every thread of the CTA
// computes (the LOADS = 1 conv and the one-launch kernel).
//
// B (TN rows of w x 64 channels) always comes by TMA (tmap_b, made by warp 0).
// LOADS = 2: A too, as a box of whole image rows of x (tmap_a: [N, H, W, C], box
// [1, TM/W rows, W, 64 channels]; the plan picks it when W divides TM and TM
// divides H*W), shifted by the filter tap, the padding being the box's
// out-of-bounds zeros; thread 0 issues both copies of a stage.  LOADS = 1 (other
// widths): every thread gathers 16-byte pieces of A with cp.async (zero-fill for
// the padding and rows past M).
template <int TM, int TN, int STAGES, int LOADS>
__device__ __forceinline__ void mainloop(float* acc, uint32_t smem_base, const __half* x, const __half* w,
                                         unsigned char* tmaps, int n, int h, int wd, int c, int k, int r, int pad,
                                         int m0, int n0) {
    using S = Shape<float, TM, TN, STAGES>;
    constexpr int NT = S::kThreads;
    constexpr int A_PER = TM * 8 / NT;   // 16-byte pieces of A per thread per stage (LOADS = 1)
    static_assert(LOADS == 1 || LOADS == 2, "w always comes through TMA");
    const int t = threadIdx.x, hw = h * wd, M = n * hw;
    int kb_begin, kt;
    slice_kblocks(r * r * c / 64, kb_begin, kt);
    const void *tmap_a = nullptr, *tmap_b = nullptr;   // made by warp 0, used by thread 0
    if (t < 32) {
        if (LOADS == 2) tmap_a = tensor_map(tmaps, 0, x);
        tmap_b = tensor_map(tmaps, 1, w);
    }
    __shared__ __align__(8) unsigned long long full[STAGES];   // stage s's TMA copies have landed
    const uint32_t bars = smem_u32(full);
    const int img0 = m0 / hw, p0 = (m0 - img0 * hw) / wd, q0 = m0 - img0 * hw - p0 * wd;   // the A box's origin

    // LOADS = 1: each thread loads 16-byte piece j of rows row0 + i * NT/8 of A.
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
    auto load_stage = [&](int stage, int kb) {
        int c0, dy, dx;
        tap_of(kb, c, r, pad, c0, dy, dx);
        const uint32_t a_tile = smem_base + stage * S::kStageBytes, b_tile = a_tile + TM * 128;
        const int shift = (dy * wd + dx) * c + c0;
        if constexpr (LOADS < 2) {
            #pragma unroll
            for (int i = 0; i < A_PER; ++i) {
                const int ih = a_p[i] + dy, iw = a_q[i] + dx;
                const bool ok = (unsigned)ih < (unsigned)h && (unsigned)iw < (unsigned)wd;
                cp_async16(swizzled(a_tile, row0 + i * (NT / 8), j), ok ? x + a_off[i] + shift : x, ok);
            }
        }
        if (t == 0) {   // rows past K, pixels in the padding: zeros (the maps' bounds)
            const uint32_t bar = bars + stage * 8;
            mbar_expect_tx(bar, (LOADS == 2 ? TM + TN : TN) * 128);
            if constexpr (LOADS == 2) tma_load(a_tile, tmap_a, bar, c0, q0 + dx, p0 + dy, img0);
            tma_load(b_tile, tmap_b, bar, kb * 64, n0);
        }
    };

    #pragma unroll
    for (int i = 0; i < S::kAcc; ++i) acc[i] = 0.f;
    const int wg = t / 128;
    if (t == 0) {   // the stages' mbarriers, initialized before any copy lands
        #pragma unroll
        for (int s = 0; s < STAGES; ++s) mbar_init(bars + s * 8, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    #pragma unroll
    for (int s = 0; s < STAGES - 2; ++s) {
        if (s < kt) load_stage(s, kb_begin + s);
        if constexpr (LOADS < 2) cp_async_commit();
    }
    #pragma unroll 1
    for (int i = 0; i < kt; ++i) {
        if constexpr (LOADS < 2) cp_async_wait<STAGES - 3>();          // this thread's pieces of k-block i landed
        mbar_wait(bars + (i % STAGES) * 8, (i / STAGES) & 1);         // and the TMA's boxes
        if constexpr (LOADS < 2) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // cp.async -> wgmma
        __syncthreads();                                              // everyone's landed; wgmma(i-2) retired
        if (i + STAGES - 2 < kt) load_stage((i + STAGES - 2) % STAGES, kb_begin + i + STAGES - 2);
        if constexpr (LOADS < 2) cp_async_commit();
        mma_kblock<TM, TN>(acc, smem_base + (i % STAGES) * S::kStageBytes, wg);
    }
    mma_drain<TN>(acc);
    cp_async_wait<0>();
}

// The same product with A and B by TMA (LOADS = 2), warp-specialized: the CTA's
// NT consumer threads (TM / 64 warpgroups) only multiply; one more warp, the
// producer, issues each stage's two copies as soon as the stage is free.  A stage
// has a full mbarrier (the copies' bytes landed) and an empty one (every consumer
// warp's wgmma reading it retired: NT / 32 arrivals), so the loads run up to
// STAGES k-blocks ahead and no CTA-wide barrier stalls the tensor cores.
// Returns true in the consumers, false in the producer warp (acc untouched).
// Measured on the H100 (bare conv, us): C=1280 16x16 N=2 41.9 -> 35.1, N=1
// 29.5 -> 25.0, C=320 64x64 N=1 23.8 -> 22.6 (docs/conv.md).
template <int TM, int TN, int STAGES>
__device__ __forceinline__ bool mainloop_ws(float* acc, uint32_t smem_base, const __half* x, const __half* w,
                                            unsigned char* tmaps, int n, int h, int wd, int c, int k, int r, int pad,
                                            int m0, int n0) {
    using S = Shape<float, TM, TN, STAGES>;
    constexpr int NT = S::kThreads;
    const int t = threadIdx.x, hw = h * wd;
    int kb_begin, kt;
    slice_kblocks(r * r * c / 64, kb_begin, kt);
    __shared__ __align__(8) unsigned long long full[STAGES], empty[STAGES];
    const uint32_t full_bar = smem_u32(full), empty_bar = smem_u32(empty);
    if (t == 0) {
        #pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full_bar + s * 8, 1);
            mbar_init(empty_bar + s * 8, NT / 32);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (t >= NT) {   // the producer warp
        const void* tmap_a = tensor_map(tmaps, 0, x);
        const void* tmap_b = tensor_map(tmaps, 1, w);
        if (t == NT) {
            const int img0 = m0 / hw, p0 = (m0 - img0 * hw) / wd, q0 = m0 - img0 * hw - p0 * wd;  // A box origin
            for (int i = 0; i < kt; ++i) {
                const int s = i % STAGES;
                if (i >= STAGES) mbar_wait(empty_bar + s * 8, (i / STAGES - 1) & 1);   // k-block i - STAGES retired
                int c0, dy, dx;
                tap_of(kb_begin + i, c, r, pad, c0, dy, dx);
                const uint32_t a_tile = smem_base + s * S::kStageBytes, bar = full_bar + s * 8;
                mbar_expect_tx(bar, (TM + TN) * 128);
                tma_load(a_tile, tmap_a, bar, c0, q0 + dx, p0 + dy, img0);
                tma_load(a_tile + TM * 128, tmap_b, bar, (kb_begin + i) * 64, n0);
            }
        }
        __syncwarp();
        return false;
    }
    #pragma unroll
    for (int i = 0; i < S::kAcc; ++i) acc[i] = 0.f;
    const int wg = t / 128;
    #pragma unroll 1
    for (int i = 0; i < kt; ++i) {
        mbar_wait(full_bar + (i % STAGES) * 8, (i / STAGES) & 1);
        mma_kblock<TM, TN>(acc, smem_base + (i % STAGES) * S::kStageBytes, wg);
        if (i > 0 && (t & 31) == 0) mbar_arrive(empty_bar + ((i - 1) % STAGES) * 8);   // wgmma(i-1) retired
    }
    mma_drain<TN>(acc);
    return true;
}

// Split-K through a global workspace (the one-launch kernel, which is cooperative and
// so has no clusters, and the two-launch conv where a cluster per tile would not fit
// the GPU at once): every slice stores its accumulators to the workspace; the CTA
// that arrives last at the tile's counter gets every slice's tile added in slice
// order (deterministic whoever is last) and returns true; the others false.  The
// NT consumer threads call it (the producer warp may have left).
template <int NT, int ACC>
__device__ __forceinline__ bool splitk_reduce(float* acc, float* partials, int* counters, int tile_id, int slices,
                                              int z) {
    const int t = threadIdx.x;
    // [tile][slice][ACC / 4][NT] float4: each warp writes 512 contiguous bytes
    float4* ws = reinterpret_cast<float4*>(partials) + (size_t)tile_id * slices * (ACC / 4) * NT;
    #pragma unroll
    for (int a = 0; a < ACC / 4; ++a)
        ws[((size_t)z * (ACC / 4) + a) * NT + t] = make_float4(acc[4 * a], acc[4 * a + 1], acc[4 * a + 2], acc[4 * a + 3]);
    __threadfence();
    csync<NT>();
    __shared__ int last;
    if (t == 0) last = atomicAdd(counters + tile_id, 1) == slices - 1;
    csync<NT>();
    if (!last) return false;
    __threadfence();
    #pragma unroll
    for (int a = 0; a < ACC; ++a) acc[a] = 0.f;
    // this slice's tile is read back too: the order stays fixed, and a slice's loads are all in flight at once
    for (int s = 0; s < slices; ++s) {
        #pragma unroll
        for (int a = 0; a < ACC / 4; ++a) {
            const float4 v = __ldcg(ws + ((size_t)s * (ACC / 4) + a) * NT + t);
            acc[4 * a] += v.x; acc[4 * a + 1] += v.y; acc[4 * a + 2] += v.z; acc[4 * a + 3] += v.w;
        }
    }
    if (t == 0) counters[tile_id] = 0;   // ready for the next launch (graph replays)
    return true;
}

// acc + bias (none if bias is null), converted to ST, into the staged tile [TM][TN]
// (row stride kRowBytes).
template <typename ST, typename BT, int TM, int TN>
__device__ __forceinline__ void stage_tile(const float* acc, const BT* bias, unsigned char* smem, int n0, int k) {
    using S = Shape<ST, TM, TN, 3>;
    const int t = threadIdx.x, lane = t % 32, wg = t / 128;
    const int row = wg * 64 + (t % 128) / 32 * 16 + lane / 4;   // WGMMA's accumulator layout
    #pragma unroll
    for (int b = 0; b < TN / 8; ++b) {
        const int col = b * 8 + (lane % 4) * 2;
        float b0 = 0.f, b1 = 0.f;
        if (bias != nullptr && n0 + col < k) { const float2 bb = load2(bias + n0 + col); b0 = bb.x; b1 = bb.y; }
        store2(reinterpret_cast<ST*>(smem + row * S::kRowBytes) + col, acc[4 * b] + b0, acc[4 * b + 1] + b1);
        store2(reinterpret_cast<ST*>(smem + (row + 8) * S::kRowBytes) + col, acc[4 * b + 2] + b0, acc[4 * b + 3] + b1);
    }
}

// The GroupNorm partials of the staged rows (smem: rows [m0, m_end), the second
// image's from `boundary` on) into out: per channel and segment, shifted sums over
// the rows (shift = the segment's first row, so M2 = S2 - S1^2/n cancels little
// when |mean| >> std), then the channels of each group merged (groupnorm.cuh).
// scratch: kScratchBytes of shared memory; the consumer threads call it.
template <typename ST, int TM, int TN>
__device__ __forceinline__ void tile_partials(const unsigned char* smem, unsigned char* scratch_bytes, float2* out,
                                              int m0, int m_end, int boundary, int n0, int k, int cpg, int gs) {
    using S = Shape<ST, TM, TN, 3>;
    constexpr int NT = S::kThreads;
    const int t = threadIdx.x;
    float* scratch = reinterpret_cast<float*>(scratch_bytes);   // [kSlices][2][TN] (S1, S2)
    float* chan = scratch + S::kSlices * 2 * TN * 2;             // [2][TN] (mean, M2)
    auto at = [&](int row) { return reinterpret_cast<const ST*>(smem + row * S::kRowBytes); };
    const int cp = t % (TN / 2), sl = t / (TN / 2);
    if (sl < S::kSlices) {
        float sh[2][2], s1[2][2] = {}, s2[2][2] = {};
        #pragma unroll
        for (int sg = 0; sg < 2; ++sg) {
            const int row = (sg == 0 ? m0 : boundary) - m0;
            const float2 v = row < m_end - m0 ? load2(at(row) + 2 * cp) : make_float2(0.f, 0.f);
            sh[sg][0] = v.x; sh[sg][1] = v.y;
        }
        #pragma unroll 4
        for (int row = sl; row < m_end - m0; row += S::kSlices) {   // unrolled: several loads in flight
            const float2 v = load2(at(row) + 2 * cp);
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
    csync<NT>();
    for (int e = t; e < 2 * TN; e += NT) {   // slices in a fixed order
        const int sg = e / TN, col = e % TN;
        const int rows = sg == 0 ? boundary - m0 : m_end - boundary;
        float a = 0.f, b = 0.f;
        for (int s = 0; s < S::kSlices; ++s) {
            const float* d = scratch + ((s * 2 + sg) * TN + col) * 2;
            a += d[0];
            b += d[1];
        }
        const float shv = rows > 0 ? (float)at((sg == 0 ? m0 : boundary) - m0)[col] : 0.f;
        const float md = rows > 0 ? a / rows : 0.f;
        chan[e * 2] = shv + md;
        chan[e * 2 + 1] = rows > 0 ? fmaxf(b - a * md, 0.f) : 0.f;
    }
    csync<NT>();
    channels_to_groups(chan, out, TN, n0, k, cpg, gs, boundary - m0, m_end - boundary, NT);
}

// y rows [m0, m_end) from the staged rows (row 0 = m0) in coalesced 16-byte stores.
template <typename ST, int TM, int TN>
__device__ __forceinline__ void store_rows(const unsigned char* staged, ST* y, int m0, int m_end, int n0, int k) {
    using S = Shape<ST, TM, TN, 3>;
    constexpr int V = 16 / sizeof(ST), RV = TN / V;   // 16-byte vectors per tile row
    for (int e = threadIdx.x; e < (m_end - m0) * RV; e += S::kThreads) {
        const int row = e / RV, col = (e % RV) * V;
        if (n0 + col < k)
            *reinterpret_cast<uint4*>(y + (size_t)(m0 + row) * k + n0 + col) =
                *reinterpret_cast<const uint4*>(staged + row * S::kRowBytes + col * sizeof(ST));
    }
}

__device__ __forceinline__ void store4(__half* p, float4 v) {
    store2(p, v.x, v.y);
    store2(p + 2, v.z, v.w);
}
__device__ __forceinline__ void store4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }

// -- split-K in a thread-block cluster -------------------------------------------------
//
// The cluster is the tile's `slices` CTAs (rank = blockIdx.z); each has left its fp32
// tile in `mine` (kAccRowBytes rows).  Rows [r0, r0 + rows) summed over the slices in
// rank order through distributed shared memory, + bias, as ST into `staged`.
// Measured on the H100 (bare conv, us; 1 k-block per slice to expose the fixed
// costs): C=1280 16x16 N=1, 128x160 x 6 slices: 10.0 in all, 7.0 without this sum,
// 5.6 without the two cluster barriers either, 4.2 without any epilogue.  Every
// slice pushing its rows into the owners' shared memory (remote stores) instead
// of the owners pulling them was 2-10 us slower at every shape and split.
template <typename ST, int TM, int TN>
__device__ __forceinline__ void cluster_sum_rows(float* mine, const ST* bias, unsigned char* staged, int r0, int rows,
                                                 int slices, int n0, int k) {
    using S = Shape<ST, TM, TN, 3>;
    constexpr int V = TN / 4, ROW = S::kAccRowBytes / 4;   // float4 per row; floats per fp32 row
    const float* src[8];
    #pragma unroll
    for (int s = 0; s < 8; ++s) src[s] = cluster_map(mine, s < slices ? s : 0);
    for (int e = threadIdx.x; e < rows * V; e += S::kThreads) {
        const int row = e / V, col = (e % V) * 4, at = (r0 + row) * ROW + col;
        float4 v[8];
        #pragma unroll
        for (int s = 0; s < 8; ++s)   // every slice's load in flight before the adds
            if (s < slices) v[s] = *reinterpret_cast<const float4*>(src[s] + at);
        float4 sum = v[0];
        #pragma unroll
        for (int s = 1; s < 8; ++s)
            if (s < slices) { sum.x += v[s].x; sum.y += v[s].y; sum.z += v[s].z; sum.w += v[s].w; }
        if (n0 + col < k) {   // K % 8 == 0: the 4 columns are in or out together
            const float2 b0 = load2(bias + n0 + col), b1 = load2(bias + n0 + col + 2);
            sum.x += b0.x; sum.y += b0.y; sum.z += b1.x; sum.w += b1.y;
        }
        store4(reinterpret_cast<ST*>(staged + row * S::kRowBytes) + col, sum);
    }
}

// The rows of slice s of a tile of TM rows from m0 (M rows in all): [ms, me), the
// second image's from bd on.  Slices are ceil(TM / slices) rows; the last may be short
// or empty.
struct SliceRows {
    int ms, me, bd;
    __device__ __forceinline__ SliceRows(int m0, int TM, int M, int hw, int slices, int s) {
        const int per = (TM + slices - 1) / slices;
        ms = min(m0 + s * per, m0 + TM);
        me = max(ms, min(min(ms + per, m0 + TM), M));
        bd = min((ms / hw + 1) * hw, me);
    }
};

// The tile's GroupNorm partials ([2 segments][gs] (mean, M2), as tile_partials makes
// them for a whole tile) from the slices' (`inbox`: [slices][2][gs]), merged in slice
// order (Chan).  A slice's segment 0 is the tile's second when the slice starts in
// the tile's second image.
template <int NT, int TN>
__device__ __forceinline__ void merge_slices(const float2* inbox, float2* out, int slices, int m0, int TM, int M, int hw,
                                             int n0, int k, int cpg, int gs) {
    const int img0 = m0 / hw, g0 = n0 / cpg;
    for (int e = threadIdx.x; e < 2 * gs; e += NT) {
        const int seg = e / gs, lg = e % gs, g = g0 + lg;
        const int chans = min(min((g + 1) * cpg, n0 + TN), k) - max(g * cpg, n0);
        float cnt = 0.f, mean = 0.f, m2 = 0.f;
        for (int s = 0; s < slices && chans > 0; ++s) {
            const SliceRows sr(m0, TM, M, hw, slices, s);
            #pragma unroll
            for (int u = 0; u < 2; ++u) {
                const int rows = u == 0 ? sr.bd - sr.ms : sr.me - sr.bd;
                if (rows <= 0 || sr.ms / hw + u - img0 != seg) continue;
                const float2 v = inbox[(s * 2 + u) * gs + lg];
                chan_merge(cnt, mean, m2, (float)rows * (float)chans, v.x, v.y);
            }
        }
        out[e] = make_float2(mean, m2);
    }
}

// A barrier of `count` CTAs (all resident: the launch is cooperative), reusable
// launch after launch: bar[0] counts arrivals, bar[1] is a generation number the
// last arrival bumps after resetting the count.  Release/acquire through
// __threadfence, so every CTA's writes before it are visible to all after it.
__device__ __forceinline__ void grid_barrier(int* bar, int count) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        volatile int* generation = bar + 1;
        const int gen = *generation;   // read before arriving: it cannot move until everyone has
        if (atomicAdd(bar, 1) == count - 1) {
            atomicExch(bar, 0);
            __threadfence();
            atomicAdd(bar + 1, 1);
        } else {
            while (*generation == gen) __nanosleep(64);
        }
        __threadfence();
    }
    __syncthreads();
}

}  // namespace convwg

// Launch 1 of 2: y [N*H*W, K] = conv(x [N,H,W,C], w [K,R,R,C]) + bias (stride 1, padding
// pad), and the GroupNorm partials of every tile (with_stats).  Grid (M tiles, K tiles,
// split-K slices), the slices of a tile one cluster, or (workspace_split) none, the
// slices meeting in `partials` ([tiles][slices][TM * TN] fp32) and `counters` ([tiles],
// zero, left zero); stats [MT, NT, KS * 2 * GS * 2]: the tile's values go to the last
// slice's slot.  Block: 2 * TM consumer threads, +
// the producer warp when LOADS = 2.  LOADS and tmaps: see mainloop, mainloop_ws and
// tensor_map.  Needs C % 64 == 0, K % 8 == 0, H*W >= TM (checked by kernels/conv.py).
template <typename YT, int TM, int TN, int STAGES, int LOADS>
__global__ void __launch_bounds__(TM * 2 + 32, 1)
conv2d_gn_stats_wgmma(float* stats, YT* y, const __half* x, const __half* w, const YT* bias, unsigned char* tmaps,
                      float* partials, int* counters, int n, int h, int wd, int c, int k, int r, int pad, int cpg,
                      int gs, int with_stats, int workspace_split) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using S = convwg::Shape<YT, TM, TN, STAGES>;
    constexpr int NT = S::kThreads;
    // The apply kernel (launched with PDL) may start now: its CTAs take SM room
    // this grid leaves free and wait in griddepcontrol.wait for this grid to end.
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    extern __shared__ unsigned char smem_raw[];
    uint32_t smem_base;
    unsigned char* smem = convwg::aligned_smem<S::kSmem>(smem_raw, smem_base);
    const int hw = h * wd, M = n * hw, slices = gridDim.z, z = blockIdx.z;
    const int m0 = blockIdx.x * TM, n0 = blockIdx.y * TN, tile_id = blockIdx.x * gridDim.y + blockIdx.y;
    // launched without the cluster (or the workspace) its split-K needs
    if (slices > 1 && convwg::cluster_size() != (workspace_split ? 1u : (unsigned)slices)) __trap();
    float2* out = reinterpret_cast<float2*>(stats) + ((size_t)tile_id * slices + (slices - 1)) * 2 * gs;
    float acc[S::kAcc];
    bool consumer = true;
    if constexpr (LOADS == 2)
        consumer = convwg::mainloop_ws<TM, TN, STAGES>(acc, smem_base, x, w, tmaps, n, h, wd, c, k, r, pad, m0, n0);
    else
        convwg::mainloop<TM, TN, STAGES, LOADS>(acc, smem_base, x, w, tmaps, n, h, wd, c, k, r, pad, m0, n0);

    if (slices > 1 && workspace_split) {   // the last slice to arrive gets the tile's sum
        if (!consumer || !convwg::splitk_reduce<NT, S::kAcc>(acc, partials, counters, tile_id, slices, z)) return;
    }
    if (slices == 1 || workspace_split) {   // the whole tile here
        if (!consumer) return;
        const int m_end = min(m0 + TM, M);
        convwg::csync<NT>();   // every warpgroup is done with the pipeline's shared memory
        convwg::stage_tile<YT, YT, TM, TN>(acc, bias, smem, n0, k);
        convwg::csync<NT>();
        convwg::store_rows<YT, TM, TN>(smem, y, m0, m_end, n0, k);
        if (with_stats)
            convwg::tile_partials<YT, TM, TN>(smem, smem + TM * S::kRowBytes, out, m0, m_end,
                                              min((m0 / hw + 1) * hw, m_end), n0, k, cpg, gs);
        return;
    }
    // Split-K: shared memory is [this slice's fp32 tile][staged rows][scratch][inbox].
    float* mine = reinterpret_cast<float*>(smem);
    unsigned char* staged = smem + S::kAccBytes;
    unsigned char* scratch = staged + TM / 2 * S::kRowBytes;
    float2* inbox = reinterpret_cast<float2*>(scratch + S::kScratchBytes);
    if (consumer) {
        convwg::csync<NT>();
        convwg::stage_tile<float, YT, TM, TN>(acc, nullptr, smem, n0, k);   // kAccRowBytes rows
    }
    convwg::cluster_sync();   // every slice's tile is in its shared memory after this
    const convwg::SliceRows sr(m0, TM, M, hw, slices, z);
    if (consumer) {
        convwg::cluster_sum_rows<YT, TM, TN>(mine, bias, staged, sr.ms - m0, sr.me - sr.ms, slices, n0, k);
        convwg::csync<NT>();
        convwg::store_rows<YT, TM, TN>(staged, y, sr.ms, sr.me, n0, k);
        if (with_stats)   // this slice's partials into the last slice's inbox
            convwg::tile_partials<YT, TM, TN>(staged, scratch, convwg::cluster_map(inbox, slices - 1) + z * 2 * gs,
                                              sr.ms, sr.me, sr.bd, n0, k, cpg, gs);
    }
    convwg::cluster_sync();   // no slice reads another's shared memory after this; the inbox is full
    if (consumer && with_stats && z == slices - 1)
        convwg::merge_slices<NT, TN>(inbox, out, slices, m0, TM, M, hw, n0, k, cpg, gs);
#endif
}

// The whole op in one cooperative launch (every CTA resident; small N): the conv
// tile stays in shared memory in fp32, its GroupNorm partials go to `stats`, a grid
// barrier waits for every tile's, then each CTA merges the partials of its groups
// (for its one or two images), folds gamma/beta into a scale and shift per channel,
// and writes act(tile * scale + shift) to out.  y never goes to memory.
// counters: [MT * NT] split-K counters, then the barrier's 2 words.
template <typename OT, typename BT, int TM, int TN, int STAGES, int LOADS>
__global__ void __launch_bounds__(TM * 2, 1)
conv2d_gn_act_wgmma(float* stats, OT* out, const __half* x, const __half* w, const BT* bias, const float* gamma,
                    const float* beta, float* partials, int* counters, unsigned char* tmaps, int n, int h, int wd,
                    int c, int k, int r, int pad, int cpg, int gs, int groups, float eps, int act) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using S = convwg::Shape<float, TM, TN, STAGES>;
    constexpr int NT = S::kThreads;
    extern __shared__ unsigned char smem_raw[];
    uint32_t smem_base;
    unsigned char* smem = convwg::aligned_smem<S::kSmem>(smem_raw, smem_base);
    const int t = threadIdx.x, hw = h * wd, M = n * hw, slices = gridDim.z, z = blockIdx.z;
    const int m0 = blockIdx.x * TM, n0 = blockIdx.y * TN, tiles = gridDim.x * gridDim.y;
    const int tile_id = blockIdx.x * gridDim.y + blockIdx.y;
    float acc[S::kAcc];
    convwg::mainloop<TM, TN, STAGES, LOADS>(acc, smem_base, x, w, tmaps, n, h, wd, c, k, r, pad, m0, n0);
    if (slices > 1 && !convwg::splitk_reduce<NT, S::kAcc>(acc, partials, counters, tile_id, slices, z)) return;

    __syncthreads();
    convwg::stage_tile<float, BT, TM, TN>(acc, bias, smem, n0, k);
    __syncthreads();
    const int m_end = min(m0 + TM, M), boundary = min((m0 / hw + 1) * hw, m_end);
    const float2* st = reinterpret_cast<const float2*>(stats);
    convwg::tile_partials<float, TM, TN>(smem, smem + TM * S::kRowBytes,
                                         reinterpret_cast<float2*>(stats) + ((size_t)tile_id * slices + (slices - 1)) * 2 * gs,
                                         m0, m_end, boundary, n0, k, cpg, gs);
    // gamma and beta (not another CTA's output) are fetched before the barrier
    float* scale = reinterpret_cast<float*>(smem + TM * S::kRowBytes) + (S::kSlices * 2 + 2) * TN * 2;   // [2][TN]
    float* shift = scale + 2 * TN;                                                                       // [2][TN]
    for (int e = t; e < 2 * TN; e += NT) {
        const int ch = n0 + e % TN;
        scale[e] = ch < k ? gamma[ch] : 0.f;
        shift[e] = ch < k ? beta[ch] : 0.f;
    }
    convwg::grid_barrier(counters + tiles, tiles);   // every tile's partials are in `stats` after this

    // Each (segment, group) of this tile: 8 lanes merge its image's partials (warp-uniform loop).
    const int lane = t % 32, sub = lane & 7, g0 = n0 / cpg, img0 = m0 / hw;
    for (int base = (t / 32) * 4; base < 2 * gs; base += NT / 8) {
        const int e = base + lane / 8, sg = e / gs, g = g0 + e % gs;
        const bool valid = e < 2 * gs && g < groups && g * cpg < min(n0 + TN, k) &&
                           (sg == 0 ? boundary > m0 : m_end > boundary);
        GroupPartials gp(st, img0 + sg, g, valid, hw, cpg, TM, TN, gridDim.y, slices, gs, sub);
        gp.load();
        float mean, m2;
        gp.merge(mean, m2);
        if (valid) {
            const float rstd = rsqrtf(fmaxf(m2 * gp.inv_count, 0.f) + eps);
            for (int ch = max(g * cpg, n0) + sub; ch < min(min((g + 1) * cpg, n0 + TN), k); ch += 8) {
                const float sc = scale[sg * TN + ch - n0] * rstd;
                shift[sg * TN + ch - n0] -= mean * sc;
                scale[sg * TN + ch - n0] = sc;
            }
        }
    }
    __syncthreads();
    for (int e = t; e < TM * TN / 8; e += NT) {   // 8 channels at a time, straight from the staged tile
        const int row = e / (TN / 8), col = (e % (TN / 8)) * 8;
        if (m0 + row >= m_end || n0 + col >= k) continue;
        const int sg = m0 + row < boundary ? 0 : 1;
        const float4* src = reinterpret_cast<const float4*>(smem + row * S::kRowBytes) + col / 4;
        const float4 lo = src[0], hi = src[1];
        float f[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
        affine8(f, scale + sg * TN + col, shift + sg * TN + col);
        #pragma unroll
        for (int i = 0; i < 8; ++i)   // a uniform branch: the activation is an argument, not a template (fewer CUBINs)
            f[i] = act == ACT_SILU ? activation<ACT_SILU>(f[i]) : act == ACT_MISH ? activation<ACT_MISH>(f[i]) : f[i];
        store8(out + (size_t)(m0 + row) * k + n0 + col, f);
    }
#endif
}
