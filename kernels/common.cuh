// Device helpers shared by drvtrain's kernels.
#pragma once

// Global thread index and grid stride for 1-D grid-stride loops.
__device__ __forceinline__ long long dt_thread_index() {
    return (long long)blockIdx.x * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ long long dt_grid_stride() {
    return (long long)gridDim.x * blockDim.x;
}

// +infinity as float; NVRTC has no <math.h> macros.
__device__ __forceinline__ float dt_inf() { return __int_as_float(0x7f800000); }

__device__ __forceinline__ bool dt_first_thread() {
    return threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0;
}

// ---------------------------------------------------------------- last block
// The last-block protocol: blocks that each wrote partial results to global
// memory arrive at a counter; the block that arrives last sees every partial
// and finishes the reduction. No float atomics, so the result is bitwise
// reproducible for a fixed grid. Every use in drvtrain goes through this.
//
// Memory ordering, argued once:
//  1. A block barrier orders every thread's writes of the block's partials
//     before its first thread's arrival.
//  2. That thread adds to the counter with acquire and release semantics at
//     device scope. The release is cumulative: it covers the block's writes that
//     the barrier ordered before it, so fencing in every thread is not needed.
//     Arrivals are totally ordered on the counter; the block that reads
//     `arrivals - 1` comes after every other block's release, and its acquire
//     makes their partials visible to its first thread.
//  3. A second block barrier passes that on to the last block's threads, which
//     read the partials with __ldcg (L2), never through a possibly stale L1 line.
//  4. The last block resets the counter to 0 at once: every other block has
//     already incremented it, and the next launch on the stream sees the 0,
//     so the kernel replays correctly inside a graph.
// Every thread of the block must call it; the result is block-uniform, so
// barriers inside `if (dt_last_block(...))` are safe.
__device__ __forceinline__ bool dt_last_block(unsigned int* counter, unsigned int arrivals) {
    __shared__ bool last;
    __syncthreads();
    if (dt_first_thread()) {
        unsigned int seen;
        asm volatile("atom.add.acq_rel.gpu.global.u32 %0, [%1], 1;" : "=r"(seen) : "l"(counter) : "memory");
        last = seen == arrivals - 1;
        if (last) *counter = 0u;
    }
    __syncthreads();
    return last;
}

// ---------------------------------------------------------------- block sums
// Sums of doubles over a block of exactly THREADS threads (a power of two, at
// least one warp), one value per thread for each sum, in a fixed tree order:
// level w = THREADS / 2, ..., 2, 1 adds element t + w into element t for every
// t < w, and the sum is element 0. Every thread of the block must call them;
// every thread gets the sums. Kernels pin THREADS with __launch_bounds__ and the
// Python side launches with the kernel's declared block (Kernel.block), so a
// mismatch is refused before launch.
//
// How: the levels w >= 32 pair values of different warps. Every warp reads all
// THREADS values from shared memory in one round (lane l holds elements l,
// l + 32, l + 64, ...) and runs those levels in registers; levels 16 .. 1 are
// shuffles within the warp, and lane 0's result is broadcast. Each add meets
// the same two operands as in a shared-memory tree with a barrier per level,
// so the bits are that tree's, in two barriers instead of log2(THREADS) + 2
// (none for a single warp). Every warp computes the same sums the same way.
// dt_block_sums does N sums in one pass: the same bits as N dt_block_sum calls.
template <int THREADS, int N>
__device__ __forceinline__ void dt_block_sums(double (&v)[N]) {
    static_assert(THREADS >= 32 && (THREADS & (THREADS - 1)) == 0, "THREADS must be a power of two >= 32");
    constexpr int WARPS = THREADS / 32;
    const int lane = threadIdx.x & 31;
    if constexpr (WARPS > 1) {
        __shared__ double sum[N][THREADS];
#pragma unroll
        for (int i = 0; i < N; ++i) sum[i][threadIdx.x] = v[i];
        __syncthreads();
#pragma unroll
        for (int i = 0; i < N; ++i) {
            double r[WARPS];
#pragma unroll
            for (int k = 0; k < WARPS; ++k) r[k] = sum[i][lane + 32 * k];
#pragma unroll
            for (int h = WARPS / 2; h >= 1; h >>= 1)
#pragma unroll
                for (int k = 0; k < h; ++k) r[k] += r[k + h];
            v[i] = r[0];
        }
    }
#pragma unroll
    for (int w = 16; w >= 1; w >>= 1)
#pragma unroll
        for (int i = 0; i < N; ++i) v[i] += __shfl_down_sync(0xffffffffu, v[i], w);
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = __shfl_sync(0xffffffffu, v[i], 0);
    if constexpr (WARPS > 1) __syncthreads();  // the array is free for the next call
}

template <int THREADS>
__device__ __forceinline__ double dt_block_sum(double v) {
    double s[1] = {v};
    dt_block_sums<THREADS, 1>(s);
    return s[0];
}

// dt_block_sum's bits from values already in shared memory (`values[t]` for
// thread t of THREADS), taken by one warp alone: every lane of the calling warp
// must call it (no barrier; the values written before the caller's last one),
// and every lane gets the sum. For a sum only one warp needs. (dt_block_sums
// keeps its own copy of these steps: it interleaves the shuffles of its N sums.)
template <int THREADS>
__device__ __forceinline__ double dt_block_sum_warp0(const double* values) {
    static_assert(THREADS >= 32 && (THREADS & (THREADS - 1)) == 0, "THREADS must be a power of two >= 32");
    constexpr int WARPS = THREADS / 32;
    const int lane = threadIdx.x & 31;
    double r[WARPS];
#pragma unroll
    for (int k = 0; k < WARPS; ++k) r[k] = values[lane + 32 * k];
#pragma unroll
    for (int h = WARPS / 2; h >= 1; h >>= 1)
#pragma unroll
        for (int k = 0; k < h; ++k) r[k] += r[k + h];
    double v = r[0];
#pragma unroll
    for (int w = 16; w >= 1; w >>= 1) v += __shfl_down_sync(0xffffffffu, v, w);
    return __shfl_sync(0xffffffffu, v, 0);
}

// The grid-wide sum of one double per thread: each block writes its sum to
// partials[blockIdx.x]; the last block (dt_last_block) adds the partials in a
// fixed order into `total` and returns true; every other block returns false.
// Bitwise reproducible for a fixed grid.
template <int THREADS>
__device__ __forceinline__ double dt_partials_sum(const double* partials, int count);

template <int THREADS>
__device__ __forceinline__ bool dt_grid_sum_last(double v, double* partials, unsigned int* counter,
                                                 double& total) {
    const double block = dt_block_sum<THREADS>(v);
    if (threadIdx.x == 0) partials[blockIdx.x] = block;
    if (!dt_last_block(counter, gridDim.x)) return false;
    total = dt_partials_sum<THREADS>(partials, gridDim.x);
    return true;
}

// Thread t's share of the sum of partials[0 .. count) in dt_grid_sum_last's
// fixed order: partials t, t + THREADS, ... added to 0 in turn, read from L2.
// The caller may have loaded the first LOADED of them already (to issue those
// loads early), into loaded[0 .. LOADED): loaded[k] stands for partial
// t + k * THREADS and is ignored past count. dt_block_sum of the shares gives
// the same bits in every block that takes it.
template <int THREADS, int LOADED = 0>
__device__ __forceinline__ double dt_partials_share(const double* partials, int count,
                                                    const double* loaded = nullptr) {
    double s = 0.0;
#pragma unroll
    for (int k = 0; k < LOADED; ++k)
        if ((int)threadIdx.x + k * THREADS < count) s += loaded[k];
    for (int b = threadIdx.x + LOADED * THREADS; b < count; b += THREADS) s += __ldcg(&partials[b]);
    return s;
}

// The sum of partials[0 .. count) in dt_grid_sum_last's fixed order (the
// shares, then the block tree): the same bits in every block that calls it.
// Every thread of the block must call it.
template <int THREADS>
__device__ __forceinline__ double dt_partials_sum(const double* partials, int count) {
    return dt_block_sum<THREADS>(dt_partials_share<THREADS>(partials, count));
}

// ---------------------------------------------------------------- error flags
// Errors a kernel finds cannot raise on the device. Flag k is counted in
// device memory (`counts`, a device-scope atomic) and the new count is
// published with a plain store to mapped host memory (`published`). The host
// never writes either array: drvtrain.flags.ErrorFlags reports flag k when its
// published count exceeds the largest it has seen, so no flag raised after a
// check can be lost, whatever the interleaving of host reads and device stores.
__device__ __forceinline__ void dt_raise(unsigned int* counts, unsigned int* published, int k) {
    const unsigned int c = atomicAdd(&counts[k], 1u) + 1u;
    reinterpret_cast<volatile unsigned int*>(published)[k] = c;
}

// ---------------------------------------------------------------- metrics words
// One field of a metrics slot in mapped host memory (drvtrain.nn.Metrics): an
// 8-byte word, naturally aligned, with the float's bits in the low half and
// the step's low 32 bits in the high half, written by one relaxed system-scope
// store. The store is single-copy atomic, and an aligned 8-byte write reaches
// host memory whole (the bus does not split it), so the host never sees a
// value under another step's tag, and a slot whose every tag is t holds step
// t's fields whatever order the words land in: no fence, no ordering at all.
__device__ __forceinline__ void dt_metric_store(unsigned long long* word, float value, long long step) {
    const unsigned long long w = (unsigned long long)(unsigned int)step << 32 | __float_as_uint(value);
    asm volatile("st.relaxed.sys.u64 [%0], %1;" ::"l"(word), "l"(w) : "memory");
}

// ---------------------------------------------------------------- load issue order
// dt_issued(x): x is needed here. No instruction is emitted; the front end must
// place x's load before this point, so it cannot sink the load past a later
// branch to where x is used (ptxas, which never sees the empty asm, keeps that
// order in the tail kernels that use it: their SASS issues the loads before the
// branch). A kernel that reads a flag and then, if the flag allows, data at
// known addresses loads both, marks both issued, and only then branches: one
// round trip to memory instead of two.
__device__ __forceinline__ void dt_issued(int x) { asm volatile("" ::"r"(x)); }
__device__ __forceinline__ void dt_issued(float x) { asm volatile("" ::"f"(x)); }
__device__ __forceinline__ void dt_issued(double x) { asm volatile("" ::"d"(x)); }
__device__ __forceinline__ void dt_issued(long long x) { asm volatile("" ::"l"(x)); }
__device__ __forceinline__ void dt_issued(const float4& x) { asm volatile("" ::"f"(x.x), "f"(x.y), "f"(x.z), "f"(x.w)); }

// A flag word (a skip flag, a training loop's gate), 0 when `flag` is null. A
// kernel loads it with its first operands and tests it once those are issued
// (dt_issued), so its round trip overlaps theirs.
__device__ __forceinline__ int dt_read_flag(const int* flag) { return flag != nullptr ? *flag : 0; }

// A kernel's skip flag, its load issued here.
__device__ __forceinline__ int dt_issued_flag(const int* flag) {
    const int value = dt_read_flag(flag);
    dt_issued(value);
    return value;
}

// ---------------------------------------------------------------- dependent launch
// Programmatic dependent launch (sm_90+). A kernel launched with
// Kernel.launch(..., dependent=True) may start while the kernel before it on the
// stream is still running; dt_wait_prior_grid() blocks until that kernel has
// finished and its writes are visible. Every drvtrain kernel calls it before its
// first global memory access (read or write) that could touch what earlier work
// writes or reads; before it, a kernel reads only what stays constant for the
// step's life (the spectral kernels' and the finish pass's matrix table), a
// guess that it checks after the wait and redoes if wrong (adamw_clip_step's
// step counter), or what no kernel it directly depends on writes: gemm.cu's
// `settled` weights (where its launcher vouches for it, and in a forward's
// products after the first), spectral_rows' W (after spectral_columns) and
// adamw_clip_step's params and moments (after grad_norm_partials). It may also
// prefetch into L2 (dt_prefetch_l2 below: dqn_finish's target), which reads no
// value. So the overlap covers launch, block setup and that work, and no result
// can change.
// Without the launch attribute both calls are no-ops.
// dt_allow_dependents() lets the next kernel's blocks be scheduled once every
// block of this grid has called it (or exited). Every drvtrain kernel calls it
// only after its own dt_wait_prior_grid(): so while a kernel runs ahead of its
// wait, only the kernels it directly depends on can still be running (what the
// `settled` reads rely on). Anywhere after the wait it is safe: the next kernel
// still waits for this whole grid in dt_wait_prior_grid().
__device__ __forceinline__ void dt_wait_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void dt_allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// ---------------------------------------------------------------- L2 prefetch
// Brings `bytes` (a multiple of 16, from a 16-byte aligned `p`, inside one
// allocation) of global memory into L2: one bulk prefetch on compute capability
// 9.0+, a prefetch a 128-byte line before it. A prefetch is a hint: it returns no
// value and changes none, and L2 is where every SM's writes land, so a kernel may
// issue it before its grid wait, even for memory that the kernels before it are
// still writing (the dependent-launch rules above).
__device__ __forceinline__ void dt_prefetch_l2(const void* p, unsigned int bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#else
    const unsigned long long first = reinterpret_cast<unsigned long long>(p) & ~127ull;  // the line p starts in
    const unsigned long long end = reinterpret_cast<unsigned long long>(p) + bytes;
    for (unsigned long long line = first; line < end; line += 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(line) : "memory");
#endif
}

// What this block's threads read of `a` (n4 float4s, 16-byte aligned) in a
// grid-stride loop over float4s (one float4 a thread a round, float4 index
// dt_thread_index() + k * dt_grid_stride()) into L2: a block's round is
// blockDim.x consecutive float4s, one bulk prefetch. The calling thread issues
// them all.
__device__ __forceinline__ void dt_prefetch_rounds(const float* a, long long n4) {
    const float4* a4 = reinterpret_cast<const float4*>(a);
    const long long stride = dt_grid_stride();
    for (long long s = (long long)blockIdx.x * blockDim.x; s < n4; s += stride)
        dt_prefetch_l2(a4 + s, (unsigned int)(min((long long)blockDim.x, n4 - s) * 16));
}

// The dynamic shared memory this launch was given, in bytes.
__device__ __forceinline__ unsigned int dt_dynamic_shared_bytes() {
    unsigned int bytes;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(bytes));
    return bytes;
}

