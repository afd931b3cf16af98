// Tiled GEMMs with fused epilogues: the linear layers of drvtrain's MLPs.
//
//   C[i, j] = sum_k A(i, k) * B(k, j)
//
// Each operand is stored either "k-fast" (k contiguous) or "row-fast" (i, resp. j,
// contiguous), fixed per kernel at compile time; lda/ldb are the other stride:
//   A k-fast: A(i, k) = A[i*lda + k]      A row-fast: A(i, k) = A[i + k*lda]
//   B k-fast: B(k, j) = B[j*ldb + k]      B row-fast: B(k, j) = B[j + k*ldb]
// C is row-major with leading dimension ldc; `mask` is row-major with ldm.
// The kernels are the three products of a linear layer Y = X W^T + b:
//   linear_forward[_relu]_<tile>_<cp>_tf32    Y = X W^T + b (+ ReLU)      A = X k-fast,  B = W k-fast
//   linear_grad_input_<tile>_<cp>_3xtf32     dX = (dY W) * (X > 0)       A = dY k-fast, B = W row-fast
//   linear_grad_weight_<tile>_<cp>_3xtf32    dW = dY^T X, db = sum_m dY   A = dY row-fast, B = X row-fast
//   linear_grad_input_dw0_32x32_<cp>_cluster_3xtf32: grad-input's dX, not stored, folded into the
//     first layer's dW0 = dX^T X0 and db0 (tc::FirstDw; its arguments follow `gate`)
//   linear_grad_input_dwl_64x64_<cp>_cluster_3xtf32: grad-input's dX of the output layer (K <= 32),
//     with that layer's dW = dY^T X and db folded in (tc::LastDw; its arguments follow `gate`);
//     launched as clusters of the grid's row tiles (1, gridDim.y, 1)
//   dqn_loss_dwl[_a18]_64x64_<cp>_cluster_3xtf32: the same with its A, the Double-DQN loss's
//     gradient rows dout, computed in the kernel from the three Q arrays and stored at A
//     by the first column of blocks, with the priorities and the loss's partials
//     (tc::DqnLoss, after the LastDw arguments); _a18 is compiled for 18 actions
//     (K = 19) and traps on any other K
//   linear_forward[_relu]_x0_32x32_<cp>_cluster_tf32: the forward with its A = H0, the first layer's
//     output, computed in the kernel from X0, W0 and b0 and stored at A (tc::FirstLayer; its
//     arguments follow `gate`)
//   linear_forward[_relu]_f32, linear_grad_input_f32, linear_grad_weight_f32: the same on FP32 FFMA.
//   The tensor-core forward and grad-input kernels (the folded ones too, but for the dwl
//   ones) come twice: once more with `settled_` before the precision, for a B that no
//   kernel they directly depend on writes (a layer's weights): B's first tiles (and a
//   folded first layer's W0 and b0) go out before the grid wait (tc::gemm's SETTLED).
//
// Tensor-core kernels: mma.sync m16n8k8 with FP32 accumulation, operands staged
// in shared memory in their global layout by cp.async through a ring of stages.
//   *_tf32:   one MMA on operands rounded to TF32 (round to nearest, as cvt.rna):
//             about 3e-4 relative on random data.
//   *_3xtf32: x = big + small with big = tf32(x), small = x - big (truncated to TF32
//             by the tensor cores, tf32.cuh); each step
//             adds small_a*big_b, big_a*small_b, then big_a*big_b into a fragment
//             that is added to the FP32 accumulator with an FADD once per k tile
//             (the tensor cores do not round their own sums to nearest): FP32
//             accuracy, about 2e-7 relative against float64 on random data.
//   <tile>:   64x64: 128 threads, 4 warps of 32x32 outputs, k tiles of 32, 2 stages
//                    (36 KB of shared memory at most);
//             32x32: 128 threads, 4 warps of 16x16 outputs, k tiles of 16, 5 stages
//                    (25 KB; 35 KB where the first layer is folded in), so several
//                    blocks share an SM on the small products.
//             128-row tiles (128x128 and 128x64, 3 stages in dynamic shared
//             memory) measured no faster than 64x64 on any product of the nets
//             (docs/perf-notes.md), so there are none.
//   <cp>:     cp16: 16-byte copies; needs lda, ldb multiples of 4 floats and A, B
//             16-byte aligned (drvtrain.nn.mlp.vector_width decides).
//             cp4: 4-byte copies, any stride and alignment.
//   Out-of-range elements are zero-filled by the copy (src-size below cp-size).
// FFMA kernels: exact FP32; 256 threads, 64x64 block tile, k tiles of 64.
// Launch: grid (ceil(N/BN), ceil(M/BM), S), block = the kernel's __launch_bounds__;
// drvtrain.nn.mlp.plan picks the tile and S.
// S > 1 splits the k range over S blocks per output tile: each writes its sums to
// `workspace`, and the last block of the tile to arrive (dt_last_block on a counter
// per tile) adds the S partials in z order and applies the epilogue. The 32x32
// tile's `_cluster_` kernels launched in clusters (1, 1, S) (compute capability 9.0)
// need neither: block 0 of the tile adds the partials over distributed shared memory
// in the same order, to the same bits.
// Determinism: every output is one thread's accumulation in a fixed k order plus a
// fixed z order over the splits; db is summed in FP32 by the blocks of grid column
// 0, in a fixed order. No atomics on data: bitwise reproducible for a fixed launch.
#include "common.cuh"
#include "epilogue.cuh"
#include "tf32.cuh"
#include "dqn_loss.cuh"

namespace {

// ================================================================= tensor cores
namespace tc {

enum { PREC_TF32 = 1, PREC_3XTF32 = 3 };

template <int BM_, int BN_, int WARPS_M_, int WARPS_N_, int BK_, int STAGES_>
struct Config {
    static constexpr int BM = BM_, BN = BN_, BK = BK_, STAGES = STAGES_;
    static constexpr int WARPS_M = WARPS_M_, WARPS_N = WARPS_N_;
    static constexpr int THREADS = 32 * WARPS_M * WARPS_N;
    static constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N;  // one warp's outputs
    static constexpr int MI = WM / 16, NI = WN / 8;              // its m16n8 fragments
    static_assert(WM % 16 == 0 && WN % 8 == 0 && BK % 8 == 0, "tile shape");
    static_assert(THREADS >= BM, "one thread per row sums db");
};

using Tile64x64 = Config<64, 64, 2, 2, 32, 2>;
// The 32x32 tile keeps five stages: a split of the small nets' products (k = 64 of a
// 256-deep product in four splits) is four k tiles, all of them in flight from the
// prologue; with four stages the fourth tile's copy waited for the first tile to land
// (docs/perf-notes.md, forty-eighth pass).
using Tile32x32 = Config<32, 32, 2, 2, 16, 5>;

// One operand's tile in shared memory, in its global layout. Row strides make the
// m16n8k8 fragment loads conflict-free: lane (g, t) = (lane / 4, lane % 4) reads
// (row g, depth t) at g*S + t (k-fast, S % 8 == 4) or t*S + g (row-fast,
// S % 16 == 8): 32 distinct banks either way. S is a multiple of 4, so every
// 16-byte copy lands aligned.
template <int ROWS, int BK, bool KFAST>
struct Smem {
    static constexpr int STRIDE = KFAST ? BK + 4 : ROWS + 8;
    static constexpr int LINES = KFAST ? ROWS : BK;
    static constexpr int FLOATS = LINES * STRIDE;
    static_assert(KFAST ? STRIDE % 8 == 4 : STRIDE % 16 == 8, "padding must keep fragment loads conflict-free");
    __device__ static __forceinline__ int at(int r, int k) { return KFAST ? r * STRIDE + k : k * STRIDE + r; }
};

template <int W>
__device__ __forceinline__ void cp_async(unsigned int dst, const float* src, int bytes) {
    if (W == 4)
        dt_cp_async16(dst, src, bytes);
    else
        dt_cp_async4(dst, src, bytes);
}

// Moves one operand's ROWS x BK tiles into shared memory. A tile is LINES lines
// (rows when k-fast, depths when row-fast) of a contiguous extent; consecutive
// threads copy consecutive W-float pieces of a line, and each thread walks down
// the lines with a fixed stride, so only "outer" (the line) and "inner" (the
// position along it) need bounds.
template <int ROWS, int BK, int THREADS, bool KFAST, bool VEC>
struct Loader {
    using S = Smem<ROWS, BK, KFAST>;
    static constexpr int W = VEC ? 4 : 1;
    static constexpr int PER_LINE = (KFAST ? BK : ROWS) / W;
    static_assert(THREADS % PER_LINE == 0, "a round covers whole lines");
    static constexpr int STEP = THREADS / PER_LINE;  // lines per round
    static_assert(S::LINES % STEP == 0, "whole rounds per tile");
    static constexpr int ROUNDS = S::LINES / STEP;

    const float* base;
    const float* ptr;  // this thread's first element of the next tile
    long long ld;
    int outer, outer_end, inner, inner_end;
    unsigned int dst;  // byte offset of this thread's first element within a tile

    __device__ __forceinline__ Loader(const float* base_, int ld_, int row0, int rows, int k0, int k_end)
        : base(base_), ld(ld_) {
        const int along = (threadIdx.x % PER_LINE) * W, line = threadIdx.x / PER_LINE;
        if (KFAST) {
            outer = row0 + line, outer_end = rows, inner = k0 + along, inner_end = k_end;
        } else {
            outer = k0 + line, outer_end = k_end, inner = row0 + along, inner_end = rows;
        }
        ptr = base + (long long)outer * ld + inner;
        dst = (unsigned int)(line * S::STRIDE + along) * 4u;
    }

