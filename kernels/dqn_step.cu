// The last kernels of the Double-DQN step. dqn_finish: the spectral scaling,
// the target network update, the step counter and the metrics slot, in one
// pass. dqn_tail (below): the gradient norm, the priority update, AdamW, the
// spectral power iteration and that pass in one cooperative launch.
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
//     (clip_scale and sigma_max 0 on a skipped step: nothing was applied)
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
#include "optim.cuh"
#include "spectral.cuh"
#include "sumtree.cuh"

constexpr int FINISH_THREADS = 256;
constexpr int FINISH_STAGED_MATS = 16;  // table entries a finish block stages in shared memory
constexpr int METRIC_FIELDS = 7;  // the step follows them as an int

namespace {

// The finish pass over float4 elements first, first + stride, ...; `reporter`
// is the one thread that counts the step and writes the metrics slot.
__device__ __forceinline__ void finish_pass(long long first, long long stride, bool reporter, float* params,
                                            float* target, long long n, const DtSpectralMatrix* mats, int n_mats,
                                            const float* scale, const float* sigma, float tau, int period,
                                            const int* adam_t, const int* skip, const float* scalars,
                                            const float* clip, const float* beta, long long* step_counter,
                                            float* ring, int ring_slots, unsigned int* skip_counts,
                                            unsigned int* skip_published, long long* skipped_step) {
    // Everything the first float4 needs is loaded before anything waits on it:
    // the flag, t (hard copies), this thread's first float4 of params and target,
    // and the first FINISH_STAGED_MATS entries of the table with their scales.
    const int skip_value = *skip;
    const bool hard = period > 0;
    const int t_value = hard ? *adam_t : 0;
    float4* p4 = reinterpret_cast<float4*>(params);
    float4* t4 = reinterpret_cast<float4*>(target);
    float4 p = {}, t = {};
    if (first < n / 4) {
        p = p4[first];
        t = t4[first];
    }
    // The table entries and scales are loaded into registers alongside, and
    // staged in shared memory only once every load is issued: one round trip.
    const bool stages = (int)threadIdx.x < min(n_mats, FINISH_STAGED_MATS);
    long long stage_begin = 0;
    int stage_rows = 0, stage_cols = 0;
    float stage_scale = 0.0f;
    if (stages) {
        stage_begin = mats[threadIdx.x].w_offset;
        stage_rows = mats[threadIdx.x].rows;
        stage_cols = mats[threadIdx.x].cols;
        stage_scale = scale[threadIdx.x];
    }
    dt_issued(skip_value);
    dt_issued(t_value);
    dt_issued(p);
    dt_issued(t);
    dt_issued(stage_begin);
    dt_issued(stage_rows);
    dt_issued(stage_cols);
    dt_issued(stage_scale);
    __shared__ long long mat_begin[FINISH_STAGED_MATS], mat_end[FINISH_STAGED_MATS];
    __shared__ float mat_scale[FINISH_STAGED_MATS];
    if (threadIdx.x < FINISH_STAGED_MATS) {  // zeros past n_mats, never read
        mat_begin[threadIdx.x] = stage_begin;
        mat_end[threadIdx.x] = stage_begin + (long long)stage_rows * stage_cols;
        mat_scale[threadIdx.x] = stage_scale;
    }
    __syncthreads();
    if (skip_value == 2) return;  // a training loop's step that was not due: nothing happened
    const bool skipped = skip_value != 0;
    if (reporter) {
        const long long step = *step_counter + 1;
        *step_counter = step;
        float sigma_max = 0.0f;
        for (int m = 0; m < n_mats; ++m) sigma_max = fmaxf(sigma_max, sigma[m]);
        float* slot = ring + (long long)(METRIC_FIELDS + 1) * (step % ring_slots);
        slot[0] = scalars[0];
        slot[1] = clip[0];
        slot[2] = skipped ? 0.0f : clip[1];  // nothing was applied
        slot[3] = scalars[1];
        slot[4] = scalars[2];
        slot[5] = skipped ? 0.0f : sigma_max;  // sigma[] is the last applied step's
        slot[6] = *beta;
        if (skipped) {
            reinterpret_cast<volatile long long*>(skipped_step)[0] = step;
            dt_raise(skip_counts, skip_published, 0);
        }
        __threadfence_system();
        reinterpret_cast<volatile int*>(slot)[METRIC_FIELDS] = (int)step;
    }
    if (skipped) return;
    const bool copy = hard && (t_value % period) == 0;
    if (hard && !copy && n_mats == 0) return;
    for (long long i = first; i < n / 4; i += stride) {
        if (i != first) {
            p = p4[i];
            if (!hard) t = t4[i];
        }
        const long long e = 4 * i;
        for (int m = 0; m < n_mats; ++m) {
            const bool staged = m < FINISH_STAGED_MATS;
            const long long begin = staged ? mat_begin[m] : mats[m].w_offset;
            const long long end = staged ? mat_end[m] : begin + (long long)mats[m].rows * mats[m].cols;
            if (e >= begin && e < end) {
                const float s = staged ? mat_scale[m] : scale[m];
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
            t.x += tau * (p.x - t.x);
            t.y += tau * (p.y - t.y);
            t.z += tau * (p.z - t.z);
            t.w += tau * (p.w - t.w);
            t4[i] = t;
        }
    }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(FINISH_THREADS) dqn_finish(
        float* params, float* target, long long n, const DtSpectralMatrix* mats, int n_mats,
        const float* scale, const float* sigma, float tau, int period, const int* adam_t, const int* skip,
        const float* scalars, const float* clip, const float* beta, long long* step_counter, float* ring,
        int ring_slots, unsigned int* skip_counts, unsigned int* skip_published, long long* skipped_step) {
    dt_wait_prior_grid();
    dt_allow_dependents();
    finish_pass(dt_thread_index(), dt_grid_stride(), blockIdx.x == 0 && threadIdx.x == 0, params, target, n, mats,
                n_mats, scale, sigma, tau, period, adam_t, skip, scalars, clip, beta, step_counter, ring, ring_slots,
                skip_counts, skip_published, skipped_step);
}

// dqn_tail: everything of a step after the backward, in one cooperative launch:
// the gradient norm (the NaN guard), the priority update, AdamW, both spectral
// phases and the finish pass, with a grid barrier (common.cuh) wherever the
// kernels they replace had a kernel boundary. Six launches become one node.
//   gate non-null and non-zero (not due): *skip = 2 and nothing else.
//   The norm: block b of the grid takes the norm's phase blocks b, b + G, ...
//     of a grid of norm_blocks (grad_norm_clip's grid), each writing its
//     partial; barrier; every block adds the partials in grad_norm_clip's order
//     and so holds the same norm, scale and skip decision; block 0 publishes
//     them (clip, skip, t) as grad_norm_clip's last block does.
//   Not skipped: the priority update and AdamW over the grid (independent
//     data, no barrier between them); barrier; spectral phase 1 over its phase
//     blocks; barrier; phase 2; (no phases or barriers without a projected
//     matrix).
//   Barrier; the finish pass, which reads what block 0 published.
// Every branch depends only on the gate, the norm (the same bits in every block)
// and n_mats, so every block meets every barrier. Each phase runs the code of
// the kernel it replaces over the same elements and phase blocks: the result is
// the same, bit for bit, as grad_norm_clip, sumtree_update, adamw_step,
// spectral_columns, spectral_rows and dqn_finish.
// Launch: cooperative (every block resident), block FINISH_THREADS (256), any
// grid G >= 1; norm_partials: norm_blocks doubles; `barrier` one uint32, zero
// when allocated, never written by the host again.
static_assert(FINISH_THREADS == SPECTRAL_THREADS, "one block shape for every phase");

extern "C" __global__ void __launch_bounds__(FINISH_THREADS) dqn_tail(
        // the norm and AdamW
        float* params, const float* grads, float* m, float* v, long long n, int norm_blocks, double* norm_partials,
        float max_norm, const float* loss, float lr, double beta1, double beta2, float eps, float weight_decay,
        float* clip, int* adam_t, int* skip, const int* gate,
        // the priority update
        double* nodes, float* leaves, float* max_leaf, const int* indices, const float* priorities, float alpha,
        int n_update, int capacity, int height, int internal, unsigned int* tree_err_counts,
        unsigned int* tree_err_published,
        // the spectral projection
        const DtSpectralMatrix* mats, int n_mats, int column_blocks, int row_blocks, float* u_all, float* v_all,
        float c, float* sigma, float* scale, double* spectral_partials, unsigned int* spectral_counters,
        // the finish pass
        float* target, float tau, int period, const float* scalars, const float* beta, long long* step_counter,
        float* ring, int ring_slots, unsigned int* skip_counts, unsigned int* skip_published,
        long long* skipped_step, unsigned int* barrier) {
    dt_wait_prior_grid();
    dt_allow_dependents();
    if (gate != nullptr && *gate) {
        if (blockIdx.x == 0 && threadIdx.x == 0) *skip = 2;
        return;
    }
    for (int b = blockIdx.x; b < norm_blocks; b += gridDim.x) {
        const double acc = dt_sum_of_squares((long long)b * FINISH_THREADS + threadIdx.x,
                                             (long long)norm_blocks * FINISH_THREADS, grads, n);
        const double block = dt_block_sum<FINISH_THREADS>(acc);
        if (threadIdx.x == 0) norm_partials[b] = block;
    }
    const int old_step = *adam_t;  // every block reads t before block 0 advances it
    dt_grid_barrier(barrier);
    const DtClip decision = dt_clip_decide(dt_partials_sum<FINISH_THREADS>(norm_partials, norm_blocks), max_norm,
                                           loss, true);
    if (blockIdx.x == 0 && threadIdx.x == 0)
        dt_clip_publish(decision, old_step, clip, adam_t, loss, nullptr, 1, skip);
    if (!decision.bad) {
        dt_tree_update(dt_thread_index(), dt_grid_stride(), nodes, leaves, max_leaf, indices, priorities, alpha,
                       n_update, capacity, height, internal, tree_err_counts, tree_err_published);
        dt_adamw_elements(dt_adamw_setup(lr, beta1, beta2, eps, weight_decay, decision.scale, old_step + 1),
                          dt_thread_index(), dt_grid_stride(), params, grads, m, v, n);
        if (n_mats > 0) {
            dt_grid_barrier(barrier);
            for (int b = blockIdx.x; b < column_blocks; b += gridDim.x) {
                dt_spectral_columns_block(b, params, mats, n_mats, u_all, v_all, spectral_partials, 0);
                __syncthreads();  // the body's shared arrays are free for the next phase block
            }
            dt_grid_barrier(barrier);
            for (int b = blockIdx.x; b < row_blocks; b += gridDim.x) {
                dt_spectral_rows_block(b, params, mats, n_mats, u_all, v_all, c, sigma, scale, spectral_partials,
                                       spectral_counters, 0);
                __syncthreads();
            }
        }
    }
    dt_grid_barrier(barrier);
    finish_pass(dt_thread_index(), dt_grid_stride(), blockIdx.x == 0 && threadIdx.x == 0, params, target, n, mats,
                n_mats, scale, sigma, tau, period, adam_t, skip, scalars, clip, beta, step_counter, ring, ring_slots,
                skip_counts, skip_published, skipped_step);
}