// ---------------------------------------------------------------- asynchronous copies
// cp.async from global to shared memory (compute capability 8.0+), for every kernel
// that stages tiles. `dst` is a shared-window address (__cvta_generic_to_shared);
// `src_bytes` below the copy's size reads that many bytes and fills the rest with
// zeros (0 reads nothing, but `src` must still be a mapped address). The 16-byte
// copy bypasses L1 (.cg), the 4-byte one may use it (.ca; .cg takes 16 bytes only).
// None of these is a compiler memory barrier: the copies write slots that nothing
// reads until after a wait and a __syncthreads(), which is one.
__device__ __forceinline__ void dt_cp_async16(unsigned int dst, const float* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}

__device__ __forceinline__ void dt_cp_async4(unsigned int dst, const float* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}

// Four 8x8 matrices of 16-bit elements from shared memory (ldmatrix .x4): lane l gives
// the address of row l % 8 of matrix l / 8 (16 bytes, 16-byte aligned), and gets in
// r[i] the 32 bits at row l / 4, bytes 4 * (l % 4) of matrix i. Read as 32-bit
// elements, a matrix is 8 rows of 4 floats and r[i] is (row l / 4, column l % 4): an
// m16n8k8 TF32 fragment's element.
__device__ __forceinline__ void dt_ldmatrix_x4(unsigned int (&r)[4], unsigned int address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
}