    // Queue the copies of the next tile into the tile at shared address `tile`.
    // `whole`: the caller's word that every copy of every tile is in bounds (tc::gemm's
    // `whole`), so none computes a bound.
    __device__ __forceinline__ void load(unsigned int tile, bool whole = false) {
        if (whole) {
#pragma unroll
            for (int c = 0; c < ROUNDS; ++c)
                cp_async<W>(tile + dst + c * STEP * S::STRIDE * 4, ptr + c * STEP * ld, 4 * W);
        } else {
            const int inner_bytes = 4 * max(0, min(W, inner_end - inner));
#pragma unroll
            for (int c = 0; c < ROUNDS; ++c) {
                const int bytes = outer + c * STEP < outer_end ? inner_bytes : 0;
                const float* src = bytes ? ptr + c * STEP * ld : base;  // never form a wild address
                cp_async<W>(tile + dst + c * STEP * S::STRIDE * 4, src, bytes);
            }
        }
        if (KFAST) {
            inner += BK;
            ptr += BK;
        } else {
            outer += BK;
            ptr += BK * ld;
        }
    }
};

// TF32 operands: round to nearest in one add (tf32.cuh; non-finite values unrounded in
// TF32, and as tf32.cuh says in 3xTF32).
template <int PREC>
__device__ __forceinline__ void split(float x, unsigned int& big, unsigned int& small) {
    dt_tf32_split<PREC == PREC_3XTF32>(x, big, small);
}

__device__ __forceinline__ void mma(float (&d)[4], const unsigned int (&a)[4], const unsigned int (&b)[2]) {
    dt_mma_tf32(d, a, b[0], b[1]);
}

// The first layer's dW and db folded into the grad-input product of the layer above
// it (DW0 kernels): with dX1 = that product's masked tile, dW0 = dX1^T X0 and
// db0 = the column sums of dX1, where X0 [M, in0] is the net's input (in0 <= DW0_MAX_IN).
constexpr int DW0_MAX_IN = 8;
struct FirstDw {
    const float* x0;           // X0 [M, in0], rows ldx0 floats apart
    int ldx0, in0;
    float* dw0;                // dW0 [N, in0], row-major
    float* db0;                // db0 [N]
    float* work;               // gridDim.x * gridDim.y * BN * (in0 + 1) floats
    unsigned int* counters;    // gridDim.x zeroed uints (left zeroed), or null: the tiles
                               // only write their shares, and the kernel after this one sums
                               // them (kernels/optim.cuh's DtFirstDw)
};

// The first layer folded into the second layer's forward (X0 kernels): A = H0 =
// relu(X0 W0^T + b0) [M, K] is computed here, not read, one k tile at a time into the
// ring, in FP32 (b0, then one FMA an input in order, then the ReLU as dt_epilogue
// applies it), from X0 [M, in0] (in0 <= DW0_MAX_IN), W0 [K, in0]
// (row-major) and b0 [K]. A split's k range is at most X0_MAX_K (its W0 and b0 are
// staged in shared memory). Where A is not null, every block also stores there the
// k tiles kt (counted from 0 over all of K) with kt % gridDim.x == blockIdx.x of its
// rows and split: each element of H0 once, over the whole grid (the backward's saved
// activation).
constexpr int X0_MAX_K = 256;
struct FirstLayer {
    const float* x0;  // X0 [M, in0], rows ldx0 floats apart
    int ldx0, in0;
    const float* w0;  // W0 [K, in0]
    const float* b0;  // b0 [K]
};

// The output layer's dW and db folded into its grad-input product (DWL kernels): with
// dY [M, K] the product's A (K <= BK: one k tile) and H [M, N] its mask (the layer's
// input), dW = dY^T H [K, N] (rows ldw floats apart) and db = the column sums of dY [K].
// The grid's row tiles are one cluster (1, gridDim.y, 1), gridDim.y <= 8.
struct LastDw {
    float* dw;
    int ldw;
    float* db;
};

// The Double-DQN loss computed in the output layer's grad-input product (LOSS, with
// DWL: the dqn_loss_dwl kernels). A = dout [M, K] (K = 1 + n_actions) is not read
// but computed: each block the loss of its BM rows from their rows of the three Q
// arrays [M, K] (dqn_loss.cuh's sample_argmax and sample_loss_given, the parts of
// dqn_loss's sample_loss: the same operations, so dqn_loss's bits), into its A tile.
// Grid column 0 stores dout (rows lda floats apart), the priorities, a* (if not
// null) and the loss's partials [3][blocks] as dqn_loss's grid of 32-row blocks
// leaves them (blocks = ceil(M / 32)), for dqn_means_32.
struct DqnLoss {
    const float* q_s;
    const float* q_next;
    const float* q_target;
    const int* action;
    const float* reward;
    const float* done;
    const float* weights;
    float gamma, huber_delta;
    float* priorities;
    double* partials;
    int blocks;
    int* a_star;
};

// The split-k workspace of a launch (floats):
//   partials: tiles * S * BM * BN, tile-major, in fragment order (fully coalesced);
//   row sums (grad-weight only): gridDim.y * S * BM, after the partials.
template <class CFG, int PREC, bool A_KFAST, bool B_KFAST, int EPI, bool VEC, bool CLUSTER, bool DW0 = false,
          bool X0 = false, bool SETTLED = false, bool DWL = false, bool LOSS = false, int LOSS_K = 0>
__device__ __forceinline__ void gemm(const float* A, int lda, const float* B, int ldb, float* C, int ldc, int M,
                                     int N, int K, const float* bias, const float* mask, int ldm, float* col_sum,
                                     float* workspace, unsigned int* counters, const int* gate, FirstDw fd = {},
                                     FirstLayer fl = {}, LastDw lw = {}, DqnLoss dl = {}) {
    constexpr int BM = CFG::BM, BN = CFG::BN, BK = CFG::BK, STAGES = CFG::STAGES, THREADS = CFG::THREADS;
    constexpr int MI = CFG::MI, NI = CFG::NI;
    // LOSS_K > 0: compiled for K == LOSS_K (1 + n_actions), so the loss's loops over the
    // actions unroll, its divisions are by a constant, and k has one tile of known depth:
    // the same operations in the same order, so the same bits as LOSS_K = 0.
    static_assert(LOSS_K == 0 || (LOSS && LOSS_K >= 2 && LOSS_K <= BK), "a constant K is the loss's, one tile deep");
    if constexpr (LOSS_K > 0) {
        if (K != LOSS_K) __trap();  // the host launches this build for that K only
        K = LOSS_K;
    }
    using SA = Smem<BM, BK, A_KFAST>;
    using SB = Smem<BN, BK, B_KFAST>;
    constexpr int STAGE = SA::FLOATS + SB::FLOATS;
    __shared__ __align__(16) float smem[STAGES * STAGE];
    // Unless SETTLED (below), the wait for the grid before comes first, and then the
    // gate word, which is tested once the first tiles' copies are issued: its round
    // trip overlaps theirs (reading the operands of a step that is not due is
    // harmless; nothing is written).
    if constexpr (!SETTLED) dt_wait_prior_grid();
    int gated = SETTLED ? 0 : dt_read_flag(gate);

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int wm = warp / CFG::WARPS_N, wn = warp % CFG::WARPS_N;
    const int i0 = blockIdx.y * BM, j0 = blockIdx.x * BN;
    const int splits = gridDim.z, z = blockIdx.z;
    // This block's share of k: whole BK-deep tiles, split evenly over gridDim.z.
    const int k_tiles = (K + BK - 1) / BK, per = (k_tiles + splits - 1) / splits;
    const int kb = min(K, z * per * BK), ke = min(K, kb + per * BK);
    const int tiles = (ke - kb + BK - 1) / BK;
    // A warp whose outputs all fall outside C skips the arithmetic (N = 3, say).
    const bool active = i0 + wm * CFG::WM < M && j0 + wn * CFG::WN < N;
    const bool sums = EPI == EPI_NONE && col_sum != nullptr && blockIdx.x == 0;

    Loader<BM, BK, THREADS, A_KFAST, VEC> la(A, lda, i0, M, kb, ke);
    Loader<BN, BK, THREADS, B_KFAST, VEC> lb(B, ldb, j0, N, kb, ke);
    const unsigned int smem0 = (unsigned int)__cvta_generic_to_shared(smem);

    float acc[MI][NI][4];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < NI; ++ni)
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[mi][ni][q] = 0.0f;
    float row_sum = 0.0f;

    // Each thread's fragment elements sit at fixed offsets from one base per
    // operand: (row wm*WM + g, depth t) for A, (column wn*WN + g, depth t) for B.
    const int a_base = SA::at(wm * CFG::WM + g, t), b_base = SB::at(wn * CFG::WN + g, t);

