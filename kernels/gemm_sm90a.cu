// The linear layer's forward on Hopper's warpgroup MMA (wgmma), for sm_90a only
// (built for any other target, the kernels trap at once):
//
//   linear_forward[_relu]_wgmma_tf32   Y = X W^T + b (+ ReLU), X [M, K] and W [N, K] k-fast
//
// the same contract as gemm.cu's linear_forward[_relu]_<tile>_cp16_tf32 (its
// header: arguments, split-k workspace and counters, the gate, dependent launch),
// with a 128x128 block tile. drvtrain.nn.mlp chooses it for the wide forward
// products on compute capability 9.0 and falls back to gemm.cu's mma.sync
// kernels everywhere else (and when forced).
//
// Block: 256 threads, two warpgroups; warpgroup w owns output rows 64w .. 64w+63
// of the tile and all 128 columns: one wgmma.m64n128k8 per 8 deep, both operands
// read from shared memory through matrix descriptors, FP32 accumulators in
// registers (64 per thread).
// Precision: the tensor cores read FP32 operands and truncate them to TF32 (about
// 8e-4 relative on random data, against 3e-4 for gemm.cu, which rounds to
// nearest; rounding in shared memory measured 3.5 us slower on 512x1024x1024).
// Non-finite operands stay non-finite.
// Pipeline: 4 stages of 32-deep k tiles, copied by cp.async in 16-byte pieces
// (lda, ldb multiples of 4 floats, X and W 16-byte aligned: the host checks) two
// tiles ahead, while one tile's MMAs are in flight and the next tile's are issued.
// Shared layout of one operand tile, 128 rows x 32 deep: 128-byte rows, the
// 16-byte chunk c of row r at 128 r + 16 (c ^ r % 8) (the 128-byte swizzle, in
// 1024-byte atoms of 8 rows): a warp's copies and the MMAs' reads are free of
// bank conflicts. (The unswizzled layout measured 26 us against 17.)
// Determinism: every output is one thread's accumulation in a fixed k order
// (the tensor core's own, fixed per shape) plus a fixed z order over the splits.
#include "common.cuh"
#include "tf32.cuh"

// Built for any other target than sm_90a (a compile-everything check, say) the
// wgmma instructions do not exist: the kernels trap, and the host never loads
// that build.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DT_WGMMA 1
#endif

#if DT_WGMMA
namespace {

constexpr int BM = 128, BN = 128, BK = 32, STAGES = 4, THREADS = 256;
constexpr int TILE_FLOATS = 128 * BK;                 // one operand's k tile
constexpr int STAGE_FLOATS = 2 * TILE_FLOATS;         // A then B
constexpr int PER_THREAD = TILE_FLOATS / 4 / THREADS; // 16-byte pieces per thread and operand tile: 4
constexpr int ACC = BN / 2;                           // accumulators per thread: 64 x 128 / 128
constexpr int LEAD = STAGES - 2;                      // k tiles copied ahead; one more is in the MMAs
// 128 KB of stages, plus 1 KB to align them to the 1024-byte swizzle atom.
constexpr unsigned int SHARED_BYTES = STAGES * STAGE_FLOATS * 4 + 1024;

enum { EPI_NONE = 0, EPI_BIAS = 1, EPI_BIAS_RELU = 2, EPI_MASK = 3 };

__device__ __forceinline__ void cp_async16(unsigned int dst, const float* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}

// A matrix descriptor at shared byte address `addr` for the 128-byte swizzled
// K-major layout: start >> 4 in bits 0-13, leading byte offset (unused by this
// layout, 1 by convention) in 16-29, stride byte offset >> 4 in 32-45 (8-row
// atoms 1024 bytes apart), layout type 1 (128-byte swizzle) in 62-63.
__device__ __forceinline__ unsigned long long descriptor(unsigned int addr) {
    return ((addr >> 4) & 0x3fffull) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}

// d (+)= A B for one 64 x 128 x 8 step; ACCUMULATE = 0 overwrites d (scale-d).
template <int ACCUMULATE = 1>
__device__ __forceinline__ void wgmma_m64n128k8(float (&d)[ACC], unsigned long long a, unsigned long long b) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %66, 0;\n"  // scale-d
        "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, p, 1, 1;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]),
          "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
          "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]),
          "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]),
          "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]),
          "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]),
          "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(a), "l"(b), "n"(ACCUMULATE));
}

