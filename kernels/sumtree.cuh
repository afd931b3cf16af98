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
// Why the internal sums are never updated by adding differences: additions in
// an order the hardware picks (atomics from many warps) round differently from
// run to run. Instead, whatever writes leaves recomputes every ancestor of the
// leaves it wrote from that node's 32 children, level by level, each node in
// one block (dt_tree_refresh and dt_tree_refresh_range in one block;
// dt_tree_update_partitioned's blocks each their own subtrees, and its last
// block the levels above them), in the fixed order of dt_warp_sum, which
// sumtree_rebuild uses too. So every internal node is, bit for bit, the
// fixed-order sum of its children, and the whole tree is a function of its
// leaves: the same leaves give the same nodes in every run, eager or captured,
// and after rebuild(). No float is added by an atomic.
//
// Why fp64 internal sums: the walk subtracts child sums from a prefix mass at
// every level. A sum in fp64 rounds at 2^-53 of itself, so a leaf of 1e-12 of
// the total still moves the masses; in fp32 (2^-24) a leaf below about 6e-8 of
// its ancestors' sums would vanish from them.
//
// Why the sampler still checks the leaves: sums that disagree with their
// leaves can still reach it (the nodes are a device buffer its owner may
// write, or load from an older file), and the root can be 0 while a caller
// samples. So the walk takes the sums as a guide only: when it reaches 32
// leaves that are all 0, or the root is not positive, the warp scans the
// leaves themselves for the nearest non-zero one (dt_tree_nearest_live).
// Only when every leaf is 0 does the sampler raise DT_ERR_EMPTY.
#pragma once

#define DT_FULL_MASK 0xffffffffu

// Error flags, raised with dt_raise (common.cuh); the order matches the flag
// names in drvtrain/rl/sumtree.py.
enum { DT_ERR_INDEX = 0, DT_ERR_PRIORITY = 1, DT_ERR_EMPTY = 2, DT_ERR_COUNT = 3 };

// The filter (`keep`, `own` below) that holds for every index: the whole tree.
struct DtEveryIndex {
    __device__ bool operator()(int) const { return true; }
};

// Nodes at level h >= 1 that cover real leaves: ceil(capacity / 32^h).
__device__ __forceinline__ int dt_level_real(int capacity, int h) {
    long long span = 1ll << (5 * h);
    return (int)(((long long)capacity + span - 1) >> (5 * h));
}

// Entries level h occupies in `nodes`: the real nodes padded to a multiple of 32.
__device__ __forceinline__ int dt_level_size(int capacity, int h) {
    return (dt_level_real(capacity, h) + 31) & ~31;
}

// Deterministic warp sum (fixed butterfly order).
__device__ __forceinline__ double dt_warp_sum(double v) {
#pragma unroll
    for (int d = 16; d >= 1; d >>= 1) v += __shfl_xor_sync(DT_FULL_MASK, v, d);
    return v;
}

// dt_warp_sum's result, computed by one thread from the 32 values: at the stage
// of distance d, lanes i and i ^ d add the same two numbers (IEEE addition
// commutes), so lane 0 ends with the sum of this pairwise tree, the same bits.
template <int D>
__device__ __forceinline__ void dt_sum32_stage(double (&v)[32]) {
#pragma unroll
    for (int i = 0; i < D; ++i) v[i] += v[i + D];
}

__device__ __forceinline__ double dt_sum32(double (&v)[32]) {
    dt_sum32_stage<16>(v);
    dt_sum32_stage<8>(v);
    dt_sum32_stage<4>(v);
    dt_sum32_stage<2>(v);
    dt_sum32_stage<1>(v);
    return v[0];
}

// Node `node` of level h >= 1 recomputed from its 32 children (the leaves
// when h == 1, else level h-1 at offset `below`), as rebuild computes it.
// Children are read from L2 (__ldcg): other blocks, or other threads of this
// one, wrote them in this launch.
__device__ __forceinline__ void dt_tree_recompute(double* nodes, const float* leaves, int h, int offset, int below,
                                                  int node) {
    double v[32];
    if (h == 1) {
        const float4* p = reinterpret_cast<const float4*>(leaves + (long long)node * 32);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const float4 f = __ldcg(p + j);
            v[4 * j] = f.x;
            v[4 * j + 1] = f.y;
            v[4 * j + 2] = f.z;
            v[4 * j + 3] = f.w;
        }
    } else {
        const double2* p = reinterpret_cast<const double2*>(nodes + below + (long long)node * 32);
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const double2 d = __ldcg(p + j);
            v[2 * j] = d.x;
            v[2 * j + 1] = d.y;
        }
    }
    nodes[offset + node] = dt_sum32(v);
}

