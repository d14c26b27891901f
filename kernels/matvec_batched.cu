// Batched matrix-vector product: out[b, n] = dot(x[b, :], w[n, :]) for the
// MB batch rows and BN weight rows of one tile (tile [MB, BN] of out[B, N];
// the grid is (B / MB, N / BN)).  Still memory-bound on the weights for the
// batches of a decode step (B <= 64): each weight is read from DRAM once per
// call; the B / MB batch tiles of one weight tile run as neighbouring blocks,
// so repeats hit L2.  One warp per weight row as in matvec: each lane issues
// BK independent 16-byte loads of its row, then multiplies them into MB
// accumulators (x rows come through L1: 8 KB each at K = 2048).
template <int BN, int BK, int K, int MB>
__global__ void __launch_bounds__(32 * BN, 1)
matvec_batched(float* __restrict__ out, const float* __restrict__ x, const float* __restrict__ w) {
    static_assert(K % (128 * BK) == 0, "K must be a multiple of 128 * BK");
    static_assert(BN >= 1 && BN <= 32, "BN must be in [1, 32] (one warp per row)");
    static_assert(MB >= 1 && MB <= 16, "MB must be in [1, 16] (accumulators per lane)");
    constexpr int STEP = 32 * BK;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const size_t row = (size_t)blockIdx.y * BN + warp;
    const size_t n_rows = (size_t)gridDim.y * BN;
    const size_t b0 = (size_t)blockIdx.x * MB;
    const bool once = gridDim.x == 1;  // one batch tile: stream the weights past L2
    const float4* w4 = reinterpret_cast<const float4*>(w + row * K);
    const float4* x4 = reinterpret_cast<const float4*>(x + b0 * K);

    float acc[MB];
    #pragma unroll
    for (int m = 0; m < MB; ++m) acc[m] = 0.f;
    #pragma unroll 1
    for (int base = 0; base < K / 4; base += STEP) {
        float4 wv[BK];
        #pragma unroll
        for (int j = 0; j < BK; ++j) wv[j] = once ? __ldcs(w4 + base + j * 32 + lane) : __ldg(w4 + base + j * 32 + lane);
        #pragma unroll
        for (int j = 0; j < BK; ++j) {
            #pragma unroll
            for (int m = 0; m < MB; ++m) {
                const float4 xv = __ldg(x4 + (size_t)m * (K / 4) + base + j * 32 + lane);
                acc[m] += wv[j].x * xv.x + wv[j].y * xv.y + wv[j].z * xv.z + wv[j].w * xv.w;
            }
        }
    }
    #pragma unroll
    for (int m = 0; m < MB; ++m) {
        float a = acc[m];
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
        if (lane == 0) out[(b0 + m) * n_rows + row] = a;
    }
}
