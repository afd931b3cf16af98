// Fused forward and backward of narrow MLPs: every width <= 256, 1 to 4 weight layers.
//
// Parameters: one flat fp32 buffer per network (drvtrain.nn.layout): W_l [w[l+1], w[l]]
// row-major at float offset w_off[l], b_l [w[l+1]] at b_off[l]; ReLU after every layer but
// the last. Gradients use the same layout; padding between views is never written.
//
// narrow_forward (TF32 mma.sync m16n8k8, cvt.rna at fragment load, FP32 accumulate)
// narrow_forward_f32 (exact FP32 FFMA)
//   params0..2, x0..2, acts0..2, batch, layers, w[0..4], w_off[0..3], b_off[0..3], gate, stop
//   Up to 3 independent forward passes of one layout in one launch. Pass p reads params_p
//   and x_p [batch, w[0]] (any 4-byte alignment) and writes the output of each of the first
//   `stop` layers (1 <= stop <= layers) to its block acts_p: layer l at
//   acts_p + sum_{j<l} roundup(batch * w[j+1], 64), [batch, w[l+1]], post-ReLU for hidden
//   layers, raw for the net's last.
//   Launch: grid (ceil(batch / 16), passes), block 512.
// narrow_forward_cluster (TF32) / narrow_forward_cluster_f32 (exact FP32), same arguments
//   The same results' layout, computed by clusters of C blocks (compute capability 9.0+),
//   each cluster 32 rows of one pass, each block 1/C of every layer's output columns (see
//   "cluster forward" below). Launch: grid (C * ceil(batch / 32), passes), cluster (C, 1, 1),
//   block 256, dynamic shared memory as narrow.py's cluster_shared_bytes.
// narrow_backward_data (3xTF32)
//   params, grads, x0..3, dy0..3, batch, layers, w[], w_off[], b_off[], workspace, counters, gate
//   x[l] is the input of layer l (x[0] unused), dy[L-1] the caller's dout; for l = L-1 .. 1
//   writes dy[l-1] = (dy[l] W_l) * (x[l] > 0), each [batch, w[l]]. Launch: grid
//   (ceil(batch / 16)), block 512 (nothing to do when L == 1: do not launch).
// narrow_weight_grads (3xTF32), same arguments
//   For every layer: dW_l = dy[l]^T x[l] into grads + w_off[l], db_l = column sums of dy[l]
//   into grads + b_off[l]. Launch: grid (tiles, splits), block 256: x enumerates the 64x64
//   tiles of dW_0, dW_1, ... (ceil(w[l+1]/64) * ceil(w[l]/64) each, row-major within a
//   layer); y splits the batch, in 32-row chunks, over splits <= 4 blocks. With splits > 1
//   workspace holds tiles * splits * 4160 floats and counters one zeroed uint per tile (left
//   zeroed on exit); with splits == 1 both may be 0.
// Built with -DDT_NARROW_FIXED=<the 15 shape arguments> -DDT_NARROW_STOP=<stop>
// -DDT_NARROW_RANKS=<C> (narrow.py's fix_shape), the file holds only the four forwards,
// compiled for that one shape: the same bits, fewer instructions; a launch with another
// shape, stop or cluster size traps.
// gate (every kernel; may be 0): while it points at a non-zero word the kernel writes nothing.
//   The word must not change while the kernel runs (it is written by earlier work, read after
//   dt_wait_prior_grid): in the cluster forward every block of a cluster must leave together.
//
// Row kernels (forward, data gradients): a block owns 16 batch rows, one m16 tile, and keeps
// the layer's input rows (16 x 264 floats) in shared memory; 16 warps share the layer's n8
// output tiles. The weights do not pass through shared memory: each warp loads the B
// fragments of its own tiles from L2 (where the weights stay) into registers, 8 k-steps
// ahead and double-buffered, so no barrier stands between k-steps. A first version streamed
// 8 KiB weight chunks through a three-stage cp.async ring, as much as fits the 48 KiB of
// static shared memory beside the rows; it paid a block barrier and ~180 instructions of
// copy bookkeeping per 8 k, and measured 32 us for three forwards of 4-256-256-3 at batch
// 256 on an H200. 16 rows rather than 32: twice the blocks (48 for three passes at batch
// 256), and a block's time is set by its k-steps, not by its row count.
// Layers narrower than the warps split the k-steps of a tile over several warps; the
// partial tiles are added in a fixed order (see reduce_slices).
//
// Determinism: every output element is one accumulation in a fixed order that depends only
// on its own row and the layout (forward, data gradients) or on the tile and the batch split
// (weight gradients, whose split partials the last block adds in split order, dt_last_block).
// No atomics on data, so results are bitwise reproducible, and a forward row's result does
// not depend on which pass or how many passes share the launch. The cluster forward's k
// split depends on its cluster size C, which narrow.py picks from the widest layer run:
// its bits are fixed for a layout and `stop`, and may differ between two values of `stop`.
#include "common.cuh"
#include "tf32.cuh"

