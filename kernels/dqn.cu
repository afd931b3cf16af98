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

namespace {

__device__ __forceinline__ float quiet_nan() { return __int_as_float(0x7fffffff); }

// x != x is the NaN test (no fast-math, so it is not folded away).
__device__ __forceinline__ bool is_nan(float x) { return x != x; }

// max(n, 1e-12) that keeps a NaN norm NaN (fmax would return 1e-12).
__device__ __forceinline__ double norm_floor(double n) { return n < 1e-12 ? 1e-12 : n; }

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
// One power iteration per matrix W [rows, cols] of the table (dqn.cuh), with
// the persistent u [rows] in u_all:
//   x = W^T u;  v = x / max(||x||, 1e-12);  y = W v;  u_new = y / max(||y||, 1e-12)
//   sigma = u_new . y  (computed as ||y||^2 / max(||y||, 1e-12), the same number)
//   scale = c / sigma if sigma > c, else exactly 1 (min(1, c / sigma); a NaN sigma gives 1)
// W is not changed here: the caller applies W *= scale[m] later.
// Phase 1 (spectral_columns) writes x unnormalised into v_all and one partial
// ||x||^2 per block; phase 2 (spectral_rows) forms ||x|| in every block from
// those partials (same order, so the same bits in every block), normalises v
// while staging it, computes y, and the last block of each matrix normalises u
// and writes sigma and scale. Phase 1 therefore needs no last block.
// Between the two launches v_all holds x, and during phase 2 u_all holds y.
//
// Scratch (the same `partials` buffer goes to both kernels):
//   partials: GC + GR doubles, GC = spectral_columns' grid, GR = spectral_rows'
//     grid. Phase 1 writes [0, GC); phase 2 reads them and writes [GC, GC + GR).
//     Phase 2 finds GC from the table as max_m(first_block_cols + ceil(cols / 16)).
//   v_all: sum(cols) floats (v_offset); no y scratch: y is staged in u_all.
//   counters: n_mats uints, zero on entry and left zero; used by
//     spectral_rows only (spectral_columns ignores its argument, which may be null).
// skip: when non-null and *skip != 0 both kernels return at once, writing nothing.
// Sizes: rows, cols >= 1, any size (the 1024-column bound of the v stage is
//   handled by chunks). float4 loads when cols % 4 == 0 and W is 16-byte aligned.
// Determinism: fixed per-thread loop orders, fixed shuffle/shared trees and
//   partials added in block order; bitwise reproducible for a fixed table.
constexpr int SPECTRAL_THREADS = 256;
constexpr int SPECTRAL_WARPS = SPECTRAL_THREADS / 32;
constexpr int SPECTRAL_QUADS = DT_SPECTRAL_COLS_PER_BLOCK / 4;            // float4 lanes across columns
constexpr int SPECTRAL_ROW_LANES = SPECTRAL_THREADS / SPECTRAL_QUADS;     // lanes down the rows
constexpr int SPECTRAL_ROWS_PER_WARP = DT_SPECTRAL_ROWS_PER_BLOCK / SPECTRAL_WARPS;
constexpr int SPECTRAL_V_CHUNK = 1024;                                    // floats of v staged at a time
static_assert(DT_SPECTRAL_COLS_PER_BLOCK % 4 == 0 && 32 % SPECTRAL_QUADS == 0, "quads tile a warp");
static_assert(DT_SPECTRAL_ROWS_PER_BLOCK % SPECTRAL_WARPS == 0, "rows split evenly over warps");

namespace {

// The matrix whose block range in this grid holds blockIdx.x, or -1.
__device__ __forceinline__ int spectral_find(const DtSpectralMatrix* mats, int n_mats, bool by_columns,
                                             DtSpectralMatrix& mat, int& block) {
    int found = -1;
    for (int k = 0; k < n_mats; ++k) {
        const DtSpectralMatrix e = mats[k];
        const int first = by_columns ? e.first_block_cols : e.first_block_rows;
        const int count = by_columns ? dt_spectral_column_blocks(e.cols) : dt_spectral_row_blocks(e.rows);
        const int b = (int)blockIdx.x - first;
        if (found < 0 && b >= 0 && b < count) {
            found = k;
            mat = e;
            block = b;
        }
    }
    return found;
}

__device__ __forceinline__ bool aligned16(const void* p) {
    return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0;
}

}  // namespace

// spectral_columns: x = W^T u for DT_SPECTRAL_COLS_PER_BLOCK (16) columns per
//   block, all rows. Thread t takes column quad t % 4 and rows t / 4, t / 4 + 64, ...
//   so a warp reads 8 rows x 64 contiguous bytes. Writes v_all[v_offset + j] = x_j
//   and partials[blockIdx.x] = sum of x_j^2 over the block's columns.
// Launch: grid = sum_m ceil(cols_m / 16) (matrix m at first_block_cols), block
//   SPECTRAL_THREADS (256).
extern "C" __global__ void __launch_bounds__(SPECTRAL_THREADS) spectral_columns(
        const float* params, const DtSpectralMatrix* mats, int n_mats, const float* u_all, float* v_all,
        double* partials, unsigned int* counters, const int* skip) {
    dt_wait_prior_grid();
    dt_allow_dependents();
    (void)counters;
    if (skip != nullptr && *skip != 0) return;
    DtSpectralMatrix mat;
    int block = 0;
    if (spectral_find(mats, n_mats, true, mat, block) < 0) return;
    __shared__ double warp_sums[SPECTRAL_WARPS][DT_SPECTRAL_COLS_PER_BLOCK];
    __shared__ double squares[DT_SPECTRAL_COLS_PER_BLOCK];

    const int rows = mat.rows, cols = mat.cols;
    const float* W = params + mat.w_offset;
    const float* u = u_all + mat.u_offset;
    const int quad = threadIdx.x % SPECTRAL_QUADS;
    const int lane_row = threadIdx.x / SPECTRAL_QUADS;
    const int j0 = block * DT_SPECTRAL_COLS_PER_BLOCK + 4 * quad;
    double acc[4] = {0.0, 0.0, 0.0, 0.0};
    if (j0 < cols) {
        if (cols % 4 == 0 && aligned16(W)) {
#pragma unroll 8
            for (int i = lane_row; i < rows; i += SPECTRAL_ROW_LANES) {
                const float4 w = *reinterpret_cast<const float4*>(W + (long long)i * cols + j0);
                const double ui = u[i];
                acc[0] += (double)w.x * ui;
                acc[1] += (double)w.y * ui;
                acc[2] += (double)w.z * ui;
                acc[3] += (double)w.w * ui;
            }
        } else {
            const int n = min(4, cols - j0);
            for (int i = lane_row; i < rows; i += SPECTRAL_ROW_LANES) {
                const float* p = W + (long long)i * cols + j0;
                const double ui = u[i];
                for (int e = 0; e < n; ++e) acc[e] += (double)p[e] * ui;
            }
        }
    }
    // Sum over the row lanes: the 8 of a warp by a fixed butterfly, then the
    // warps in order.
#pragma unroll
    for (int e = 0; e < 4; ++e)
#pragma unroll
        for (int off = SPECTRAL_QUADS; off < 32; off <<= 1) acc[e] += __shfl_xor_sync(0xffffffffu, acc[e], off);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane < SPECTRAL_QUADS)
        for (int e = 0; e < 4; ++e) warp_sums[warp][4 * lane + e] = acc[e];
    __syncthreads();
    if (threadIdx.x < DT_SPECTRAL_COLS_PER_BLOCK) {
        double x = 0.0;
        for (int w = 0; w < SPECTRAL_WARPS; ++w) x += warp_sums[w][threadIdx.x];
        const int j = block * DT_SPECTRAL_COLS_PER_BLOCK + threadIdx.x;
        if (j < cols) v_all[mat.v_offset + j] = (float)x;
        squares[threadIdx.x] = j < cols ? x * x : 0.0;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        double s = 0.0;
        for (int c = 0; c < DT_SPECTRAL_COLS_PER_BLOCK; ++c) s += squares[c];
        partials[blockIdx.x] = s;
    }
}

