// Prioritized replay's sum tree: update, rebuild, stratified sample with
// importance weights and a fused gather. Layout and precision: sumtree.cuh.
#include "common.cuh"
#include "philox.cuh"
#include "sumtree.cuh"

// sumtree_update: leaf[indices[t]] = priorities[t]^alpha for t < n, one thread
// per index over any grid whose block size is a multiple of 32. Duplicate indices are legal (see dt_tree_set_leaf).
// An index outside [0, capacity) or a negative, NaN or infinite priority is
// skipped and raises its flag in `errors` (mapped host memory).
// max_leaf tracks the largest leaf value ever written (new transitions enter
// with it). The final leaves depend only on which duplicate lands last; the
// internal sums are exact to fp64 rounding.
extern "C" __global__ void sumtree_update(double* nodes, float* leaves, float* max_leaf,
                                          const int* indices, const float* priorities, float alpha,
                                          int n, int capacity, int height, int internal, int* errors) {
    // Every lane of a warp runs the same iterations (the grid stride is a multiple
    // of 32), so the root and the running maximum take one atomic per warp instead
    // of one per index: those two addresses are where all updates collide.
    const int lane = threadIdx.x & 31;
    const long long rounded = ((long long)n + 31) & ~31ll;
    for (long long t = dt_thread_index(); t < rounded; t += dt_grid_stride()) {
        double diff = 0.0;
        float p = 0.0f;
        int i = 0;
        if (t < n) {
            i = indices[t];
            const float pr = priorities[t];
            if (i < 0 || i >= capacity) {
                errors[DT_ERR_INDEX] = 1;
            } else if (!(pr >= 0.0f) || isinf(pr)) {
                errors[DT_ERR_PRIORITY] = 1;
            } else {
                p = alpha == 1.0f ? pr : powf(pr, alpha);
                diff = (double)p - (double)atomicExch(&leaves[i], p);
            }
        }
        if (diff != 0.0) dt_tree_add_below_root(nodes, capacity, height, internal, i, diff);
        const double root_diff = dt_warp_sum(diff);
        float largest = p;
#pragma unroll
        for (int d = 16; d >= 1; d >>= 1) largest = fmaxf(largest, __shfl_xor_sync(DT_FULL_MASK, largest, d));
        if (lane == 0) {
            if (root_diff != 0.0) atomicAdd(&nodes[0], root_diff);
            atomicMax(reinterpret_cast<int*>(max_leaf), __float_as_int(largest));  // >= 0: int order is float order
        }
    }
}