namespace {

constexpr int ROW_THREADS = 512;  // forward and data gradients: 16 warps, 4 per scheduler
constexpr int ROW_WARPS = ROW_THREADS / 32;
constexpr int ROWS = 16;           // one m16 tile
constexpr int MAX_LAYERS = 4;
constexpr int MAX_WIDTH = 256;
constexpr int ACT_LD = MAX_WIDTH + 8;  // = 8 (mod 32): the 64-bit A-fragment loads are conflict-free
constexpr int DEPTH = 8;  // k-steps of weight fragments per register group (TF32 and 3xTF32)
constexpr int GRAD_THREADS = 256;  // weight gradients: 8 warps over a 64 x 64 tile
constexpr int TILE = 64;
constexpr int CHUNK = 32;          // batch rows per pipeline stage
constexpr int TILE_LD = TILE + 8;  // = 8 (mod 32): fragment loads are conflict-free
constexpr int MAX_SPLITS = 4;
constexpr int PARTIAL = TILE * TILE + TILE;  // floats of one split's partial dW tile and db

// The layout as kernel arguments. Layer-indexed reads go through selects, never an array,
// so nothing lands in local memory: a local load would add a dependent round trip to the
// start of every layer.
static_assert(MAX_LAYERS == 4, "pick() selects among 4 layers");

template <typename T>
__device__ __forceinline__ T pick(int l, T a, T b, T c, T d) {
    return l == 0 ? a : l == 1 ? b : l == 2 ? c : d;
}

struct NetShape {
    int batch, layers;
    int w0, w1, w2, w3, w4, wo0, wo1, wo2, wo3, bo0, bo1, bo2, bo3;
    __device__ __forceinline__ int width(int l) const { return l == 4 ? w4 : pick(l, w0, w1, w2, w3); }
    __device__ __forceinline__ int w_off(int l) const { return pick(l, wo0, wo1, wo2, wo3); }
    __device__ __forceinline__ int b_off(int l) const { return pick(l, bo0, bo1, bo2, bo3); }
    __device__ __forceinline__ bool same(const NetShape& o) const {
        return batch == o.batch && layers == o.layers && w0 == o.w0 && w1 == o.w1 && w2 == o.w2 && w3 == o.w3 &&
               w4 == o.w4 && wo0 == o.wo0 && wo1 == o.wo1 && wo2 == o.wo2 && wo3 == o.wo3 && bo0 == o.bo0 &&
               bo1 == o.bo1 && bo2 == o.bo2 && bo3 == o.bo3;
    }
};

template <typename T>
struct PerLayer {  // one pointer per layer
    T* p0;
    T* p1;
    T* p2;
    T* p3;
    __device__ __forceinline__ T* operator[](int l) const { return pick(l, p0, p1, p2, p3); }
};

__device__ __forceinline__ int round_up(int n, int m) { return (n + m - 1) / m * m; }

// ---------------------------------------------------------------- tensor cores
__device__ __forceinline__ unsigned int to_tf32(float x) {
    unsigned int r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

// 3xTF32: x = big + small with both TF32; big*big' + big*small' + small*big' keeps FP32 accuracy.
__device__ __forceinline__ void split_tf32(float x, unsigned int& big, unsigned int& small) {
    big = to_tf32(x);
    small = to_tf32(x - __uint_as_float(big));
}

// The three products of 3xTF32 into one accumulator, small terms first, in a fixed order
// (dt_mma_tf32, tf32.cuh: D += A B, m16n8k8). The fragments' k index is a fixed permutation
// of the stored k (logical t -> 2t, t + 4 -> 2t + 1), the same for A and B, so a thread's two
// k values are adjacent in memory and load as one 64-bit access; the sum is the same set of
// products in a fixed order.
__device__ __forceinline__ void mma_3xtf32(float (&d)[4], const unsigned int (&a_big)[4],
                                           const unsigned int (&a_small)[4], unsigned int b0_big,
                                           unsigned int b1_big, unsigned int b0_small, unsigned int b1_small) {
    dt_mma_tf32(d, a_small, b0_big, b1_big);
    dt_mma_tf32(d, a_big, b0_small, b1_small);
    dt_mma_tf32(d, a_big, b0_big, b1_big);
}

// A fragment from two rows of a [16][ACT_LD] tile at k0 (k permuted as mma_3xtf32 describes).
__device__ __forceinline__ void load_a(const float (*tile)[ACT_LD], int k0, int g, int t, float2& lo, float2& hi) {
    lo = *reinterpret_cast<const float2*>(&tile[g][k0 + 2 * t]);
    hi = *reinterpret_cast<const float2*>(&tile[g + 8][k0 + 2 * t]);
}

// ---------------------------------------------------------------- cp.async
// common.cuh's copies with a pointer destination: a copy whose `valid` is false reads
// nothing and fills zeros (src-size 0); `src` must still be a mapped address, so callers
// pass a base pointer then.
__device__ __forceinline__ void cp_async4(float* dst, const float* src, bool valid) {
    dt_cp_async4((unsigned int)__cvta_generic_to_shared(dst), src, valid ? 4 : 0);
}

__device__ __forceinline__ void cp_async16(float* dst, const float* src, bool valid) {
    dt_cp_async16((unsigned int)__cvta_generic_to_shared(dst), src, valid ? 16 : 0);
}

__device__ __forceinline__ bool aligned16(const void* p) { return (reinterpret_cast<size_t>(p) & 15) == 0; }

// ---------------------------------------------------------------- row kernels
// A block owns 16 rows; its warps share the n8 tiles of a layer's output. Each warp streams
// the weight fragments of its own tiles straight from L2 into registers, DEPTH k-steps
// ahead and double-buffered, so no weight passes through shared memory and no barrier
// stands between k-steps: only the layer's input rows are shared. Where a layer has fewer
// tiles than warps, the warps of a tile split its k-steps (interleaved) and the slice-0
// warp adds the others' partial tiles in slice order.
struct Share {
    int slices, slice, count;  // k-step slices of a tile; this warp's slice and its k-steps
    int tile[2];               // this warp's n8 tiles (the second only with one slice)
    bool on[2];
};

// The k-slicing of `tiles` (>= 1) n8 tiles over WARPS warps.
template <int WARPS>
__device__ __forceinline__ Share share_over(int tiles, int ksteps, int warp) {
    Share w;
    int slices = 1;
    if (tiles < WARPS)
        while (2 * slices * tiles <= WARPS) slices *= 2;
    while (slices > 1 && slices > ksteps) slices >>= 1;
    w.slices = slices;
    w.slice = slices == 1 ? 0 : warp % slices;
    w.tile[0] = slices == 1 ? warp : warp / slices;
    w.tile[1] = slices == 1 ? warp + WARPS : tiles;
    w.on[0] = w.tile[0] < tiles;
    w.on[1] = w.tile[1] < tiles;
    w.count = w.on[0] ? (ksteps - w.slice + slices - 1) / slices : 0;
    return w;
}

__device__ __forceinline__ Share share(int tiles, int ksteps, int warp) {
    return share_over<ROW_WARPS>(tiles, ksteps, warp);
}

// After the k loop: the other slices' partial tiles into the slice-0 warp's accumulators,
// added in slice order. Ends with a barrier, so the layer's input may then be overwritten.
// Returns whether this warp writes its tiles.
__device__ __forceinline__ bool reduce_slices(const Share& w, float (&acc)[2][4], float (*red)[128], int warp,
                                              int g, int t) {
    if (w.slices > 1 && w.on[0])
#pragma unroll
        for (int j = 0; j < 4; ++j) red[warp][(g + 8 * (j >> 1)) * 8 + 2 * t + (j & 1)] = acc[0][j];
    __syncthreads();
    if (w.slices > 1 && w.on[0] && w.slice == 0)
        for (int s = 1; s < w.slices; ++s)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[0][j] += red[warp + s][(g + 8 * (j >> 1)) * 8 + 2 * t + (j & 1)];
    return w.slice == 0;
}

// ---------------------------------------------------------------- forward
// Fragments of W_l ([n][k] row-major) for tile nt, k-step ks. TF32: the two k of the
// thread's B fragment, W[8nt + g][8ks + 2t, +1]. F32: the thread's two output columns
// 8nt + 2t, +1, all 8 k of the step.
template <bool TF32> struct FwdFrag;
template <> struct FwdFrag<true> { float2 w; };
template <> struct FwdFrag<false> { float4 w[4]; };  // column 2t: k 0-3, 4-7; column 2t + 1: k 0-3, 4-7

// Guarded loads: 0 where `ok` is false. Whole k-steps past a warp's share are skipped by a
// warp-uniform branch before these, so `ok` is false only at the edges of a layer.
__device__ __forceinline__ float ld_or_zero(const float* p, bool ok) { return ok ? __ldg(p) : 0.0f; }
__device__ __forceinline__ float2 ld2_or_zero(const float* p, bool ok) {
    return ok ? __ldg(reinterpret_cast<const float2*>(p)) : make_float2(0.0f, 0.0f);
}
__device__ __forceinline__ float4 ld4_or_zero(const float* p, bool ok) {
    return ok ? __ldg(reinterpret_cast<const float4*>(p)) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
}

// Where a warp's fragments of one layer come from: per tile the first element the thread
// reads (k-step `slice`), then `step` floats further per k-step of the warp.
struct FwdStream {
    const float* p[2];  // per tile
    bool row_ok[2][2];  // per tile, per row the thread reads (TF32: one row, in [0])
    bool on[2];         // per tile, warp-uniform
    int K, k0, step, count;
};

template <bool TF32>
__device__ __forceinline__ FwdStream forward_stream(const float* w, int K, int N, const Share& sh, int g, int t) {
    FwdStream st;
    st.K = K;
    st.k0 = sh.slice * 8 + (TF32 ? 2 * t : 0);
    st.step = sh.slices * 8;
    st.count = sh.count;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int row = TF32 ? sh.tile[j] * 8 + g : sh.tile[j] * 8 + 2 * t;
        st.on[j] = sh.on[j];
        st.row_ok[j][0] = sh.on[j] && row < N;
        st.row_ok[j][1] = sh.on[j] && row + 1 < N;
        st.p[j] = st.row_ok[j][0] ? w + row * K + st.k0 : w;
    }
    return st;
}

__device__ __forceinline__ void fetch_forward(FwdFrag<true>& f, const FwdStream& st, int j, int i) {
    const int k = st.k0 + i * st.step;
    const float* p = st.p[j] + i * st.step;
    const bool ok = st.row_ok[j][0];
    if ((st.K & 1) == 0) f.w = ld2_or_zero(p, ok && k < st.K);  // k even: k + 1 < K too
    else f.w = make_float2(ld_or_zero(p, ok && k < st.K), ld_or_zero(p + 1, ok && k + 1 < st.K));
}

__device__ __forceinline__ void fetch_forward(FwdFrag<false>& f, const FwdStream& st, int j, int i) {
    const int k = st.k0 + i * st.step;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
        const float* p = st.p[j] + i * st.step + c * st.K;
        const bool ok = st.row_ok[j][c];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int kh = k + 4 * h;
            if ((st.K & 3) == 0) {
                f.w[2 * c + h] = ld4_or_zero(p + 4 * h, ok && kh < st.K);
            } else {
                f.w[2 * c + h] = make_float4(ld_or_zero(p + 4 * h, ok && kh < st.K),
                                             ld_or_zero(p + 4 * h + 1, ok && kh + 1 < st.K),
                                             ld_or_zero(p + 4 * h + 2, ok && kh + 2 < st.K),
                                             ld_or_zero(p + 4 * h + 3, ok && kh + 3 < st.K));
            }
        }
    }
}

