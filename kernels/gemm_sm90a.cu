// The linear layer's products on Hopper's warpgroup MMA (wgmma), for sm_90a only
// (built for any other target, the kernels trap at once):
//
//   linear_forward[_relu]_wgmma_tf32   Y = X W^T + b (+ ReLU), X [M, K] and W [N, K] k-fast
//   linear_forward_relu_head_wgmma_tf32
//                                      the same with ReLU, and the output layer after it
//                                      (Q = Y W2^T + b2, at most HEAD_N outputs) in its epilogue
//   linear_grad_input_wgmma_3xtf32     dX = (dY W) * (X > 0)
//   linear_grad_weight_wgmma_3xtf32    dW = dY^T X, db = sum_m dY
//   linear_grad_{input,weight}_wgmma_presplit_3xtf32, tf32_split
//                                      the same backward on operands split once
//                                      into TF32 parts (at the end of this file)
//
// the same contract as gemm.cu's kernels of those roles with 16-byte copies (its
// header: operand layouts, split-k workspace and counters, the gate, dependent
// launch), with a 128x128 block tile, and one more way to split k: a launch in
// clusters of a tile's splits needs no workspace (finish_tile). The backward takes
// gemm.cu's arguments; the forward takes its operands as tensor maps instead of
// pointers (at its kernels below).
// drvtrain.nn.mlp chooses them for the wide products on compute capability 9.0
// and falls back to gemm.cu's mma.sync kernels everywhere else (and when forced).
//
// Block: two warpgroups (the backward adds a third, which feeds them); warpgroup w
// owns output rows 64w .. 64w+63 of the tile and all 128 columns: one
// wgmma.m64n128k8 per 8 deep (three in 3xTF32), B read from shared memory through
// a matrix descriptor, A too in the forward and from registers in the backward,
// FP32 accumulators in registers (64 per thread; the backward another 64 for each k
// tile's fragment).
// Precision: the forward lets the tensor cores truncate its FP32 operands to TF32
// (about 8e-4 relative on random data, against 3e-4 for gemm.cu, which rounds to
// nearest; rounding in shared memory measured 3.5 us slower on 512x1024x1024).
// The backward splits its operands as gemm.cu's 3xTF32 does: FP32 accuracy.
// Non-finite operands stay non-finite.
// Forward pipeline: 5 stages of 32-deep k tiles, each copied by two TMA copies
// (one thread issues them, the stage's mbarrier counts their bytes) three tiles
// ahead, while one tile's MMAs are in flight and the next tile's are issued. The
// backward's pipeline is described at backward() below.
// Shared layout of one MMA operand tile, 128 rows x 32 deep: 128-byte rows, the
// 16-byte chunk c of row r at 128 r + 16 (c ^ r % 8) (the 128-byte swizzle, in
// 1024-byte atoms of 8 rows), which TMA writes for the forward and the backward's
// producer writes free of bank conflicts, and which the MMAs read free of them. (The
// unswizzled layout measured 26 us against 17.)
// Determinism: every output is one thread's accumulation in a fixed k order
// (the tensor core's own, fixed per shape) plus a fixed z order over the splits,
// the same in a cluster as through the workspace.
#include "common.cuh"
#include "epilogue.cuh"
#include "tf32.cuh"
#include "tma.cuh"

// Built for any other target than sm_90a (a compile-everything check, say) the
// wgmma instructions do not exist: the kernels trap, and the host never loads
// that build.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DT_WGMMA 1
#endif

// The backward's block: two consumer warpgroups and a producer (backward() below).
#define DT_BACKWARD_THREADS 384

#if DT_WGMMA
namespace {

constexpr int BM = 128, BN = 128, BK = 32, THREADS = 256;
constexpr int TILE_FLOATS = 128 * BK;                 // one operand's k tile
constexpr int STAGE_FLOATS = 2 * TILE_FLOATS;         // A then B
constexpr int ACC = BN / 2;                           // accumulators per thread: 64 x 128 / 128
// The forward: 5 stages (measured on the H200, 512x1024x1024 in 3 clustered splits:
// 4 stages 8.9 us, 5 stages 8.4, 6 stages 8.5), 3 k tiles copied ahead, one more in
// the MMAs; 160 KB, plus 1 KB to align them to the 1024-byte swizzle atom.
constexpr int STAGES = 5, LEAD = 3;
// forward() copies tile kt + LEAD into the slot of tile kt - 2, whose MMAs the last
// iteration's wait finished: that holds only with exactly two tiles not copied ahead.
static_assert(LEAD == STAGES - 2, "the forward's slot reuse");
constexpr unsigned int SHARED_BYTES = STAGES * STAGE_FLOATS * 4 + 1024;

// A matrix descriptor at shared byte address `addr` for the 128-byte swizzled
// K-major layout: start >> 4 in bits 0-13, leading byte offset (unused by this
// layout, 1 by convention) in 16-29, stride byte offset >> 4 in 32-45 (8-row
// atoms 1024 bytes apart), layout type 1 (128-byte swizzle) in 62-63.
__device__ __forceinline__ unsigned long long descriptor(unsigned int addr) {
    return ((addr >> 4) & 0x3fffull) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}

// The 64 FP32 accumulators of an m64n128 wgmma: its register list (operands %0 to
// %63 of the asm) and their constraints.
#define DT_WGMMA_D                                                                                \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                    \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "            \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "            \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define DT_WGMMA_D_OPERANDS(d)                                                                    \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),      \
    "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),    \
    "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),    \
    "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),    \
    "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]),    \
    "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),    \
    "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),    \
    "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// d (+)= A B for one 64 x 128 x 8 step; ACCUMULATE = 0 overwrites d (scale-d).
template <int ACCUMULATE = 1>
__device__ __forceinline__ void wgmma_m64n128k8(float (&d)[ACC], unsigned long long a, unsigned long long b) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %66, 0;\n"  // scale-d
        "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 "
        DT_WGMMA_D ", "
        "%64, %65, p, 1, 1;\n"
        "}\n"
        : DT_WGMMA_D_OPERANDS(d)
        : "l"(a), "l"(b), "n"(ACCUMULATE));
}

// Keeps the compiler from moving any use of the accumulators across the
// asynchronous MMAs' issue and wait (no instruction is emitted).
__device__ __forceinline__ void fence_accumulators(float (&acc)[ACC]) {
#pragma unroll
    for (int q = 0; q < ACC; ++q) asm volatile("" : "+f"(acc[q])::"memory");
}

// Accumulator q = 4 j + 2 h + e of a thread: row 64 wg + 16 warp + g + 8 h of the
// block tile (wg the warpgroup, warp its warp within it, g = lane / 4), column
// 8 j + 2 t + e (t = lane % 4).

// Split-k (gridDim.z = S > 1): every block writes its partial tile to `workspace`
// in accumulator order (coalesced), and `sums` blocks their row sums (thread tid <
// 128 holds row tid) after all partials, [tile row][z][128]; the last block of
// the tile to arrive (dt_last_block) adds the S partials in z order into `acc`
// and `row_sum` and returns true. Every other block returns false and must exit.
// A block of BLOCK > THREADS threads calls it with all of them: the first THREADS
// hold the accumulators, the others only meet the barriers.
template <int BLOCK = THREADS>
__device__ __forceinline__ bool reduce_splits(float (&acc)[ACC], float* workspace, unsigned int* counters, bool sums,
                                              float& row_sum) {
    const int tid = threadIdx.x, splits = gridDim.z, z = blockIdx.z;
    const bool active = BLOCK == THREADS || tid < THREADS;
    const unsigned int tile = blockIdx.y * gridDim.x + blockIdx.x;
    float4* parts = reinterpret_cast<float4*>(workspace) + (size_t)tile * splits * (BM * BN / 4);
    float* row_parts =
        workspace + (size_t)gridDim.x * gridDim.y * splits * BM * BN + (size_t)blockIdx.y * splits * BM;
    if (active)
#pragma unroll
        for (int j = 0; j < ACC / 4; ++j)
            parts[(size_t)z * (BM * BN / 4) + j * THREADS + tid] =
                make_float4(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]);
    if (sums && tid < BM) row_parts[z * BM + tid] = row_sum;
    if (!dt_last_block(&counters[tile], splits)) return false;
    if (!active) return true;
    // Every z's loads go out together: the tail costs `splits` round trips.
    float4 v[ACC / 4];
#pragma unroll
    for (int j = 0; j < ACC / 4; ++j) v[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int s = 0; s < splits; ++s) {
#pragma unroll
        for (int j = 0; j < ACC / 4; ++j) {
            const float4 p = s == z ? make_float4(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3])
                                    : __ldcg(&parts[(size_t)s * (BM * BN / 4) + j * THREADS + tid]);
            v[j].x += p.x, v[j].y += p.y, v[j].z += p.z, v[j].w += p.w;
        }
    }
#pragma unroll
    for (int j = 0; j < ACC / 4; ++j)
        acc[4 * j] = v[j].x, acc[4 * j + 1] = v[j].y, acc[4 * j + 2] = v[j].z, acc[4 * j + 3] = v[j].w;
    if (sums && tid < BM) {
        float r = 0.0f;
        for (int s = 0; s < splits; ++s) r += s == z ? row_sum : __ldcg(&row_parts[s * BM + tid]);
        row_sum = r;
    }
    return true;
}

// ---------------------------------------------------------------- epilogue
// The block's outputs go through shared memory (`stage`, 1024-byte aligned; the
// caller's MMAs are done in its own warpgroup, and a barrier here waits for the
// other) so that a warp writes whole rows of the tile: 16-byte accesses to C and
// the mask where their strides and addresses allow, else 4-byte ones, coalesced
// either way. (Written from the accumulators' fragment layout, a warp's stores
// touched 8 rows at stride 2 floats: the 1-split grad-input epilogue took longer
// than 5 of its 32 k tiles.) Epilogues: + bias (+ ReLU, keeping a NaN, as
// gemm.cu), or times the ReLU mask (row-major, ldm), or none.
constexpr int STAGE_LD = BN + 8;  // floats per staged row: the fragment writes are free of bank conflicts
constexpr int PER_ROW = BN / 4;   // 16-byte pieces per row: a warp takes one row
constexpr int MAX_ROUNDS = BM * PER_ROW / THREADS;

__device__ __forceinline__ bool aligned16(const void* p, int ld) {
    return ld % 4 == 0 && (reinterpret_cast<unsigned long long>(p) & 15u) == 0;
}

