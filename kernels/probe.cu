// Probe kernels for launch-overhead and synchronisation benchmarks and graph tests.
//
// noop8: eight arguments of mixed kinds (4 pointers, 2 ints, 2 floats) and
// almost no work, so a launch costs what the host and driver spend on it.
// Launch: any shape. Writes out[0] only when n == -1 (never in benchmarks),
// which keeps the arguments live.
#include "common.cuh"

extern "C" __global__ void noop8(float* out, const float* a, const float* b, const float* c,
                                 int n, int m, float x, float y) {
    dt_wait_prior_grid();
    dt_allow_dependents();
    if (n == -1 && dt_thread_index() == 0) out[0] = a[0] + b[0] + c[0] + (float)m + x * y;
}

// What one synchronisation costs (tools/bench_sync.py); each hands data over and
// counts a stale read in *errors, so a broken ordering cannot pass as a fast one.
// sync_chain: one node of a chain of kernels. Round r reads what round r - 1 wrote
// for the next block and writes its own word of the other half of `data` (2 x grid
// words), so no round reads a word that it also writes.
extern "C" __global__ void sync_chain(unsigned int* data, unsigned int* errors, int round) {
    dt_wait_prior_grid();
    dt_allow_dependents();
    if (threadIdx.x == 0) {
        const unsigned int blocks = gridDim.x;
        if (round > 0) {
            const unsigned int seen = __ldcg(&data[((round - 1) & 1) * blocks + (blockIdx.x + 1) % blocks]);
            if (seen != (unsigned int)(round - 1)) atomicAdd(errors, 1u);
        }
        data[(round & 1) * blocks + blockIdx.x] = (unsigned int)round;
    }
}

// sync_grid: `rounds` grid barriers (dt_grid_barrier; a cooperative launch), each
// after a write that the next block reads after it. `data`: 2 x grid words.
extern "C" __global__ void sync_grid(unsigned int* word, unsigned int* data, unsigned int* errors, int rounds) {
    dt_wait_prior_grid();
    dt_allow_dependents();
    for (int r = 0; r < rounds; ++r) {
        unsigned int* slot = data + (r & 1) * gridDim.x;
        if (threadIdx.x == 0) slot[blockIdx.x] = (unsigned int)r;
        dt_grid_barrier(word);
        if (threadIdx.x == 0 && __ldcg(&slot[(blockIdx.x + 1) % gridDim.x]) != (unsigned int)r)
            atomicAdd(errors, 1u);
    }
}

// sync_cluster: `rounds` cluster barriers, each after a write into the next block's
// shared memory (a cluster launch; compute capability 9.0+).
extern "C" __global__ void sync_cluster(unsigned int* errors, int rounds) {
    __shared__ unsigned int slot[2];
    dt_wait_prior_grid();
    dt_allow_dependents();
    const unsigned int rank = dt_cluster_rank(), size = dt_cluster_blocks();
    const unsigned int remote = dt_cluster_address((unsigned int)__cvta_generic_to_shared(&slot[0]), (rank + 1) % size);
    dt_cluster_barrier();  // every block has started before any writes into another
    for (int r = 0; r < rounds; ++r) {
        if (threadIdx.x == 0) dt_cluster_store(remote + 4u * (r & 1), (unsigned int)r);
        dt_cluster_barrier();
        if (threadIdx.x == 0 && ((volatile unsigned int*)slot)[r & 1] != (unsigned int)r) atomicAdd(errors, 1u);
    }
    dt_cluster_barrier();  // no block leaves while another may still write into it
}
