"""Launch options on a real GPU: dependent launches, clusters, large dynamic shared memory."""
import numpy as np
import pytest
from cuda.bindings import driver as cu

from drvtrain import DeviceBuffer, capture, check, load_source

pytestmark = pytest.mark.gpu
BLOCK = 256

# Step i of a chain: out = 2 * reverse(in) + add, over a grid-stride loop. Each
# step lets the next one start at once (dt_allow_dependents first), and one
# block per SM leaves room for the next step's blocks, so with dependent=True
# they are running while this step still writes; only dt_wait_prior_grid()
# keeps them from reading poison (without it, the chain comes out wrong). The
# chain ping-pongs between two buffers, so a step also overwrites what the
# step before it read.
CHAIN_SOURCE = r"""
#include "common.cuh"
extern "C" __global__ void chain_step(float* out, const float* in, float add, int n) {
    dt_allow_dependents();
    dt_wait_prior_grid();
    for (long long i = dt_thread_index(); i < n; i += dt_grid_stride()) out[i] = 2.0f * in[n - 1 - i] + add;
}
"""

# Each block writes its rank in the cluster, its cluster id (x, y), and the
# value its cluster neighbour (rank + 1) put in its own shared memory, read
# through distributed shared memory.
CLUSTER_SOURCE = r"""
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\t"
                 "barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

extern "C" __global__ void cluster_exchange(unsigned* rank_out, unsigned* cluster_out,
                                            float* neighbour_out, const float* in) {
    __shared__ float mine;
    unsigned rank, size, cx, cy;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(size));
    asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(cx));
    asm volatile("mov.u32 %0, %%clusterid.y;" : "=r"(cy));
    const unsigned b = blockIdx.y * gridDim.x + blockIdx.x;
    if (threadIdx.x == 0) mine = in[b];
    cluster_sync();  // every block's value is in its shared memory
    if (threadIdx.x == 0) {
        unsigned local, remote;
        float v;
        asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }"
                     : "=r"(local) : "l"(&mine));
        asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"((rank + 1) % size));
        asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
        neighbour_out[b] = v;
        rank_out[b] = rank;
        cluster_out[2 * b] = cx;
        cluster_out[2 * b + 1] = cy;
    }
    cluster_sync();  // no block leaves while a neighbour may still read its shared memory
}
"""

# One block per tile of `tile` floats, staged through `tile` floats of dynamic
# shared memory: out = scale * reverse_within_tile(in) + add.
REVERSE_SOURCE = r"""
#include "common.cuh"
extern "C" __global__ void __launch_bounds__(256) reverse_tiles(float* out, const float* in, float scale,
                                                               float add, int tile) {
    extern __shared__ float staged[];
    const long long base = (long long)blockIdx.x * tile;
    dt_wait_prior_grid();
    for (int j = threadIdx.x; j < tile; j += blockDim.x) staged[j] = in[base + j];
    __syncthreads();
    dt_allow_dependents();
    for (int j = threadIdx.x; j < tile; j += blockDim.x) out[base + j] = scale * staged[tile - 1 - j] + add;
}

// 16 KiB of static shared memory beside the dynamic part: out = in, through both.
extern "C" __global__ void static_and_dynamic(float* out, const float* in) {
    __shared__ float fixed[4096];
    extern __shared__ float dynamic[];
    const unsigned t = threadIdx.x, last = blockDim.x - 1;
    fixed[t] = in[t];
    __syncthreads();
    dynamic[t] = fixed[last - t];
    __syncthreads();
    out[t] = dynamic[last - t];
}
"""
REVERSE_SIG = "ptr, ptr, f32, f32, i32"
TILE_100K = 100 * 1024 // 4


@pytest.fixture
def chain(device):
    return load_source(CHAIN_SOURCE, "chain.cu").kernel("chain_step", "ptr, ptr, f32, i32")


@pytest.fixture
def reverse_module(device):
    return load_source(REVERSE_SOURCE, "reverse_tiles.cu")


def chain_reference(x, adds):
    y = x
    for add in adds:
        y = np.float32(2.0) * y[::-1] + np.float32(add)
    return y