// Accumulator q = 4 j + 2 h + e to stage row 64 wg + 16 warp + g + 8 h, column 8 j + 2 t + e.
__device__ __forceinline__ void stage_tile(const float (&acc)[ACC], float* stage) {
    const int tid = threadIdx.x, wg = tid / 128, lane = tid % 32, warp = (tid % 128) / 32;
    float* row0 = stage + (64 * wg + 16 * warp + lane / 4) * STAGE_LD + 2 * (lane % 4);
#pragma unroll
    for (int j = 0; j < ACC / 4; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h)
            *reinterpret_cast<float2*>(row0 + 8 * h * STAGE_LD + 8 * j) =
                make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
}

// The 4 bias values of this thread's columns in store_rows (the same in every round),
// zeros for the epilogues without a bias. The forward loads them before its k loop,
// so that the epilogue does not wait for them.
template <int EPI>
__device__ __forceinline__ float4 epilogue_bias(const float* bias, int N) {
    const int c = blockIdx.x * BN + 4 * ((int)threadIdx.x % PER_ROW);
    float bv[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) bv[e] = (EPI == EPI_BIAS || EPI == EPI_BIAS_RELU) && c + e < N ? bias[c + e] : 0.0f;
    return make_float4(bv[0], bv[1], bv[2], bv[3]);
}

// The rounds store_rows takes for rows [row_begin, row_end) of the tile, NT threads a round.
template <int NT = THREADS>
__device__ __forceinline__ int row_rounds(int row_begin, int row_end) {
    return ((row_end - row_begin) * PER_ROW + NT - 1) / NT;
}

// The tile row this thread takes in round `it` of store_rows over rows from row_begin on
// (PER_ROW threads a row, NT a round); mask_group loads the mask of the same rows.
template <int NT = THREADS>
__device__ __forceinline__ int round_row(int row_begin, int it) {
    return row_begin + ((int)threadIdx.x + NT * it) / PER_ROW;
}