__device__ __forceinline__ void dt_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until at most PENDING of this thread's committed groups are still in flight.
template <int PENDING>
__device__ __forceinline__ void dt_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING));
}

// ---------------------------------------------------------------- clusters
// Thread block clusters (compute capability 9.0+; Kernel.launch(cluster=...)).
// Blocks of a cluster read and write each other's shared memory through
// shared::cluster addresses (dt_cluster_address); a barrier orders those
// accesses. A block may touch another's shared memory only after a barrier
// that block has also passed (so it has started), and must not exit while
// another may still access its own. Compiled for an older device (a kernel
// file built for every architecture) they trap: the host refuses cluster
// launches there.
// The most blocks a cluster may have anywhere (the portable size): the kernels that sum
// over a cluster's blocks hold this many addresses or values, and the host plans no more.
constexpr int DT_PORTABLE_CLUSTER = 8;

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define DT_CLUSTER_ONLY(...) __trap()
#else
#define DT_CLUSTER_ONLY(...) __VA_ARGS__
#endif

__device__ __forceinline__ unsigned int dt_cluster_rank() {
    unsigned int r = 0;
    DT_CLUSTER_ONLY(asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(r)));
    return r;
}

// 1 below compute capability 9.0, which has no clusters.
__device__ __forceinline__ unsigned int dt_cluster_blocks() {
    unsigned int n = 1;
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
    asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
#endif
    return n;
}

