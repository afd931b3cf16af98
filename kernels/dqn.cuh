// The table that drives the spectral projection kernels of dqn.cu, shared with
// any kernel that applies the resulting scales (e.g. the target-update pass).
//
// One DtSpectralMatrix per projected weight matrix W [rows, cols], in device
// memory, filled from the host. Byte layout (32 bytes, natural alignment, no
// padding; a numpy dtype of the same fields in this order matches it):
//   offset  0  int64  w_offset          float offset of W (row-major) in params
//   offset  8  int32  rows
//   offset 12  int32  cols
//   offset 16  int32  u_offset          float offset of u [rows] in u_all
//   offset 20  int32  v_offset          float offset of v [cols] in v_all
//   offset 24  int32  first_block_cols  first column block of this matrix
//   offset 28  int32  first_block_rows  first block of this matrix in spectral_rows' grid
// Matrix m owns dt_spectral_column_blocks(cols) = ceil(cols / 16) consecutive
// column blocks (16 columns each; they index the column phase's partials and
// counters) and dt_spectral_row_blocks(rows) = ceil(rows / 16) consecutive
// blocks of the spectral_rows grid: both running sums in table order, starting
// at 0. The column phase itself runs one block per column block and row chunk
// of 64 rows (dt_spectral_row_chunks(rows)), matrix after matrix in table
// order, so its grid is sum_m column_blocks_m * row_chunks_m.
#pragma once

struct DtSpectralMatrix {
    long long w_offset;
    int rows;
    int cols;
    int u_offset;
    int v_offset;
    int first_block_cols;
    int first_block_rows;
};
static_assert(sizeof(DtSpectralMatrix) == 32, "the host fills this table byte for byte");

constexpr int DT_SPECTRAL_COLS_PER_BLOCK = 16;  // columns of W^T u per column block
constexpr int DT_SPECTRAL_CHUNK_ROWS = 64;      // rows of one column block per column-phase block
constexpr int DT_SPECTRAL_ROWS_PER_BLOCK = 16;  // rows of W v per spectral_rows block

__device__ __forceinline__ int dt_spectral_column_blocks(int cols) {
    return (cols + DT_SPECTRAL_COLS_PER_BLOCK - 1) / DT_SPECTRAL_COLS_PER_BLOCK;
}

__device__ __forceinline__ int dt_spectral_row_chunks(int rows) {
    return (rows + DT_SPECTRAL_CHUNK_ROWS - 1) / DT_SPECTRAL_CHUNK_ROWS;
}

__device__ __forceinline__ int dt_spectral_row_blocks(int rows) {
    return (rows + DT_SPECTRAL_ROWS_PER_BLOCK - 1) / DT_SPECTRAL_ROWS_PER_BLOCK;
}
