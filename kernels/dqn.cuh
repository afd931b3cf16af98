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
//   offset 24  int32  first_block_cols  first block of this matrix in spectral_columns' grid
//   offset 28  int32  first_block_rows  first block of this matrix in spectral_rows' grid
// Matrix m owns dt_spectral_column_blocks(cols) consecutive blocks of the
// spectral_columns grid and dt_spectral_row_blocks(rows) of the spectral_rows
// grid, i.e. ceil(cols / DT_SPECTRAL_COLS_PER_BLOCK) and
// ceil(rows / DT_SPECTRAL_ROWS_PER_BLOCK). The ranges must not overlap; the
// usual fill is a running sum in table order, starting at 0.
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

constexpr int DT_SPECTRAL_COLS_PER_BLOCK = 16;  // columns of W^T u per spectral_columns block
constexpr int DT_SPECTRAL_ROWS_PER_BLOCK = 16;  // rows of W v per spectral_rows block

__device__ __forceinline__ int dt_spectral_column_blocks(int cols) {
    return (cols + DT_SPECTRAL_COLS_PER_BLOCK - 1) / DT_SPECTRAL_COLS_PER_BLOCK;
}

__device__ __forceinline__ int dt_spectral_row_blocks(int rows) {
    return (rows + DT_SPECTRAL_ROWS_PER_BLOCK - 1) / DT_SPECTRAL_ROWS_PER_BLOCK;
}