// The 16-byte pieces of one operand's k tile this thread copies: piece q = tid +
// 256 i (i < 4) is row q / 8, depth chunk q % 8, at byte 128 row + 16 (chunk ^
// row % 8) of the tile: a warp reads four whole 128-byte rows.
struct Pieces {
    const float* base;             // a valid address for the zero-filling copies
    const float* src[PER_THREAD];  // piece i of this thread in the split's first k tile
    unsigned int dst[PER_THREAD];  // its byte offset within a tile
    int depth[PER_THREAD];         // its depth within a k tile
    int row_ok, k0;                // bit i: the row of piece i is inside the matrix

    __device__ __forceinline__ Pieces(const float* base_, int ld, int row0, int rows, int k_begin)
        : base(base_), k0(k_begin) {
        row_ok = 0;
#pragma unroll
        for (int i = 0; i < PER_THREAD; ++i) {
            const int q = threadIdx.x + THREADS * i, row = q / 8, chunk = q % 8, r = row0 + row;
            dst[i] = 128u * row + 16u * (chunk ^ (row & 7));
            depth[i] = 4 * chunk;
            row_ok |= (r < rows) << i;
            src[i] = base_ + (long long)(r < rows ? r : 0) * ld + k_begin + depth[i];
        }
    }

    // Queue the copies of the k tile starting at depth k into the tile at shared
    // byte address `tile`; depths at or past k_end are zero-filled.
    __device__ __forceinline__ void load(unsigned int tile, int k, int k_end) const {
#pragma unroll
        for (int i = 0; i < PER_THREAD; ++i) {
            const int d = k + depth[i];
            const int bytes = (row_ok >> i & 1) ? 4 * max(0, min(4, k_end - d)) : 0;
            cp_async16(tile + dst[i], bytes ? src[i] + (k - k0) : base, bytes);
        }
    }
};

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
__device__ __forceinline__ bool reduce_splits(float (&acc)[ACC], float* workspace, unsigned int* counters, bool sums,
                                              float& row_sum) {
    const int tid = threadIdx.x, splits = gridDim.z, z = blockIdx.z;
    const unsigned int tile = blockIdx.y * gridDim.x + blockIdx.x;
    float4* parts = reinterpret_cast<float4*>(workspace) + (size_t)tile * splits * (BM * BN / 4);
    float* row_parts =
        workspace + (size_t)gridDim.x * gridDim.y * splits * BM * BN + (size_t)blockIdx.y * splits * BM;
#pragma unroll
    for (int j = 0; j < ACC / 4; ++j)
        parts[(size_t)z * (BM * BN / 4) + j * THREADS + tid] =
            make_float4(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]);
    if (sums && tid < BM) row_parts[z * BM + tid] = row_sum;
    if (!dt_last_block(&counters[tile], splits)) return false;
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

// The block's outputs through the epilogue into C (row-major, ldc): + bias (+ ReLU,
// keeping a NaN, as gemm.cu), or times the ReLU mask (mask row-major, ldm), or as is.
template <int EPI>
__device__ __forceinline__ void store_tile(const float (&acc)[ACC], float* C, int ldc, int M, int N,
                                           const float* bias, const float* mask, int ldm) {
    const int tid = threadIdx.x, wg = tid / 128, lane = tid % 32, warp = (tid % 128) / 32;
    const int g = lane / 4, t = lane % 4;
    const int r0 = blockIdx.y * BM + 64 * wg + 16 * warp + g, j0 = blockIdx.x * BN;
    float bv[ACC / 4][2];
#pragma unroll
    for (int j = 0; j < ACC / 4; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int c = j0 + 8 * j + 2 * t + e;
            bv[j][e] = (EPI == EPI_BIAS || EPI == EPI_BIAS_RELU) && c < N ? bias[c] : 0.0f;
        }
    float mv[EPI == EPI_MASK ? ACC : 1];
    if (EPI == EPI_MASK) {  // every mask load out before the first store
#pragma unroll
        for (int j = 0; j < ACC / 4; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int r = r0 + 8 * h, c = j0 + 8 * j + 2 * t + e;
                    mv[4 * j + 2 * h + e] = r < M && c < N ? mask[(size_t)r * ldm + c] : 0.0f;
                }
    }
#pragma unroll
    for (int j = 0; j < ACC / 4; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int r = r0 + 8 * h, c = j0 + 8 * j + 2 * t + e;
                float y = acc[4 * j + 2 * h + e];
                if (EPI == EPI_BIAS || EPI == EPI_BIAS_RELU) y += bv[j][e];
                if (EPI == EPI_BIAS_RELU) y = y < 0.0f ? 0.0f : y + 0.0f;
                if (EPI == EPI_MASK && !(mv[EPI == EPI_MASK ? 4 * j + 2 * h + e : 0] > 0.0f)) y = 0.0f;
                if (r < M && c < N) C[(size_t)r * ldc + c] = y;
            }
}

