// Element-wise add: out = a + b over one tile of B elements per block, B/4
// threads each moving 16 bytes.
template <int B>
__global__ void __launch_bounds__(B / 4)
add(float* __restrict__ out, const float* __restrict__ a, const float* __restrict__ b) {
    static_assert(B % 128 == 0, "B must be a multiple of 128 (a warp of float4s)");
    const size_t i = (size_t)blockIdx.x * (B / 4) + threadIdx.x;
    const float4 va = reinterpret_cast<const float4*>(a)[i];
    const float4 vb = reinterpret_cast<const float4*>(b)[i];
    reinterpret_cast<float4*>(out)[i] = make_float4(va.x + vb.x, va.y + vb.y, va.z + vb.z, va.w + vb.w);
}
