"""The linear-layer GEMMs of kernels/gemm.cu and gemm_sm90a.cu on the GPU against float64: every role, tile
and copy width."""
import numpy as np
import pytest

from drvtrain import Arena, DeviceBuffer, Stream, capture, dependent_launches
from drvtrain.stream import fork
from drvtrain.nn import MLP, FlatBuffer, ParamLayout
from drvtrain.nn.mlp import TILE_32, TILES, WGMMA_TILE, LinearKernels, gemm, plan, wgmma_available
from late_writer import LATE_NS, late_copy, words
from nn_reference import mlp_backward, rel

pytestmark = pytest.mark.gpu

ROLES = ["forward", "forward_relu", "grad_input", "grad_weight"]
# (M, N, K): not multiples of any tile; the output layer's narrow N; split-k with both tiles;
# a grid of blocks inside the operands and blocks across their edges, in splits of whole k
# tiles and a last split that ends inside one, past the ring's first tiles (the 32x32
# forward's k loop without bounds, and with them).
SHAPES = [(77, 35, 45), (512, 19, 1024), (256, 3, 256), (512, 1024, 1024), (100, 70, 1000)]
TF32_BOUND, X3_BOUND = 2e-3, 1e-5


def padded_ld(extent, vector):
    """A leading dimension that allows 16-byte copies (vector 16) or, mostly, does not."""
    return -(-extent // 4) * 4 + 4 if vector == 16 else extent + 3


def device_matrix(values, ld):
    """values [rows, cols] stored row-major with leading dimension ld; the padding is NaN,
    so a kernel that reads past a row's end shows it."""
    rows, cols = values.shape
    host = np.full((rows, ld), np.nan, np.float32)
    host[:, :cols] = values
    return DeviceBuffer.from_numpy(host)


class Product:
    """One role's operands on the device and its float64 reference."""

    def __init__(self, role, m, n, k, vector, rng):
        self.role, self.m, self.n, self.k = role, m, n, k
        f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)
        self.epilogue, self.ref_sums = {}, None
        if role.startswith("forward"):  # Y = X W^T + b: X [M, K], W [N, K]
            x, w, b = f32(m, k), f32(n, k), f32(n)
            self.lda, self.ldb = padded_ld(k, vector), padded_ld(k, vector)
            self.a, self.b = device_matrix(x, self.lda), device_matrix(w, self.ldb)
            self.bias = DeviceBuffer.from_numpy(b)
            self.epilogue["bias"] = self.bias
            self.want = x.astype(np.float64) @ w.T.astype(np.float64) + b
            if role == "forward_relu":
                self.want = np.maximum(self.want, 0.0)
        elif role == "grad_input":  # dX = (dY W) * (X > 0): dY [M, K], W [K, N], X [M, N]
            dy, w, x = f32(m, k), f32(k, n), np.maximum(f32(m, n), 0.0)
            self.lda, self.ldb = padded_ld(k, vector), padded_ld(n, vector)
            self.a, self.b = device_matrix(dy, self.lda), device_matrix(w, self.ldb)
            self.ldm = n + 1
            self.mask = device_matrix(x, self.ldm)
            self.epilogue.update(mask=self.mask, ldm=self.ldm)
            self.want = (dy.astype(np.float64) @ w.astype(np.float64)) * (x > 0)
        else:  # dW = dY^T X, db = column sums of dY: dY [K, M], X [K, N]
            dy, x = f32(k, m), f32(k, n)
            self.lda, self.ldb = padded_ld(m, vector), padded_ld(n, vector)
            self.a, self.b = device_matrix(dy, self.lda), device_matrix(x, self.ldb)
            self.col_sum = DeviceBuffer((m,), np.float32)
            self.epilogue["col_sum"] = self.col_sum
            self.want = dy.T.astype(np.float64) @ x.astype(np.float64)
            self.ref_sums = dy.astype(np.float64).sum(axis=0)
        self.ldc = n + 5
        self.c = DeviceBuffer((m, self.ldc), np.float32)

    def poison(self, stream):
        self.c.poison(stream=stream)
        if self.ref_sums is not None:
            self.col_sum.poison(stream=stream)

    def launch(self, kernels, arena, stream, tile, vector):
        return kernels.launch(self.role, self.a, self.lda, self.b, self.ldb, self.c, self.ldc, self.m, self.n,
                              self.k, arena=arena, stream=stream, tile=tile, vector=vector, **self.epilogue)

    def outputs(self):
        c = self.c.to_numpy()
        sums = self.col_sum.to_numpy() if self.ref_sums is not None else None
        return c, sums

    def run(self, kernels, stream, tile, vector):
        """Plan its arena, poison the outputs, launch, and read back (C's first n columns,
        the bias sums or None)."""
        arena, _ = arena_for(kernels, self.role, self.m, self.n, self.k, tile)
        self.poison(stream)
        self.launch(kernels, arena, stream, tile, vector)
        c, sums = self.outputs()
        return c[:, :self.n], sums

    def relu_kept(self):
        """Where the grad-input product's ReLU mask keeps its value."""
        return self.mask.to_numpy()[:, :self.n] > 0


# gemm.cu's mma.sync tiles for every role and copy width, gemm_sm90a.cu's wgmma
# tile for every role with 16-byte copies.
ALL_TILES = TILES + (WGMMA_TILE,)
VARIANTS = [pytest.param(role, tile, vector, id=f"{role}-{tile.name}-cp{vector}")
            for role in ROLES for tile in ALL_TILES
            for vector in (16, 4) if tile is not WGMMA_TILE or vector == 16]


def kernels_for(role, device):
    if role.startswith("forward"):
        return LinearKernels(("forward", "forward_relu"), "tf32", device.sm_count, wgmma=wgmma_available(device))
    return LinearKernels(("grad_input", "grad_weight"), "3xtf32", device.sm_count, wgmma=wgmma_available(device),
                         presplit=True)


def skip_unless_compiled(device, tile):
    if tile is WGMMA_TILE and not wgmma_available(device):
        pytest.skip(f"wgmma needs compute capability 9.0; this device is {device.arch}")


def arena_for(kernels, role, m, n, k, tile):
    p = kernels.plan(role, m, n, k, tile=tile)
    return Arena(4 * p.workspace_floats + 1024, zeroed_bytes=4 * p.counters + 256), p


