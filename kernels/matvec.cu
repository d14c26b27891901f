// Matrix-vector product: out[n] = dot(x[0, :], w[n, :]) for the BN rows of one tile.
// Memory-bound: every weight is read once (d = 2048: 16 MB per call), so the
// kernel is built to keep loads in flight.  One warp per row, BN warps per
// block, so all BN rows of a tile stream at once; each lane issues BK
// independent 16-byte loads of its row (coalesced: lane-consecutive float4s)
// before it uses any of them (the launch bound lets all BN warps hold all
// their loads in registers at once).  Requires K % (128 * BK) == 0, BN <= 32.
template <int BN, int BK, int K>
__global__ void __launch_bounds__(32 * BN, 1)
matvec(float* __restrict__ out, const float* __restrict__ x, const float* __restrict__ w) {
    static_assert(K % (128 * BK) == 0, "K must be a multiple of 128 * BK");
    static_assert(BN >= 1 && BN <= 32, "BN must be in [1, 32] (one warp per row)");
    constexpr int STEP = 32 * BK;  // float4s per warp step
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const size_t row = (size_t)blockIdx.x * BN + warp;
    const float4* x4 = reinterpret_cast<const float4*>(x);
    const float4* w4 = reinterpret_cast<const float4*>(w + row * K);

    float acc = 0.f;
    #pragma unroll 1
    for (int base = 0; base < K / 4; base += STEP) {
        float4 wv[BK];
        #pragma unroll
        for (int j = 0; j < BK; ++j) wv[j] = __ldcs(w4 + base + j * 32 + lane);  // streamed: read once
        #pragma unroll
        for (int j = 0; j < BK; ++j) {
            const float4 xv = __ldg(x4 + base + j * 32 + lane);                  // reused by every row
            acc += wv[j].x * xv.x + wv[j].y * xv.y + wv[j].z * xv.z + wv[j].w * xv.w;
        }
    }
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) out[row] = acc;
}
