// Double-DQN kernels of the training step (docs/step-spec.md, steps 3, 4 and 8):
// the fused dueling Double-DQN loss with PER weights, and the two phases of the
// spectral projection's power iteration.
//
// Determinism: no float atomics anywhere. Every sum is accumulated in double in
// an order fixed by the launch shape alone (per-thread loops in index order,
// fixed shuffle and shared-memory trees, partials added in block order), so
// the results are bitwise reproducible run to run for a fixed grid and table.
// Memory ordering: the only cross-block hand-over inside a kernel is the
// last-block protocol of dt_last_block (common.cuh; it fences, counts and
// resets the counter), and the last block reads what other blocks wrote with
// __ldcg. Everything else crosses a kernel boundary on the stream, which
// orders it.
#include "common.cuh"
#include "dqn.cuh"
#include "spectral.cuh"

namespace {

__device__ __forceinline__ float quiet_nan() { return __int_as_float(0x7fffffff); }

// x != x is the NaN test (no fast-math, so it is not folded away).
__device__ __forceinline__ bool is_nan(float x) { return x != x; }

}  // namespace

// ============================================================== dqn_loss
// Inputs:  q_s, q_next_online, q_next_target  [batch, 1 + n_actions] row-major,
//            column 0 = V, columns 1.. = A; Q = V + (A - mean(A)) is formed here.
//          action [batch] int32, reward, done, weights [batch] fp32.
// Outputs: dout [batch, 1 + n_actions] = d loss / d q_s (every element written):
//            g = -w huber'(td) / batch; dout[j][0] = g,
//            dout[j][1 + k] = g ((k == a_j) - 1 / n_actions).
//          priorities [batch] = |td| + 1e-6.
//          scalars[0] = mean(w huber(td)), scalars[1] = mean Q_online(s, a),
//          scalars[2] = mean |td| (written by the last block).
//          a_star [batch] int32 (may be null) = the a* of each sample, for tests
//            and diagnostics.
//   gate (may be null): while it points at a non-zero word the kernel returns at once.
//   a* = argmax Q_online(s', .) (first maximum), y = r + gamma (1 - done) Q_target(s', a*),
//   td = y - Q_online(s, a); huber with threshold huber_delta.
// NaN: td is NaN when any Q_online(s', .) is NaN (the argmax is then
//   meaningless) and whenever r, done, Q_target(s', a*) or Q_online(s, a) is
//   NaN; a NaN in any column of a row reaches every Q of it through mean(A).
//   A NaN td gives a NaN loss, gradient row and priority; the loss is never
//   made finite. An action outside [0, n_actions) is clamped for the memory
//   access and its Q_online(s, a), td, loss, gradient and priority are NaN.
//   n_actions outside [1, DQN_MAX_ACTIONS] writes NaN to scalars and nothing else.
// Scratch: partials = 3 * gridDim.x doubles; counter = one uint, zero on entry
//   and on exit.
// Launch: grid = ceil(batch / DQN_LOSS_THREADS), block DQN_LOSS_THREADS (32),
//   one thread per sample. The block's rows of each Q array are contiguous, so
//   the three are staged through shared memory with coalesced loads, in one
//   round (and dout is stored the same way).
// Determinism: per-sample terms in double, fixed block trees, partials added in
//   block order by the last block: bitwise reproducible for a fixed grid.
constexpr int DQN_LOSS_THREADS = 32;
constexpr int DQN_MAX_ACTIONS = 64;

namespace {

// mean(A) of one row [V, A_0 .. A_{n-1}], summed in double in index order.
__device__ __forceinline__ float advantage_mean(const float* row, int n_actions) {
    double s = 0.0;
    for (int k = 0; k < n_actions; ++k) s += row[1 + k];
    return (float)(s / n_actions);
}

// Q(., k) = V + (A_k - mean(A)), associated as in docs/step-spec.md's reference.
__device__ __forceinline__ float dueling_q(const float* row, int k, float mean) {
    return row[0] + (row[1 + k] - mean);
}

}  // namespace

