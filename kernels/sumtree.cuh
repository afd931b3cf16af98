// The device side of drvtrain's sum tree: a 32-ary tree, so that one warp
// reads all the children of a node in a single coalesced access.
//
// Layout for `capacity` leaves and `height` H (the smallest H with
// ceil(capacity / 32^H) == 1):
//   leaves: fp32 leaf values p = priority^alpha, capacity rounded up to a
//           multiple of 32; padding leaves stay 0.
//   nodes:  fp64 internal sums, level by level from the root down. Level h
//           (1 <= h <= H) holds ceil(capacity / 32^h) nodes, padded to a
//           multiple of 32; node n of level h sums children 32n .. 32n+31 of
//           level h-1 (level 0 = the leaves). The root is nodes[0], the total.
//
// Why fp64 internal sums: updates add differences atomically, and fp32 sums
// drift from their leaves over millions of updates (every add rounds at 2^-24
// of the running sum). In fp64 the same rounding is 2^29 times smaller: after
// 10^6 updates at capacity 2^20 the root still matches an exact sum of the
// leaves to better than 1e-12 (measured: docs/perf-notes.md). rebuild()
// restores sums that are exact up to one rounding per add.
//
// Why the sampler reads the leaves when the sums say otherwise: the fp64 error
// is relative to the largest sums a node ever held, not to what it holds now.
// Leaves once near 1e6, all set back to 0, leave their ancestors holding a
// residue of 1e-10 or more, of either sign, while one live leaf elsewhere is
// 1e-6: a dead node can then outweigh live ones, and the root can even be
// <= 0 while a leaf is not. So the walk takes the sums as a guide only: when
// it reaches 32 leaves that are all 0, or the root is not positive, the warp
// scans the leaves themselves for the nearest non-zero one
// (dt_tree_nearest_live). Only when every leaf is 0 does the sampler raise
// DT_ERR_EMPTY. The scan is the rare path; rebuild() removes the residue that
// leads to it.
#pragma once

#define DT_FULL_MASK 0xffffffffu

// Error flags, raised with dt_raise (common.cuh); the order matches the flag
// names in drvtrain/rl/sumtree.py.
enum { DT_ERR_INDEX = 0, DT_ERR_PRIORITY = 1, DT_ERR_EMPTY = 2, DT_ERR_COUNT = 3 };

// Nodes at level h >= 1 that cover real leaves: ceil(capacity / 32^h).
__device__ __forceinline__ int dt_level_real(int capacity, int h) {
    long long span = 1ll << (5 * h);
    return (int)(((long long)capacity + span - 1) >> (5 * h));
}

// Entries level h occupies in `nodes`: the real nodes padded to a multiple of 32.
__device__ __forceinline__ int dt_level_size(int capacity, int h) {
    return (dt_level_real(capacity, h) + 31) & ~31;
}

// Write leaf i and carry the difference up to the root. Concurrent writers
// of the same leaf each see the value they replaced, so the differences
// telescope: every internal node still equals the sum of its children.
// `internal` is the length of `nodes`; level 1 sits at its end.
// Add `diff` to the ancestors of leaf i below the root (levels 1 .. height-1).
__device__ __forceinline__ void dt_tree_add_below_root(double* nodes, int capacity, int height, int internal,
                                                       int i, double diff) {
    int offset = internal;
    for (int h = 1; h < height; ++h) {
        offset -= dt_level_size(capacity, h);
        atomicAdd(&nodes[offset + (int)((long long)i >> (5 * h))], diff);
    }
}

__device__ __forceinline__ void dt_tree_set_leaf(double* nodes, float* leaves, int capacity, int height,
                                                 int internal, int i, float p) {
    float old = atomicExch(&leaves[i], p);
    double diff = (double)p - (double)old;
    if (diff == 0.0) return;
    dt_tree_add_below_root(nodes, capacity, height, internal, i, diff);
    atomicAdd(&nodes[0], diff);
}

// Deterministic warp sum (fixed butterfly order).
__device__ __forceinline__ double dt_warp_sum(double v) {
#pragma unroll
    for (int d = 16; d >= 1; d >>= 1) v += __shfl_xor_sync(DT_FULL_MASK, v, d);
    return v;
}

// The nearest non-zero leaf to the group of 32 leaves `group` (level-1 node
// `group`), looking at groups at distance 0, 1, 2, ... below and above it: one
// coalesced load per group. Below is taken before above, and within a group
// the leaf nearest `group` (the last one below, the first one above), so the
// answer is deterministic. Returns -1, with leaf_value 0, when all `groups`
// groups hold only zeros. Every lane of the warp must call it; every lane
// gets the same answer. Terminates after at most `groups` rounds.
__device__ __forceinline__ int dt_tree_nearest_live(const float* leaves, int groups, int group,
                                                    float& leaf_value) {
    const int lane = threadIdx.x & 31;
    for (int d = 0; d < groups; ++d) {
        const int below = group - d, above = group + d;
        if (below < 0 && above >= groups) break;
        const float lo = below >= 0 ? leaves[below * 32 + lane] : 0.0f;
        const float hi = above < groups ? leaves[above * 32 + lane] : 0.0f;
        const unsigned lo_mask = __ballot_sync(DT_FULL_MASK, lo > 0.0f);
        const unsigned hi_mask = __ballot_sync(DT_FULL_MASK, hi > 0.0f);
        if (lo_mask) {
            const int c = 31 - __clz(lo_mask);
            leaf_value = __shfl_sync(DT_FULL_MASK, lo, c);
            return below * 32 + c;
        }
        if (hi_mask) {
            const int c = __ffs(hi_mask) - 1;
            leaf_value = __shfl_sync(DT_FULL_MASK, hi, c);
            return above * 32 + c;
        }
    }
    leaf_value = 0.0f;
    return -1;
}

