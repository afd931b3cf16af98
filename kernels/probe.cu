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

// Two other grid barriers, as ways to compare dt_grid_barrier with (same word, same
// flip of its top bit; common.cuh says how the word counts):
// - probe_grid_barrier_fenced: every thread fences (fence.sc) before the block
//   barrier and after the wait, and the first thread polls with acquire loads;
// - probe_grid_barrier_red: the first thread reads the word before the block barrier
//   (the bit it holds cannot flip before this block arrives), arrives with a reduction
//   that returns nothing, and polls relaxed from then on.
__device__ __forceinline__ void probe_grid_barrier_fenced(unsigned int* word) {
    __threadfence();
    __syncthreads();
    if (dt_first_thread()) {
        const unsigned int add = dt_grid_barrier_add();
        const unsigned int seen = atomicAdd(word, add);
        unsigned int now;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(now) : "l"(word) : "memory");
        } while (((now ^ seen) & 0x80000000u) == 0u);
    }
    __syncthreads();
    __threadfence();
}

__device__ __forceinline__ void probe_grid_barrier_red(unsigned int* word) {
    unsigned int before = 0;
    if (dt_first_thread()) asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(before) : "l"(word) : "memory");
    __syncthreads();
    if (dt_first_thread()) {
        const unsigned int add = dt_grid_barrier_add();
        asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(word), "r"(add) : "memory");
        unsigned int now;
        do {
            asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(now) : "l"(word) : "memory");
        } while (((now ^ before) & 0x80000000u) == 0u);
        asm volatile("fence.acq_rel.gpu;" ::: "memory");
    }
    __syncthreads();
}