    // The epilogue's operands (bias, mask; fragment (mi, ni) holds rows r, r + 8
    // and columns c, c + 1) do not depend on the products, so their loads go out
    // with the first tiles' copies where a thread holds few fragments (EARLY),
    // so that their round trip overlaps the k loop. With more fragments (64x64)
    // the registers they would hold through the k loop and the split-k tail
    // cost occupancy (128 -> 168 registers measured for grad-input), so there
    // they load after the tail, as the epilogue needs them.
    // Element q (0..3) of fragment (mi, ni) sits at row frag_row(mi, q), column frag_col(ni, q & 1).
    auto frag_row = [&](int mi, int q) { return i0 + wm * CFG::WM + mi * 16 + g + (q >> 1) * 8; };
    auto frag_col = [&](int ni, int q) { return j0 + wn * CFG::WN + ni * 8 + 2 * t + q; };
    float bv[NI][2], mv[MI][NI][4];
    auto load_epilogue = [&]() {
#pragma unroll
        for (int ni = 0; ni < NI; ++ni)
#pragma unroll
            for (int q = 0; q < 2; ++q) {
                const int c = frag_col(ni, q);
                bv[ni][q] = (EPI == EPI_BIAS || EPI == EPI_BIAS_RELU) && c < N ? bias[c] : 0.0f;
            }
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
            for (int ni = 0; ni < NI; ++ni)
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const int r = frag_row(mi, q), c = frag_col(ni, q & 1);
                    mv[mi][ni][q] = EPI == EPI_MASK && r < M && c < N ? mask[(size_t)r * ldm + c] : 0.0f;
                }
    };
    constexpr bool EARLY = MI * NI <= 2;
    // DWL: H's BM x BN tile (the mask, and the dW share's B operand) copied straight
    // into slot 1, rows DWL_HS floats apart, zero outside C, 16 bytes a copy where H's
    // rows allow it (in the kernels built for 4-byte copies too: their 4 bytes are
    // for A and B). Issued where slot 1 is free: without LOSS after the prologue's
    // groups, with LOSS after the loss, which stages the Q rows there. Either way left
    // uncommitted, so that the k loop's first wait does not wait for them; the commit
    // and wait after the loop end their round trip, which the k loop's MMAs overlap.
    constexpr int DWL_HS = BN + 8;
    // DWL: one k tile, unsplit, the grid's row tiles one cluster of at most the portable
    // size (the sums at the end); the host refuses anything else first, and a launch
    // that got past it traps here, before any copy (slot 1 holds one BM x BN tile).
    if constexpr (DWL)
        if (K > BK || splits != 1 || dt_cluster_blocks() != gridDim.y || gridDim.y > DT_PORTABLE_CLUSTER) __trap();
    auto copy_mask = [&]() {
        const bool vec = (reinterpret_cast<unsigned long long>(mask) & 15ull) == 0 && (ldm & 3) == 0;
        const unsigned int hs0 = smem0 + 4u * STAGE;
        if (vec) {
            for (int e = tid; e < BM * (BN / 4); e += THREADS) {
                const int r = e / (BN / 4), c = (e - r * (BN / 4)) * 4;
                const int n = i0 + r < M ? max(0, min(4, N - j0 - c)) : 0;
                const float* src = n > 0 ? mask + (size_t)(i0 + r) * ldm + j0 + c : mask;
                dt_cp_async16(hs0 + 4u * (r * DWL_HS + c), src, 4 * n);
            }
        } else {
            for (int e = tid; e < BM * BN; e += THREADS) {
                const int r = e / BN, c = e - r * BN;
                const bool in = i0 + r < M && j0 + c < N;
                const float* src = in ? mask + (size_t)(i0 + r) * ldm + j0 + c : mask;
                dt_cp_async4(hs0 + 4u * (r * DWL_HS + c), src, in ? 4 : 0);
            }
        }
    };

