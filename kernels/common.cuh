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

// Sum of one double per thread over a 256-thread block, in a fixed tree order.
// Every thread of the block must call it; every thread gets the sum.
__device__ __forceinline__ double dt_block_sum256(double v) {
    __shared__ double sum[256];
    sum[threadIdx.x] = v;
    __syncthreads();
    for (int w = 128; w >= 1; w >>= 1) {
        if (threadIdx.x < w) sum[threadIdx.x] += sum[threadIdx.x + w];
        __syncthreads();
    }
    const double total = sum[0];
    __syncthreads();  // the array is free for the next call
    return total;
}

// The grid-wide sum without float atomics: each block writes its sum to
// partials[blockIdx.x]; the block that arrives last at `counter` adds the
// partials in a fixed order into `total` and returns true (every other block
// returns false), after resetting the counter for the next launch. Bitwise
// reproducible for a fixed grid. blockDim.x must be 256.
__device__ __forceinline__ bool dt_grid_sum_last(double v, double* partials, unsigned int* counter,
                                                 double& total) {
    __shared__ bool last;
    const double block = dt_block_sum256(v);
    if (threadIdx.x == 0) {
        partials[blockIdx.x] = block;
        __threadfence();
        last = atomicAdd(counter, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return false;
    __threadfence();
    double s = 0.0;
    for (int b = threadIdx.x; b < gridDim.x; b += blockDim.x) s += __ldcg(&partials[b]);
    total = dt_block_sum256(s);
    if (threadIdx.x == 0) *counter = 0u;
    return true;
}
