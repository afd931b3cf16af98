// Replay storage: insertion into the ring of transitions, with new entries
// entering the sum tree at the largest leaf value seen so far.
#include "common.cuh"
#include "sumtree.cuh"

// replay_insert: write n transitions at slots (cursor + t) mod capacity,
// t < n <= capacity, and set each slot's leaf to *max_leaf; the last block
// then recomputes their ancestors in the sum tree (dt_tree_refresh_range).
// state[0] = transitions ever inserted (the cursor), state[1] = stored count.
// Launch: one warp per transition, block INSERT_THREADS (pinned), grid =
// ceil(n / INSERT_WARPS). The last block (dt_last_block) advances the cursor
// and count, so the kernel replays correctly inside a graph. Inputs may be
// device or mapped memory. Deterministic: each slot is written by exactly one
// warp, and the tree's sums in a fixed order.
constexpr int INSERT_THREADS = 128;
constexpr int INSERT_WARPS = INSERT_THREADS / 32;

extern "C" __global__ void __launch_bounds__(INSERT_THREADS) replay_insert(
        float* obs, float* next_obs, int* action, float* reward, float* done, int obs_dim, int capacity,
        const float* in_obs, const float* in_next_obs, const int* in_action, const float* in_reward,
        const float* in_done, int n, long long* state, double* nodes, float* leaves,
        const float* max_leaf, int tree_height, int tree_internal, unsigned int* counter) {
    dt_wait_prior_grid();
    dt_allow_dependents();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int t = blockIdx.x * INSERT_WARPS + warp;
    if (t < n) {
        const int slot = (int)((state[0] + t) % capacity);
        const long long src = (long long)t * obs_dim, dst = (long long)slot * obs_dim;
        // Action, reward, done and the largest leaf are loaded before any
        // store: a load may not move above a store to the ring (the pointers
        // could alias), so loaded after the row's stores each would be its own
        // round trip. A row longer than 32 floats still loads and stores a
        // warp's width at a time.
        int a = 0;
        float r = 0.0f, dn = 0.0f, p = 0.0f;
        if (lane == 0) {
            a = in_action[t];
            r = in_reward[t];
            dn = in_done[t];
            p = *max_leaf;
        }
        dt_issued(a);
        dt_issued(r);
        dt_issued(dn);
        dt_issued(p);
        for (int d = lane; d < obs_dim; d += 32) {
            const float x = in_obs[src + d], y = in_next_obs[src + d];
            obs[dst + d] = x;
            next_obs[dst + d] = y;
        }
        if (lane == 0) {
            action[slot] = a;
            reward[slot] = r;
            done[slot] = dn;
            leaves[slot] = p;
        }
    }
    // Every block has read the cursor before it arrives, so the last one may move
    // it, once the refresh (which ends with a block barrier) has read it too.
    if (!dt_last_block(counter, gridDim.x)) return;
    dt_tree_refresh_range(nodes, leaves, capacity, tree_height, tree_internal, state[0], n);
    if (threadIdx.x == 0) {
        const long long stored = state[1] + n;
        state[0] += n;
        state[1] = stored < capacity ? stored : capacity;
    }
}
