// Prioritized replay's sum tree: update, rebuild, stratified sample with
// importance weights and a fused gather. Layout and precision: sumtree.cuh.
#include "common.cuh"
#include "philox.cuh"
#include "sumtree.cuh"

// sumtree_update: leaf[indices[t]] = priorities[t]^alpha for t < n, then every
// ancestor of those leaves recomputed from its children (dt_tree_refresh) by the
// last block to finish its leaves (dt_last_block on `counter`): the nodes are
// the fixed-order sums of the new leaves, the bits rebuild() gives. Block b
// writes the leaves of its own contiguous share of the indices, ceil(n / grid)
// of them, a thread an index (or several, past blockDim); the last block then
// takes every index, a thread a node of a level at a time, so a block of about
// n threads refreshes in one round of loads a level. Duplicate indices are
// legal: the leaf ends as one of the values written to it. An index outside
// [0, capacity) or a negative, NaN or infinite priority is skipped and raises
// its flag (dt_raise into err_counts / err_published). When `skip` is not null
// and *skip != 0, nothing changes: a training step that found a NaN skips its
// update without the host deciding. max_leaf tracks the largest leaf value
// ever written (new transitions enter with it).
// Launch: block a multiple of 32, at most UPDATE_THREADS; any grid.
constexpr int UPDATE_THREADS = 512;

extern "C" __global__ void __launch_bounds__(UPDATE_THREADS) sumtree_update(
        double* nodes, float* leaves, float* max_leaf, const int* indices, const float* priorities, float alpha,
        int n, int capacity, int height, int internal, const int* skip, unsigned int* err_counts,
        unsigned int* err_published, unsigned int* counter) {
    dt_wait_prior_grid();
    dt_allow_dependents();
    // Nothing writes *skip here, so every thread sees the same value and the
    // warp-wide shuffles of the update are never split.
    if (skip != nullptr && *skip != 0) return;
    const long long share = ((long long)n + gridDim.x - 1) / gridDim.x, first = blockIdx.x * share;
    const int count = (int)max(0ll, min((long long)n, first + share) - first);
    dt_tree_update(threadIdx.x, blockDim.x, leaves, max_leaf, indices + first, priorities + first, alpha, count,
                   capacity, err_counts, err_published);
    if (!dt_last_block(counter, gridDim.x)) return;
    dt_tree_refresh(nodes, leaves, capacity, height, internal, indices, n);
}

// sumtree_rebuild: recompute every internal node from the leaves with fixed-order
// warp sums, so the result is bit-for-bit reproducible.
// Launch: block REBUILD_THREADS (pinned), grid = ceil(ceil(capacity / 32) / REBUILD_WARPS).
// Warp w of block b sums the leaves of level-1 node 32b + w; warp 0 then sums
// the block's 32 level-1 nodes into level-2 node b. The last block
// (dt_last_block) builds levels 3 and up.
constexpr int REBUILD_WARPS = 32;  // one warp per child of a level-2 node
constexpr int REBUILD_THREADS = 32 * REBUILD_WARPS;

