// Elementwise float32 kernels: the building blocks of self-checks, demos and tests.
//
// Contract for every kernel here:
//   inputs/outputs: contiguous float32 arrays of n elements, device or mapped memory;
//   launch: any 1-D grid and block; a grid-stride loop covers all n elements;
//   determinism: each output element is written by exactly one thread, no atomics.
#include "common.cuh"

// out[i] = value
extern "C" __global__ void fill_f32(float* out, float value, int n) {
    dt_wait_prior_grid();
    dt_allow_dependents();
    for (long long i = dt_thread_index(); i < n; i += dt_grid_stride()) out[i] = value;
}

// out[i] = start + i * step
extern "C" __global__ void iota_f32(float* out, float start, float step, int n) {
    dt_wait_prior_grid();
    dt_allow_dependents();
    for (long long i = dt_thread_index(); i < n; i += dt_grid_stride()) out[i] = start + (float)i * step;
}

// out[i] = a * x[i]   (out may alias x)
extern "C" __global__ void scale_f32(float* out, const float* x, float a, int n) {
    dt_wait_prior_grid();
    dt_allow_dependents();
    for (long long i = dt_thread_index(); i < n; i += dt_grid_stride()) out[i] = a * x[i];
}

// y[i] = a * x[i] + y[i]
extern "C" __global__ void axpy_f32(float* y, const float* x, float a, int n) {
    dt_wait_prior_grid();
    dt_allow_dependents();
    for (long long i = dt_thread_index(); i < n; i += dt_grid_stride()) y[i] = fmaf(a, x[i], y[i]);
}

// out[i] = a[i] + b[i]
extern "C" __global__ void add_f32(float* out, const float* a, const float* b, int n) {
    dt_wait_prior_grid();
    dt_allow_dependents();
    for (long long i = dt_thread_index(); i < n; i += dt_grid_stride()) out[i] = a[i] + b[i];
}