// Every thread of every block of the cluster; writes before it (shared, also
// remote, and global) are visible to the cluster after it.
__device__ __forceinline__ void dt_cluster_barrier() {
    DT_CLUSTER_ONLY(asm volatile("barrier.cluster.arrive.release.aligned;\n"
                                 "barrier.cluster.wait.acquire.aligned;\n" ::: "memory"));
}

// dt_cluster_barrier in two halves: the arrival (the thread's earlier reads and
// writes happen before it, for the cluster) and, later, the wait.
__device__ __forceinline__ void dt_cluster_arrive() {
    DT_CLUSTER_ONLY(asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory"));
}

// The barrier in two halves, the arrival ordering no memory access for the memory model
// (the "memory" clobber keeps the compiler's order). Arriving early, the pair only says
// every block of the cluster has started. Arriving after the thread has consumed (stored,
// say) every value it loaded from other blocks with ld.shared::cluster, it also says
// those reads are over, without waiting for its own global stores to drain as the
// release does: a property of the machine, not of the PTX model. The consumers issue
// before the arrival, in order, and wait for the loads' registers, so the loads have
// returned. It covers consumed remote loads only, not remote stores, atomics or bulk
// copies. A premature arrival fails the tests (a block's exit while another reads it is
// a launch failure on the H200), not compute-sanitizer's racecheck (docs/perf-notes.md,
// sixty-second pass).
__device__ __forceinline__ void dt_cluster_arrive_relaxed() {
    DT_CLUSTER_ONLY(asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory"));
}

__device__ __forceinline__ void dt_cluster_wait() {
    DT_CLUSTER_ONLY(asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory"));
}

// The shared::cluster address of shared::cta address `addr` in the block of rank `rank`.
__device__ __forceinline__ unsigned int dt_cluster_address(unsigned int addr, unsigned int rank) {
    unsigned int out = addr;
    DT_CLUSTER_ONLY(asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(out) : "r"(addr), "r"(rank)));
    return out;
}

__device__ __forceinline__ float4 dt_cluster_load4(unsigned int addr) {
    float4 v = {};
    DT_CLUSTER_ONLY(asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(addr) : "memory"));
    return v;
}

__device__ __forceinline__ float dt_cluster_load(unsigned int addr) {
    float v = 0.0f;
    DT_CLUSTER_ONLY(asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory"));
    return v;
}

__device__ __forceinline__ void dt_cluster_store(unsigned int addr, unsigned int v) {
    DT_CLUSTER_ONLY(asm volatile("st.shared::cluster.u32 [%0], %1;" ::"r"(addr), "r"(v) : "memory"));
}

__device__ __forceinline__ void dt_cluster_store2(unsigned int addr, float a, float b) {
    DT_CLUSTER_ONLY(asm volatile("st.shared::cluster.v2.f32 [%0], {%1, %2};" ::"r"(addr), "f"(a), "f"(b) : "memory"));
}

// `addr` 16-byte aligned.
__device__ __forceinline__ void dt_cluster_store4(unsigned int addr, float4 v) {
    DT_CLUSTER_ONLY(asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "f"(v.x), "f"(v.y),
                                 "f"(v.z), "f"(v.w) : "memory"));
}

// ---------------------------------------------------------------- mbarriers and bulk copies
// (compute capability 9.0+; trap below, as the cluster helpers.) An mbarrier is an
// 8-byte aligned shared word that counts arrivals and bytes. The pattern here:
// - one thread initialises it for one arrival (dt_mbar_init) and fences the
//   initialisation (dt_mbar_init_fence); a block barrier (a cluster barrier, where other
//   blocks copy into it) then stands between that and the first copy naming it;
// - its owner arrives once a phase, naming the bytes that will land in it
//   (dt_mbar_arrive_expect), before or after the copies complete (until that arrival the
//   phase stays open, whatever the byte count);
// - dt_mbar_wait(bar, parity) returns once phase `parity` (0, 1, 0, ... on successive
//   phases) has completed: the arrival made and every byte landed and visible.
// A bulk copy moves `bytes` (a multiple of 16, both ends 16-byte aligned) with one
// instruction and completes on an mbarrier of the receiving block.
__device__ __forceinline__ void dt_mbar_init(unsigned int bar, unsigned int arrivals) {
    DT_CLUSTER_ONLY(asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(arrivals) : "memory"));
}