template <bool TF32, int D>
__device__ __forceinline__ void fetch_forward_group(FwdFrag<TF32> (&f)[2][D], const FwdStream& st, int first) {
#pragma unroll
    for (int d = 0; d < D; ++d) {
        if (first + d >= st.count) break;  // warp-uniform: k-steps past the warp's share load nothing
#pragma unroll
        for (int j = 0; j < 2; ++j)
            if (st.on[j]) fetch_forward(f[j][d], st, j, first + d);
    }
}

__device__ __forceinline__ void compute_forward(float (&acc)[4], const FwdFrag<true>& f, const unsigned int (&a)[4],
                                                const float4 (&)[4]) {
    dt_mma_tf32(acc, a, to_tf32(f.w.x), to_tf32(f.w.y));
}

__device__ __forceinline__ void compute_forward(float (&acc)[4], const FwdFrag<false>& f, const unsigned int (&)[4],
                                                const float4 (&x)[4]) {
    // x: rows g (k 0-3, 4-7) and g + 8 (k 0-3, 4-7); one FMA chain per output, k in order.
    const float* r0 = reinterpret_cast<const float*>(&x[0]);
    const float* r1 = reinterpret_cast<const float*>(&x[2]);
    const float* c0 = reinterpret_cast<const float*>(&f.w[0]);
    const float* c1 = reinterpret_cast<const float*>(&f.w[2]);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        acc[0] = fmaf(r0[k], c0[k], acc[0]);
        acc[1] = fmaf(r0[k], c1[k], acc[1]);
        acc[2] = fmaf(r1[k], c0[k], acc[2]);
        acc[3] = fmaf(r1[k], c1[k], acc[3]);
    }
}

template <bool TF32, int D>
__device__ __forceinline__ void compute_forward_group(float (&acc)[2][4], const FwdFrag<TF32> (&f)[2][D],
                                                      const float (*act)[ACT_LD], const Share& sh, int first, int g,
                                                      int t) {
#pragma unroll
    for (int d = 0; d < D; ++d) {
        const int i = first + d;
        if (i >= sh.count) break;  // warp-uniform
        const int k0 = (sh.slice + i * sh.slices) * 8;
        unsigned int a[4] = {0, 0, 0, 0};
        float4 x[4];
        if constexpr (TF32) {
            float2 lo, hi;
            load_a(act, k0, g, t, lo, hi);
            a[0] = to_tf32(lo.x), a[1] = to_tf32(hi.x), a[2] = to_tf32(lo.y), a[3] = to_tf32(hi.y);
        } else {
            x[0] = *reinterpret_cast<const float4*>(&act[g][k0]);
            x[1] = *reinterpret_cast<const float4*>(&act[g][k0 + 4]);
            x[2] = *reinterpret_cast<const float4*>(&act[g + 8][k0]);
            x[3] = *reinterpret_cast<const float4*>(&act[g + 8][k0 + 4]);
        }
#pragma unroll
        for (int j = 0; j < 2; ++j)
            if (sh.on[j]) compute_forward(acc[j], f[j][d], a, x);
    }
}