// The ReLU mask of rounds g .. g + GROUP - 1 of store_rows over rows [row_begin,
// row_end) (the range store_rows then takes; an empty one loads nothing): this
// thread's 4 columns, zeros past the rounds, the rows or the columns. 16-byte loads
// where the mask's alignment allows them, whatever C's.
template <int EPI, int GROUP, int NT = THREADS>
__device__ __forceinline__ void mask_group(const float* mask, int ldm, int row_begin, int row_end, int g, int M,
                                           int N, float4 (&mv)[GROUP]) {
    const int tid = threadIdx.x, i0 = blockIdx.y * BM, c = blockIdx.x * BN + 4 * (tid % PER_ROW);
    const int rounds = row_rounds<NT>(row_begin, row_end);
    const bool vec = aligned16(mask, ldm) && c + 3 < N;
#pragma unroll
    for (int u = 0; u < GROUP; ++u) {
        const int row = round_row<NT>(row_begin, g + u), r = i0 + row;
        float m[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (EPI == EPI_MASK && g + u < rounds && row < row_end && r < M && c < N) {
            if (vec) *reinterpret_cast<float4*>(m) = *reinterpret_cast<const float4*>(mask + (size_t)r * ldm + c);
            else
#pragma unroll
                for (int e = 0; e < 4; ++e) m[e] = c + e < N ? mask[(size_t)r * ldm + c + e] : 0.0f;
        }
        mv[u] = *reinterpret_cast<const float4*>(m);
    }
}

// Rows [row_begin, row_end) of the tile through the epilogue into C; value(row, c4)
// gives the 4 sums at columns 4 c4 .. 4 c4 + 3 of a staged row, bias4 the bias of
// those columns (epilogue_bias), and `ahead` the mask of the first group of rounds
// (mask_group, loaded by the caller before its barriers; store_rows then loads each
// next group's into it).
// The rounds go in groups of GROUP: the group's values are loaded first, then
// stored, so a warp waits for its loads once a group rather than once a round (4 for
// a staged tile, one shared load a round; 2 where each value sums the partials of a
// cluster, up to 8 loads a round). The mask comes from global memory, one group
// ahead of the values, so that its loads overlap the group before. The loop over the
// groups stays rolled. A block runs this code once, after its k loop, so every
// instruction is fetched cold. Fully unrolled (16 rounds, up to 8 summed partials
// each, vector and scalar stores) it was half of the grad-input kernel's 100 KB of
// code and took 11.5 us of the wide dX in the large step, against 5.3 rolled; the
// step gained 4 us (docs/perf-notes.md, thirteenth pass).
template <int EPI, int GROUP, class Value, int NT = THREADS>
__device__ __forceinline__ void store_rows(int row_begin, int row_end, const Value& value, float* C, int ldc, int M,
                                           int N, float4 bias4, const float* mask, int ldm, float4 (&ahead)[GROUP]) {
    const int tid = threadIdx.x, i0 = blockIdx.y * BM, j0 = blockIdx.x * BN;
    const bool vec = aligned16(C, ldc);
    const int c4 = tid % PER_ROW, c = j0 + 4 * c4;  // the same columns in every round
    const int rounds = row_rounds<NT>(row_begin, row_end);
    const float bv[4] = {bias4.x, bias4.y, bias4.z, bias4.w};
    static_assert(MAX_ROUNDS % GROUP == 0, "whole groups of rounds");
#pragma unroll 1
    for (int g = 0; g < rounds; g += GROUP) {
        float4 mv[GROUP], v[GROUP];
#pragma unroll
        for (int u = 0; u < GROUP; ++u) mv[u] = EPI == EPI_MASK ? ahead[u] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (EPI == EPI_MASK) mask_group<EPI, GROUP, NT>(mask, ldm, row_begin, row_end, g + GROUP, M, N, ahead);
#pragma unroll
        for (int u = 0; u < GROUP; ++u) {
            const int row = round_row<NT>(row_begin, g + u);
            v[u] = g + u < rounds && row < row_end && i0 + row < M && c < N ? value(row, c4)
                                                                            : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
#pragma unroll
        for (int u = 0; u < GROUP; ++u) {
            const int it = g + u, row = round_row<NT>(row_begin, it), r = i0 + row;
            if (it >= rounds || row >= row_end || r >= M || c >= N) continue;
            float y[4], m[4];
            *reinterpret_cast<float4*>(y) = v[u];
            *reinterpret_cast<float4*>(m) = mv[u];
#pragma unroll
            for (int e = 0; e < 4; ++e) {  // dt_epilogue's maths (epilogue.cuh), written out: as a call it compiles differently
                if (EPI == EPI_BIAS || EPI == EPI_BIAS_RELU) y[e] += bv[e];
                if (EPI == EPI_BIAS_RELU) y[e] = y[e] < 0.0f ? 0.0f : y[e] + 0.0f;
                if (EPI == EPI_MASK && !(m[e] > 0.0f)) y[e] = 0.0f;
            }
            if (vec && c + 3 < N) {
                *reinterpret_cast<float4*>(C + (size_t)r * ldc + c) = *reinterpret_cast<const float4*>(y);
            } else {
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (c + e < N) C[(size_t)r * ldc + c + e] = y[e];
            }
        }
    }
}

// The end of every kernel here: the S = gridDim.z splits of the tile summed in z
// order, then the epilogue into C, and with `sums` (thread tid < 128 holding row
// tid's sum) the row sums into col_sum. `stage` at shared::cta address
// `stage_addr` holds the 128 x STAGE_LD staged tile and then 128 row sums.
//  - Launched in clusters of the S blocks of a tile ((1, 1, S): what the host
//    launches when all the product's clusters fit at once, Plan.cluster): each block stages its partial tile in its own shared
//    memory, and after a cluster barrier block z sums rows z R .. z R + R - 1
//    (R = ceil(128 / S)) of all S partials over distributed shared memory and
//    stores them. No partials in global memory, no counters, and the tail is
//    spread over the S blocks.
//  - Otherwise (S > 1 without clusters, or S == 1): through `workspace` and
//    `counters` (reduce_splits), the last block to arrive storing the tile.
// Both add the same values in the same order: the same bits.
// A block of BLOCK > THREADS threads calls it with all of them: the first THREADS
// hold the accumulators and stage them; in a cluster, without a mask, all BLOCK threads
// then take the rounds of the sum (fewer rounds a thread: the rounds, not the remote
// loads' round trips, are most of this epilogue, docs/perf-notes.md, sixtieth pass);
// otherwise the others only meet the barriers.
template <int EPI, int BLOCK = THREADS>
__device__ __forceinline__ void finish_tile(float (&acc)[ACC], float row_sum, bool sums, float* stage,
                                            unsigned int stage_addr, float* C, int ldc, int M, int N,
                                            float4 bias4, const float* mask, int ldm, float* col_sum,
                                            float* workspace, unsigned int* counters) {
    const int tid = threadIdx.x, splits = gridDim.z, z = blockIdx.z, i0 = blockIdx.y * BM;
    const bool active = BLOCK == THREADS || tid < THREADS;
    if (splits > 1 && dt_cluster_blocks() == (unsigned int)splits) {
        if (splits > DT_PORTABLE_CLUSTER) __trap();  // base[] below holds that many
        // The first group's mask, in flight across the staging. (The cluster barrier's
        // release is a memory barrier in the machine code, which may wait for it.)
        // Threads that store nothing take an empty range.
        // This block's rows of the sum: rows row_begin .. row_end - 1 of the tile.
        const int rows = (BM + splits - 1) / splits, row_begin = min(BM, z * rows), row_end = min(BM, row_begin + rows);
        float4 ahead[2];
        // The threads that take the rounds of the sum: all of the block's without a mask
        // (dW in 2 splits: 6 rounds a thread instead of 8), only the first THREADS with one
        // (dX in 3 splits: all 384 made its rounds slower; docs/perf-notes.md, sixtieth pass).
        constexpr int RT = EPI == EPI_MASK ? THREADS : BLOCK;
        const bool in_rounds = RT == BLOCK || active;
        if (EPI == EPI_MASK)
            mask_group<EPI, 2, RT>(mask, ldm, row_begin, in_rounds ? row_end : row_begin, 0, M, N, ahead);
        __syncthreads();  // the other warpgroup's MMAs and any earlier use of the stage are over
        if (active) stage_tile(acc, stage);
        if (sums && tid < BM) stage[BM * STAGE_LD + tid] = row_sum;
        dt_cluster_barrier();  // every block's partial is staged
        unsigned int base[DT_PORTABLE_CLUSTER];  // every split's stage, as this block addresses it
#pragma unroll
        for (int s = 0; s < DT_PORTABLE_CLUSTER; ++s) base[s] = s < splits ? dt_cluster_address(stage_addr, s) : 0u;
        const auto sum = [&](int row, int c4) {
            float4 p[DT_PORTABLE_CLUSTER];
            const unsigned int at = 4u * (row * STAGE_LD + 4 * c4);
#pragma unroll
            for (int s = 0; s < DT_PORTABLE_CLUSTER; ++s)
                if (s < splits) p[s] = dt_cluster_load4(base[s] + at);
            float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
            for (int s = 0; s < DT_PORTABLE_CLUSTER; ++s)
                if (s < splits) v.x += p[s].x, v.y += p[s].y, v.z += p[s].z, v.w += p[s].w;
            return v;
        };
        if (in_rounds)
            store_rows<EPI, 2, decltype(sum), RT>(row_begin, row_end, sum, C, ldc, M, N, bias4, mask, ldm, ahead);
        if (sums && tid >= row_begin && tid < row_end && i0 + tid < M) {
            float v = 0.0f;
#pragma unroll
            for (int s = 0; s < DT_PORTABLE_CLUSTER; ++s)
                if (s < splits) v += dt_cluster_load(base[s] + 4u * (BM * STAGE_LD + tid));
            col_sum[i0 + tid] = v;
        }
        // No block leaves while another still reads its shared memory. The arrival is
        // relaxed (dt_cluster_arrive_relaxed says when that is safe): every 16-byte value
        // this thread loaded from the cluster is stored, at least in part, before it in
        // program order, so its reads are over; a release would also wait for its stores
        // into C to drain (MEMBAR.ALL.GPU, 630 to 710 clocks a block; docs/perf-notes.md,
        // sixty-second pass).
        dt_cluster_arrive_relaxed();
        dt_cluster_wait();
        return;
    }
    float r = row_sum;
    if (splits > 1 && !reduce_splits<BLOCK>(acc, workspace, counters, sums, r)) return;
    if (sums && tid < BM && i0 + tid < M) col_sum[i0 + tid] = r;
    float4 ahead[4];  // the first group's mask, in flight across the barriers (threads that store nothing: none)
    if (EPI == EPI_MASK) mask_group<EPI, 4>(mask, ldm, 0, active ? BM : 0, 0, M, N, ahead);
    __syncthreads();
    if (active) stage_tile(acc, stage);
    __syncthreads();
    const auto staged = [&](int row, int c4) { return *reinterpret_cast<const float4*>(stage + row * STAGE_LD + 4 * c4); };
    if (active) store_rows<EPI, 4>(0, BM, staged, C, ldc, M, N, bias4, mask, ldm, ahead);
}

// What every kernel here starts with: its dynamic shared memory (at least `need`
// bytes, else a trap: launched without it) from the first 1024-byte boundary (the
// swizzle atom) on, and this block's share of the k range: whole BK-deep tiles,
// split evenly over gridDim.z.
struct Setup {
    char* raw;                 // the dynamic shared memory as declared
    unsigned int raw0, smem0;  // its shared address, and the aligned start
    int kb, ke, tiles;         // this split's k range and its k tiles

    __device__ __forceinline__ Setup(char* smem_raw, unsigned int need, int K) : raw(smem_raw) {
        if (dt_dynamic_shared_bytes() < need) __trap();
        raw0 = (unsigned int)__cvta_generic_to_shared(smem_raw);
        smem0 = (raw0 + 1023u) & ~1023u;
        const int k_tiles = (K + BK - 1) / BK, per = (k_tiles + gridDim.z - 1) / gridDim.z;
        kb = min(K, (int)blockIdx.z * per * BK), ke = min(K, kb + per * BK);
        tiles = (ke - kb + BK - 1) / BK;
    }

    // The aligned start as a generic pointer.
    __device__ __forceinline__ float* stage() const { return reinterpret_cast<float*>(raw + (smem0 - raw0)); }
};

// ---------------------------------------------------------------- the output layer in the epilogue
// linear_forward_relu_head_wgmma_tf32 runs a hidden layer's forward (unsplit) and then
// the output layer after it, Q = H W2^T + b2 with H = relu(X W^T + b), from the block's
// accumulators: its 128 columns of H are the depths of one share of Q's product. Each
// block adds its share for its 128 rows (an m64n24k8 wgmma per 8 deep, A from the
// accumulators' registers, B = W2's matching columns in shared memory) and leaves it
// in `work`; the last block of the row tile to arrive (dt_last_block) adds the shares
// in column-tile order, then b2, and stores Q's rows. Launched with the row tile's
// column tiles as one cluster ((gridDim.x, 1, 1), at most 8), the shares meet in
// distributed shared memory instead (head_cluster_finish), in the same order. H holds
// the plain kernel's values, stored from the head's fragments (head_store), unless C is
// null (the kernel's header). The depth order of the shares is the output layer's own
// forward's in 8 clustered splits of a 1024-wide H, so the sums keep that kernel's structure; within
// 8 deep the MMA takes its products in another order (head_loads); on the H200 the
// bits came out the same as that kernel's (the tests check it where the shares are
// the same), and they are the same from run to run.
struct Head {
    const float* w;  // W2 [n, N], rows ldw floats apart
    int ldw;
    const float* bias;       // b2 [n]
    float* q;                // Q [M, n], rows ldq floats apart
    int ldq, n;              // n <= HEAD_N
    float* work;             // gridDim.y x gridDim.x x THREADS x HEAD_ACC floats
    unsigned int* counters;  // gridDim.y, zeroed (and left zeroed)
};

constexpr int HEAD_N = 24;             // the widest output layer: the MMA's n
constexpr int HEAD_ACC = HEAD_N / 2;   // a thread's accumulators of an m64n24 wgmma
constexpr unsigned int HEAD_TILE_BYTES = HEAD_N * BK * 4;     // W2's slice, one k tile: 24 rows of 128 bytes
constexpr unsigned int HEAD_AT = STAGES * STAGE_FLOATS * 4;   // after the pipeline's stages (1024-byte aligned)
constexpr unsigned int HEAD_BIAS_AT = HEAD_AT + (BN / BK) * HEAD_TILE_BYTES;  // then b's 128 columns
constexpr unsigned int HEAD_SHARE_AT = HEAD_BIAS_AT + BN * 4;  // then the share, [BM][HEAD_N], in a cluster
constexpr unsigned int HEAD_SHARED_BYTES = HEAD_SHARE_AT + BM * HEAD_N * 4 + 1024;
static_assert(HEAD_AT >= BM * STAGE_LD * 4, "the staged tile and the head's operands do not overlap");

// d += A B for one 64 x 24 x 8 step, A from registers (wgmma_m64n128k8_ra's fragment).
__device__ __forceinline__ void wgmma_m64n24k8_ra(float (&d)[HEAD_ACC], const unsigned int (&a)[4],
                                                  unsigned long long b) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n24k8.f32.tf32.tf32 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11}, {%12, %13, %14, %15}, %16, p, 1, 1;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// W2's columns j0 .. j0 + 127 (this block's columns of H) into shared memory at `at` as
// the B operand of the head's MMAs, and b's same columns after them (HEAD_BIAS_AT):
// k tile q holds columns 32 q .. 32 q + 31 of W2 as 24 rows (its outputs, zeros past n)
// in the 128-byte swizzle, the columns of each 8 deep in the order 0 2 4 6 1 3 5 7,
// the order in which a thread's accumulators give them to A (head_partial). 4-byte
// copies, zeros past N; one commit group.
__device__ __forceinline__ void head_loads(const Head& h, unsigned int at, const float* bias, int N) {
    const int tid = threadIdx.x, j0 = blockIdx.x * BN;
#pragma unroll
    for (int i = 0; i < HEAD_N * BN / THREADS; ++i) {
        const int e = tid + THREADS * i, o = e / BN, d = e % BN;  // output o, depth d as the MMA takes it
        const int q = d / BK, w = d % BK, l = w % 8;
        const int col = q * BK + w - l + (l < 4 ? 2 * l : 2 * l - 7);
        const bool ok = o < h.n && j0 + col < N;
        dt_cp_async4(at + q * HEAD_TILE_BYTES + 128 * o + 16 * ((w / 4) ^ (o % 8)) + 4 * (w % 4),
                     ok ? h.w + (size_t)o * h.ldw + j0 + col : h.w, ok ? 4 : 0);
    }
    if (tid < BN) {
        const bool ok = j0 + tid < N;
        dt_cp_async4(at + (BN / BK) * HEAD_TILE_BYTES + 4 * tid, ok ? bias + j0 + tid : bias, ok ? 4 : 0);
    }
    dt_cp_async_commit();
}

// This block's share of Q for its warpgroup's 64 rows: d = relu(acc + b) W2_slice^T.
// Accumulators 4 j + e (row r, column 8 j + 2 t + e) and 4 j + 2 + e (row r + 8) are
// A's fragment of depth step j with depths 2 t and 2 t + 1 taken as t and t + 4, which
// head_loads' order matches. The fragments are all computed before the first MMA
// and read again only after the wait for the last (the MMAs read them asynchronously).
// Those fragments are H's values (finish_tile's bias and ReLU, in the same order: the
// same bits); they are left in `a` for head_store.
__device__ __forceinline__ void head_partial(const float (&acc)[ACC], unsigned int at, const float* bias_s,
                                             float (&d)[HEAD_ACC], unsigned int (&a)[BN / 8][4]) {
    const int t = threadIdx.x % 4;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
        const float b0 = bias_s[8 * j + 2 * t], b1 = bias_s[8 * j + 2 * t + 1];
        const float x[4] = {acc[4 * j] + b0, acc[4 * j + 2] + b0, acc[4 * j + 1] + b1, acc[4 * j + 3] + b1};
#pragma unroll
        for (int u = 0; u < 4; ++u) a[j][u] = __float_as_uint(x[u] < 0.0f ? 0.0f : x[u] + 0.0f);  // the epilogue's ReLU
        asm volatile("" : "+r"(a[j][0]), "+r"(a[j][1]), "+r"(a[j][2]), "+r"(a[j][3])::"memory");
    }
#pragma unroll
    for (int q = 0; q < HEAD_ACC; ++q) {
        d[q] = 0.0f;
        asm volatile("" : "+f"(d[q])::"memory");  // zeroed before the fence, not sunk past it
    }
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
        wgmma_m64n24k8_ra(d, a[j], descriptor(at + (j / 4) * HEAD_TILE_BYTES + (j % 4) * 32));
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
        asm volatile("" : "+r"(a[j][0]), "+r"(a[j][1]), "+r"(a[j][2]), "+r"(a[j][3])::"memory");
#pragma unroll
    for (int q = 0; q < HEAD_ACC; ++q) asm volatile("" : "+f"(d[q])::"memory");
}