// The whole warp walks from the root to the leaf holding prefix mass `mass`.
// At each node the 32 lanes load the 32 child sums, scan them, and take the
// first child whose running sum exceeds the mass, then subtract the sums
// before it. A child whose sum is at most `empty` (0 for leaves) is never
// taken, so rounding at a segment edge cannot end on a zero leaf: when no
// child qualifies the walk clamps to the last non-empty one. A group of 32
// leaves with none above 0 (reached through fp64 residue, see the top of this
// file) hands over to dt_tree_nearest_live. Every lane returns the leaf index,
// and its value in `leaf_value`; -1 when every leaf is 0.
// `first` is this lane's child of the root, loaded by the caller (see
// dt_tree_first_level) so that its load overlaps the load of the total.
__device__ __forceinline__ int dt_tree_descend(const double* nodes, const float* leaves, int capacity,
                                               int height, double first, double mass, double empty,
                                               float& leaf_value) {
    const int lane = threadIdx.x & 31;
    int node = 0, offset = 0;  // the root: node 0 of level `height`, at nodes[0]
    for (int h = height; h >= 1; --h) {
        const int child = node * 32 + lane;
        double v;
        if (h > 1) offset += dt_level_size(capacity, h);
        if (h == height) {
            v = first;
        } else if (h > 1) {
            v = nodes[offset + child];
        } else {
            v = (double)leaves[child];
        }
        const double threshold = h > 1 ? empty : 0.0;
        double inclusive = v;
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            double t = __shfl_up_sync(DT_FULL_MASK, inclusive, d);
            if (lane >= d) inclusive += t;
        }
        double exclusive = __shfl_up_sync(DT_FULL_MASK, inclusive, 1);
        if (lane == 0) exclusive = 0.0;
        const bool live = v > threshold;
        const unsigned live_mask = __ballot_sync(DT_FULL_MASK, live);
        if (h == 1 && live_mask == 0)  // warp-uniform: the ballot is the same in every lane
            return dt_tree_nearest_live(leaves, dt_level_real(capacity, 1), node, leaf_value);
        const unsigned hit_mask = __ballot_sync(DT_FULL_MASK, live && inclusive > mass);
        const int c = hit_mask ? __ffs(hit_mask) - 1 : (live_mask ? 31 - __clz(live_mask) : 0);
        mass -= __shfl_sync(DT_FULL_MASK, exclusive, c);
        node = node * 32 + c;
        if (h == 1) leaf_value = (float)__shfl_sync(DT_FULL_MASK, v, c);
    }
    return node;
}

// This lane's child of the root: level height-1 sits right after the root's
// padded level (32 entries), or the leaves themselves when height is 1.
__device__ __forceinline__ double dt_tree_first_level(const double* nodes, const float* leaves, int height) {
    const int lane = threadIdx.x & 31;
    return height > 1 ? nodes[32 + lane] : (double)leaves[lane];
}

// The priority update of sumtree.cu's sumtree_update over indices t = first,
// first + stride, ... below n (rounded up to a warp): both a multiple of 32, so
// every lane of a warp runs the same iterations. Also a phase of dqn_step.cu's
// cooperative tail.
__device__ __forceinline__ void dt_tree_update(long long first, long long stride, double* nodes, float* leaves,
                                               float* max_leaf, const int* indices, const float* priorities,
                                               float alpha, int n, int capacity, int height, int internal,
                                               unsigned int* err_counts, unsigned int* err_published) {
    // Every lane of a warp runs the same iterations (the grid stride is a multiple
    // of 32), so the root and the running maximum take one atomic per warp instead
    // of one per index: those two addresses are where all updates collide.
    const int lane = threadIdx.x & 31;
    const long long rounded = ((long long)n + 31) & ~31ll;
    for (long long t = first; t < rounded; t += stride) {
        double diff = 0.0;
        float p = 0.0f;
        int i = 0;
        if (t < n) {
            i = indices[t];
            const float pr = priorities[t];
            if (i < 0 || i >= capacity) {
                dt_raise(err_counts, err_published, DT_ERR_INDEX);
            } else if (!(pr >= 0.0f) || isinf(pr)) {
                dt_raise(err_counts, err_published, DT_ERR_PRIORITY);
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
