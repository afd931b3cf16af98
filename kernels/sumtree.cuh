// The device side of drvtrain's sum tree.
//
// Layout: leaf_base = a power of two >= max(capacity, 2). Internal sums are
// fp64 in nodes[1 .. leaf_base-1] (nodes[1] is the total; the children of k are
// 2k and 2k+1). Leaf values p = priority^alpha are fp32 in leaves[0 ..
// leaf_base-1]; leaves past the capacity stay 0. The parent of leaf i is
// node (leaf_base + i) >> 1.
//
// Why fp64 internal nodes: updates add differences atomically, and fp32 sums
// drift away from their leaves over millions of updates (each add rounds at
// 2^-24 of the running sum). In fp64 the same drift is 2^29 times smaller, so
// the tree stays within 1e-12 of an exact rebuild after 10^6 updates (see the
// drift test and docs/perf-notes.md); rebuild() still exists to restore
// bit-exact sums.
#pragma once

// Error flags in mapped host memory: plain stores of 1, so no atomics cross the bus.
enum { DT_ERR_INDEX = 0, DT_ERR_PRIORITY = 1, DT_ERR_EMPTY = 2, DT_ERR_COUNT = 4 };

// Write leaf i and carry the difference up to the root. Concurrent writers
// of the same leaf each see the value they replaced, so the differences
// telescope: every internal node still equals the sum of its children.
__device__ __forceinline__ void dt_tree_set_leaf(double* nodes, float* leaves, int leaf_base, int i, float p) {
    float old = atomicExch(&leaves[i], p);
    double diff = (double)p - (double)old;
    if (diff != 0.0) {
        for (int k = (leaf_base + i) >> 1; k >= 1; k >>= 1) atomicAdd(&nodes[k], diff);
    }
}

// Walk from the root to the leaf holding prefix mass `mass`: left when the
// left sum exceeds the mass, else subtract it and go right. A subtree whose
// sum is at most `empty` is never entered, so rounding at a segment edge can
// not end on a zero leaf; it clamps to the last non-zero leaf instead.
__device__ __forceinline__ int dt_tree_descend(const double* nodes, const float* leaves, int leaf_base,
                                               double mass, double empty) {
    int k = 1;
    const int half = leaf_base >> 1;
    while (k < half) {
        double left = nodes[2 * k], right = nodes[2 * k + 1];
        bool left_ok = left > empty, right_ok = right > empty;
        if (right_ok && !(left_ok && left > mass)) {
            mass -= left;
            k = 2 * k + 1;
        } else {
            k = 2 * k;
        }
    }
    int a = 2 * k - leaf_base;
    float left = leaves[a], right = leaves[a + 1];
    bool left_ok = left > 0.0f, right_ok = right > 0.0f;
    return (right_ok && !(left_ok && (double)left > mass)) ? a + 1 : a;
}