    // SETTLED (the `_settled_` kernels): the launcher's word that no kernel this one
    // directly depends on writes B (nor W0 and b0): a layer's weights, from the
    // step's start until its optimizer. Every drvtrain kernel lets its dependents
    // start only after its own wait, so while this one runs ahead of its wait only
    // the kernels it directly depends on can still be running. B's prologue tiles
    // then go out before the wait for the grid before this one, their round trip
    // overlapping its tail; left uncommitted, they join the first group, which holds
    // tile 0. Everything else, A, the epilogue's operands and the gate word, is read
    // after the wait.
    if constexpr (SETTLED) {
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s)
            if (s < tiles) lb.load(smem0 + (s * STAGE + SA::FLOATS) * 4);
    }

    // X0: each thread computes 4 consecutive k of one row of every A tile. Its row of
    // X0 and two rows of W0 and b0 (k = kb + tid, kb + tid + THREADS) are loaded with
    // the first tiles' copies, and W0 (as W0^T [IN0][X0_MAX_K], zero past in0 and past
    // the split's k range) and b0 are staged in `first` once the gate is open. Every
    // instruction here is on the chain (a handful of warps an SM, each one dependent
    // instruction after another): no division, no per-element bounds; an input of at
    // most 4 takes half the loop. A row past M computes relu(b0): only C's rows past
    // M read it, and those are not stored.
    constexpr int IN0 = DW0_MAX_IN, K_PER = X0 ? X0_MAX_K / THREADS : 1;
    __shared__ __align__(16) float first[X0 ? (IN0 + 1) * X0_MAX_K : 4];
    const int x0_row = tid / (BK / 4), x0_k = (tid % (BK / 4)) * 4;
    const bool wide0 = X0 && fl.in0 > 4;  // grid-uniform
    float x0v[IN0] = {}, w0v[K_PER][IN0] = {}, b0v[K_PER] = {};
    if constexpr (X0) {
        static_assert(BM * BK == 4 * THREADS && X0_MAX_K % THREADS == 0 && X0_MAX_K % BK == 0 && IN0 == 8,
                      "4 consecutive k of one row a thread; whole k tiles staged; two halves of in0");
        if (fl.in0 < 1 || fl.in0 > IN0 || ke - kb > X0_MAX_K) __trap();  // the host refuses them first
        // Every block of a row reads the same rows of X0 and W0 (a few KB that all the
        // grid's blocks load at once): where in0 is 4 or 8 and the rows are 16-byte
        // aligned, in 16-byte loads, a quarter of the requests on those L2 lines.
        const int r = i0 + x0_row;
        const bool vec_x0 = fl.in0 % 4 == 0 && fl.ldx0 % 4 == 0 && reinterpret_cast<size_t>(fl.x0) % 16 == 0;
        const bool vec_w0 = fl.in0 % 4 == 0 && reinterpret_cast<size_t>(fl.w0) % 16 == 0;
        auto load_row = [&](const float* row, bool ok, bool vec, float* v) {
            if (vec) {
#pragma unroll
                for (int h = 0; h < IN0 / 4; ++h) {
                    const float4 q = ok && 4 * h < fl.in0 ? *reinterpret_cast<const float4*>(row + 4 * h)
                                                          : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                    v[4 * h] = q.x, v[4 * h + 1] = q.y, v[4 * h + 2] = q.z, v[4 * h + 3] = q.w;
                }
            } else {
#pragma unroll
                for (int i = 0; i < IN0; ++i) v[i] = ok && i < fl.in0 ? row[i] : 0.0f;
            }
        };
        // W0 and b0 are weights: before the wait where SETTLED says so, X0 after it.
        auto load_first = [&]() {
#pragma unroll
            for (int c = 0; c < K_PER; ++c) {
                const int k = kb + tid + c * THREADS;
                load_row(fl.w0 + (size_t)k * fl.in0, k < ke, vec_w0, w0v[c]);
                b0v[c] = k < ke ? fl.b0[k] : 0.0f;
            }
        };
        auto issued_first = [&]() {
#pragma unroll
            for (int c = 0; c < K_PER; ++c) {
#pragma unroll
                for (int i = 0; i < IN0; ++i) dt_issued(w0v[c][i]);
                dt_issued(b0v[c]);
            }
        };
        if constexpr (SETTLED) {
            load_first();
            issued_first();
            dt_wait_prior_grid();
        }
        load_row(fl.x0 + (size_t)r * fl.ldx0, r < M, vec_x0, x0v);
        if constexpr (!SETTLED) load_first();
#pragma unroll
        for (int i = 0; i < IN0; ++i) dt_issued(x0v[i]);
        if constexpr (!SETTLED) issued_first();
    }
    // Which block of the row stores the next k tile of H0 (k tile kt: kt % gridDim.x).
    int h0_owner = X0 ? (kb / BK) % (int)gridDim.x : 0;
    // A tile tt of this split into ring slot `slot` (X0), and this block's share of H0.
    auto first_tile = [&](int tt, int slot) {
        const int kl = tt * BK + x0_k;
        const float4 b4 = *reinterpret_cast<const float4*>(&first[IN0 * X0_MAX_K + kl]);
        float v[4] = {b4.x, b4.y, b4.z, b4.w};
        auto add = [&](int i) {
            const float4 w = *reinterpret_cast<const float4*>(&first[i * X0_MAX_K + kl]);
            v[0] = fmaf(x0v[i], w.x, v[0]);
            v[1] = fmaf(x0v[i], w.y, v[1]);
            v[2] = fmaf(x0v[i], w.z, v[2]);
            v[3] = fmaf(x0v[i], w.w, v[3]);
        };
#pragma unroll
        for (int i = 0; i < 4; ++i) add(i);
        if (wide0) {
#pragma unroll
            for (int i = 4; i < IN0; ++i) add(i);
        }
        // ReLU that keeps a NaN and turns -0 into +0, as dt_epilogue's.
#pragma unroll
        for (int j = 0; j < 4; ++j) v[j] = v[j] < 0.0f ? 0.0f : v[j] + 0.0f;
        *reinterpret_cast<float4*>(&smem[slot * STAGE + SA::at(x0_row, x0_k)]) = make_float4(v[0], v[1], v[2], v[3]);
        if (A != nullptr && h0_owner == (int)blockIdx.x && i0 + x0_row < M) {
            const int k = kb + kl;
            float* out = const_cast<float*>(A) + (size_t)(i0 + x0_row) * lda + k;
            if (VEC && k + 3 < ke) {
                *reinterpret_cast<float4*>(out) = make_float4(v[0], v[1], v[2], v[3]);
            } else {
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    if (k + j < ke) out[j] = v[j];
            }
        }
        h0_owner = h0_owner + 1 == (int)gridDim.x ? 0 : h0_owner + 1;
    };

    // Prologue: STAGES - 1 tiles in flight (B's already, where SETTLED). Every thread
    // commits one group per tile slot, empty or not, so wait_group counts stay uniform.
    if constexpr (SETTLED && !X0) dt_wait_prior_grid();  // X0 waited above, between its weights and X0
    if constexpr (SETTLED) gated = dt_read_flag(gate);
    // LOSS: the block's rows of the three Q arrays, in the first group with B's tile:
    // Q(s)'s rows into the A tile (a row's K floats at its start), the other two, one
    // after the other, into slot 1, which one k tile leaves free; and the per-sample
    // operands of row i0 + tid into registers.
    static_assert(!LOSS || (DWL && A_KFAST && STAGES >= 2 && 2 * BM * BK + 3 * BM <= STAGE && 2 * BM <= THREADS &&
                            BM % 32 == 0),
                  "the loss: Q's rows in the A tile and slot 1, two threads a row");
    const int loss_rows = LOSS ? max(0, min(BM, M - i0)) : 0;
    int loss_a = 0;
    float loss_r = 0.0f, loss_d = 0.0f, loss_w = 0.0f;
    if constexpr (LOSS) {
        if (K < 2 || K > BK || dl.blocks != (M + 31) / 32) __trap();  // the host refuses them first
        if (tid < loss_rows) {
            loss_a = dl.action[i0 + tid];
            loss_r = dl.reward[i0 + tid];
            loss_d = dl.done[i0 + tid];
            loss_w = dl.weights[i0 + tid];
        }
        const int count = loss_rows * K;
        const size_t base = (size_t)i0 * K;
#pragma unroll 1
        for (int e = tid; e < count; e += THREADS) {
            const int r = e / K, c = e - r * K;
            dt_cp_async4(smem0 + 4u * SA::at(r, c), dl.q_s + base + e, 4);
        }
        // The other two land as they lie, the block's rows one run of floats each: 16
        // bytes a copy where both arrays start 16-byte aligned (the rows start at i0 K
        // floats, a multiple of 4, as does the second run in slot 1).
        const float* const next = dl.q_next + base;
        const float* const target = dl.q_target + base;
        const bool vec = ((reinterpret_cast<unsigned long long>(next) | reinterpret_cast<unsigned long long>(target)) &
                          15ull) == 0;
        stage_floats<THREADS>(smem + STAGE, next, count, vec);
        stage_floats<THREADS>(smem + STAGE + BM * K, target, count, vec);
    }
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < tiles) {
            if constexpr (!X0 && !LOSS) la.load(smem0 + s * STAGE * 4);
            if constexpr (!SETTLED) lb.load(smem0 + (s * STAGE + SA::FLOATS) * 4);
        }
        dt_cp_async_commit();
    }
    if constexpr (DWL && !LOSS) copy_mask();  // after tile 0's group: uncommitted, as with LOSS
    if constexpr (EARLY) load_epilogue();
    dt_issued(gated);
    if (gated) {  // grid-uniform: no block of a cluster meets a barrier
        if constexpr (DWL && !LOSS) dt_cp_async_commit();  // copy_mask's copies with the rest
        dt_cp_async_wait<0>();
        return;
    }
    if constexpr (LOSS) {
        // A's tile past the rows and past K is zero (the MMAs' padding); the copies
        // write the rest.
        for (int e = tid; e < BM * BK; e += THREADS) {
            const int r = e / BK, c = e % BK;
            if (r >= loss_rows || c >= K) smem[SA::at(r, c)] = 0.0f;
        }
        dt_cp_async_wait<0>();
        __syncthreads();
        // Row i's loss in two threads: thread BM + i adds the advantage means of its
        // Q_target(s') and Q(s) rows while thread i finds its argmax, then thread i
        // finishes it (dqn_loss's sample_loss in two parts: the same operations, so the
        // same bits). Grid column 0 keeps its priority and a*, the other columns put
        // them in slot 1 past the Q rows, before the means. Its dout row overwrites its
        // Q(s) row in place.
        float* const spare = smem + STAGE + 2 * BM * K;
        float* const means = spare + BM;  // [2][BM]: Q_target(s')'s, Q(s)'s
        const bool keep = blockIdx.x == 0;
        const float* const row_next = smem + STAGE + tid * K;
        const float* const row_target = smem + STAGE + BM * K + tid * K;
        if (tid >= BM && tid - BM < loss_rows) {
            const int i = tid - BM;
            means[i] = advantage_mean(smem + STAGE + BM * K + i * K, K - 1);
            means[BM + i] = advantage_mean(smem + SA::at(i, 0), K - 1);
        }
        int best_a = 0;
        bool poisoned = false;
        if (tid < loss_rows) sample_argmax(row_next, K - 1, best_a, poisoned);
        __syncthreads();  // the means are in
        SampleTerms terms;
        if (tid < loss_rows)
            terms = sample_loss_given(row_target, means[tid], smem + SA::at(tid, 0), means[BM + tid], best_a,
                                      poisoned, loss_a, loss_r, loss_d, loss_w, M, K - 1, dl.gamma, dl.huber_delta,
                                      keep ? &dl.priorities[i0 + tid] : &spare[tid],
                                      keep && dl.a_star != nullptr ? &dl.a_star[i0 + tid] : nullptr);
        // Each warp of 32 rows: dqn_loss's block of the same rows, its tree and its partials.
        if (keep && warp < BM / 32) {
            double v[3] = {terms.loss, terms.q, terms.abs_td};
            dt_block_sums<32, 3>(v);
            const int b = blockIdx.y * (BM / 32) + warp;
            if (lane == 0 && b < dl.blocks) {
                dl.partials[b] = v[0];
                dl.partials[dl.blocks + b] = v[1];
                dl.partials[2 * dl.blocks + b] = v[2];
            }
        }
        __syncthreads();  // every dout row is in the A tile
        if (keep) {
            float* const dout = const_cast<float*>(A);
            for (int e = tid; e < loss_rows * K; e += THREADS) {
                const int r = e / K, c = e - r * K;
                dout[(size_t)(i0 + r) * lda + c] = smem[SA::at(r, c)];
            }
        }
        copy_mask();  // slot 1's Q rows are done with (the barrier above)
    }
    if constexpr (X0) {
        // Every entry of W0^T and b0 the tiles read, zero past in0 and the split's k range.
#pragma unroll
        for (int c = 0; c < K_PER; ++c) {
            const int kl = tid + c * THREADS;
#pragma unroll
            for (int i = 0; i < IN0; ++i) first[i * X0_MAX_K + kl] = w0v[c][i];
            first[IN0 * X0_MAX_K + kl] = b0v[c];
        }
        __syncthreads();
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s)
            if (s < tiles) first_tile(s, s);
    }
    // The 32x32 tile's TF32 kernels (the forward roles) hold two k loops: one whose
    // copies compute no bounds (Loader::load's `whole`), for a block whose every copy
    // of every tile is in bounds (whole k tiles, its rows and columns inside A and B),
    // and the bounded one for the rest. Every TF32 kernel (both tiles, the folded first
    // layer's too) loads its operands, both k-fast, four fragment registers at a time
    // with ldmatrix.
    // The 3xTF32 kernels keep one bounded loop and single loads: with both there, the
    // small DQN step was slower (docs/perf-notes.md, twenty-eighth pass). Block-uniform,
    // so every thread meets the same barriers.
    const bool whole = PREC == PREC_TF32 && BM == 32 && (ke - kb) % BK == 0 && i0 + BM <= M && j0 + BN <= N;
    // ldmatrix: lane l addresses row l % 8 of matrix l / 8. A's four matrices are a
    // fragment's (rows +0, k +0), (+8, +0), (+0, +4), (+8, +4); B's, two n8 fragments'
    // (columns +0, k +0), (+0, +4), (+8, +0), (+8, +4).
    static_assert(PREC != PREC_TF32 || (A_KFAST && B_KFAST && NI % 2 == 0), "TF32 fragments by ldmatrix");
    const unsigned int a_ldsm = smem0 + 4u * SA::at(wm * CFG::WM + (lane & 7) + ((lane >> 3) & 1) * 8, (lane >> 4) * 4);
    const unsigned int b_ldsm =
        smem0 + 4u * (SA::FLOATS + SB::at(wn * CFG::WN + (lane & 7) + (lane >> 4) * 8, ((lane >> 3) & 1) * 4));
    // Called with a constant `whole_tiles`: inlined there, each call is its own loop, and
    // the whole one holds no bound. (A generic lambda, which would carry the constant in
    // its type, is a host function to NVRTC 13.0.)
    // LOSS_K > 0: the k8 steps past K are left out. Their products are exact zeros
    // (A's tile is zero past K and B's copies fill zeros past ke), which add nothing to
    // a fragment that starts at +0: the same bits, a quarter fewer MMAs at K = 19.
    constexpr int KK_END = LOSS_K > 0 ? (LOSS_K + 7) / 8 * 8 : BK;
    auto k_loop = [&](bool whole_tiles) {
        int read_slot = 0, write_slot = STAGES - 1;
        for (int kt = 0; kt < tiles; ++kt) {
            dt_cp_async_wait<STAGES - 2>();
            // Tile kt has landed for every thread, and every warp is done with tile
            // kt - 1, whose slot the next copies overwrite.
            __syncthreads();
            if (kt + STAGES - 1 < tiles) {
                if constexpr (X0)
                    first_tile(kt + STAGES - 1, write_slot);
                else
                    la.load(smem0 + write_slot * STAGE * 4, whole_tiles);
                lb.load(smem0 + (write_slot * STAGE + SA::FLOATS) * 4, whole_tiles);
            }
            dt_cp_async_commit();
            write_slot = write_slot == STAGES - 1 ? 0 : write_slot + 1;
            // Tile kt's ring slot: as pointers (single loads, the row sums) and as a byte
            // offset (ldmatrix); each kernel uses what its precision needs.
            [[maybe_unused]] const float* As = smem + read_slot * STAGE;
            [[maybe_unused]] const float* Bs = As + SA::FLOATS;
            [[maybe_unused]] const unsigned int slot_bytes = 4u * read_slot * STAGE;
            read_slot = read_slot == STAGES - 1 ? 0 : read_slot + 1;
            if (sums && tid < BM) {
#pragma unroll
                for (int k = 0; k < BK; ++k) row_sum += As[SA::at(tid, k)];
            }
            if (active) {
                // 3xTF32: the tensor cores' own accumulation is not round-to-nearest, so
                // each k tile's products are summed in a fresh fragment and added to the
                // FP32 accumulator with an FADD (the error no longer grows with k).
                float part[MI][NI][4];
                if (PREC == PREC_3XTF32) {
#pragma unroll
                    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                        for (int ni = 0; ni < NI; ++ni)
#pragma unroll
                            for (int q = 0; q < 4; ++q) part[mi][ni][q] = 0.0f;
                }
#pragma unroll
                for (int kk = 0; kk < KK_END; kk += 8) {
                    unsigned int a[MI][4], as[MI][4], b[NI][2], bs[NI][2];
                    if constexpr (PREC == PREC_TF32) {
#pragma unroll
                        for (int mi = 0; mi < MI; ++mi) {
                            unsigned int r[4];
                            dt_ldmatrix_x4(r, a_ldsm + slot_bytes + 4u * SA::at(mi * 16, kk));
#pragma unroll
                            for (int q = 0; q < 4; ++q) split<PREC>(__uint_as_float(r[q]), a[mi][q], as[mi][q]);
                        }
#pragma unroll
                        for (int ni = 0; ni < NI; ni += 2) {
                            unsigned int r[4];
                            dt_ldmatrix_x4(r, b_ldsm + slot_bytes + 4u * SB::at(ni * 8, kk));
#pragma unroll
                            for (int q = 0; q < 4; ++q)
                                split<PREC>(__uint_as_float(r[q]), b[ni + (q >> 1)][q & 1], bs[ni + (q >> 1)][q & 1]);
                        }
                    } else {
#pragma unroll
                        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                            for (int q = 0; q < 4; ++q)
                                split<PREC>(As[a_base + SA::at(mi * 16 + (q & 1) * 8, kk + (q >> 1) * 4)], a[mi][q],
                                            as[mi][q]);
#pragma unroll
                        for (int ni = 0; ni < NI; ++ni)
#pragma unroll
                            for (int q = 0; q < 2; ++q)
                                split<PREC>(Bs[b_base + SB::at(ni * 8, kk + q * 4)], b[ni][q], bs[ni][q]);
                    }
#pragma unroll
                    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                        for (int ni = 0; ni < NI; ++ni) {
                            if (PREC == PREC_3XTF32) {  // small terms first: they are the ones rounding would lose
                                mma(part[mi][ni], as[mi], b[ni]);
                                mma(part[mi][ni], a[mi], bs[ni]);
                                mma(part[mi][ni], a[mi], b[ni]);
                            } else {
                                mma(acc[mi][ni], a[mi], b[ni]);
                            }
                        }
                }
                if (PREC == PREC_3XTF32) {
#pragma unroll
                    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                        for (int ni = 0; ni < NI; ++ni)
#pragma unroll
                            for (int q = 0; q < 4; ++q) acc[mi][ni][q] += part[mi][ni][q];
                }
            }
        }
    };
    if (whole)
        k_loop(true);
    else
        k_loop(false);
    if constexpr (DWL) dt_cp_async_commit();  // copy_mask's copies, whatever the loop committed
    dt_cp_async_wait<0>();
    // The next kernel's blocks may be placed from here on: earlier, they would sit
    // on SMs this grid's later blocks still need (a dependent launch only).
    dt_allow_dependents();

    // Only the kernels built with CLUSTER (the 32x32 tile's `_cluster_` kernels,
    // drvtrain.nn.mlp.Tile.cluster_splits) hold the code that sums splits in a cluster;
    // every other kernel keeps none (measured on the H200: with it, the large step's
    // 64x64 weight gradient, never clustered, ended 2.7 us later, and its 32x32 one 0.4 us).
    const bool clustered = CLUSTER && splits > 1 && dt_cluster_blocks() == (unsigned int)splits;
    if constexpr (CLUSTER) if (clustered) {
        // The splits of the tile are one cluster (1, 1, S), rank z: each block stages
        // its partial in its own ring, in fragment order, and block 0 adds them over
        // distributed shared memory in z order, its own from registers: the sums of
        // the workspace path below, bit for bit, after one barrier, with no global memory.
        static_assert(BM * BN + BM <= STAGES * STAGE, "the ring holds a partial tile and its row sums");
        float4* stage = reinterpret_cast<float4*>(smem);
        __syncthreads();  // every warp is done with its last k tile
        if (z != 0) {
            if (active) {
#pragma unroll
                for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                    for (int ni = 0; ni < NI; ++ni)
                        stage[(mi * NI + ni) * THREADS + tid] =
                            make_float4(acc[mi][ni][0], acc[mi][ni][1], acc[mi][ni][2], acc[mi][ni][3]);
            }
            if (sums && tid < BM) smem[BM * BN + tid] = row_sum;
        }
        dt_cluster_barrier();  // every partial is staged
        if (z != 0) {
            dt_cluster_barrier();  // block 0 has read them: only then may this block leave
            return;
        }
        // The other ranks' partials are loaded R ranks a round, every fragment's and the
        // row sums' loads of a round issued before any is added: one round trip over
        // distributed shared memory a round, not one a fragment (docs/perf-notes.md,
        // forty-eighth pass). R = 3: the plans' at most four splits in one round
        // (drvtrain.nn.mlp.TILE_32.cluster_splits), the most a cluster takes (8) in
        // three. The adds keep z order.
        constexpr int R = 3;
        auto add = [](float4& v, const float4& p) { v.x += p.x, v.y += p.y, v.z += p.z, v.w += p.w; };
        float4 v[MI][NI];
        float rv = 0.0f;
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
            for (int ni = 0; ni < NI; ++ni) {
                v[mi][ni] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                add(v[mi][ni], make_float4(acc[mi][ni][0], acc[mi][ni][1], acc[mi][ni][2], acc[mi][ni][3]));
            }
        if (sums && tid < BM) rv += row_sum;
        for (int s0 = 1; s0 < splits; s0 += R) {
            float4 p[R][MI][NI];
            float rp[R];
#pragma unroll
            for (int r = 0; r < R; ++r) {
                if (s0 + r < splits) {
                    if (active) {
#pragma unroll
                        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                            for (int ni = 0; ni < NI; ++ni)
                                p[r][mi][ni] = dt_cluster_load4(
                                    dt_cluster_address(smem0 + 16u * ((mi * NI + ni) * THREADS + tid), s0 + r));
                    }
                    if (sums && tid < BM)
                        rp[r] = dt_cluster_load(dt_cluster_address(smem0 + 4u * (BM * BN + tid), s0 + r));
                }
            }
#pragma unroll
            for (int r = 0; r < R; ++r) {
                if (s0 + r >= splits) continue;
                if (active) {
#pragma unroll
                    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                        for (int ni = 0; ni < NI; ++ni) add(v[mi][ni], p[r][mi][ni]);
                }
                if (sums && tid < BM) rv += rp[r];
            }
        }
        if (active) {
#pragma unroll
            for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                for (int ni = 0; ni < NI; ++ni)
                    acc[mi][ni][0] = v[mi][ni].x, acc[mi][ni][1] = v[mi][ni].y, acc[mi][ni][2] = v[mi][ni].z,
                    acc[mi][ni][3] = v[mi][ni].w;
        }
        if (sums && tid < BM) row_sum = rv;
        // The loads above have returned (release): the other blocks may leave while
        // this one stores; it waits for their arrival only at its very end.
        dt_cluster_arrive();
    }
    if (!clustered && splits > 1) {
        const unsigned int tile = blockIdx.y * gridDim.x + blockIdx.x;
        float4* parts = reinterpret_cast<float4*>(workspace) + (size_t)tile * splits * (BM * BN / 4);
        float* row_parts = workspace + (size_t)gridDim.x * gridDim.y * splits * BM * BN + (size_t)blockIdx.y * splits * BM;
        if (active) {
#pragma unroll
            for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                for (int ni = 0; ni < NI; ++ni)
                    parts[(size_t)z * (BM * BN / 4) + (mi * NI + ni) * THREADS + tid] =
                        make_float4(acc[mi][ni][0], acc[mi][ni][1], acc[mi][ni][2], acc[mi][ni][3]);
        }
        if (sums && tid < BM) row_parts[z * BM + tid] = row_sum;
        if (!dt_last_block(&counters[tile], splits)) return;
        // The partials in z order; this block's own come from its registers. Every
        // z's loads go out together: the tail costs `splits` round trips.
        if (active) {
            float4 v[MI][NI];
#pragma unroll
            for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                for (int ni = 0; ni < NI; ++ni) v[mi][ni] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            for (int s = 0; s < splits; ++s) {
#pragma unroll
                for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                    for (int ni = 0; ni < NI; ++ni) {
                        const float4 p = s == z ? make_float4(acc[mi][ni][0], acc[mi][ni][1], acc[mi][ni][2],
                                                              acc[mi][ni][3])
                                                : __ldcg(&parts[(size_t)s * (BM * BN / 4) + (mi * NI + ni) * THREADS + tid]);
                        v[mi][ni].x += p.x, v[mi][ni].y += p.y, v[mi][ni].z += p.z, v[mi][ni].w += p.w;
                    }
            }
#pragma unroll
            for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                for (int ni = 0; ni < NI; ++ni)
                    acc[mi][ni][0] = v[mi][ni].x, acc[mi][ni][1] = v[mi][ni].y, acc[mi][ni][2] = v[mi][ni].z,
                    acc[mi][ni][3] = v[mi][ni].w;
        }
        if (sums && tid < BM) {
            float v = 0.0f;
            for (int s = 0; s < splits; ++s) v += s == z ? row_sum : __ldcg(&row_parts[s * BM + tid]);
            row_sum = v;
        }
    }
    if (sums && tid < BM && i0 + tid < M) col_sum[i0 + tid] = row_sum;
    if constexpr (DW0) {
        // dX1 is not stored: its tile's share of dW0 and db0 is summed here, per
        // column over this tile's rows, and the last tile of each column strip
        // (dt_last_block) adds the strip's shares in blockIdx.y order (with no
        // counters, the kernel after this one does, in the same order). FP32 FMAs in
        // a fixed order: bitwise reproducible for a fixed launch.
        static_assert(EPI == EPI_MASK && EARLY && CFG::WARPS_M * BN * (DW0_MAX_IN + 1) <= STAGES * STAGE,
                      "the masked tile, its mask from the first copies, and room for the warps' shares");
        constexpr int IN = DW0_MAX_IN, E = BN * (IN + 1);
        const int in0 = fd.in0;
        if (in0 < 1 || in0 > IN) __trap();  // the host refuses it first (drvtrain.nn.mlp.gemm)
        float share[NI][2][IN + 1];  // (column slot, value): in0 products with X0, then the plain sum (db0)
#pragma unroll
        for (int ni = 0; ni < NI; ++ni)
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int i = 0; i <= IN; ++i) share[ni][h][i] = 0.0f;
        if (active) {
#pragma unroll
            for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                for (int rh = 0; rh < 2; ++rh) {
                    const int r = frag_row(mi, 2 * rh);
                    float x[IN];
#pragma unroll
                    for (int i = 0; i < IN; ++i) x[i] = i < in0 && r < M ? fd.x0[(size_t)r * fd.ldx0 + i] : 0.0f;
#pragma unroll
                    for (int ni = 0; ni < NI; ++ni)
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            const int q = 2 * rh + h;
                            // mv is 0 outside C (r >= M or c >= N): such an element adds 0.
                            const float v = dt_epilogue<EPI_MASK>(acc[mi][ni][q], 0.0f, mv[mi][ni][q]);
#pragma unroll
                            for (int i = 0; i < IN; ++i) share[ni][h][i] = fmaf(v, x[i], share[ni][h][i]);
                            share[ni][h][IN] += v;
                        }
                }
        }
        // The 8 lanes of a column (one t, every g), in a fixed butterfly.