// sumtree_rebuild: recompute every internal node from the leaves with fixed-order
// warp sums, so the result is bit-for-bit reproducible.
// Launch: blockDim = 1024 (32 warps), grid = ceil(ceil(capacity / 32) / 32).
// Warp w of block b sums the leaves of level-1 node 32b + w; warp 0 then sums
// the block's 32 level-1 nodes into level-2 node b. The last block to finish
// (counter pattern, no float atomics) builds levels 3 and up, then resets the
// counter for the next launch.
extern "C" __global__ void sumtree_rebuild(double* nodes, const float* leaves, int capacity, int height,
                                           int internal, unsigned int* counter) {
    __shared__ double level1[32];
    __shared__ bool last;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int offset1 = internal - dt_level_size(capacity, 1);
    const int n = blockIdx.x * 32 + warp;
    double v = 0.0;
    if (n < dt_level_real(capacity, 1)) {
        v = dt_warp_sum((double)leaves[n * 32 + lane]);
        if (lane == 0) nodes[offset1 + n] = v;
    }
    if (lane == 0) level1[warp] = v;
    __syncthreads();
    if (height >= 2 && warp == 0) {
        double s = dt_warp_sum(level1[lane]);
        if (lane == 0) nodes[offset1 - dt_level_size(capacity, 2) + blockIdx.x] = s;
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(counter, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    int below = offset1 - dt_level_size(capacity, 2);  // offset of level h-1
    for (int h = 3; h <= height; ++h) {
        const int offset = below - dt_level_size(capacity, h);
        for (int k = warp; k < dt_level_real(capacity, h); k += 32) {
            double s = dt_warp_sum(__ldcg(&nodes[below + k * 32 + lane]));
            if (lane == 0) nodes[offset + k] = s;
        }
        __threadfence_block();
        __syncthreads();
        below = offset;
    }
    if (threadIdx.x == 0) *counter = 0u;
}

// sumtree_sample: a stratified batch of B leaves with importance weights, and
// optionally the gathered transitions.
//   mass_j = (j + U_j) * total / B, U_j from Philox(seed, *step, j) or, when
//   `uniforms` is not null, uniforms[j] (tests inject them);
//   w_j = (N p_j / total)^-beta / max_j w_j = (p_min / p_j)^beta.
// Launch: one warp per sample, blockDim = 32 * SAMPLES_PER_BLOCK (128),
// grid = ceil(B / 4): never a single block for B > 4. The warp walks the
// 32-ary tree together (one coalesced load per level), then copies the rows
// with coalesced accesses. Dynamic shared memory: 4 * B bytes. The last block
// to finish computes the weights, advances *step and resets the counter, so
// a graph replay draws fresh numbers.
// A tree whose total is 0 raises errors[DT_ERR_EMPTY] and returns leaf 0.
// Gather pointers may be null (obs_dim 0 skips the rows); with obs_dim a
// multiple of 4, every row pointer must be 16-byte aligned (device buffers
// and arena slices are 256-byte aligned).
extern "C" __global__ void sumtree_sample(
        const double* nodes, const float* leaves, int capacity, int height, int batch,
        unsigned long long seed, unsigned long long* step, const double* uniforms, float beta,
        int* out_index, float* out_weight, unsigned int* counter, int* errors,
        const float* obs, const float* next_obs, const int* action, const float* reward,
        const float* done, int obs_dim, float* batch_obs, float* batch_next_obs, int* batch_action,
        float* batch_reward, float* batch_done) {
    constexpr int WARPS = 4;
    __shared__ bool last;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int j = blockIdx.x * WARPS + warp;
    float p = dt_inf();
    int leaf = 0;
    if (j < batch) {
        const double total = nodes[0];
        const double first = dt_tree_first_level(nodes, leaves, height);
        const double u = uniforms ? uniforms[j] : dt_uniform53(seed, *step, (unsigned int)j);
        const double mass = ((double)j + u) * total / (double)batch;
        if (total > 0.0) {
            leaf = dt_tree_descend(nodes, leaves, capacity, height, first, mass, total * 0x1p-40, p);
        } else {
            p = leaves[0];
            if (lane == 0) errors[DT_ERR_EMPTY] = 1;
        }
        if (lane == 0) {
            out_index[j] = leaf;
            out_weight[j] = p;  // the leaf value, until the last block turns it into a weight
        }
    }
    // The weights need the batch minimum. Each writer fences its own stores; the
    // last block to arrive stages every leaf value in shared memory with one
    // round of loads, takes the minimum there and writes the weights.
    if (j < batch && lane == 0) __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(counter, 1u) == gridDim.x - 1;
    __syncthreads();
    if (last) {  // block-uniform, so the barriers below are safe
        __threadfence();
        extern __shared__ float batch_p[];  // `batch` floats
        __shared__ float reduce[128];
        float m = dt_inf();
#pragma unroll 4
        for (int k = threadIdx.x; k < batch; k += blockDim.x) {
            const float pk = __ldcg(&out_weight[k]);
            batch_p[k] = pk;
            m = fminf(m, pk);
        }
        reduce[threadIdx.x] = m;
        __syncthreads();
        for (int width = blockDim.x >> 1; width >= 1; width >>= 1) {
            if (threadIdx.x < width) reduce[threadIdx.x] = fminf(reduce[threadIdx.x], reduce[threadIdx.x + width]);
            __syncthreads();
        }
        const float p_min = reduce[0];
        for (int k = threadIdx.x; k < batch; k += blockDim.x) {
            const float pk = batch_p[k];
            out_weight[k] = pk > 0.0f ? powf(p_min / pk, beta) : 0.0f;
        }
        if (threadIdx.x == 0) {
            *counter = 0u;
            *step += 1ull;
        }
    }
    // The gather comes last: its HBM round trip overlaps the weights tail
    // instead of delaying the counter.
    if (j < batch && obs_dim > 0) {
        const long long src = (long long)leaf * obs_dim, dst = (long long)j * obs_dim;
        if ((obs_dim & 3) == 0) {
            // 16-byte accesses, both loads issued before either store: a row of
            // 128 floats is one load per lane per array, one HBM round trip.
            const float4* o = reinterpret_cast<const float4*>(obs + src);
            const float4* no = reinterpret_cast<const float4*>(next_obs + src);
            float4* bo = reinterpret_cast<float4*>(batch_obs + dst);
            float4* bno = reinterpret_cast<float4*>(batch_next_obs + dst);
            for (int d = lane; d < (obs_dim >> 2); d += 32) {
                const float4 a = __ldg(o + d), b = __ldg(no + d);
                bo[d] = a;
                bno[d] = b;
            }
        } else {
            for (int d = lane; d < obs_dim; d += 32) {
                const float a = __ldg(obs + src + d), b = __ldg(next_obs + src + d);
                batch_obs[dst + d] = a;
                batch_next_obs[dst + d] = b;
            }
        }
        if (lane == 0) {
            batch_action[j] = action[leaf];
            batch_reward[j] = reward[leaf];
            batch_done[j] = done[leaf];
        }
    }
}