template <bool TF32>
__device__ __forceinline__ void forward_block(const float* params, const float* x, float* acts, const NetShape& s, int stop,
                              const int* gate) {
    constexpr int D = TF32 ? 8 : 1;  // k-steps per register group; two groups in flight
    __shared__ __align__(16) float act[ROWS][ACT_LD];
    __shared__ __align__(16) float red[ROW_WARPS][128];
    const int skip = dt_read_flag(gate);  // tested once the input rows' copies are in flight
    const int layers = s.layers, batch = s.batch, row0 = blockIdx.x * ROWS;
    {  // the block's input rows, zero beyond the batch and up to the next multiple of 8
        const int k_in = s.width(0), kp = round_up(k_in, 8);
        for (int e = threadIdx.x; e < ROWS * kp; e += ROW_THREADS) {
            const int r = e / kp, k = e - r * kp, row = row0 + r;
            const bool ok = row < batch && k < k_in;
            cp_async4(&act[r][k], ok ? x + (long long)row * k_in + k : x, ok);
        }
        dt_cp_async_commit();
    }
    if (skip) {
        dt_cp_async_wait<0>();
        return;
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    long long y_off = 0;
#pragma unroll
    for (int l = 0; l < stop; ++l) {
        const int K = s.width(l), N = s.width(l + 1), np = round_up(N, 8);
        const float* w = params + s.w_off(l);
        const float* b = params + s.b_off(l);
        float* y = acts + y_off;
        y_off += ((long long)batch * N + 63) / 64 * 64;  // see narrow.py
        const Share sh = share(np / 8, round_up(K, 8) / 8, warp);
        const FwdStream stream = forward_stream<TF32>(w, K, N, sh, g, t);
        FwdFrag<TF32> f0[2][D], f1[2][D];
        fetch_forward_group<TF32, D>(f0, stream, 0);
        float bias[2][2];
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int col = sh.tile[j] * 8 + 2 * t + e;
                bias[j][e] = sh.on[j] && col < N ? __ldg(b + col) : 0.0f;
            }
        if (l == 0) {
            dt_cp_async_wait<0>();
            __syncthreads();
        }
        float acc[2][4] = {};
        for (int i = 0; i < sh.count; i += 2 * D) {
            fetch_forward_group<TF32, D>(f1, stream, i + D);
            compute_forward_group<TF32, D>(acc, f0, act, sh, i, g, t);
            fetch_forward_group<TF32, D>(f0, stream, i + 2 * D);
            compute_forward_group<TF32, D>(acc, f1, act, sh, i + D, g, t);
        }
        const bool hidden = l + 1 < layers;
        if (reduce_slices(sh, acc, red, warp, g, t)) {
            // Epilogue: bias, ReLU; into shared memory as the next layer's input (0 in the
            // padding columns) and to global memory for the backward.
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                if (!sh.on[j]) continue;
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int r = g + 8 * (e >> 1), col = sh.tile[j] * 8 + 2 * t + (e & 1);
                    float v = 0.0f;
                    if (col < N) {
                        v = acc[j][e] + bias[j][e & 1];
                        if (hidden) v = v < 0.0f ? 0.0f : v + 0.0f;  // ReLU keeping NaN, as torch.relu
                        if (row0 + r < batch) y[(long long)(row0 + r) * N + col] = v;
                    }
                    act[r][col] = v;
                }
            }
        }
        __syncthreads();
    }
}

// ---------------------------------------------------------------- backward, data
// Layer l = L-1 .. 1: the block's outputs are the k = w[l] columns of dY_{l-1}, the
// reduction runs over the n = w[l+1] columns of dY_l. B fragment of tile nt, k-step ks:
// W[8ks + 2t, +1][8nt + g], two rows of W, so two 4-byte loads (8 threads of a row read
// 32 consecutive bytes).
struct BwdStream {
    const float* p[2];  // per tile: W[slice * 8 + 2t][8 tile + g]
    bool col_ok[2];
    bool on[2];  // per tile, warp-uniform
    int N, n0, step, rows_step, count, K;
};

__device__ __forceinline__ BwdStream backward_stream(const float* w, int K, int N, const Share& sh, int g, int t) {
    BwdStream st;
    st.K = K;
    st.N = N;
    st.n0 = sh.slice * 8 + 2 * t;
    st.rows_step = sh.slices * 8;
    st.step = st.rows_step * K;
    st.count = sh.count;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int col = sh.tile[j] * 8 + g;
        st.on[j] = sh.on[j];
        st.col_ok[j] = sh.on[j] && col < K;
        st.p[j] = st.col_ok[j] ? w + st.n0 * K + col : w;
    }
    return st;
}

__device__ __forceinline__ void fetch_backward_group(float2 (&f)[2][DEPTH], const BwdStream& st, int first) {
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {
        const int i = first + d, n = st.n0 + i * st.rows_step;
        if (i >= st.count) break;  // warp-uniform: k-steps past the warp's share load nothing
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            if (!st.on[j]) continue;
            const float* p = st.p[j] + i * st.step;
            f[j][d] = make_float2(ld_or_zero(p, st.col_ok[j] && n < st.N),
                                  ld_or_zero(p + st.K, st.col_ok[j] && n + 1 < st.N));
        }
    }
}

__device__ __forceinline__ void compute_backward_group(float (&acc)[2][4], const float2 (&f)[2][DEPTH],
                                                       const float (*grad)[ACT_LD], const Share& sh, int first,
                                                       int g, int t) {
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {
        const int i = first + d;
        if (i >= sh.count) break;  // warp-uniform
        float2 lo, hi;
        load_a(grad, (sh.slice + i * sh.slices) * 8, g, t, lo, hi);
        unsigned int a_big[4], a_small[4];
        split_tf32(lo.x, a_big[0], a_small[0]);
        split_tf32(hi.x, a_big[1], a_small[1]);
        split_tf32(lo.y, a_big[2], a_small[2]);
        split_tf32(hi.y, a_big[3], a_small[3]);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            if (!sh.on[j]) continue;
            unsigned int b0, b0s, b1, b1s;
            split_tf32(f[j][d].x, b0, b0s);
            split_tf32(f[j][d].y, b1, b1s);
            mma_3xtf32(acc[j], a_big, a_small, b0, b1, b0s, b1s);
        }
    }
}