// sync_grid: `rounds` grid-wide joins (a cooperative launch). Modes 0 to 2: a grid
// barrier after a write by the block's last thread, which thread 0 of the block before
// reads after it, so the barrier must carry another thread's write. `data`: 2 x grid
// words; 0: dt_grid_barrier; 1: probe_grid_barrier_fenced; 2: probe_grid_barrier_red;
// 3: dt_grid_barrier alone, nothing handed over.
// Mode 4, a join with no barrier: the block's last thread stores one 8-byte word that
// holds its value and the round's tag together (single-copy atomic, so a word with the
// tag holds the value), and the first warp of every block polls every block's word of
// the round until all carry the tag, checking each value. `data`: 2 x grid 8-byte
// words (4 x grid uint32), a half a round, so a block writes round r + 1 into the other
// half while a slower one still polls round r, and reaches round r + 2 only once every
// block has written r + 1, that is, has finished polling r. Tags start at 1; the words
// are zeroed after a last dt_grid_barrier, so the next launch sees no old tag. At most
// 32 x POLL_WORDS blocks (mode 4 does nothing on a larger grid and counts it an error),
// and blocks of whole warps (its first warp polls with __all_sync over all 32 lanes).
#define POLL_WORDS 9
extern "C" __global__ void sync_grid(unsigned int* word, unsigned int* data, unsigned int* errors, int rounds,
                                     int mode) {
    dt_wait_prior_grid();
    dt_allow_dependents();
    const unsigned int blocks = gridDim.x;
    if (mode == 4) {
        if (blocks > 32u * POLL_WORDS) {
            if (dt_first_thread() && blockIdx.x == 0) atomicAdd(errors, 1u);
            return;
        }
        unsigned long long* words = reinterpret_cast<unsigned long long*>(data);
        for (int r = 0; r < rounds; ++r) {
            unsigned long long* half = words + (r & 1) * blocks;
            const unsigned long long tag = (unsigned long long)(r + 1) << 32;
            if (threadIdx.x == blockDim.x - 1) {
                const unsigned long long mine = tag | (blockIdx.x ^ (unsigned int)r);
                asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(half + blockIdx.x), "l"(mine) : "memory");
            }
            if (threadIdx.x < 32) {
                // A lane's words are loaded together, then checked: each poll is one round trip.
                bool all;
                do {
                    unsigned long long seen[POLL_WORDS];
#pragma unroll
                    for (int i = 0; i < POLL_WORDS; ++i) {
                        const unsigned int b = threadIdx.x + 32u * i;
                        seen[i] = tag;
                        if (b < blocks)
                            asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];"
                                         : "=l"(seen[i]) : "l"(half + b) : "memory");
                    }
                    all = true;
#pragma unroll
                    for (int i = 0; i < POLL_WORDS; ++i) {
                        const unsigned int b = threadIdx.x + 32u * i;
                        if (b >= blocks) continue;
                        if ((seen[i] >> 32) != (unsigned long long)(r + 1))
                            all = false;
                        else if ((unsigned int)seen[i] != (b ^ (unsigned int)r))
                            atomicAdd(errors, 1u);
                    }
                } while (!__all_sync(0xffffffffu, all));
            }
            __syncthreads();
        }
        dt_grid_barrier(word);
        if (threadIdx.x == 0) words[blockIdx.x] = words[blocks + blockIdx.x] = 0ull;
        return;
    }
    for (int r = 0; r < rounds; ++r) {
        unsigned int* slot = data + (r & 1) * blocks;
        if (mode != 3 && threadIdx.x == blockDim.x - 1) slot[blockIdx.x] = (unsigned int)r;
        if (mode == 1)
            probe_grid_barrier_fenced(word);
        else if (mode == 2)
            probe_grid_barrier_red(word);
        else
            dt_grid_barrier(word);
        if (mode != 3 && threadIdx.x == 0 && __ldcg(&slot[(blockIdx.x + 1) % blocks]) != (unsigned int)r)
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

// sync_handover: `rounds` all-to-all hand-overs in clusters of C <= 8 blocks (a cluster
// launch, 256 threads a block, dynamic shared memory 2 x C x 4 KB: two halves, used in
// turn). In round r every block hands its 4 KB slice (1024 words, word i = r << 13 |
// rank << 10 | i) to the same place of every block of its cluster, and then every thread
// checks one word of every block's slice: *errors counts the stale words, *checked the
// words checked.
//   mode 0: remote 8-byte stores by every thread, then a cluster barrier;
//   mode 1: remote 16-byte stores, then a cluster barrier;
//   mode 2: the block writes its slice into its own shared memory and one thread pushes it
//           to every other block with a bulk copy that completes on the receiver's mbarrier
//           for that half; a block waits on its own mbarrier, and no cluster barrier runs.
// Mode 2 needs no barrier per round: a block pushes round r + 2 into a half (and rewrites
// its own slice there) only after its wait of round r + 1, which needs every block's round
// r + 1 push, which each block issues only after its wait of round r (so its round r copies
// have landed) and a block barrier that follows its checks of round r. A cluster barrier
// at the end keeps every block until every copy has landed.
constexpr unsigned int HO_WORDS = 1024;

extern "C" __global__ void __launch_bounds__(256) sync_handover(unsigned int* errors, unsigned long long* checked,
                                                                int rounds, int mode) {
    extern __shared__ __align__(128) unsigned int halves[];  // [2][C][HO_WORDS]
    __shared__ __align__(8) unsigned long long landed[2];    // mode 2: an mbarrier per half
    dt_wait_prior_grid();
    dt_allow_dependents();
    const unsigned int rank = dt_cluster_rank(), size = dt_cluster_blocks(), t = threadIdx.x;
    if (size > 8 || mode < 0 || mode > 2) __trap();
    const unsigned int base = (unsigned int)__cvta_generic_to_shared(halves);
    const unsigned int bars = (unsigned int)__cvta_generic_to_shared(landed);
    if (t == 0) {
        dt_mbar_init(bars, 1);
        dt_mbar_init(bars + 8, 1);
        dt_mbar_init_fence();
    }
    dt_cluster_barrier();  // every block has started, its mbarriers initialised
    unsigned int remote[8];
#pragma unroll
    for (int q = 0; q < 8; ++q) remote[q] = q < (int)size ? dt_cluster_address(base, q) : 0u;
    unsigned int bad = 0;
    for (int r = 0; r < rounds; ++r) {
        const unsigned int half = (r & 1) * size * HO_WORDS;
        const unsigned int mine = half + rank * HO_WORDS;  // this block's slice, in words, in every block
        const unsigned int tag = (unsigned int)r << 13 | rank << 10;
        if (mode == 0) {
#pragma unroll
            for (int p = 0; p < 2; ++p) {
                const unsigned int w = 2 * (t + 256 * p);
#pragma unroll
                for (int q = 0; q < 8; ++q)
                    if (q < (int)size) dt_cluster_store2(remote[q] + 4 * (mine + w), __uint_as_float(tag | w),
                                                         __uint_as_float(tag | (w + 1)));
            }
            dt_cluster_barrier();
        } else if (mode == 1) {
            const unsigned int w = 4 * t;
            const float4 v = make_float4(__uint_as_float(tag | w), __uint_as_float(tag | (w + 1)),
                                         __uint_as_float(tag | (w + 2)), __uint_as_float(tag | (w + 3)));
#pragma unroll
            for (int q = 0; q < 8; ++q)
                if (q < (int)size) dt_cluster_store4(remote[q] + 4 * (mine + w), v);
            dt_cluster_barrier();
        } else {
            const unsigned int w = 4 * t;
            *reinterpret_cast<uint4*>(&halves[mine + w]) = make_uint4(tag | w, tag | (w + 1), tag | (w + 2), tag | (w + 3));
            dt_fence_proxy_async();  // this thread's words, visible to the bulk copies
            __syncthreads();  // the slice is written, and every thread has checked round r - 1
            const unsigned int bar = bars + 8 * (r & 1);
            if (t == 0) {
                dt_mbar_arrive_expect(bar, (size - 1) * HO_WORDS * 4);
                for (unsigned int q = 0; q < size; ++q)
                    if (q != rank)
                        dt_bulk_push(dt_cluster_address(base + 4 * mine, q), base + 4 * mine, HO_WORDS * 4,
                                     dt_cluster_address(bar, q));
            }
            dt_mbar_wait(bar, (r >> 1) & 1);
        }
        for (unsigned int q = 0; q < size; ++q) {
            const unsigned int w = (4 * t + (r & 3)) % HO_WORDS;
            if (((volatile unsigned int*)halves)[half + q * HO_WORDS + w] != ((unsigned int)r << 13 | q << 10 | w)) ++bad;
        }
    }
    if (bad) atomicAdd(errors, bad);
    atomicAdd(checked, (unsigned long long)rounds * size);
    dt_cluster_barrier();  // no block leaves while a copy may still read or write its shared memory
}

// sync_partials: the sum at the end of a product split over a cluster (gemm_sm90a.cu's
// finish_tile), alone: its bytes over the cluster's network, with no k loop, mask or
// global memory. Each block of a cluster of S <= 8 (384 threads) holds a 128 x 128 float
// partial (64 KB of dynamic shared memory), and in each of `rounds` rounds sums rows
// z R .. z R + R - 1 (R = ceil(128 / S)) of the S partials in z order into a result
// buffer in its own shared memory:
//   mode 0: 16-byte loads through the cluster window, the block's own partial too, two
//           pieces' loads in flight before their adds (finish_tile's way);
//   mode 1: each block pushes the rows of every other block's share to it with one bulk
//           copy (into a receive buffer: (S - 1) x R x 512 bytes after the partial), which
//           completes on the receiver's mbarrier; then plain shared loads;
//   mode 2: plain shared loads of the block's own partial S times (no network: the floor).
// Dynamic shared memory: 64 KB + S x R x 512 bytes (the receive and result buffers).
// Round r's partial z holds (z + 1) x ((i + r) mod 256) at element i, so every sum is
// exact and a stale read shows. Each round: write the partial, a cluster barrier, the
// timed part (thread 0's clock64 from there to a block barrier after the sums), the
// check of every sum, a cluster barrier (no block rewrites its partial while another
// reads it). clocks[block] is the timed parts' sum; *errors counts the wrong sums (in
// mode 2, S times the block's own partial is right).
constexpr int SP_THREADS = 384, SP_ROWS = 128;

__device__ __forceinline__ float4 sp_lds4(unsigned int addr) {
    float4 v;
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(addr));
    return v;
}