extern "C" __global__ void __launch_bounds__(REBUILD_THREADS) sumtree_rebuild(
        double* nodes, const float* leaves, int capacity, int height, int internal, unsigned int* counter) {
    dt_wait_prior_grid();
    dt_allow_dependents();
    __shared__ double level1[REBUILD_WARPS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int offset1 = internal - dt_level_size(capacity, 1);
    const int n = blockIdx.x * REBUILD_WARPS + warp;
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
    if (!dt_last_block(counter, gridDim.x)) return;
    int below = offset1 - dt_level_size(capacity, 2);  // offset of level h-1
    for (int h = 3; h <= height; ++h) {
        const int offset = below - dt_level_size(capacity, h);
        for (int k = warp; k < dt_level_real(capacity, h); k += REBUILD_WARPS) {
            double s = dt_warp_sum(__ldcg(&nodes[below + k * 32 + lane]));
            if (lane == 0) nodes[offset + k] = s;
        }
        __threadfence_block();
        __syncthreads();
        below = offset;
    }
}

// sumtree_sample: a stratified batch of B leaves with importance weights, and
// optionally the gathered transitions.
//   mass_j = (j + U_j) * total / B, U_j from Philox(seed, *step, j) or, when
//   `uniforms` is not null, uniforms[j] (tests inject them);
//   w_j = (N p_j / total)^-beta / max_j w_j = (p_min / p_j)^beta;
//   beta = beta_start + (beta_end - beta_start) * min(1, *step / beta_steps),
//   with *step read before this launch advances it (a constant beta passes
//   start = end). When `beta_out` is not null the beta used is written there.
// Launch: one warp per sample, block SAMPLE_THREADS (pinned), grid =
// ceil(B / SAMPLE_WARPS): never a single block for B > SAMPLE_WARPS. The warp
// walks the 32-ary tree together (one coalesced load per level), then copies
// the rows with coalesced accesses. Dynamic shared memory: 4 * B bytes. The
// last block (dt_last_block) computes the weights and advances *step, so a
// graph replay draws fresh numbers.
// With a null `counter` the draw is split in two launches: out_weight
// receives the drawn leaf values p_j, block 0 writes beta to beta_out (not
// null then), *step is left alone and no shared memory is used;
// sumtree_weights, launched after this kernel, finishes the draw. Nothing
// waits for a last block, so the kernels that read only the rows start
// sooner.
// A sampled leaf is never 0 while any leaf is not (sumtree.cuh says how).
// When every leaf is 0, the sample is leaf 0 with weight 0 and DT_ERR_EMPTY
// is raised.
// Gather pointers may be null (obs_dim 0 skips the rows); with obs_dim a
// multiple of 4, every row pointer must be 16-byte aligned (device buffers
// and arena slices are 256-byte aligned).
namespace {

// beta = start + (end - start) * min(1, step / steps), in double, rounded once.
__device__ __forceinline__ float dt_sample_beta(unsigned long long step, float start, float end,
                                                unsigned long long steps) {
    const double progress = step >= steps ? 1.0 : (double)step / (double)steps;
    return (float)((double)start + ((double)end - (double)start) * progress);
}

// The importance weight of a drawn leaf value p given the batch minimum.
__device__ __forceinline__ float dt_is_weight(float p_min, float p, float beta) {
    return p > 0.0f ? powf(p_min / p, beta) : 0.0f;
}

// The block's minimum of one float per thread, in every thread: shuffles within
// each warp, then the warps' minima from `reduce` (THREADS / 32 floats). A
// minimum does not depend on the order it is taken in.
template <int THREADS>
__device__ __forceinline__ float dt_block_min(float m, float* reduce) {
#pragma unroll
    for (int d = 16; d >= 1; d >>= 1) m = fminf(m, __shfl_xor_sync(DT_FULL_MASK, m, d));
    if ((threadIdx.x & 31) == 0) reduce[threadIdx.x >> 5] = m;
    __syncthreads();
    m = reduce[0];
#pragma unroll
    for (int w = 1; w < THREADS / 32; ++w) m = fminf(m, reduce[w]);
    return m;
}

}  // namespace

constexpr int SAMPLE_THREADS = 128;
constexpr int SAMPLE_WARPS = SAMPLE_THREADS / 32;
// A residency hint of 8 blocks (32 warps) per SM: with the bound alone, ptxas
// aims higher and spills the walk's state to local memory.
constexpr int SAMPLE_MIN_BLOCKS = 8;

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS, SAMPLE_MIN_BLOCKS) sumtree_sample(
        const double* nodes, const float* leaves, int capacity, int height, int batch,
        unsigned long long seed, unsigned long long* step, const double* uniforms,
        float beta_start, float beta_end, unsigned long long beta_steps, float* beta_out,
        int* out_index, float* out_weight, unsigned int* counter,
        unsigned int* err_counts, unsigned int* err_published,
        const float* obs, const float* next_obs, const int* action, const float* reward,
        const float* done, int obs_dim, float* batch_obs, float* batch_next_obs, int* batch_action,
        float* batch_reward, float* batch_done, const int* gate) {
    dt_wait_prior_grid();
    dt_allow_dependents();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int j = blockIdx.x * SAMPLE_WARPS + warp;
    const bool draws = j < batch;
    // A training loop's step that is not due draws and writes nothing. The gate
    // word is loaded with the walk's first loads and tested once they are issued.
    const int gated = dt_read_flag(gate);
    const double total = draws ? nodes[0] : 0.0;
    const double first = draws ? dt_tree_first_level(nodes, leaves, height) : 0.0;
    const long long counted = draws && uniforms == nullptr ? (long long)*step : 0;
    dt_issued(gated);
    dt_issued(total);
    dt_issued(first);
    dt_issued(counted);
    if (gated) return;
    float p = 0.0f;
    int leaf = 0;
    if (draws) {
        const double u = uniforms ? uniforms[j] : dt_uniform53(seed, (unsigned long long)counted, (unsigned int)j);
        const double mass = ((double)j + u) * total / (double)batch;
        if (total > 0.0) {
            leaf = dt_tree_descend(nodes, leaves, capacity, height, first, mass, total * 0x1p-40, p);
        } else {
            // A root <= 0 is an empty tree or sums that disagree with the leaves: only the leaves can
            // tell. Start from this sample's stratum of the leaf range.
            const int groups = dt_level_real(capacity, 1);
            leaf = dt_tree_nearest_live(leaves, groups, (int)((long long)j * groups / batch), p);
        }
        if (leaf < 0) {
            leaf = 0;
            p = 0.0f;
            if (lane == 0) dt_raise(err_counts, err_published, DT_ERR_EMPTY);
        }
        if (lane == 0) {
            out_index[j] = leaf;
            out_weight[j] = p;  // the leaf value, until the last block turns it into a weight
        }
    }
    if (counter == nullptr) {
        // A split draw: sumtree_weights takes the minimum, writes the weights
        // and advances *step.
        if (blockIdx.x == 0 && threadIdx.x == 0) *beta_out = dt_sample_beta(*step, beta_start, beta_end, beta_steps);
    } else if (dt_last_block(counter, gridDim.x)) {  // block-uniform, so the barriers below are safe
        // The weights need the batch minimum: the last block stages every leaf
        // value in shared memory with one round of loads, takes the minimum
        // there and writes the weights.
        extern __shared__ float batch_p[];  // `batch` floats
        __shared__ float reduce[SAMPLE_WARPS];
        const unsigned long long s = *step;  // read by every thread before thread 0 advances it
        const float beta = dt_sample_beta(s, beta_start, beta_end, beta_steps);
        float m = dt_inf();
#pragma unroll 4
        for (int k = threadIdx.x; k < batch; k += SAMPLE_THREADS) {
            const float pk = __ldcg(&out_weight[k]);
            batch_p[k] = pk;
            m = fminf(m, pk);
        }
        const float p_min = dt_block_min<SAMPLE_THREADS>(m, reduce);
        for (int k = threadIdx.x; k < batch; k += SAMPLE_THREADS) out_weight[k] = dt_is_weight(p_min, batch_p[k], beta);
        if (threadIdx.x == 0) {
            *step = s + 1ull;
            if (beta_out != nullptr) *beta_out = beta;
        }
    }
    // The gather comes last: its HBM round trip overlaps the weights tail
    // instead of delaying the counter. Action, reward and done are loaded
    // before any store: a load may not move above a store to the batch (the
    // pointers could alias), so loaded after the rows' stores each would cost
    // a round trip. A row longer than 32 elements (float4s on the 16-byte
    // path) still loads and stores a warp's width at a time.
    if (j < batch && obs_dim > 0) {
        const long long src = (long long)leaf * obs_dim, dst = (long long)j * obs_dim;
        int a = 0;
        float r = 0.0f, dn = 0.0f;
        if (lane == 0) {
            a = action[leaf];
            r = reward[leaf];
            dn = done[leaf];
        }
        dt_issued(a);
        dt_issued(r);
        dt_issued(dn);
        if ((obs_dim & 3) == 0) {
            // 16-byte accesses, both loads issued before either store: a row of
            // 128 floats is one load per lane per array, one HBM round trip.
            const float4* o = reinterpret_cast<const float4*>(obs + src);
            const float4* no = reinterpret_cast<const float4*>(next_obs + src);
            float4* bo = reinterpret_cast<float4*>(batch_obs + dst);
            float4* bno = reinterpret_cast<float4*>(batch_next_obs + dst);
            for (int d = lane; d < (obs_dim >> 2); d += 32) {
                const float4 x = __ldg(o + d), y = __ldg(no + d);
                bo[d] = x;
                bno[d] = y;
            }
        } else {
            for (int d = lane; d < obs_dim; d += 32) {
                const float x = __ldg(obs + src + d), y = __ldg(next_obs + src + d);
                batch_obs[dst + d] = x;
                batch_next_obs[dst + d] = y;
            }
        }
        if (lane == 0) {
            batch_action[j] = a;
            batch_reward[j] = r;
            batch_done[j] = dn;
        }
    }
}

