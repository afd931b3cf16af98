// The spectral projection's power iteration as block bodies, shared by the
// kernels of dqn.cu and the cooperative tail of dqn_step.cu.
#pragma once
#include "common.cuh"
#include "dqn.cuh"

// One power iteration per matrix W [rows, cols] of the table (dqn.cuh), with
// the persistent u [rows] in u_all:
//   x = W^T u;  v = x / max(||x||, 1e-12);  y = W v;  u_new = y / max(||y||, 1e-12)
//   sigma = u_new . y  (computed as ||y||^2 / max(||y||, 1e-12), the same number)
//   scale = c / sigma if sigma > c, else exactly 1 (min(1, c / sigma); a NaN sigma gives 1)
// The two phases here are block bodies (dt_spectral_columns_block,
// dt_spectral_rows_block) over a phase block index: the kernels of dqn.cu run
// one per block of their grid, and dqn_step.cu's cooperative tail loops its
// blocks over them with a grid barrier between the phases. The same blocks, the
// same partials in the same order: the same bits either way.
// Phase 1 (spectral_columns) writes x unnormalised into v_all and one partial
// ||x||^2 per block. Phase 2 (spectral_rows) computes y' = W x from x as phase
// 1 stored it, into u_all, so that no dot product waits on a norm; after them
// every block sums phase 1's partials into ||x||^2 (the same order, so the same
// bits in every block), writes it to its slot and one partial ||y||^2 per block,
// its rows' sum of y'^2 divided by max(||x||^2, 1e-24) (so y = y' / max(||x||,
// 1e-12), and the partials add up to ||y||^2). Neither phase has a last block:
// whoever needs ||y|| sums phase 2's partials in the same order (dt_partials_sum
// in common.cuh), in every block that needs it. The finish pass (dqn_step.cu)
// does: it takes sigma and the scale, forms u_new = y' / (max(||x||, 1e-12)
// max(||y||, 1e-12)) and applies W *= scale[m].
// Between the phases v_all holds x; after phase 2, u_all holds y' until the
// finish pass replaces it with u_new. y' = W x is about sigma^2 ||u|| (y about
// sigma), both stored as floats: sigma up to about 1e19 (and down to 1e-19) stays
// in range, far past any layer this projection bounds.
//
// Scratch (the same `partials` buffer goes to both kernels):
//   partials: GC + 2 GR doubles, GC = spectral_columns' grid, GR = spectral_rows'
//     grid. Phase 1 writes [0, GC); phase 2 reads them and writes its partials of
//     ||y||^2 to [GC, GC + GR) and ||x||^2 of its block's matrix to
//     [GC + GR, GC + 2 GR) (every block of a matrix the same bits). Both find GC and
//     GR from the table: max_m(first_block_cols + ceil(cols / 16)) and
//     max_m(first_block_rows + ceil(rows / 16)).
//   v_all: sum(cols) floats (v_offset); no y' scratch: y' is staged in u_all.
// skip: when non-null and *skip != 0 both kernels write nothing (they load their
//   first operands with the flag, then return).
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
constexpr int SPECTRAL_V_PER_THREAD = SPECTRAL_V_CHUNK / SPECTRAL_THREADS;  // of a chunk, loaded early
constexpr int SPECTRAL_Q_PER_LANE = SPECTRAL_V_CHUNK / 4 / 32;            // float4s of a row's chunk per lane
constexpr int SPECTRAL_COLUMN_LOADS = 8;  // rows a columns-phase thread loads at once
static_assert(DT_SPECTRAL_COLS_PER_BLOCK % 4 == 0 && 32 % SPECTRAL_QUADS == 0, "quads tile a warp");
static_assert(DT_SPECTRAL_ROWS_PER_BLOCK % SPECTRAL_WARPS == 0, "rows split evenly over warps");