#pragma unroll
        for (int off = 4; off < 32; off <<= 1)
#pragma unroll
            for (int ni = 0; ni < NI; ++ni)
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int i = 0; i <= IN; ++i) share[ni][h][i] += __shfl_xor_sync(0xffffffffu, share[ni][h][i], off);
        // The warps of a column, in wm order, through shared memory (the ring is free).
        float* red = smem;  // [WARPS_M][BN][IN + 1]
        __syncthreads();
        if (g == 0) {
#pragma unroll
            for (int ni = 0; ni < NI; ++ni)
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int i = 0; i <= IN; ++i)
                        red[(wm * BN + wn * CFG::WN + ni * 8 + 2 * t + h) * (IN + 1) + i] = share[ni][h][i];
        }
        __syncthreads();
        // In the workspace, a tile's share is BN columns of in0 + 1 values (dW0's row, then db0).
        const int row_floats = in0 + 1, share_floats = BN * row_floats;
        float* mine = fd.work + (size_t)(blockIdx.x * gridDim.y + blockIdx.y) * share_floats;
        for (int e = tid; e < share_floats; e += THREADS) {
            const int c = e / row_floats, i = e % row_floats, at = c * (IN + 1) + (i < in0 ? i : IN);
            float v = 0.0f;
#pragma unroll
            for (int w = 0; w < CFG::WARPS_M; ++w) v += red[w * E + at];
            mine[e] = v;
        }
        if (fd.counters != nullptr && dt_last_block(&fd.counters[blockIdx.x], gridDim.y)) {
            const float* strip = fd.work + (size_t)blockIdx.x * gridDim.y * share_floats;
            for (int e = tid; e < share_floats; e += THREADS) {
                float v = 0.0f;
                for (int y = 0; y < (int)gridDim.y; ++y) v += __ldcg(&strip[(size_t)y * share_floats + e]);
                const int c = j0 + e / row_floats, i = e % row_floats;
                if (c < N) {
                    if (i < in0)
                        fd.dw0[(size_t)c * in0 + i] = v;
                    else
                        fd.db0[c] = v;
                }
            }
        }
        if constexpr (CLUSTER) if (clustered) dt_cluster_wait();  // the arrival above: every thread ends it
        return;
    }
    // A block of a cluster still waits at its end, below; a DWL block adds its share there.
    if (!CLUSTER && !DWL && !active) return;

    if constexpr (DWL) {
        // The output layer's dX, dW and db (LastDw). This block's share of dW is dY's 64
        // rows (the ring's slot 0, A's one k tile) against its 64 x 64 tile of H (the
        // mask, copied into slot 1 by copy_mask, which one k tile leaves unused), on the
        // tensor cores in 3xTF32 as the k loop computes: the m16n8k8
        // product's m is dW's row (dY's column: two m16 tiles, zero past K, as the
        // copies fill them), n is H's column (16 a warp: two n8 tiles), and k is the
        // block's row (eight k8 steps). Each half of the rows is summed in fresh fragments
        // and the halves added (the first's plus the second's), as the k loop adds each k
        // tile's products. The share goes into slot 0's B tile, done with since the MMAs.
        // db's share (grid column 0): four quarters of the rows, one thread a column of
        // dY and its 16 rows in order. The block arrives on the cluster barrier once its
        // share is staged, before it stores dX (whose mask it reads back from the staged
        // H: the same values, so the same bits), so the arrival's release waits for no
        // global store. Then the column's row tiles, one cluster, add the shares in
        // row-tile order over distributed shared memory, each block a slice of the K x 64
        // values (db: each row tile's quarters in order). A fixed order: bitwise
        // reproducible for a fixed launch.
        constexpr int HS = DWL_HS;  // H's staged rows, floats apart
        constexpr int WARPS = THREADS / 32, QUARTER = BM / WARPS;
        static_assert(EPI == EPI_MASK && A_KFAST && !CLUSTER && !DW0 && !X0 && !EARLY && PREC == PREC_3XTF32 &&
                          BK == 32 && BM == 64 && BN == 16 * WARPS && STAGES >= 2 && BM * HS <= STAGE &&
                          BK * BN + WARPS * BK <= SB::FLOATS,
                      "H staged in slot 1; two m16 tiles of dW's rows, two n8 tiles a warp, eight k8 steps; "
                      "the share and db's quarters in slot 0's B tile");
        float* const hs = smem + STAGE;
        float* const share = smem + SA::FLOATS;  // [K][BN], then db's quarters [WARPS][BK] at BK * BN
        // Every warp's MMAs are over (slot 0's B tile is free), and every thread's copies
        // of H have landed (copy_mask; the wait after the k loop).
        __syncthreads();
        if (blockIdx.x == 0 && lane < K) {
            float v = 0.0f;
#pragma unroll 4
            for (int i = warp * QUARTER; i < (warp + 1) * QUARTER; ++i) v += smem[SA::at(i, lane)];
            share[BK * BN + warp * BK + lane] = v;
        }
        const int n0 = warp * 16;
        float dws[2][2][4];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float part[2][2][4];
#pragma unroll
            for (int mi = 0; mi < 2; ++mi)
#pragma unroll
                for (int ni = 0; ni < 2; ++ni)
#pragma unroll
                    for (int q = 0; q < 4; ++q) part[mi][ni][q] = 0.0f;
#pragma unroll
            for (int kk = h * (BM / 2); kk < (h + 1) * (BM / 2); kk += 8) {
                unsigned int a[2][4], as[2][4], b[2][2], bs[2][2];
#pragma unroll
                for (int mi = 0; mi < 2; ++mi)  // A[m][k] = dY's (row kk + k, column m)
#pragma unroll
                    for (int q = 0; q < 4; ++q)
                        split<PREC>(smem[SA::at(kk + t + (q >> 1) * 4, mi * 16 + g + (q & 1) * 8)], a[mi][q],
                                    as[mi][q]);
#pragma unroll
                for (int ni = 0; ni < 2; ++ni)  // B[k][n] = H's (row kk + k, column n0 + n)
#pragma unroll
                    for (int q = 0; q < 2; ++q)
                        split<PREC>(hs[(kk + t + q * 4) * HS + n0 + ni * 8 + g], b[ni][q], bs[ni][q]);
#pragma unroll
                for (int mi = 0; mi < 2; ++mi)
#pragma unroll
                    for (int ni = 0; ni < 2; ++ni) {  // small terms first, as the k loop
                        mma(part[mi][ni], as[mi], b[ni]);
                        mma(part[mi][ni], a[mi], bs[ni]);
                        mma(part[mi][ni], a[mi], b[ni]);
                    }
            }
#pragma unroll
            for (int mi = 0; mi < 2; ++mi)
#pragma unroll
                for (int ni = 0; ni < 2; ++ni)
#pragma unroll
                    for (int q = 0; q < 4; ++q)
                        dws[mi][ni][q] = h == 0 ? part[mi][ni][q] : dws[mi][ni][q] + part[mi][ni][q];
        }
