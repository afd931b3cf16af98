// The last kernels of the Double-DQN step. dqn_finish: the spectral
// projection's last step, the target network update, the step counter and the
// metrics slot, in one pass. dqn_tail (below): the gradient norm, the priority
// update, AdamW, the spectral power iteration and that pass in one cooperative
// launch.
//
// dqn_finish, over the flat parameter buffer of n floats (n a multiple of 4):
//   - unless the step was skipped (*skip != 0, the NaN guard):
//       every block sums the row partials of each spectral matrix m
//       (spectral_rows leaves them in row_partials, matrix m's at its
//       first_block_rows, and ||x||^2 of matrix m GR slots after them,
//       spectral.cuh) in the order spectral.cuh fixes, so every block holds
//       the same ||y||, sigma and scale (dt_spectral_result, with the bound
//       c); the grid replaces y' in u_all by u_new = y' / (max(||x||, 1e-12)
//       max(||y||, 1e-12)), one element per thread; block 0 writes sigma[m]
//       and scale[m];
//       params[e] *= scale[m] for every element of matrix m;
//       then the target: Polyak target += tau (params - target) when
//       period == 0, else target = params when the optimizer counter *adam_t
//       is a multiple of period. The device decides: no host branch.
//   - *skip == 2 (the step was not due: the gate of adamw_clip_step,
//     grad_norm_clip or dqn_tail): nothing.
//   - block 0, thread 0: step = ++*step_counter (every step, skipped or
//     not); the metrics slot `step mod ring_slots` gets
//     {loss, grad_norm, clip_scale, mean_q, mean_abs_td, sigma_max, beta}
//     (clip_scale and sigma_max 0 on a skipped step: nothing was applied),
//     each field a word tagged with the step (dt_metric_store), so a slot
//     whose every tag is the step is complete. A skipped step publishes its
//     number in skipped_step[0] (mapped memory) and then, after a system
//     fence, raises flag 0 of (skip_counts, skip_published).
// Launch: any grid, block FINISH_THREADS (pinned); n_mats <= FINISH_MAX_MATS
// (the table is staged in shared memory; more traps). A float4 never straddles
// two parameter views (each starts on a 64-float boundary), and padding
// between views is 0, so scaling a whole float4 by its first element's matrix
// is exact. Deterministic: the sums have a fixed order, the rest is elementwise.
// With n_mats > 0 it must come directly after spectral_rows (a dependent launch
// may then start before that kernel ends): it reads the flag, t, its first
// float4 of params and target and the metrics' operands before its grid wait,
// which holds only when neither spectral phase writes them.
#include "common.cuh"
#include "dqn.cuh"
#include "optim.cuh"
#include "spectral.cuh"
#include "sumtree.cuh"

constexpr int FINISH_THREADS = 256;
constexpr int FINISH_MAX_MATS = 64;  // spectral matrices a finish block stages (drvtrain.rl.dqn checks it)
constexpr int FINISH_GROUP = 4;      // matrices whose ||y||^2 one block-sum pass takes
constexpr int METRIC_FIELDS = 7;     // words of a metrics slot, each tagged with the step