// H's tile into C from head_partial's fragments, with no staging and no block barrier
// (in the large DQN step's forward that stores H, finish_tile's staging and stores took
// 1.8 us, 8-byte stores from the fragments 1.3: docs/perf-notes.md, sixty-fifth pass).
// Where C's rows allow 16-byte stores (C 16-byte aligned, ldc a multiple of 4), the
// threads t and t ^ 1 of a row (lane % 4 = t) swap one pair of columns of each two
// neighbouring column groups j, j + 1 (8 columns each; thread t holds columns 2 t and
// 2 t + 1 of each): an even t then holds columns 4 (t / 2) .. 4 (t / 2) + 3 of group j,
// an odd t the same of group j + 1, and a warp's store covers 8 rows of 64 bytes. Else
// each thread stores its two neighbouring columns as one 8-byte store where C allows it
// (8 rows of 32 bytes a warp's store), else one at a time.
__device__ __forceinline__ void head_store(const unsigned int (&a)[BN / 8][4], float* C, int ldc, int M, int N) {
    const int tid = threadIdx.x, t = tid % 4;
    const int r = blockIdx.y * BM + 64 * (tid / 128) + 16 * ((tid % 128) / 32) + (tid % 32) / 4;
    if (aligned16(C, ldc)) {  // grid-uniform
        const bool odd = t & 1;
        const int c0 = blockIdx.x * BN + 8 * (t & 1) + 4 * (t / 2);
#pragma unroll
        for (int j = 0; j < BN / 8; j += 2)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {  // a[j][hh]: row r + 8 hh, column 2 t; a[j][2 + hh]: column 2 t + 1
                const unsigned int e0 = a[j][hh], e1 = a[j][2 + hh], o0 = a[j + 1][hh], o1 = a[j + 1][2 + hh];
                const float k0 = __uint_as_float(odd ? o0 : e0), k1 = __uint_as_float(odd ? o1 : e1);
                const float g0 = __shfl_xor_sync(0xffffffffu, __uint_as_float(odd ? e0 : o0), 1);
                const float g1 = __shfl_xor_sync(0xffffffffu, __uint_as_float(odd ? e1 : o1), 1);
                const float4 v = odd ? make_float4(g0, g1, k0, k1) : make_float4(k0, k1, g0, g1);
                const int row = r + 8 * hh, c = c0 + 8 * j;
                if (row >= M || c >= N) continue;
                float* const out = C + (size_t)row * ldc + c;
                if (c + 3 < N) {
                    *reinterpret_cast<float4*>(out) = v;
                } else {  // the row's last four columns, part filled
                    out[0] = v.x;
                    if (c + 1 < N) out[1] = v.y;
                    if (c + 2 < N) out[2] = v.z;
                }
            }
        return;
    }
    const int c0 = blockIdx.x * BN + 2 * t;
    const bool pairs = dt_pairs_fit(C, ldc);
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {  // a[j][hh]: row r + 8 hh, column c; a[j][2 + hh]: column c + 1
            const int row = r + 8 * hh, c = c0 + 8 * j;
            if (row >= M || c >= N) continue;
            dt_store_pair(C + (size_t)row * ldc + c, __uint_as_float(a[j][hh]), __uint_as_float(a[j][2 + hh]), c, N,
                          pairs);
        }
}

// The row tile's last block: Q's rows = the column tiles' shares added in order, + b2.
// A thread's share values sit at the same offsets in every column tile's share.
__device__ __forceinline__ void head_finish(const Head& h, int M) {
    const int tid = threadIdx.x, wg = tid / 128, warp = (tid % 128) / 32, lane = tid % 32;
    const int tiles = gridDim.x;
    const float* part = h.work + ((size_t)blockIdx.y * tiles * THREADS + tid) * HEAD_ACC;
    float s[HEAD_ACC];
#pragma unroll
    for (int q = 0; q < HEAD_ACC; ++q) s[q] = 0.0f;
    for (int x0 = 0; x0 < tiles; x0 += 4) {  // 4 column tiles' loads in flight at once
        float4 v[4][HEAD_ACC / 4];
#pragma unroll
        for (int u = 0; u < 4; ++u)
#pragma unroll
            for (int c = 0; c < HEAD_ACC / 4; ++c)
                v[u][c] = x0 + u < tiles
                              ? __ldcg(reinterpret_cast<const float4*>(part + (size_t)(x0 + u) * THREADS * HEAD_ACC) + c)
                              : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
        for (int u = 0; u < 4; ++u)
            if (x0 + u < tiles)
#pragma unroll
                for (int c = 0; c < HEAD_ACC / 4; ++c)
                    s[4 * c] += v[u][c].x, s[4 * c + 1] += v[u][c].y, s[4 * c + 2] += v[u][c].z,
                                s[4 * c + 3] += v[u][c].w;
    }
    const int r = blockIdx.y * BM + 64 * wg + 16 * warp + lane / 4;
#pragma unroll
    for (int q = 0; q < HEAD_ACC; ++q) {  // accumulator q = 4 j + 2 hh + e: row r + 8 hh, output 8 j + 2 t + e
        const int row = r + 8 * ((q / 2) % 2), o = 8 * (q / 4) + 2 * (lane % 4) + q % 2;
        if (row < M && o < h.n) h.q[(size_t)row * h.ldq + o] = s[q] + h.bias[o];
    }
}

// The same sums when the row tile's column tiles run as one cluster ((gridDim.x, 1, 1)):
// every block's share sits in its shared memory at `share` ([BM][HEAD_N], staged before
// the cluster's arrival), and block x adds rows x R .. x R + R - 1 (R = ceil(BM /
// gridDim.x)) over the cluster's blocks in rank (column tile) order: head_finish's order,
// so the same bits, with no workspace, counters or global arrival.
__device__ __forceinline__ void head_cluster_finish(const Head& h, int M, unsigned int share) {
    const int tiles = gridDim.x, rows = (BM + tiles - 1) / tiles, r0 = (int)dt_cluster_rank() * rows;
    const int i0 = blockIdx.y * BM;
    unsigned int base[DT_PORTABLE_CLUSTER];  // every block's share, as this block addresses it
#pragma unroll
    for (int x = 0; x < DT_PORTABLE_CLUSTER; ++x) base[x] = x < tiles ? dt_cluster_address(share, x) : 0u;
    for (int i = threadIdx.x; i < rows * HEAD_N; i += THREADS) {
        const int row = r0 + i / HEAD_N, o = i % HEAD_N;
        if (row >= BM || o >= h.n || i0 + row >= M) continue;
        float v = 0.0f;
#pragma unroll
        for (int x = 0; x < DT_PORTABLE_CLUSTER; ++x)
            if (x < tiles) v += dt_cluster_load(base[x] + 4u * (row * HEAD_N + o));
        h.q[(size_t)(i0 + row) * h.ldq + o] = v + h.bias[o];
    }
}

// The operand tiles arrive by TMA: thread 0 issues tile kt's two copies (A's 128
// rows, then B's, each 128 x 32 floats in the 128-byte swizzle, which is the MMA
// layout above) on the stage's mbarrier, which completes when their bytes have
// landed. Depths past K and rows past M or N arrive as zeros from the maps; a
// split's range is whole k tiles but for the last split's end, so no tile reads
// another split's depths.
// HEAD: the output layer after it (Head above), for an unsplit launch only.
template <int EPI, bool HEAD = false>
__device__ __forceinline__ void forward(const DtTensorMap* ta, const DtTensorMap* tb, float* C, int ldc, int M,
                                        int N, int K, const float* bias, float* workspace, unsigned int* counters,
                                        const Head& head = Head{}) {
    extern __shared__ __align__(128) char smem_raw[];
    __shared__ __align__(8) unsigned long long landed[STAGES];
    const Setup su(smem_raw, HEAD ? HEAD_SHARED_BYTES : SHARED_BYTES, K);
    const unsigned int smem0 = su.smem0, bars = (unsigned int)__cvta_generic_to_shared(landed);
    const int kb = su.kb, tiles = su.tiles;
    const int tid = threadIdx.x, wg = tid / 128;
    const int i0 = blockIdx.y * BM, j0 = blockIdx.x * BN;
    const float4 bias4 = epilogue_bias<EPI>(bias, N);  // its wait overlaps the k loop
    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) dt_mbar_init(bars + 8u * s, 1);
        dt_mbar_init_fence();
    }
    __syncthreads();
    if constexpr (HEAD)
        if (gridDim.z != 1 || head.n < 1 || head.n > HEAD_N) __trap();  // whole columns of H, at most HEAD_N outputs
    // The row tile's column tiles as one cluster (the host's choice, LinearKernels.plan_head):
    // the shares meet in distributed shared memory instead of the workspace.
    const bool clustered = HEAD && gridDim.x > 1 && dt_cluster_blocks() == gridDim.x;
    if (clustered && gridDim.x > DT_PORTABLE_CLUSTER) __trap();
    // The head kernel with no C serves a forward whose caller reads only Q: X (the hidden
    // output before) is read here for the last time, so its lines go first from L2.
    const bool x_last_read = HEAD && C == nullptr;
    const unsigned long long x_policy = x_last_read && tid == 0 ? dt_l2_evict_first_policy() : 0ull;
    const auto load = [&](int kt) {  // thread 0 only
        const int slot = kt % STAGES;
        const unsigned int tile = smem0 + slot * STAGE_FLOATS * 4, bar = bars + 8u * slot;
        dt_mbar_arrive_expect(bar, STAGE_FLOATS * 4);
        if (x_last_read) dt_tma_load_2d_evict_first(tile, ta, kb + kt * BK, i0, bar, x_policy);
        else dt_tma_load_2d(tile, ta, kb + kt * BK, i0, bar);
        dt_tma_load_2d(tile + TILE_FLOATS * 4, tb, kb + kt * BK, j0, bar);
    };
    if (tid == 0)
        for (int s = 0; s < LEAD && s < tiles; ++s) load(s);
    // The head's operands after thread 0's copies: head_loads is about 450 instructions a
    // thread, which before them held the first copies back by 0.65 us (docs/perf-notes.md,
    // sixty-fifth pass).
    if constexpr (HEAD) head_loads(head, smem0 + HEAD_AT, bias, N);
    float acc[ACC];
