// Double-DQN kernels of the training step (docs/step-spec.md, steps 3-6 and 9):
// the fused dueling Double-DQN loss with PER weights (dqn_loss), the same loss
// fused with the output layer's forwards and data gradient (dqn_head, and
// dqn_head_a2 compiled for two actions), the
// batch means of either when they leave them to a kernel of their own
// (dqn_means_32, dqn_means_256), and the two phases of the spectral
// projection's power iteration.
//
// Determinism: no float atomics anywhere. Every sum is accumulated in an order
// fixed by the launch shape alone (per-thread loops in index order, fixed
// shuffle and shared-memory trees, partials added in block order): the loss
// terms and the projection's sums in double, dqn_head's dot products in FP32.
// The results are bitwise reproducible run to run for a fixed grid and table.
// Memory ordering: the only cross-block hand-over inside a kernel is the
// last-block protocol of dt_last_block (common.cuh; one acquire-release add on
// the counter, which the last block resets), and the last block reads what
// other blocks wrote with __ldcg. Everything else crosses a kernel boundary: on the stream, or (the
// means' partials, read by dqn_means_* on another stream) across streams
// through the caller's event fork and join, which order it the same way.
#include "common.cuh"
#include "dqn.cuh"
#include "dqn_loss.cuh"
#include "spectral.cuh"


