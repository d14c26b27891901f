// Row moves addressed by an int in device memory, e.g. a device loop's
// iteration index (deviceop.loop): the index is read by the kernel, so one
// captured graph serves every iteration.  B floats per block, 16 bytes per
// thread; an index outside [0, rows) moves nothing (no out-of-bounds access).
// PDL-ready (.pdl()): everything they read may come from the previous kernel,
// so they wait for it first; launched with PDL, only their launch overlaps it.

#include <deviceop/pdl.cuh>

// out[:] = table[*index, :]      out [D] tiles [B], grid D/B
template <int B>
__global__ void __launch_bounds__(B / 4)
load_row(float* __restrict__ out, const float* __restrict__ table, const int* __restrict__ index, int rows) {
    static_assert(B % 128 == 0, "B must be a multiple of 128 (a warp of float4s)");
    pdl_wait();
    const int r = *index;
    if (r < 0 || r >= rows) return;
    const size_t d = (size_t)gridDim.x * B;
    const size_t i = (size_t)blockIdx.x * (B / 4) + threadIdx.x;
    reinterpret_cast<float4*>(out)[i] = reinterpret_cast<const float4*>(table + (size_t)r * d)[i];
}

// table[*index, :] = x[:]        table [rows, D] tiles [rows, B], grid (1, D/B)
template <int B>
__global__ void __launch_bounds__(B / 4)
store_row(float* __restrict__ table, const float* __restrict__ x, const int* __restrict__ index, int rows) {
    static_assert(B % 128 == 0, "B must be a multiple of 128 (a warp of float4s)");
    pdl_wait();
    const int r = *index;
    if (r < 0 || r >= rows) return;
    const size_t d = (size_t)gridDim.y * B;
    const size_t i = (size_t)blockIdx.y * (B / 4) + threadIdx.x;
    reinterpret_cast<float4*>(table + (size_t)r * d)[i] = reinterpret_cast<const float4*>(x)[i];
}