#pragma unroll
    for (int q = 0; q < ACC; ++q) acc[q] = 0.0f;
    for (int kt = 0; kt < tiles; ++kt) {
        const int slot = kt % STAGES;
        dt_mbar_wait(bars + 8u * slot, (unsigned int)(kt / STAGES) & 1u);  // tile kt has landed
        // Both warpgroups' MMAs of tile kt - 2 are done (the wait at the end of the
        // last iteration left only tile kt - 1's in flight), so the slot of tile
        // kt + LEAD (that of kt - 2) is free for its copies.
        __syncthreads();
        if (tid == 0 && kt + LEAD < tiles) load(kt + LEAD);
        const unsigned int a_tile = smem0 + slot * STAGE_FLOATS * 4 + wg * 64 * 128;  // this warpgroup's 64 rows
        const unsigned int b_tile = smem0 + (slot * STAGE_FLOATS + TILE_FLOATS) * 4;
        fence_accumulators(acc);
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
        for (int kk = 0; kk < BK / 8; ++kk)  // 8 deep: 32 bytes further along each row
            wgmma_m64n128k8(acc, descriptor(a_tile + kk * 32), descriptor(b_tile + kk * 32));
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");  // tile kt's MMAs may still run
        fence_accumulators(acc);
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    fence_accumulators(acc);
    dt_allow_dependents();
    if constexpr (HEAD) {  // this block's share of Q, out before H's stores
        dt_cp_async_wait<0>();
        dt_fence_proxy_async();  // cp.async wrote W2's slice through the generic proxy; the MMAs read the async one
        __syncthreads();
        float d[HEAD_ACC];
        unsigned int hv[BN / 8][4];  // H's values, as head_partial's fragments hold them
        head_partial(acc, smem0 + HEAD_AT, su.stage() + HEAD_BIAS_AT / 4, d, hv);
        if (clustered) {  // staged for the cluster, announced; H's stores run before the wait
            float* share = su.stage() + HEAD_SHARE_AT / 4;
            const int r = 64 * wg + 16 * ((tid % 128) / 32) + (tid % 32) / 4, t = tid % 4;
#pragma unroll
            for (int q = 0; q < HEAD_ACC; q += 2)  // accumulator q = 4 j + 2 hh + e: row r + 8 hh, output 8 j + 2 t + e
                *reinterpret_cast<float2*>(share + (r + 8 * ((q / 2) % 2)) * HEAD_N + 8 * (q / 4) + 2 * t) =
                    make_float2(d[q], d[q + 1]);
            dt_cluster_arrive();
        } else {
            float4* mine = reinterpret_cast<float4*>(
                head.work + ((size_t)(blockIdx.y * gridDim.x + blockIdx.x) * THREADS + tid) * HEAD_ACC);
#pragma unroll
            for (int c = 0; c < HEAD_ACC / 4; ++c)
                mine[c] = make_float4(d[4 * c], d[4 * c + 1], d[4 * c + 2], d[4 * c + 3]);
        }
        if (C != nullptr) head_store(hv, C, ldc, M, N);  // the head kernel with no C: its caller reads Q alone
    }
    if constexpr (!HEAD)
        finish_tile<EPI>(acc, 0.0f, false, su.stage(), smem0, C, ldc, M, N, bias4,
                         nullptr, 0, nullptr, workspace, counters);
    if constexpr (HEAD) {
        if (clustered) {
            dt_cluster_wait();  // every block's share is staged
            head_cluster_finish(head, M, smem0 + HEAD_SHARE_AT);
            dt_cluster_arrive_relaxed();  // no block leaves while another still reads its share: the
            dt_cluster_wait();            // loads' values are stored before it (as in finish_tile)
        } else if (dt_last_block(head.counters + blockIdx.y, gridDim.x)) {
            head_finish(head, M);
        }
    }
}

// ---------------------------------------------------------------- 3xTF32 backward
// TF32 wgmma reads K-major operands only, and the backward's operands are not all
// K-major: dX = (dY W) * mask reads A = dY k-fast and B = W row-fast, dW = dY^T X
// (with db) reads A = dY and B = X both row-fast. The products split every operand
// into big and small TF32 parts (tf32.cuh) as they go: 3 MMAs per 8 deep.
// A block is three warpgroups. The two consumers (threads 0-255, laid out as the
// forward's) each copy their own 64 rows of A with cp.async (three tiles ahead,
// four stages), read their MMA fragments from those raw tiles, split them in
// registers, and issue the MMAs with A from registers. The producer (threads
// 256-383) loads B as it lies from L2 into registers (two tiles ahead) and stores it
// split into big and small parts in the swizzled K-major layout the MMAs read
// (above), transposing it. Neither A's parts nor B's raw tiles touch shared memory.
// That matters because shared memory's traffic holds much of the loop: with A split in
// shared memory too, a k tile moved 272 KB through it and took 1.59 us (dX on the
// H200, about 90 bytes a clock), against 0.85 us for the MMAs alone; A from registers
// left 192 KB and took 1.30 (docs/perf-notes.md, twelfth pass). B through registers
// leaves about 160 KB and took 4 to 8 % off the k loops (fifty-ninth pass): the bytes
// are not the loop's only bound. At 168 registers at entry (all 384 threads run the
// epilogue at that budget) ptxas 13.0 spills nothing.

__device__ __forceinline__ float4 lds4(unsigned int addr) {
    float4 v;
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(addr));
    return v;
}

// Splits 4 depths of one row and stores the parts at byte `at` of the big and small tiles.
__device__ __forceinline__ void store_split(unsigned int big, unsigned int small, unsigned int at, float x0, float x1,
                                            float x2, float x3) {
    unsigned int b0, b1, b2, b3, s0, s1, s2, s3;
    dt_tf32_split<true>(x0, b0, s0);
    dt_tf32_split<true>(x1, b1, s1);
    dt_tf32_split<true>(x2, b2, s2);
    dt_tf32_split<true>(x3, b3, s3);
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(big + at), "r"(b0), "r"(b1), "r"(b2), "r"(b3)
                 : "memory");
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(small + at), "r"(s0), "r"(s1), "r"(s2), "r"(s3)
                 : "memory");
}

// The producer's share of B (B(k, j) = B[j + k ld]): thread t of a 256-thread layout
// (the producer thread p runs t = p and t = p + 128) takes a 4 x 4 block of each k
// tile, columns 4 rg .. 4 rg + 3 at depths 4 kg .. 4 kg + 3 with rg = 8 (warp % 4) +
// lane / 4 and kg = 4 (warp / 4) + lane % 4 (warp = t / 32, lane = t % 32). It loads
// the block from L2 straight into registers (four 16-byte loads, ld.global.cg: a
// warp's load takes 128 contiguous bytes of each of four depths), then splits it and
// stores it transposed, one 16-byte chunk a column, into the big and small MMA tiles
// (every 8 consecutive lanes, one wavefront of a 16-byte store, touch 8 different
// chunk positions of the swizzle). Through registers, B's raw tile never touches
// shared memory: a copy into it and the conversion's reads from it were 32 KB of a k
// tile's shared-memory traffic.
struct ProducerB {
    const float* src;  // depth 4 kg, column 4 rg of the split's first k tile
    int ld, cols;      // cols: the matrix's columns from 4 rg on, unclamped (<= 0: none of the 4, >= 4: all)
    int rg, kg;

    __device__ __forceinline__ ProducerB(const float* B, int ldb, int col0, int n, int k_begin, int t) : ld(ldb) {
        const int warp = t / 32, lane = t % 32;
        rg = 8 * (warp % 4) + lane / 4;
        kg = 4 * (warp / 4) + lane % 4;
        cols = n - (col0 + 4 * rg);
        src = B + (long long)(k_begin + 4 * kg) * ldb + (cols > 0 ? col0 + 4 * rg : 0);
    }

    // The block of the k tile at depth k; zeros at depths at or past k_end and at
    // columns past the matrix. (cols stays unclamped: from max(0, min(4, ...)) and a
    // test for 4, ptxas 13.0 made one predicate that sent whole blocks down the partial
    // path, which loads no w; the first tile's depth 4 kg lost its fourth column.)
    __device__ __forceinline__ void load(float4 (&x)[4], int k, int k_begin, int k_end) const {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float* p = src + (long long)(k - k_begin + e) * ld;
            x[e] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (k + 4 * kg + e >= k_end || cols <= 0) continue;
            if (cols >= 4) {
                x[e] = __ldcg(reinterpret_cast<const float4*>(p));
            } else {
                x[e].x = __ldcg(p);
                if (cols > 1) x[e].y = __ldcg(p + 1);
                if (cols > 2) x[e].z = __ldcg(p + 2);
            }
        }
    }

    // The block split into the big and small MMA tiles at shared byte addresses big, small.
    __device__ __forceinline__ void store(unsigned int big, unsigned int small, const float4 (&x)[4]) const {
#pragma unroll
        for (int h = 0; h < 4; ++h) {
            const int r = 4 * rg + h;
            const unsigned int at = 128u * r + 16u * (kg ^ (r & 7));
            if (h == 0) store_split(big, small, at, x[0].x, x[1].x, x[2].x, x[3].x);
            if (h == 1) store_split(big, small, at, x[0].y, x[1].y, x[2].y, x[3].y);
            if (h == 2) store_split(big, small, at, x[0].z, x[1].z, x[2].z, x[3].z);
            if (h == 3) store_split(big, small, at, x[0].w, x[1].w, x[2].w, x[3].w);
        }
    }
};

// Shared memory of the backward: two sets of B's MMA tiles (big, small; 32 KB a
// set) and each consumer's four raw stages of its 64 rows of A (8 KB each): 129 KB.
constexpr unsigned int TILE_BYTES = TILE_FLOATS * 4;
constexpr int A_STAGES = 4, A_LEAD = 3;  // a consumer's A copies: tile kt + 3 goes where tile kt - 1 was
constexpr unsigned int A_STAGE_BYTES = 64 * BK * 4;
constexpr unsigned int SET_BYTES = 2 * TILE_BYTES;
constexpr unsigned int BACKWARD_SHARED_BYTES =
    2 * SET_BYTES + 2 * A_STAGES * A_STAGE_BYTES + 1024;
constexpr int BACKWARD_THREADS = THREADS + 128;
static_assert(BACKWARD_THREADS == DT_BACKWARD_THREADS, "the kernels' launch bounds");
// Registers: 384 threads start with 168 each (the epilogue's budget, which every
// thread runs); in the k loop the consumers take 200 and the producer keeps 104
// (2 x 128 x 200 + 128 x 104 = 384 x 168).
constexpr int START_REGISTERS = 168, CONSUMER_REGISTERS = 200, PRODUCER_REGISTERS = 104;
static_assert(2 * 128 * CONSUMER_REGISTERS + 128 * PRODUCER_REGISTERS <= BACKWARD_THREADS * START_REGISTERS,
              "the register file");
// Named barriers (0 is __syncthreads): each consumer's own, set s read (BAR_EMPTY + s),
// set s converted for consumer warpgroup wg (BAR_FULL + 2 s + wg), and the consumers'
// turns at issuing a tile's MMAs (BAR_TURN + wg: wg's turn).
constexpr int BAR_CONSUMER = 2, BAR_EMPTY = 4, BAR_FULL = 6, BAR_TURN = 10;