__device__ void backward_data_block(const float* params, const PerLayer<const float>& x, const PerLayer<float>& dy,
                                    const NetShape& s, const int* gate) {
    __shared__ __align__(16) float grad[ROWS][ACT_LD];
    __shared__ __align__(16) float red[ROW_WARPS][128];
    const int skip = dt_read_flag(gate);  // tested once the input rows' copies are in flight
    const int layers = s.layers, batch = s.batch, row0 = blockIdx.x * ROWS;
    if (layers < 2) return;
    {  // dout's rows, zero beyond the batch and up to the next multiple of 8
        const int n = s.width(layers), np = round_up(n, 8);
        const float* dout = dy[layers - 1];
        for (int e = threadIdx.x; e < ROWS * np; e += ROW_THREADS) {
            const int r = e / np, c = e - r * np, row = row0 + r;
            const bool ok = row < batch && c < n;
            cp_async4(&grad[r][c], ok ? dout + (long long)row * n + c : dout, ok);
        }
        dt_cp_async_commit();
    }
    if (skip) {
        dt_cp_async_wait<0>();
        return;
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    for (int l = layers - 1; l > 0; --l) {
        const int K = s.width(l), N = s.width(l + 1);
        const float* w = params + s.w_off(l);
        const float* mask = x[l];
        float* dx = dy[l - 1];
        const Share sh = share(round_up(K, 8) / 8, round_up(N, 8) / 8, warp);
        const BwdStream stream = backward_stream(w, K, N, sh, g, t);
        float2 f0[2][DEPTH], f1[2][DEPTH];
        fetch_backward_group(f0, stream, 0);
        float keep[2][4];  // the ReLU mask of this thread's outputs, loaded while the fragments stream
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = row0 + g + 8 * (e >> 1), col = sh.tile[j] * 8 + 2 * t + (e & 1);
                keep[j][e] = sh.on[j] && row < batch && col < K ? mask[(long long)row * K + col] : 0.0f;
            }
        if (l == layers - 1) {
            dt_cp_async_wait<0>();
            __syncthreads();
        }
        float acc[2][4] = {};
        for (int i = 0; i < sh.count; i += 2 * DEPTH) {
            fetch_backward_group(f1, stream, i + DEPTH);
            compute_backward_group(acc, f0, grad, sh, i, g, t);
            fetch_backward_group(f0, stream, i + 2 * DEPTH);
            compute_backward_group(acc, f1, grad, sh, i + DEPTH, g, t);
        }
        if (reduce_slices(sh, acc, red, warp, g, t)) {
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                if (!sh.on[j]) continue;
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int r = g + 8 * (e >> 1), col = sh.tile[j] * 8 + 2 * t + (e & 1), row = row0 + r;
                    // x[l] = relu(z) > 0 exactly where z > 0: the saved input is the ReLU's mask.
                    const float v = keep[j][e] > 0.0f ? acc[j][e] : 0.0f;
                    grad[r][col] = v;
                    if (row < batch && col < K) dx[(long long)row * K + col] = v;
                }
            }
        }
        __syncthreads();
    }
}

// ---------------------------------------------------------------- backward, weights
__device__ void weight_grads_block(float* grads, const PerLayer<const float>& x, const PerLayer<float>& dy, const NetShape& s,
                                   float* workspace, unsigned int* counters, const int* gate) {
    __shared__ __align__(16) float gs[2][CHUNK][TILE_LD];  // dY rows: [batch][n]
    __shared__ __align__(16) float xs[2][CHUNK][TILE_LD];  // X rows:  [batch][k]
    const int skip = dt_read_flag(gate);  // tested once the input rows' copies are in flight
    // Which layer and tile: block-uniform arithmetic over at most 4 layers.
    int tile = blockIdx.x, l = 0;
    for (; l + 1 < s.layers; ++l) {
        const int count = ((s.width(l + 1) + TILE - 1) / TILE) * ((s.width(l) + TILE - 1) / TILE);
        if (tile < count) break;
        tile -= count;
    }
    const int K = s.width(l), N = s.width(l + 1), batch = s.batch;
    const int col_tiles = (K + TILE - 1) / TILE;
    const int n0 = tile / col_tiles * TILE, k0 = tile % col_tiles * TILE;
    const float* gy = dy[l];
    const float* xin = x[l];
    const bool g_vec = (N & 3) == 0 && aligned16(gy), x_vec = (K & 3) == 0 && aligned16(xin);
    const int chunks = (batch + CHUNK - 1) / CHUNK, per = (chunks + gridDim.y - 1) / gridDim.y;
    const int c_begin = blockIdx.y * per, c_end = min(chunks, c_begin + per);

    auto issue = [&](int c, int buf) {
        const int b0 = c * CHUNK;
        if (g_vec) {
            for (int e = threadIdx.x; e < CHUNK * TILE / 4; e += GRAD_THREADS) {
                const int r = e >> 4, j = 4 * (e & 15), b = b0 + r, n = n0 + j;
                const bool ok = b < batch && n < N;
                cp_async16(&gs[buf][r][j], ok ? gy + (long long)b * N + n : gy, ok);
            }
        } else {
            for (int e = threadIdx.x; e < CHUNK * TILE; e += GRAD_THREADS) {
                const int r = e >> 6, j = e & 63, b = b0 + r, n = n0 + j;
                const bool ok = b < batch && n < N;
                cp_async4(&gs[buf][r][j], ok ? gy + (long long)b * N + n : gy, ok);
            }
        }
        if (x_vec) {
            for (int e = threadIdx.x; e < CHUNK * TILE / 4; e += GRAD_THREADS) {
                const int r = e >> 4, j = 4 * (e & 15), b = b0 + r, k = k0 + j;
                const bool ok = b < batch && k < K;
                cp_async16(&xs[buf][r][j], ok ? xin + (long long)b * K + k : xin, ok);
            }
        } else {
            for (int e = threadIdx.x; e < CHUNK * TILE; e += GRAD_THREADS) {
                const int r = e >> 6, j = e & 63, b = b0 + r, k = k0 + j;
                const bool ok = b < batch && k < K;
                cp_async4(&xs[buf][r][j], ok ? xin + (long long)b * K + k : xin, ok);
            }
        }
        dt_cp_async_commit();
    };
    issue(c_begin, 0);
    if (skip) {
        dt_cp_async_wait<0>();
        return;
    }

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int wm = (warp >> 2) * 32, wn = (warp & 3) * 16;  // this warp's 32 x 16 of the tile
    bool row_on[2], col_on[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        row_on[i] = n0 + wm + 16 * i < N;
        col_on[i] = k0 + wn + 8 * i < K;
    }
    const bool sums = k0 == 0 && threadIdx.x < TILE;  // db: the tiles of column 0, one thread per row
    float acc[2][2][4] = {};
    float db = 0.0f;
    for (int c = c_begin; c < c_end; ++c) {
        const int buf = (c - c_begin) & 1;
        if (c + 1 < c_end) issue(c + 1, buf ^ 1);
        else dt_cp_async_commit();
        dt_cp_async_wait<1>();
        __syncthreads();
        const int rows = min(CHUNK, batch - c * CHUNK);
        if (sums)
            for (int r = 0; r < rows; ++r) db += gs[buf][r][threadIdx.x];
        for (int kk = 0; kk < rows; kk += 8) {
            unsigned int a_big[2][4], a_small[2][4], b_big[2][2], b_small[2][2];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                if (!row_on[i]) continue;
                const int m = wm + 16 * i + g;
                split_tf32(gs[buf][kk + t][m], a_big[i][0], a_small[i][0]);
                split_tf32(gs[buf][kk + t][m + 8], a_big[i][1], a_small[i][1]);
                split_tf32(gs[buf][kk + t + 4][m], a_big[i][2], a_small[i][2]);
                split_tf32(gs[buf][kk + t + 4][m + 8], a_big[i][3], a_small[i][3]);
            }
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                if (!col_on[j]) continue;
                const int n = wn + 8 * j + g;
                split_tf32(xs[buf][kk + t][n], b_big[j][0], b_small[j][0]);
                split_tf32(xs[buf][kk + t + 4][n], b_big[j][1], b_small[j][1]);
            }
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int j = 0; j < 2; ++j)
                    if (row_on[i] && col_on[j])
                        mma_3xtf32(acc[i][j], a_big[i], a_small[i], b_big[j][0], b_big[j][1], b_small[j][0],
                                   b_small[j][1]);
        }
        __syncthreads();  // the buffer is refilled next iteration
    }

    float* dw = grads + s.w_off(l);
    float* dbias = grads + s.b_off(l);
    if (gridDim.y == 1) {
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int n = n0 + wm + 16 * i + g + 8 * (e >> 1), k = k0 + wn + 8 * j + 2 * t + (e & 1);
                    if (n < N && k < K) dw[(long long)n * K + k] = acc[i][j][e];
                }
        if (sums && n0 + threadIdx.x < N) dbias[n0 + threadIdx.x] = db;
        return;
    }

    // Split batch: this block's partial tile (every element, zeros where inactive), then the
    // last block of the tile adds the splits in order.
    float* tile_ws = workspace + (long long)blockIdx.x * gridDim.y * PARTIAL;
    float* part = tile_ws + (long long)blockIdx.y * PARTIAL;
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                part[(wm + 16 * i + g + 8 * (e >> 1)) * TILE + wn + 8 * j + 2 * t + (e & 1)] = acc[i][j][e];
    if (threadIdx.x < TILE) part[TILE * TILE + threadIdx.x] = db;
    if (!dt_last_block(&counters[blockIdx.x], gridDim.y)) return;

    const int splits = gridDim.y;
    constexpr int GROUPS = TILE * TILE / 4 / GRAD_THREADS;  // float4s per thread
    float4 p[GROUPS][MAX_SPLITS];
