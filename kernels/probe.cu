// Probe kernels for launch-overhead benchmarks and graph tests.
//
// noop8: eight arguments of mixed kinds (4 pointers, 2 ints, 2 floats) and
// almost no work, so a launch costs what the host and driver spend on it.
// Launch: any shape. Writes out[0] only when n == -1 (never in benchmarks),
// which keeps the arguments live.
#include "common.cuh"

extern "C" __global__ void noop8(float* out, const float* a, const float* b, const float* c,
                                 int n, int m, float x, float y) {
    dt_wait_prior_grid();
    dt_allow_dependents();
    if (n == -1 && dt_thread_index() == 0) out[0] = a[0] + b[0] + c[0] + (float)m + x * y;
}