template <int EPI>
__device__ __forceinline__ void forward(const float* A, int lda, const float* B, int ldb, float* C, int ldc, int M,
                                        int N, int K, const float* bias, float* workspace, unsigned int* counters) {
    extern __shared__ __align__(128) char smem_raw[];
    unsigned int bytes;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(bytes));
    if (bytes < SHARED_BYTES) __trap();  // launched without the ring's shared memory
    // The stages start on a 1024-byte boundary (the swizzle atom).
    const unsigned int raw0 = (unsigned int)__cvta_generic_to_shared(smem_raw);
    const unsigned int smem0 = (raw0 + 1023u) & ~1023u;

    const int tid = threadIdx.x, wg = tid / 128;
    const int i0 = blockIdx.y * BM, j0 = blockIdx.x * BN;
    const int splits = gridDim.z, z = blockIdx.z;
    const int k_tiles = (K + BK - 1) / BK, per = (k_tiles + splits - 1) / splits;
    const int kb = min(K, z * per * BK), ke = min(K, kb + per * BK);
    const int tiles = (ke - kb + BK - 1) / BK;

    const Pieces pa(A, lda, i0, M, kb), pb(B, ldb, j0, N, kb);
    float acc[ACC];
#pragma unroll
    for (int q = 0; q < ACC; ++q) acc[q] = 0.0f;

    // Every thread commits one copy group per k tile slot, empty or not, so the
    // wait counts stay uniform.
#pragma unroll
    for (int s = 0; s < LEAD; ++s) {
        if (s < tiles) {
            pa.load(smem0 + s * STAGE_FLOATS * 4, kb + s * BK, ke);
            pb.load(smem0 + (s * STAGE_FLOATS + TILE_FLOATS) * 4, kb + s * BK, ke);
        }
        asm volatile("cp.async.commit_group;\n" ::);
    }
    for (int kt = 0; kt < tiles; ++kt) {
        const int slot = kt % STAGES;
        asm volatile("cp.async.wait_group %0;\n" ::"n"(LEAD - 1));  // this thread's copies of tile kt
        // The copies (generic proxy) before the MMAs' reads (async proxy).
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        // Tile kt is complete, and both warpgroups' MMAs of tile kt - 2, whose slot
        // the next copies overwrite, are done (the wait at the end of the last
        // iteration left only tile kt - 1's in flight).
        __syncthreads();
        const int next = kt + LEAD;
        if (next < tiles) {
            const int ns = next % STAGES;
            pa.load(smem0 + ns * STAGE_FLOATS * 4, kb + next * BK, ke);
            pb.load(smem0 + (ns * STAGE_FLOATS + TILE_FLOATS) * 4, kb + next * BK, ke);
        }
        asm volatile("cp.async.commit_group;\n" ::);
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
    asm volatile("cp.async.wait_group 0;\n" ::);
    dt_allow_dependents();

    float no_sums = 0.0f;
    if (splits > 1 && !reduce_splits(acc, workspace, counters, false, no_sums)) return;
    store_tile<EPI>(acc, C, ldc, M, N, bias, nullptr, 0);
}

// ---------------------------------------------------------------- 3xTF32 backward
// One operand's 128 x 32 k tile on its way from global memory through registers
// into shared memory, as the big and small TF32 parts of 3xTF32 (tf32.cuh), each in
// the swizzled K-major layout the MMAs read (above), whatever the global layout:
//   k-fast (X(r, k) = X[r ld + k]): 4 pieces of 4 depths of one row; piece q =
//     tid + 256 i is row q / 8, chunk q % 8 (a warp reads 4 whole 128-byte rows);
//   row-fast (X(r, k) = X[r + k ld]): a 4 x 4 block, rows 4 rg .. 4 rg + 3 at depths
//     4 kg .. 4 kg + 3 (four 16-byte loads), transposed in registers into one
//     chunk per row; rg = 8 (warp % 4) + lane % 8 and kg = 4 (warp / 4) + lane / 8,
//     so a warp's loads are 128-byte lines and its stores fall on all 8 chunk
//     positions of the swizzle (4 wavefronts, the least for 512 bytes).
// Elements outside the matrix (row >= rows, depth >= k_end) load as 0. Whole
// 16-byte loads need ld a multiple of 4 floats and X 16-byte aligned (the host
// checks); a piece that crosses an edge loads element by element.
template <bool KFAST>
struct Operand {
    float v[16];
    const float* base;
    long long ld;
    int row0, rows, k_end;

