// RMS normalization of each row: out[r, :] = x[r, :] * rsqrt(mean(x[r, :]^2) + eps) * w
// One block per row (the output partition's tile is [1, D]); BS threads.
// Memory-bound and tiny at D = 2048 (8 KB in, 8 KB out): 16-byte loads, one
// block-wide reduction, the row re-read from L1/L2 for the scaling pass.
template <int D, int BS>
__global__ void __launch_bounds__(BS)
rms_norm(float* __restrict__ out, const float* __restrict__ x, const float* __restrict__ w, float eps) {
    static_assert(D % 4 == 0, "D must be a multiple of 4 (16-byte loads)");
    static_assert(BS % 32 == 0 && BS <= 1024, "BS must be a multiple of 32, at most 1024");
    constexpr int V = D / 4;
    const size_t row = blockIdx.x;
    const float4* xr = reinterpret_cast<const float4*>(x + row * D);

    float ss = 0.f;
    for (int i = threadIdx.x; i < V; i += BS) {
        const float4 v = xr[i];
        ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
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
    const float4* w4 = reinterpret_cast<const float4*>(w);
    for (int i = threadIdx.x; i < V; i += BS) {
        const float4 v = xr[i], g = w4[i];
        o[i] = make_float4(v.x * scale * g.x, v.y * scale * g.y, v.z * scale * g.z, v.w * scale * g.w);
    }
}