#pragma unroll
    for (int q = 0; q < GROUPS; ++q)  // every load first, so the tail is one round trip
#pragma unroll
        for (int z = 0; z < MAX_SPLITS; ++z)
            if (z < splits)
                p[q][z] = __ldcg(reinterpret_cast<const float4*>(tile_ws + (long long)z * PARTIAL) + q * GRAD_THREADS +
                                 threadIdx.x);
#pragma unroll
    for (int q = 0; q < GROUPS; ++q) {
        float4 v = p[q][0];
#pragma unroll
        for (int z = 1; z < MAX_SPLITS; ++z)
            if (z < splits) v.x += p[q][z].x, v.y += p[q][z].y, v.z += p[q][z].z, v.w += p[q][z].w;
        const int e = 4 * (q * GRAD_THREADS + threadIdx.x), n = n0 + e / TILE, k = k0 + e % TILE;
        if (n < N) {
            float* out = dw + (long long)n * K + k;
            if (k < K) out[0] = v.x;
            if (k + 1 < K) out[1] = v.y;
            if (k + 2 < K) out[2] = v.z;
            if (k + 3 < K) out[3] = v.w;
        }
    }
    if (sums && n0 + threadIdx.x < N) {
        float v = 0.0f;
        for (int z = 0; z < splits; ++z) v += __ldcg(tile_ws + (long long)z * PARTIAL + TILE * TILE + threadIdx.x);
        dbias[n0 + threadIdx.x] = v;
    }
}

// ---------------------------------------------------------------- cluster forward
// A cluster of C blocks owns CL_ROWS batch rows of one pass and splits every layer's
// output columns: rank r holds n8 tiles [r tb, r tb + tb) of layer l's T = ceil(N / 8),
// tb = ceil(T / C). Every block first copies its input rows, its weight rows and its bias
// slice of every layer into shared memory (cp.async, all in flight at once). A layer's
// outputs go to global memory (the backward needs them) and, but for the last layer run,
// into the next layer's input rows of every block of the cluster (distributed shared
// memory); a cluster barrier stands between layers. So a block reads 1/C of the weights,
// once, and the only round trip to memory is the first.
constexpr int CL_THREADS = 256;
constexpr int CL_WARPS = CL_THREADS / 32;
constexpr int CL_ROWS = 32;  // two m16 tiles: each weight fragment serves both
constexpr int CL_MAX = 8;    // blocks a cluster: the portable size

// Row stride of a shared-memory row of k floats: = 8 (mod 32), so the 64-bit fragment
// loads of a half-warp (8 rows apart by g, 2t within a row) hit 32 distinct banks.
__device__ __forceinline__ int cl_stride(int k) { return round_up(k, 32) + 8; }

__device__ __forceinline__ int cl_tiles(int n, int ranks) { return (round_up(n, 8) / 8 + ranks - 1) / ranks; }

// The k-slicing of a block's `tiles` n8 tiles over its warps; tiles may be 0 (a rank
// past the layer's last tile), and then no warp has any.
__device__ __forceinline__ Share cl_share(int tiles, int ksteps, int warp) {
    Share w = share_over<CL_WARPS>(max(tiles, 1), ksteps, warp);
    if (tiles == 0) {
        w.on[0] = w.on[1] = false;
        w.count = 0;
    }
    return w;
}

// Copy rows x k floats (row-major, `ld` floats apart, rows from `first_row` below `rows_ok`
// and k below `k_ok`, zero elsewhere) into shared rows of stride `stride`, k padded to 8.
// A warp copies a row at a time, so no thread divides.
__device__ __forceinline__ void cl_copy_rows(float* dst, int stride, const float* src, long long ld, int first_row,
                                             int rows, int rows_ok, int k, bool vector) {
    const int kp = round_up(k, 8), warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int i = warp; i < rows; i += CL_WARPS) {
        const int row = first_row + i;
        const bool row_ok = row < rows_ok;
        const float* from = src + (row_ok ? row * ld : 0);
        float* to = dst + i * stride;
        if (vector) {  // k % 4 == 0 and src 16-byte aligned
            for (int c = 4 * lane; c < kp; c += 128) {
                const bool ok = row_ok && c < k;
                cp_async16(to + c, ok ? from + c : src, ok);
            }
        } else {
            for (int c = lane; c < kp; c += 32) {
                const bool ok = row_ok && c < k;
                cp_async4(to + c, ok ? from + c : src, ok);
            }
        }
    }
}