def split_workspace(tile, m, n, splits):
    """An arena with the workspace and tile counters of an m x n product in ``splits``
    splits summed through memory, sized as gemm.cu's header lays them out (each tile's
    partials, then the row sums), for tests that force a split the planner would not
    choose. Returns (arena, workspace, counters)."""
    rows, cols = -(-m // tile.bm), -(-n // tile.bn)
    floats = rows * cols * splits * tile.bm * tile.bn + rows * splits * tile.bm
    work = Arena(4 * floats + 1024, zeroed_bytes=4 * rows * cols + 256)
    return work, work.array(floats, np.float32), work.zeroed(rows * cols, np.uint32)


@pytest.mark.parametrize("role, tile, vector", VARIANTS)
@pytest.mark.parametrize("m, n, k", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
def test_product_matches_float64(device, stream, rng, role, tile, vector, m, n, k):
    """Every compiled variant on shapes that are not tile multiples: TF32 forward to
    2e-3, 3xTF32 backward (and db) to 1e-5, the output's padding untouched, no NaN.
    The mma.sync tiles run on the H200 too: they are the wgmma tile's fallback."""
    skip_unless_compiled(device, tile)
    kernels = kernels_for(role, device)
    prod = Product(role, m, n, k, vector, rng)
    arena, p = arena_for(kernels, role, m, n, k, tile)
    prod.poison(stream)
    kernel = prod.launch(kernels, arena, stream, tile, vector)
    precision = "tf32" if role.startswith("forward") else "3xtf32"
    # The 32x32 tile runs every product of up to 4 splits on its `_cluster_` kernels (clusters on, 9.0+).
    clustered = "cluster_" if kernels.clusters and 1 < tile.cluster_splits and p.splits <= tile.cluster_splits \
        and tile is not WGMMA_TILE else ""
    want_name = f"_{tile.name}_{precision}" if tile is WGMMA_TILE else f"_{tile.name}_cp{vector}_{clustered}{precision}"
    assert kernel.name.endswith(want_name), kernel.name
    c, sums = prod.outputs()
    got = c[:, :n]
    assert not np.isnan(got).any(), f"{np.isnan(got).sum()} outputs unwritten ({p.splits} splits)"
    assert (c[:, n:].view(np.uint32) == 0xFFFFFFFF).all(), "the output's padding was written"
    bound = TF32_BOUND if role.startswith("forward") else X3_BOUND
    err = rel(got, prod.want)
    assert err < bound, f"{kernel.name} {m}x{n}x{k}, {p.splits} splits: rel {err:.3g} >= {bound:g}"
    if prod.ref_sums is not None:
        err = rel(sums, prod.ref_sums)
        assert err < X3_BOUND, f"db of {kernel.name} {m}x{n}x{k}, {p.splits} splits: rel {err:.3g}"


def set_bits(buf, index, bits):
    host = buf.to_numpy()
    host.view(np.uint32)[index] = bits
    buf.copy_from_numpy(host)


@pytest.mark.parametrize("role, tile, vector", VARIANTS)
def test_nan_operands_reach_the_output(device, stream, rng, role, tile, vector):
    """A NaN in either operand makes exactly its output row (A) or column (B) NaN, as in
    float64, whatever its bits: 0x7fffffff (what device code writes) would carry out of its
    exponent if rounded to TF32 by an add, and 0xffffffff is the poison pattern. A hidden
    layer's ReLU keeps the NaN. Everything else stays finite."""
    skip_unless_compiled(device, tile)
    m, n, k = 77, 35, 45
    i0, j0, ka, kb = 5, 7, 3, 11
    kernels = kernels_for(role, device)
    prod = Product(role, m, n, k, vector, rng)
    # (row, col) of A(i0, ka) and B(kb, j0) in each role's storage (see Product).
    a_at, b_at = {"forward": ((i0, ka), (j0, kb)), "forward_relu": ((i0, ka), (j0, kb)),
                  "grad_input": ((i0, ka), (kb, j0)), "grad_weight": ((ka, i0), (kb, j0))}[role]
    set_bits(prod.a, a_at, 0x7FFFFFFF)
    set_bits(prod.b, b_at, 0xFFFFFFFF)
    got, sums = prod.run(kernels, stream, tile, vector)
    want_nan = np.zeros((m, n), bool)
    want_nan[i0, :] = True
    want_nan[:, j0] = True
    if role == "grad_input":  # the ReLU mask zeroes what it masks, NaN or not
        want_nan &= prod.relu_kept()
    np.testing.assert_array_equal(np.isnan(got), want_nan)
    if sums is not None:
        want_sums = np.zeros(m, bool)
        want_sums[i0] = True
        np.testing.assert_array_equal(np.isnan(sums), want_sums)


@pytest.mark.parametrize("role, tile, vector", VARIANTS)
def test_an_infinite_operand_is_infinite_in_tf32_and_nan_in_3xtf32(device, stream, rng, role, tile, vector):
    """An infinity in A reaches exactly its output row. The TF32 forward passes it
    unrounded, so the row is infinite (or 0 where the ReLU takes -inf); the 3xTF32
    backward splits it into an infinite big part and a NaN remainder (kernels/tf32.cuh),
    so the row is NaN (where the ReLU mask keeps it), and a weight gradient's bias sum,
    FP32 on the unsplit values in these kernels, is infinite (the pre-split backward's
    sums big + small: NaN). Everything else stays finite."""
    skip_unless_compiled(device, tile)
    m, n, k = 77, 35, 45
    i0, ka = 6, 4
    kernels = kernels_for(role, device)
    prod = Product(role, m, n, k, vector, rng)
    sign = float(rng.choice([-1.0, 1.0]))
    set_bits(prod.a, (ka, i0) if role == "grad_weight" else (i0, ka),
             int(np.float32(sign * np.inf).view(np.uint32)))
    got, sums = prod.run(kernels, stream, tile, vector)
    row = np.zeros((m, n), bool)
    row[i0, :] = True
    if role.startswith("forward"):
        assert not np.isnan(got).any()
        hit = np.isinf(got)
        if role == "forward_relu":  # +inf stays; -inf becomes 0, as does a negative sum
            assert (hit == (row & (got > 0))).all() and (got[i0] >= 0).all()
        else:
            assert (hit == row).all()
    else:
        if role == "grad_input":  # the ReLU mask zeroes what it masks, NaN or not
            row &= prod.relu_kept()
        np.testing.assert_array_equal(np.isnan(got), row)
        assert np.isfinite(got[~row]).all()
    if sums is not None:
        assert np.isinf(sums[i0]) and np.sign(sums[i0]) == sign
        assert np.isfinite(np.delete(sums, i0)).all()


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("m, n, k", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
def test_ffma_product_matches_float64(device, stream, rng, role, m, n, k):
    """The FP32 FFMA kernels (MLP(tf32=False) forward, backward="f32") to 1e-5."""
    kernels = LinearKernels((role,), "f32", device.sm_count)
    prod = Product(role, m, n, k, 4, rng)
    p = kernels.plan(role, m, n, k)
    arena = Arena(4 * p.workspace_floats + 1024, zeroed_bytes=4 * p.counters + 256)
    prod.poison(stream)
    kernel = prod.launch(kernels, arena, stream, None, None)
    assert kernel.name == f"linear_{role}_f32"
    c, sums = prod.outputs()
    assert (c[:, n:].view(np.uint32) == 0xFFFFFFFF).all(), "the output's padding was written"
    err = rel(c[:, :n], prod.want)
    assert err < 1e-5, f"{kernel.name} {m}x{n}x{k}, {p.splits} splits: rel {err:.3g}"
    if prod.ref_sums is not None:
        assert rel(sums, prod.ref_sums) < 1e-5


def test_shapes_cover_split_and_unsplit_launches_of_every_tile(device):
    for precision, tiles in (("tf32", ALL_TILES), ("3xtf32", ALL_TILES)):
        for tile in tiles:
            splits = {plan(m, n, k, device.sm_count, precision=precision, tile=tile).splits for m, n, k in SHAPES}
            assert 1 in splits and max(splits) > 1, (precision, tile.name, splits)


def test_shapes_cover_whole_and_bounded_blocks_of_the_32x32_forward(device):
    """The 32x32 tile's TF32 kernels run a k loop without bounds in a block whose every
    copy is in bounds (kernels/gemm.cu's `whole`: the split's k range whole k tiles, the
    block inside M and N), the bounded loop elsewhere: SHAPES hold grids of each kind
    and one with both. And one bounded split ends inside a k tile that its k loop copies
    (past the ring's first STAGES - 1 = 4 tiles, which the prologue copies with bounds):
    the only case where a block wrongly taken for whole changes a stored output."""
    bk, prologue_tiles = TILE_32.bk, 4

    def kinds(m, n, k):
        splits = plan(m, n, k, device.sm_count, precision="tf32", tile=TILE_32).splits
        per = -(-(-(-k // bk)) // splits)
        found, tail_in_loop = set(), False
        for z in range(splits):
            kb = min(k, z * per * bk)
            ke = min(k, kb + per * bk)
            tail_in_loop |= (ke - kb) % bk != 0 and -(-(ke - kb) // bk) > prologue_tiles
            for i0 in range(0, m, TILE_32.bm):
                for j0 in range(0, n, TILE_32.bn):
                    found.add((ke - kb) % bk == 0 and i0 + TILE_32.bm <= m and j0 + TILE_32.bn <= n)
        return found, tail_in_loop

    seen = [kinds(*shape) for shape in SHAPES]
    grids = [found for found, _ in seen]
    assert {True} in grids and {False} in grids and {True, False} in grids, seen
    assert any(tail for _, tail in seen), seen


@pytest.mark.parametrize("role, tile, vector", [v for v in VARIANTS if v.values[2] == 16])
def test_runs_are_bitwise_identical_and_graph_replay_matches_eager(device, stream, rng, role, tile, vector):
    skip_unless_compiled(device, tile)
    m, n, k = 512, 19, 1024  # split k with every tile
    kernels = kernels_for(role, device)
    prod = Product(role, m, n, k, 16, rng)
    arena, p = arena_for(kernels, role, m, n, k, tile)
    assert p.splits > 1
    runs = []
    for _ in range(2):
        arena.reset()
        prod.poison(stream)
        prod.launch(kernels, arena, stream, tile, None)
        runs.append(prod.outputs())
    arena.reset()
    with capture(stream) as graph:
        prod.launch(kernels, arena, stream, tile, None)
    exe = graph.instantiate()
    for _ in range(2):
        prod.poison(stream)
        exe.launch(stream)
        runs.append(prod.outputs())
    first_c, first_sums = runs[0]
    assert not np.isnan(first_c[:, :n]).any()
    for c, sums in runs[1:]:
        assert c.tobytes() == first_c.tobytes()
        if sums is not None:
            assert sums.tobytes() == first_sums.tobytes()


@pytest.mark.parametrize("role", ["grad_input", "grad_weight"])
def test_wgmma_backward_runs_a_producer_beside_two_mma_warpgroups(device, role):
    """The wgmma backward's block is three warpgroups (two issue the MMAs, one loads
    and converts B): 384 threads, read from the kernel's launch bounds; and the host
    gives it the 129 KB of shared memory its stages take (the kernel traps on less)."""
    skip_unless_compiled(device, WGMMA_TILE)
    kernel = kernels_for(role, device).kernels[(role, WGMMA_TILE, 16)]
    assert kernel.kernel.block == 384
    assert kernel.shared_bytes == 129 * 1024


@pytest.mark.parametrize("splits", range(2, 9))
@pytest.mark.parametrize("role", ROLES)
def test_wgmma_splits_summed_in_a_cluster_or_through_global_memory_give_the_same_bits(device, stream, rng, role,
                                                                                       splits):
    """The wgmma kernels launch a tile's splits as one cluster that sums them in
    distributed shared memory (the default, no workspace); launched without a
    cluster they take gemm.cu's workspace and counters instead. Both add the same
    partials in the same z order: the same bits, and float64 agrees. Every split
    count a cluster takes, 2 to 8: with 3 splits the cluster's blocks store 43, 43
    and 42 rows of each tile, with 6 five of 22 and one of 18."""
    skip_unless_compiled(device, WGMMA_TILE)
    m, n, k = 300, 260, 1024
    kernels = kernels_for(role, device)
    prod = Product(role, m, n, k, 16, rng)
    p = kernels.plan(role, m, n, k, tile=WGMMA_TILE, splits=splits)
    assert p.splits == splits and p.workspace_floats == 0 and p.counters == 0
    arena = Arena(1024)
    prod.poison(stream)
    kernels.launch(role, prod.a, prod.lda, prod.b, prod.ldb, prod.c, prod.ldc, m, n, k, arena=arena, stream=stream,
                   tile=WGMMA_TILE, vector=16, splits=splits, **prod.epilogue)
    clustered = prod.outputs()
    work, workspace, counters = split_workspace(WGMMA_TILE, m, n, p.splits)
    prod.poison(stream)
    gemm(kernels.kernels[(role, WGMMA_TILE, 16)], prod.a, prod.lda, prod.b, prod.ldb, prod.c, prod.ldc, m, n, k,
         stream, splits=p.splits, workspace=workspace, counters=counters, cluster=False, **prod.epilogue)
    through_memory = prod.outputs()
    assert not np.isnan(clustered[0][:, :n]).any()
    assert clustered[0].tobytes() == through_memory[0].tobytes()
    if prod.ref_sums is not None:
        assert clustered[1].tobytes() == through_memory[1].tobytes()
        assert rel(clustered[1], prod.ref_sums) < X3_BOUND
    bound = TF32_BOUND if role.startswith("forward") else X3_BOUND
    assert rel(clustered[0][:, :n], prod.want) < bound


@pytest.mark.parametrize("way", ["unsplit", "cluster", "workspace"])
@pytest.mark.parametrize("c_aligned, mask_aligned", [(True, False), (False, True)], ids=["c16-mask4", "c4-mask16"])
def test_wgmma_grad_input_with_output_and_mask_aligned_apart(device, stream, rng, c_aligned, mask_aligned, way):
    """The wgmma grad-input epilogue stores 16 bytes at a time where C allows it and
    loads the ReLU mask 16 bytes at a time where the mask allows it, each decided on
    its own: an aligned output with a mask that is not, and the other way round,
    unsplit (the staged rounds, in groups of 4), in 3 clustered splits (43, 43 and 42
    rows a block, groups of 2) and in 3 splits through the workspace. Float64 agrees,
    every masked output is exactly 0, no output is left unwritten and the padding is
    untouched."""
    skip_unless_compiled(device, WGMMA_TILE)
    m, n, k = 300, 260, 256
    f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    dy, w, x = f32(m, k), f32(k, n), np.maximum(f32(m, n), 0.0)
    lda, ldb = padded_ld(k, 16), padded_ld(n, 16)
    ldc, ldm = (n + 4 if c_aligned else n + 5), (n + 4 if mask_aligned else n + 1)
    a, b, mask = device_matrix(dy, lda), device_matrix(w, ldb), device_matrix(x, ldm)
    c = DeviceBuffer((m, ldc), np.float32)
    c.poison(stream=stream)
    kernel = kernels_for("grad_input", device).kernels[("grad_input", WGMMA_TILE, 16)]
    splits = 1 if way == "unsplit" else 3
    through_memory = {}
    if way == "workspace":
        work, workspace, counters = split_workspace(WGMMA_TILE, m, n, splits)
        through_memory = dict(workspace=workspace, counters=counters)
    gemm(kernel, a, lda, b, ldb, c, ldc, m, n, k, stream, splits=splits, cluster=way == "cluster", mask=mask,
         ldm=ldm, **through_memory)
    out = c.to_numpy()
    got = out[:, :n]
    assert not np.isnan(got).any(), f"{np.isnan(got).sum()} outputs unwritten"
    assert (out[:, n:].view(np.uint32) == 0xFFFFFFFF).all(), "the output's padding was written"
    assert (got[x <= 0] == 0).all(), "an output the mask zeroes is not 0"
    assert rel(got, (dy.astype(np.float64) @ w.astype(np.float64)) * (x > 0)) < X3_BOUND


def launch_each_way(stream, ways, prod, splits, bound):
    """Run ``prod``'s product in ``splits`` splits once per (kernel, cluster) of
    ``ways`` (cluster True: each tile's splits as one cluster; False: through a
    workspace and counters), each checked for unwritten outputs and against float64
    (``bound``; db at 1e-5). Returns (where, C, the bits of C and db) per run."""
    m, n, k = prod.m, prod.n, prod.k
    runs = []
    for kernel, cluster in ways:
        work, workspace, counters = split_workspace(kernel.tile, m, n, splits)
        prod.poison(stream)
        gemm(kernel, prod.a, prod.lda, prod.b, prod.ldb, prod.c, prod.ldc, m, n, k, stream, splits=splits,
             workspace=0 if cluster else workspace, counters=0 if cluster else counters, cluster=cluster,
             **prod.epilogue)
        c, sums = prod.outputs()
        where = f"{kernel.name} " + ("in a cluster" if cluster else "through memory")
        assert not np.isnan(c[:, :n]).any(), f"{np.isnan(c[:, :n]).sum()} outputs unwritten ({where})"
        assert rel(c[:, :n], prod.want) < bound, where
        if sums is not None:
            assert not np.isnan(sums).any() and rel(sums, prod.ref_sums) < X3_BOUND, where
        runs.append((where, c, c.tobytes() + (b"" if sums is None else sums.tobytes())))
        work.close()
    return runs


@pytest.mark.parametrize("splits", [4, 5, 8])
@pytest.mark.parametrize("role, tile, vector", [v for v in VARIANTS if v.values[1].name == "32x32"])
def test_mma_splits_summed_in_a_cluster_or_through_global_memory_give_the_same_bits(device, stream, rng, role, tile,
                                                                                     vector, splits):
    """gemm.cu's `_cluster_` kernels launched as clusters of a tile's splits (compute
    capability 9.0): block 0 of a tile adds the other blocks' partials over
    distributed shared memory. Launched without clusters they take the workspace and
    counters, as the tile's plain kernel does. All three add the same partials in z
    order from 0: the same bits, and float64 agrees. The rule clusters the 32x32
    tile's splits up to 4; its `_cluster_` kernels take any split up to 8 (its plain
    kernels and the 64x64 tile's are refused: they have no cluster path). 200 x 77
    leaves warps with no output in the edge tiles (they meet the barriers only); 600
    deep cuts the last split shorter."""
    if tuple(device.compute_capability) < (9, 0):
        pytest.skip(f"clusters need compute capability 9.0; this device is {device.arch}")
    m, n, k = 200, 77, 600
    kernels = kernels_for(role, device)
    prod = Product(role, m, n, k, vector, rng)
    p = kernels.plan(role, m, n, k, tile=tile, splits=splits, vector=vector)
    assert p.splits == splits and p.cluster == (splits <= tile.cluster_splits)
    assert (p.workspace_floats == 0) == p.cluster
    clustered, plain = kernels.clustered[(role, tile, vector)], kernels.kernels[(role, tile, vector)]
    assert "_cluster_" in clustered.name and "_cluster_" not in plain.name
    for refused in (plain, kernels.kernels[(role, TILES[0], vector)]):
        with pytest.raises(ValueError, match="does not reduce its splits in a cluster"):
            gemm(refused, prod.a, prod.lda, prod.b, prod.ldb, prod.c, prod.ldc, m, n, k, stream, splits=splits,
                 cluster=True, **prod.epilogue)
    with pytest.raises(ValueError, match="9 splits in one cluster; a tile's splits meet in a cluster of at most 8"):
        gemm(clustered, prod.a, prod.lda, prod.b, prod.ldb, prod.c, prod.ldc, m, n, k, stream, splits=9,
             cluster=True, **prod.epilogue)
    bound = TF32_BOUND if role.startswith("forward") else X3_BOUND
    runs = launch_each_way(stream, [(clustered, True), (clustered, False), (plain, False)], prod, splits, bound)
    for where, c, _ in runs:
        assert (c[:, n:].view(np.uint32) == 0xFFFFFFFF).all(), f"the output's padding was written ({where})"
    assert len({bits for _, _, bits in runs}) == 1, "a cluster and the workspace gave different bits"


@pytest.mark.parametrize("vector", [16, 4])
@pytest.mark.parametrize("m, n, k, in0", [(256, 256, 256, 4), (200, 77, 300, 3), (45, 40, 33, 8), (70, 64, 128, 1)],
                         ids=["256x256x256-in4", "200x77x300-in3", "45x40x33-in8", "70x64x128-in1"])
def test_first_layer_dw_folded_into_the_grad_input_matches_float64(device, stream, rng, m, n, k, in0, vector):
    """grad_input_dw0: the second layer's dX (dY W, masked) is not stored; its tiles
    sum dW0 = dX^T X0 and db0 = dX's column sums, and the last tile of each column
    strip adds the strip's shares. Against float64 at 1e-5 (3xTF32 dX, FP32 sums),
    nothing unwritten, dX's buffer untouched; at 1 to 4 splits, a tile's splits in a
    cluster and through the workspace give the same bits (every other run on the
    `_settled_` kernel: W before the wait). 200 x 77 and 45 x 40 leave edge tiles part
    empty (and warps with no rows); in0 = 8 is the bound."""
    if tuple(device.compute_capability) < (9, 0):
        pytest.skip(f"the folded kernels run in clusters: compute capability 9.0; this device is {device.arch}")
    kernels = kernels_for("grad_input", device)
    prod = Product("grad_input", m, n, k, vector, rng)
    x0 = rng.standard_normal((m, in0)).astype(np.float32)
    ldx0 = in0 + 2
    x0_dev = device_matrix(x0, ldx0)
    want_dw = prod.want.T @ x0.astype(np.float64)
    want_db = prod.want.sum(axis=0)
    p = kernels.plan_first_dw(m, n, k, in0)
    assert p is not None and p.tile.name == "32x32"
    # The rule folds nothing it cannot: a 9-wide input, or a product of 8 splits.
    assert kernels.plan_first_dw(m, n, k, 9) is None and kernels.plan_first_dw(200, 77, 600, 3) is None
    kernel = kernels.first_dw[vector]
    settled = kernels.settled[(kernel.role, kernel.tile, vector, True)]
    assert settled.name == kernel.name.replace("_3xtf32", "_settled_3xtf32")
    rows, cols = -(-m // 32), -(-n // 32)
    runs = []
    for splits in sorted({1, 2, 3, 4, p.splits}):
        for cluster in ((True, False) if splits > 1 else (False,)):
            dw, db = DeviceBuffer((n, in0), np.float32), DeviceBuffer((n,), np.float32)
            for buf in (dw, db, prod.c):
                buf.poison(stream=stream)
            floats = rows * cols * splits * 32 * 32
            work = Arena(4 * (floats + rows * cols * 32 * (in0 + 1)) + 4096,
                         zeroed_bytes=4 * (rows * cols + cols) + 512)
            gemm(settled if len(runs) % 2 else kernel, prod.a, prod.lda, prod.b, prod.ldb, 0, n, m, n, k, stream,
                 splits=splits,
                 workspace=0 if cluster or splits == 1 else work.array(floats, np.float32),
                 counters=0 if cluster or splits == 1 else work.zeroed(rows * cols, np.uint32), cluster=cluster,
                 mask=prod.mask, ldm=prod.ldm,
                 first_dw=(x0_dev, ldx0, in0, dw, db, work.array(rows * cols * 32 * (in0 + 1), np.float32),
                           work.zeroed(cols, np.uint32)))
            got_dw, got_db = dw.to_numpy(), db.to_numpy()
            where = f"{splits} splits " + ("in a cluster" if cluster else "through memory")
            assert not np.isnan(got_dw).any() and not np.isnan(got_db).any(), f"unwritten ({where})"
            assert rel(got_dw, want_dw) < X3_BOUND, where
            assert rel(got_db, want_db) < X3_BOUND, where
            assert np.isnan(prod.c.to_numpy()).all(), f"dX was written ({where})"
            runs.append((splits, got_dw.tobytes() + got_db.tobytes()))
            work.close()
    for splits in {s for s, _ in runs}:  # another split sums dX in another order: other bits, each path the same
        assert len({bits for s, bits in runs if s == splits}) == 1, f"{splits} splits: a cluster and memory differ"
    with pytest.raises(ValueError, match="with 1 <= in0 <= 8"):
        gemm(kernel, prod.a, prod.lda, prod.b, prod.ldb, 0, n, m, n, k, stream, mask=prod.mask, ldm=prod.ldm,
             first_dw=(x0_dev, ldx0, 9, 0, 0, 0, 0))
    with pytest.raises(ValueError, match="first_dw goes with the grad_input_dw0 kernels"):
        gemm(kernels.kernels[("grad_input", TILES[1], vector)], prod.a, prod.lda, prod.b, prod.ldb, prod.c, prod.ldc,
             m, n, k, stream, mask=prod.mask, ldm=prod.ldm, first_dw=(x0_dev, ldx0, in0, 0, 0, 0, 0))


@pytest.mark.parametrize("vector", [16, 4])
@pytest.mark.parametrize("role", ["forward_relu", "forward"])
@pytest.mark.parametrize("m, n, k, in0", [(256, 256, 256, 4), (200, 77, 300, 3), (45, 40, 33, 8), (70, 64, 128, 1)],
                         ids=["256x256x256-in4", "200x77x300-in3", "45x40x33-in8", "70x64x128-in1"])
def test_first_layer_folded_into_the_forward_matches_float64(device, stream, rng, m, n, k, in0, role, vector):
    """forward[_relu]_x0: the first layer, H0 = relu(X0 W0^T + b0) [m, k], is computed
    in the second layer's product (FP32), which also stores every element of H0 once.
    H0 against float64 at 1e-6, C (TF32 on H0) at the TF32 bound; nothing unwritten,
    the padding of H0 and C untouched; at 1 to 4 splits (k = 300 needs 2: at most 256
    k a split), a tile's splits in a cluster and through the workspace give the same
    bits, and H0 the same bits at every split. Without H0's buffer (0) C is the same.
    Every other run is the `_settled_` kernel (W, W0 and b0 before the wait): the same bits.
    X0's rows of 1 and 3 inputs are padded with NaN: a kernel that read past in0 would
    show it; those of 4 and 8 are packed and 16-byte aligned (the 16-byte loads)."""
    if tuple(device.compute_capability) < (9, 0):
        pytest.skip(f"the folded kernels run in clusters: compute capability 9.0; this device is {device.arch}")
    from drvtrain.nn.mlp import X0_MAX_K
    kernels = kernels_for("forward", device)
    f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    x0, w0, b0, w1, b1 = f32(m, in0), f32(k, in0), f32(k), f32(n, k), f32(n)
    # Rows of 4 or 8 inputs, packed, take 16-byte loads (as a net's input does); the others
    # are padded with NaN, so a kernel that read past in0 would show it.
    ldx0, ldh, ldw = in0 if in0 % 4 == 0 else in0 + 2, padded_ld(k, vector), padded_ld(k, vector)
    x0_dev, w1_dev = device_matrix(x0, ldx0), device_matrix(w1, ldw)
    w0_dev, b0_dev, b1_dev = (DeviceBuffer.from_numpy(v) for v in (w0, b0, b1))
    h0_want = np.maximum(x0.astype(np.float64) @ w0.T.astype(np.float64) + b0, 0.0)
    want = h0_want @ w1.T.astype(np.float64) + b1
    if role == "forward_relu":
        want = np.maximum(want, 0.0)
    p = kernels.plan_first_layer(role, m, n, k, in0)
    assert p is not None and p.tile is TILE_32
    # The rule folds nothing it cannot: a 9-wide input, or a product the wgmma tile takes.
    assert kernels.plan_first_layer(role, m, n, k, 9) is None
    assert kernels.plan_first_layer(role, 512, 1024, 1024, in0) is None
    kernel = kernels.first_layer[(role, vector)]
    settled = kernels.settled[(kernel.role, kernel.tile, vector, True)]
    assert settled.name == kernel.name.replace("_tf32", "_settled_tf32")
    h0, c = DeviceBuffer((m, ldh), np.float32), DeviceBuffer((m, n + 5), np.float32)
    rows, cols = -(-m // 32), -(-n // 32)
    k_tiles = -(-k // 16)
    runs, h0_bits = [], set()
    for splits in sorted({1, 2, 3, 4, p.splits}):
        if -(-k_tiles // splits) * 16 > X0_MAX_K:
            with pytest.raises(ValueError, match=f"more than {X0_MAX_K} k a split"):
                gemm(kernel, h0, ldh, w1_dev, ldw, c, n + 5, m, n, k, stream, bias=b1_dev, splits=splits,
                     first_layer=(x0_dev, ldx0, in0, w0_dev, b0_dev))
            continue
        for cluster, store in ([(True, True), (False, True), (True, False)] if splits > 1 else [(False, True),
                                                                                                  (False, False)]):
            for buf in (h0, c):
                buf.poison(stream=stream)
            floats = rows * cols * splits * 32 * 32
            work = Arena(4 * floats + 4096, zeroed_bytes=4 * rows * cols + 512)
            gemm(settled if len(runs) % 2 else kernel, h0 if store else 0, ldh, w1_dev, ldw, c, n + 5, m, n, k,
                 stream, bias=b1_dev, splits=splits,
                 workspace=0 if cluster or splits == 1 else work.array(floats, np.float32),
                 counters=0 if cluster or splits == 1 else work.zeroed(rows * cols, np.uint32), cluster=cluster,
                 first_layer=(x0_dev, ldx0, in0, w0_dev, b0_dev))
            got_h0, got = h0.to_numpy(), c.to_numpy()
            where = f"{splits} splits " + ("in a cluster" if cluster else "through memory") + \
                (", H0 stored" if store else ", H0 not stored")
            assert not np.isnan(got[:, :n]).any(), f"{np.isnan(got[:, :n]).sum()} outputs unwritten ({where})"
            assert rel(got[:, :n], want) < TF32_BOUND, where
            assert np.isnan(got[:, n:]).all(), f"C's padding was written ({where})"
            assert np.isnan(got_h0[:, k:]).all(), f"H0's padding was written ({where})"
            if store:
                assert not np.isnan(got_h0[:, :k]).any(), f"{np.isnan(got_h0[:, :k]).sum()} of H0 unwritten ({where})"
                assert rel(got_h0[:, :k], h0_want) < 1e-6, where
                h0_bits.add(got_h0[:, :k].tobytes())
            else:
                assert np.isnan(got_h0).all(), f"H0 was written without its buffer ({where})"
            runs.append((splits, got[:, :n].tobytes()))
            work.close()
    assert len(h0_bits) == 1, "H0 changed bits with the split"
    for splits in {s for s, _ in runs}:
        assert len({bits for s, bits in runs if s == splits}) == 1, f"{splits} splits: the runs differ"
    with pytest.raises(ValueError, match="with 1 <= in0 <= 8"):
        gemm(kernel, h0, ldh, w1_dev, ldw, c, n + 5, m, n, k, stream, bias=b1_dev, splits=p.splits,
             cluster=p.cluster, first_layer=(x0_dev, ldx0, 9, w0_dev, b0_dev))
    with pytest.raises(ValueError, match="first_layer goes with the forward_x0 kernels"):
        gemm(kernels.kernels[(role, TILES[1], vector)], h0, ldh, w1_dev, ldw, c, n + 5, m, n, k, stream,
             bias=b1_dev, first_layer=(x0_dev, ldx0, in0, w0_dev, b0_dev))
    with pytest.raises(ValueError, match="first_layer goes with the forward_x0 kernels"):
        gemm(kernel, h0, ldh, w1_dev, ldw, c, n + 5, m, n, k, stream, bias=b1_dev, splits=p.splits,
             cluster=p.cluster)


@pytest.mark.parametrize("role, tile, vector", [v for v in VARIANTS if v.values[1] is not WGMMA_TILE
                                                and v.values[0] != "grad_weight"])
def test_settled_weights_load_before_the_wait_to_the_same_bits(device, stream, rng, role, tile, vector):
    """gemm.cu's forward and dX products on their `_settled_` kernels (B, the weights,
    loaded before waiting for the kernel before): A is poisoned, then written by a late
    one-block kernel (`late_copy`) launched just before the product, both dependent
    launches, so the product's blocks start while A is still poison. At the planned
    split and at 1, 3 and 8 splits (8: the 32x32 tile's plain kernels, and splits with
    no k tile), C is the same bits as an ordinary launch's, nothing unwritten, twice
    over: a product that read A before its wait, or lost one of B's early tiles, would
    show it."""
    if tuple(device.compute_capability) < (9, 0):
        pytest.skip(f"programmatic dependent launch needs compute capability 9.0; this device is {device.arch}")
    m, n, k = 200, 77, 300  # edge tiles, and split k on both tiles
    kernels = kernels_for(role, device)
    prod = Product(role, m, n, k, vector, rng)
    a_values = DeviceBuffer.from_numpy(prod.a.to_numpy())  # A as it lies, padding included
    copy = late_copy()
    bound = TF32_BOUND if role.startswith("forward") else X3_BOUND
    launch = lambda arena, splits, **settled: kernels.launch(
        role, prod.a, prod.lda, prod.b, prod.ldb, prod.c, prod.ldc, m, n, k, arena=arena, stream=stream, tile=tile,
        vector=vector, splits=splits, **settled, **prod.epilogue)
    for splits in (None, 1, 3, 8):
        p = kernels.plan(role, m, n, k, tile=tile, splits=splits)
        arena = Arena(4 * p.workspace_floats + 1024, zeroed_bytes=4 * p.counters + 256)
        prod.poison(stream)
        kernel = launch(arena, splits)
        want, _ = prod.outputs()
        assert not np.isnan(want[:, :n]).any() and rel(want[:, :n], prod.want) < bound, kernel.name
        for _ in range(2):
            prod.a.poison(stream=stream)
            prod.poison(stream)
            arena.reset()
            with dependent_launches(True):
                copy.launch(1, 128, prod.a, a_values, words(prod.a), 0, 0, 0, LATE_NS, stream=stream)
                again = launch(arena, splits, settled=True)
            assert again.settled and again.name == kernel.name.replace("_tf32", "_settled_tf32").replace(
                "_3xtf32", "_settled_3xtf32")
            got, _ = prod.outputs()
            where = f"{again.name}, {p.splits} splits"
            assert not np.isnan(got[:, :n]).any(), f"{where}: {np.isnan(got[:, :n]).sum()} outputs NaN or unwritten"
            assert got.tobytes() == want.tobytes(), f"{where}: not the ordinary launch's bits"
        arena.close()


@pytest.mark.parametrize("vector", [16, 4])
@pytest.mark.parametrize("role", ["forward_relu_x0", "grad_input_dw0"])
def test_settled_folded_kernels_read_their_input_after_the_wait(device, stream, rng, role, vector):
    """The folded `_settled_` kernels (W, and the forward's W0 and b0, before the wait)
    under dependent launch: the input that the kernel before writes (the forward's X0,
    the dX's dY) is poisoned, then written by `late_copy` launched just before. H0 and
    C (the forward), dW0 and db0 (the dX) are the same bits as the plain kernel's,
    nothing unwritten: a forward that read X0 before its wait, or a dX that read dY
    before it, would show it."""
    if tuple(device.compute_capability) < (9, 0):
        pytest.skip(f"the folded kernels run in clusters: compute capability 9.0; this device is {device.arch}")
    m, n, k, in0 = 256, 256, 256, 4
    f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    copy = late_copy()
    arena = Arena(1 << 22, zeroed_bytes=1 << 14)
    if role == "forward_relu_x0":
        kernels = kernels_for("forward", device)
        x0 = DeviceBuffer.from_numpy(f32(m, in0))
        w0, b0, b1 = (DeviceBuffer.from_numpy(v) for v in (f32(k, in0), f32(k), f32(n)))
        ldw = k if vector == 16 else k + 1  # W's rows of k + 1 floats: 4-byte copies
        w1 = device_matrix(f32(n, k), ldw)
        h0, c = DeviceBuffer((m, k), np.float32), DeviceBuffer((m, n), np.float32)
        written, outputs = x0, (h0, c)
        run = lambda **settled: kernels.launch_first_layer(
            "forward_relu", w1, ldw, c, n, m, n, k, bias=b1, x0=x0, ldx0=in0, in0=in0, w0=w0, b0=b0, h0=h0,
            arena=arena, stream=stream, **settled)
    else:
        kernels = kernels_for("grad_input", device)
        prod = Product("grad_input", m, n, k, vector, rng)
        x0 = DeviceBuffer.from_numpy(f32(m, in0))
        dw0, db0 = DeviceBuffer((n, in0), np.float32), DeviceBuffer((n,), np.float32)
        written, outputs = prod.a, (dw0, db0)
        run = lambda **settled: kernels.launch_first_dw(
            prod.a, prod.lda, prod.b, prod.ldb, m, n, k, mask=prod.mask, ldm=prod.ldm, x0=x0, ldx0=in0, in0=in0,
            dw0=dw0, db0=db0, arena=arena, stream=stream, **settled)
    values = DeviceBuffer.from_numpy(written.to_numpy())
    for buf in outputs:
        buf.poison(stream=stream)
    run()
    want = [buf.to_numpy() for buf in outputs]
    assert not any(np.isnan(w).any() for w in want)
    for _ in range(2):
        written.poison(stream=stream)
        for buf in outputs:
            buf.poison(stream=stream)
        arena.reset()
        with dependent_launches(True):
            copy.launch(1, 128, written, values, words(written), 0, 0, 0, LATE_NS, stream=stream)
            run(settled=True)
        for buf, w in zip(outputs, want):
            got = buf.to_numpy()
            assert not np.isnan(got).any(), f"{role}: {np.isnan(got).sum()} NaN or unwritten"
            assert got.tobytes() == w.tobytes(), f"{role}: not the plain kernel's bits"
    arena.close()


def test_gate_skips_every_write_of_the_folded_forward(device, stream, rng):
    """forward_relu_x0 (the small nets' second layer with the first computed in it),
    4 splits in clusters: closed, H0 and C keep their poison; open, both are the
    float64 layers."""
    if tuple(device.compute_capability) < (9, 0):
        pytest.skip(f"the folded kernels run in clusters: compute capability 9.0; this device is {device.arch}")
    kernels = kernels_for("forward", device)
    m = n = k = 256
    f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    x0, w0, b0, w1, b1 = f32(m, 4), f32(k, 4), f32(k), f32(n, k), f32(n)
    bufs = [DeviceBuffer.from_numpy(v) for v in (x0, w0, b0, w1, b1)]
    h0_want = np.maximum(x0.astype(np.float64) @ w0.T.astype(np.float64) + b0, 0.0)
    want = np.maximum(h0_want @ w1.T.astype(np.float64) + b1, 0.0)
    h0, c = DeviceBuffer((m, k), np.float32), DeviceBuffer((m, n), np.float32)
    arena = Arena(4096, zeroed_bytes=4096)
    gate = DeviceBuffer.from_numpy(np.ones(1, np.int32))
    for closed in (1, 0):
        gate.copy_from_numpy(np.full(1, closed, np.int32))
        h0.poison(stream=stream)
        c.poison(stream=stream)
        arena.reset()
        kernel = kernels.launch_first_layer("forward_relu", bufs[3], k, c, n, m, n, k, bias=bufs[4], x0=bufs[0],
                                            ldx0=4, in0=4, w0=bufs[1], b0=bufs[2], h0=h0, arena=arena,
                                            stream=stream, gate=gate, splits=4)
        got_h0, got = h0.to_numpy(), c.to_numpy()
        if closed:
            assert np.isnan(got_h0).all() and np.isnan(got).all(), kernel.name
        else:
            assert rel(got_h0, h0_want) < 1e-6 and rel(got, want) < TF32_BOUND, kernel.name


@pytest.mark.parametrize("k, splits", [(150, 4), (90, 1)], ids=["k150-4splits", "k90-3tiles"])
@pytest.mark.parametrize("role", ["grad_input", "grad_weight"])
def test_wgmma_backward_on_splits_with_no_k_tile_and_with_three(device, stream, rng, role, k, splits):
    """The wgmma backward at the edges of its k loop, launched directly (the planner
    never cuts an empty split). K = 150 in 4 splits is 5 k tiles of 32 cut 2, 2, 1
    (22 deep) and 0: the last block of every tile runs no k tile, meets no hand-over
    barrier, and adds zeros, in a cluster and through the workspace alike. K = 90
    unsplit is exactly the three tiles the copies run ahead (the last 26 deep).
    Against float64 at 1e-5, db included, nothing left unwritten."""
    skip_unless_compiled(device, WGMMA_TILE)
    m, n = 300, 260
    kernels = kernels_for(role, device)
    kernel = kernels.kernels[(role, WGMMA_TILE, 16)]
    prod = Product(role, m, n, k, 16, rng)
    runs = launch_each_way(stream, [(kernel, cluster) for cluster in ((True, False) if splits > 1 else (False,))],
                           prod, splits, X3_BOUND)
    assert len({bits for _, _, bits in runs}) == 1, "a cluster and the workspace gave different bits"


@pytest.mark.parametrize("role, tile", [("grad_weight", None), ("forward", WGMMA_TILE), ("grad_input", WGMMA_TILE),
                                        ("grad_weight", WGMMA_TILE)],
                         ids=["dW", "wgmma-forward", "wgmma-dX", "wgmma-dW"])
def test_gate_skips_every_write(device, stream, rng, role, tile):
    skip_unless_compiled(device, tile)
    kernels = kernels_for(role, device)
    m, n, k = (256, 3, 256) if tile is None else (300, 260, 1024)
    prod = Product(role, m, n, k, 16, rng)
    arena, _ = arena_for(kernels, role, m, n, k, tile)
    gate = DeviceBuffer.from_numpy(np.ones(1, np.int32))
    for closed in (1, 0):  # closed: nothing written; open: the product
        gate.copy_from_numpy(np.full(1, closed, np.int32))
        prod.poison(stream)
        arena.reset()
        kernel = kernels.launch(role, prod.a, prod.lda, prod.b, prod.ldb, prod.c, prod.ldc, m, n, k, arena=arena,
                                stream=stream, gate=gate, tile=tile, **prod.epilogue)
        c, sums = prod.outputs()
        if closed:
            assert np.isnan(c).all() and (sums is None or np.isnan(sums).all()), kernel.name
        else:
            assert rel(c[:, :n], prod.want) < (TF32_BOUND if role == "forward" else X3_BOUND), kernel.name


@pytest.mark.parametrize("role", ["forward_relu", "grad_input", "grad_weight"])
def test_gate_skips_every_write_of_a_clustered_split(device, stream, rng, role):
    """The 32x32 tile's kernels load the gate with their first tiles and test it once
    those copies are issued. A product split 4 ways in clusters (the small nets'
    plan): closed, every output keeps its poison; open, the float64 product."""
    kernels = kernels_for(role, device)
    m = n = k = 256
    p = kernels.plan(role, m, n, k, tile=TILE_32, splits=4, vector=16)
    assert p.cluster and p.splits == 4, p
    prod = Product(role, m, n, k, 16, rng)
    arena, _ = arena_for(kernels, role, m, n, k, TILE_32)
    gate = DeviceBuffer.from_numpy(np.ones(1, np.int32))
    for closed in (1, 0):
        gate.copy_from_numpy(np.full(1, closed, np.int32))
        prod.poison(stream)
        arena.reset()
        kernel = kernels.launch(role, prod.a, prod.lda, prod.b, prod.ldb, prod.c, prod.ldc, m, n, k, arena=arena,
                                stream=stream, gate=gate, tile=TILE_32, splits=4, vector=16, **prod.epilogue)
        assert "_cluster_" in kernel.name
        c, sums = prod.outputs()
        if closed:
            assert np.isnan(c).all() and (sums is None or np.isnan(sums).all()), kernel.name
        else:
            assert rel(c[:, :n], prod.want) < (TF32_BOUND if role == "forward_relu" else X3_BOUND), kernel.name


def test_forced_16_byte_copies_on_unaligned_operands_are_refused(device, stream, rng):
    kernels = kernels_for("forward", device)
    prod = Product("forward", 8, 8, 9, 4, rng)  # lda = 12: aligned rows; shift A by one float
    arena = Arena(1 << 16)
    shifted = prod.a.view(np.float32, (8 * 12 - 1,), 4)
    with pytest.raises(ValueError, match="16-byte copies"):
        kernels.launch("forward", shifted, prod.lda, prod.b, prod.ldb, prod.c, prod.ldc, 8, 8, 9, arena=arena,
                       stream=stream, vector=16, bias=prod.bias)


@pytest.mark.parametrize("widths", [[128, 1024, 1024, 19], [512, 1024, 1024, 19]], ids=["128-in", "512-in"])
@pytest.mark.parametrize("presplit", [True, False], ids=["presplit", "tile-split"])
@pytest.mark.parametrize("graph", [False, True])
def test_backward_on_a_weight_stream_matches_one_stream_bitwise(device, rng, graph, presplit, widths):
    """dW/db on their own stream, overlapping the dX chain, and on two (the output
    layer's and the hidden layer's side by side): the same bits as on one stream, and
    float64 to 1e-5 (3xTF32), for nets with 1024-wide layers. Pre-split, also with the
    weights split ahead on a third stream (MLP.split_weights); with a 512-wide input
    the first layer's dW runs pre-split too, on the main stream."""
    batch = 512
    layout = ParamLayout.from_widths(widths)
    params = FlatBuffer(layout, layout.init_numpy(int(rng.integers(1 << 30))))
    x = rng.standard_normal((batch, widths[0])).astype(np.float32)
    dout = rng.standard_normal((batch, widths[-1])).astype(np.float32)
    xd, dd = DeviceBuffer.from_numpy(x), DeviceBuffer.from_numpy(dout)
    mlp = MLP(layout, tf32=False, presplit=presplit)
    assert mlp.backward_precision == "3xtf32"
    if wgmma_available(device):
        want = {1: (True, True)} | ({0: (False, True)} if widths[0] == 512 else {})
        assert mlp.presplit_layers(batch) == (want if presplit else {})
    arena = Arena(mlp.scratch_bytes(batch), zeroed_bytes=mlp.zeroed_bytes(batch) + 256)
    main, side, side2, early = Stream(), Stream(), Stream(), Stream()
    results, activations = [], []
    runs = [(None, False), (side, False), ((side, side2), False)] + \
        ([(side, True), ((side, side2), True)] if mlp.presplit_layers(batch) else [])
    for weight_stream, ahead in runs:
        grads = FlatBuffer(layout)
        grads.buffer.poison(stream=main)

        def enqueue():
            arena.reset()
            splits = None
            if ahead:
                fork(main, early)
                splits = mlp.split_weights(params, batch, arena=arena, stream=early)
            fwd = mlp.forward(params, xd, arena=arena, stream=main)
            activations[:] = fwd.activations
            mlp.backward(params, grads, fwd, dd, arena=arena, stream=main, weight_stream=weight_stream,
                         weight_splits=splits)

        if graph:
            with capture(main) as g:
                enqueue()
            g.instantiate().launch(main)
        else:
            enqueue()
        main.synchronize()
        results.append(grads.buffer.to_numpy())
    for other in results[1:]:
        assert results[0].tobytes() == other.tobytes()
    named = params.to_numpy()
    # The reference backward starts from the device's activations (still in the arena):
    # at 512 x 1024 a pre-activation or two land within FP32 rounding of zero, and a ReLU
    # mask decided differently in float64 moves a whole gradient row (about 1e-3 relative).
    acts = [x.astype(np.float64)] + [a.to_numpy().astype(np.float64) for a in activations[1:]]
    want = mlp_backward(named, acts, dout)
    got = layout.unflatten(results[1])
    for name, w in want.items():
        err = rel(got[name], w)
        assert err < X3_BOUND, f"{name}: rel {err:.3g}"


# ---------------------------------------------------------------- the pre-split backward

def tf32_parts(x):
    """float64-free numpy statement of tf32_split's parts (kernels/tf32.cuh): big = x
    rounded to TF32 (half a TF32 unit added to the bits, ties away from zero), small =
    x - big in FP32 truncated to TF32, both with the 13 low bits clear. Nothing is
    special-cased: an infinity gives an infinite big and a NaN small, a NaN a NaN small
    (its NaN bits are the device's; compare NaNs as NaNs)."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    big = ((u + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).astype(np.uint32)
    with np.errstate(invalid="ignore", over="ignore"):
        rest = (x.astype(np.float32) - big.view(np.float32)).astype(np.float32).view(np.uint32)
    small = (rest & np.uint32(0xFFFFE000)).astype(np.uint32)
    return big, small


def test_tf32_parts_reference_bounds(rng):
    """The reference itself: big + small is x to within 2^-22 relative (float64; 2^-23
    at most, as with small rounded), each part a TF32 value, big within half a TF32 unit
    of x, small no larger than x - big (truncated, not rounded); an infinity is an
    infinite big and a NaN small."""
    x = (rng.standard_normal(100000) * np.exp2(rng.integers(-60, 60, 100000))).astype(np.float32)
    big, small = tf32_parts(x)
    assert not (big & 0x1FFF).any() and not (small & 0x1FFF).any()
    b, s = big.view(np.float32).astype(np.float64), small.view(np.float32).astype(np.float64)
    xd = x.astype(np.float64)
    assert (np.abs(xd - b) <= np.abs(xd) * 2.0 ** -11).all()
    assert (np.abs(xd - b - s) <= np.abs(xd) * 2.0 ** -22).all()
    assert (np.abs(s) <= np.abs(xd - b)).all()
    big, small = tf32_parts(np.array([np.inf, -np.inf, np.nan], np.float32))
    assert (big.view(np.float32)[:2] == [np.inf, -np.inf]).all() and np.isnan(small.view(np.float32)).all()


@pytest.mark.parametrize("as_is, transposed", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("rows, cols, ld", [(77, 45, 48), (512, 1024, 1024), (33, 130, 131)])
def test_split_writes_the_tf32_parts_as_is_and_transposed(device, stream, rng, rows, cols, ld, as_is, transposed):
    """tf32_split against the reference bit for bit, infinities, NaNs, subnormals and
    values next to a rounding tie included; the padding of every row untouched."""
    skip_unless_compiled(device, WGMMA_TILE)
    kernels = kernels_for("grad_input", device)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    flat = x.reshape(-1)
    picks = rng.choice(flat.size, 12, replace=False)
    flat[picks[:4]] = [np.inf, -np.inf, np.nan, 1e-40]
    flat[picks[4:8]] = np.array([0x3F801000, 0x3F800FFF, 0xBF803000, 0x7F7FEFFF], np.uint32).view(np.float32)
    xd = device_matrix(x, ld)
    arena = Arena(split_bytes_of(rows, cols) + 4096)
    a, t = kernels.split(xd, ld, rows, cols, arena=arena, stream=stream, as_is=as_is, transposed=transposed)
    assert (a is not None) == as_is and (t is not None) == transposed
    for part in (a, t):
        if part is not None:
            part.big.poison(stream=stream)
            part.small.poison(stream=stream)
    arena.reset()
    a2, t2 = kernels.split(xd, ld, rows, cols, arena=arena, stream=stream, as_is=as_is, transposed=transposed)
    assert [p.big.ptr for p in (a2, t2) if p] == [p.big.ptr for p in (a, t) if p]
    big, small = tf32_parts(x)
    for part, want_big, want_small in ((a, big, small), (t, big.T, small.T)):
        if part is None:
            continue
        r, k = want_big.shape
        assert (part.rows, part.k) == (r, k) and part.ld % 4 == 0 and k <= part.ld < k + 4
        got_big = part.big.to_numpy().view(np.uint32)
        got_small = part.small.to_numpy().view(np.uint32)
        assert (got_big[:, :k] == want_big).all()
        # A NaN small is the device's NaN bits (the reference's are numpy's): NaN for NaN.
        nan = np.isnan(want_small.view(np.float32))
        assert (np.isnan(got_small[:, :k].view(np.float32)) == nan).all()
        assert (got_small[:, :k][~nan] == want_small[~nan]).all()
        assert not (got_small[:, :k] & 0x1FFF).any()
        assert (got_big[:, k:] == 0xFFFFFFFF).all() and (got_small[:, k:] == 0xFFFFFFFF).all()


def split_bytes_of(rows, cols):
    from drvtrain.nn.mlp import split_bytes
    return split_bytes(rows, cols) + split_bytes(cols, rows)


PRESPLIT_CASES = [  # (m, n, k, forced splits or None for the rule)
    (512, 1024, 1024, None), (1024, 1024, 512, None), (300, 260, 1000, 2), (300, 260, 1000, 3), (300, 260, 1000, 8),
    (129, 129, 33, 1)]


@pytest.mark.parametrize("role", ["grad_input", "grad_weight"])
@pytest.mark.parametrize("m, n, k, splits", PRESPLIT_CASES, ids=["x".join(map(str, c[:3])) + f"-s{c[3]}"
                                                                  for c in PRESPLIT_CASES])
def test_presplit_product_matches_float64_and_the_tile_splitting_kernel(device, stream, rng, role, m, n, k, splits):
    """The pre-split dX and dW (+ db) against float64 (3xTF32: 1e-5), no output left
    unwritten, the padding untouched; and dX and dW bit for bit the wgmma kernel that
    splits each tile as it loads it (the same parts, the same MMA order, the same
    split sums). 1000 deep in 2 splits is 16 k tiles a split, the kernel's bound."""
    skip_unless_compiled(device, WGMMA_TILE)
    kernels = kernels_for(role, device)
    prod = Product(role, m, n, k, 16, rng)
    p = kernels.plan_presplit(role, m, n, k, splits=splits)
    assert p is not None and p.tile is WGMMA_TILE
    arena = Arena(split_bytes_of(m, k) + split_bytes_of(n, k) + 4 * p.workspace_floats + 8192,
                  zeroed_bytes=4 * p.counters + 256)
    prod.poison(stream)
    kernel = kernels.launch(role, prod.a, prod.lda, prod.b, prod.ldb, prod.c, prod.ldc, m, n, k, arena=arena,
                            stream=stream, presplit=True, splits=p.splits, **prod.epilogue)
    assert kernel.name == f"linear_{role}_wgmma_presplit_3xtf32"
    c, sums = prod.outputs()
    got = c[:, :n]
    assert not np.isnan(got).any(), f"{np.isnan(got).sum()} outputs unwritten ({p.splits} splits)"
    assert (c[:, n:].view(np.uint32) == 0xFFFFFFFF).all(), "the output's padding was written"
    err = rel(got, prod.want)
    assert err < X3_BOUND, f"{kernel.name} {m}x{n}x{k}, {p.splits} splits: rel {err:.3g}"
    if prod.ref_sums is not None:
        err = rel(sums, prod.ref_sums)
        assert err < X3_BOUND, f"db {m}x{n}x{k}, {p.splits} splits: rel {err:.3g}"
    prod.poison(stream)
    other = Arena(4 * 64 * 128 * 128 * 8 + 8192, zeroed_bytes=4 * 4096)
    kernels.launch(role, prod.a, prod.lda, prod.b, prod.ldb, prod.c, prod.ldc, m, n, k, arena=other, stream=stream,
                   tile=WGMMA_TILE, vector=16, splits=p.splits, **prod.epilogue)
    tiles_split, _ = prod.outputs()
    assert c.tobytes() == tiles_split.tobytes(), f"{np.sum(c != tiles_split)} outputs differ"


@pytest.mark.parametrize("role", ["grad_input", "grad_weight"])
def test_presplit_splits_summed_in_a_cluster_or_through_global_memory_give_the_same_bits(device, stream, rng, role):
    from drvtrain.nn.mlp import gemm_presplit
    skip_unless_compiled(device, WGMMA_TILE)
    m, n, k, splits = 300, 260, 1000, 3
    kernels = kernels_for(role, device)
    prod = Product(role, m, n, k, 16, rng)
    arena = Arena(split_bytes_of(m, k) + split_bytes_of(n, k) + 8192)
    outputs = []
    for cluster in (True, False):
        arena.reset()
        prod.poison(stream)
        if cluster:  # the rule's launch: 9 clusters of 3 fit at once
            assert kernels.plan_presplit(role, m, n, k, splits=splits).cluster
            kernels.launch(role, prod.a, prod.lda, prod.b, prod.ldb, prod.c, prod.ldc, m, n, k, arena=arena,
                           stream=stream, presplit=True, splits=splits, **prod.epilogue)
        else:
            if role == "grad_input":
                a, _ = kernels.split(prod.a, prod.lda, m, k, arena=arena, stream=stream)
            else:
                _, a = kernels.split(prod.a, prod.lda, k, m, arena=arena, stream=stream, as_is=False, transposed=True)
            _, b = kernels.split(prod.b, prod.ldb, k, n, arena=arena, stream=stream, as_is=False, transposed=True)
            work, workspace, counters = split_workspace(WGMMA_TILE, m, n, splits)
            gemm_presplit(kernels.presplit[role], a, b, prod.c, prod.ldc, m, n, k, stream, splits=splits,
                          workspace=workspace, counters=counters, cluster=False, **prod.epilogue)
        outputs.append(prod.outputs())
    (c1, s1), (c2, s2) = outputs
    assert not np.isnan(c1[:, :n]).any() and c1.tobytes() == c2.tobytes()
    if s1 is not None:
        assert s1.tobytes() == s2.tobytes() and rel(s1, prod.ref_sums) < X3_BOUND
    assert rel(c1[:, :n], prod.want) < X3_BOUND


def test_presplit_gate_skips_every_write(device, stream, rng):
    skip_unless_compiled(device, WGMMA_TILE)
    m, n, k = 512, 1024, 1024
    kernels = kernels_for("grad_weight", device)
    prod = Product("grad_weight", m, n, k, 16, rng)
    arena = Arena(split_bytes_of(m, k) + split_bytes_of(n, k) + 8192)
    gate = DeviceBuffer.from_numpy(np.ones(1, np.int32))
    for closed in (1, 0):
        gate.copy_from_numpy(np.full(1, closed, np.int32))
        arena.reset()
        prod.poison(stream)
        kernels.launch("grad_weight", prod.a, prod.lda, prod.b, prod.ldb, prod.c, prod.ldc, m, n, k, arena=arena,
                       stream=stream, gate=gate, presplit=True, **prod.epilogue)
        c, sums = prod.outputs()
        if closed:
            assert np.isnan(c).all() and np.isnan(sums).all()
        else:
            assert rel(c[:, :n], prod.want) < X3_BOUND and rel(sums, prod.ref_sums) < X3_BOUND


def test_presplit_refuses_more_k_tiles_a_split_than_its_bound(device, stream, rng):
    skip_unless_compiled(device, WGMMA_TILE)
    kernels = kernels_for("grad_input", device)
    with pytest.raises(ValueError, match="more than 16 a split"):
        kernels.plan_presplit("grad_input", 512, 1024, 1024, splits=1)
    assert kernels.plan_presplit("grad_input", 512, 1024, 1024, splits=2) is not None
    # One tile wide: nothing to share, the rule keeps the tile-splitting kernel.
    assert kernels.plan_presplit("grad_input", 16384, 64, 512) is None
