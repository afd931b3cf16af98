// Tiled GEMM with fused epilogues: the linear layers of drvtrain's MLPs.
//
//   C[i, j] = sum_k A(i, k) * B(k, j),   A(i, k) = A[i*sa0 + k*sa1],  B(k, j) = B[k*sb0 + j*sb1]
//
// Strides make one kernel serve the three products of a linear layer:
//   forward  Y  = X W^T + b   (A = X, B = W^T)            epilogue bias (+ ReLU)
//   backward dX = dY W        (A = dY, B = W)             epilogue ReLU mask of the layer's input
//   backward dW = dY^T X      (A = dY^T, B = X)           col_sum gives db = sum_m dY[m, :]
// C is row-major with leading dimension ldc; `mask` (if used) is row-major with ldm.
//
// Two arithmetic modes, one name each:
//   gemm_tf32_*: tensor cores, mma.sync m16n8k8 TF32 inputs with FP32 accumulation.
//                Tiles are 64 deep in k: small layers are bound by the latency of each
//                k step's loads, so fewer, deeper steps are faster (docs/perf-notes.md).
//                128 threads, 64x64 block tile, 2x2 warps of 32x32.
//   gemm_f32_*:  exact FP32 FFMA, 256 threads, 64x64 block tile, 4x4 outputs per thread.
// Launch: grid (ceil(N/64), ceil(M/64)), block 128 (tf32) or 256 (f32).
// Determinism: every output is one thread's accumulation in a fixed k order; col_sum
// (FP32 mode only) is summed by the blocks of grid column 0 in a fixed order. No atomics.
#include "common.cuh"

