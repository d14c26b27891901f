// Two kernels built by nvcc into the binaries beside this file (build.sh), which
// tests/test_prebuilt.py and tests/test_prebuilt_gpu.py declare with Kernel.from_binary.

// y = a * x + y, one thread an element, the last block partial: an extern "C" kernel
// whose output is also an input (an InOut), its grid declared by the caller.
extern "C" __global__ void saxpy(float* y, const float* x, float a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}

namespace demo {
// out = s * x, and each block's sum of out into sums[block]: a C++ template (its symbol
// is mangled) with two outputs, the first a partition of B elements a block.
template <int B>
__global__ void scale_sums(float* out, float* sums, const float* x, float s) {
    __shared__ float part[B];
    int i = blockIdx.x * B + threadIdx.x;
    float v = s * x[i];
    out[i] = v;
    part[threadIdx.x] = v;
    __syncthreads();
    for (int stride = B / 2; stride > 0; stride /= 2) {
        if (threadIdx.x < stride) part[threadIdx.x] += part[threadIdx.x + stride];
        __syncthreads();
    }
    if (threadIdx.x == 0) sums[blockIdx.x] = part[0];
}
template __global__ void scale_sums<256>(float*, float*, const float*, float);
}  // namespace demo