#pragma unroll
        for (int mi = 0; mi < 2; ++mi)
#pragma unroll
            for (int ni = 0; ni < 2; ++ni)
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const int r = mi * 16 + g + (q >> 1) * 8;
                    if (r < K) share[r * BN + n0 + ni * 8 + 2 * t + (q & 1)] = dws[mi][ni][q];
                }
        dt_cluster_arrive();  // this block's share is staged (release)
        if (active) {
            // A fragment's two columns are neighbours (c even): one 8-byte store where C
            // allows it, in place of two.
            const bool pairs = dt_pairs_fit(C, ldc);
#pragma unroll
            for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                for (int ni = 0; ni < NI; ++ni)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int r = frag_row(mi, 2 * h), c = frag_col(ni, 0);
                        if (r >= M) continue;
                        const float* m = hs + (r - i0) * HS + c - j0;
                        const float v0 = dt_epilogue<EPI>(acc[mi][ni][2 * h], 0.0f, m[0]);
                        const float v1 = dt_epilogue<EPI>(acc[mi][ni][2 * h + 1], 0.0f, m[1]);
                        dt_store_pair(C + (size_t)r * ldc + c, v0, v1, c, N, pairs);
                    }
        }
        dt_cluster_wait();  // every row tile's share is staged (acquire)
        const unsigned int ranks = gridDim.y, rank = dt_cluster_rank();
        const unsigned int share0 = smem0 + 4u * SA::FLOATS;
        for (int e = rank * THREADS + tid; e < K * BN; e += ranks * THREADS) {
            const int r = e / BN, c = j0 + e % BN;
            if (c >= N) continue;  // no load whose value no store takes (the relaxed arrival below)
            float v[DT_PORTABLE_CLUSTER];
#pragma unroll
            for (int y = 0; y < DT_PORTABLE_CLUSTER; ++y)  // every load out before the adds
                v[y] = y < (int)ranks ? dt_cluster_load(dt_cluster_address(share0 + 4u * e, y)) : 0.0f;
            float sum = 0.0f;
#pragma unroll
            for (int y = 0; y < DT_PORTABLE_CLUSTER; ++y) sum += v[y];  // the row tiles in order; the rest add 0
            lw.dw[(size_t)r * lw.ldw + c] = sum;
        }
        if (blockIdx.x == 0 && rank == 0 && tid < K) {
            float sum = 0.0f;
            for (unsigned int y = 0; y < ranks; ++y) {
                float v = 0.0f;
#pragma unroll
                for (int w = 0; w < WARPS; ++w)
                    v += dt_cluster_load(dt_cluster_address(share0 + 4u * (BK * BN + w * BK + tid), y));
                sum += v;
            }
            lw.db[tid] = sum;
        }
        // Every remote load's value is in a store above, so the loads are over: the
        // arrival orders nothing more (relaxed), and its wait keeps this block until the
        // others have read its share.
        dt_cluster_arrive_relaxed();
        dt_cluster_wait();
        return;
    }
    // Epilogue.
    if (active) {
        if constexpr (!EARLY) load_epilogue();
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
            for (int ni = 0; ni < NI; ++ni)
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const int r = frag_row(mi, q), c = frag_col(ni, q & 1);
                    if (r < M && c < N)
                        C[(size_t)r * ldc + c] = dt_epilogue<EPI>(acc[mi][ni][q], bv[ni][q & 1], mv[mi][ni][q]);
                }
    }
    if constexpr (CLUSTER) if (clustered) dt_cluster_wait();  // the arrival above: every thread ends it
}

}  // namespace tc