// ============================================================== dqn_loss
// Inputs:  q_s, q_next_online, q_next_target  [batch, 1 + n_actions] row-major,
//            column 0 = V, columns 1.. = A; Q = V + (A - mean(A)) is formed here.
//          action [batch] int32, reward, done, weights [batch] fp32.
// Outputs: dout [batch, 1 + n_actions] = d loss / d q_s (every element written):
//            g = -w huber'(td) / batch; dout[j][0] = g,
//            dout[j][1 + k] = g ((k == a_j) - 1 / n_actions).
//          priorities [batch] = |td| + 1e-6.
//          scalars[0] = mean(w huber(td)), scalars[1] = mean Q_online(s, a),
//          scalars[2] = mean |td|: written by the last block when `counter` is
//            not null; with counter null each block only leaves its partials,
//            and dqn_means_32 (the same block size, so the same tree) sums them
//            into scalars later, off the kernel's critical path.
//          a_star [batch] int32 (may be null) = the a* of each sample, for tests
//            and diagnostics.
//   gate (may be null): while it points at a non-zero word the kernel writes nothing
//     (dqn_loss tests it first; dqn_head once its first loads are issued).
//   a* = argmax Q_online(s', .) (first maximum), y = r + gamma (1 - done) Q_target(s', a*),
//   td = y - Q_online(s, a); huber with threshold huber_delta.
// NaN: td is NaN when any Q_online(s', .) is NaN (the argmax is then
//   meaningless) and whenever r, done, Q_target(s', a*) or Q_online(s, a) is
//   NaN; a NaN in any column of a row reaches every Q of it through mean(A).
//   A NaN td gives a NaN loss, gradient row and priority; the loss is never
//   made finite. An action outside [0, n_actions) is clamped for the memory
//   access and its Q_online(s, a), td, loss, gradient and priority are NaN.
//   n_actions outside [1, DQN_MAX_ACTIONS] writes NaN to scalars (with a null
//   counter: NaN partials, so the means kernel writes NaN) and nothing else.
// Scratch: partials = 3 * gridDim.x doubles; counter (may be null, above) = one
//   uint, zero on entry and on exit.
// Launch: grid = ceil(batch / DQN_LOSS_THREADS), block DQN_LOSS_THREADS (32),
//   one thread per sample. The block's rows of each Q array are contiguous, so
//   the three are staged in shared memory by cp.async copies, all in flight
//   at once (16 bytes each when the three arrays start on 16-byte
//   boundaries), and dout is stored from there with coalesced stores.
// Determinism: per-sample terms in double, fixed block trees, partials added in
//   block order by the last block (or, with a null counter, by dqn_means_32 in
//   the same order): bitwise reproducible for a fixed grid.
namespace {

// n_actions out of range: NaN means. With a counter block 0 writes them; with
// none every block leaves NaN partials, so dqn_means_* writes NaN means too.
__device__ __forceinline__ void nan_means(float* scalars, double* partials, const unsigned int* counter) {
    if (threadIdx.x != 0) return;
    if (counter != nullptr) {
        if (blockIdx.x == 0) scalars[0] = scalars[1] = scalars[2] = quiet_nan();
        return;
    }
    const double nan = __longlong_as_double(0x7ff8000000000000ll);
    for (int k = 0; k < 3; ++k) partials[(long long)k * gridDim.x + blockIdx.x] = nan;
}

// scalars[0..2] = the batch means of the three terms from partials[3][blocks]:
// thread t adds partials t, t + THREADS, ... of each in block order, then the
// block tree. Every thread of one block of THREADS threads calls it.
template <int THREADS>
__device__ __forceinline__ void sum_means(const double* partials, unsigned int blocks, int batch, float* scalars) {
    double s[3] = {0.0, 0.0, 0.0};
    for (unsigned int b = threadIdx.x; b < blocks; b += THREADS) {  // three dt_partials_share in one loop
        s[0] += __ldcg(&partials[b]);
        s[1] += __ldcg(&partials[blocks + b]);
        s[2] += __ldcg(&partials[2 * blocks + b]);
    }
    dt_block_sums<THREADS, 3>(s);  // the bits of three dt_partials_sum calls
    if (threadIdx.x == 0) {
        scalars[0] = (float)(s[0] / batch);
        scalars[1] = (float)(s[1] / batch);
        scalars[2] = (float)(s[2] / batch);
    }
}

// The block sums of the three terms into partials[3][gridDim.x]; then, with a
// counter, the last block's sum_means. Every thread of the block calls it. The
// three sums of a block run in one pass (dt_block_sums), with the bits of three
// separate ones.
template <int THREADS>
__device__ __forceinline__ void publish_means(SampleTerms terms, int batch, float* scalars, double* partials,
                                              unsigned int* counter) {
    double block[3] = {terms.loss, terms.q, terms.abs_td};
    dt_block_sums<THREADS, 3>(block);
    const unsigned int blocks = gridDim.x;
    if (threadIdx.x == 0) {
        partials[blockIdx.x] = block[0];
        partials[blocks + blockIdx.x] = block[1];
        partials[2 * blocks + blockIdx.x] = block[2];
    }
    if (counter == nullptr || !dt_last_block(counter, blocks)) return;
    sum_means<THREADS>(partials, blocks, batch, scalars);
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
    // One tile per Q array, all copied in one round of cp.async copies, so the
    // kernel waits for memory once, not once per array or per element.
    __shared__ __align__(16) float tiles[3][DQN_LOSS_THREADS * (1 + DQN_MAX_ACTIONS)];
    if (n_actions < 1 || n_actions > DQN_MAX_ACTIONS) {
        nan_means(scalars, partials, counter);
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
    // The block's rows start at a multiple of 32 rows, 128 (1 + n_actions) bytes,
    // so 16-byte copies need only the arrays themselves on 16-byte boundaries.
    const bool vec = ((reinterpret_cast<unsigned long long>(q_s) |
                       reinterpret_cast<unsigned long long>(q_next_online) |
                       reinterpret_cast<unsigned long long>(q_next_target)) & 15ull) == 0;
    stage_floats<DQN_LOSS_THREADS>(tiles[0], q_next_online + base, count, vec);
    stage_floats<DQN_LOSS_THREADS>(tiles[1], q_next_target + base, count, vec);
    stage_floats<DQN_LOSS_THREADS>(tiles[2], q_s + base, count, vec);
    dt_cp_async_commit();
    dt_cp_async_wait<0>();
    __syncthreads();
    SampleTerms terms;
    if (live)  // the thread's own row of each tile is read and written only by this thread
        terms = sample_loss(tiles[0] + t * cols, tiles[1] + t * cols, tiles[2] + t * cols, a, r, d, w, batch,
                            n_actions, gamma, huber_delta, &priorities[j], a_star != nullptr ? &a_star[j] : nullptr);
    __syncthreads();
#pragma unroll 4
    for (int e = t; e < count; e += DQN_LOSS_THREADS) dout[base + e] = tiles[2][e];
    publish_means<DQN_LOSS_THREADS>(terms, batch, scalars, partials, counter);
}

// ============================================================== dqn_head
// The network's last layer and the loss in one kernel: the three forwards of the
// output layer, dqn_loss, and the output layer's data gradient, row by row (so
// three launches leave the step's chain).
// Inputs:  h_s, h_next, h_target [batch, hidden] row-major: the last hidden
//            layer's outputs (ReLU, so >= 0 or NaN) of the online net on s, the
//            online net on s' and the target net on s'.
//          w_online, w_target [1 + n_actions, hidden] row-major and b_online,
//            b_target [1 + n_actions]: the output layer of each net.
//          action, reward, done, weights, batch, n_actions, gamma, huber_delta
//            and gate as dqn_loss.
// Outputs: q_s, q_next, q_target [batch, 1 + n_actions]: the three output layers
//            (z = h W^T + b), each a dot product in FP32 in a fixed order.
//          dout, priorities, scalars, a_star: as dqn_loss, from those Q rows.
//          dh [batch, hidden] = (dout W_online) where h_s > 0, else 0 (the ReLU
//            mask of gemm.cu's grad-input epilogue), in FP32, summed over the
//            output columns in index order.
// NaN: dqn_loss's rules, from Q rows that carry any NaN of h or W.
// Shared memory (dynamic, bytes): head_shared_bytes(hidden, n_actions) in
//   drvtrain/rl/dqn.py = 4 (2 (1 + n_actions) hidden + 3 DQN_HEAD_ROWS (hidden
//   + 1 + n_actions)): both output layers and the block's rows of the three
//   inputs, staged in one round of cp.async copies, 16 bytes each when hidden %
//   4 == 0 and the five arrays start on 16-byte boundaries (as the parameter
//   layout and the arena place them), else 4 bytes each.
// Scratch: partials = 3 * gridDim.x doubles; counter as dqn_loss (null: the
//   means are left to dqn_means_256).
// Launch: grid = ceil(batch / DQN_HEAD_ROWS), block DQN_HEAD_THREADS.
// dqn_head_a2: the same, compiled for n_actions == 2 (the same bits); any other
//   count gives NaN means and writes nothing else, as a count outside [1, 64] does.
// Determinism: fixed per-lane orders and a fixed shuffle tree for the dot
//   products; the scalars as dqn_loss: bitwise reproducible for a fixed grid.
constexpr int DQN_HEAD_THREADS = 256;
constexpr int DQN_HEAD_ROWS = 4;

namespace {

// acc[r] += the lane's share of dot(w, x_r) for the block's rows: lane l takes
// elements 4l .. 4l+3 of every 128 (VEC) or element l of every 32. With `w1` not
// null, unit += the lane's share of dot(w1, x1) too, in the same order (one more
// row, of another item: dqn_head's last round).
template <bool VEC>
__device__ __forceinline__ void lane_dots(const float* w, const float* x, int hidden, int rows, int lane,
                                          float (&acc)[DQN_HEAD_ROWS], const float* w1, const float* x1,
                                          float& unit) {
    if (VEC) {
        for (int k = 4 * lane; k < hidden; k += 128) {
            const float4 wv = *reinterpret_cast<const float4*>(w + k);
#pragma unroll
            for (int r = 0; r < DQN_HEAD_ROWS; ++r) {
                if (r < rows) {
                    const float4 xv = *reinterpret_cast<const float4*>(x + r * hidden + k);
                    acc[r] = fmaf(wv.x, xv.x, acc[r]);
                    acc[r] = fmaf(wv.y, xv.y, acc[r]);
                    acc[r] = fmaf(wv.z, xv.z, acc[r]);
                    acc[r] = fmaf(wv.w, xv.w, acc[r]);
                }
            }
            if (w1 != nullptr) {
                const float4 uw = *reinterpret_cast<const float4*>(w1 + k);
                const float4 ux = *reinterpret_cast<const float4*>(x1 + k);
                unit = fmaf(uw.x, ux.x, unit);
                unit = fmaf(uw.y, ux.y, unit);
                unit = fmaf(uw.z, ux.z, unit);
                unit = fmaf(uw.w, ux.w, unit);
            }
        }
    } else {
        for (int k = lane; k < hidden; k += 32) {
            const float wk = w[k];
#pragma unroll
            for (int r = 0; r < DQN_HEAD_ROWS; ++r)
                if (r < rows) acc[r] = fmaf(wk, x[r * hidden + k], acc[r]);
            if (w1 != nullptr) unit = fmaf(w1[k], x1[k], unit);
        }
    }
}

}  // namespace

namespace {

// A dqn_head kernel. COLS > 0: compiled for 1 + n_actions == COLS, so the loss's loops
// over the actions unroll and its divisions by n_actions are by a constant (the same
// operations in the same order: the same bits as COLS = 0, which takes any count); a
// launch with another count gives NaN means, as an invalid count.
template <int COLS>
__device__ __forceinline__ void head_kernel(
        const float* h_s, const float* h_next, const float* h_target, int hidden, const float* w_online,
        const float* b_online, const float* w_target, const float* b_target, const int* action,
        const float* reward, const float* done, const float* weights, int batch, int n_actions, float gamma,
        float huber_delta, float* q_s, float* q_next, float* q_target, float* dout, float* dh, float* priorities,
        float* scalars, double* partials, unsigned int* counter, int* a_star, const int* gate) {
    static_assert(COLS == 0 || (COLS >= 2 && COLS - 1 <= DQN_MAX_ACTIONS), "a build's count of actions");
    dt_wait_prior_grid();
    dt_allow_dependents();
    // A step that is not due writes nothing. The gate word is loaded with the
    // staged operands below and tested once they are in flight.
    const int gated = dt_read_flag(gate);
    if (n_actions < 1 || n_actions > DQN_MAX_ACTIONS || (COLS > 0 && n_actions != COLS - 1)) {
        if (!gated) nan_means(scalars, partials, counter);
        return;
    }
    if (COLS > 0) n_actions = COLS - 1;
    extern __shared__ float4 head_shared[];
    const int cols = 1 + n_actions;
    float* w_sh = reinterpret_cast<float*>(head_shared);   // [2][cols][hidden]: online, target
    float* x_sh = w_sh + 2 * cols * hidden;                // [3][ROWS][hidden]: s, s' online, s' target
    float* q_sh = x_sh + 3 * DQN_HEAD_ROWS * hidden;       // [3][ROWS][cols]
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const long long j0 = (long long)blockIdx.x * DQN_HEAD_ROWS;
    const int here = (int)max(0ll, min((long long)DQN_HEAD_ROWS, (long long)batch - j0));
    const bool vec = (hidden & 3) == 0 &&
                     ((reinterpret_cast<unsigned long long>(h_s) | reinterpret_cast<unsigned long long>(h_next) |
                       reinterpret_cast<unsigned long long>(h_target) | reinterpret_cast<unsigned long long>(w_online) |
                       reinterpret_cast<unsigned long long>(w_target)) & 15ull) == 0;
    const long long x0 = j0 * hidden;

    stage_floats<DQN_HEAD_THREADS>(w_sh, w_online, cols * hidden, vec);
    stage_floats<DQN_HEAD_THREADS>(w_sh + cols * hidden, w_target, cols * hidden, vec);
    stage_floats<DQN_HEAD_THREADS>(x_sh, h_s + x0, here * hidden, vec);
    stage_floats<DQN_HEAD_THREADS>(x_sh + DQN_HEAD_ROWS * hidden, h_next + x0, here * hidden, vec);
    stage_floats<DQN_HEAD_THREADS>(x_sh + 2 * DQN_HEAD_ROWS * hidden, h_target + x0, here * hidden, vec);
    dt_cp_async_commit();
    const long long j = j0 + t;
    const bool live = t < here;
    int a = 0;
    float r = 0.0f, d = 0.0f, w = 0.0f;
    if (live) {  // the per-sample loads fly with the copies
        a = action[j];
        r = reward[j];
        d = done[j];
        w = weights[j];
    }
    // How the forwards' dot products are shared out (below), and the biases this warp
    // adds first, loaded with the copies too: loaded after a dot product's shuffle
    // tree, each was a round trip on the chain.
    constexpr int WARPS = DQN_HEAD_THREADS / 32;
    const int items = 3 * cols, rest = items % WARPS;
    const bool by_rows = items > WARPS && rest > 0 && rest * here <= WARPS;  // block-uniform
    const int whole = by_rows ? items - rest : items;
    const bool has_unit = by_rows && warp < rest * here;
    const int unit_item = whole + (has_unit ? warp / here : 0), unit_row = has_unit ? warp % here : 0;
    const int unit_p = unit_item / cols, unit_c = unit_item % cols;
    const float first_bias = warp < whole ? (warp / cols == 2 ? b_target : b_online)[warp % cols] : 0.0f;
    const float unit_bias = has_unit ? (unit_p == 2 ? b_target : b_online)[unit_c] : 0.0f;
    dt_issued(first_bias);
    dt_issued(unit_bias);
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    if (gated) return;  // grid-uniform, and before the block's first barrier
    __syncthreads();

    // The forwards: warp item (pass p, column c) = Q[p][r][c] for the block's rows,
    // lanes over k, then a fixed shuffle tree whose result lane 0 holds. Warp w takes
    // items w, w + 8, ... When more items than warps leave a last round of at most 8
    // (item, row) units ((3 cols) % 8 items of `here` rows: with cols = 3, the ninth
    // item's rows), its units go one a warp, in the k loop of the warp's last item:
    // no warp takes a second item on its own. Every dot keeps its lanes' order and
    // its tree, so the bits are the same either way. The biases of a warp's first
    // item and of its unit were loaded with the staged operands (above).
    for (int item = warp; item < whole; item += WARPS) {
        const int p = item / cols, c = item % cols;
        const float* wrow = w_sh + (p == 2 ? cols * hidden : 0) + c * hidden;
        const bool with_unit = has_unit && item + WARPS >= whole;  // this warp's last item
        const float* w1 = with_unit ? w_sh + (unit_p == 2 ? cols * hidden : 0) + unit_c * hidden : nullptr;
        const float* x1 = x_sh + (unit_p * DQN_HEAD_ROWS + unit_row) * hidden;
        const float bias = item == warp ? first_bias : (p == 2 ? b_target : b_online)[c];
        float acc[DQN_HEAD_ROWS], unit = 0.0f;
#pragma unroll
        for (int i = 0; i < DQN_HEAD_ROWS; ++i) acc[i] = 0.0f;
        if (vec)
            lane_dots<true>(wrow, x_sh + p * DQN_HEAD_ROWS * hidden, hidden, here, lane, acc, w1, x1, unit);
        else
            lane_dots<false>(wrow, x_sh + p * DQN_HEAD_ROWS * hidden, hidden, here, lane, acc, w1, x1, unit);
#pragma unroll
        for (int off = 16; off >= 1; off >>= 1) {
#pragma unroll
            for (int i = 0; i < DQN_HEAD_ROWS; ++i) acc[i] += __shfl_down_sync(0xffffffffu, acc[i], off);
            unit += __shfl_down_sync(0xffffffffu, unit, off);
        }
        if (lane == 0) {
            float* out = p == 0 ? q_s : (p == 1 ? q_next : q_target);
            for (int i = 0; i < here; ++i) {
                const float z = acc[i] + bias;
                q_sh[(p * DQN_HEAD_ROWS + i) * cols + c] = z;
                out[(j0 + i) * cols + c] = z;
            }
            if (with_unit) {
                const float z = unit + unit_bias;
                q_sh[(unit_p * DQN_HEAD_ROWS + unit_row) * cols + unit_c] = z;
                (unit_p == 0 ? q_s : (unit_p == 1 ? q_next : q_target))[(j0 + unit_row) * cols + unit_c] = z;
            }
        }
    }
    __syncthreads();

    SampleTerms terms;
    if (live)  // row t of each Q tile is read and written by thread t only
        terms = sample_loss(q_sh + (DQN_HEAD_ROWS + t) * cols, q_sh + (2 * DQN_HEAD_ROWS + t) * cols,
                            q_sh + t * cols, a, r, d, w, batch, n_actions, gamma, huber_delta, &priorities[j],
                            a_star != nullptr ? &a_star[j] : nullptr);
    __syncthreads();
    for (int e = t; e < here * cols; e += DQN_HEAD_THREADS) dout[j0 * cols + e] = q_sh[e];

    // dh[r][k] = sum_c dout[r][c] W[c][k], masked by h_s[r][k] > 0.
    for (int k = t; k < hidden; k += DQN_HEAD_THREADS) {
        float acc[DQN_HEAD_ROWS];
#pragma unroll
        for (int i = 0; i < DQN_HEAD_ROWS; ++i) acc[i] = 0.0f;
        for (int c = 0; c < cols; ++c) {
            const float wk = w_sh[c * hidden + k];
#pragma unroll
            for (int i = 0; i < DQN_HEAD_ROWS; ++i) acc[i] = fmaf(q_sh[i * cols + c], wk, acc[i]);
        }
        for (int i = 0; i < here; ++i) dh[x0 + (long long)i * hidden + k] = x_sh[i * hidden + k] > 0.0f ? acc[i] : 0.0f;
    }
    if (counter == nullptr) {
        // The means left to dqn_means_256: this block's partials. Its live rows are
        // threads 0 .. DQN_HEAD_ROWS - 1, all in warp 0, and every other thread's terms
        // are +0. dt_block_sums' levels across the warps would only add +0 to warp 0's
        // values (x + 0 is x; -0 + 0 is +0, which the first shuffle level below does
        // as well), so warp 0's shuffle tree alone gives its bits, with no barrier, and
        // the other warps are done once their stores are issued.
        static_assert(DQN_HEAD_ROWS <= 32, "the block's rows are threads of warp 0");
        if (warp != 0) return;
        double v[3] = {terms.loss, terms.q, terms.abs_td};
#pragma unroll
        for (int off = 16; off >= 1; off >>= 1)
#pragma unroll
            for (int i = 0; i < 3; ++i) v[i] += __shfl_down_sync(0xffffffffu, v[i], off);
        if (lane == 0) {
            partials[blockIdx.x] = v[0];
            partials[gridDim.x + blockIdx.x] = v[1];
            partials[2 * gridDim.x + blockIdx.x] = v[2];
        }
        return;
    }
    publish_means<DQN_HEAD_THREADS>(terms, batch, scalars, partials, counter);
}

}  // namespace

#define DQN_HEAD_KERNEL(NAME, COLS)                                                                             \
    extern "C" __global__ void __launch_bounds__(DQN_HEAD_THREADS) NAME(                                        \
            const float* h_s, const float* h_next, const float* h_target, int hidden, const float* w_online,    \
            const float* b_online, const float* w_target, const float* b_target, const int* action,             \
            const float* reward, const float* done, const float* weights, int batch, int n_actions, float gamma,\
            float huber_delta, float* q_s, float* q_next, float* q_target, float* dout, float* dh,              \
            float* priorities, float* scalars, double* partials, unsigned int* counter, int* a_star,            \
            const int* gate) {                                                                                  \
        head_kernel<COLS>(h_s, h_next, h_target, hidden, w_online, b_online, w_target, b_target, action,        \
                          reward, done, weights, batch, n_actions, gamma, huber_delta, q_s, q_next, q_target,   \
                          dout, dh, priorities, scalars, partials, counter, a_star, gate);                      \
    }
// Any count of actions; and two only (CartPole, the small configuration), its loss
// compiled for them (docs/perf-notes.md, forty-sixth and forty-seventh passes). The same bits.
DQN_HEAD_KERNEL(dqn_head, 0)
DQN_HEAD_KERNEL(dqn_head_a2, 3)

// ============================================================== dqn_means_32, dqn_means_256
// scalars[0..2] from the partials of a dqn_loss (dqn_means_32) or dqn_head
// (dqn_means_256) launch of `blocks` blocks that ran with a null counter: block
// k sums mean k as that kernel's last block would, in the same order and tree
// (dt_block_sums gives each of its sums the bits of a dt_block_sum), so the
// same bits. It can run on another stream beside the kernels after the loss;
// whatever reads the scalars must wait for it. gate: as dqn_loss (then nothing
// is written). Launch: grid 3, block 32 or 256 (the kernel's own).
template <int THREADS>
__device__ __forceinline__ void means_kernel(const double* partials, int blocks, int batch, float* scalars,
                                             const int* gate) {
    dt_wait_prior_grid();
    dt_allow_dependents();
    if (gate != nullptr && *gate) return;
    const double s = dt_partials_sum<THREADS>(partials + (long long)blockIdx.x * blocks, blocks);
    if (threadIdx.x == 0) scalars[blockIdx.x] = (float)(s / batch);
}

static_assert(DQN_LOSS_THREADS == 32, "dqn_means_32 sums dqn_loss's partials");
extern "C" __global__ void __launch_bounds__(DQN_LOSS_THREADS) dqn_means_32(
        const double* partials, int blocks, int batch, float* scalars, const int* gate) {
    means_kernel<DQN_LOSS_THREADS>(partials, blocks, batch, scalars, gate);
}

static_assert(DQN_HEAD_THREADS == 256, "dqn_means_256 sums dqn_head's partials");
extern "C" __global__ void __launch_bounds__(DQN_HEAD_THREADS) dqn_means_256(
        const double* partials, int blocks, int batch, float* scalars, const int* gate) {
    means_kernel<DQN_HEAD_THREADS>(partials, blocks, batch, scalars, gate);
}

// ============================================================== spectral projection
// The two phases of spectral.cuh, one phase block per block of the grid.
// spectral_columns: grid = sum_m ceil(cols_m / 16), block SPECTRAL_THREADS (256).
// spectral_rows (and spectral_rows_staged): grid = sum_m ceil(rows_m / 16), block
//   SPECTRAL_THREADS, directly after spectral_columns on the same stream: it reads
//   W before its grid wait, which holds only when the kernel before it writes no W.
//   It leaves y' = W x in u_all, and after the column partials its partials of
//   ||y||^2 and ||x||^2 (spectral.cuh); dqn_finish (dqn_step.cu) takes sigma, the
//   scale and u_new from them.
// skip: when non-null and *skip != 0 both write nothing (they read their first
//   operands with the flag, so that the flag costs no round trip of its own).
extern "C" __global__ void __launch_bounds__(SPECTRAL_THREADS) spectral_columns(
        const float* params, const DtSpectralMatrix* mats, int n_mats, const float* u_all, float* v_all,
        double* partials, const int* skip) {
    const DtSpectralBlock where = dt_spectral_block(mats, n_mats, true, (int)blockIdx.x);  // the constant table
    dt_wait_prior_grid();
    dt_allow_dependents();
    // The flag is loaded with W and u: one round trip, not two.
    dt_spectral_columns_block((int)blockIdx.x, where, params, u_all, v_all, partials, dt_issued_flag(skip));
}

extern "C" __global__ void __launch_bounds__(SPECTRAL_THREADS) spectral_rows(
        const float* params, const DtSpectralMatrix* mats, int n_mats, float* u_all, const float* v_all,
        double* partials, const int* skip) {
    const DtSpectralBlock where = dt_spectral_block(mats, n_mats, false, (int)blockIdx.x);  // the constant table
    // W before the grid wait (it waits inside), the flag with the partials and x.
    dt_spectral_rows_block<true>((int)blockIdx.x, where, params, u_all, v_all, partials, skip);
}

// spectral_rows_staged: spectral_rows with the block's rows of W copied into dynamic
// shared memory before the wait instead of registers (64 registers a thread, not about
// 250, so other blocks fit beside it): give it 16 x min(cols, 1024) x 4 bytes for the
// widest matrix (drvtrain.rl.dqn.spectral_stage_bytes); with less it reads them after
// the wait. The same bits as spectral_rows.
extern "C" __global__ void __launch_bounds__(SPECTRAL_THREADS) spectral_rows_staged(
        const float* params, const DtSpectralMatrix* mats, int n_mats, float* u_all, const float* v_all,
        double* partials, const int* skip) {
    extern __shared__ float4 spectral_w_stage[];
    const DtSpectralBlock where = dt_spectral_block(mats, n_mats, false, (int)blockIdx.x);  // the constant table
    dt_spectral_rows_block<true, true>((int)blockIdx.x, where, params, u_all, v_all, partials, skip, spectral_w_stage,
                                       (int)(dt_dynamic_shared_bytes() / 16));
}