// A warp's k loop over `count` k-steps for TILES n8 tiles and both m16 tiles: A from the
// input rows (held rounded to TF32 on the TF32 path), B from the staged weight rows.
template <bool TF32, int TILES>
__device__ __forceinline__ void cl_k_loop(float (&acc)[2][2][4], const float* a, const float* b0, const float* b1,
                                          int S, int step, int count) {
#pragma unroll 4
    for (int i = 0; i < count; ++i, a += step, b0 += step, b1 += step) {
        unsigned int frag[2][4] = {};
        float4 xr[2][4];
#pragma unroll
        for (int m = 0; m < 2; ++m) {
            const float* r0 = a + 16 * m * S;
            const float* r1 = r0 + 8 * S;
            if constexpr (TF32) {
                const float2 lo = *reinterpret_cast<const float2*>(r0);
                const float2 hi = *reinterpret_cast<const float2*>(r1);
                frag[m][0] = __float_as_uint(lo.x), frag[m][1] = __float_as_uint(hi.x);
                frag[m][2] = __float_as_uint(lo.y), frag[m][3] = __float_as_uint(hi.y);
            } else {
                xr[m][0] = *reinterpret_cast<const float4*>(r0);
                xr[m][1] = *reinterpret_cast<const float4*>(r0 + 4);
                xr[m][2] = *reinterpret_cast<const float4*>(r1);
                xr[m][3] = *reinterpret_cast<const float4*>(r1 + 4);
            }
        }
#pragma unroll
        for (int j = 0; j < TILES; ++j) {
            const float* b = j == 0 ? b0 : b1;
            FwdFrag<TF32> f;
            if constexpr (TF32) {
                f.w = *reinterpret_cast<const float2*>(b);
            } else {
#pragma unroll
                for (int c = 0; c < 2; ++c)
#pragma unroll
                    for (int h = 0; h < 2; ++h) f.w[2 * c + h] = *reinterpret_cast<const float4*>(b + c * S + 4 * h);
            }
#pragma unroll
            for (int m = 0; m < 2; ++m) compute_forward(acc[m][j], f, frag[m], xr[m]);
        }
    }
}

template <bool TF32>
__device__ __forceinline__ void forward_cluster_block(const float* params, const float* x, float* acts, const NetShape& s, int stop,
                                      const int* gate) {
    extern __shared__ __align__(16) float smem[];
#ifdef DT_NARROW_RANKS
    constexpr int ranks = DT_NARROW_RANKS;
    if (dt_cluster_blocks() != ranks) __trap();
#else
    const int ranks = (int)dt_cluster_blocks();
#endif
    const int rank = (int)dt_cluster_rank();
    const int batch = s.batch, layers = s.layers, row0 = (blockIdx.x / ranks) * CL_ROWS;
    // Shared memory, in floats (narrow.py's cluster_shared_bytes says the same): the
    // inputs of even layers, of odd layers, the slice partials, then per layer its
    // weight rows and its bias slice.
    int even = 0, odd = 0;
#pragma unroll
    for (int l = 0; l < stop; ++l) {
        if (l & 1) odd = max(odd, cl_stride(s.width(l)));
        else even = max(even, cl_stride(s.width(l)));
    }
    float* act0 = smem;
    float* act1 = act0 + CL_ROWS * even;
    float* red = act1 + CL_ROWS * odd;
    float* slices0 = red + CL_WARPS * 2 * 128;
    const int skip = dt_read_flag(gate);  // tested once the input rows' copies are in flight
    {
        const int k = s.width(0);
        cl_copy_rows(act0, cl_stride(k), x, k, row0, CL_ROWS, batch, k, (k & 3) == 0 && aligned16(x));
        float* at = slices0;
#pragma unroll
        for (int l = 0; l < stop; ++l) {
            const int K = s.width(l), N = s.width(l + 1), tb = cl_tiles(N, ranks);
            const float* w = params + s.w_off(l);
            cl_copy_rows(at, cl_stride(K), w, K, rank * tb * 8, tb * 8, N, K, (K & 3) == 0 && aligned16(w));
            at += tb * 8 * cl_stride(K);
            const float* b = params + s.b_off(l);
            for (int i = threadIdx.x; i < tb * 8; i += CL_THREADS) {
                const int col = rank * tb * 8 + i;
                cp_async4(at + i, col < N ? b + col : b, col < N);
            }
            at += round_up(tb * 8, 4);
        }
        dt_cp_async_commit();
    }
    if (skip) {  // the same word in every block of the cluster: all leave here together
        dt_cp_async_wait<0>();
        return;
    }
    if (stop > 1) dt_cluster_arrive_relaxed();  // waited for before the first remote write
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    dt_cp_async_wait<0>();
    __syncthreads();  // every thread's copies have landed
    if constexpr (TF32) {
        // Every layer's input rows are held rounded to TF32, so the k loops pass them to
        // the MMAs as they are: the input here, the later layers' as the epilogue writes
        // them. The same bits as rounding each fragment as it is loaded.
        const int k = s.width(0), stride = cl_stride(k), kp = round_up(k, 8);
        for (int i = warp; i < CL_ROWS; i += CL_WARPS)
            for (int c = lane; c < kp; c += 32) act0[i * stride + c] = __uint_as_float(to_tf32(act0[i * stride + c]));
        __syncthreads();
    }
    const float* wl = slices0;
    long long y_off = 0;
#pragma unroll
    for (int l = 0; l < stop; ++l) {
        const int K = s.width(l), N = s.width(l + 1), S = cl_stride(K), tb = cl_tiles(N, ranks);
        const int first_tile = rank * tb, mine = max(0, min(tb, round_up(N, 8) / 8 - first_tile));
        const float* in = (l & 1) ? act1 : act0;
        float* next = (l & 1) ? act0 : act1;
        const float* bl = wl + tb * 8 * S;
        float* y = acts + y_off;
        y_off += ((long long)batch * N + 63) / 64 * 64;  // see narrow.py
        const Share sh = cl_share(mine, round_up(K, 8) / 8, warp);
        float acc[2][2][4] = {};  // [m16 tile][n8 tile][fragment]
        // This warp's first A and B elements; a k-step moves both `step` floats on. The
        // loop is specialised on whether the warp holds a second tile (warp-uniform, the
        // same for every k-step), so no k-step branches.
        const int step = sh.slices * 8, k0 = sh.slice * 8 + (TF32 ? 2 * t : 0);
        const float* a0 = in + g * S + k0;
        const float* b0 = wl + (8 * sh.tile[0] + (TF32 ? g : 2 * t)) * S + k0;
        const float* b1 = wl + (8 * sh.tile[1] + (TF32 ? g : 2 * t)) * S + k0;
        if (sh.on[1]) cl_k_loop<TF32, 2>(acc, a0, b0, b1, S, step, sh.count);
        else if (sh.on[0]) cl_k_loop<TF32, 1>(acc, a0, b0, b1, S, step, sh.count);
        // The other slices' partial tiles into the slice-0 warp's, in slice order.
        if (sh.slices > 1 && sh.on[0])
#pragma unroll
            for (int m = 0; m < 2; ++m)
#pragma unroll
                for (int e = 0; e < 4; ++e) red[warp * 256 + m * 128 + (g + 8 * (e >> 1)) * 8 + 2 * t + (e & 1)] = acc[m][0][e];
        __syncthreads();
        if (sh.slices > 1 && sh.on[0] && sh.slice == 0)
            for (int q = 1; q < sh.slices; ++q)
#pragma unroll
                for (int m = 0; m < 2; ++m)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        acc[m][0][e] += red[(warp + q) * 256 + m * 128 + (g + 8 * (e >> 1)) * 8 + 2 * t + (e & 1)];
        const bool hidden = l + 1 < layers, more = l + 1 < stop;
        if (more && l == 0) dt_cluster_wait();  // every block of the cluster has started
        if (sh.slice == 0) {
            // Bias, ReLU (keeping NaN, as torch.relu); to global memory, and into the next
            // layer's input rows of every block (0 in the padding columns up to a multiple of 8).
            const int SN = cl_stride(N);
            unsigned int remote[CL_MAX];  // the next layer's input rows in every block of the cluster
            if (ranks > CL_MAX) __trap();     // narrow.py launches at most the portable 8
            if (more) {
                const unsigned int base = (unsigned int)__cvta_generic_to_shared(next);
#pragma unroll
                for (int q = 0; q < CL_MAX; ++q) remote[q] = q < ranks ? dt_cluster_address(base, q) : 0u;
            }
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                if (!sh.on[j]) continue;
                const int local = 8 * sh.tile[j] + 2 * t, col = 8 * first_tile + local;
                const float b0 = bl[local], b1 = bl[local + 1];
#pragma unroll
                for (int m = 0; m < 2; ++m)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int r = 16 * m + g + 8 * h, row = row0 + r;
                        float v0 = 0.0f, v1 = 0.0f;
                        if (col < N) {
                            v0 = acc[m][j][2 * h] + b0;
                            if (hidden) v0 = v0 < 0.0f ? 0.0f : v0 + 0.0f;
                            if (row < batch) y[(long long)row * N + col] = v0;
                        }
                        if (col + 1 < N) {
                            v1 = acc[m][j][2 * h + 1] + b1;
                            if (hidden) v1 = v1 < 0.0f ? 0.0f : v1 + 0.0f;
                            if (row < batch) y[(long long)row * N + col + 1] = v1;
                        }
                        if (more) {
                            const unsigned int at = 4u * (unsigned int)(r * SN + col);
                            const float n0 = TF32 ? __uint_as_float(to_tf32(v0)) : v0;
                            const float n1 = TF32 ? __uint_as_float(to_tf32(v1)) : v1;
#pragma unroll
                            for (int q = 0; q < CL_MAX; ++q)
                                if (q < ranks) dt_cluster_store2(remote[q] + at, n0, n1);
                        }
                    }
            }
        }
        if (more) dt_cluster_barrier();  // the next layer's inputs are complete in every block
        wl = bl + round_up(tb * 8, 4);
    }
}

}  // namespace