def reverse_reference(x, tile, scale, add):
    return (np.float32(scale) * x.reshape(-1, tile)[:, ::-1] + np.float32(add)).reshape(-1)


def assert_single_chain(graph, n):
    """The graph is n kernel nodes joined in one line, each by a programmatic edge."""
    assert graph.node_counts() == {"kernel": n}
    edges = graph.edges()
    assert len(edges) == n - 1 and len(set(edges)) == n - 1
    sources, targets = [a for a, _ in edges], [b for _, b in edges]
    assert len(set(sources)) == n - 1 and len(set(targets)) == n - 1  # no branch, no join
    assert graph.longest_chain() == n  # so the n - 1 edges link all n kernels in order
    assert sorted(graph.programmatic_edges()) == sorted(edges)


# ------------------------------------------------------------------ dependent launches
def test_dependent_chain_eager_matches_numpy(rng, stream, chain, device):
    n, steps = (1 << 22) + int(rng.integers(0, 4096)), 8
    x = rng.uniform(-1, 1, n).astype(np.float32)
    adds = [float(np.float32(a)) for a in rng.uniform(-1, 1, steps)]
    src, ping, pong = DeviceBuffer.from_numpy(x), DeviceBuffer(n), DeviceBuffer(n)
    grid = device.sm_count
    for _ in range(2):  # twice, from fresh poison each time
        ping.poison(stream=stream)
        pong.poison(stream=stream)
        inp = src
        for i, add in enumerate(adds):
            out = ping if i % 2 == 0 else pong
            chain.launch(grid, BLOCK, out, inp, add, n, stream=stream, dependent=True)
            inp = out
        got = inp.to_numpy()
        assert not np.isnan(got).any()
        np.testing.assert_array_equal(got, chain_reference(x, adds))


def test_dependent_chain_captured_has_programmatic_edges_and_replays(rng, stream, chain, device):
    n, steps = (1 << 22) + int(rng.integers(0, 4096)), 6
    x = rng.uniform(-1, 1, n).astype(np.float32)
    adds = [float(np.float32(a)) for a in rng.uniform(-1, 1, steps)]
    src, ping, pong = DeviceBuffer.from_numpy(x), DeviceBuffer(n), DeviceBuffer(n)
    grid = device.sm_count
    bound, inp = [], src
    for i, add in enumerate(adds):
        out = ping if i % 2 == 0 else pong
        bound.append(chain.bind(grid, BLOCK, out, inp, add, n, dependent=True))
        inp = out
    result = inp
    with capture(stream) as graph:
        for b in bound:
            b.launch(stream)
    assert_single_chain(graph, steps)
    assert {k.function for k in graph.kernel_nodes()} == {"chain_step"}
    assert all(k.grid == (grid, 1, 1) and k.block == (BLOCK, 1, 1) for k in graph.kernel_nodes())
    assert f"programmatic edges (dependent launches): {steps - 1}" in graph.summary()
    exe = graph.instantiate()
    want = chain_reference(x, adds)
    for _ in range(3):
        ping.poison(stream=stream)
        pong.poison(stream=stream)
        exe.launch(stream)
        got = result.to_numpy()
        assert not np.isnan(got).any()
        np.testing.assert_array_equal(got, want)
    exe.close()
    graph.close()


def test_dependent_and_plain_launches_mix_in_one_capture(rng, stream, chain, device):
    """A plain launch between dependent ones: the edges still connect every kernel in order."""
    n = 1 << 20
    x = rng.uniform(-1, 1, n).astype(np.float32)
    adds = [float(np.float32(a)) for a in rng.uniform(-1, 1, 4)]
    src, ping, pong = DeviceBuffer.from_numpy(x), DeviceBuffer(n), DeviceBuffer(n)
    grid = device.sm_count
    with capture(stream) as graph:
        inp = src
        for i, add in enumerate(adds):
            out = ping if i % 2 == 0 else pong
            chain.launch(grid, BLOCK, out, inp, add, n, stream=stream, dependent=(i != 2))
            inp = out
    assert graph.node_counts() == {"kernel": 4} and graph.longest_chain() == 4
    assert len(graph.edges()) == 3 and len(graph.programmatic_edges()) == 2
    ping.poison(stream=stream)
    pong.poison(stream=stream)
    graph.instantiate().launch(stream)
    np.testing.assert_array_equal(inp.to_numpy(), chain_reference(x, adds))