// Levels with at most this many nodes are recomputed once a node by
// dt_tree_refresh (a claim bit a node in shared memory); wider ones once an
// index, duplicates included (the same bits, written twice).
constexpr int DT_TREE_CLAIM_NODES = 32768;

// The walk both refreshes share: level by level from `first` (1: the leaves'
// parents) up to `last` (the root: height), the calling block runs
// `level(h, offset, below)` (level h at `offset`, its children's level at
// `below`), which recomputes the nodes of level h it picks, then a block
// barrier, so that level h + 1 reads them.
template <class Level>
__device__ __forceinline__ void dt_tree_levels(int capacity, int height, int internal, Level level, int first = 1,
                                               int last = 1 << 30) {
    int below = internal, offset = internal;  // levels h-1 and h
    for (int h = 1; h <= min(height, last); ++h) {
        offset -= dt_level_size(capacity, h);
        if (h >= first) {
            level(h, offset, below);
            __threadfence_block();
            __syncthreads();
        }
        below = offset;
    }
}

// The claim bits of one level, a bit a node: one array for every refresh of a
// kernel (a function's shared variable, not a template's).
__device__ __forceinline__ unsigned int* dt_tree_claims() {
    __shared__ unsigned int claims[DT_TREE_CLAIM_NODES / 32];
    return claims;
}

// Every ancestor of the leaves indices[0 .. n) that lie in [0, capacity)
// (others are skipped), recomputed from its children level by level up to the
// root, by the calling block: every thread of the block calls it, with any
// block size that is a multiple of 32. Before the call the block must see
// every leaf write (a barrier after its own, dt_last_block or a grid barrier
// after the grid's); the call ends with a block barrier.
// dt_tree_refresh_levels: levels first .. last only, and only the ancestors of
// the indices that `keep(i)` holds for; dt_tree_refresh: all of them.
template <class Keep>
__device__ __forceinline__ void dt_tree_refresh_levels(double* nodes, const float* leaves, int capacity, int height,
                                                       int internal, const int* indices, int n, int first, int last,
                                                       Keep keep) {
    unsigned int* claims = dt_tree_claims();
    dt_tree_levels(capacity, height, internal, [&](int h, int offset, int below) {
        const int real = dt_level_real(capacity, h);
        const bool claim = real <= DT_TREE_CLAIM_NODES;
        if (claim) {
            for (int w = threadIdx.x; w < (real + 31) / 32; w += blockDim.x) claims[w] = 0u;
            __syncthreads();
        }
        for (int t = threadIdx.x; t < n; t += blockDim.x) {
            const int i = __ldg(indices + t);
            if (i < 0 || i >= capacity || !keep(i)) continue;
            const int node = (int)((long long)i >> (5 * h));
            if (claim) {
                const unsigned int bit = 1u << (node & 31);
                if (atomicOr(&claims[node >> 5], bit) & bit) continue;  // another thread has it
            }
            dt_tree_recompute(nodes, leaves, h, offset, below, node);
        }
    }, first, last);
}

__device__ __forceinline__ void dt_tree_refresh(double* nodes, const float* leaves, int capacity, int height,
                                                int internal, const int* indices, int n) {
    dt_tree_refresh_levels(nodes, leaves, capacity, height, internal, indices, n, 1, height, DtEveryIndex());
}

