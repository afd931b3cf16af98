// Tiled GEMM with fused epilogues: the linear layers of drvtrain's MLPs.
//
//   C[i, j] = sum_k A(i, k) * B(k, j)
//
// Each operand is stored either "k-fast" (k contiguous) or "row-fast" (i, resp. j,
// contiguous), fixed per kernel at compile time so the tile loaders are a pointer
// walk with no per-element index arithmetic; lda/ldb are the other stride:
//   A k-fast: A(i, k) = A[i*lda + k]      A row-fast: A(i, k) = A[i + k*lda]
//   B k-fast: B(k, j) = B[j*ldb + k]      B row-fast: B(k, j) = B[j + k*ldb]
// The kernels are the three products of a linear layer Y = X W^T + b:
//   linear_forward[_relu]_{tf32,f32}  Y = X W^T + b (+ ReLU)      A = X k-fast, B = W k-fast
//   linear_grad_input_f32            dX = (dY W) * (X > 0)       A = dY k-fast, B = W row-fast
//   linear_grad_weight_f32           dW = dY^T X, db = sum_m dY   A = dY row-fast, B = X row-fast
// C is row-major with leading dimension ldc; `mask` is row-major with ldm.
//
// Arithmetic:
//   *_tf32: tensor cores, mma.sync m16n8k8 TF32 inputs with FP32 accumulation;
//           128 threads, 64x64 block tile, 2x2 warps of 32x32.
//   *_f32:  exact FP32 FFMA; 256 threads, 64x64 block tile, 4x4 outputs per thread.
// Tiles are 64 deep in k, with the next tile's loads in flight during the current
// one. Launch: grid (ceil(N/64), ceil(M/64), S), block 128 (tf32) or 256 (f32); S > 1
// splits the k range over S blocks per output tile (see Output), so that small
// products still spread over the SMs.
// Determinism: every output is one thread's accumulation in a fixed k order; db is
// summed by the blocks of grid column 0 in a fixed order. No atomics.
#include "common.cuh"

namespace {

constexpr int BM = 64, BN = 64, BK = 64, PAD = 4;  // PAD keeps fragment loads conflict-free

enum { EPI_NONE = 0, EPI_BIAS = 1, EPI_BIAS_RELU = 2, EPI_MASK = 3 };

__device__ __forceinline__ unsigned int to_tf32(float x) {
    unsigned int r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

// Tile loader: THREADS threads move a ROWS x BK tile into registers, then into
// shared memory as tile[row][k]. Consecutive threads take consecutive addresses
// along the contiguous dimension; each thread then walks a fixed stride.
template <int THREADS, int ROWS, bool K_FAST>
struct TileLoader {
    static constexpr int PER = ROWS * BK / THREADS;
    static constexpr int STEP = THREADS / (K_FAST ? BK : ROWS);  // rows (k-fast) or k (row-fast) per step
    float reg[PER];

    __device__ __forceinline__ void load(const float* base, int ld, int row0, int k0, int rows_total,
                                         int k_total) {
        const int fixed = threadIdx.x % (K_FAST ? BK : ROWS);
        const int first = threadIdx.x / (K_FAST ? BK : ROWS);
        if (K_FAST) {
            const int k = k0 + fixed, r = row0 + first;
            const float* p = base + (long long)r * ld + k;
#pragma unroll
            for (int i = 0; i < PER; ++i)
                reg[i] = (k < k_total && r + i * STEP < rows_total) ? p[(long long)i * STEP * ld] : 0.0f;
        } else {
            const int r = row0 + fixed, k = k0 + first;
            const float* p = base + r + (long long)k * ld;
#pragma unroll
            for (int i = 0; i < PER; ++i)
                reg[i] = (r < rows_total && k + i * STEP < k_total) ? p[(long long)i * STEP * ld] : 0.0f;
        }
    }

    template <bool TF32>
    __device__ __forceinline__ void store(float (*tile)[BK + PAD]) const {
        const int fixed = threadIdx.x % (K_FAST ? BK : ROWS);
        const int first = threadIdx.x / (K_FAST ? BK : ROWS);
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const float v = TF32 ? __uint_as_float(to_tf32(reg[i])) : reg[i];
            if (K_FAST) tile[first + i * STEP][fixed] = v;
            else tile[fixed][first + i * STEP] = v;
        }
    }
};

template <int EPI>
__device__ __forceinline__ void epilogue_store(float* C, int ldc, int M, int N, int i, int j, float v,
                                               const float* bias, const float* mask, int ldm) {
    if (i >= M || j >= N) return;
    if (EPI == EPI_BIAS || EPI == EPI_BIAS_RELU) v += bias[j];
    if (EPI == EPI_BIAS_RELU) v = fmaxf(v, 0.0f);
    // The layer input is relu(z), and relu(z) > 0 exactly when z > 0, so the mask
    // of the saved activation equals the mask of the pre-activation.
    if (EPI == EPI_MASK && !(mask[(long long)i * ldm + j] > 0.0f)) v = 0.0f;
    C[(long long)i * ldc + j] = v;
}

// Where a block's sums go. With gridDim.z == 1, through the epilogue into C. With
// the k range split over gridDim.z blocks, into partial tiles in `workspace`
// ([z][M][N], then the row sums [z][M]); the last block of each output tile to
// finish (dt_last_block on a counter per tile, no float atomics) adds the
// partials in z order and applies the epilogue. Deterministic either way.
template <int EPI>
struct Output {
    float* C;
    int ldc, M, N;
    const float* bias;
    const float* mask;
    int ldm;
    float* col_sum;
    float* workspace;
    unsigned int* counters;