__device__ __forceinline__ void dt_mbar_init_fence() {
    DT_CLUSTER_ONLY(asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"));
}

__device__ __forceinline__ void dt_mbar_arrive_expect(unsigned int bar, unsigned int bytes) {
    DT_CLUSTER_ONLY(asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
                                 : "memory"));
}

__device__ __forceinline__ void dt_mbar_wait(unsigned int bar, unsigned int parity) {
    unsigned int done = 1;
    do {
        DT_CLUSTER_ONLY(asm volatile("{\n"
                                     ".reg .pred p;\n"
                                     "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                                     "selp.u32 %0, 1, 0, p;\n"
                                     "}\n"
                                     : "=r"(done) : "r"(bar), "r"(parity) : "memory"));
    } while (!done);
}

// Shared memory of this block (`src`, shared window) to shared memory of a block of the
// cluster (`dst` and its mbarrier `bar`, shared::cluster addresses: dt_cluster_address).
// Every thread that wrote the source through ordinary stores first makes its writes
// visible to the copy engine (dt_fence_proxy_async), then a block barrier orders them
// before the copy. Only the receiver's mbarrier tells when the copy is done, reading as
// well as writing: the sender may write the source again, or exit, only once it knows
// the receiver's wait has passed (a reply that depends on it, or a cluster barrier that
// every receiver reaches after its wait).
__device__ __forceinline__ void dt_bulk_push(unsigned int dst, unsigned int src, unsigned int bytes,
                                             unsigned int bar) {
    DT_CLUSTER_ONLY(asm volatile(
        "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
        "r"(src), "r"(bytes), "r"(bar) : "memory"));
}

