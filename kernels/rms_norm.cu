// RMS normalization of each row: out[r, :] = x[r, :] * rsqrt(mean(x[r, :]^2) + eps) * w
// One block per row (the output partition's tile is [1, D]); BS threads.
// Tiny and latency-bound at D = 2048 (8 KB in, 8 KB out): each thread loads
// its D / (4 BS) float4s once, keeps them in registers through the block-wide
// reduction, and writes the scaled values; no second pass over x.
template <int D, int BS>
__global__ void __launch_bounds__(BS)
rms_norm(float* __restrict__ out, const float* __restrict__ x, const float* __restrict__ w, float eps) {
    static_assert(D % (4 * BS) == 0, "D must be a multiple of 4 * BS (16-byte loads, whole rows per block)");
    static_assert(BS % 32 == 0 && BS <= 1024, "BS must be a multiple of 32, at most 1024");
    constexpr int PER = D / (4 * BS);  // float4s per thread
    const size_t row = blockIdx.x;
    const float4* xr = reinterpret_cast<const float4*>(x + row * D);
    const float4* w4 = reinterpret_cast<const float4*>(w);

    float4 v[PER], g[PER];
    float ss = 0.f;
    #pragma unroll
    for (int j = 0; j < PER; ++j) {
        v[j] = xr[threadIdx.x + j * BS];
        g[j] = __ldg(w4 + threadIdx.x + j * BS);
        ss += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
    }
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    __shared__ float partial[BS / 32];
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = ss;
    __syncthreads();
    float total = 0.f;
    #pragma unroll
    for (int i = 0; i < BS / 32; ++i) total += partial[i];
    const float scale = rsqrtf(total / D + eps);

    float4* o = reinterpret_cast<float4*>(out + row * D);
    #pragma unroll
    for (int j = 0; j < PER; ++j)
        o[threadIdx.x + j * BS] = make_float4(v[j].x * scale * g[j].x, v[j].y * scale * g[j].y,
                                              v[j].z * scale * g[j].z, v[j].w * scale * g[j].w);
}