__device__ __forceinline__ void named_sync(int id, int count) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int count) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// d (+)= A B for one 64 x 128 x 8 step with A from registers: this thread's
// fragment a[0..3] = A(16 warp + g, t), A(16 warp + g + 8, t), A(16 warp + g, t + 4),
// A(16 warp + g + 8, t + 4) (g = lane / 4, t = lane % 4, warp within the warpgroup).
template <int ACCUMULATE = 1>
__device__ __forceinline__ void wgmma_m64n128k8_ra(float (&d)[ACC], const unsigned int (&a)[4],
                                                   unsigned long long b) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %69, 0;\n"  // scale-d
        "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 "
        DT_WGMMA_D ", "
        "{%64, %65, %66, %67}, %68, p, 1, 1;\n"
        "}\n"
        : DT_WGMMA_D_OPERANDS(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(ACCUMULATE));
}

// A consumer thread's copies of its warpgroup's 64 rows of an A k tile (A_STAGE_BYTES)
// and its MMA fragments from them. ct: the thread within the warpgroup; g = lane / 4,
// t = lane % 4, r = 16 warp + g: the fragment holds rows r and r + 8 at depths
// 8 kk + t and 8 kk + t + 4 (wgmma_m64n128k8_ra).
template <bool KFAST>
struct ConsumerA;

// k-fast A(i, k) = A[i lda + k]: the MMA layout, 128-byte rows, the 16-byte chunk c
// of row r at 128 r + 16 (c ^ r % 8). Piece q = ct + 128 i (i < 4) is row ct / 8 +
// 16 i, chunk ct % 8. The fragment's reads are free of bank conflicts: the 4 lanes
// of a g read one chunk, the 8 values of g (= r % 8) eight chunk positions.
template <>
struct ConsumerA<true> {
    const float* src;   // piece 0 in the split's first k tile; piece i is 16 i rows on
    const float* base;  // a valid address for the zero-filling copies
    long long step;     // 16 rows
    unsigned int dst;   // piece 0's byte offset; piece i is 2048 i further
    unsigned int frag;  // the fragment's row r at depth t
    int row_ok, depth, g;

    __device__ __forceinline__ ConsumerA(const float* A, int lda, int row0, int rows, int k_begin, int ct) {
        const int row = ct / 8, chunk = ct % 8, lane = ct % 32;
        depth = 4 * chunk;
        dst = 128u * row + 16u * (chunk ^ (row & 7));
        row_ok = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) row_ok |= (row0 + row + 16 * i < rows) << i;
        base = A;
        step = 16ll * lda;
        src = A + (long long)(row0 + row < rows ? row0 + row : 0) * lda + k_begin + depth;
        g = lane / 4;
        frag = 128u * (16 * (ct / 32) + g) + 4u * (lane % 4);
    }

    // Queue the copies of the k tile at depth k into the tile at shared byte
    // address `tile`; depths at or past k_end and rows past the matrix are zero-filled.
    __device__ __forceinline__ void load(unsigned int tile, int k, int k_begin, int k_end) const {
        const int bytes = 4 * max(0, min(4, k_end - k - depth));
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int b = (row_ok >> i & 1) ? bytes : 0;
            dt_cp_async16(tile + dst + 2048u * i, b ? src + i * step + (k - k_begin) : base, b);
        }
    }

    // x = A(r, 8 kk + t), A(r + 8, 8 kk + t), A(r, 8 kk + t + 4), A(r + 8, 8 kk + t + 4).
    __device__ __forceinline__ void fragment(unsigned int tile, int kk, float (&x)[4]) const {
        const unsigned int lo = tile + frag + 16u * ((2 * kk) ^ g), hi = tile + frag + 16u * ((2 * kk + 1) ^ g);
        asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(x[0]) : "r"(lo));
        asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(x[1]) : "r"(lo + 8u * 128u));
        asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(x[2]) : "r"(hi));
        asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(x[3]) : "r"(hi + 8u * 128u));
    }
};

// row-fast A(i, k) = A[i + k lda]: 32 lines of 64 rows (256 bytes) per k tile, the
// 16-byte chunk c (rows 4 c .. 4 c + 3) of line d at 256 d + 16 (c ^ 2 (d % 4)).
// Piece q = ct + 128 i (i < 4) is line ct / 16 + 8 i, chunk ct % 16: a warp writes
// two whole lines. The fragment's depths 8 kk + t (+ 4) all have d % 4 = t, so a
// thread's chunk positions are fixed: (r / 4) ^ 2 t and (r / 4 + 2) ^ 2 t, which over
// a warp's lanes (r / 4 = 4 warp + g / 4) are eight different positions mod 8 for
// each of the four r % 4: free of bank conflicts.
template <>
struct ConsumerA<false> {
    const float* src;  // piece 0 in the split's first k tile; piece i is 8 i lines on
    const float* base;
    int ld;
    unsigned int dst;  // piece 0's byte offset; piece i is 2048 i further
    unsigned int frag0, frag1;  // rows r and r + 8 at depth t
    int valid, line;

    __device__ __forceinline__ ConsumerA(const float* A, int lda, int row0, int rows, int k_begin, int ct) {
        const int chunk = ct % 16, lane = ct % 32, g = lane / 4, t = lane % 4, r = 16 * (ct / 32) + g;
        line = ct / 16;
        dst = 256u * line + 16u * (chunk ^ (2 * (line % 4)));
        valid = 4 * max(0, min(4, rows - (row0 + 4 * chunk)));
        base = A;
        ld = lda;
        src = A + (long long)(k_begin + line) * lda + (valid ? row0 + 4 * chunk : 0);
        frag0 = 256u * t + 16u * ((r / 4) ^ (2 * t)) + 4u * (r % 4);
        frag1 = 256u * t + 16u * ((r / 4 + 2) ^ (2 * t)) + 4u * (r % 4);
    }

    __device__ __forceinline__ void load(unsigned int tile, int k, int k_begin, int k_end) const {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int b = k + line + 8 * i < k_end ? valid : 0;
            dt_cp_async16(tile + dst + 2048u * i, b ? src + (long long)(k - k_begin + 8 * i) * ld : base, b);
        }
    }

    __device__ __forceinline__ void fragment(unsigned int tile, int kk, float (&x)[4]) const {
        const unsigned int at = tile + 2048u * kk;  // 8 lines a kk
        asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(x[0]) : "r"(at + frag0));
        asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(x[1]) : "r"(at + frag1));
        asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(x[2]) : "r"(at + frag0 + 1024u));
        asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(x[3]) : "r"(at + frag1 + 1024u));
    }
};

// C = A B in 3xTF32 with the epilogue EPI, A in the layout A_KFAST names and B
// row-fast (gemm.cu's header). `sums` (grad-weight, grid column 0): row sums of A
// (db) as well, from the consumers' fragments: each thread adds its values of rows r
// and r + 8 per k tile in kk order (depth t, then t + 4), and the four threads of a
// row then add theirs by a fixed butterfly.
template <bool A_KFAST, int EPI>
__device__ __forceinline__ void backward(const float* A, int lda, const float* B, int ldb, float* C, int ldc,
                                         int M, int N, int K, const float* mask, int ldm, float* col_sum,
                                         float* workspace, unsigned int* counters) {
    extern __shared__ __align__(128) char smem_raw[];
    const Setup su(smem_raw, BACKWARD_SHARED_BYTES, K);
    const unsigned int smem0 = su.smem0, a_raw0 = smem0 + 2 * SET_BYTES;
    const int kb = su.kb, ke = su.ke, tiles = su.tiles;
    const int tid = threadIdx.x, wg = tid / 128;
    const int i0 = blockIdx.y * BM, j0 = blockIdx.x * BN;
    const bool sums = EPI == EPI_NONE && col_sum != nullptr && blockIdx.x == 0;
    float rs[2] = {0.0f, 0.0f};  // a consumer's row sums (db) of rows r and r + 8
    // The consumers' accumulators; the producer never sets them (finish_tile
    // reads only the consumers'), so they take none of its registers.
    float acc[ACC];

    if (wg < 2) {  // a consumer warpgroup: its 64 rows of the tile
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER_REGISTERS));
#pragma unroll
        for (int q = 0; q < ACC; ++q) acc[q] = 0.0f;
        const int ct = tid % 128;
        const ConsumerA<A_KFAST> pa(A, lda, i0 + 64 * wg, M, kb, ct);
        const unsigned int a_raw = a_raw0 + wg * A_STAGES * A_STAGE_BYTES;
        const auto copy = [&](int kt) {  // this warpgroup's rows of tile kt; one commit group either way
            if (kt < tiles) pa.load(a_raw + (kt % A_STAGES) * A_STAGE_BYTES, kb + kt * BK, kb, ke);
            dt_cp_async_commit();
        };