    __device__ __forceinline__ Operand(const float* base_, int ld_, int row0_, int rows_, int k_end_)
        : base(base_), ld(ld_), row0(row0_), rows(rows_), k_end(k_end_) {}

    // The `valid` (<= 4, may be <= 0) consecutive floats at `offset`, zeros after them.
    __device__ __forceinline__ float4 piece(long long offset, int valid) const {
        if (valid >= 4) return __ldcg(reinterpret_cast<const float4*>(base + offset));
        float4 x = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (valid > 0) x.x = __ldcg(base + offset);
        if (valid > 1) x.y = __ldcg(base + offset + 1);
        if (valid > 2) x.z = __ldcg(base + offset + 2);
        return x;
    }

    // Loads the k tile starting at depth k into v.
    __device__ __forceinline__ void load(int k) {
        const int tid = threadIdx.x;
        if (KFAST) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int q = tid + THREADS * i, r = row0 + q / 8, d = k + 4 * (q % 8);
                const int valid = r < rows ? min(4, k_end - d) : 0;
                const float4 x = piece(valid > 0 ? (long long)r * ld + d : 0, valid);
                v[4 * i] = x.x, v[4 * i + 1] = x.y, v[4 * i + 2] = x.z, v[4 * i + 3] = x.w;
            }
        } else {
            const int warp = tid / 32, lane = tid % 32;
            const int r = row0 + 4 * (8 * (warp % 4) + lane % 8), d0 = k + 4 * (4 * (warp / 4) + lane / 8);
            const int valid_rows = min(4, rows - r);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int valid = d0 + e < k_end ? valid_rows : 0;
                const float4 x = piece(valid > 0 ? (long long)(d0 + e) * ld + r : 0, valid);
                v[4 * e] = x.x, v[4 * e + 1] = x.y, v[4 * e + 2] = x.z, v[4 * e + 3] = x.w;
            }
        }
    }

    // Splits v and stores the parts into the tiles at shared byte addresses big, small.
    __device__ __forceinline__ void store(unsigned int big, unsigned int small) const {
        const int tid = threadIdx.x;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            int row, chunk;
            float x[4];
            if (KFAST) {
                const int q = tid + THREADS * i;
                row = q / 8, chunk = q % 8;
#pragma unroll
                for (int e = 0; e < 4; ++e) x[e] = v[4 * i + e];
            } else {
                const int warp = tid / 32, lane = tid % 32;
                row = 4 * (8 * (warp % 4) + lane % 8) + i, chunk = 4 * (warp / 4) + lane / 8;
#pragma unroll
                for (int e = 0; e < 4; ++e) x[e] = v[4 * e + i];
            }
            unsigned int b[4], s[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) dt_tf32_split<true>(x[e], b[e], s[e]);
            const unsigned int at = 128u * row + 16u * (chunk ^ (row & 7));
            asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(big + at), "r"(b[0]), "r"(b[1]),
                         "r"(b[2]), "r"(b[3]) : "memory");
            asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(small + at), "r"(s[0]), "r"(s[1]),
                         "r"(s[2]), "r"(s[3]) : "memory");
        }
    }

    // Row-fast only: adds this thread's depths of its 4 rows to sums, in depth order.
    __device__ __forceinline__ void add_rows(float (&sums)[4]) const {
#pragma unroll
        for (int e = 0; e < 4; ++e)
#pragma unroll
            for (int c = 0; c < 4; ++c) sums[c] += v[4 * e + c];
    }
};

