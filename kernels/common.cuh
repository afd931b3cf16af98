// Device helpers shared by drvtrain's kernels.
#pragma once

// Global thread index and grid stride for 1-D grid-stride loops.
__device__ __forceinline__ long long dt_thread_index() {
    return (long long)blockIdx.x * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ long long dt_grid_stride() {
    return (long long)gridDim.x * blockDim.x;
}

// +infinity as float; NVRTC has no <math.h> macros.
__device__ __forceinline__ float dt_inf() { return __int_as_float(0x7f800000); }