@pytest.mark.parametrize("verbose", [True, False])
def test_dot_dump_marks_the_programmatic_edge(tmp_path, rng, stream, chain, verbose):
    n = 4096
    src = DeviceBuffer.from_numpy(rng.standard_normal(n).astype(np.float32))
    ping, pong = DeviceBuffer(n), DeviceBuffer(n)
    with capture(stream) as graph:
        chain.launch(n // BLOCK, BLOCK, ping, src, 1.0, n, stream=stream)
        chain.launch(n // BLOCK, BLOCK, pong, ping, 2.0, n, stream=stream, dependent=True)
        chain.launch(n // BLOCK, BLOCK, ping, pong, 3.0, n, stream=stream)
    assert len(graph.edges()) == 2 and len(graph.programmatic_edges()) == 1
    path = tmp_path / "chain.dot"
    graph.to_dot(path, verbose=verbose)
    text = path.read_text()
    assert text.lstrip().startswith("digraph") and "chain_step" in text
    assert text.count("->") == 2 and text.count('label="programmatic"') == 1


# ------------------------------------------------------------------ clusters
@pytest.mark.parametrize("grid, cluster", [
    ((16, 1), (2, 1, 1)), ((32, 1), (4, 1, 1)), ((64, 1), (8, 1, 1)), ((6, 4), (2, 2, 1)),
    ((3, 8), (1, 4, 1)), ((8, 2), (1, 1, 1)), ((48, 1), (16, 1, 1)), ((12, 4), (4, 4, 1)),
])
@pytest.mark.parametrize("policy", [None, "spread", "load_balancing"])
def test_cluster_ranks_ids_and_distributed_shared_memory(rng, stream, grid, cluster, policy):
    """Each placement policy keeps a cluster's ranks, ids and shared memory."""
    kern = load_source(CLUSTER_SOURCE, "cluster.cu").kernel("cluster_exchange", "ptr, ptr, ptr, ptr")
    gx, gy = grid
    cx, cy, _ = cluster
    blocks = gx * gy
    x = rng.standard_normal(blocks).astype(np.float32)
    src = DeviceBuffer.from_numpy(x)
    ranks, ids = DeviceBuffer(blocks, np.uint32), DeviceBuffer(2 * blocks, np.uint32)
    neighbours = DeviceBuffer(blocks)
    for buf in (ranks, ids, neighbours):
        buf.poison(stream=stream)
    kern.launch(grid, 64, ranks, ids, neighbours, src, stream=stream, cluster=cluster, cluster_policy=policy)
    by, bx = np.meshgrid(np.arange(gy), np.arange(gx), indexing="ij")  # row b = by * gx + bx
    want_rank = (bx % cx) + cx * (by % cy)
    peer = (want_rank + 1) % (cx * cy)
    peer_x, peer_y = (bx // cx) * cx + peer % cx, (by // cy) * cy + peer // cx
    np.testing.assert_array_equal(ranks.to_numpy(), want_rank.reshape(-1))
    np.testing.assert_array_equal(ids.to_numpy().reshape(-1, 2),
                                  np.stack([bx // cx, by // cy], axis=-1).reshape(-1, 2))
    np.testing.assert_array_equal(neighbours.to_numpy(), x[(peer_y * gx + peer_x).reshape(-1)])


# Every block of a cluster gathers the cluster's slices (256 floats each, from `in`) in its
# shared memory: its own by a store, every other pushed by its owner with one bulk copy
# (dt_bulk_push) that completes on the receiver's mbarrier; then writes what it gathered.
BULK_SOURCE = r"""
#include "common.cuh"
extern "C" __global__ void __launch_bounds__(256) gather(float* out, const float* in) {
    __shared__ __align__(128) float all[8 * 256];
    __shared__ __align__(8) unsigned long long landed;
    const unsigned int rank = dt_cluster_rank(), size = dt_cluster_blocks(), t = threadIdx.x;
    const unsigned int base = (unsigned int)__cvta_generic_to_shared(all);
    const unsigned int bar = (unsigned int)__cvta_generic_to_shared(&landed);
    if (t == 0) {
        dt_mbar_init(bar, 1);
        dt_mbar_init_fence();
    }
    all[rank * 256 + t] = in[blockIdx.x * 256 + t];
    dt_fence_proxy_async();
    dt_cluster_barrier();  // every block started, its mbarrier initialised, its slice written
    if (t == 0) {
        dt_mbar_arrive_expect(bar, (size - 1) * 1024);
        const unsigned int mine = base + rank * 1024;
        for (unsigned int q = 0; q < size; ++q)
            if (q != rank) dt_bulk_push(dt_cluster_address(mine, q), mine, 1024, dt_cluster_address(bar, q));
    }
    dt_mbar_wait(bar, 0);
    for (unsigned int i = t; i < size * 256; i += 256) out[blockIdx.x * 2048 + i] = all[i];
    dt_cluster_barrier();  // every block has its slices: no copy still reads or writes shared memory
}
"""


@pytest.mark.parametrize("blocks, size", [(16, 2), (32, 4), (64, 8), (8, 1)])
def test_bulk_copies_gather_a_cluster_on_mbarriers(rng, stream, blocks, size):
    kern = load_source(BULK_SOURCE, "bulk.cu").kernel("gather", "ptr, ptr")
    x = rng.standard_normal((blocks, 256)).astype(np.float32)
    out = DeviceBuffer((blocks, 2048))
    out.poison(stream=stream)
    kern.launch(blocks, 256, out, DeviceBuffer.from_numpy(x), stream=stream, cluster=(size, 1, 1))
    got = out.to_numpy()
    for b in range(blocks):
        first = b // size * size
        np.testing.assert_array_equal(got[b, : size * 256], x[first: first + size].reshape(-1), err_msg=f"block {b}")
        assert np.all(got[b, size * 256:].view(np.uint32) == 0xFFFFFFFF), f"block {b} wrote past its cluster"


def test_cluster_bound_launch_replays_in_a_graph(rng, stream):
    kern = load_source(CLUSTER_SOURCE, "cluster.cu").kernel("cluster_exchange", "ptr, ptr, ptr, ptr")
    blocks = 64
    x = rng.standard_normal(blocks).astype(np.float32)
    src = DeviceBuffer.from_numpy(x)
    ranks, ids = DeviceBuffer(blocks, np.uint32), DeviceBuffer(2 * blocks, np.uint32)
    neighbours = DeviceBuffer(blocks)
    bound = kern.bind(blocks, 32, ranks, ids, neighbours, src, cluster=4)
    with capture(stream) as graph:
        bound.launch(stream)
    exe = graph.instantiate()
    b = np.arange(blocks)
    for _ in range(2):
        neighbours.poison(stream=stream)
        exe.launch(stream)
        np.testing.assert_array_equal(neighbours.to_numpy(), x[(b // 4) * 4 + (b % 4 + 1) % 4])
    np.testing.assert_array_equal(ranks.to_numpy(), b % 4)


def test_max_active_clusters_counts_co_resident_clusters(rng, stream, reverse_module, device):
    """With 150 KiB of shared memory a block has an SM to itself, so at most
    sm_count / c clusters of c fit, fewer where a GPC's SMs do not divide by c;
    a grid of that many clusters runs, and reverses its tiles."""
    kern = reverse_module.kernel("reverse_tiles", REVERSE_SIG)
    shared = 150 * 1024
    assert kern.max_resident_blocks(BLOCK, shared) == device.sm_count
    fits = {c: kern.max_active_clusters((c, 1, 1), BLOCK, shared) for c in (1, 2, 4, 8)}
    assert fits[1] == device.sm_count
    for c in (2, 4, 8):
        assert 1 <= fits[c] and fits[c] * c <= fits[c // 2] * (c // 2) <= device.sm_count, fits
    tile = shared // 4
    blocks = fits[4] * 4
    x = rng.standard_normal(blocks * tile).astype(np.float32)
    src, out = DeviceBuffer.from_numpy(x), DeviceBuffer(x.size)
    out.poison(stream=stream)
    kern.launch(blocks, BLOCK, out, src, 1.0, 0.0, tile, stream=stream, shared_mem=shared, cluster=(4, 1, 1))
    np.testing.assert_array_equal(out.to_numpy(), reverse_reference(x, tile, 1.0, 0.0))


def test_bad_cluster_is_refused_before_launch(stream):
    kern = load_source(CLUSTER_SOURCE, "cluster.cu").kernel("cluster_exchange", "ptr, ptr, ptr, ptr")
    buf = DeviceBuffer(64)
    with pytest.raises(ValueError, match="not divisible"):
        kern.launch(6, 32, buf, buf, buf, buf, stream=stream, cluster=4)
    with pytest.raises(ValueError, match="at most 16"):
        kern.launch(32, 32, buf, buf, buf, buf, stream=stream, cluster=32)


def test_max_active_clusters_counts_the_non_portable_size(stream):
    """16-block clusters (non-portable): the occupancy query sets the function's attribute and
    the H200 places at least one, and at most half as many as 8-block clusters (any placement
    of 16-block clusters splits into twice as many 8-block ones)."""
    kern = load_source(CLUSTER_SOURCE, "cluster16.cu").kernel("cluster_exchange", "ptr, ptr, ptr, ptr")
    sixteen, eight = kern.max_active_clusters(16, 64), kern.max_active_clusters(8, 64)
    assert 1 <= sixteen and 2 * sixteen <= eight


# ------------------------------------------------------------------ large dynamic shared memory
def test_100_kib_of_dynamic_shared_memory_reverses_tiles(rng, stream, reverse_module, device):
    kern = reverse_module.kernel("reverse_tiles", REVERSE_SIG)
    tiles = int(rng.integers(200, 400))
    x = rng.standard_normal(tiles * TILE_100K).astype(np.float32)
    src, out = DeviceBuffer.from_numpy(x), DeviceBuffer(x.size)
    out.poison(stream=stream)
    kern.launch(tiles, BLOCK, out, src, 1.0, 0.0, TILE_100K, stream=stream, shared_mem=TILE_100K * 4)
    got = out.to_numpy()
    assert not np.isnan(got).any()
    np.testing.assert_array_equal(got, reverse_reference(x, TILE_100K, 1.0, 0.0))


def test_more_than_the_opt_in_maximum_is_refused_before_launch(rng, stream, reverse_module, device):
    kern = reverse_module.kernel("reverse_tiles", REVERSE_SIG)
    optin = device.limits.max_shared_per_block_optin
    assert optin >= 100 * 1024
    x = rng.standard_normal(4 * 1024).astype(np.float32)
    src, out = DeviceBuffer.from_numpy(x), DeviceBuffer(x.size)
    with pytest.raises(ValueError, match=rf"reverse_tiles: {optin + 4} bytes of dynamic shared memory "
                                         rf"requested.*at most {optin}"):
        kern.launch(4, BLOCK, out, src, 1.0, 0.0, (optin + 4) // 4, stream=stream, shared_mem=optin + 4)
    with pytest.raises(ValueError, match="opt-in maximum"):
        kern.launch(4, BLOCK, out, src, 1.0, 0.0, 1024, stream=stream, shared_mem=optin + 4, dependent=True)
    out.poison(stream=stream)  # the kernel still launches, with the arguments it is given
    kern.launch(4, BLOCK, out, src, 2.0, 0.5, 1024, stream=stream, shared_mem=4096)
    np.testing.assert_array_equal(out.to_numpy(), reverse_reference(x, 1024, 2.0, 0.5))


def test_static_shared_memory_counts_against_the_opt_in_maximum(rng, stream, reverse_module, device):
    kern = reverse_module.kernel("static_and_dynamic", "ptr, ptr")
    static = check(cu.cuFuncGetAttribute, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
                   kern.function)
    assert static >= 16 * 1024
    room = device.limits.max_shared_per_block_optin - static
    x = rng.standard_normal(1024).astype(np.float32)
    src, out = DeviceBuffer.from_numpy(x), DeviceBuffer(1024)
    with pytest.raises(ValueError, match=rf"static __shared__ arrays take {static}, so at most {room}"):
        kern.launch(1, 1024, out, src, stream=stream, shared_mem=room + 1)
    out.poison(stream=stream)
    kern.launch(1, 1024, out, src, stream=stream, shared_mem=room)
    np.testing.assert_array_equal(out.to_numpy(), x)


def test_raised_limit_is_shared_by_every_kernel_of_the_function(rng, stream, reverse_module):
    """A smaller launch through a second Kernel of the same function never lowers the limit."""
    free = reverse_module.kernel("reverse_tiles", REVERSE_SIG)
    fixed = reverse_module.kernel("reverse_tiles", REVERSE_SIG, fixed_block=True)
    assert fixed is not free and fixed.block == BLOCK
    # The fixed kernel looks at the limit first (at 16 KiB), the free one raises it to 100 KiB; a
    # fixed kernel that went by what it saw itself would now set 60 KiB and break the next free launch.
    kib = 1024 // 4
    for kern, tile in ((fixed, 16 * kib), (free, 100 * kib), (fixed, 60 * kib), (free, 100 * kib),
                       (fixed, 120 * kib)):
        tiles = int(rng.integers(20, 60))
        x = rng.standard_normal(tiles * tile).astype(np.float32)
        src, out = DeviceBuffer.from_numpy(x), DeviceBuffer(x.size)
        out.poison(stream=stream)
        kern.launch(tiles, BLOCK, out, src, 1.0, 0.0, tile, stream=stream, shared_mem=tile * 4)
        np.testing.assert_array_equal(out.to_numpy(), reverse_reference(x, tile, 1.0, 0.0))


# ------------------------------------------------------------------ combined
def test_dependent_launches_with_100_kib_shared_memory_in_a_graph(rng, stream, reverse_module):
    kern = reverse_module.kernel("reverse_tiles", REVERSE_SIG)
    tiles, steps = int(rng.integers(300, 500)), 4
    x = rng.standard_normal(tiles * TILE_100K).astype(np.float32)
    adds = [float(np.float32(a)) for a in rng.uniform(-1, 1, steps)]
    src, ping, pong = DeviceBuffer.from_numpy(x), DeviceBuffer(x.size), DeviceBuffer(x.size)
    with capture(stream) as graph:  # the first launch of this shape raises the limit inside the capture
        inp = src
        for i, add in enumerate(adds):
            out = ping if i % 2 == 0 else pong
            kern.launch(tiles, BLOCK, out, inp, 2.0, add, TILE_100K, stream=stream,
                        shared_mem=TILE_100K * 4, dependent=True)
            inp = out
    assert_single_chain(graph, steps)
    assert all(k.shared_mem == TILE_100K * 4 for k in graph.kernel_nodes())
    want = x
    for add in adds:
        want = reverse_reference(want, TILE_100K, 2.0, add)
    exe = graph.instantiate()
    for _ in range(3):
        ping.poison(stream=stream)
        pong.poison(stream=stream)
        exe.launch(stream)
        got = inp.to_numpy()
        assert not np.isnan(got).any()
        np.testing.assert_array_equal(got, want)


# ------------------------------------------------------------------ cooperative launches
# `rounds` rounds of a ring rotation over the whole grid, one grid barrier
# between rounds: each block takes its right neighbour's value of the last
# round (block b + 1 mod G, written by another block) plus one. Without the
# barrier a block reads its neighbour's value before or after the neighbour
# updates it, and the result differs from the sequential reference. The values
# stay small integers, so float32 is exact.
BARRIER_SOURCE = r"""
#include "common.cuh"
extern "C" __global__ void __launch_bounds__(128) ring_rounds(float* a, float* b, int rounds,
                                                              unsigned int* word) {
    dt_wait_prior_grid();
    const int g = gridDim.x, me = blockIdx.x;
    for (int r = 0; r < rounds; ++r) {
        const float* src = r % 2 == 0 ? a : b;
        float* dst = r % 2 == 0 ? b : a;
        if (threadIdx.x == 0) dst[me] = src[(me + 1) % g] + 1.0f;
        dt_grid_barrier(word);
    }
}
"""


def ring_reference(x, rounds):
    return np.roll(x.astype(np.float64), -rounds) + rounds


@pytest.fixture
def ring(device):
    return load_source(BARRIER_SOURCE, "ring_rounds.cu").kernel("ring_rounds", "ptr, ptr, i32, ptr",
                                                                fixed_block=True)


@pytest.mark.parametrize("blocks", [2, 37, "resident"])
def test_grid_barrier_in_a_cooperative_launch_matches_numpy(rng, stream, ring, device, blocks):
    g = ring.max_resident_blocks(ring.block) if blocks == "resident" else blocks
    assert ring.max_resident_blocks(ring.block) >= device.sm_count  # a 128-thread block fits on every SM
    rounds = 6
    x = rng.integers(-1000, 1000, g).astype(np.float32)
    a, b = DeviceBuffer.from_numpy(x), DeviceBuffer((g,), np.float32)
    b.poison(stream=stream)
    word = DeviceBuffer.zeros(1, np.uint32)
    ring.launch(g, ring.block, a, b, rounds, word, stream=stream, cooperative=True)
    stream.synchronize()
    np.testing.assert_array_equal(a.to_numpy(), ring_reference(x, rounds))
    # 6 barriers flipped the top bit 6 times and left the low bits at 0.
    assert int(word.to_numpy()[0]) == 0


@pytest.mark.parametrize("dependent", [False, True])
def test_cooperative_launches_replay_in_a_graph(rng, stream, ring, device, dependent):
    """Three cooperative launches in one captured graph, replayed 5 times: the barrier
    word is never reset, and an odd number of barriers per launch leaves its top bit
    set between launches."""
    g, rounds = 2 * device.sm_count, 3
    x = rng.integers(-1000, 1000, g).astype(np.float32)
    a, b = DeviceBuffer.from_numpy(x), DeviceBuffer((g,), np.float32)
    word = DeviceBuffer.zeros(1, np.uint32)
    with capture(stream) as graph:
        for _ in range(3):
            # `rounds` is odd, so a launch leaves its result in its second buffer:
            # a pair of launches with the buffers swapped ends in a.
            ring.launch(g, ring.block, a, b, rounds, word, stream=stream, cooperative=True, dependent=dependent)
            ring.launch(g, ring.block, b, a, rounds, word, stream=stream, cooperative=True, dependent=dependent)
    assert graph.node_counts() == {"kernel": 6}
    if dependent:
        assert len(graph.programmatic_edges()) == 5
    exe = graph.instantiate()
    want = x
    for _ in range(5):
        exe.launch(stream)
        want = ring_reference(want, 6 * rounds)
    stream.synchronize()
    np.testing.assert_array_equal(a.to_numpy(), want)
    assert int(word.to_numpy()[0]) == 0  # 90 barriers: an even number of flips
    exe.close()


def test_too_large_a_cooperative_grid_is_refused_before_launch(stream, ring):
    top = ring.max_resident_blocks(ring.block)
    word = DeviceBuffer.zeros(1, np.uint32)
    a, b = DeviceBuffer((top + 1,), np.float32), DeviceBuffer((top + 1,), np.float32)
    with pytest.raises(ValueError, match=f"cooperative launch of {top + 1} blocks, but at most {top}"):
        ring.launch(top + 1, ring.block, a, b, 1, word, stream=stream, cooperative=True)
    with pytest.raises(ValueError, match="either cooperative or in clusters"):
        ring.launch(4, ring.block, a, b, 1, word, stream=stream, cooperative=True, cluster=2)
