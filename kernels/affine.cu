// Element-wise affine map: out = alpha * x + beta over one tile of B elements
// per block, B/4 threads each moving 16 bytes.  Two scalar parameters: the
// kernel of the dynamic-parameter workflow (seed 004), whose scalars change
// between replays of one graph.
template <int B>
__global__ void __launch_bounds__(B / 4)
affine(float* __restrict__ out, const float* __restrict__ x, float alpha, float beta) {
    static_assert(B % 128 == 0, "B must be a multiple of 128 (a warp of float4s)");
    const size_t i = (size_t)blockIdx.x * (B / 4) + threadIdx.x;
    const float4 v = reinterpret_cast<const float4*>(x)[i];
    reinterpret_cast<float4*>(out)[i] = make_float4(fmaf(alpha, v.x, beta), fmaf(alpha, v.y, beta),
                                                    fmaf(alpha, v.z, beta), fmaf(alpha, v.w, beta));
}