// ================================================================= FP32 FFMA
namespace ffma {

constexpr int BM = 64, BN = 64, BK = 64, PAD = 4;  // PAD keeps the tile stores conflict-free

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

    __device__ __forceinline__ void store(float (*tile)[BK + PAD]) const {
        const int fixed = threadIdx.x % (K_FAST ? BK : ROWS);
        const int first = threadIdx.x / (K_FAST ? BK : ROWS);
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            if (K_FAST) tile[first + i * STEP][fixed] = reg[i];
            else tile[fixed][first + i * STEP] = reg[i];
        }
    }
};

template <int EPI>
__device__ __forceinline__ void epilogue_store(float* C, int ldc, int M, int N, int i, int j, float v,
                                               const float* bias, const float* mask, int ldm) {
    if (i >= M || j >= N) return;
    const float b = (EPI == EPI_BIAS || EPI == EPI_BIAS_RELU) ? bias[j] : 0.0f;
    const float m = EPI == EPI_MASK ? mask[(long long)i * ldm + j] : 0.0f;
    C[(long long)i * ldc + j] = dt_epilogue<EPI>(v, b, m);
}

// Where a block's sums go. With gridDim.z == 1, through the epilogue into C. With
// the k range split over gridDim.z blocks, into partial tiles in `workspace`
// ([z][M][N], then the row sums [z][M]); the last block of each output tile adds
// the partials in z order and applies the epilogue.
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
        constexpr int Q = 16;  // BM * BN / 256
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

template <int EPI, bool A_KFAST, bool B_KFAST>
__device__ void gemm(const float* A, int lda, const float* B, int ldb, int M, int N, int K, const Output<EPI>& out) {
    constexpr int THREADS = 256;
    __shared__ float As[BM][BK + PAD];
    __shared__ float Bs[BN][BK + PAD];
    const int i0 = blockIdx.y * BM, j0 = blockIdx.x * BN;
    const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
    const bool sums = out.col_sum != nullptr && blockIdx.x == 0;
    float acc[4][4] = {};
    float row_sum = 0.0f;
    // This block's share of the k range: whole 64-deep tiles, split evenly over gridDim.z.
    const int k_tiles = (K + BK - 1) / BK, per = (k_tiles + gridDim.z - 1) / gridDim.z;
    const int kb = min(K, (int)blockIdx.z * per * BK), ke = min(K, kb + per * BK);
    TileLoader<THREADS, BM, A_KFAST> la;
    TileLoader<THREADS, BN, B_KFAST> lb;
    la.load(A, lda, i0, kb, M, ke);
    lb.load(B, ldb, j0, kb, N, ke);
    for (int k0 = kb; k0 < ke; k0 += BK) {
        la.store(As);
        lb.store(Bs);
        __syncthreads();
        if (k0 + BK < ke) {  // the next tile's global loads fly while this one computes
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
    dt_allow_dependents();  // after the main loop, as in the tensor-core kernels
    if (sums && threadIdx.x < BM) out.put_row_sum(i0 + threadIdx.x, row_sum);
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int c = 0; c < 4; ++c) out.put(i0 + ty + 16 * r, j0 + tx + 16 * c, acc[r][c]);
    out.finish(sums);
}

}  // namespace ffma

}  // namespace

// One signature for all: ptr i32 ptr i32 ptr i32 i32 i32 i32 ptr ptr i32 ptr ptr ptr ptr.
// `gate` (may be 0): when it points at a non-zero word the whole grid returns
// having written nothing (a training loop's step that is not due this iteration).
// The `_settled_` kernels (forward and grad-input roles, folded ones included) are
// the same products for a B (and a folded first layer's W0 and b0) that no kernel
// they directly depend on writes: they issue B's first tiles (and read W0 and b0)
// before waiting for the grid before them (tc::gemm says why that is safe). They
// are kernels of their own, not a flag: a branch on a launch argument there
// measured slower on the H200 than no early tiles at all (docs/perf-notes.md,
// twenty-fifth pass).
// Arguments a kernel does not use (bias, mask, col_sum) may be 0; so may workspace
// and counters with gridDim.z == 1, or for a `_cluster_` kernel launched in
// clusters of its gridDim.z splits. Otherwise counters is one zeroed uint per output
// tile (left zeroed on exit) and workspace holds, in floats:
//   tensor cores: gridDim.x * gridDim.y * S * BM * BN (+ gridDim.y * S * BM with col_sum)
//   FFMA:         S * (M * N + M)
// Every kernel waits for the grid before it (programmatic dependent launch) before
// touching memory, the gate word included (a settled B's first tiles aside), and
// lets the next grid's blocks be placed only after its main loop. The tensor-core
// kernels load the gate with their first tiles and test it once those copies are
// issued; the FFMA kernels test it first.
#define DT_GEMM_PARAMS                                                                                    \
    const float *A, int lda, const float *B, int ldb, float *C, int ldc, int M, int N, int K,             \
        const float *bias, const float *mask, int ldm, float *col_sum, float *workspace,                  \
        unsigned int *counters, const int *gate
#define DT_GEMM_ARGS A, lda, B, ldb, C, ldc, M, N, K, bias, mask, ldm, col_sum, workspace, counters
#define DT_GEMM_PROLOGUE        \
    dt_wait_prior_grid();       \
    if (gate != nullptr && *gate) return;

#define DT_TC_KERNEL(NAME, CFG, PREC, A_KFAST, B_KFAST, EPI, VEC, CLUSTER, SETTLED)                      \
    extern "C" __global__ void __launch_bounds__(tc::CFG::THREADS) NAME(DT_GEMM_PARAMS) {                \
        tc::gemm<tc::CFG, tc::PREC, A_KFAST, B_KFAST, EPI, VEC, CLUSTER, false, false, SETTLED>(          \
            DT_GEMM_ARGS, gate);                                                                          \
    }
#define DT_DW0_PARAMS \
    , const float *x0, int ldx0, int in0, float *dw0, float *db0, float *work0, unsigned int *counters0
