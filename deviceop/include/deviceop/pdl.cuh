// Programmatic dependent launch (sm_90): the two instructions every PDL-ready
// kernel uses; compiled out below sm_90, and no-ops in a launch without PDL.
// deviceop's own header: every Kernel compiles with deviceop/include on its include
// path (deviceop/kernel/declare.py), so kernels/ and deviceop's kernels both
// #include <deviceop/pdl.cuh>.
#pragma once

// Wait until the previous kernel on the stream has completed and its writes are visible.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Let the next kernel on the stream start its CTAs (they still pdl_wait for this one's writes).
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