extern "C" __global__ void __launch_bounds__(SP_THREADS) sync_partials(unsigned int* errors, long long* clocks,
                                                                       int rounds, int mode) {
    extern __shared__ __align__(128) float partial[];  // [128][128], the receive buffer, the results
    __shared__ __align__(8) unsigned long long landed;  // mode 1's mbarrier
    dt_wait_prior_grid();
    dt_allow_dependents();
    const unsigned int z = dt_cluster_rank(), S = dt_cluster_blocks(), t = threadIdx.x;
    if (S > DT_PORTABLE_CLUSTER || mode < 0 || mode > 2 || blockDim.x != SP_THREADS) __trap();
    const int R = (SP_ROWS + (int)S - 1) / (int)S, row0 = min(SP_ROWS, (int)z * R);
    const int rows = min(SP_ROWS, row0 + R) - row0;  // this block's share of the tile's rows
    const unsigned int base = (unsigned int)__cvta_generic_to_shared(partial);
    const unsigned int recv = base + 4u * SP_ROWS * 128, bar = (unsigned int)__cvta_generic_to_shared(&landed);
    float4* result = reinterpret_cast<float4*>(partial + SP_ROWS * 128 + (S - 1) * R * 128);
    if (t == 0) {
        dt_mbar_init(bar, 1);
        dt_mbar_init_fence();
    }
    unsigned int from[DT_PORTABLE_CLUSTER];  // where split s's rows of this block's share are read
#pragma unroll
    for (int s = 0; s < DT_PORTABLE_CLUSTER; ++s) {
        const unsigned int rows_at = 4u * row0 * 128;
        if (s >= (int)S) from[s] = 0u;
        else if (mode == 0) from[s] = dt_cluster_address(base, s) + rows_at;
        else if (mode == 2 || s == (int)z) from[s] = base + rows_at;
        else from[s] = recv + 512u * R * (s < (int)z ? s : s - 1);
    }
    const unsigned int scale = mode == 2 ? S * (z + 1) : S * (S + 1) / 2;
    unsigned int bad = 0;
    long long spent = 0;
    for (int r = 0; r < rounds; ++r) {
        for (int i = t; i < SP_ROWS * 128; i += SP_THREADS)
            partial[i] = (float)((z + 1) * ((unsigned int)(i + r) & 255u));
        dt_fence_proxy_async();  // the partial, visible to the bulk copies
        dt_cluster_barrier();    // every partial written; last round's receive buffers read
        const long long begin = clock64();
        if (mode == 1) {
            if (t == 0) {
                dt_mbar_arrive_expect(bar, (S - 1) * 512u * rows);
                for (unsigned int q = 0; q < S; ++q) {
                    const int q0 = min(SP_ROWS, (int)q * R), qrows = min(SP_ROWS, q0 + R) - q0;
                    if (q == z || qrows == 0) continue;
                    const unsigned int slot = 512u * R * (z < q ? z : z - 1);
                    dt_bulk_push(dt_cluster_address(recv + slot, q), base + 4u * q0 * 128, 512u * qrows,
                                 dt_cluster_address(bar, q));
                }
            }
            dt_mbar_wait(bar, r & 1);
        }
        for (int i = t; i < rows * 32; i += 2 * SP_THREADS) {
            float4 p[2][DT_PORTABLE_CLUSTER];
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                const unsigned int at = 16u * (i + u * SP_THREADS);
                const bool in = i + u * SP_THREADS < rows * 32;
#pragma unroll
                for (int s = 0; s < DT_PORTABLE_CLUSTER; ++s)
                    if (s < (int)S && in) p[u][s] = mode == 0 ? dt_cluster_load4(from[s] + at) : sp_lds4(from[s] + at);
            }
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                if (i + u * SP_THREADS >= rows * 32) continue;
                float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
                for (int s = 0; s < DT_PORTABLE_CLUSTER; ++s)
                    if (s < (int)S) v.x += p[u][s].x, v.y += p[u][s].y, v.z += p[u][s].z, v.w += p[u][s].w;
                result[i + u * SP_THREADS] = v;
            }
        }
        __syncthreads();  // every thread's sums of the round are done
        spent += clock64() - begin;
        for (int i = t; i < rows * 32; i += SP_THREADS) {
            const float4 v = result[i];
            const float w[4] = {v.x, v.y, v.z, v.w};
            const unsigned int e = row0 * 128 + 4 * i + r;
#pragma unroll
            for (int c = 0; c < 4; ++c)
                if (w[c] != (float)(scale * ((e + c) & 255u))) ++bad;
        }
        // No block writes its partial again while another still reads it: in mode 0 every
        // value loaded from another block is stored above, so the arrival may be relaxed;
        // in mode 1 each receiver waited for its copies (its mbarrier) before arriving.
        dt_cluster_arrive_relaxed();
        dt_cluster_wait();
    }
    if (bad) atomicAdd(errors, bad);
    if (t == 0) clocks[(blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x] = spent;
}