namespace {

// max(n, 1e-12) that keeps a NaN norm NaN (fmax would return 1e-12).
__device__ __forceinline__ double spectral_norm_floor(double n) { return n < 1e-12 ? 1e-12 : n; }

// The same floor on a squared norm: max(n2, 1e-24), NaN kept.
__device__ __forceinline__ double spectral_square_floor(double n2) { return n2 < 1e-24 ? 1e-24 : n2; }

// The matrix whose block range in this phase holds block `index`, or -1.
__device__ __forceinline__ int spectral_find(const DtSpectralMatrix* mats, int n_mats, bool by_columns, int index,
                                             DtSpectralMatrix& mat, int& block) {
    int found = -1;
    for (int k = 0; k < n_mats; ++k) {
        const DtSpectralMatrix e = mats[k];
        const int first = by_columns ? e.first_block_cols : e.first_block_rows;
        const int count = by_columns ? dt_spectral_column_blocks(e.cols) : dt_spectral_row_blocks(e.rows);
        const int b = index - first;
        if (found < 0 && b >= 0 && b < count) {
            found = k;
            mat = e;
            block = b;
        }
    }
    return found;
}

// acc += w . v in double, one element at a time in x, y, z, w order (the rows
// phase's sum order, whichever way w arrived).
__device__ __forceinline__ void spectral_dot4(double& acc, const float4& w, const float4& v) {
    acc += (double)w.x * v.x;
    acc += (double)w.y * v.y;
    acc += (double)w.z * v.z;
    acc += (double)w.w * v.w;
}

__device__ __forceinline__ bool aligned16(const void* p) {
    return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0;
}

}  // namespace

// Phase block `index`'s place in the table, for either phase: the matrix, the
// block within it (`found` -1 when no matrix holds the index) and, for the rows
// phase, both phases' grids (0 for the columns phase, which needs neither). The
// table is constant for the step's life, so a kernel finds
// its block before it waits for the kernel before it: the table's loads leave
// the chain.
struct DtSpectralBlock {
    DtSpectralMatrix mat;
    int found, block, column_grid, row_grid;
};

__device__ __forceinline__ DtSpectralBlock dt_spectral_block(const DtSpectralMatrix* mats, int n_mats,
                                                             bool by_columns, int index) {
    DtSpectralBlock b;
    b.block = 0;
    b.found = spectral_find(mats, n_mats, by_columns, index, b.mat, b.block);
    b.column_grid = 0;
    b.row_grid = 0;
    if (!by_columns)
        for (int k = 0; k < n_mats; ++k) {
            const DtSpectralMatrix e = mats[k];
            b.column_grid = max(b.column_grid, e.first_block_cols + dt_spectral_column_blocks(e.cols));
            b.row_grid = max(b.row_grid, e.first_block_rows + dt_spectral_row_blocks(e.rows));
        }
    return b;
}

// spectral_columns: x = W^T u for DT_SPECTRAL_COLS_PER_BLOCK (16) columns per
//   block, all rows. Thread t takes column quad t % 4 and rows t / 4, t / 4 + 64, ...
//   so a warp reads 8 rows x 64 contiguous bytes. Writes v_all[v_offset + j] = x_j
//   and partials[index] = sum of x_j^2 over the block's columns.
// Blocks: index in [0, sum_m ceil(cols_m / 16)) (matrix m from first_block_cols),
//   `where` = dt_spectral_block(.., true, index), SPECTRAL_THREADS (256) threads,
//   every one of which calls it. `skipped` (the kernel's skip flag, loaded with W
//   and u; 0 in the cooperative tail) non-zero: it reads but writes nothing.
__device__ __forceinline__ void dt_spectral_columns_block(int index, const DtSpectralBlock& where,
                                                          const float* params, const float* u_all, float* v_all,
                                                          double* partials, int skipped) {
    if (where.found < 0) return;
    const DtSpectralMatrix& mat = where.mat;
    const int block = where.block;
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
            // SPECTRAL_COLUMN_LOADS rows at a time, every load issued before the first
            // add (a rolled loop would wait a round trip per row: 256 rows are only 4).
            for (int i0 = lane_row; i0 < rows; i0 += SPECTRAL_COLUMN_LOADS * SPECTRAL_ROW_LANES) {
                float4 w[SPECTRAL_COLUMN_LOADS];
                float uf[SPECTRAL_COLUMN_LOADS];
#pragma unroll
                for (int k = 0; k < SPECTRAL_COLUMN_LOADS; ++k) {
                    const int i = i0 + k * SPECTRAL_ROW_LANES;
                    w[k] = i < rows ? *reinterpret_cast<const float4*>(W + (long long)i * cols + j0) : float4{};
                    uf[k] = i < rows ? u[i] : 0.0f;
                }
#pragma unroll
                for (int k = 0; k < SPECTRAL_COLUMN_LOADS; ++k) {
                    if (i0 + k * SPECTRAL_ROW_LANES < rows) {  // rows in order: the same sums
                        const double ui = uf[k];
                        acc[0] += (double)w[k].x * ui;
                        acc[1] += (double)w[k].y * ui;
                        acc[2] += (double)w[k].z * ui;
                        acc[3] += (double)w[k].w * ui;
                    }
                }
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
    if (skipped) return;  // block-uniform; checked once the loads are in
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
        partials[index] = s;
    }
}