__device__ __forceinline__ void dt_fence_proxy_async() {
    DT_CLUSTER_ONLY(asm volatile("fence.proxy.async.shared::cta;" ::: "memory"));
}

// ---------------------------------------------------------------- grid barrier
// Every block of the grid waits here until all blocks have arrived, and every
// global write before it is visible to every thread after it. Only for a
// cooperative launch (Kernel.launch(..., cooperative=True)), which guarantees
// that all blocks are resident at once; otherwise the blocks that did not fit
// would never arrive. Every thread of every block must call it the same number
// of times. One-dimensional grids only (block 0 is blockIdx.x == 0 of gridDim.x).
// `word`: one uint32 that starts at 0 when allocated and is never reset. Block 0
// adds 2^31 - (G - 1), every other block 1: after a whole barrier the word has
// grown by exactly 2^31, so its top bit flips once per barrier and the low bits
// return to what they were. A block waits for the flip of the value it saw when
// it arrived, so consecutive barriers, launches and graph replays need no reset.
// Memory ordering: the block barrier orders every thread's accesses before the
// first thread's arrival, an add with release semantics at device scope (release is
// cumulative: it covers what that thread has seen, the block's writes included). The
// block that completes the barrier sees the flip in the add's own result and polls
// nothing; the others poll with relaxed loads, so no load in the loop fences. Once the
// flip is seen, one acquire fence, and the second block barrier passes it on to the
// block's threads. Only the first thread of a block fences.
// dt_grid_barrier_add: what this block adds to the word (the probe's other barriers too).
__device__ __forceinline__ unsigned int dt_grid_barrier_add() {
    return blockIdx.x == 0 ? 0x80000000u - (gridDim.x - 1u) : 1u;
}

__device__ __forceinline__ void dt_grid_barrier(unsigned int* word) {
    __syncthreads();
    if (dt_first_thread()) {
        const unsigned int add = dt_grid_barrier_add();
        unsigned int seen, now;
        asm volatile("atom.add.release.gpu.global.u32 %0, [%1], %2;" : "=r"(seen) : "l"(word), "r"(add) : "memory");
        now = seen + add;
        while (((now ^ seen) & 0x80000000u) == 0u)
            asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(now) : "l"(word) : "memory");
        asm volatile("fence.acq_rel.gpu;" ::: "memory");
    }
    __syncthreads();
}
