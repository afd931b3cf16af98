"""A ReLU MLP over a flat parameter layout: forward on TF32 tensor cores, backward in 3xTF32 (FP32 accuracy)."""
from __future__ import annotations

import numpy as np

from dataclasses import dataclass

from ..driver import get_device
from ..kernel import PORTABLE_CLUSTER_SIZE, builtin_module
from ..memory import Arena, DeviceBuffer
from ..stream import Event, fork, join
from ..tma import tensor_map_2d
from .layout import FlatBuffer, ParamLayout

__all__ = ["MLP", "Forward", "FirstDwShares", "GemmKernel", "LinearKernels", "Plan", "SplitOperand", "Tile", "TILES",
           "FFMA_TILE", "WGMMA_TILE", "HEAD_MAX_OUT", "LAST_DW_MAX_OUT", "PRESPLIT_MAX_TILES", "WeightSplits",
           "wgmma_available", "gemm", "gemm_presplit",
           "operand_map", "choose_tile", "kernel_name", "plan", "split_bytes", "split_count", "vector_width"]

_SIGNATURE = "ptr i32 ptr i32 ptr i32 i32 i32 i32 ptr ptr i32 ptr ptr ptr ptr"
# grad_input_dw0: the same, then X0, ldx0, in0, dW0, db0, work, counters (kernels/gemm.cu's DT_DW0_PARAMS).
_FIRST_DW_SIGNATURE = _SIGNATURE + " ptr i32 i32 ptr ptr ptr ptr"
# grad_input_dwl: then dW, ldw, db (kernels/gemm.cu's DT_DWL_PARAMS).
_LAST_DW_SIGNATURE = _SIGNATURE + " ptr i32 ptr"
# The forward_x0 kernels: then X0, ldx0, in0, W0, b0 (the first layer computed in them).
_FIRST_LAYER_SIGNATURE = _SIGNATURE + " ptr i32 i32 ptr ptr"
# gemm_sm90a.cu's forward: X and W as tensor maps, then C, ldc, M, N, K, bias,
# workspace, counters, gate.
_WGMMA_FORWARD_SIGNATURE = "tmap tmap ptr i32 i32 i32 i32 ptr ptr ptr ptr"
# Its forward with the output layer in the epilogue: then W2, ldw2, b2, Q, ldq, n,
# work, counters (LinearKernels.launch_head).
_WGMMA_HEAD_SIGNATURE = _WGMMA_FORWARD_SIGNATURE + " ptr i32 ptr ptr i32 i32 ptr ptr"
_HEAD_KERNEL = "linear_forward_relu_head_wgmma_tf32"
_HEAD_THREADS = 256  # its block
# Its pre-split backward: A's and B's big and small parts as tensor maps, then C, ldc,
# M, N, K, mask, ldm, col_sum, workspace, counters, gate.
_PRESPLIT_SIGNATURE = "tmap tmap tmap tmap ptr i32 i32 i32 i32 ptr i32 ptr ptr ptr ptr"
# tf32_split: X, ld, rows, cols, big, small, ld_out, big_t, small_t, ld_t, gate.
_SPLIT_SIGNATURE = "ptr i32 i32 i32 ptr ptr i32 ptr ptr i32 ptr"
_MAX_TILES = 4096  # output tiles a split-k product may have (one counter each)


@dataclass(frozen=True)
class Tile:
    """A block tile of kernels/gemm.cu: its name in kernel names, its shape, and
    how far its products split k (see :func:`split_count`)."""
    name: str
    bm: int
    bn: int
    bk: int
    max_splits: int
    min_split_tiles: int  # k tiles a split keeps at least
    waves: int  # blocks per SM the split aims for
    per_sm: int = 8  # blocks of this tile that fit on one SM at once (registers, shared memory)
    cluster_splits: int = 0  # the most splits a tile sums in a cluster (see plan); 0: never


# The mma.sync tiles' splits in clusters (measured on the H200, docs/perf-notes.md,
# fifteenth pass): the 32x32 tile's products of the small nets, split 2-4 ways, gain
# 0.5 us each; the 64x64 tile's 1024x128x512 dW lost 3 us, and 8-way clusters of the
# 32x32 tile gained nothing alone and slowed the wgmma products beside them.
TILE_64 = Tile("64x64", 64, 64, 32, 8, 4, 4, per_sm=4)
TILE_32 = Tile("32x32", 32, 32, 16, 8, 4, 2, per_sm=8, cluster_splits=4)
TILES = (TILE_64, TILE_32)  # gemm.cu's mma.sync tiles (every role), largest first
FFMA_TILE = Tile("f32", 64, 64, 64, 4, 1, 2)
# kernels/gemm_sm90a.cu: every role on wgmma (the forward in TF32, the backward in
# 3xTF32), compute capability 9.0 only, 16-byte copies only; one block per SM.
WGMMA_TILE = Tile("wgmma", 128, 128, 32, 8, 4, 1, per_sm=1, cluster_splits=PORTABLE_CLUSTER_SIZE)
# Dynamic shared memory: the forward's 5 stages of two 128 x 32 float tiles; the
# backward's 2 sets of B's two parts (128 x 32 floats each; B reaches them through
# the producer's registers) and 4 raw stages of A's 64 x 32 floats for each of its 2
# consumer warpgroups; 1 KB to align them.
WGMMA_SHARED_BYTES = 5 * 2 * 128 * 32 * 4 + 1024
# The forward with the output layer in its epilogue: W2's slice (24 rows x 128 deep),
# b's 128 columns and the block's share of the output (128 rows x 24) after the 5
# stages. Output layers of at most HEAD_MAX_OUT.
HEAD_MAX_OUT = 24
WGMMA_HEAD_SHARED_BYTES = WGMMA_SHARED_BYTES + HEAD_MAX_OUT * 128 * 4 + 128 * 4 + 128 * HEAD_MAX_OUT * 4
WGMMA_OPERAND_BOX = (128, 32)  # the forward's tensor maps: 128 rows x 32 floats, 128-byte swizzle
WGMMA_BACKWARD_SHARED_BYTES = (2 * 2) * 128 * 32 * 4 + 2 * 4 * 64 * 32 * 4 + 1024
# The pre-split backward: 3 stages of four 128 x 32 float tiles (A and B, big and small).
WGMMA_PRESPLIT_SHARED_BYTES = 3 * 4 * 128 * 32 * 4 + 1024
PRESPLIT_MAX_TILES = 16  # k tiles a split of the pre-split backward may have (gemm_sm90a.cu)
_SPLIT_MAX_ROWS = 65535 * 32  # tf32_split: a block per 32 rows on the grid's y axis
_WGMMA_CC = (9, 0)

_ROLES = ("forward", "forward_relu", "grad_input", "grad_weight", "grad_input_dw0", "grad_input_dwl", "forward_x0",
          "forward_relu_x0")
_PRECISIONS = {"forward": ("tf32", "f32"), "forward_relu": ("tf32", "f32"),
               "grad_input": ("3xtf32", "f32"), "grad_weight": ("3xtf32", "f32"), "grad_input_dw0": ("3xtf32",),
               "grad_input_dwl": ("3xtf32",),
               "forward_x0": ("tf32",), "forward_relu_x0": ("tf32",)}
# grad_input_dw0: the second layer's dX with the first layer's dW and db folded in
# (kernels/gemm.cu's tc::FirstDw), for a first layer of at most DW0_MAX_IN inputs.
DW0_MAX_IN = 8
# grad_input_dwl: the output layer's dX with that layer's dW and db folded in
# (kernels/gemm.cu's tc::LastDw), for an output layer of at most LAST_DW_MAX_OUT outputs
# (dY's one k tile of the 64x64 tile) and a batch of at most 8 row tiles (one cluster).
LAST_DW_MAX_OUT = 32
# forward_x0, forward_relu_x0: the second layer's forward with the first layer (at most
# DW0_MAX_IN inputs) computed in it (kernels/gemm.cu's tc::FirstLayer), for a split k
# range of at most X0_MAX_K (its W0 and b0 are staged in shared memory).
X0_MAX_K = 256
# The last tile of a column strip adds the strip's shares one after another: measured
# at 8 row tiles (batch 256); taller grids keep the two launches until measured.
FIRST_DW_MAX_ROW_TILES = 16


_FOLDED = ("grad_input_dw0", "forward_x0", "forward_relu_x0")  # the 32x32 tile's cluster kernels only
# The roles whose B is a layer's weights: gemm.cu has `_settled_` kernels of them (kernel_name).
_SETTLED_ROLES = ("forward", "forward_relu", "grad_input", "grad_input_dw0", "forward_x0", "forward_relu_x0")


def kernel_name(role: str, precision: str, tile: Tile = FFMA_TILE, vector: int = 16, presplit: bool = False,
                cluster: bool = False, settled: bool = False) -> str:
    """The name in kernels/gemm.cu (gemm_sm90a.cu for the wgmma tile) of ``role`` in
    ``precision`` with ``tile`` and ``vector``-byte copies; ``presplit``: the wgmma
    backward that takes its operands split (:meth:`LinearKernels.split`); ``cluster``:
    the kernel of a gemm.cu tile that sums its splits in a cluster (``_cluster_``: only
    tiles whose ``cluster_splits`` > 1; their other kernels hold no code for it), or,
    for ``grad_input_dwl`` (the 64x64 tile only, always ``cluster``), its row tiles'
    shares of dW. The wgmma kernels all may, whatever ``cluster`` says. ``settled``:
    gemm.cu's tensor-core kernel of a role whose B is a layer's weights (forward,
    grad-input, folded or not, but for ``grad_input_dwl``) that loads B's first tiles
    before its grid wait (``_settled_``; :func:`gemm` says when it may run)."""
    if role not in _ROLES:
        raise ValueError(f"role must be one of {_ROLES}, got {role!r}")
    if precision not in _PRECISIONS[role]:
        raise ValueError(f"{role} runs in {' or '.join(_PRECISIONS[role])}, not {precision!r}")
    if settled and (role not in _SETTLED_ROLES or precision == "f32" or tile not in TILES or presplit):
        raise ValueError(f"no settled kernel of {role} in {precision} on tile {tile.name}: only gemm.cu's "
                         f"tensor-core kernels of {', '.join(_SETTLED_ROLES)}")
    if presplit:
        if tile is not WGMMA_TILE or precision != "3xtf32":
            raise ValueError(f"only the wgmma tile's 3xTF32 backward takes split operands, not {role} in "
                             f"{precision} on tile {tile.name}")
        return f"linear_{role}_wgmma_presplit_{precision}"
    if role == "grad_input_dwl":
        if tile is not TILE_64 or not cluster or vector not in (4, 16):
            raise ValueError(f"grad_input_dwl runs on tile 64x64's cluster kernels only, not tile {tile.name} "
                             f"(cluster={cluster}, {vector}-byte copies)")
        return f"linear_grad_input_dwl_64x64_cp{vector}_cluster_{precision}"
    if role in _FOLDED and not (tile is TILE_32 and cluster and vector in (4, 16) and not presplit):
        raise ValueError(f"{role} runs on tile 32x32's cluster kernels only, not tile {tile.name} "
                         f"(cluster={cluster}, {vector}-byte copies)")
    if precision == "f32":
        if cluster:
            raise ValueError("the FP32 FFMA kernels have no kernels that sum their splits in a cluster")
        return f"linear_{role}_f32"
    if tile is WGMMA_TILE:
        if vector != 16:
            raise ValueError(f"the wgmma tile runs with 16-byte copies only, not {vector}-byte copies")
        return f"linear_{role}_wgmma_{precision}"
    if tile not in TILES or vector not in (4, 16):
        raise ValueError(f"no tensor-core kernel for tile {tile.name} with {vector}-byte copies")
    if cluster and tile.cluster_splits < 2:
        raise ValueError(f"tile {tile.name} has no kernels that sum their splits in a cluster")
    variant = ("cluster_" if cluster else "") + ("settled_" if settled else "")
    return f"linear_{role}_{tile.name}_cp{vector}_{variant}{precision}"


