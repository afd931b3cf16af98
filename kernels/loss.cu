// Regression loss for the supervised engine.
//
// mse_loss: loss = sum((pred - target)^2) / n and dpred = 2 (pred - target) / n
// over n = rows * cols elements (both row-major, contiguous).
// Launch: grid = G blocks (any G > 1; the caller fixes it), block LOSS_THREADS (pinned). Each
// thread accumulates its grid-stride elements in double, the block reduces
// in a fixed tree, the last block to finish (counter pattern, no float
// atomics) sums the G partials in order and writes *loss, then resets the
// counter. Bitwise reproducible for a fixed G.
#include "common.cuh"

constexpr int LOSS_THREADS = 256;

extern "C" __global__ void __launch_bounds__(LOSS_THREADS) mse_loss(const float* pred, const float* target, int n,
                                                           float* dpred, double* partials,
                                                           unsigned int* counter, float* loss) {
    dt_wait_prior_grid();
    dt_allow_dependents();
    const float scale = 2.0f / (float)n;
    double acc = 0.0;
    for (long long i = dt_thread_index(); i < n; i += dt_grid_stride()) {
        const float d = pred[i] - target[i];
        dpred[i] = scale * d;
        acc += (double)d * (double)d;
    }
    double total;
    if (dt_grid_sum_last<LOSS_THREADS>(acc, partials, counter, total) && threadIdx.x == 0) *loss = (float)(total / n);
}