    __device__ __forceinline__ void put(int i, int j, float v) const {
        if (gridDim.z == 1) epilogue_store<EPI>(C, ldc, M, N, i, j, v, bias, mask, ldm);
        else if (i < M && j < N) workspace[((long long)blockIdx.z * M + i) * N + j] = v;
    }

    __device__ __forceinline__ void put_row_sum(int i, float v) const {
        if (i >= M) return;
        if (gridDim.z == 1) col_sum[i] = v;
        else workspace[(long long)gridDim.z * M * N + (long long)blockIdx.z * M + i] = v;
    }

    __device__ void finish(bool sums) const {
        if (gridDim.z == 1) return;
        const unsigned int tile = blockIdx.y * gridDim.x + blockIdx.x;
        if (!dt_last_block(&counters[tile], gridDim.z)) return;
        const int i0 = blockIdx.y * BM, j0 = blockIdx.x * BN, splits = gridDim.z;
        // Each thread owns Q elements; for every z their loads go out together, so the
        // tail costs `splits` round trips, not splits * Q. The z order stays fixed.
        constexpr int Q = 16;  // BM * BN / 256; a 128-thread block runs the loop twice
        for (int base = threadIdx.x; base < BM * BN; base += Q * blockDim.x) {
            float v[Q];
#pragma unroll
            for (int q = 0; q < Q; ++q) v[q] = 0.0f;
            for (int z = 0; z < splits; ++z) {
                const float* part = workspace + (long long)z * M * N;
#pragma unroll
                for (int q = 0; q < Q; ++q) {
                    const int e = base + q * blockDim.x, i = i0 + e / BN, j = j0 + e % BN;
                    if (e < BM * BN && i < M && j < N) v[q] += __ldcg(&part[(long long)i * N + j]);
                }
            }
#pragma unroll
            for (int q = 0; q < Q; ++q) {
                const int e = base + q * blockDim.x;
                if (e < BM * BN) epilogue_store<EPI>(C, ldc, M, N, i0 + e / BN, j0 + e % BN, v[q], bias, mask, ldm);
            }
        }
        if (sums) {
            const float* rows = workspace + (long long)splits * M * N;
            for (int r = threadIdx.x; r < BM && i0 + r < M; r += blockDim.x) {
                float v = 0.0f;
                for (int z = 0; z < splits; ++z) v += __ldcg(&rows[(long long)z * M + i0 + r]);
                col_sum[i0 + r] = v;
            }
        }
    }
};

// This block's share of the k range: whole 64-deep tiles, split evenly over gridDim.z.
__device__ __forceinline__ void k_range(int K, int& begin, int& end) {
    const int tiles = (K + BK - 1) / BK;
    const int per = (tiles + gridDim.z - 1) / gridDim.z;
    begin = min(K, (int)blockIdx.z * per * BK);
    end = min(K, begin + per * BK);
}

template <int EPI, bool A_KFAST, bool B_KFAST>
__device__ void gemm_tf32(const float* A, int lda, const float* B, int ldb, int M, int N, int K,
                          const Output<EPI>& out) {
    constexpr int THREADS = 128;
    __shared__ float As[BM][BK + PAD];
    __shared__ float Bs[BN][BK + PAD];
    const int i0 = blockIdx.y * BM, j0 = blockIdx.x * BN;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wm = warp >> 1, wn = warp & 1, g = lane >> 2, t = lane & 3;
    float acc[2][4][4] = {};
    int kb, ke;
    k_range(K, kb, ke);
    TileLoader<THREADS, BM, A_KFAST> la;
    TileLoader<THREADS, BN, B_KFAST> lb;
    la.load(A, lda, i0, kb, M, ke);
    lb.load(B, ldb, j0, kb, N, ke);
    for (int k0 = kb; k0 < ke; k0 += BK) {
        la.template store<true>(As);
        lb.template store<true>(Bs);
        __syncthreads();
        if (k0 + BK < ke) {  // the next tile's global loads fly while this one computes
            la.load(A, lda, i0, k0 + BK, M, ke);
            lb.load(B, ldb, j0, k0 + BK, N, ke);
        }
#pragma unroll 2
        for (int kk = 0; kk < BK; kk += 8) {
            unsigned int a[2][4], b[4][2];
#pragma unroll
            for (int mi = 0; mi < 2; ++mi) {
                const int r = wm * 32 + mi * 16 + g;
                a[mi][0] = __float_as_uint(As[r][kk + t]);
                a[mi][1] = __float_as_uint(As[r + 8][kk + t]);
                a[mi][2] = __float_as_uint(As[r][kk + t + 4]);
                a[mi][3] = __float_as_uint(As[r + 8][kk + t + 4]);
            }
#pragma unroll
            for (int ni = 0; ni < 4; ++ni) {
                const int c = wn * 32 + ni * 8 + g;
                b[ni][0] = __float_as_uint(Bs[c][kk + t]);
                b[ni][1] = __float_as_uint(Bs[c][kk + t + 4]);
            }
#pragma unroll
            for (int mi = 0; mi < 2; ++mi)
#pragma unroll
                for (int ni = 0; ni < 4; ++ni)
                    asm volatile(
                        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
                        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                        : "+f"(acc[mi][ni][0]), "+f"(acc[mi][ni][1]), "+f"(acc[mi][ni][2]), "+f"(acc[mi][ni][3])
                        : "r"(a[mi][0]), "r"(a[mi][1]), "r"(a[mi][2]), "r"(a[mi][3]), "r"(b[ni][0]), "r"(b[ni][1]));
        }
        __syncthreads();
    }
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) {
            const int r = i0 + wm * 32 + mi * 16 + g, c = j0 + wn * 32 + ni * 8 + 2 * t;
            out.put(r, c, acc[mi][ni][0]);
            out.put(r, c + 1, acc[mi][ni][1]);
            out.put(r + 8, c, acc[mi][ni][2]);
            out.put(r + 8, c + 1, acc[mi][ni][3]);
        }
    out.finish(false);
}