def split_count(m: int, n: int, k: int, sm_count: int, tile: Tile = FFMA_TILE, want: int | None = None) -> int:
    """How many blocks share each output tile's k range: enough for ``tile.waves``
    blocks per SM but no more than fit at once (``tile.per_sm``), at most
    ``tile.max_splits``, each with whole k tiles and at least
    ``tile.min_split_tiles`` of them, none left empty. (Measured on the H200: more
    splits buy parallelism for the small products, and cost a partial round trip
    and the last block's tail.) ``want`` asks for a split count instead; the
    result is the nearest that leaves no split empty."""
    tiles = -(-m // tile.bm) * -(-n // tile.bn)
    k_tiles = -(-k // tile.bk)
    if tiles > _MAX_TILES:
        return 1
    if want is None:
        want = min(tile.max_splits, k_tiles // tile.min_split_tiles, -(-tile.waves * sm_count // tiles),
                   tile.per_sm * sm_count // tiles)
    want = max(1, min(want, k_tiles))
    per = -(-k_tiles // want)
    return -(-k_tiles // per)


def choose_tile(m: int, n: int, k: int, sm_count: int, precision: str, wgmma: bool = False) -> Tile:
    """With ``wgmma`` (compute capability 9.0, 16-byte copies, tensor-core
    precision) the 128x128 wgmma tile when its blocks, split over k as
    :func:`split_count` would (before :func:`plan` lowers the split to fit
    clusters), fill at least two thirds of the SMs; else 64x64 tiles when theirs
    fill three quarters (the 1024-wide products: fewer loads per multiply), 32x32
    tiles for the rest, which need the parallelism; FFMA kernels have their own.
    (Measured on the H200 for the TF32 forward: at 96 wgmma blocks on 132 SMs, 73%,
    five forwards from 384x1024x512 to 2048x384x256 took 42-60% of the time of the
    64x64 tile's 192-384 blocks. The 3xTF32 backward, not measured there, keeps the
    three quarters.)"""
    if precision == "f32":
        return FFMA_TILE
    if wgmma:
        tiles = -(-m // WGMMA_TILE.bm) * -(-n // WGMMA_TILE.bn)
        num, den = (2, 3) if precision == "tf32" else (3, 4)
        if den * tiles * split_count(m, n, k, sm_count, WGMMA_TILE) >= num * sm_count:
            return WGMMA_TILE
    tiles = -(-m // TILE_64.bm) * -(-n // TILE_64.bn)
    if 4 * tiles * split_count(m, n, k, sm_count, TILE_64) >= 3 * sm_count:
        return TILE_64
    return TILE_32


@dataclass(frozen=True)
class Plan:
    """How one product launches: its tile, its split, whether a tile's splits meet
    in one cluster, and the scratch it takes."""
    tile: Tile
    splits: int
    workspace_floats: int  # 0 when unsplit or clustered (MLP's accounting also reserves a fallback's)
    counters: int  # zeroed uint32 tile counters; 0 when unsplit or clustered (likewise)
    # The splits of a tile launch as one cluster (wgmma and 32x32 tiles); plan_head: a row
    # tile's column tiles; plan_last_dw: a column's row tiles.
    cluster: bool = False

    def grid(self, m: int, n: int) -> tuple[int, int, int]:
        return -(-n // self.tile.bn), -(-m // self.tile.bm), self.splits


def plan(m: int, n: int, k: int, sm_count: int, *, precision: str, sums: bool = False,
         tile: Tile | None = None, splits: int | None = None, wgmma: bool = False,
         max_clusters=None) -> Plan:
    """The launch of an m x n x k product: the one rule behind every launch and
    behind ``MLP.scratch_bytes`` / ``MLP.zeroed_bytes``. ``sums``: the product also
    writes row sums of A (db). ``tile`` forces a tile (tests: every compiled
    variant), ``splits`` a split count (benchmarks: the plans around the rule's).
    ``wgmma``: the wgmma tile may be chosen (see :func:`choose_tile`).

    A split product launches each tile's S splits as one cluster, summed in
    distributed shared memory with no workspace, when S is at most the tile's
    ``cluster_splits`` and ``max_clusters(tile, S)`` (the device's count of
    co-resident clusters of S such blocks; 0 where a tile's kernels may not run
    in clusters) holds every tile at once. For the wgmma tile the rule lowers S
    to the largest count that does; a forced ``splits`` is kept, as is the
    mma.sync tiles' S. Else, and always without ``max_clusters``, it sums
    through a workspace as gemm.cu does (a second wave of clusters would cost
    more than the workspace: measured on the H200)."""
    if tile is None:
        tile = choose_tile(m, n, k, sm_count, precision, wgmma)
    elif (tile is FFMA_TILE) != (precision == "f32"):
        raise ValueError(f"tile {tile.name} has no {precision} kernels")
    s = split_count(m, n, k, sm_count, tile, splits)
    if s == 1:
        return Plan(tile, 1, 0, 0)
    rows, cols = -(-m // tile.bm), -(-n // tile.bn)
    if max_clusters is not None and tile.cluster_splits > 1:
        # The wgmma rule: the most splits, up to its own count, whose clusters all fit
        # (measured on the H200: 512x1024x1024 forward 10.8 us in 3 clustered splits,
        # 14.1 in 4 through the workspace, as 30 clusters of 4 fit and 32 are needed;
        # dX the same at 3 as at 4). Forced, or an mma.sync tile: that split.
        lower = tile is WGMMA_TILE and splits is None
        for c in (range(s, 1, -1) if lower else [s]):
            c = split_count(m, n, k, sm_count, tile, c)
            if 1 < c <= tile.cluster_splits and rows * cols <= max_clusters(tile, c):
                return Plan(tile, c, 0, 0, cluster=True)
    if tile is FFMA_TILE:
        floats = s * (m * n + m)  # [z][M][N] partials, then [z][M] row sums
    else:  # per tile and split a BM x BN partial in fragment order, then [row][z][BM] row sums
        floats = rows * cols * s * tile.bm * tile.bn + (rows * s * tile.bm if sums else 0)
    return Plan(tile, s, floats, rows * cols)


def _address(buf) -> int:
    return buf if isinstance(buf, int) else buf.ptr


def vector_width(a, lda: int, b, ldb: int) -> int:
    """16 when both operands allow 16-byte copies (16-byte aligned, leading
    dimensions multiples of 4 floats), else 4."""
    ok = lda % 4 == 0 and ldb % 4 == 0 and _address(a) % 16 == 0 and _address(b) % 16 == 0
    return 16 if ok else 4


def _signature(name: str) -> str:
    """The argument types of a kernel of gemm.cu or gemm_sm90a.cu, by its name."""
    if name == "tf32_split":
        return _SPLIT_SIGNATURE
    if name == _HEAD_KERNEL:
        return _WGMMA_HEAD_SIGNATURE
    if "_wgmma_" in name:
        if name.startswith("linear_forward"):
            return _WGMMA_FORWARD_SIGNATURE
        return _PRESPLIT_SIGNATURE if "_presplit_" in name else _SIGNATURE
    if "_x0_" in name:
        return _FIRST_LAYER_SIGNATURE
    if name.startswith("linear_grad_input_dwl_"):
        return _LAST_DW_SIGNATURE
    return _FIRST_DW_SIGNATURE if name.startswith("linear_grad_input_dw0_") else _SIGNATURE


def _load_kernel(name: str):
    source = "gemm_sm90a.cu" if name == "tf32_split" or "_wgmma_" in name else "gemm.cu"
    module = builtin_module(source, arch_specific=True) if source == "gemm_sm90a.cu" else builtin_module(source)
    return module.kernel(name, _signature(name), fixed_block=True)


class _Extent:
    """An operand's address and the bytes it spans, for a tensor map over memory the
    caller vouches for (a raw address or a buffer)."""
    __slots__ = ("ptr", "nbytes")
    dtype = np.float32

    def __init__(self, ptr: int, nbytes: int):
        self.ptr, self.nbytes = ptr, nbytes


_operand_maps: dict = {}
_OPERAND_MAPS_KEPT = 4096


def operand_map(a, ld: int, rows: int, cols: int, name: str = "operand") -> bytes:
    """The wgmma forward's tensor map of the row-major float32 operand at ``a`` (a
    buffer or an address): ``rows`` x ``cols``, rows ``ld`` floats apart, boxes of
    :data:`WGMMA_OPERAND_BOX` in the 128-byte swizzle, zeros outside. A map's bytes
    depend on nothing but these numbers, so each is encoded once and reused. A buffer
    smaller than the matrix, or a matrix no map can describe, is a ValueError that
    names the operand (``name``)."""
    ptr = _address(a)
    extent = ((rows - 1) * ld + cols) * 4
    nbytes = getattr(a, "nbytes", None)
    if nbytes is not None and extent > nbytes:
        raise ValueError(f"{name}: {rows} rows of {cols} floats {ld} apart need {extent} bytes; "
                         f"the buffer has {nbytes}")
    key = (ptr, rows, cols, ld)
    raw = _operand_maps.get(key)
    if raw is None:
        if len(_operand_maps) >= _OPERAND_MAPS_KEPT:
            _operand_maps.clear()
        try:
            raw = tensor_map_2d(_Extent(ptr, extent), WGMMA_OPERAND_BOX, shape=(rows, cols), ld=ld).raw
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        _operand_maps[key] = raw
    return raw


def wgmma_available(device=None) -> bool:
    """Whether this device runs kernels/gemm_sm90a.cu (compute capability 9.0)."""
    device = device or get_device()
    return tuple(getattr(device, "compute_capability", ())) == _WGMMA_CC


class GemmKernel:
    """A kernel of kernels/gemm.cu (or gemm_sm90a.cu) with the tile its grid is cut in;
    ``presplit``: the wgmma backward on split operands (:func:`gemm_presplit`);
    ``cluster``: gemm.cu's kernel that sums a tile's splits in a cluster (``grad_input_dwl``:
    its row tiles' shares of dW); ``settled``: its
    kernel for settled weights (both: :func:`kernel_name`). ``clusters`` says whether
    :func:`gemm` may launch it in clusters."""

    def __init__(self, role: str, precision: str, tile: Tile = FFMA_TILE, vector: int = 16, presplit: bool = False,
                 cluster: bool = False, settled: bool = False):
        self.role, self.precision, self.tile, self.vector = role, precision, tile, vector
        self.presplit, self.cluster, self.settled = presplit, cluster, settled
        self.name = kernel_name(role, precision, tile, vector, presplit, cluster, settled)
        self.clusters = tile is WGMMA_TILE or (cluster and precision != "f32")
        self.kernel = _load_kernel(self.name)
        if tile is not WGMMA_TILE:
            self.shared_bytes = 0
        elif presplit:
            self.shared_bytes = WGMMA_PRESPLIT_SHARED_BYTES
        else:
            self.shared_bytes = WGMMA_SHARED_BYTES if role.startswith("forward") else WGMMA_BACKWARD_SHARED_BYTES

    def __repr__(self) -> str:
        return f"<GemmKernel {self.name}>"


def _settled_key(kernel: GemmKernel) -> tuple:
    """The key of ``kernel``'s ``_settled_`` kernel in :attr:`LinearKernels.settled`."""
    return kernel.role, kernel.tile, kernel.vector, kernel.cluster


def gemm(kernel: GemmKernel, a, lda, b, ldb, c, ldc, m, n, k, stream, *, bias=0, mask=0, ldm=0, col_sum=0,
         splits=1, workspace=0, counters=0, gate=0, cluster=False, first_dw=(), first_layer=(), last_dw=()):
    """C[m, n] = sum_k A(i, k) B(k, j) with the operand layouts and epilogue of ``kernel``
    (kernels/gemm.cu names them), the k range split over ``splits`` blocks per tile.
    ``workspace`` and ``counters`` as :func:`plan` sizes them.

    A ``_settled_`` kernel (:func:`kernel_name`'s ``settled``) issues B's first tiles
    before waiting for the kernels this launch directly depends on (programmatic
    dependent launch): launch one only where none of them writes B (nor a folded
    first layer's W0 and b0), as :meth:`MLP.forward`'s ``weights_settled`` says.

    ``cluster`` (the wgmma kernels and gemm.cu's ``_cluster_`` kernels, compute capability 9.0+):
    launch the splits of a tile as one thread block cluster, which sums them in distributed shared
    memory and needs no workspace or counters (:attr:`Plan.cluster` says when). A
    ``_cluster_`` kernel launched without one sums through the workspace like the others.
    gemm.cu's clusters launch with the load-balancing placement (measured on the
    H200: 0.5 us faster than the default on the 32x32 tile's products).

    ``first_dw`` (the ``grad_input_dw0`` kernels, and only they): (X0, ldx0, in0, dW0,
    db0, work, counters), the first layer's input and gradients and the scratch of
    their sums (:meth:`LinearKernels.launch_first_dw`); C is then not written.

    ``first_layer`` (the ``forward_x0`` and ``forward_relu_x0`` kernels, and only they):
    (X0, ldx0, in0, W0, b0), the first layer whose output is A (computed, not read;
    stored at ``a`` with rows ``lda`` floats apart unless ``a`` is 0), for at most
    :data:`X0_MAX_K` k a split (:meth:`LinearKernels.launch_first_layer`).

    ``last_dw`` (the ``grad_input_dwl`` kernels, and only they): (dW, ldw, db), the
    output layer's gradients, dW = A^T mask [k, n] (rows ``ldw`` floats apart) and db
    = the column sums of A [k], summed as well as C (:meth:`LinearKernels.launch_last_dw`);
    the launch is one cluster of the grid's row tiles, unsplit, k at most
    :data:`LAST_DW_MAX_OUT`."""
    tile = kernel.tile
    if bool(last_dw) != (kernel.role == "grad_input_dwl"):
        raise ValueError(f"{kernel.name}: last_dw goes with the grad_input_dwl kernels, and they need it")
    if last_dw:
        rows = -(-m // tile.bm)
        if len(last_dw) != 3 or splits != 1 or not 1 <= k <= LAST_DW_MAX_OUT or rows > PORTABLE_CLUSTER_SIZE \
                or last_dw[1] < n:
            raise ValueError(f"{kernel.name}: last_dw is (dW, ldw >= n, db), unsplit, with 1 <= k <= "
                             f"{LAST_DW_MAX_OUT} and at most {PORTABLE_CLUSTER_SIZE} row tiles (m <= "
                             f"{PORTABLE_CLUSTER_SIZE * tile.bm})")
    if bool(first_dw) != (kernel.role == "grad_input_dw0"):
        raise ValueError(f"{kernel.name}: first_dw goes with the grad_input_dw0 kernels, and they need it")
    if first_dw and (len(first_dw) != 7 or not 1 <= first_dw[2] <= DW0_MAX_IN):
        raise ValueError(f"first_dw is (X0, ldx0, in0, dW0, db0, work, counters) with 1 <= in0 <= {DW0_MAX_IN}")
    if bool(first_layer) != kernel.role.endswith("_x0"):
        raise ValueError(f"{kernel.name}: first_layer goes with the forward_x0 kernels, and they need it")
    if first_layer:
        if len(first_layer) != 5 or not 1 <= first_layer[2] <= DW0_MAX_IN:
            raise ValueError(f"first_layer is (X0, ldx0, in0, W0, b0) with 1 <= in0 <= {DW0_MAX_IN}")
        k_tiles = -(-k // tile.bk)
        if -(-k_tiles // splits) * tile.bk > X0_MAX_K:
            raise ValueError(f"{kernel.name}: {k} k in {splits} splits is more than {X0_MAX_K} k a split")
    if kernel.presplit:
        raise ValueError(f"{kernel.name} takes split operands: launch it with gemm_presplit")
    if cluster and not kernel.clusters:
        raise ValueError(f"{kernel.name} does not reduce its splits in a cluster")
    _check_cluster_splits(kernel, splits, cluster)
    dims = (1, 1, splits) if cluster and splits > 1 else None
    grid = (-(-n // tile.bn), -(-m // tile.bm), splits)
    if last_dw:  # the row tiles of a column of C are one cluster
        dims = (1, grid[1], 1)
    if tile is WGMMA_TILE and kernel.role.startswith("forward"):  # X [m, k] and W [n, k] as tensor maps
        operands = (operand_map(a, lda, m, k, "X"), operand_map(b, ldb, n, k, "W"), c, ldc, m, n, k, bias)
    else:
        operands = (a, lda, b, ldb, c, ldc, m, n, k, bias, mask, ldm, col_sum)
    policy = "load_balancing" if dims is not None and tile is not WGMMA_TILE else None
    kernel.kernel.launch(grid, kernel.kernel.block, *operands, workspace, counters, gate if gate is not None else 0,
                         *first_dw, *first_layer, *last_dw, stream=stream, shared_mem=kernel.shared_bytes,
                         cluster=dims, cluster_policy=policy)


def _check_cluster_splits(kernel: GemmKernel, splits: int, cluster: bool) -> None:
    """A tile's splits summed in one cluster: at most the portable 8 (the wgmma kernels
    hold 8 cluster addresses and trap on more; :func:`plan` never asks for more)."""
    if cluster and splits > PORTABLE_CLUSTER_SIZE:
        raise ValueError(f"{kernel.name}: {splits} splits in one cluster; a tile's splits meet in a cluster "
                         f"of at most {PORTABLE_CLUSTER_SIZE} blocks (cluster=False sums them through the "
                         f"workspace)")


@dataclass(frozen=True)
class SplitOperand:
    """A matrix's TF32 big and small parts (kernels/gemm_sm90a.cu's tf32_split), stored
    K-major as the pre-split backward reads them: ``rows`` x ``k`` floats each, rows
    ``ld`` floats apart (a multiple of 4, for the tensor maps). big + small is the
    matrix to within 2^-23 relative (big rounded to nearest, small truncated; for
    values above about 2^-113); each part is an exact TF32 value."""
    big: DeviceBuffer
    small: DeviceBuffer
    rows: int
    k: int
    ld: int

    def maps(self, name: str) -> tuple[bytes, bytes]:
        """The tensor maps of the big and the small part (:func:`operand_map`)."""
        return (operand_map(self.big, self.ld, self.rows, self.k, f"{name} (big)"),
                operand_map(self.small, self.ld, self.rows, self.k, f"{name} (small)"))


def split_bytes(rows: int, cols: int) -> int:
    """Arena bytes of one :class:`SplitOperand` of a ``rows`` x ``cols`` matrix (K-major:
    ``cols`` deep, either way round the caller stores it)."""
    return 2 * _rounded(rows * (-(-cols // 4) * 4))


def gemm_presplit(kernel: GemmKernel, a: SplitOperand, b: SplitOperand, c, ldc, m, n, k, stream, *, mask=0, ldm=0,
                  col_sum=0, splits=1, workspace=0, counters=0, gate=0, cluster=False):
    """C[m, n] = sum_k A(i, k) B(j, k) in 3xTF32 from split operands (``a`` m x k and
    ``b`` n x k, K-major) with the epilogue of ``kernel``'s role (dX: times the mask;
    dW: col_sum gets A's row sums, db). Split and clustered as :func:`gemm`; a split
    may have at most :data:`PRESPLIT_MAX_TILES` k tiles."""
    if not kernel.presplit:
        raise ValueError(f"{kernel.name} does not take split operands")
    if (a.rows, a.k, b.rows, b.k) != (m, k, n, k):
        raise ValueError(f"split operands of {a.rows} x {a.k} and {b.rows} x {b.k} do not make an "
                         f"{m} x {n} x {k} product")
    k_tiles = -(-k // WGMMA_TILE.bk)
    if -(-k_tiles // splits) > PRESPLIT_MAX_TILES:
        raise ValueError(f"{kernel.name}: {k_tiles} k tiles in {splits} splits is more than "
                         f"{PRESPLIT_MAX_TILES} a split")
    _check_cluster_splits(kernel, splits, cluster)
    dims = (1, 1, splits) if cluster and splits > 1 else None
    grid = (-(-n // WGMMA_TILE.bn), -(-m // WGMMA_TILE.bm), splits)
    kernel.kernel.launch(grid, kernel.kernel.block, *a.maps("A"), *b.maps("B"), c, ldc, m, n, k, mask, ldm, col_sum,
                         workspace, counters, gate if gate is not None else 0, stream=stream,
                         shared_mem=kernel.shared_bytes, cluster=dims)


class LinearKernels:
    """The kernels of one arithmetic for some roles, every tile and copy width, loaded
    up front (never during a capture), and the launch of a product through them.

    ``wgmma``: the products may run on kernels/gemm_sm90a.cu's wgmma tile (pass
    True only where :func:`wgmma_available`, which is not checked here; FFMA
    precision and operands that do not allow 16-byte copies use gemm.cu's
    kernels). ``presplit`` (with ``wgmma``, 3xTF32): also load the pre-split
    backward and its split pass (:meth:`split`, :meth:`launch_presplit`); whether a
    product runs that way is the caller's choice. ``clusters``: a split product on
    gemm.cu's tensor-core tiles may sum its splits in a cluster (:func:`plan`);
    None: where the device has clusters (compute capability 9.0+). False keeps
    the workspace path (tests of it). The wgmma tile always may. ``kernels`` and
    ``clustered`` (gemm.cu's ``_cluster_`` kernels, loaded with ``clusters``) map
    (role, tile, copy width) to a :class:`GemmKernel`; ``settled`` maps (role, tile,
    copy width, cluster) to the ``_settled_`` kernel of each of them (and of the
    folded ones) whose B is a weight: loaded up front with the others, used where a
    caller asks (:meth:`kernel_for`) and in :meth:`MLP.forward`'s products after
    its first."""

    def __init__(self, roles, precision: str, sm_count: int, *, wgmma: bool = False, presplit: bool = False,
                 clusters: bool | None = None):
        self.precision = precision
        self.sm_count = sm_count
        if clusters is None:
            clusters = tuple(get_device().compute_capability) >= _WGMMA_CC
        self.clusters = bool(clusters and precision != "f32")
        if precision == "f32":
            variants = [(FFMA_TILE, 16)]
        else:
            variants = [(tile, vector) for tile in TILES for vector in (16, 4)]
        self.kernels = {(role, tile, vector): GemmKernel(role, precision, tile, vector)
                        for role in roles for tile, vector in variants}
        # gemm.cu's kernels that sum their splits in a cluster, by the same key.
        self.clustered = {(role, tile, vector): GemmKernel(role, precision, tile, vector, cluster=True)
                          for role in roles for tile, vector in variants
                          if self.clusters and tile.cluster_splits > 1}
        # The second layer's dX with the first layer's dW folded in (launch_first_dw), by copy width.
        self.first_dw = {vector: GemmKernel("grad_input_dw0", precision, TILE_32, vector, cluster=True)
                         for vector in (16, 4) if self.clusters and precision == "3xtf32" and "grad_input" in roles}
        # The output layer's dX with its dW and db folded in (launch_last_dw), by copy width.
        self.last_dw = {vector: GemmKernel("grad_input_dwl", precision, TILE_64, vector, cluster=True)
                        for vector in (16, 4) if self.clusters and precision == "3xtf32" and "grad_input" in roles}
        # The second layer's forward with the first layer computed in it (launch_first_layer),
        # by (role, copy width).
        self.first_layer = {(role, vector): GemmKernel(role + "_x0", precision, TILE_32, vector, cluster=True)
                            for role in ("forward", "forward_relu") if role in roles
                            for vector in (16, 4) if self.clusters and precision == "tf32"}
        # Each gemm.cu tensor-core kernel above whose B is a weight, for settled weights
        # (kernel_name's settled), by (role, tile, copy width, cluster).
        loaded = list(self.kernels.values()) + list(self.clustered.values()) + list(self.first_dw.values()) + \
            list(self.first_layer.values())
        self.settled = {_settled_key(k): GemmKernel(k.role, precision, k.tile, k.vector, cluster=k.cluster,
                                                    settled=True)
                        for k in loaded if k.role in _SETTLED_ROLES and k.tile in TILES}
        self.wgmma = bool(wgmma and precision != "f32")
        for role in roles if self.wgmma else ():
            self.kernels[(role, WGMMA_TILE, 16)] = GemmKernel(role, precision, WGMMA_TILE, 16)
        # The pre-split backward (wgmma, 3xTF32): the role's kernel, keyed by role.
        self.presplit = {role: GemmKernel(role, precision, WGMMA_TILE, 16, presplit=True)
                         for role in roles if self.wgmma and presplit and precision == "3xtf32"}
        self.split_kernel = _load_kernel("tf32_split") if self.presplit else None
        # The wide forward with the output layer in its epilogue (launch_head).
        self.head = _load_kernel(_HEAD_KERNEL) if self.wgmma and "forward_relu" in roles else None

    def kernel_for(self, role, p: Plan, vector: int = 16, settled: bool = False) -> GemmKernel:
        """The kernel that runs ``role``'s product planned as ``p`` with ``vector``-byte
        copies. On a tile with ``_cluster_`` kernels (loaded with ``clusters``) every
        product the cluster rule could cluster, S <= ``cluster_splits`` (unsplit ones
        and those whose clusters do not all fit included), runs the ``_cluster_``
        kernel, and only those with more splits run the plain one: products that run
        one after another then share their code (measured on the H200: the small DQN
        step's unsplit first layer on the plain kernel made the clustered second layer,
        and the step, 1 us slower, from code fetched cold). ``settled``: its ``_settled_``
        kernel where there is one (gemm.cu's tensor-core tiles, a role whose B is a
        weight), else the same kernel."""
        key = (role, p.tile, vector if self.precision != "f32" else 16)
        if key in self.clustered and p.splits <= p.tile.cluster_splits:  # a clustered plan always is
            kernel = self.clustered[key]
        else:
            kernel = self.kernels[key]
        return self.settled_twin(kernel) if settled else kernel

    def settled_twin(self, kernel: GemmKernel) -> GemmKernel:
        """``kernel``'s ``_settled_`` kernel (:attr:`settled`), or ``kernel`` itself where
        it has none."""
        return self.settled.get(_settled_key(kernel), kernel)

    def plan_first_dw(self, m, n, k, in0) -> Plan | None:
        """The plan of the ``grad_input_dw0`` product (dX [m, n] = dY [m, k] W [k, n],
        masked, folded into dW0 [n, in0] and db0), or None where it does not run: no
        such kernels here (compute capability 9.0 with clusters, 3xTF32), ``in0`` over
        :data:`DW0_MAX_IN`, more than :data:`FIRST_DW_MAX_ROW_TILES` row tiles, or a plan
        off the 32x32 tile's cluster kernels (more than ``cluster_splits`` splits, or
        another tile)."""
        if not self.first_dw or not 1 <= in0 <= DW0_MAX_IN or -(-m // TILE_32.bm) > FIRST_DW_MAX_ROW_TILES:
            return None
        p = self.plan("grad_input_dw0", m, n, k)
        return p if p.tile is TILE_32 and p.splits <= TILE_32.cluster_splits else None

    @staticmethod
    def first_dw_scratch(m, n, in0) -> tuple[int, int]:
        """(work floats, zeroed counters) of a ``grad_input_dw0`` launch: each tile's
        share of dW0 and db0, and one counter per column strip."""
        rows, cols = -(-m // TILE_32.bm), -(-n // TILE_32.bn)
        return rows * cols * TILE_32.bn * (in0 + 1), cols

    def launch_first_dw(self, dy, ldy, w, ldw, m, n, k, *, mask, ldm, x0, ldx0, in0, dw0, db0, arena: Arena,
                        stream, gate=None, finish: bool = True, settled: bool = False) -> DeviceBuffer:
        """The second layer's grad-input product (dY [m, k] times W [k, n], masked by
        ``mask``) with the first layer's dW0 [n, in0] = dX^T X0 and db0 [n] (the
        column sums of dX) summed from its tiles, instead of dX itself: one launch for
        two products, dX never stored (:meth:`plan_first_dw` must plan; checked).
        Returns the tiles' shares (an arena slice, laid out as :class:`FirstDwShares`
        says). With ``finish`` False the last tile of each column strip does not sum
        them: dW0 and db0 are left unwritten for the next kernel to sum
        (``AdamW.step``'s ``first_dw``). ``settled``: W is settled, as
        :meth:`MLP.forward`'s ``weights_settled`` says (its ``_settled_`` kernel runs)."""
        p = self.plan_first_dw(m, n, k, in0)
        if p is None:
            raise ValueError(f"no grad_input_dw0 launch of {m}x{n}x{k} with {in0} inputs here")
        kernel = self.first_dw[vector_width(dy, ldy, w, ldw)]
        if settled:
            kernel = self.settled_twin(kernel)
        workspace = arena.array(p.workspace_floats, np.float32) if p.workspace_floats else 0
        counters = arena.zeroed(p.counters, np.uint32) if p.counters else 0
        work_floats, strips = self.first_dw_scratch(m, n, in0)
        work = arena.array(work_floats, np.float32)
        strip_counters = arena.zeroed(strips, np.uint32) if finish else 0
        gemm(kernel, dy, ldy, w, ldw, 0, n, m, n, k, stream, splits=p.splits, workspace=workspace,
             counters=counters, gate=gate, cluster=p.cluster, mask=mask, ldm=ldm,
             first_dw=(x0, ldx0, in0, dw0, db0, work, strip_counters))
        return work

    def plan_last_dw(self, m, n, k) -> Plan | None:
        """The plan of the ``grad_input_dwl`` product (the output layer's dX [m, n] = dY
        [m, k] W [k, n], masked by its input X, with dW = dY^T X [k, n] and db summed in
        the same launch), or None where it does not run: no such kernels here (compute
        capability 9.0 with clusters, 3xTF32), ``k`` over :data:`LAST_DW_MAX_OUT`, more
        row tiles than one cluster holds (:data:`PORTABLE_CLUSTER_SIZE`, a batch of at
        most 512), a cluster of them that does not fit, or a product whose own plan
        (:meth:`plan`) is not the 64x64 tile unsplit: the fold keeps the dX's launch."""
        rows = -(-m // TILE_64.bm)
        if not self.last_dw or not 1 <= k <= LAST_DW_MAX_OUT or rows > PORTABLE_CLUSTER_SIZE:
            return None
        p = self.plan("grad_input", m, n, k)  # the wgmma tile where 16-byte copies would choose it: no fold
        if p.tile is not TILE_64 or p.splits != 1:
            return None
        if any(kern.kernel.max_active_clusters((1, rows, 1), kern.kernel.block, kern.shared_bytes) < 1
               for kern in self.last_dw.values()):
            return None
        return Plan(TILE_64, 1, 0, 0, cluster=True)

    def launch_last_dw(self, dy, ldy, w, ldw, dx, ldx, m, n, k, *, mask, ldm, dw, lddw, db, stream,
                       gate=None) -> GemmKernel:
        """The output layer's grad-input product, dX [m, n] = (dY [m, k] times W [k, n])
        masked by ``mask`` (the layer's input X), with the layer's dW [k, n] = dY^T X
        (rows ``lddw`` floats apart) and db [k] (the column sums of dY) summed in the same
        launch: one launch for two products, each block's share of dW in 3xTF32 on the
        tensor cores (:meth:`plan_last_dw` must plan; checked). Needs no scratch. It has no
        ``_settled_`` twin: W is read after the grid wait even where the weights are settled.
        Returns the kernel that ran."""
        if self.plan_last_dw(m, n, k) is None:
            raise ValueError(f"no grad_input_dwl launch of {m}x{n}x{k} here")
        kernel = self.last_dw[vector_width(dy, ldy, w, ldw)]
        gemm(kernel, dy, ldy, w, ldw, dx, ldx, m, n, k, stream, gate=gate, mask=mask, ldm=ldm,
             last_dw=(dw, lddw, db))
        return kernel

    def plan_first_layer(self, role, m, n, k, in0, *, sms=None, splits=None) -> Plan | None:
        """The plan of ``role``'s (``forward`` or ``forward_relu``) m x n x k product of
        a second layer with the first layer computed in it (:meth:`launch_first_layer`),
        or None where that does not run: no such kernels here (compute capability 9.0
        with clusters, TF32), ``in0`` over :data:`DW0_MAX_IN`, or a plan off the 32x32
        tile's cluster kernels (another tile, more than ``cluster_splits`` splits) or
        with a split k range over :data:`X0_MAX_K`. ``sms`` as :meth:`plan` takes it;
        ``splits`` forces a split count (tests), within the same conditions."""
        if (role, 16) not in self.first_layer or not 1 <= in0 <= DW0_MAX_IN:
            return None
        p = self.plan(role + "_x0", m, n, k, tile=TILE_32 if splits is not None else None, splits=splits, sms=sms)
        k_tiles = -(-k // TILE_32.bk)
        if p.tile is not TILE_32 or p.splits > TILE_32.cluster_splits \
                or -(-k_tiles // p.splits) * TILE_32.bk > X0_MAX_K:
            return None
        return p

    def launch_first_layer(self, role, w, ldw, c, ldc, m, n, k, *, bias, x0, ldx0, in0, w0, b0, h0, arena: Arena,
                           stream, gate=None, sms=None, splits=None, settled: bool = False) -> GemmKernel:
        """``role``'s product of the second layer, C [m, n] = H0 W^T + bias (ReLU with
        ``forward_relu``), where H0 [m, k] = relu(X0 W0^T + b0) is computed in the
        same launch, in FP32, from X0 [m, in0] (rows ``ldx0`` floats apart), W0 [k, in0]
        and b0 [k]: the first layer's own launch is saved. Every element of H0 is also
        stored at ``h0`` ([m, k], rows ``k`` floats apart) unless ``h0`` is 0.
        :meth:`plan_first_layer` must plan (checked). ``settled``: W, W0 and b0 are
        settled, as :meth:`MLP.forward`'s ``weights_settled`` says (the ``_settled_`` kernel runs)."""
        p = self.plan_first_layer(role, m, n, k, in0, sms=sms, splits=splits)
        if p is None:
            raise ValueError(f"no {role}_x0 launch of {m}x{n}x{k} with {in0} inputs here")
        vector = vector_width(h0, k, w, ldw) if h0 else vector_width(0, 4, w, ldw)  # no H0: only W decides
        kernel = self.first_layer[(role, vector)]
        if settled:
            kernel = self.settled_twin(kernel)
        workspace = arena.array(p.workspace_floats, np.float32) if p.workspace_floats else 0
        counters = arena.zeroed(p.counters, np.uint32) if p.counters else 0
        gemm(kernel, h0, k, w, ldw, c, ldc, m, n, k, stream, bias=bias, splits=p.splits, workspace=workspace,
             counters=counters, gate=gate, cluster=p.cluster, first_layer=(x0, ldx0, in0, w0, b0))
        return kernel

    def plan_head(self, m, n, k, n_out, *, sms=None, cluster=None) -> Plan | None:
        """The plan of a hidden layer's m x n x k ``forward_relu`` product with the
        output layer after it (``n_out`` outputs) computed in its epilogue
        (:meth:`launch_head`), or None where that does not run: no such kernel here
        (compute capability 9.0, TF32), ``n_out`` over :data:`HEAD_MAX_OUT`, or a plan
        for ``sms`` SMs (:meth:`plan`) off the wgmma tile or split. Where a row tile's
        column tiles (2 to the portable 8) fit as a cluster, every row tile's at once
        on the whole device, the plan is clustered (their shares meet in distributed
        shared memory, no scratch); otherwise its workspace holds each block's share of
        the output (``HEAD_MAX_OUT / 2`` floats a thread), its counters one a row tile.
        ``cluster`` forces either (tests): False the workspace, True a cluster (None
        where the row tiles' clusters do not fit)."""
        if self.head is None or not 1 <= n_out <= HEAD_MAX_OUT:
            return None
        p = self.plan("forward_relu", m, n, k, sms=sms)
        if p.tile is not WGMMA_TILE or p.splits != 1:
            return None
        cols, rows, _ = p.grid(m, n)
        fits = cluster is not False and 1 < cols <= PORTABLE_CLUSTER_SIZE and \
            rows <= self.head.max_active_clusters((cols, 1, 1), self.head.block, WGMMA_HEAD_SHARED_BYTES)
        if fits:
            return Plan(WGMMA_TILE, 1, 0, 0, cluster=True)
        if cluster:
            return None
        return Plan(WGMMA_TILE, 1, cols * rows * _HEAD_THREADS * (HEAD_MAX_OUT // 2), rows)

    def launch_head(self, x, ldx, w, ldw, h, ldh, m, n, k, *, bias, w2, ldw2, b2, q, ldq, n_out, arena: Arena,
                    stream, gate=None, sms=None, cluster=None) -> None:
        """A hidden layer's product H [m, n] = relu(X W^T + b) (X [m, k], W [n, k]), and
        in the same launch the output layer after it, Q [m, n_out] = H W2^T + b2 (W2
        [n_out, n]): each block adds its columns' share of Q, and the last block of
        each row tile adds the shares in column order, or, where the plan is clustered,
        each block of the row tile's cluster some of its rows, in the same order
        (kernels/gemm_sm90a.cu, the output layer in the epilogue). H is stored as :meth:`launch` stores it
        (``h`` None: not at all, for a caller that reads only Q; X's copies then carry the
        evict-first L2 hint, for no later kernel reads X either); Q
        is right to TF32 accuracy like the output layer's own product, with the same
        bits run to run; where that product sums the same 128-deep shares (8 clustered
        splits of a 1024-wide H) the bits came out the same as its on the H200, which
        the tests check, though no contract promises it. :meth:`plan_head` must
        plan (with ``cluster`` as it takes it), and X and W must allow the tensor maps
        (16-byte aligned rows); checked."""
        p = self.plan_head(m, n, k, n_out, sms=sms, cluster=cluster)
        if p is None:
            raise ValueError(f"no forward with the output layer in its epilogue for {m}x{n}x{k} and {n_out} "
                             f"outputs here")
        if vector_width(x, ldx, w, ldw) != 16:
            raise ValueError("launch_head needs X and W with 16-byte aligned rows")
        work = arena.array(p.workspace_floats, np.float32) if p.workspace_floats else 0
        counters = arena.zeroed(p.counters, np.uint32) if p.counters else 0
        grid = p.grid(m, n)
        self.head.launch(grid, self.head.block, operand_map(x, ldx, m, k, "X"), operand_map(w, ldw, n, k, "W"),
                         h if h is not None else 0, ldh, m, n, k, bias, 0, 0, gate if gate is not None else 0,
                         w2, ldw2, b2, q, ldq, n_out, work, counters, stream=stream, shared_mem=WGMMA_HEAD_SHARED_BYTES,
                         cluster=(grid[0], 1, 1) if p.cluster else None)

    def share(self, sms) -> int:
        """The SMs a product plans for: ``sms`` (an int from 1 to the device's count),
        or the whole device for None; anything else is a ValueError."""
        if sms is None:
            return self.sm_count
        if isinstance(sms, bool) or not isinstance(sms, (int, np.integer)) or not 1 <= sms <= self.sm_count:
            raise ValueError(f"sms must be an int in [1, {self.sm_count}] (the device's SMs) or None, got {sms!r}")
        return int(sms)

    def plan(self, role, m, n, k, *, tile=None, splits=None, vector=16, sms=None) -> Plan:
        """The launch of ``role``'s m x n x k product (grad-weight also sums db) with
        ``vector``-byte copies (the wgmma tile needs 16), split and tiled for ``sms``
        SMs (:meth:`share`). Whether a tile's splits fit as clusters is still judged
        on the whole device."""
        sm_count = self.share(sms)

        def limit(tile, s):
            # gemm.cu's tiles: the fewer of the two copy widths' counts, so that the plan
            # (and the scratch it reserves) is the same whichever kernel the operands pick.
            if tile is WGMMA_TILE:
                kernels = [self.kernels.get((role, tile, 16))]
            elif role == "grad_input_dw0":
                kernels = [self.first_dw.get(v) for v in (16, 4)] if tile is TILE_32 else []
            elif role in ("forward_x0", "forward_relu_x0"):
                kernels = [self.first_layer.get((role[:-3], v)) for v in (16, 4)] if tile is TILE_32 else []
            else:
                kernels = [self.clustered.get((role, tile, v)) for v in (16, 4)]
            return min((k.kernel.max_active_clusters((1, 1, s), k.kernel.block, k.shared_bytes)
                        for k in kernels if k is not None), default=0)

        return plan(m, n, k, sm_count, precision=self.precision, sums=role == "grad_weight", tile=tile,
                    splits=splits, wgmma=self.wgmma and vector == 16,
                    max_clusters=limit if self.wgmma or self.clusters else None)

    def split(self, x, ld: int, rows: int, cols: int, *, arena: Arena, stream, gate=None, as_is: bool = True,
              transposed: bool = False):
        """Split the float32 ``rows`` x ``cols`` matrix at ``x`` (rows ``ld`` floats
        apart, any alignment) into TF32 parts in ``arena``, in one launch on ``stream``
        (kernels/gemm_sm90a.cu's tf32_split): ``as_is`` gives the :class:`SplitOperand`
        that is ``rows`` x ``cols`` (an operand reduced along its rows, such as dY for
        dX), ``transposed`` the one that is ``cols`` x ``rows`` (W for dX; dY and X for
        dW). Returns the pair (as_is or None, transposed or None)."""
        if self.split_kernel is None:
            raise ValueError("no pre-split kernels here (wgmma 3xTF32 backward only)")
        if not (as_is or transposed):
            raise ValueError("split needs as_is, transposed or both")
        if rows < 1 or cols < 1 or ld < cols:
            raise ValueError(f"a {rows} x {cols} matrix with rows {ld} floats apart cannot be split")
        if rows > _SPLIT_MAX_ROWS:
            raise ValueError(f"a matrix of {rows} rows cannot be split in one launch (at most {_SPLIT_MAX_ROWS})")
        pad = lambda v: -(-v // 4) * 4
        a = t = None
        if as_is:
            a = SplitOperand(arena.array((rows, pad(cols)), np.float32), arena.array((rows, pad(cols)), np.float32),
                             rows, cols, pad(cols))
        if transposed:
            t = SplitOperand(arena.array((cols, pad(rows)), np.float32), arena.array((cols, pad(rows)), np.float32),
                             cols, rows, pad(rows))
        kernel = self.split_kernel
        kernel.launch((-(-cols // 32), -(-rows // 32)), kernel.block, x, ld, rows, cols,
                      a.big if a else 0, a.small if a else 0, a.ld if a else 0,
                      t.big if t else 0, t.small if t else 0, t.ld if t else 0,
                      gate if gate is not None else 0, stream=stream, shared_mem=0)
        return a, t

    def plan_presplit(self, role, m, n, k, *, splits=None) -> Plan | None:
        """The launch of ``role``'s m x n x k product on split operands, or None where it
        does not run that way: no pre-split kernels here, a product the rule gives to
        another tile, one whose tiles of A or of B are each read by one block only (a
        grid one tile wide or high: splitting them once saves nothing), or more than
        :data:`PRESPLIT_MAX_TILES` k tiles a split even at 8 splits (or a dimension past
        what one split launch takes, 65535 x 32 rows). The wgmma rule's
        split, raised where a split would exceed that bound; ``splits`` forces one
        (tests, benchmarks; the other conditions still hold)."""
        kernel = self.presplit.get(role)
        if kernel is None or m <= WGMMA_TILE.bm or n <= WGMMA_TILE.bn or max(m, n, k) > _SPLIT_MAX_ROWS:
            return None
        p = self.plan(role, m, n, k, splits=splits) if splits is None else None
        if p is not None and p.tile is not WGMMA_TILE:
            return None
        k_tiles = -(-k // WGMMA_TILE.bk)
        want = splits if splits is not None else p.splits
        if -(-k_tiles // want) > PRESPLIT_MAX_TILES:
            if splits is not None:
                raise ValueError(f"{k_tiles} k tiles in {splits} splits is more than {PRESPLIT_MAX_TILES} a split")
            want = -(-k_tiles // PRESPLIT_MAX_TILES)
            if want > WGMMA_TILE.max_splits:
                return None
        limit = lambda tile, s: kernel.kernel.max_active_clusters((1, 1, s), kernel.kernel.block, kernel.shared_bytes)
        q = plan(m, n, k, self.sm_count, precision=self.precision, sums=role == "grad_weight", tile=WGMMA_TILE,
                 splits=want, wgmma=True, max_clusters=limit)
        return q if -(-k_tiles // q.splits) <= PRESPLIT_MAX_TILES else None

    def launch_presplit(self, role, a: SplitOperand, b: SplitOperand, c, ldc, m, n, k, *, arena: Arena, stream,
                        gate=None, splits=None, **epilogue) -> GemmKernel:
        """Plan (:meth:`plan_presplit`, which must not be None) and launch ``role``'s
        product on split operands: dX's ``a`` is dY as it lies and ``b`` W transposed;
        dW's ``a`` is dY transposed and ``b`` X transposed."""
        p = self.plan_presplit(role, m, n, k, splits=splits)
        if p is None:
            raise ValueError(f"no pre-split launch of {role} {m}x{n}x{k} here")
        kernel = self.presplit[role]
        workspace = arena.array(p.workspace_floats, np.float32) if p.workspace_floats else 0
        counters = arena.zeroed(p.counters, np.uint32) if p.counters else 0
        gemm_presplit(kernel, a, b, c, ldc, m, n, k, stream, splits=p.splits, workspace=workspace,
                      counters=counters, gate=gate, cluster=p.cluster, **epilogue)
        return kernel

    def launch(self, role, a, lda, b, ldb, c, ldc, m, n, k, *, arena: Arena, stream, gate=None, tile=None,
               vector=None, splits=None, presplit=False, sms=None, settled=False, **epilogue) -> GemmKernel:
        """Plan the product, take its workspace and counters from ``arena``, launch it.

        ``tile``, ``vector`` and ``splits`` force a variant (tests, benchmarks); a
        forced 16-byte copy the operands do not allow is refused. ``sms``: plan for
        that many SMs (:meth:`share`; a caller running products side by side). ``presplit``: split
        both operands into ``arena`` first and run the pre-split kernel (which must
        plan, :meth:`plan_presplit`; it plans for the whole device). ``settled``: B is settled,
        as :meth:`MLP.forward`'s ``weights_settled`` says: the ``_settled_`` kernel runs where
        there is one (:meth:`kernel_for`; none on the wgmma and FFMA tiles). Returns the kernel that ran."""
        self.share(sms)  # checked before anything is queued
        if presplit:
            if tile is not None or vector is not None or sms is not None:
                raise ValueError("presplit runs the wgmma tile's pre-split kernel on the whole device: "
                                 "no tile, vector or sms to force")
            if self.plan_presplit(role, m, n, k, splits=splits) is None:  # before anything is queued
                raise ValueError(f"no pre-split launch of {role} {m}x{n}x{k} here")
            if role == "grad_input":  # A = dY [m, k] as it lies, B = W [k, n] transposed
                sa, _ = self.split(a, lda, m, k, arena=arena, stream=stream, gate=gate)
            else:  # A = dY [k, m] transposed, B = X [k, n] transposed
                _, sa = self.split(a, lda, k, m, arena=arena, stream=stream, gate=gate, as_is=False, transposed=True)
            _, sb = self.split(b, ldb, k, n, arena=arena, stream=stream, gate=gate, as_is=False, transposed=True)
            return self.launch_presplit(role, sa, sb, c, ldc, m, n, k, arena=arena, stream=stream, gate=gate,
                                        splits=splits, **epilogue)
        allowed = vector_width(a, lda, b, ldb) if self.precision != "f32" else 16
        if vector is None:
            vector = allowed
        elif vector > allowed:
            raise ValueError("16-byte copies need 16-byte aligned operands with leading dimensions "
                             "that are multiples of 4")
        if tile is WGMMA_TILE and (role, tile, vector) not in self.kernels:
            raise ValueError(f"no wgmma kernel for {role} with {vector}-byte copies here (wgmma: "
                             f"{self.wgmma}; it needs compute capability 9.0, tensor cores and 16-byte copies)")
        p = self.plan(role, m, n, k, tile=tile, splits=splits, vector=vector, sms=sms)
        kernel = self.kernel_for(role, p, vector, settled=settled)
        workspace = arena.array(p.workspace_floats, np.float32) if p.workspace_floats else 0
        counters = arena.zeroed(p.counters, np.uint32) if p.counters else 0
        gemm(kernel, a, lda, b, ldb, c, ldc, m, n, k, stream, splits=p.splits, workspace=workspace,
             counters=counters, gate=gate, cluster=p.cluster, **epilogue)
        return kernel


@dataclass(frozen=True)
class WeightSplits:
    """What :meth:`MLP.split_weights` queued: the split transposed weight of each layer
    whose dX runs pre-split at ``batch`` rows, the stream it ran on and the event
    recorded after it (None when no layer needs one)."""
    batch: int
    weights: dict
    stream: object
    event: object


@dataclass(frozen=True)
class FirstDwShares:
    """The first layer's dW and db that ``MLP.backward(..., defer_first_dw=True)`` left
    unsummed: row tile ``y``'s share of column ``c`` (column strip ``x = c // bn``)
    is ``shares[((x * rows + y) * bn + c - x * bn) * (in0 + 1) + i]``, dW0[c, i] for
    ``i < in0`` and db0[c] for ``i == in0``. ``AdamW.step(first_dw=...)`` sums them
    into ``grads`` (at float offsets ``dw0_at`` and ``db0_at``), in the order the
    backward would have, so every gradient keeps its bits. ``shares`` is an arena
    slice: it is valid until the arena is reset."""
    grads: FlatBuffer
    shares: DeviceBuffer
    dw0_at: int
    db0_at: int
    in0: int
    cols: int
    rows: int
    bn: int

    def kernel_args(self) -> tuple:
        """The trailing arguments of kernels/optim.cu's grad_norm_partials_first_dw."""
        return self.shares, self.dw0_at, self.db0_at, self.in0, self.cols, self.rows, self.bn


@dataclass(frozen=True)
class Forward:
    """What one forward leaves for its backward: the input and the output of
    every layer, as arena slices valid until the arena is reset (None for a
    hidden output that ``forward(..., store_hidden=False)`` did not store)."""
    activations: tuple

    @property
    def output(self) -> DeviceBuffer:
        return self.activations[-1]

    @property
    def batch(self) -> int:
        return self.activations[0].shape[0]

    def require_every_layer(self) -> None:
        """A backward reads every layer's input: refuse a Forward that kept a None."""
        if any(a is None for a in self.activations):
            raise ValueError("this Forward kept no hidden output (MLP.forward(..., store_hidden=False)); the "
                             "backward reads every layer's input")


def layer_count(layers, n: int) -> int:
    """A forward's ``layers`` argument checked against a net of ``n`` layers: None is
    all of them; otherwise an int in [1, n], or a ValueError that says so."""
    if layers is None:
        return n
    if isinstance(layers, bool) or not isinstance(layers, (int, np.integer)) or not 1 <= layers <= n:
        raise ValueError(f"layers must be an int in [1, {n}], got {layers!r}")
    return int(layers)


def _check_input(name: str, buf, shape) -> None:
    if not isinstance(buf, DeviceBuffer):
        raise TypeError(f"{name} must be a DeviceBuffer, got {type(buf).__name__}")
    if buf.dtype != np.float32:
        raise TypeError(f"{name} must hold float32, got {buf.dtype}")
    if buf.shape != tuple(shape):
        raise ValueError(f"{name} has shape {buf.shape}, expected {tuple(shape)}")


def _rounded(floats: int) -> int:
    return -(-floats * 4 // 256) * 256


class MLP:
    """Linear, bias and ReLU after every layer but the last; the epilogues are fused.

    ``tf32``: the forward on TF32 tensor cores (else FP32 FFMA). ``backward``:
    ``"3xtf32"`` (tensor cores at FP32 accuracy) or ``"f32"`` (FFMA).
    ``wgmma``: on compute capability 9.0 the wide tensor-core products run on
    kernels/gemm_sm90a.cu (wgmma); ``False`` forces gemm.cu's mma.sync kernels.
    ``presplit``: the wide 3xTF32 backward products split each operand once into
    TF32 parts (a pass per operand) and run on those (:meth:`presplit_layers`)
    instead of on the wgmma kernels that split every tile as they load it. Off by
    default: on the H200 the 512x1024x1024 products take 32% (dX) and 18% (dW) less
    time, but the passes, as kernels of their own, cost more than that saves
    (docs/perf-notes.md).
    ``fold_first_layer``: a first layer of at most 8 inputs is computed inside the
    second layer's forward product where that plans (:meth:`first_layer_folded`).
    ``fold_head``: an output layer of at most :data:`HEAD_MAX_OUT` outputs is computed in
    the epilogue of the last hidden layer's product where that plans (:meth:`head_folded`).
    ``fold_last_dw``: the output layer's dW and db are summed in its dX product where
    that plans (:meth:`last_dw_folded`).

    Stateless between calls: ``forward`` returns a :class:`Forward` holding its
    activations (arena slices) and ``backward`` takes it, so two forwards of
    two parameter sets, on two streams, never touch each other's state. Where
    :meth:`first_layer_folded`, the first layer is computed (in FP32) inside the
    second layer's product, which also stores its output (``fold_first_layer=False``
    keeps the two launches). Every
    split-k product reduced through a workspace takes its tile counters from
    ``arena.zeroed``.
    ``backward`` writes every gradient of the layout with no float atomics:
    dW = dY^T X and db (column sums of dY) in one kernel, dX = dY W masked by
    the ReLU of the layer's input in another; where :meth:`first_dw_folded`, the
    first layer's dW and db come out of the second layer's dX kernel (or, with
    ``defer_first_dw``, out of ``AdamW.step``'s norm kernel); where
    :meth:`last_dw_folded`, the output layer's dW and db come out of its dX kernel.
    """

    def __init__(self, layout: ParamLayout, *, tf32: bool = True, backward: str = "3xtf32", wgmma: bool = True,
                 presplit: bool = False, fold_first_layer: bool = True, fold_head: bool = True,
                 fold_last_dw: bool = True):
        if backward not in ("3xtf32", "f32"):
            raise ValueError(f"backward must be '3xtf32' or 'f32', got {backward!r}")
        self.layout = layout
        self.fold_first_layer = bool(fold_first_layer)
        self.fold_head = bool(fold_head)
        self.fold_last_dw = bool(fold_last_dw)
        self.tf32 = tf32
        self.backward_precision = backward
        device = get_device()
        self._sm_count = device.sm_count
        self.forward_kernels = LinearKernels(("forward", "forward_relu"), "tf32" if tf32 else "f32", self._sm_count,
                                             wgmma=wgmma and tf32 and wgmma_available(device))
        self.backward_kernels = LinearKernels(("grad_input", "grad_weight"), backward, self._sm_count,
                                              wgmma=wgmma and backward == "3xtf32" and wgmma_available(device),
                                              presplit=presplit)

    @property
    def in_features(self) -> int:
        return self.layout.layers[0][1]

    @property
    def out_features(self) -> int:
        return self.layout.layers[-1][0]

    def first_dw_folded(self, batch: int) -> bool:
        """Whether the backward folds the first layer's dW and db into the second
        layer's dX product (one ``grad_input_dw0`` launch for both; dX of the second
        layer is never stored): a net of three or more layers whose first layer takes
        at most :data:`DW0_MAX_IN` inputs, where that product plans on the 32x32
        tile's cluster kernels (:meth:`LinearKernels.plan_first_dw`: at most
        ``FIRST_DW_MAX_ROW_TILES`` row tiles) and neither of the first two layers runs a
        product pre-split. Measured on the H200: docs/perf-notes.md, seventeenth pass."""
        layers = self.layout.layers
        if len(layers) < 3 or any(k in (0, 1) for k in self.presplit_layers(batch)):
            return False
        (o1, i1), in0 = layers[1], layers[0][1]
        return self.backward_kernels.plan_first_dw(batch, i1, o1, in0) is not None

    def last_dw_folded(self, batch: int) -> bool:
        """Whether the backward sums the output layer's dW and db in that layer's dX
        product (one ``grad_input_dwl`` launch for the three, :meth:`LinearKernels.launch_last_dw`;
        dX is still stored): a net of two or more layers whose output layer has at most
        :data:`LAST_DW_MAX_OUT` outputs, a batch of at most 512 (8 row tiles, one
        cluster), where that dX plans unsplit on the 64x64 tile
        (:meth:`LinearKernels.plan_last_dw`) and neither of its products runs pre-split.
        dW and db are then summed in another order than the unfolded product's (each
        block's 64 rows in 3xTF32 on the tensor cores, then the row tiles in order), to
        FP32 accuracy either way. The backward does not fold where its caller gives
        ``dx_last``. Never with ``MLP(fold_last_dw=False)``. Measured on the H200: docs/perf-notes.md,
        thirty-sixth and thirty-seventh passes."""
        layers = self.layout.layers
        last = len(layers) - 1
        if not self.fold_last_dw or last < 1 or last in self.presplit_layers(batch):
            return False
        out, inp = layers[last]
        return self.backward_kernels.plan_last_dw(batch, inp, out) is not None

    def first_layer_folded(self, batch: int, *, sms=None, layers=None) -> bool:
        """Whether :meth:`forward` (with these ``sms`` and ``layers``) computes the first
        layer inside the second layer's product (one ``forward_x0`` or
        ``forward_relu_x0`` launch for both; H0 is still stored): a forward of two or
        more layers whose first layer takes at most :data:`DW0_MAX_IN` inputs, where
        the second layer plans on the 32x32 tile's cluster kernels in TF32
        (:meth:`LinearKernels.plan_first_layer`). H0 is then computed in FP32 FMAs
        instead of TF32 products. Never with ``MLP(fold_first_layer=False)``.
        Measured on the H200 (docs/perf-notes.md, twenty-fourth pass): a forward of
        the small nets 1.3 us faster alone, the supervised small step 1.0 us faster;
        the DQN step's three forwards side by side 2.6 to 2.9 us slower (it does not fold)."""
        n = len(self.layout.layers)
        if not self.fold_first_layer or layer_count(layers, n) < 2:
            return False
        (o1, i1), in0 = self.layout.layers[1], self.layout.layers[0][1]
        role = "forward" if n == 2 else "forward_relu"
        return self.forward_kernels.plan_first_layer(role, batch, o1, i1, in0, sms=sms) is not None

    def head_folded(self, batch: int, *, sms=None, layers=None) -> bool:
        """Whether :meth:`forward` (with these ``sms`` and ``layers``) computes the
        output layer in the epilogue of the last hidden layer's product (one
        ``forward_relu_head`` launch for both, :meth:`LinearKernels.launch_head`; the
        hidden layer's output is still stored, unless ``store_hidden=False``): a whole
        forward of three or more layers (so that the last hidden layer's input is an
        activation of the arena, never a caller's misaligned input) whose output layer has
        at most :data:`HEAD_MAX_OUT` outputs, where the last hidden layer takes a multiple
        of 4 inputs (the tensor maps' rows), plans unsplit on the wgmma tile
        (:meth:`LinearKernels.plan_head`) and is not folded with the first layer. Never
        with ``MLP(fold_head=False)``.
        Measured on the H200 (docs/perf-notes.md, thirty-fifth pass): the large DQN
        step's three forwards, each planned for a third of the SMs, 0.8 us faster."""
        n = len(self.layout.layers)
        if not self.fold_head or layer_count(layers, n) < n or n < 3:
            return False
        (o, i), n_out = self.layout.layers[-2], self.layout.layers[-1][0]
        if i % 4 or (n == 3 and self.first_layer_folded(batch, sms=sms, layers=layers)):
            return False
        return self.forward_kernels.plan_head(batch, o, i, n_out, sms=sms) is not None

    def _roles(self, batch: int, *, sms=None):
        """(role, m, n, k) of every product of a forward (given ``sms``) and backward,
        in launch order."""
        last = len(self.layout.layers) - 1
        out = [("forward" if k == last else "forward_relu", batch, o, i) for k, (o, i) in enumerate(self.layout.layers)]
        if self.first_layer_folded(batch, sms=sms):  # one launch for the first two layers
            out = [(out[1][0] + "_x0",) + out[1][1:]] + out[2:]
        if self.head_folded(batch, sms=sms):  # one launch for the last two
            out = out[:-2] + [("forward_relu_head",) + out[-2][1:]]
        folded = self.first_dw_folded(batch)
        folded_last = self.last_dw_folded(batch)
        for k in range(last, -1, -1):
            o, i = self.layout.layers[k]
            if k == last and folded_last:  # one launch for the output layer's dX, dW and db
                out.append(("grad_input_dwl", batch, i, o))
                continue
            if k > 0 or not folded:
                out.append(("grad_weight", o, i, batch))
            if k > 0:
                out.append(("grad_input_dw0" if k == 1 and folded else "grad_input", batch, i, o))
        return out

    def _products(self, batch: int, *, sms=None):
        """(m, n, k) of every product of a forward (given ``sms``) and backward, in launch order."""
        return [(m, n, k) for _, m, n, k in self._roles(batch, sms=sms)]

    def _plans(self, batch: int, *, sms=None):
        """(role, m, n, k, plan, pre-split) of every product, the forward's planned for
        ``sms`` SMs (:meth:`forward`)."""
        for role, m, n, k in self._roles(batch, sms=sms):
            grad = role.startswith("grad")
            kernels = self.backward_kernels if grad else self.forward_kernels
            share = None if grad else sms
            if role.endswith("_x0"):  # first_layer_folded planned it
                yield role, m, n, k, kernels.plan_first_layer(role[:-3], m, n, k, self.in_features, sms=share), False
                continue
            if role == "forward_relu_head":  # head_folded planned it
                yield role, m, n, k, kernels.plan_head(m, n, k, self.out_features, sms=share), False
                continue
            if role == "grad_input_dwl":  # last_dw_folded planned it; room for the dW's own launch,
                q = [kernels.plan("grad_weight", k, n, m, vector=v) for v in (16, 4)]  # which dx_last keeps
                yield role, m, n, k, Plan(TILE_64, 1, max(p.workspace_floats for p in q),
                                          max(p.counters for p in q), cluster=True), False
                continue
            p = kernels.plan(role, m, n, k, sms=share)
            if p.tile is WGMMA_TILE:  # a misaligned input falls back to gemm.cu: room for either
                q = kernels.plan(role, m, n, k, vector=4, sms=share)
                p = Plan(p.tile, max(p.splits, q.splits), max(p.workspace_floats, q.workspace_floats),
                         max(p.counters, q.counters), p.cluster)
            s = kernels.plan_presplit(role, m, n, k) if role.startswith("grad") else None
            if s is not None:  # it runs pre-split (its split operands): room for its workspace too
                p = Plan(s.tile, s.splits, max(p.workspace_floats, s.workspace_floats), max(p.counters, s.counters),
                         s.cluster)
            yield role, m, n, k, p, s is not None

    def presplit_layers(self, batch: int) -> dict:
        """{layer: (dX pre-split, dW pre-split)} for the layers with a product that runs
        on split operands at this batch size (the wide 3xTF32 products on compute
        capability 9.0; see :meth:`LinearKernels.plan_presplit`). A first layer's dX is
        never launched."""
        kernels, out = self.backward_kernels, {}
        if not kernels.presplit:
            return out
        for k, (o, i) in enumerate(self.layout.layers):
            dx = k > 0 and kernels.plan_presplit("grad_input", batch, i, o) is not None
            dw = kernels.plan_presplit("grad_weight", o, i, batch) is not None
            if dx or dw:
                out[k] = (dx, dw)
        return out

    def zeroed_bytes(self, batch: int, *, sms=None) -> int:
        """``arena.zeroed`` bytes (tile counters) one forward (given ``sms``) and backward take."""
        return sum((_rounded(p.counters) if p.counters else 0)
                   + (_rounded(LinearKernels.first_dw_scratch(m, n, self.in_features)[1])
                      if role == "grad_input_dw0" else 0)
                   for role, m, n, k, p, _ in self._plans(batch, sms=sms))

    def scratch_bytes(self, batch: int, *, sms=None) -> int:
        """Arena bytes one forward (given ``sms``, as :meth:`forward` takes it) and
        backward take at this batch size, plus 1024: activations, data gradients,
        split-k workspaces and the split operands of the pre-split products
        (:meth:`split_weights` included)."""
        total = 0
        for role, m, n, k, p, presplit in self._plans(batch, sms=sms):
            if role == "grad_input_dw0":  # no dX: the tiles' shares of dW0 and db0
                total += _rounded(LinearKernels.first_dw_scratch(m, n, self.in_features)[0])
            elif role.endswith("_x0"):  # the first layer's output, then the second's
                total += _rounded(m * k) + _rounded(m * n)
            elif role == "forward_relu_head":  # the hidden layer's output, then the output layer's
                total += _rounded(m * n) + _rounded(m * self.out_features)
            elif role != "grad_weight":  # activations and their gradients; dW goes to grads
                total += _rounded(m * n)
            if p.workspace_floats:
                total += _rounded(p.workspace_floats)
            if presplit:  # dX: dY [m, k] as it lies and W^T [n, k]; dW: dY^T [m, k] and X^T [n, k]
                total += split_bytes(m, k) + split_bytes(n, k)
        return total + 1024

    def split_weights(self, params: FlatBuffer, batch: int, *, arena: Arena, stream, gate=None,
                      dx_last: bool = False) -> "WeightSplits":
        """Queue on ``stream`` the split of every weight that a pre-split dX reads (W
        transposed, :meth:`presplit_layers`), for a backward at ``batch`` rows, and
        record a new event after them. A caller with a stream to spare queues this
        early (it needs only the parameters) and passes the result to
        :meth:`backward`, which then waits for the event (joining ``stream``) instead
        of splitting the weights itself. ``dx_last``: the backward will be given
        ``dx_last``, so the last layer's dX is not launched and its weight not split."""
        if params.layout != self.layout:
            raise ValueError("params were made for another layout")
        weights = {}
        for k in self.dx_presplit_layers(batch, dx_last=dx_last):
            out, inp = self.layout.layers[k]
            _, weights[k] = self.backward_kernels.split(params.weight(k), inp, out, inp, arena=arena, stream=stream,
                                                        gate=gate, as_is=False, transposed=True)
        return WeightSplits(batch, weights, stream, Event().record(stream) if weights else None)

    def dx_presplit_layers(self, batch: int, *, dx_last: bool = False) -> list:
        """The layers whose dX runs pre-split in a backward at ``batch`` rows (given
        ``dx_last`` or not): those whose weight :meth:`split_weights` splits."""
        last = len(self.layout.layers) - 1
        return [k for k, (dx, _) in self.presplit_layers(batch).items() if dx and not (dx_last and k == last)]

    def forward(self, params: FlatBuffer, x: DeviceBuffer, *, arena: Arena, stream, gate=None,
                layers: int | None = None, sms: int | None = None, weights_settled: bool = False,
                store_hidden: bool = True) -> Forward:
        """Every layer's output into arena slices; ``.output`` is [batch, out].

        ``gate``: an int32 device word; while it is non-zero every launch returns
        at once (a training loop's step that is not due). ``layers``: run only
        the first ``layers`` layers (a caller that computes the rest itself);
        ``.output`` is then that layer's output. :meth:`backward` takes a
        Forward of every layer, so such a caller appends the outputs it
        computed (``Forward(f.activations + (out,))``).

        ``sms``: the SMs the products are planned for (default: the whole device).
        A caller that runs several forwards side by side on their own streams (the
        DQN step's three) gives each its share: each product then takes fewer,
        longer blocks, and the passes run at once instead of queueing for SMs. The
        arena's size then comes from :meth:`scratch_bytes` and :meth:`zeroed_bytes`
        with the same ``sms``.

        ``weights_settled``: the caller vouches that no kernel the first product
        directly depends on writes ``params`` (an optimizer step queued just before
        does, under dependent launches). The first product then runs gemm.cu's
        ``_settled_`` kernel, which loads its first weight tiles before waiting for the
        kernel before it (measured on the H200 in docs/perf-notes.md, twenty-fifth
        pass). The products after the first always run them: each directly depends
        only on the product before, which writes no weight. That holds because every
        drvtrain kernel lets its dependents start only after its own wait; a kernel of
        the caller's that lets them start earlier makes the kernels before it direct
        ones too. The output is the same bits either way. Default False.

        ``store_hidden=False``: for a caller that reads only ``.output`` (the DQN step's
        target forward and online forward of s'). Where the output layer runs in the last
        hidden layer's epilogue (:meth:`head_folded`), that hidden layer's output, which no
        later launch reads, is not written, and its place in ``.activations`` is None;
        :meth:`backward` refuses such a Forward. Elsewhere every hidden output is the
        next launch's input and is stored as always. ``.output`` is the same bits either
        way."""
        if not isinstance(store_hidden, bool):
            raise TypeError(f"store_hidden must be a bool, got {store_hidden!r}")
        if params.layout != self.layout:
            raise ValueError("params were made for another layout")
        batch = x.shape[0] if x.shape else 0
        _check_input("x", x, (batch, self.in_features))
        if batch < 1:
            raise ValueError("the batch must have at least one row")
        self.forward_kernels.share(sms)
        n = len(self.layout.layers)
        layers = layer_count(layers, n)
        acts = [x]
        last = n - 1
        folded = self.first_layer_folded(batch, sms=sms, layers=layers)
        head = self.head_folded(batch, sms=sms, layers=layers)
        settled = weights_settled  # then True: each later product follows one that writes no weight
        for k, (out, inp) in enumerate(self.layout.layers[:layers]):
            if head and k == last:  # computed with the layer before
                break
            y = arena.array((batch, out), np.float32) if store_hidden or not (head and k == last - 1) else None
            role = "forward" if k == last else "forward_relu"
            if head and k == last - 1:  # this layer's product, then the output layer, in one launch
                q = arena.array((batch, self.out_features), np.float32)
                self.forward_kernels.launch_head(acts[-1], inp, params.weight(k), inp, y, out, batch, out, inp,
                                                 bias=params.bias(k), w2=params.weight(last), ldw2=out,
                                                 b2=params.bias(last), q=q, ldq=self.out_features,
                                                 n_out=self.out_features, arena=arena, stream=stream, gate=gate,
                                                 sms=sms)
                acts += [y, q]
                continue
            if folded and k == 1:  # the first layer's output is computed, and stored, here
                in0 = self.in_features
                self.forward_kernels.launch_first_layer(role, params.weight(1), inp, y, out, batch, out, inp,
                                                        bias=params.bias(1), x0=x, ldx0=in0, in0=in0,
                                                        w0=params.weight(0), b0=params.bias(0), h0=acts[1],
                                                        arena=arena, stream=stream, gate=gate, sms=sms,
                                                        settled=settled)
                settled = True
            elif not (folded and k == 0):  # layer 0 is launched with layer 1
                self.forward_kernels.launch(role, acts[-1], inp, params.weight(k), inp, y, out, batch, out, inp,
                                            arena=arena, stream=stream, gate=gate, bias=params.bias(k), sms=sms,
                                            settled=settled)
                settled = True
            acts.append(y)
        return Forward(tuple(acts))

    def backward(self, params: FlatBuffer, grads: FlatBuffer, forward: Forward, dout: DeviceBuffer, *,
                 arena: Arena, stream, gate=None, weight_stream=None, dx_last: DeviceBuffer | None = None,
                 weight_splits: WeightSplits | None = None, last_dw_done: bool = False,
                 defer_first_dw: bool = False, weights_settled: bool = False) -> FirstDwShares | None:
        """Gradients of the loss whose derivative by ``forward.output`` is ``dout``, into ``grads``.

        ``defer_first_dw``: where the first layer's dW is folded into the second
        layer's dX (:meth:`first_dw_folded`), leave its last step, the sum of the
        tiles' shares into dW0 and db0, to the optimizer: the backward returns a
        :class:`FirstDwShares` for ``AdamW.step(first_dw=...)``, whose norm kernel
        sums them on its way (measured on the H200: docs/perf-notes.md, twenty-first
        pass). Until that step runs, the first layer's gradients in ``grads`` are
        not written, and only ``AdamW.step`` sums them: ``clip_grad_norm`` and
        ``apply`` take no shares. Elsewhere, and by default, every gradient is
        written here and the backward returns None.

        ``dx_last``: the last layer's data gradient (by its input, the ReLU mask
        applied), already computed by the caller into this [batch, in] buffer;
        that product is then not launched and the dX chain starts from it (and the
        output layer's dW runs as a product of its own even where
        :meth:`last_dw_folded`). ``last_dw_done`` (with ``dx_last``): the caller's
        launch wrote the output layer's dW and db into ``grads`` as well, so that
        product is not launched either.

        Where :meth:`last_dw_folded` (and no ``dx_last``), the output layer's dW and db
        are summed in its dX launch on ``stream``, and no weight stream takes them.

        ``weight_stream``: when given, each layer's dW/db product but the first
        layer's runs there, forked from ``stream`` once its dY is ready, so it
        overlaps the rest of the dX chain. The first layer's runs on ``stream``
        right after the last dX (or inside it, :meth:`first_dw_folded`): nothing is
        left there for it to overlap, and queued behind the other dW products it
        would wait for them. A tuple of
        streams takes those products in turn from the last layer's on (with two,
        the last layer's dW and the one below it run side by side). Everything
        is joined back into ``stream`` before return.

        ``weights_settled``: as :meth:`forward` takes it, for the dX products (they
        read ``params``; the dW products read activations): no kernel that any dX
        product directly depends on (the loss, a dW product, the dX before it) writes
        ``params``.

        Pre-split products (:meth:`presplit_layers`): a layer's dY is split on
        ``stream`` in one pass for both of its products. With ``weight_stream`` the
        weights' splits (for dX) run first on it (on the first of a tuple), and the
        input's split of each layer whose dW runs on a weight stream runs first on
        that stream, beside the chain; every other split runs on ``stream`` ahead
        of its product. ``weight_splits``: the weights already split
        (:meth:`split_weights`, same batch and ``dx_last``); ``stream`` waits for its
        event before the first pre-split dX (or before return, if none runs)."""
        if not isinstance(forward, Forward) or len(forward.activations) != len(self.layout.layers) + 1:
            raise TypeError("backward takes the Forward that this MLP's forward returned")
        forward.require_every_layer()
        if grads.layout != self.layout or params.layout != self.layout:
            raise ValueError("params and grads must be made for this MLP's layout")
        batch = forward.batch
        _check_input("dout", dout, (batch, self.out_features))
        if dx_last is not None:
            if len(self.layout.layers) < 2:
                raise ValueError("dx_last needs a hidden layer: a one-layer net has no data gradient to chain")
            _check_input("dx_last", dx_last, (batch, self.layout.layers[-1][1]))
        elif last_dw_done:
            raise ValueError("last_dw_done goes with dx_last: the launch that wrote the output layer's dW "
                             "computes its dX too")
        kernels = self.backward_kernels
        last = len(self.layout.layers) - 1
        sides = tuple(weight_stream) if isinstance(weight_stream, (tuple, list)) else \
            () if weight_stream is None else (weight_stream,)
        if weight_stream is not None and (not sides or any(s is None or s is stream for s in sides)
                                          or len(set(map(id, sides))) < len(sides)):
            raise ValueError("weight_stream must be a stream other than stream, or a non-empty tuple of "
                             "distinct ones")
        side_of = lambda k: sides[(last - k) % len(sides)] if sides and k > 0 else None
        folded = self.first_dw_folded(batch)  # layer 0's dW rides on layer 1's dX
        folded_last = dx_last is None and self.last_dw_folded(batch)  # the last layer's dW on its dX
        shares = None  # what defer_first_dw leaves to the optimizer
        presplit = self.presplit_layers(batch)
        if dx_last is not None and last in presplit:  # the last layer's dX is not launched (nor its dW, if done)
            presplit[last] = (False, presplit[last][1] and not last_dw_done)
        presplit = {k: (dx, dw) for k, (dx, dw) in presplit.items() if dx or dw}
        if weight_splits is not None:  # checked before anything is queued
            if weight_splits.batch != batch:
                raise ValueError(f"weight_splits were made for a batch of {weight_splits.batch}, not {batch}")
            missing = [k for k, (dx, _) in presplit.items() if dx and k not in weight_splits.weights]
            if missing:
                raise ValueError(f"weight_splits holds no split of the weight of layer(s) {missing}")
        inputs = {}  # layer: its input X, split transposed (dW)
        split_input = lambda k, on: kernels.split(forward.activations[k], self.layout.layers[k][1], batch,
                                                  self.layout.layers[k][1], arena=arena, stream=on, gate=gate,
                                                  as_is=False, transposed=True)[1]
        forked = set()  # the side streams forked from stream
        if presplit:
            aside = sides[0] if sides else stream
            if sides:
                fork(stream, *sides)
                forked.update(sides)
            if weight_splits is None and any(dx for dx, _ in presplit.values()):
                weight_splits = self.split_weights(params, batch, arena=arena, stream=aside, gate=gate,
                                                   dx_last=dx_last is not None)
            for k, (_, dw) in presplit.items():
                if dw and side_of(k) is not None:  # their dW runs on a side stream: split there
                    inputs[k] = split_input(k, side_of(k))
        waited = weight_splits is None or weight_splits.event is None or weight_splits.stream is stream
        dy = dout
        for k in range(last, -1, -1):
            out, inp = self.layout.layers[k]
            x = forward.activations[k]
            if k == 0 and folded:  # launched with layer 1's dX
                break
            split_dx, split_dw = presplit.get(k, (False, False))
            split_dx = split_dx and k > 0
            dy_split = dyt_split = None
            if split_dx or split_dw:  # dY [batch, out]: as it lies for dX, transposed for dW
                dy_split, dyt_split = kernels.split(dy, out, batch, out, arena=arena, stream=stream, gate=gate,
                                                    as_is=split_dx, transposed=split_dw)
            if k == last and folded_last:  # dX, dW and db in one launch on stream
                dx = arena.array((batch, inp), np.float32)
                kernels.launch_last_dw(dy, out, params.weight(k), inp, dx, inp, batch, inp, out, mask=x, ldm=inp,
                                       dw=grads.weight(k), lddw=inp, db=grads.bias(k), stream=stream, gate=gate)
                dy = dx
                continue
            if k == last and last_dw_done:  # dX, dW and db from the caller's launch
                dy = dx_last
                continue
            side = side_of(k)
            if side is not None:
                fork(stream, side)
                forked.add(side)
            if split_dw:
                if k not in inputs:  # its dW runs on stream (the first layer's, or no weight_stream): split there
                    inputs[k] = split_input(k, stream)
                kernels.launch_presplit("grad_weight", dyt_split, inputs[k], grads.weight(k), inp, out, inp, batch,
                                        arena=arena, stream=stream if side is None else side, gate=gate,
                                        col_sum=grads.bias(k))
            else:
                kernels.launch("grad_weight", dy, out, x, inp, grads.weight(k), inp, out, inp, batch, arena=arena,
                               stream=stream if side is None else side, gate=gate, col_sum=grads.bias(k))
            if k == last and dx_last is not None:  # a hidden layer exists: checked above
                dy = dx_last
            elif k == 1 and folded:  # dX of layer 1 is not stored: it becomes dW0 and db0 at once
                in0 = self.layout.layers[0][1]
                work = kernels.launch_first_dw(dy, out, params.weight(k), inp, batch, inp, out, mask=x, ldm=inp,
                                               x0=forward.activations[0], ldx0=in0, in0=in0, dw0=grads.weight(0),
                                               db0=grads.bias(0), arena=arena, stream=stream, gate=gate,
                                               finish=not defer_first_dw, settled=weights_settled)
                if defer_first_dw:
                    shares = FirstDwShares(grads, work, self.layout.weight(0).offset, self.layout.bias(0).offset,
                                           in0, inp, -(-batch // TILE_32.bm), TILE_32.bn)
                dy = None
            elif k > 0:
                dx = arena.array((batch, inp), np.float32)
                if split_dx:
                    w_split = weight_splits.weights[k]  # split above, or checked above
                    if not waited:
                        stream.wait(weight_splits.event)
                        waited = True
                    kernels.launch_presplit("grad_input", dy_split, w_split, dx, inp, batch, inp, out, arena=arena,
                                            stream=stream, gate=gate, mask=x, ldm=inp)
                else:
                    kernels.launch("grad_input", dy, out, params.weight(k), inp, dx, inp, batch, inp, out,
                                   arena=arena, stream=stream, gate=gate, mask=x, ldm=inp, settled=weights_settled)
                dy = dx
        if not waited:  # weight splits queued elsewhere and not needed after all: still joined
            stream.wait(weight_splits.event)
        if forked:  # else nothing was forked
            join(stream, *(s for s in sides if s in forked))
        return shares