// C = A B in 3xTF32 with the epilogue EPI: A(i, k) and B(k, j) in the layouts
// A_KFAST, B_KFAST name (gemm.cu's header). Shared memory: two sets of four
// 16 KB tiles (A big, A small, B big, B small), one holding k tile kt for the
// MMAs while the threads fill the other with k tile kt + 1 from registers
// loaded one tile before: the copies overlap the MMAs, and the next loads the
// wait for them. Each k tile's 12 MMAs (small A big B, big A small B, big A big
// B per 8 deep) sum into a fresh fragment (scale-d 0 first) that is added to
// the FP32 accumulators once the group is done: the tensor cores do not round
// their running sums to nearest, so the error would otherwise grow with k.
// `sums` (grad-weight, grid column 0): row sums of A (db) as well.
template <bool A_KFAST, bool B_KFAST, int EPI>
__device__ __forceinline__ void backward(const float* A, int lda, const float* B, int ldb, float* C, int ldc,
                                         int M, int N, int K, const float* mask, int ldm, float* col_sum,
                                         float* workspace, unsigned int* counters) {
    extern __shared__ __align__(128) char smem_raw[];
    unsigned int bytes;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(bytes));
    if (bytes < SHARED_BYTES) __trap();
    const unsigned int raw0 = (unsigned int)__cvta_generic_to_shared(smem_raw);
    const unsigned int smem0 = (raw0 + 1023u) & ~1023u;
    constexpr unsigned int TILE_BYTES = TILE_FLOATS * 4, SET_BYTES = 4 * TILE_BYTES;
    static_assert(2 * SET_BYTES + 1024 <= SHARED_BYTES, "two sets of four tiles");

    const int tid = threadIdx.x, wg = tid / 128;
    const int i0 = blockIdx.y * BM, j0 = blockIdx.x * BN;
    const int splits = gridDim.z, z = blockIdx.z;
    const int k_tiles = (K + BK - 1) / BK, per = (k_tiles + splits - 1) / splits;
    const int kb = min(K, z * per * BK), ke = min(K, kb + per * BK);
    const int tiles = (ke - kb + BK - 1) / BK;
    const bool sums = EPI == EPI_NONE && col_sum != nullptr && blockIdx.x == 0;

    Operand<A_KFAST> oa(A, lda, i0, M, ke);
    Operand<B_KFAST> ob(B, ldb, j0, N, ke);
    float acc[ACC], part[ACC], rows[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int q = 0; q < ACC; ++q) acc[q] = 0.0f;

    if (tiles > 0) {
        oa.load(kb);
        ob.load(kb);
        oa.store(smem0, smem0 + TILE_BYTES);
        ob.store(smem0 + 2 * TILE_BYTES, smem0 + 3 * TILE_BYTES);
        if (!A_KFAST && sums) oa.add_rows(rows);
        if (tiles > 1) {
            oa.load(kb + BK);
            ob.load(kb + BK);
        }
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // the stores before the MMAs' reads
        __syncthreads();
    }
    for (int kt = 0; kt < tiles; ++kt) {
        const unsigned int set = smem0 + (kt & 1) * SET_BYTES;
        const unsigned int a_big = set + wg * 64 * 128, a_small = a_big + TILE_BYTES;  // this warpgroup's 64 rows
        const unsigned int b_big = set + 2 * TILE_BYTES, b_small = set + 3 * TILE_BYTES;
        fence_accumulators(part);
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
        for (int kk = 0; kk < BK / 8; ++kk) {  // small terms first: they are the ones rounding would lose
            if (kk == 0) wgmma_m64n128k8<0>(part, descriptor(a_small), descriptor(b_big));
            else wgmma_m64n128k8(part, descriptor(a_small + kk * 32), descriptor(b_big + kk * 32));
            wgmma_m64n128k8(part, descriptor(a_big + kk * 32), descriptor(b_small + kk * 32));
            wgmma_m64n128k8(part, descriptor(a_big + kk * 32), descriptor(b_big + kk * 32));
        }
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        if (kt + 1 < tiles) {  // the other set: its MMAs (tile kt - 1) are done in both warpgroups
            const unsigned int next = smem0 + ((kt + 1) & 1) * SET_BYTES;
            oa.store(next, next + TILE_BYTES);
            ob.store(next + 2 * TILE_BYTES, next + 3 * TILE_BYTES);
            if (!A_KFAST && sums) oa.add_rows(rows);
            if (kt + 2 < tiles) {
                oa.load(kb + (kt + 2) * BK);
                ob.load(kb + (kt + 2) * BK);
            }
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        }
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        fence_accumulators(part);
#pragma unroll
        for (int q = 0; q < ACC; ++q) acc[q] += part[q];
        // Set kt + 1 is complete, and set kt is free: every warpgroup's MMAs of tile kt are done.
        __syncthreads();
    }
    dt_allow_dependents();

    // db: the 8 threads of each row (one per kg) add their sums in kg order.
    float row_sum = 0.0f;
    if (!A_KFAST && sums) {
        float* red = reinterpret_cast<float*>(smem_raw + (smem0 - raw0));
        const int warp = tid / 32, lane = tid % 32;
        const int rg = 8 * (warp % 4) + lane % 8, kg = 4 * (warp / 4) + lane / 8;
#pragma unroll
        for (int c = 0; c < 4; ++c) red[kg * BM + 4 * rg + c] = rows[c];
        __syncthreads();
        if (tid < BM)
            for (int g = 0; g < 8; ++g) row_sum += red[g * BM + tid];
    }
    if (splits > 1 && !reduce_splits(acc, workspace, counters, sums, row_sum)) return;
    if (sums && tid < BM && i0 + tid < M) col_sum[i0 + tid] = row_sum;
    store_tile<EPI>(acc, C, ldc, M, N, nullptr, mask, ldm);
}

}  // namespace
#endif