namespace {

// The spectral table as the finish pass uses it, in shared memory, with the
// per-matrix results the pass computes.
struct FinishMats {
    long long w_begin[FINISH_MAX_MATS], w_end[FINISH_MAX_MATS];
    int u_begin[FINISH_MAX_MATS], u_end[FINISH_MAX_MATS];
    int row_block0[FINISH_MAX_MATS], row_blocks[FINISH_MAX_MATS];
    double u_den[FINISH_MAX_MATS];
    float sigma[FINISH_MAX_MATS], scale[FINISH_MAX_MATS];
    int u_total;   // max_m u_end
    int row_grid;  // spectral_rows' grid, max_m (row_block0 + row_blocks): where the ||x||^2 slots start
};

// Stages the table (constant for the step's life, so a kernel may do this
// before it waits for the kernel before it). Every thread of the block calls it.
__device__ __forceinline__ void finish_stage(FinishMats& sh, const DtSpectralMatrix* mats, int n_mats) {
    if (n_mats > FINISH_MAX_MATS) __trap();
    if ((int)threadIdx.x < n_mats) {
        const DtSpectralMatrix e = mats[threadIdx.x];
        sh.w_begin[threadIdx.x] = e.w_offset;
        sh.w_end[threadIdx.x] = e.w_offset + (long long)e.rows * e.cols;
        sh.u_begin[threadIdx.x] = e.u_offset;
        sh.u_end[threadIdx.x] = e.u_offset + e.rows;
        sh.row_block0[threadIdx.x] = e.first_block_rows;
        sh.row_blocks[threadIdx.x] = dt_spectral_row_blocks(e.rows);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int total = 0, row_grid = 0;
        for (int m = 0; m < n_mats; ++m) {
            total = max(total, sh.u_end[m]);
            row_grid = max(row_grid, sh.row_block0[m] + sh.row_blocks[m]);
        }
        sh.u_total = total;
        sh.row_grid = row_grid;
    }
    __syncthreads();
}

// What the finish pass reads that neither spectral phase writes: the flag, t
// (hard copies), this thread's first float4 of params and target (elements
// `first` of the pass below), and the reporter's operands, all written by
// kernels before the spectral phases (dqn_finish loads them before its wait).
struct FinishFirst {
    int skip_value, t_value;
    float4 p, t;
    long long old_step;
    float loss, norm, clip_scale, mean_q, mean_abs_td, beta_used;
};

__device__ __forceinline__ FinishFirst finish_first(long long first, bool reporter, const float* params,
                                                    const float* target, long long n, int period, const int* adam_t,
                                                    const int* skip, const float* scalars, const float* clip,
                                                    const float* beta, const long long* step_counter) {
    FinishFirst f = {};
    f.skip_value = *skip;
    f.t_value = period > 0 ? *adam_t : 0;
    if (first < n / 4) {
        f.p = reinterpret_cast<const float4*>(params)[first];
        f.t = reinterpret_cast<const float4*>(target)[first];
    }
    if (reporter) {
        f.old_step = *step_counter;
        f.loss = scalars[0];
        f.mean_q = scalars[1];
        f.mean_abs_td = scalars[2];
        f.norm = clip[0];
        f.clip_scale = clip[1];
        f.beta_used = *beta;
    }
    return f;
}

// The finish pass over float4 elements first, first + stride, ... of the
// parameters and elements first, first + stride, ... of u; `sh` staged by
// finish_stage, `f` loaded by finish_first with the same `first`. `lead` is
// every thread of the block that writes sigma and the scales (block 0);
// `reporter` the one thread that counts the step and writes the metrics slot.
__device__ __forceinline__ void finish_pass(FinishMats& sh, const FinishFirst& f, long long first, long long stride,
                                            bool lead, bool reporter, float* params, float* target, long long n,
                                            int n_mats, float* u_all, const double* row_partials, float c,
                                            float* scale, float* sigma, float tau, int period,
                                            long long* step_counter, unsigned long long* ring, int ring_slots,
                                            unsigned int* skip_counts, unsigned int* skip_published,
                                            long long* skipped_step) {
    // What the first ||y|| sums need is loaded before anything waits on it: this
    // thread's first row partial of the first matrices, its first element of y' and,
    // in thread i < FINISH_GROUP, ||x||^2 of matrix i.
    const int skip_value = f.skip_value, t_value = f.t_value;
    const bool hard = period > 0;
    float4* p4 = reinterpret_cast<float4*>(params);
    float4* t4 = reinterpret_cast<float4*>(target);
    float4 p = f.p, t = f.t;
    double part0[FINISH_GROUP];
#pragma unroll
    for (int i = 0; i < FINISH_GROUP; ++i)
        part0[i] = i < n_mats && (int)threadIdx.x < sh.row_blocks[i]
                       ? __ldcg(&row_partials[sh.row_block0[i] + threadIdx.x]) : 0.0;
    const float y0 = first < sh.u_total ? __ldcg(&u_all[first]) : 0.0f;
    const double x_sq0 = (int)threadIdx.x < min(n_mats, FINISH_GROUP)
                             ? __ldcg(&row_partials[sh.row_grid + sh.row_block0[threadIdx.x]]) : 0.0;
    const long long old_step = f.old_step;
    const float loss = f.loss, norm = f.norm, clip_scale = f.clip_scale, mean_q = f.mean_q,
                mean_abs_td = f.mean_abs_td, beta_used = f.beta_used;
    dt_issued(skip_value);
    dt_issued(t_value);
    dt_issued(p);
    dt_issued(t);
#pragma unroll
    for (int i = 0; i < FINISH_GROUP; ++i) dt_issued(part0[i]);
    dt_issued(y0);
    dt_issued(x_sq0);
    if (skip_value == 2) return;  // a training loop's step that was not due: nothing happened
    const bool skipped = skip_value != 0;
    if (!skipped && n_mats > 0) {  // block-uniform: every thread meets the block sums
        for (int g = 0; g < n_mats; g += FINISH_GROUP) {
            double s[FINISH_GROUP];
#pragma unroll
            for (int i = 0; i < FINISH_GROUP; ++i) {
                const int m = g + i;
                s[i] = 0.0;
                if (m < n_mats) {
                    const double* rp = row_partials + sh.row_block0[m];
                    const double head = g == 0 ? part0[i]
                                        : ((int)threadIdx.x < sh.row_blocks[m] ? __ldcg(&rp[threadIdx.x]) : 0.0);
                    s[i] = dt_partials_share<FINISH_THREADS, 1>(rp, sh.row_blocks[m], &head);
                }
            }
            dt_block_sums<FINISH_THREADS, FINISH_GROUP>(s);
            double mine = s[0];  // thread i takes matrix g + i (selected, not indexed: s stays in registers)
#pragma unroll
            for (int i = 1; i < FINISH_GROUP; ++i)
                if ((int)threadIdx.x == i) mine = s[i];
            if ((int)threadIdx.x < FINISH_GROUP && g + (int)threadIdx.x < n_mats) {
                const int m = g + threadIdx.x;
                const double x_sq = g == 0 ? x_sq0 : __ldcg(&row_partials[sh.row_grid + sh.row_block0[m]]);
                const DtSpectralResult r = dt_spectral_result(x_sq, mine, c);
                sh.u_den[m] = r.u_den;
                sh.sigma[m] = r.sigma;
                sh.scale[m] = r.scale;
                if (lead) {
                    sigma[m] = r.sigma;
                    scale[m] = r.scale;
                }
            }
        }
        __syncthreads();
        for (long long i = first; i < sh.u_total; i += stride) {
            const float y = i == first ? y0 : __ldcg(&u_all[i]);
            for (int m = 0; m < n_mats; ++m) {
                if (i >= sh.u_begin[m] && i < sh.u_end[m]) {
                    u_all[i] = (float)((double)y / sh.u_den[m]);
                    break;
                }
            }
        }
    }
    if (reporter) {
        const long long step = old_step + 1;
        *step_counter = step;
        float sigma_max = 0.0f;
        if (!skipped)
            for (int m = 0; m < n_mats; ++m) sigma_max = fmaxf(sigma_max, sh.sigma[m]);
        if (skipped) {
            // The step's number before its flag: whoever sees the count sees the number.
            reinterpret_cast<volatile long long*>(skipped_step)[0] = step;
            __threadfence_system();
            dt_raise(skip_counts, skip_published, 0);
        }
        unsigned long long* slot = ring + (long long)METRIC_FIELDS * (step % ring_slots);
        const float fields[METRIC_FIELDS] = {loss, norm,
                                             skipped ? 0.0f : clip_scale,  // nothing was applied
                                             mean_q, mean_abs_td,
                                             sigma_max,  // 0 on a skipped step
                                             beta_used};
#pragma unroll
        for (int f = 0; f < METRIC_FIELDS; ++f) dt_metric_store(&slot[f], fields[f], step);
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
            if (e >= sh.w_begin[m] && e < sh.w_end[m]) {
                const float sc = sh.scale[m];
                p.x *= sc;
                p.y *= sc;
                p.z *= sc;
                p.w *= sc;
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
        float* params, float* target, long long n, const DtSpectralMatrix* mats, int n_mats, float* u_all,
        const double* row_partials, float c, float* scale, float* sigma, float tau, int period, const int* adam_t,
        const int* skip, const float* scalars, const float* clip, const float* beta, long long* step_counter,
        unsigned long long* ring, int ring_slots, unsigned int* skip_counts, unsigned int* skip_published,
        long long* skipped_step) {
    __shared__ FinishMats sh;
    finish_stage(sh, mats, n_mats);  // the constant table, while the rows phase runs
    // Polyak averaging reads the whole target network, which the step last read at its
    // start: into L2 before the wait (no kernel of the step writes it before this one).
    // On an SM that holds a spectral_rows block (its registers fill the SM's), this block
    // starts only once that one has ended, so the prefetch leads the reads by less.
    if (period == 0 && threadIdx.x == 0) dt_prefetch_rounds(target, n / 4);
    // With spectral phases (n_mats > 0: the kernel before this one is spectral_rows),
    // what neither phase writes is loaded before the wait: its writers (the norm, AdamW,
    // the loss's means, the sampler, the finish pass before) ended before the columns
    // phase's wait returned, which that phase, like every drvtrain kernel, passes before
    // it lets its dependents start (common.cuh), and so the rows phase and this one.
    // Without them the kernel before is AdamW, which writes params: after the wait.
    const bool reporter = blockIdx.x == 0 && threadIdx.x == 0;
    FinishFirst f;
    if (n_mats > 0)
        f = finish_first(dt_thread_index(), reporter, params, target, n, period, adam_t, skip, scalars, clip, beta,
                         step_counter);
    dt_wait_prior_grid();
    dt_allow_dependents();
    if (n_mats == 0)
        f = finish_first(dt_thread_index(), reporter, params, target, n, period, adam_t, skip, scalars, clip, beta,
                         step_counter);
    finish_pass(sh, f, dt_thread_index(), dt_grid_stride(), blockIdx.x == 0, reporter, params, target, n, n_mats,
                u_all, row_partials, c, scale, sigma, tau, period, step_counter, ring, ring_slots, skip_counts,
                skip_published, skipped_step);
}

// dqn_priority_update: the step's priority update (the leaves and sums of
// sumtree.cu's sumtree_update, the same bits, with the refresh split between
// the blocks: dt_tree_update_partitioned) with the NaN guard decided here
// instead of read from the *skip that adamw_clip_step writes, so that the
// update can start once the norm's partials are written and run beside AdamW.
// Every block adds the partials in adamw_clip_step's order (dt_partials_share
// over GUARD_SHARES threads, then dt_block_sum's tree, which dt_block_sum_warp0
// gives in every warp) and takes dt_clip_decide_value's verdict: it changes
// nothing when the norm or *loss is not finite (AdamW's *skip = 1) or the gate
// is set (*skip = 2), the launches that sumtree_update skips behind that
// *skip, decided from the same bits.
// Launch: block a multiple of 32 from GUARD_SHARES to PRIORITY_THREADS, any
// grid (every block reads all n indices); norm_partials and norm_blocks as
// adamw_clip_step takes them; loss and gate may be null (no loss; never gated).
constexpr int PRIORITY_THREADS = 512;
constexpr int GUARD_SHARES = ADAM_THREADS;  // adamw_clip_step's block (optim.cuh): the order of its sum

extern "C" __global__ void __launch_bounds__(PRIORITY_THREADS) dqn_priority_update(
        double* nodes, float* leaves, float* max_leaf, const int* indices, const float* priorities, float alpha,
        int n, int capacity, int height, int internal, const double* norm_partials, int norm_blocks,
        const float* loss, const int* gate, unsigned int* err_counts, unsigned int* err_published,
        unsigned int* counter) {
    __shared__ double shares[GUARD_SHARES];
    dt_wait_prior_grid();
    dt_allow_dependents();
    const int gated = dt_issued_flag(gate);
    const float loss_value = loss != nullptr ? __ldcg(loss) : 0.0f;
    if (threadIdx.x < GUARD_SHARES) shares[threadIdx.x] = dt_partials_share<GUARD_SHARES>(norm_partials, norm_blocks);
    __syncthreads();
    const double total = dt_block_sum_warp0<GUARD_SHARES>(shares);
    // The same verdict in every thread (the same bits), so the update's barriers are met by all or none.
    if (gated || dt_clip_decide_value(total, 1.0f, loss != nullptr, loss_value, true).bad) return;
    dt_tree_update_partitioned(nodes, leaves, max_leaf, indices, priorities, alpha, n, capacity, height, internal,
                               err_counts, err_published, counter);
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
// spectral_columns, spectral_rows and dqn_finish (and so as grad_norm_partials
// with adamw_clip_step, which give grad_norm_clip's and adamw_step's bits).
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
        float c, float* sigma, float* scale, double* spectral_partials,
        // the finish pass
        float* target, float tau, int period, const float* scalars, const float* beta, long long* step_counter,
        unsigned long long* ring, int ring_slots, unsigned int* skip_counts, unsigned int* skip_published,
        long long* skipped_step, unsigned int* barrier) {
    __shared__ FinishMats finish_mats;
    finish_stage(finish_mats, mats, n_mats);
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
        dt_tree_update(dt_thread_index(), dt_grid_stride(), leaves, max_leaf, indices, priorities, alpha, n_update,
                       capacity, tree_err_counts, tree_err_published);
        dt_adamw_elements(dt_adamw_setup(lr, beta1, beta2, eps, weight_decay, decision.scale, old_step + 1),
                          dt_thread_index(), dt_grid_stride(), params, grads, m, v, n);
        if (n_mats > 0) {
            dt_grid_barrier(barrier);
            for (int b = blockIdx.x; b < column_blocks; b += gridDim.x) {
                dt_spectral_columns_block(b, dt_spectral_block(mats, n_mats, true, b), params, u_all, v_all,
                                          spectral_partials, 0);
                __syncthreads();  // the body's shared arrays are free for the next phase block
            }
            dt_grid_barrier(barrier);
            for (int b = blockIdx.x; b < row_blocks; b += gridDim.x) {
                dt_spectral_rows_block<false>(b, dt_spectral_block(mats, n_mats, false, b), params, u_all, v_all,
                                              spectral_partials, nullptr);
                __syncthreads();
            }
        }
    }
    dt_grid_barrier(barrier);
    // The updated leaves' ancestors, by the last block, before its share of the finish pass
    // (which reads nothing of the tree).
    if (!decision.bad && blockIdx.x == gridDim.x - 1)
        dt_tree_refresh(nodes, leaves, capacity, height, internal, indices, n_update);
    const bool reporter = blockIdx.x == 0 && threadIdx.x == 0;
    const FinishFirst f = finish_first(dt_thread_index(), reporter, params, target, n, period, adam_t, skip, scalars,
                                       clip, beta, step_counter);
    finish_pass(finish_mats, f, dt_thread_index(), dt_grid_stride(), blockIdx.x == 0, reporter, params, target, n,
                n_mats, u_all, spectral_partials + column_blocks, c, scale, sigma, tau, period, step_counter, ring,
                ring_slots, skip_counts, skip_published, skipped_step);
}