// block_sums_32, _128, _256: the block sums of common.cuh, for tests. Block b
// sums in[(i * gridDim.x + b) * THREADS + t] over its threads t for i = 0, 1, 2
// in one pass (dt_block_sums), then sums 0 and 1 again alone, back to back
// (dt_block_sum twice: the second call reuses the first's shared array). Every
// thread writes what it got: out[((b * 5 + i) * THREADS) + t], i = 3, 4 the
// single sums.
template <int THREADS>
__device__ __forceinline__ void block_sums_body(const double* in, double* out) {
    const int b = blockIdx.x, t = threadIdx.x, g = gridDim.x;
    double v[3];
#pragma unroll
    for (int i = 0; i < 3; ++i) v[i] = in[((long long)i * g + b) * THREADS + t];
    const double first = v[0], second = v[1];
    dt_block_sums<THREADS, 3>(v);
    const double single0 = dt_block_sum<THREADS>(first);
    const double single1 = dt_block_sum<THREADS>(second);
#pragma unroll
    for (int i = 0; i < 3; ++i) out[((long long)b * 5 + i) * THREADS + t] = v[i];
    out[((long long)b * 5 + 3) * THREADS + t] = single0;
    out[((long long)b * 5 + 4) * THREADS + t] = single1;
}

extern "C" __global__ void __launch_bounds__(32) block_sums_32(const double* in, double* out) {
    block_sums_body<32>(in, out);
}

extern "C" __global__ void __launch_bounds__(128) block_sums_128(const double* in, double* out) {
    block_sums_body<128>(in, out);
}

extern "C" __global__ void __launch_bounds__(256) block_sums_256(const double* in, double* out) {
    block_sums_body<256>(in, out);
}

// stamp_time: one thread reads %globaltimer (ns) after its grid wait and writes it
// to out[*counter % slots], then advances *counter (tools/stamp_replays.py). As a
// dependent launch it is resident early and reads the timer once every kernel it
// waits for has ended (and its wait has returned); as the first node of a graph,
// when the graph starts. Launch: one block (any size; thread 0 writes).
extern "C" __global__ void stamp_time(unsigned long long* out, unsigned int* counter, int slots) {
    dt_wait_prior_grid();
    dt_allow_dependents();
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    unsigned long long now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    const unsigned int k = *counter;
    out[k % (unsigned int)slots] = now;
    *counter = k + 1;
}