#pragma unroll
        for (int s = 0; s < A_LEAD; ++s) copy(s);
        if (wg == 1 && tiles > 0) named_arrive(BAR_TURN, 256);  // the first warpgroup's first turn
        float part[ACC];
        for (int kt = 0; kt < tiles; ++kt) {
            dt_cp_async_wait<A_LEAD - 1>();      // this thread's copies of tile kt
            named_sync(BAR_CONSUMER + wg, 128);  // everyone's; and everyone has read tile kt - 1
            copy(kt + A_LEAD);
            const unsigned int at = a_raw + (kt % A_STAGES) * A_STAGE_BYTES;
            unsigned int big[BK / 8][4], small[BK / 8][4];
#pragma unroll
            for (int kk = 0; kk < BK / 8; ++kk) {
                float x[4];
                pa.fragment(at, kk, x);
                if (!A_KFAST && sums) rs[0] += x[0], rs[0] += x[2], rs[1] += x[1], rs[1] += x[3];
#pragma unroll
                for (int e = 0; e < 4; ++e) dt_tf32_split<true>(x[e], big[kk][e], small[kk][e]);
            }
            const unsigned int set = smem0 + (kt & 1) * SET_BYTES;
            const unsigned int b_big = set, b_small = set + TILE_BYTES;
            named_sync(BAR_FULL + 2 * (kt & 1) + wg, 256);  // set kt % 2 holds B's tile kt
            // The warpgroups take turns at issuing a tile's MMAs, the first one first, so
            // that the tensor cores run one's MMAs while the other waits for its own, adds
            // them up and splits its next fragments: the two no longer stop together.
            named_sync(BAR_TURN + wg, 256);
            fence_accumulators(part);
            asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
            for (int kk = 0; kk < BK / 8; ++kk) {  // per 8 deep, small terms first: rounding would lose them
                if (kk == 0) wgmma_m64n128k8_ra<0>(part, small[0], descriptor(b_big));
                else wgmma_m64n128k8_ra(part, small[kk], descriptor(b_big + kk * 32));
                wgmma_m64n128k8_ra(part, big[kk], descriptor(b_small + kk * 32));
                wgmma_m64n128k8_ra(part, big[kk], descriptor(b_big + kk * 32));
            }
            asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
            if (wg == 0 || kt + 1 < tiles) named_arrive(BAR_TURN + (1 - wg), 256);  // the other's turn
            asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
            fence_accumulators(part);
            if (kt + 2 < tiles) named_arrive(BAR_EMPTY + (kt & 1), BACKWARD_THREADS);  // the producer's tile kt + 2
#pragma unroll
            for (int q = 0; q < ACC; ++q) acc[q] += part[q];
        }
        dt_cp_async_wait<0>();  // the empty groups
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(START_REGISTERS));
    } else {  // the producer warpgroup: B, as threads t and t + 128 of ProducerB's layout
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER_REGISTERS));
        const int t0 = tid - 2 * 128;
        const ProducerB pb0(B, ldb, j0, N, kb, t0), pb1(B, ldb, j0, N, kb, t0 + 128);
        // Tiles kt and kt + 1 in registers, x[kt % 2]: each tile's loads are issued two
        // tiles ahead of its conversion, as the copies into shared memory were, so that
        // they land while the producer waits for the consumers.
        float4 x[2][2][4];
        const auto load = [&](float4 (&y)[2][4], int kt) {
            if (kt < tiles) pb0.load(y[0], kb + kt * BK, kb, ke), pb1.load(y[1], kb + kt * BK, kb, ke);
        };
        const auto convert = [&](const float4 (&y)[2][4], int kt) {
            if (kt >= 2) named_sync(BAR_EMPTY + (kt & 1), BACKWARD_THREADS);  // the consumers finished tile kt - 2
            const unsigned int big = smem0 + (kt & 1) * SET_BYTES, small = big + TILE_BYTES;
            pb0.store(big, small, y[0]);
            pb1.store(big, small, y[1]);
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // the stores before the MMAs' reads
            named_arrive(BAR_FULL + 2 * (kt & 1), 256);  // for each consumer warpgroup
            named_arrive(BAR_FULL + 2 * (kt & 1) + 1, 256);
        };
        load(x[0], 0);
        load(x[1], 1);
        for (int kt = 0; kt < tiles; kt += 2) {  // two tiles a pass: the registers are named at compile time
            convert(x[0], kt);
            load(x[0], kt + 2);
            if (kt + 1 < tiles) {
                convert(x[1], kt + 1);
                load(x[1], kt + 3);
            }
        }
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(START_REGISTERS));
    }
    dt_allow_dependents();

    // db: the four threads of a row (t = 0..3) add their sums by a butterfly, and
    // t = 0 stages row 64 wg + r's for thread 64 wg + r of finish_tile. The stage
    // overlaps the sets and (its last 4.5 KB) consumer 0's first A stage: the first
    // barrier waits for every warpgroup's last MMAs, and each consumer thread has
    // waited for its own copies (dt_cp_async_wait<0> above) before it.
    float row_sum = 0.0f;
    if (!A_KFAST && sums) {
        float* red = su.stage();
        __syncthreads();
        if (wg < 2) {
            const int lane = tid % 32;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                rs[h] += __shfl_xor_sync(0xffffffffu, rs[h], 1);
                rs[h] += __shfl_xor_sync(0xffffffffu, rs[h], 2);
            }
            const int row = 64 * wg + 16 * ((tid % 128) / 32) + lane / 4;
            if (lane % 4 == 0) red[row] = rs[0], red[row + 8] = rs[1];
        }
        __syncthreads();
        if (tid < BM) row_sum = red[tid];
    }
    finish_tile<EPI, BACKWARD_THREADS>(acc, row_sum, sums, su.stage(), smem0, C, ldc, M, N,
                                       make_float4(0.0f, 0.0f, 0.0f, 0.0f), mask, ldm, col_sum, workspace, counters);
}

}  // namespace
#endif

// The forward's own signature: X [M, K] and W [N, K] as tensor maps of 128 x 32
// float boxes in the 128-byte swizzle over exactly K columns (the fill past K is the
// zeros the last k tile needs; drvtrain.nn.mlp encodes them), then gemm.cu's
// arguments less the operands and the backward's epilogue inputs. With S > 1 splits,
// launched in clusters (1, 1, S) the kernels need no workspace or counters
// (finish_tile); launched without, workspace holds gridDim.x * gridDim.y * S * 128 *
// 128 floats and counters one zeroed uint per tile. Dynamic shared memory:
// SHARED_BYTES (161 KB). Thread 0 fetches the maps before waiting for the prior grid:
// they are the launch's own.
#define DT_WGMMA_FORWARD(NAME, EPI)                                                                          \
    extern "C" __global__ void __launch_bounds__(256) NAME(                                                  \
            const __grid_constant__ DtTensorMap A, const __grid_constant__ DtTensorMap B, float* C, int ldc, \
            int M, int N, int K, const float* bias, float* workspace, unsigned int* counters,                \
            const int* gate) {                                                                               \
        if (threadIdx.x == 0) {                                                                              \
            dt_tma_prefetch_map(&A);                                                                         \
            dt_tma_prefetch_map(&B);                                                                         \
        }                                                                                                    \
        dt_wait_prior_grid();                                                                                \
        if (gate != nullptr && *gate) return;                                                                \
        DT_WGMMA_BODY(EPI);                                                                                  \
    }

#if DT_WGMMA
#define DT_WGMMA_BODY(EPI) forward<EPI>(&A, &B, C, ldc, M, N, K, bias, workspace, counters)
#else
#define DT_WGMMA_BODY(EPI) __trap()
#endif

DT_WGMMA_FORWARD(linear_forward_wgmma_tf32, EPI_BIAS)
DT_WGMMA_FORWARD(linear_forward_relu_wgmma_tf32, EPI_BIAS_RELU)

// The forward with ReLU and the output layer after it (Head, at forward() above):
// the forward's arguments, then W2, ldw2, b2, Q, ldq, n (at most HEAD_N), work and
// counters (both unused when launched in clusters of a row tile's column tiles).
// C may be null: H is then not stored (a forward whose caller reads only Q), and X's
// copies carry the evict-first L2 hint (no later kernel reads X).
// Unsplit only (a split launch traps). Dynamic shared memory: HEAD_SHARED_BYTES (185.5 KB).
extern "C" __global__ void __launch_bounds__(256) linear_forward_relu_head_wgmma_tf32(
        const __grid_constant__ DtTensorMap A, const __grid_constant__ DtTensorMap B, float* C, int ldc, int M, int N,
        int K, const float* bias, float* workspace, unsigned int* counters, const int* gate, const float* w2,
        int ldw2, const float* b2, float* q, int ldq, int n, float* work, unsigned int* head_counters) {
    if (threadIdx.x == 0) {
        dt_tma_prefetch_map(&A);
        dt_tma_prefetch_map(&B);
    }
    dt_wait_prior_grid();
    if (gate != nullptr && *gate) return;
#if DT_WGMMA
    forward<EPI_BIAS_RELU, true>(&A, &B, C, ldc, M, N, K, bias, workspace, counters,
                                 Head{w2, ldw2, b2, q, ldq, n, work, head_counters});
#else
    __trap();
#endif
}

// The backward products in 3xTF32, gemm.cu's signature and contract again (bias
// unused): dX = (dY W) * (X > 0) with A = dY k-fast, B = W row-fast, and dW = dY^T X
// with db = sum_m dY into col_sum (grid column 0), A = dY row-fast, B = X row-fast.
// Split as the forward; a launch without clusters needs gridDim.y * S * 128 more
// workspace floats for the row sums. Block: DT_BACKWARD_THREADS (384). Dynamic
// shared memory: BACKWARD_SHARED_BYTES (129 KB).
#define DT_WGMMA_BACKWARD(NAME, A_KFAST, B_KFAST, EPI, BLOCK)                                                \
    extern "C" __global__ void __launch_bounds__(BLOCK, 1) NAME(                                             \
            const float* A, int lda, const float* B, int ldb, float* C, int ldc, int M, int N, int K,        \
            const float* bias, const float* mask, int ldm, float* col_sum, float* workspace,                 \
            unsigned int* counters, const int* gate) {                                                      \
        dt_wait_prior_grid();                                                                                \
        if (gate != nullptr && *gate) return;                                                                \
        (void)bias;                                                                                          \
        DT_WGMMA_BACKWARD_BODY(A_KFAST, B_KFAST, EPI);                                                       \
    }

#if DT_WGMMA
#define DT_WGMMA_BACKWARD_BODY(A_KFAST, B_KFAST, EPI)                                                       \
    backward<A_KFAST, EPI>(A, lda, B, ldb, C, ldc, M, N, K, mask, ldm, col_sum, workspace, counters)
#else
#define DT_WGMMA_BACKWARD_BODY(A_KFAST, B_KFAST, EPI) __trap()
#endif

DT_WGMMA_BACKWARD(linear_grad_input_wgmma_3xtf32, true, false, EPI_MASK, DT_BACKWARD_THREADS)
DT_WGMMA_BACKWARD(linear_grad_weight_wgmma_3xtf32, false, false, EPI_NONE, DT_BACKWARD_THREADS)

// ---------------------------------------------------------------- pre-split 3xTF32 backward
// The backward above splits every operand tile into TF32 big and small parts in each
// block that reads it: the 8 column blocks of dX all split the same dY tiles, and every
// row-fast operand is transposed on the way. When the operands are split once instead,
// into K-major big and small matrices in global memory (tf32_split, a pass that can run
// beside other work), a product needs no conversion at all: four TMA copies a k tile
// and the same MMAs as backward(), in the same order, so the same bits for dX. The host
// (drvtrain.nn.mlp) chooses this path for the wide products and places the passes.

// TF32 parts stored as clean TF32 values: dt_tf32_split's parts with the 13 low bits
// the tensor cores ignore cleared, so the tensor cores read the same operands from
// them as from the parts split in a tile (the same bits for dX), and big + small in
// FP32 is within 2^-23 |x| (tf32.cuh); a NaN x gives a NaN small, an infinite x an
// infinite big and a NaN small. So the pre-split dW's bias sum, which adds big +
// small, is NaN for an infinite dY where the tile kernels' sum of the values is
// infinite: non-finite either way.
__device__ __forceinline__ void clean_split(float x, unsigned int& big, unsigned int& small) {
    dt_tf32_split<true>(x, big, small);
    big &= 0xffffe000u, small &= 0xffffe000u;
}