#define DT_TC_DW0_KERNEL(NAME, CFG, VEC, SETTLED)                                                         \
    extern "C" __global__ void __launch_bounds__(tc::CFG::THREADS) NAME(DT_GEMM_PARAMS DT_DW0_PARAMS) {   \
        tc::gemm<tc::CFG, tc::PREC_3XTF32, true, false, EPI_MASK, VEC, true, true, false, SETTLED>(       \
            DT_GEMM_ARGS, gate, tc::FirstDw{x0, ldx0, in0, dw0, db0, work0, counters0});                  \
    }
#define DT_DWL_PARAMS , float *dwl, int ldwl, float *dbl
#define DT_TC_DWL_KERNEL(NAME, VEC)                                                                        \
    extern "C" __global__ void __launch_bounds__(tc::Tile64x64::THREADS) NAME(DT_GEMM_PARAMS DT_DWL_PARAMS) { \
        tc::gemm<tc::Tile64x64, tc::PREC_3XTF32, true, false, EPI_MASK, VEC, false, false, false, false, true>( \
            DT_GEMM_ARGS, gate, tc::FirstDw{}, tc::FirstLayer{}, tc::LastDw{dwl, ldwl, dbl});                 \
    }
#define DT_LOSS_PARAMS                                                                                      \
    , const float *q_s, const float *q_next, const float *q_target, const int *action, const float *reward, \
        const float *done, const float *weights, float gamma, float huber_delta, float *priorities,        \
        double *loss_partials, int loss_blocks, int *a_star
#define DT_TC_LOSS_DWL_KERNEL(NAME, VEC, LOSS_K)                                                                \
    extern "C" __global__ void __launch_bounds__(tc::Tile64x64::THREADS)                                        \
        NAME(DT_GEMM_PARAMS DT_DWL_PARAMS DT_LOSS_PARAMS) {                                                     \
        tc::gemm<tc::Tile64x64, tc::PREC_3XTF32, true, false, EPI_MASK, VEC, false, false, false, false, true,  \
                 true, LOSS_K>(DT_GEMM_ARGS, gate, tc::FirstDw{}, tc::FirstLayer{}, tc::LastDw{dwl, ldwl, dbl}, \
                       tc::DqnLoss{q_s, q_next, q_target, action, reward, done, weights, gamma, huber_delta,    \
                                   priorities, loss_partials, loss_blocks, a_star});                            \
    }
#define DT_X0_PARAMS , const float *x0, int ldx0, int in0, const float *w0, const float *b0
#define DT_TC_X0_KERNEL(NAME, EPI, VEC, SETTLED)                                                          \
    extern "C" __global__ void __launch_bounds__(tc::Tile32x32::THREADS) NAME(DT_GEMM_PARAMS DT_X0_PARAMS) { \
        tc::gemm<tc::Tile32x32, tc::PREC_TF32, true, true, EPI, VEC, true, false, true, SETTLED>(         \
            DT_GEMM_ARGS, gate, tc::FirstDw{}, tc::FirstLayer{x0, ldx0, in0, w0, b0});                    \
    }
// VARIANT is the name's part after the copy width: _ (plain) or _cluster_ (CLUSTER).
// The roles whose B is a weight also come `_settled_` (B's first tiles before the wait).
#define DT_TC_ROLES(TILE, CP, VEC, VARIANT, CLUSTER)                                                                  \
    DT_TC_KERNEL(linear_forward_##TILE##_##CP##VARIANT##tf32, Tile##TILE, PREC_TF32, true, true, EPI_BIAS, VEC,     \
                 CLUSTER, false)                                                                                     \
    DT_TC_KERNEL(linear_forward_relu_##TILE##_##CP##VARIANT##tf32, Tile##TILE, PREC_TF32, true, true, EPI_BIAS_RELU, \
                 VEC, CLUSTER, false)                                                                                \
    DT_TC_KERNEL(linear_grad_input_##TILE##_##CP##VARIANT##3xtf32, Tile##TILE, PREC_3XTF32, true, false, EPI_MASK,   \
                 VEC, CLUSTER, false)                                                                                \
    DT_TC_KERNEL(linear_grad_weight_##TILE##_##CP##VARIANT##3xtf32, Tile##TILE, PREC_3XTF32, false, false, EPI_NONE, \
                 VEC, CLUSTER, false)                                                                                \
    DT_TC_KERNEL(linear_forward_##TILE##_##CP##VARIANT##settled_tf32, Tile##TILE, PREC_TF32, true, true, EPI_BIAS,  \
                 VEC, CLUSTER, true)                                                                                 \
    DT_TC_KERNEL(linear_forward_relu_##TILE##_##CP##VARIANT##settled_tf32, Tile##TILE, PREC_TF32, true, true,       \
                 EPI_BIAS_RELU, VEC, CLUSTER, true)                                                                  \
    DT_TC_KERNEL(linear_grad_input_##TILE##_##CP##VARIANT##settled_3xtf32, Tile##TILE, PREC_3XTF32, true, false,    \
                 EPI_MASK, VEC, CLUSTER, true)

DT_TC_ROLES(64x64, cp16, true, _, false)
DT_TC_ROLES(64x64, cp4, false, _, false)
DT_TC_ROLES(32x32, cp16, true, _, false)
DT_TC_ROLES(32x32, cp4, false, _, false)
// Their splits summed in a cluster (1, 1, S); launched without one they take the workspace.
DT_TC_ROLES(32x32, cp16, true, _cluster_, true)
DT_TC_ROLES(32x32, cp4, false, _cluster_, true)
// The grad-input product of the second layer with the first layer's dW and db folded in
// (tc::FirstDw; the arguments after gate): dX itself is not stored, C may be 0.
DT_TC_DW0_KERNEL(linear_grad_input_dw0_32x32_cp16_cluster_3xtf32, Tile32x32, true, false)
DT_TC_DW0_KERNEL(linear_grad_input_dw0_32x32_cp4_cluster_3xtf32, Tile32x32, false, false)
DT_TC_DW0_KERNEL(linear_grad_input_dw0_32x32_cp16_cluster_settled_3xtf32, Tile32x32, true, true)
DT_TC_DW0_KERNEL(linear_grad_input_dw0_32x32_cp4_cluster_settled_3xtf32, Tile32x32, false, true)
// The output layer's grad-input product with its dW and db folded in (tc::LastDw; the
// arguments after gate), launched as clusters (1, gridDim.y, 1).
DT_TC_DWL_KERNEL(linear_grad_input_dwl_64x64_cp16_cluster_3xtf32, true)
DT_TC_DWL_KERNEL(linear_grad_input_dwl_64x64_cp4_cluster_3xtf32, false)
// The same with the Double-DQN loss computed in it (tc::DqnLoss; its arguments follow
// the LastDw ones): A is where dout is stored, lda its row stride; K = 1 + n_actions.
// Any count of actions; and 18 (Atari's full set, the large configuration), compiled for
// them (docs/perf-notes.md, forty-seventh pass). The same bits.
DT_TC_LOSS_DWL_KERNEL(dqn_loss_dwl_64x64_cp16_cluster_3xtf32, true, 0)
DT_TC_LOSS_DWL_KERNEL(dqn_loss_dwl_64x64_cp4_cluster_3xtf32, false, 0)
DT_TC_LOSS_DWL_KERNEL(dqn_loss_dwl_a18_64x64_cp16_cluster_3xtf32, true, 19)
DT_TC_LOSS_DWL_KERNEL(dqn_loss_dwl_a18_64x64_cp4_cluster_3xtf32, false, 19)
// The second layer's forward with the first layer computed in it (tc::FirstLayer; the
// arguments after gate): A is where H0 is stored, or 0.
DT_TC_X0_KERNEL(linear_forward_x0_32x32_cp16_cluster_tf32, EPI_BIAS, true, false)
DT_TC_X0_KERNEL(linear_forward_x0_32x32_cp4_cluster_tf32, EPI_BIAS, false, false)
DT_TC_X0_KERNEL(linear_forward_relu_x0_32x32_cp16_cluster_tf32, EPI_BIAS_RELU, true, false)
DT_TC_X0_KERNEL(linear_forward_relu_x0_32x32_cp4_cluster_tf32, EPI_BIAS_RELU, false, false)
DT_TC_X0_KERNEL(linear_forward_x0_32x32_cp16_cluster_settled_tf32, EPI_BIAS, true, true)
DT_TC_X0_KERNEL(linear_forward_x0_32x32_cp4_cluster_settled_tf32, EPI_BIAS, false, true)
DT_TC_X0_KERNEL(linear_forward_relu_x0_32x32_cp16_cluster_settled_tf32, EPI_BIAS_RELU, true, true)
DT_TC_X0_KERNEL(linear_forward_relu_x0_32x32_cp4_cluster_settled_tf32, EPI_BIAS_RELU, false, true)

#define DT_FFMA_KERNEL(NAME, EPI, A_KFAST, B_KFAST)                                                    \
    extern "C" __global__ void __launch_bounds__(256) NAME(DT_GEMM_PARAMS) {                            \
        DT_GEMM_PROLOGUE                                                                                \
        ffma::gemm<EPI, A_KFAST, B_KFAST>(A, lda, B, ldb, M, N, K,                                      \
                                          ffma::Output<EPI>{C, ldc, M, N, bias, mask, ldm, col_sum,     \
                                                            workspace, counters});                      \
    }

DT_FFMA_KERNEL(linear_forward_f32, EPI_BIAS, true, true)
DT_FFMA_KERNEL(linear_forward_relu_f32, EPI_BIAS_RELU, true, true)
DT_FFMA_KERNEL(linear_grad_input_f32, EPI_MASK, true, false)
DT_FFMA_KERNEL(linear_grad_weight_f32, EPI_NONE, false, false)