#define DT_NARROW_SHAPE                                                                                \
    int batch, int layers, int w0, int w1, int w2, int w3, int w4, int wo0, int wo1, int wo2, int wo3, \
        int bo0, int bo1, int bo2, int bo3
#define DT_NARROW_SHAPE_VALUE NetShape{batch, layers, w0, w1, w2, w3, w4, wo0, wo1, wo2, wo3, bo0, bo1, bo2, bo3}

// The build for one shape (see the file's header): the shape a compile-time constant, so
// the selects, the split of tiles over warps and the bounds checks fold away; the
// arguments checked against it.
#ifdef DT_NARROW_FIXED
#define DT_NARROW_FORWARD_SHAPE                                                                        \
    constexpr NetShape shape{DT_NARROW_FIXED};                                                         \
    constexpr int stop_used = DT_NARROW_STOP;                                                          \
    {                                                                                                  \
        const NetShape given = DT_NARROW_SHAPE_VALUE;                                                  \
        if (!shape.same(given) || stop != stop_used) __trap();                                        \
    }
#else
#define DT_NARROW_FORWARD_SHAPE               \
    const NetShape shape = DT_NARROW_SHAPE_VALUE; \
    const int stop_used = stop;
#endif

// Signature of every forward: ptr x 9, i32 x 15, ptr, i32 (stop). BLOCK is the block's
// work (forward_block or forward_cluster_block), THREADS its block size.
#define DT_NARROW_FORWARD(NAME, THREADS, BLOCK, TF32)                                                       \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                    \
        NAME(const float* params0, const float* params1, const float* params2, const float* x0,              \
             const float* x1, const float* x2, float* acts0, float* acts1, float* acts2, DT_NARROW_SHAPE,    \
             const int* gate, int stop) {                                                                    \
        dt_wait_prior_grid();                                                                                \
        dt_allow_dependents();                                                                               \
        DT_NARROW_FORWARD_SHAPE                                                                              \
        const int pass = blockIdx.y;                                                                         \
        BLOCK<TF32>(pass == 0 ? params0 : pass == 1 ? params1 : params2, pass == 0 ? x0 : pass == 1 ? x1 : x2, \
                    pass == 0 ? acts0 : pass == 1 ? acts1 : acts2, shape, stop_used, gate);                  \
    }

DT_NARROW_FORWARD(narrow_forward, ROW_THREADS, forward_block, true)
DT_NARROW_FORWARD(narrow_forward_f32, ROW_THREADS, forward_block, false)
DT_NARROW_FORWARD(narrow_forward_cluster, CL_THREADS, forward_cluster_block, true)
DT_NARROW_FORWARD(narrow_forward_cluster_f32, CL_THREADS, forward_cluster_block, false)

#ifndef DT_NARROW_FIXED  // a build for one shape holds the forwards only
// Signature of both backward kernels: ptr x 10, i32 x 15, ptr x 3.
#define DT_NARROW_BACKWARD_PARAMS                                                                      \
    const float *params, float *grads, const float *x0, const float *x1, const float *x2, const float *x3, \
        float *dy0, float *dy1, float *dy2, float *dy3, DT_NARROW_SHAPE, float *workspace,              \
        unsigned int *counters, const int *gate

extern "C" __global__ void __launch_bounds__(ROW_THREADS) narrow_backward_data(DT_NARROW_BACKWARD_PARAMS) {
    dt_wait_prior_grid();
    dt_allow_dependents();
    const PerLayer<const float> x{x0, x1, x2, x3};
    const PerLayer<float> dy{dy0, dy1, dy2, dy3};
    backward_data_block(params, x, dy, DT_NARROW_SHAPE_VALUE, gate);
}

extern "C" __global__ void __launch_bounds__(GRAD_THREADS) narrow_weight_grads(DT_NARROW_BACKWARD_PARAMS) {
    dt_wait_prior_grid();
    dt_allow_dependents();
    const PerLayer<const float> x{x0, x1, x2, x3};
    const PerLayer<float> dy{dy0, dy1, dy2, dy3};
    weight_grads_block(grads, x, dy, DT_NARROW_SHAPE_VALUE, workspace, counters, gate);
}
#endif  // DT_NARROW_FIXED