// sumtree_weights: the second launch of a split draw (sumtree_sample with a
// null counter), after that launch:
//   w_j = (p_min / p_j)^beta, p_min = min_k drawn[k] over the batch (0 where
//   p_j is 0), into out_weight[j]; block 0 then advances *step and copies the
//   beta the sampler used (beta_in) to beta_out when that is not null. No block
//   reads *step but block 0, and each block takes the minimum itself (a minimum
//   has no order): the weights are sumtree_sample's last block's, bit for bit.
//   While *gate != 0 (gate not null) nothing is written.
// Launch: block WEIGHTS_THREADS (pinned), grid = ceil(B / WEIGHTS_THREADS):
// one warp a block, so a batch of 64 already takes two blocks (each block
// reads the whole batch; the launch runs off the chain). `drawn` and
// `out_weight` must not overlap.
constexpr int WEIGHTS_THREADS = 32;

extern "C" __global__ void __launch_bounds__(WEIGHTS_THREADS) sumtree_weights(
        const float* drawn, int batch, const float* beta_in, unsigned long long* step, float* beta_out,
        float* out_weight, const int* gate) {
    dt_wait_prior_grid();
    dt_allow_dependents();
    if (gate != nullptr && *gate) return;
    __shared__ float reduce[WEIGHTS_THREADS / 32];
    const float beta = *beta_in;
    const int j = blockIdx.x * WEIGHTS_THREADS + threadIdx.x;
    const float pj = j < batch ? __ldcg(&drawn[j]) : 0.0f;
    float m = dt_inf();
#pragma unroll 4
    for (int k = threadIdx.x; k < batch; k += WEIGHTS_THREADS) m = fminf(m, __ldcg(&drawn[k]));
    const float p_min = dt_block_min<WEIGHTS_THREADS>(m, reduce);
    if (j < batch) out_weight[j] = dt_is_weight(p_min, pj, beta);
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        *step += 1ull;
        if (beta_out != nullptr) *beta_out = beta;
    }
}