// The TF32 parts of X (rows x cols, rows ld floats apart): with `big` and `small`, as X
// lies (row r, column c at r ld_out + c); with `big_t` and `small_t`, transposed
// (column c, row r at c ld_t + r). Either pair may be null. Block 256, grid
// (ceil(cols / 32), ceil(rows / 32)): a block's 32 x 32 tile goes through shared memory
// so that both stores are coalesced, each warp taking every 8th row. Padding past cols
// (or rows, transposed) is not written.
extern "C" __global__ void __launch_bounds__(256) tf32_split(const float* X, int ld, int rows, int cols,
                                                             unsigned int* big, unsigned int* small, int ld_out,
                                                             unsigned int* big_t, unsigned int* small_t, int ld_t,
                                                             const int* gate) {
    __shared__ float tile[32][33];
    dt_wait_prior_grid();
    if (gate != nullptr && *gate) return;
    dt_allow_dependents();
    const int r0 = blockIdx.y * 32, c0 = blockIdx.x * 32, tx = threadIdx.x % 32, ty = threadIdx.x / 32;
    for (int i = ty; i < 32; i += 8) {
        const int r = r0 + i, c = c0 + tx;
        const bool in = r < rows && c < cols;
        const float x = in ? X[(long long)r * ld + c] : 0.0f;
        tile[i][tx] = x;
        if (big != nullptr && in) {
            unsigned int b, s;
            clean_split(x, b, s);
            big[(long long)r * ld_out + c] = b, small[(long long)r * ld_out + c] = s;
        }
    }
    if (big_t == nullptr) return;
    __syncthreads();
    for (int i = ty; i < 32; i += 8) {
        const int c = c0 + i, r = r0 + tx;
        if (c < cols && r < rows) {
            unsigned int b, s;
            clean_split(tile[tx][i], b, s);
            big_t[(long long)c * ld_t + r] = b, small_t[(long long)c * ld_t + r] = s;
        }
    }
}

#if DT_WGMMA
namespace {

// Three stages of a k tile's four operand tiles (A big, A small, B big, B small: 64 KB
// a stage), all three copied ahead; 193 KB with the alignment.
constexpr int PRESPLIT_STAGES = 3;
constexpr unsigned int PRESPLIT_STAGE_BYTES = 4 * TILE_BYTES;
constexpr unsigned int PRESPLIT_SHARED_BYTES = PRESPLIT_STAGES * PRESPLIT_STAGE_BYTES + 1024;
// The k tiles a split may have: the loop below is unrolled to this bound (ptxas
// serializes wgmma whose accumulators stay in flight across a loop's back edge), and
// drvtrain.nn.mlp plans the splits to keep under it (PRESPLIT_MAX_TILES there).
constexpr int PRESPLIT_MAX_TILES = 16;

// C = A B^T in 3xTF32 from the split operands (A [M, K] and B [N, K], K-major, each
// as big and small maps), with the epilogue EPI. Tile kt's 12 MMAs a warpgroup go into
// fragment kt % 2 (the order and the fresh fragment of backward()); while they run, the
// fragment of tile kt - 1 is waited for and added to the accumulators (k order kept),
// and a barrier hands its stage back for tile kt + 2. `sums` (grad-weight, grid column
// 0): row sums of A (db) from big + small, each thread summing half a row of each tile
// while the tile's MMAs run, in k order.
template <int EPI>
__device__ __forceinline__ void presplit(const DtTensorMap* ab, const DtTensorMap* as, const DtTensorMap* bb,
                                         const DtTensorMap* bs, float* C, int ldc, int M, int N, int K,
                                         const float* mask, int ldm, float* col_sum, float* workspace,
                                         unsigned int* counters) {
    extern __shared__ __align__(128) char smem_raw[];
    __shared__ __align__(8) unsigned long long landed[PRESPLIT_STAGES];
    const Setup su(smem_raw, PRESPLIT_SHARED_BYTES, K);
    if (su.tiles > PRESPLIT_MAX_TILES) __trap();  // the host plans more splits
    const unsigned int smem0 = su.smem0, bars = (unsigned int)__cvta_generic_to_shared(landed);
    const int kb = su.kb, tiles = su.tiles;
    const int tid = threadIdx.x, wg = tid / 128;
    const int i0 = blockIdx.y * BM, j0 = blockIdx.x * BN;
    const bool sums = EPI == EPI_NONE && col_sum != nullptr && blockIdx.x == 0;
    if (tid == 0) {
        for (int s = 0; s < PRESPLIT_STAGES; ++s) dt_mbar_init(bars + 8u * s, 1);
        dt_mbar_init_fence();
    }
    __syncthreads();
    const auto load = [&](int kt) {  // thread 0 only
        const int slot = kt % PRESPLIT_STAGES;
        const unsigned int t = smem0 + slot * PRESPLIT_STAGE_BYTES, bar = bars + 8u * slot;
        dt_mbar_arrive_expect(bar, PRESPLIT_STAGE_BYTES);
        const int k = kb + kt * BK;
        dt_tma_load_2d(t, ab, k, i0, bar);
        dt_tma_load_2d(t + TILE_BYTES, as, k, i0, bar);
        dt_tma_load_2d(t + 2 * TILE_BYTES, bb, k, j0, bar);
        dt_tma_load_2d(t + 3 * TILE_BYTES, bs, k, j0, bar);
    };
    if (tid == 0)
        for (int s = 0; s < PRESPLIT_STAGES && s < tiles; ++s) load(s);
    float acc[ACC], part0[ACC], part1[ACC], row_part = 0.0f;
#pragma unroll
    for (int q = 0; q < ACC; ++q) acc[q] = 0.0f;
    const int sum_row = tid / 2, sum_half = tid % 2;
    const auto issue = [&](int kt, float (&part)[ACC]) {
        const int slot = kt % PRESPLIT_STAGES;
        dt_mbar_wait(bars + 8u * slot, (unsigned int)(kt / PRESPLIT_STAGES) & 1u);
        const unsigned int t = smem0 + slot * PRESPLIT_STAGE_BYTES;
        const unsigned int a_big = t + wg * 64 * 128, a_small = a_big + TILE_BYTES;  // this warpgroup's 64 rows
        const unsigned int b_big = t + 2 * TILE_BYTES, b_small = t + 3 * TILE_BYTES;
        fence_accumulators(part);
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
        for (int kk = 0; kk < BK / 8; ++kk) {  // per 8 deep, small terms first, as backward()
            if (kk == 0) wgmma_m64n128k8<0>(part, descriptor(a_small), descriptor(b_big));
            else wgmma_m64n128k8(part, descriptor(a_small + kk * 32), descriptor(b_big + kk * 32));
            wgmma_m64n128k8(part, descriptor(a_big + kk * 32), descriptor(b_small + kk * 32));
            wgmma_m64n128k8(part, descriptor(a_big + kk * 32), descriptor(b_big + kk * 32));
        }
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        if (sums) {  // chunks 4 h .. 4 h + 3 of row r, in depth order
#pragma unroll
            for (int c = 4 * sum_half; c < 4 * sum_half + 4; ++c) {
                const unsigned int at = 128u * sum_row + 16u * (c ^ (sum_row & 7));
                const float4 b = lds4(t + at), s = lds4(t + TILE_BYTES + at);
                row_part += b.x + s.x, row_part += b.y + s.y, row_part += b.z + s.z, row_part += b.w + s.w;
            }
        }
    };
    const auto retire = [&](int kt, float (&part)[ACC], bool last) {
        if (last) asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        else asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
        fence_accumulators(part);
#pragma unroll
        for (int q = 0; q < ACC; ++q) acc[q] += part[q];
        __syncthreads();  // both warpgroups are done with tile kt's stage
        if (tid == 0 && kt + PRESPLIT_STAGES < tiles) load(kt + PRESPLIT_STAGES);
    };
    if (tiles > 0) issue(0, part0);
#pragma unroll
    for (int kt = 1; kt < PRESPLIT_MAX_TILES; ++kt) {
        if (kt < tiles) {
            if (kt & 1) {
                issue(kt, part1);
                retire(kt - 1, part0, false);
            } else {
                issue(kt, part0);
                retire(kt - 1, part1, false);
            }
        }
    }
    if (tiles > 0) {
        if ((tiles - 1) & 1) retire(tiles - 1, part1, true);
        else retire(tiles - 1, part0, true);
    }
    dt_allow_dependents();
    float row_sum = 0.0f;
    if (sums) {  // the two halves of row tid, in order
        float* red = su.stage();
        red[tid] = row_part;
        __syncthreads();
        if (tid < BM) row_sum = red[2 * tid] + red[2 * tid + 1];
    }
    finish_tile<EPI>(acc, row_sum, sums, su.stage(), smem0, C, ldc, M, N, make_float4(0.0f, 0.0f, 0.0f, 0.0f), mask,
                     ldm, col_sum, workspace, counters);
}

}  // namespace
#endif

// dX = (dY W) * (X > 0) and dW = dY^T X with db = sum_m dY (col_sum, grid column 0)
// from split operands: A's and B's big and small parts as tensor maps of 128 x 32 boxes
// in the 128-byte swizzle over K-major matrices (A [M, K], B [N, K]: dY as it lies and
// W transposed for dX; dY and X transposed for dW), then gemm.cu's contract from C on
// (bias unused, so not passed). Split and launched as the wgmma forward; at most
// PRESPLIT_MAX_TILES k tiles a split (more is a trap). Dynamic shared memory:
// PRESPLIT_SHARED_BYTES (193 KB).
#define DT_WGMMA_PRESPLIT(NAME, EPI)                                                                       \
    extern "C" __global__ void __launch_bounds__(256, 1) NAME(                                             \
            const __grid_constant__ DtTensorMap ab, const __grid_constant__ DtTensorMap as,                 \
            const __grid_constant__ DtTensorMap bb, const __grid_constant__ DtTensorMap bs, float* C,      \
            int ldc, int M, int N, int K, const float* mask, int ldm, float* col_sum, float* workspace,    \
            unsigned int* counters, const int* gate) {                                                     \
        if (threadIdx.x == 0) {                                                                            \
            dt_tma_prefetch_map(&ab);                                                                      \
            dt_tma_prefetch_map(&as);                                                                      \
            dt_tma_prefetch_map(&bb);                                                                      \
            dt_tma_prefetch_map(&bs);                                                                      \
        }                                                                                                  \
        dt_wait_prior_grid();                                                                              \
        if (gate != nullptr && *gate) return;                                                              \
        DT_WGMMA_PRESPLIT_BODY(EPI);                                                                       \
    }

#if DT_WGMMA
#define DT_WGMMA_PRESPLIT_BODY(EPI) \
    presplit<EPI>(&ab, &as, &bb, &bs, C, ldc, M, N, K, mask, ldm, col_sum, workspace, counters)
#else
#define DT_WGMMA_PRESPLIT_BODY(EPI) __trap()
#endif

DT_WGMMA_PRESPLIT(linear_grad_input_wgmma_presplit_3xtf32, EPI_MASK)
DT_WGMMA_PRESPLIT(linear_grad_weight_wgmma_presplit_3xtf32, EPI_NONE)
