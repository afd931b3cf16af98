// The last kernel of the Double-DQN step: the spectral scaling, the target
// network update, the step counter and the metrics slot, in one pass.
//
// dqn_finish, over the flat parameter buffer of n floats (n a multiple of 4):
//   - unless the step was skipped (*skip != 0, the NaN guard):
//       params[e] *= scale[m] for every element of spectral matrix m (the
//       power iteration of dqn.cu found sigma and scale; the scaling is
//       applied here, in the pass that reads every parameter anyway);
//       then the target: Polyak target += tau (params - target) when
//       period == 0, else target = params when the optimizer counter *adam_t
//       is a multiple of period. The device decides: no host branch.
//   - *skip == 2 (the step was not due, see grad_norm_clip's gate): nothing.
//   - block 0, thread 0: step = ++*step_counter (every step, skipped or
//     not); the metrics slot `step mod ring_slots` gets
//     {loss, grad_norm, clip_scale, mean_q, mean_abs_td, sigma_max, beta}
//     and then, after a system fence, the step itself, so a slot whose step
//     matches is complete. A skipped step raises flag 0 of
//     (skip_counts, skip_published) and publishes its number in
//     skipped_step[0] (mapped memory).
// Launch: any grid, block FINISH_THREADS (pinned). A float4 never straddles
// two parameter views (each starts on a 64-float boundary), and padding
// between views is 0, so scaling a whole float4 by its first element's matrix
// is exact. Elementwise and deterministic.
#include "common.cuh"
#include "dqn.cuh"

constexpr int FINISH_THREADS = 256;
constexpr int METRIC_FIELDS = 7;  // the step follows them as an int

extern "C" __global__ void __launch_bounds__(FINISH_THREADS) dqn_finish(
        float* params, float* target, long long n, const DtSpectralMatrix* mats, int n_mats,
        const float* scale, const float* sigma, float tau, int period, const int* adam_t, const int* skip,
        const float* scalars, const float* clip, const float* beta, long long* step_counter, float* ring,
        int ring_slots, unsigned int* skip_counts, unsigned int* skip_published, long long* skipped_step) {
    dt_wait_prior_grid();
    dt_allow_dependents();
    if (*skip == 2) return;  // a training loop's step that was not due: nothing happened
    const bool skipped = *skip != 0;
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        const long long step = *step_counter + 1;
        *step_counter = step;
        float sigma_max = 0.0f;
        for (int m = 0; m < n_mats; ++m) sigma_max = fmaxf(sigma_max, sigma[m]);
        float* slot = ring + (long long)(METRIC_FIELDS + 1) * (step % ring_slots);
        slot[0] = scalars[0];
        slot[1] = clip[0];
        slot[2] = clip[1];
        slot[3] = scalars[1];
        slot[4] = scalars[2];
        slot[5] = sigma_max;
        slot[6] = *beta;
        if (skipped) {
            reinterpret_cast<volatile long long*>(skipped_step)[0] = step;
            dt_raise(skip_counts, skip_published, 0);
        }
        __threadfence_system();
        reinterpret_cast<volatile int*>(slot)[METRIC_FIELDS] = (int)step;
    }
    if (skipped) return;
    const bool hard = period > 0;
    const bool copy = hard && (*adam_t % period) == 0;
    if (hard && !copy && n_mats == 0) return;
    float4* p4 = reinterpret_cast<float4*>(params);
    float4* t4 = reinterpret_cast<float4*>(target);
    for (long long i = dt_thread_index(); i < n / 4; i += dt_grid_stride()) {
        float4 p = p4[i];
        const long long e = 4 * i;
        for (int m = 0; m < n_mats; ++m) {
            const long long begin = mats[m].w_offset;
            if (e >= begin && e < begin + (long long)mats[m].rows * mats[m].cols) {
                const float s = scale[m];
                p.x *= s;
                p.y *= s;
                p.z *= s;
                p.w *= s;
                p4[i] = p;
                break;
            }
        }
        if (copy) {
            t4[i] = p;
        } else if (!hard) {
            float4 t = t4[i];
            t.x += tau * (p.x - t.x);
            t.y += tau * (p.y - t.y);
            t.z += tau * (p.z - t.z);
            t.w += tau * (p.w - t.w);
            t4[i] = t;
        }
    }
}