// Every ancestor of the leaves first, first + 1, ..., first + count - 1, taken
// mod capacity (1 <= count <= capacity), by the calling block, as
// dt_tree_refresh: the nodes of each level form one range, or two where the
// slots wrap past the end.
__device__ __forceinline__ void dt_tree_refresh_range(double* nodes, const float* leaves, int capacity, int height,
                                                      int internal, long long first, int count) {
    const int a = (int)(first % capacity);
    const long long end = (long long)a + count - 1;  // past capacity - 1: the slots wrap to 0
    dt_tree_levels(capacity, height, internal, [&](int h, int offset, int below) {
        const int lo = (int)((long long)a >> (5 * h));
        int hi, wrapped = -1;  // nodes lo .. hi, then 0 .. wrapped
        if (end < capacity) {
            hi = (int)(end >> (5 * h));
        } else {
            hi = (int)((long long)(capacity - 1) >> (5 * h));
            wrapped = (int)((end - capacity) >> (5 * h));
            if (wrapped >= lo) wrapped = lo - 1;  // they meet at node lo: one range, each node once
        }
        const int first_range = hi - lo + 1, total = first_range + wrapped + 1;
        for (int t = threadIdx.x; t < total; t += blockDim.x)
            dt_tree_recompute(nodes, leaves, h, offset, below, t < first_range ? lo + t : t - first_range);
    });
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
// leaves with none above 0 (reached through sums that disagree with it, see
// the top of this file) hands over to dt_tree_nearest_live. Every lane returns the leaf index,
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

// The leaves of the priority update of sumtree.cu's sumtree_update over
// indices t = first, first + stride, ... below n (rounded up to a warp): the
// lanes of a warp start in one aligned group of 32 and stride is a multiple
// of 32, so every lane of a warp runs the same iterations. The
// caller then refreshes their ancestors (dt_tree_refresh) in one block. Also
// a phase of dqn_step.cu's cooperative tail. Duplicate indices are legal: the
// leaf ends as one of the values written to it.
// dt_tree_write_leaves writes only the leaves i that `own(i)` holds for (a
// bad priority raises its flag only there), and raises the flag of an index
// outside [0, capacity) only when report_bad_index is set.
template <class Own>
__device__ __forceinline__ void dt_tree_write_leaves(long long first, long long stride, float* leaves,
                                                     float* max_leaf, const int* indices, const float* priorities,
                                                     float alpha, int n, int capacity, unsigned int* err_counts,
                                                     unsigned int* err_published, bool report_bad_index, Own own) {
    // The running maximum takes one atomic a warp: it is where all updates
    // collide. An integer maximum: its result does not depend on the order.
    const int lane = threadIdx.x & 31;
    const long long rounded = ((long long)n + 31) & ~31ll;
    for (long long t = first; t < rounded; t += stride) {
        float p = 0.0f;
        if (t < n) {
            const int i = indices[t];
            const float pr = priorities[t];
            if (i < 0 || i >= capacity) {
                if (report_bad_index) dt_raise(err_counts, err_published, DT_ERR_INDEX);
            } else if (!own(i)) {
            } else if (!(pr >= 0.0f) || isinf(pr)) {
                dt_raise(err_counts, err_published, DT_ERR_PRIORITY);
            } else {
                p = alpha == 1.0f ? pr : powf(pr, alpha);
                atomicExch(&leaves[i], p);
            }
        }
        float largest = p;
#pragma unroll
        for (int d = 16; d >= 1; d >>= 1) largest = fmaxf(largest, __shfl_xor_sync(DT_FULL_MASK, largest, d));
        // >= 0: the int order of the bits is the float order
        if (lane == 0) atomicMax(reinterpret_cast<int*>(max_leaf), __float_as_int(largest));
    }
}

__device__ __forceinline__ void dt_tree_update(long long first, long long stride, float* leaves, float* max_leaf,
                                               const int* indices, const float* priorities, float alpha, int n,
                                               int capacity, unsigned int* err_counts,
                                               unsigned int* err_published) {
    dt_tree_write_leaves(first, stride, leaves, max_leaf, indices, priorities, alpha, n, capacity, err_counts,
                         err_published, true, DtEveryIndex());
}

// The level dt_tree_update_partitioned splits at: the highest level below the
// root with at least `blocks` nodes, so that every block owns some of its
// nodes; 0 (the leaves) when even level 1 has fewer.
__device__ __forceinline__ int dt_tree_split_level(int capacity, int height, unsigned int blocks) {
    for (int h = height - 1; h >= 1; --h)
        if ((unsigned int)dt_level_real(capacity, h) >= blocks) return h;
    return 0;
}

// sumtree.cu's sumtree_update (the same leaves, sums and flags) with the
// refresh spread over the grid: block b owns the subtrees of the nodes j of
// the split level s (dt_tree_split_level) with j mod grid == b. It writes
// their leaves among indices[0 .. n) (every block reads every index: for n up
// to a few thousand) and refreshes their levels 1 .. s, which no other block
// writes or reads, with no hand-over below level s; the last block to finish
// (dt_last_block on `counter`) then recomputes levels s + 1 .. height (the
// root alone where s is height - 1). An index outside [0, capacity) raises its
// flag in block 0 only, a bad priority in the block owning its leaf: once
// each, as above.
__device__ __forceinline__ void dt_tree_update_partitioned(double* nodes, float* leaves, float* max_leaf,
                                                           const int* indices, const float* priorities, float alpha,
                                                           int n, int capacity, int height, int internal,
                                                           unsigned int* err_counts, unsigned int* err_published,
                                                           unsigned int* counter) {
    const unsigned int blocks = gridDim.x, mine = blockIdx.x;
    const int split = dt_tree_split_level(capacity, height, blocks);
    const auto own = [&](int i) { return (unsigned int)(((long long)i >> (5 * split)) % blocks) == mine; };
    dt_tree_write_leaves(threadIdx.x, blockDim.x, leaves, max_leaf, indices, priorities, alpha, n, capacity,
                         err_counts, err_published, mine == 0, own);
    __threadfence_block();
    __syncthreads();
    dt_tree_refresh_levels(nodes, leaves, capacity, height, internal, indices, n, 1, split, own);
    if (!dt_last_block(counter, gridDim.x)) return;
    dt_tree_refresh_levels(nodes, leaves, capacity, height, internal, indices, n, split + 1, height, DtEveryIndex());
}