// gemm.cu's signature, so the host launches every forward alike; mask, ldm and
// col_sum are unused (0). workspace: gridDim.x * gridDim.y * S * 128 * 128 floats
// when S > 1. Dynamic shared memory: SHARED_BYTES (129 KB).
#define DT_WGMMA_FORWARD(NAME, EPI)                                                                          \
    extern "C" __global__ void __launch_bounds__(256) NAME(                                                  \
            const float* A, int lda, const float* B, int ldb, float* C, int ldc, int M, int N, int K,        \
            const float* bias, const float* mask, int ldm, float* col_sum, float* workspace,                 \
            unsigned int* counters, const int* gate) {                                                      \
        dt_wait_prior_grid();                                                                                \
        if (gate != nullptr && *gate) return;                                                                \
        (void)mask, (void)ldm, (void)col_sum;                                                                \
        DT_WGMMA_BODY(EPI);                                                                                  \
    }

#if DT_WGMMA
#define DT_WGMMA_BODY(EPI) forward<EPI>(A, lda, B, ldb, C, ldc, M, N, K, bias, workspace, counters)
#else
#define DT_WGMMA_BODY(EPI) __trap()
#endif

DT_WGMMA_FORWARD(linear_forward_wgmma_tf32, EPI_BIAS)
DT_WGMMA_FORWARD(linear_forward_relu_wgmma_tf32, EPI_BIAS_RELU)

// The backward products in 3xTF32, gemm.cu's signature and contract again (bias
// unused): dX = (dY W) * (X > 0) with A = dY k-fast, B = W row-fast, and dW = dY^T X
// with db = sum_m dY into col_sum (grid column 0), A = dY row-fast, B = X row-fast.
// workspace with S > 1: gridDim.x * gridDim.y * S * 128 * 128 floats, then
// gridDim.y * S * 128 for the row sums. Dynamic shared memory: SHARED_BYTES.
#define DT_WGMMA_BACKWARD(NAME, A_KFAST, B_KFAST, EPI)                                                       \
    extern "C" __global__ void __launch_bounds__(256, 1) NAME(                                               \
            const float* A, int lda, const float* B, int ldb, float* C, int ldc, int M, int N, int K,        \
            const float* bias, const float* mask, int ldm, float* col_sum, float* workspace,                 \
            unsigned int* counters, const int* gate) {                                                      \
        dt_wait_prior_grid();                                                                                \
        if (gate != nullptr && *gate) return;                                                                \
        (void)bias;                                                                                          \
        DT_WGMMA_BACKWARD_BODY(A_KFAST, B_KFAST, EPI);                                                       \
    }

#if DT_WGMMA
#define DT_WGMMA_BACKWARD_BODY(A_KFAST, B_KFAST, EPI) \
    backward<A_KFAST, B_KFAST, EPI>(A, lda, B, ldb, C, ldc, M, N, K, mask, ldm, col_sum, workspace, counters)
#else
#define DT_WGMMA_BACKWARD_BODY(A_KFAST, B_KFAST, EPI) __trap()
#endif

DT_WGMMA_BACKWARD(linear_grad_input_wgmma_3xtf32, true, false, EPI_MASK)
DT_WGMMA_BACKWARD(linear_grad_weight_wgmma_3xtf32, false, false, EPI_NONE)