// spectral_rows: y = W v for DT_SPECTRAL_ROWS_PER_BLOCK (16) rows per block;
//   each warp takes rows warp, warp + 8 of the block and reads them along the
//   columns (float4 per lane), with v normalised into shared memory in chunks of
//   1024. Writes y_i into u_all[u_offset + i] and partials[GC + blockIdx.x] =
//   sum of y_i^2 over the block's rows; the last block of matrix m (counters[m])
//   overwrites u with u_new and writes sigma[m] and scale[m].
// Launch: grid = sum_m ceil(rows_m / 16) (matrix m at first_block_rows), block
//   SPECTRAL_THREADS (256). Runs after spectral_columns on the same stream.
extern "C" __global__ void __launch_bounds__(SPECTRAL_THREADS) spectral_rows(
        const float* params, const DtSpectralMatrix* mats, int n_mats, float* u_all, const float* v_all,
        float c, float* sigma, float* scale, double* partials, unsigned int* counters, const int* skip) {
    dt_wait_prior_grid();
    dt_allow_dependents();
    if (skip != nullptr && *skip != 0) return;
    DtSpectralMatrix mat;
    int block = 0;
    const int m = spectral_find(mats, n_mats, false, mat, block);
    if (m < 0) return;
    int column_grid = 0;
    for (int k = 0; k < n_mats; ++k) {
        const DtSpectralMatrix e = mats[k];
        column_grid = max(column_grid, e.first_block_cols + dt_spectral_column_blocks(e.cols));
    }
    __shared__ __align__(16) float v_stage[SPECTRAL_V_CHUNK];
    __shared__ double row_squares[DT_SPECTRAL_ROWS_PER_BLOCK];

    const int rows = mat.rows, cols = mat.cols;
    const float* W = params + mat.w_offset;
    float* u = u_all + mat.u_offset;
    double* row_partials = partials + column_grid;

    // ||x|| from phase 1's partials of this matrix, in block order.
    double s = 0.0;
    const int column_blocks = dt_spectral_column_blocks(cols);
    for (int b = threadIdx.x; b < column_blocks; b += SPECTRAL_THREADS) s += partials[mat.first_block_cols + b];
    const double x_norm = norm_floor(sqrt(dt_block_sum<SPECTRAL_THREADS>(s)));

    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int row0 = block * DT_SPECTRAL_ROWS_PER_BLOCK + warp;
    const bool vec = cols % 4 == 0 && aligned16(W);
    double acc[SPECTRAL_ROWS_PER_WARP];
#pragma unroll
    for (int r = 0; r < SPECTRAL_ROWS_PER_WARP; ++r) acc[r] = 0.0;
    for (int c0 = 0; c0 < cols; c0 += SPECTRAL_V_CHUNK) {
        const int len = min(SPECTRAL_V_CHUNK, cols - c0);
        __syncthreads();
        for (int e = threadIdx.x; e < len; e += SPECTRAL_THREADS)
            v_stage[e] = (float)((double)v_all[mat.v_offset + c0 + e] / x_norm);
        __syncthreads();
        if (vec) {
            const float4* v4 = reinterpret_cast<const float4*>(v_stage);
#pragma unroll 4
            for (int q = lane; q < len / 4; q += 32) {
                const float4 v = v4[q];
#pragma unroll
                for (int r = 0; r < SPECTRAL_ROWS_PER_WARP; ++r) {
                    const int i = row0 + r * SPECTRAL_WARPS;
                    if (i < rows) {
                        const float4 w = reinterpret_cast<const float4*>(W + (long long)i * cols + c0)[q];
                        acc[r] += (double)w.x * v.x;
                        acc[r] += (double)w.y * v.y;
                        acc[r] += (double)w.z * v.z;
                        acc[r] += (double)w.w * v.w;
                    }
                }
            }
        } else {
            for (int e = lane; e < len; e += 32) {
                const float v = v_stage[e];
#pragma unroll
                for (int r = 0; r < SPECTRAL_ROWS_PER_WARP; ++r) {
                    const int i = row0 + r * SPECTRAL_WARPS;
                    if (i < rows) acc[r] += (double)W[(long long)i * cols + c0 + e] * v;
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < SPECTRAL_ROWS_PER_WARP; ++r) {
#pragma unroll
        for (int off = 16; off >= 1; off >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], off);
        const int i = row0 + r * SPECTRAL_WARPS;
        if (lane == 0) {
            if (i < rows) u[i] = (float)acc[r];
            row_squares[warp + r * SPECTRAL_WARPS] = i < rows ? acc[r] * acc[r] : 0.0;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        double sq = 0.0;
        for (int r = 0; r < DT_SPECTRAL_ROWS_PER_BLOCK; ++r) sq += row_squares[r];
        row_partials[blockIdx.x] = sq;
    }

    const int row_blocks = dt_spectral_row_blocks(rows);
    if (!dt_last_block(&counters[m], (unsigned int)row_blocks)) return;
    s = 0.0;
    for (int b = threadIdx.x; b < row_blocks; b += SPECTRAL_THREADS)
        s += __ldcg(&row_partials[mat.first_block_rows + b]);
    const double y_squared = dt_block_sum<SPECTRAL_THREADS>(s);
    const double y_norm = norm_floor(sqrt(y_squared));
    for (int i = threadIdx.x; i < rows; i += SPECTRAL_THREADS) u[i] = (float)((double)__ldcg(&u[i]) / y_norm);
    if (threadIdx.x == 0) {
        const double sig = y_squared / y_norm;
        sigma[m] = (float)sig;
        // W stays exactly as it was unless sigma > c (so a NaN sigma leaves it too).
        scale[m] = sig > (double)c ? (float)((double)c / sig) : 1.0f;
    }
}