extern "C" __global__ void __launch_bounds__(DQN_LOSS_THREADS) dqn_loss(
        const float* q_s, const float* q_next_online, const float* q_next_target, const int* action,
        const float* reward, const float* done, const float* weights, int batch, int n_actions,
        float gamma, float huber_delta, float* dout, float* priorities, float* scalars,
        double* partials, unsigned int* counter, int* a_star, const int* gate) {
    dt_wait_prior_grid();
    dt_allow_dependents();
    if (gate != nullptr && *gate) return;  // a step that is not due: nothing is written
    // One tile per Q array, all staged in one round of loads (no barrier between
    // the three), so the kernel waits for memory once, not three times.
    __shared__ float tiles[3][DQN_LOSS_THREADS * (1 + DQN_MAX_ACTIONS)];
    if (n_actions < 1 || n_actions > DQN_MAX_ACTIONS) {
        if (blockIdx.x == 0 && threadIdx.x == 0) scalars[0] = scalars[1] = scalars[2] = quiet_nan();
        return;
    }
    const int t = threadIdx.x;
    const int cols = 1 + n_actions;
    const long long j0 = (long long)blockIdx.x * DQN_LOSS_THREADS;
    const long long j = j0 + t;
    const int here = (int)max(0ll, min((long long)DQN_LOSS_THREADS, (long long)batch - j0));
    const bool live = t < here;
    const long long base = j0 * cols;
    const int count = here * cols;
    int a = 0;
    float r = 0.0f, d = 0.0f, w = 0.0f;
    if (live) {  // the per-sample loads fly with the tiles'
        a = action[j];
        r = reward[j];
        d = done[j];
        w = weights[j];
    }
#pragma unroll 4
    for (int e = t; e < count; e += DQN_LOSS_THREADS) {
        tiles[0][e] = q_next_online[base + e];
        tiles[1][e] = q_next_target[base + e];
        tiles[2][e] = q_s[base + e];
    }
    __syncthreads();

    // a* = first argmax of Q_online(s', .); any NaN among those Q poisons td.
    const float* row_next = tiles[0] + t * cols;
    int best_a = 0;
    bool poisoned = false;
    if (live) {
        const float mean = advantage_mean(row_next, n_actions);
        float best = dueling_q(row_next, 0, mean);
        poisoned = is_nan(best);
        for (int k = 1; k < n_actions; ++k) {
            const float q = dueling_q(row_next, k, mean);
            poisoned |= is_nan(q);
            if (q > best) {
                best = q;
                best_a = k;
            }
        }
    }

    if (live && a_star != nullptr) a_star[j] = best_a;

    const float* row_target = tiles[1] + t * cols;
    float q_target = 0.0f;
    if (live) q_target = dueling_q(row_target, best_a, advantage_mean(row_target, n_actions));

    float* row = tiles[2] + t * cols;
    double loss_j = 0.0, q_j = 0.0, abs_j = 0.0;
    if (live) {
        const bool valid = a >= 0 && a < n_actions;
        const int ac = a < 0 ? 0 : (a >= n_actions ? n_actions - 1 : a);
        float q_sa = dueling_q(row, ac, advantage_mean(row, n_actions));
        if (!valid) q_sa = quiet_nan();
        const float y = r + gamma * (1.0f - d) * q_target;
        float td = y - q_sa;
        if (poisoned) td = quiet_nan();
        const float abs_td = fabsf(td);
        // Written so that a NaN td takes the branch that keeps it NaN.
        const float huber = abs_td < huber_delta ? 0.5f * td * td : huber_delta * (abs_td - 0.5f * huber_delta);
        const float slope = abs_td >= huber_delta ? copysignf(huber_delta, td) : td;
        const float g = -(w * slope) / (float)batch;
        const float inv_n = 1.0f / (float)n_actions;
        // The thread's own row of the tile is read above and only by this thread.
        row[0] = g;
        for (int k = 0; k < n_actions; ++k) row[1 + k] = g * ((k == ac ? 1.0f : 0.0f) - inv_n);
        priorities[j] = abs_td + 1e-6f;
        loss_j = (double)w * (double)huber;
        q_j = q_sa;
        abs_j = abs_td;
    }
    __syncthreads();
#pragma unroll 4
    for (int e = t; e < count; e += DQN_LOSS_THREADS) dout[base + e] = tiles[2][e];

    const double block_loss = dt_block_sum<DQN_LOSS_THREADS>(loss_j);
    const double block_q = dt_block_sum<DQN_LOSS_THREADS>(q_j);
    const double block_abs = dt_block_sum<DQN_LOSS_THREADS>(abs_j);
    const unsigned int blocks = gridDim.x;
    if (t == 0) {
        partials[blockIdx.x] = block_loss;
        partials[blocks + blockIdx.x] = block_q;
        partials[2 * blocks + blockIdx.x] = block_abs;
    }
    if (!dt_last_block(counter, blocks)) return;
    double s_loss = 0.0, s_q = 0.0, s_abs = 0.0;
    for (unsigned int b = t; b < blocks; b += DQN_LOSS_THREADS) {
        s_loss += __ldcg(&partials[b]);
        s_q += __ldcg(&partials[blocks + b]);
        s_abs += __ldcg(&partials[2 * blocks + b]);
    }
    s_loss = dt_block_sum<DQN_LOSS_THREADS>(s_loss);
    s_q = dt_block_sum<DQN_LOSS_THREADS>(s_q);
    s_abs = dt_block_sum<DQN_LOSS_THREADS>(s_abs);
    if (t == 0) {
        scalars[0] = (float)(s_loss / batch);
        scalars[1] = (float)(s_q / batch);
        scalars[2] = (float)(s_abs / batch);
    }
}

// ============================================================== spectral projection
// The two phases of spectral.cuh, one phase block per block of the grid.
// spectral_columns: grid = sum_m ceil(cols_m / 16), block SPECTRAL_THREADS (256);
//   `counters` is unused and may be null.
// spectral_rows: grid = sum_m ceil(rows_m / 16), block SPECTRAL_THREADS, after
//   spectral_columns on the same stream.
// skip: when non-null and *skip != 0 both return at once, writing nothing.
extern "C" __global__ void __launch_bounds__(SPECTRAL_THREADS) spectral_columns(
        const float* params, const DtSpectralMatrix* mats, int n_mats, const float* u_all, float* v_all,
        double* partials, unsigned int* counters, const int* skip) {
    dt_wait_prior_grid();
    dt_allow_dependents();
    (void)counters;
    if (skip != nullptr && *skip != 0) return;
    dt_spectral_columns_block((int)blockIdx.x, params, mats, n_mats, u_all, v_all, partials);
}

extern "C" __global__ void __launch_bounds__(SPECTRAL_THREADS) spectral_rows(
        const float* params, const DtSpectralMatrix* mats, int n_mats, float* u_all, const float* v_all,
        float c, float* sigma, float* scale, double* partials, unsigned int* counters, const int* skip) {
    dt_wait_prior_grid();
    dt_allow_dependents();
    if (skip != nullptr && *skip != 0) return;
    dt_spectral_rows_block((int)blockIdx.x, params, mats, n_mats, u_all, v_all, c, sigma, scale, partials, counters);
}