// spectral_rows: y' = W x for DT_SPECTRAL_ROWS_PER_BLOCK (16) rows per block;
//   each warp takes rows warp, warp + 8 of the block and reads them along the
//   columns (float4 per lane), with x staged in shared memory in chunks of 1024.
//   Writes y'_i into u_all[u_offset + i]; then, with X = ||x||^2 (phase 1's
//   partials of the matrix, dt_partials_sum's order), partials[GC + GR + index] = X
//   and partials[GC + index] = (sum of y'_i^2 over the block's rows) / max(X, 1e-24).
// Blocks: index in [0, sum_m ceil(rows_m / 16)) (matrix m from first_block_rows),
//   `where` = dt_spectral_block(.., false, index), SPECTRAL_THREADS (256) threads,
//   every one of which calls it; after every block of phase 1 has finished.
//   The first chunk's operands (x, and on the float4 path the block's rows of W,
//   see STAGED) are loaded before anything waits on them, and this thread's first
//   partial of phase 1 with them (used after the products: one round trip for
//   both). It takes
//   the skip flag's address (the columns phase takes its value): where the flag
//   is set it returns before writing; the cooperative tail passes null (never set).
// WAIT (the spectral_rows kernels, dependent launches directly after
//   spectral_columns): the function calls the grid wait itself, after the float4
//   path's first chunk of the block's rows of W is on its way and before
//   everything else. W is settled there: the columns phase does not write it, and
//   W's writer (AdamW) ended before that phase's own wait returned, which every
//   drvtrain kernel passes before it lets its dependents start (common.cuh).
// Where that first chunk waits (the same bits either way: the same sum order):
//   STAGED false: in registers, each lane's float4s of its warp's rows (about 250
//     registers a thread: no other block fits beside this one on its SM);
//   STAGED true: in shared memory, `w_stage`, copied by cp.async (64 registers a
//     thread). w_stage holds `stage_quads` float4s; the block's 16 rows of the
//     first chunk need 16 x min(cols, 1024) / 4. With fewer (a launch that gives
//     less dynamic shared memory) the first chunk is read after the wait, like
//     the later ones.
template <bool WAIT, bool STAGED = false>
__device__ __forceinline__ void dt_spectral_rows_block(int index, const DtSpectralBlock& where, const float* params,
                                                       float* u_all, const float* v_all, double* partials,
                                                       const int* skip, float4* w_stage = nullptr,
                                                       int stage_quads = 0) {
    if (where.found < 0) {
        if constexpr (WAIT) {
            dt_wait_prior_grid();
            dt_allow_dependents();
        }
        return;
    }
    const DtSpectralMatrix& mat = where.mat;
    const int block = where.block, column_grid = where.column_grid;
    __shared__ __align__(16) float v_stage[SPECTRAL_V_CHUNK];
    __shared__ double row_squares[DT_SPECTRAL_ROWS_PER_BLOCK];
    __shared__ double x_shares[SPECTRAL_THREADS];

    const int rows = mat.rows, cols = mat.cols;
    const float* W = params + mat.w_offset;
    float* u = u_all + mat.u_offset;
    double* row_partials = partials + column_grid;
    double* x_squares = row_partials + where.row_grid;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int row0 = block * DT_SPECTRAL_ROWS_PER_BLOCK + warp;
    const bool vec = cols % 4 == 0 && aligned16(W);

    // Everything the first chunk needs, loaded before anything waits on it: on the
    // float4 path its lane's float4s of the warp's rows (before the grid wait where
    // WAIT), its values of x in the first chunk; and in the same round this thread's
    // first partial of phase 1, for ||x|| after the products.
    const int column_blocks = dt_spectral_column_blocks(cols);
    const int len0 = min(SPECTRAL_V_CHUNK, cols);
    const int quads0 = len0 / 4;  // float4s of a row's first chunk
    float4 w0[STAGED ? 1 : SPECTRAL_ROWS_PER_WARP][STAGED ? 1 : SPECTRAL_Q_PER_LANE] = {};
    const bool staged = STAGED && vec && DT_SPECTRAL_ROWS_PER_BLOCK * quads0 <= stage_quads;
    if constexpr (STAGED) {
        if (staged) {
            const int first_row = block * DT_SPECTRAL_ROWS_PER_BLOCK;
            const unsigned int base = (unsigned int)__cvta_generic_to_shared(w_stage);
            for (int e = threadIdx.x; e < DT_SPECTRAL_ROWS_PER_BLOCK * quads0; e += SPECTRAL_THREADS) {
                const int r = e / quads0, q = e - r * quads0;
                if (first_row + r < rows)
                    dt_cp_async16(base + 16u * (unsigned int)e, W + (long long)(first_row + r) * cols + 4 * q, 16);
            }
            dt_cp_async_commit();
        }
    } else if (vec) {
#pragma unroll
        for (int r = 0; r < SPECTRAL_ROWS_PER_WARP; ++r) {
            const int i = row0 + r * SPECTRAL_WARPS;
#pragma unroll
            for (int k = 0; k < SPECTRAL_Q_PER_LANE; ++k) {
                const int q = lane + 32 * k;
                if (i < rows && q < quads0) w0[r][k] = reinterpret_cast<const float4*>(W + (long long)i * cols)[q];
            }
        }
    }
    if constexpr (WAIT) {
        dt_wait_prior_grid();
        dt_allow_dependents();
    }
    const int skipped = dt_read_flag(skip);
    const double partial0 = (int)threadIdx.x < column_blocks ? partials[mat.first_block_cols + threadIdx.x] : 0.0;
    float x0[SPECTRAL_V_PER_THREAD];
#pragma unroll
    for (int k = 0; k < SPECTRAL_V_PER_THREAD; ++k) {
        const int e = threadIdx.x + k * SPECTRAL_THREADS;
        x0[k] = e < len0 ? v_all[mat.v_offset + e] : 0.0f;
    }
    // The loads above are issued before the flag (block-uniform) is tested; the
    // copies are complete before the block may leave.
    dt_issued(skipped);
    dt_issued(partial0);
#pragma unroll
    for (int k = 0; k < SPECTRAL_V_PER_THREAD; ++k) dt_issued(x0[k]);
    if constexpr (STAGED) {
        if (staged) dt_cp_async_wait<0>();
    } else {
#pragma unroll
        for (int r = 0; r < SPECTRAL_ROWS_PER_WARP; ++r)
#pragma unroll
            for (int k = 0; k < SPECTRAL_Q_PER_LANE; ++k) dt_issued(w0[r][k]);
    }
    if (skipped) return;

    double acc[SPECTRAL_ROWS_PER_WARP];
#pragma unroll
    for (int r = 0; r < SPECTRAL_ROWS_PER_WARP; ++r) acc[r] = 0.0;
    for (int c0 = 0; c0 < cols; c0 += SPECTRAL_V_CHUNK) {
        const int len = min(SPECTRAL_V_CHUNK, cols - c0);
        __syncthreads();
        if (c0 == 0) {
#pragma unroll
            for (int k = 0; k < SPECTRAL_V_PER_THREAD; ++k) {
                const int e = threadIdx.x + k * SPECTRAL_THREADS;
                if (e < len) v_stage[e] = x0[k];
            }
        } else {
            for (int e = threadIdx.x; e < len; e += SPECTRAL_THREADS)
                v_stage[e] = v_all[mat.v_offset + c0 + e];
        }
        __syncthreads();
        if (vec) {
            const float4* v4 = reinterpret_cast<const float4*>(v_stage);
            if constexpr (!STAGED) {
                if (c0 == 0) {  // the rows in registers
#pragma unroll
                    for (int k = 0; k < SPECTRAL_Q_PER_LANE; ++k) {
                        const int q = lane + 32 * k;
                        if (q < len / 4) {
                            const float4 v = v4[q];
#pragma unroll
                            for (int r = 0; r < SPECTRAL_ROWS_PER_WARP; ++r) {
                                if (row0 + r * SPECTRAL_WARPS < rows) spectral_dot4(acc[r], w0[r][k], v);
                            }
                        }
                    }
                    continue;
                }
            } else {
                if (c0 == 0 && staged) {  // the rows in shared memory, in the same order
#pragma unroll 4
                    for (int q = lane; q < quads0; q += 32) {
                        const float4 v = v4[q];
#pragma unroll
                        for (int r = 0; r < SPECTRAL_ROWS_PER_WARP; ++r) {
                            const int local = warp + r * SPECTRAL_WARPS;
                            if (row0 + r * SPECTRAL_WARPS < rows)
                                spectral_dot4(acc[r], w_stage[local * quads0 + q], v);
                        }
                    }
                    continue;
                }
            }
#pragma unroll 4
            for (int q = lane; q < len / 4; q += 32) {
                const float4 v = v4[q];
#pragma unroll
                for (int r = 0; r < SPECTRAL_ROWS_PER_WARP; ++r) {
                    const int i = row0 + r * SPECTRAL_WARPS;
                    if (i < rows)
                        spectral_dot4(acc[r], reinterpret_cast<const float4*>(W + (long long)i * cols + c0)[q], v);
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
    // This thread's share of ||x||^2 (dt_partials_share's order), for warp 0's block sum
    // after the barrier the row sums need anyway.
    double s = 0.0;
    if ((int)threadIdx.x < column_blocks) s += partial0;
    for (int b = threadIdx.x + SPECTRAL_THREADS; b < column_blocks; b += SPECTRAL_THREADS)
        s += __ldcg(&partials[mat.first_block_cols + b]);
    x_shares[threadIdx.x] = s;
    __syncthreads();
    if (warp == 0) {
        const double x_squared = dt_block_sum_warp0<SPECTRAL_THREADS>(x_shares);
        if (lane == 0) {
            double sq = 0.0;
            for (int r = 0; r < DT_SPECTRAL_ROWS_PER_BLOCK; ++r) sq += row_squares[r];
            x_squares[index] = x_squared;
            row_partials[index] = sq / spectral_square_floor(x_squared);
        }
    }
}

// From ||x||^2 and ||y||^2 of a matrix: sigma, the scale applied to W and u_den,
// the divisor that turns y' into u_new (max(||x||, 1e-12) max(||y||, 1e-12)).
struct DtSpectralResult {
    double u_den;
    float sigma, scale;
};

__device__ __forceinline__ DtSpectralResult dt_spectral_result(double x_squared, double y_squared, float c) {
    DtSpectralResult r;
    const double y_norm = spectral_norm_floor(sqrt(y_squared));
    const double sig = y_squared / y_norm;
    r.u_den = spectral_norm_floor(sqrt(x_squared)) * y_norm;
    r.sigma = (float)sig;
    // W stays exactly as it was unless sigma > c (so a NaN sigma leaves it too).
    r.scale = sig > (double)c ? (float)((double)c / sig) : 1.0f;
    return r;
}