template <int EPI, bool A_KFAST, bool B_KFAST>
__device__ void gemm_f32(const float* A, int lda, const float* B, int ldb, int M, int N, int K,
                         const Output<EPI>& out) {
    constexpr int THREADS = 256;
    __shared__ float As[BM][BK + PAD];
    __shared__ float Bs[BN][BK + PAD];
    const int i0 = blockIdx.y * BM, j0 = blockIdx.x * BN;
    const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
    const bool sums = out.col_sum != nullptr && blockIdx.x == 0;
    float acc[4][4] = {};
    float row_sum = 0.0f;
    int kb, ke;
    k_range(K, kb, ke);
    TileLoader<THREADS, BM, A_KFAST> la;
    TileLoader<THREADS, BN, B_KFAST> lb;
    la.load(A, lda, i0, kb, M, ke);
    lb.load(B, ldb, j0, kb, N, ke);
    for (int k0 = kb; k0 < ke; k0 += BK) {
        la.template store<false>(As);
        lb.template store<false>(Bs);
        __syncthreads();
        if (k0 + BK < ke) {
            la.load(A, lda, i0, k0 + BK, M, ke);
            lb.load(B, ldb, j0, k0 + BK, N, ke);
        }
        if (sums && threadIdx.x < BM) {
#pragma unroll 8
            for (int k = 0; k < BK; ++k) row_sum += As[threadIdx.x][k];
        }
#pragma unroll 8
        for (int k = 0; k < BK; ++k) {
            float a[4], b[4];
#pragma unroll
            for (int r = 0; r < 4; ++r) a[r] = As[ty + 16 * r][k];
#pragma unroll
            for (int c = 0; c < 4; ++c) b[c] = Bs[tx + 16 * c][k];
#pragma unroll
            for (int r = 0; r < 4; ++r)
#pragma unroll
                for (int c = 0; c < 4; ++c) acc[r][c] = fmaf(a[r], b[c], acc[r][c]);
        }
        __syncthreads();
    }
    if (sums && threadIdx.x < BM) out.put_row_sum(i0 + threadIdx.x, row_sum);
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int c = 0; c < 4; ++c) out.put(i0 + ty + 16 * r, j0 + tx + 16 * c, acc[r][c]);
    out.finish(sums);
}

}  // namespace