namespace {

constexpr int BM = 64, BN = 64, BK = 64, PAD = 4;  // PAD keeps fragment loads conflict-free

enum { EPI_NONE = 0, EPI_BIAS = 1, EPI_BIAS_RELU = 2, EPI_MASK = 3 };

__device__ __forceinline__ unsigned int to_tf32(float x) {
    unsigned int r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

// Tile loaders: THREADS threads move a ROWS x BK tile into registers, then shared memory.
// Consecutive threads take consecutive addresses along whichever dimension has stride 1.
template <int THREADS, int ROWS>
struct TileLoader {
    static constexpr int PER = ROWS * BK / THREADS;
    float reg[PER];

    // Operand element (row r, k) = base[r * s_row + k * s_k], rows < rows_total, k < k_total.
    __device__ __forceinline__ void load(const float* base, long long s_row, long long s_k, int row0, int k0,
                                         int rows_total, int k_total) {
        const bool k_fast = s_k == 1;
#pragma unroll
        for (int p = 0; p < PER; ++p) {
            const int idx = threadIdx.x + p * THREADS;
            const int r = k_fast ? idx / BK : idx % ROWS;
            const int k = k_fast ? idx % BK : idx / ROWS;
            const int gr = row0 + r, gk = k0 + k;
            reg[p] = (gr < rows_total && gk < k_total) ? base[(long long)gr * s_row + (long long)gk * s_k] : 0.0f;
        }
    }

    template <bool TF32>
    __device__ __forceinline__ void store(float (*tile)[BK + PAD], long long s_k) const {
        const bool k_fast = s_k == 1;
#pragma unroll
        for (int p = 0; p < PER; ++p) {
            const int idx = threadIdx.x + p * THREADS;
            const int r = k_fast ? idx / BK : idx % ROWS;
            const int k = k_fast ? idx % BK : idx / ROWS;
            tile[r][k] = TF32 ? __uint_as_float(to_tf32(reg[p])) : reg[p];
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

template <int EPI>
__device__ void gemm_tf32(const float* A, long long sa0, long long sa1, const float* B, long long sb0,
                          long long sb1, float* C, int ldc, int M, int N, int K, const float* bias,
                          const float* mask, int ldm) {
    constexpr int THREADS = 128;
    __shared__ float As[BM][BK + PAD];
    __shared__ float Bs[BN][BK + PAD];
    const int i0 = blockIdx.y * BM, j0 = blockIdx.x * BN;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wm = warp >> 1, wn = warp & 1, g = lane >> 2, t = lane & 3;
    float acc[2][4][4] = {};
    TileLoader<THREADS, BM> la;
    TileLoader<THREADS, BN> lb;
    la.load(A, sa0, sa1, i0, 0, M, K);
    lb.load(B, sb1, sb0, j0, 0, N, K);
    for (int k0 = 0; k0 < K; k0 += BK) {
        la.template store<true>(As, sa1);
        lb.template store<true>(Bs, sb0);
        __syncthreads();
        if (k0 + BK < K) {  // the next tile's global loads fly while this one computes
            la.load(A, sa0, sa1, i0, k0 + BK, M, K);
            lb.load(B, sb1, sb0, j0, k0 + BK, N, K);
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
            epilogue_store<EPI>(C, ldc, M, N, r, c, acc[mi][ni][0], bias, mask, ldm);
            epilogue_store<EPI>(C, ldc, M, N, r, c + 1, acc[mi][ni][1], bias, mask, ldm);
            epilogue_store<EPI>(C, ldc, M, N, r + 8, c, acc[mi][ni][2], bias, mask, ldm);
            epilogue_store<EPI>(C, ldc, M, N, r + 8, c + 1, acc[mi][ni][3], bias, mask, ldm);
        }
}

template <int EPI>
__device__ void gemm_f32(const float* A, long long sa0, long long sa1, const float* B, long long sb0,
                         long long sb1, float* C, int ldc, int M, int N, int K, const float* bias,
                         const float* mask, int ldm, float* col_sum) {
    constexpr int THREADS = 256;
    __shared__ float As[BM][BK + PAD];
    __shared__ float Bs[BN][BK + PAD];
    const int i0 = blockIdx.y * BM, j0 = blockIdx.x * BN;
    const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
    const bool sums = col_sum != nullptr && blockIdx.x == 0;
    float acc[4][4] = {};
    float row_sum = 0.0f;
    TileLoader<THREADS, BM> la;
    TileLoader<THREADS, BN> lb;
    la.load(A, sa0, sa1, i0, 0, M, K);
    lb.load(B, sb1, sb0, j0, 0, N, K);
    for (int k0 = 0; k0 < K; k0 += BK) {
        la.template store<false>(As, sa1);
        lb.template store<false>(Bs, sb0);
        __syncthreads();
        if (k0 + BK < K) {
            la.load(A, sa0, sa1, i0, k0 + BK, M, K);
            lb.load(B, sb1, sb0, j0, k0 + BK, N, K);
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
    if (sums && threadIdx.x < BM && i0 + threadIdx.x < M) col_sum[i0 + threadIdx.x] = row_sum;
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int c = 0; c < 4; ++c)
            epilogue_store<EPI>(C, ldc, M, N, i0 + ty + 16 * r, j0 + tx + 16 * c, acc[r][c], bias, mask, ldm);
}

}  // namespace

#define DT_GEMM_PARAMS                                                                                \
    const float *A, long long sa0, long long sa1, const float *B, long long sb0, long long sb1, float *C, \
        int ldc, int M, int N, int K, const float *bias, const float *mask, int ldm, float *col_sum
#define DT_GEMM_ARGS A, sa0, sa1, B, sb0, sb1, C, ldc, M, N, K, bias, mask, ldm

// One signature for all: ptr i64 i64 ptr i64 i64 ptr i32 i32 i32 i32 ptr ptr i32 ptr.
// The TF32 kernels ignore col_sum (pass 0); unused bias or mask may be 0.
extern "C" __global__ void __launch_bounds__(128) gemm_tf32_none(DT_GEMM_PARAMS) { gemm_tf32<EPI_NONE>(DT_GEMM_ARGS); }
extern "C" __global__ void __launch_bounds__(128) gemm_tf32_bias(DT_GEMM_PARAMS) { gemm_tf32<EPI_BIAS>(DT_GEMM_ARGS); }
extern "C" __global__ void __launch_bounds__(128) gemm_tf32_bias_relu(DT_GEMM_PARAMS) { gemm_tf32<EPI_BIAS_RELU>(DT_GEMM_ARGS); }
extern "C" __global__ void __launch_bounds__(128) gemm_tf32_mask(DT_GEMM_PARAMS) { gemm_tf32<EPI_MASK>(DT_GEMM_ARGS); }
extern "C" __global__ void __launch_bounds__(256) gemm_f32_none(DT_GEMM_PARAMS) { gemm_f32<EPI_NONE>(DT_GEMM_ARGS, col_sum); }
extern "C" __global__ void __launch_bounds__(256) gemm_f32_bias(DT_GEMM_PARAMS) { gemm_f32<EPI_BIAS>(DT_GEMM_ARGS, col_sum); }
extern "C" __global__ void __launch_bounds__(256) gemm_f32_bias_relu(DT_GEMM_PARAMS) { gemm_f32<EPI_BIAS_RELU>(DT_GEMM_ARGS, col_sum); }
extern "C" __global__ void __launch_bounds__(256) gemm_f32_mask(DT_GEMM_PARAMS) { gemm_f32<EPI_MASK>(DT_GEMM_ARGS, col_sum); }