#define DT_GEMM_PARAMS                                                                            \
    const float *A, int lda, const float *B, int ldb, float *C, int ldc, int M, int N, int K,         \
        const float *bias, const float *mask, int ldm, float *col_sum, float *workspace,              \
        unsigned int *counters, const int *gate
#define DT_GEMM_OUT(EPI) Output<EPI>{C, ldc, M, N, bias, mask, ldm, col_sum, workspace, counters}

// One signature for all: ptr i32 ptr i32 ptr i32 i32 i32 i32 ptr ptr i32 ptr ptr ptr ptr.
// `gate` (may be 0): when it points at a non-zero word the whole grid returns at
// once, writing nothing (a training loop's step that is not due this iteration).
// Arguments a kernel does not use (bias, mask, col_sum) may be 0; with gridDim.z == 1
// so may workspace and counters. Otherwise workspace holds gridDim.z * (M*N + M)
// floats and counters one zeroed uint per output tile (left zeroed on exit).
extern "C" __global__ void __launch_bounds__(128) linear_forward_tf32(DT_GEMM_PARAMS) {
    if (gate != nullptr && *gate) return;
    gemm_tf32<EPI_BIAS, true, true>(A, lda, B, ldb, M, N, K, DT_GEMM_OUT(EPI_BIAS));
}
extern "C" __global__ void __launch_bounds__(128) linear_forward_relu_tf32(DT_GEMM_PARAMS) {
    if (gate != nullptr && *gate) return;
    gemm_tf32<EPI_BIAS_RELU, true, true>(A, lda, B, ldb, M, N, K, DT_GEMM_OUT(EPI_BIAS_RELU));
}
extern "C" __global__ void __launch_bounds__(256) linear_forward_f32(DT_GEMM_PARAMS) {
    if (gate != nullptr && *gate) return;
    gemm_f32<EPI_BIAS, true, true>(A, lda, B, ldb, M, N, K, DT_GEMM_OUT(EPI_BIAS));
}
extern "C" __global__ void __launch_bounds__(256) linear_forward_relu_f32(DT_GEMM_PARAMS) {
    if (gate != nullptr && *gate) return;
    gemm_f32<EPI_BIAS_RELU, true, true>(A, lda, B, ldb, M, N, K, DT_GEMM_OUT(EPI_BIAS_RELU));
}
extern "C" __global__ void __launch_bounds__(256) linear_grad_input_f32(DT_GEMM_PARAMS) {
    if (gate != nullptr && *gate) return;
    gemm_f32<EPI_MASK, true, false>(A, lda, B, ldb, M, N, K, DT_GEMM_OUT(EPI_MASK));
}
extern "C" __global__ void __launch_bounds__(256) linear_grad_weight_f32(DT_GEMM_PARAMS) {
    if (gate != nullptr && *gate) return;
    gemm_f32<EPI_NONE, false, false>(A, lda, B, ldb, M, N, K, DT_GEMM_OUT(EPI_NONE));
}
