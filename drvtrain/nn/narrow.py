"""Narrow MLPs (every width <= 256, at most 4 weight layers) in three fused kernels.

A per-layer GEMM launch costs about 9 us whatever its size, so a Double-DQN step of three
forwards and a backward spends most of its time launching. Here one launch runs up to three
forwards of one layout (online on s, online on s', target on s'), one computes every
layer's output gradient, and one every weight and bias gradient: kernels/narrow.cu.

Arena use, exact (``scratch_bytes`` and ``zeroed_bytes`` say it in advance):
- a forward pass: one block holding every layer's output, layer l at float offset
  sum_{j<l} roundup(batch * width[j+1], 64), so every view starts on 256 bytes (the kernel
  computes the same offsets);
- a backward: one block for dY_0 .. dY_{L-2} laid out the same way (dY_{L-1} is ``dout``),
  and, when the batch is split over blocks (more than 64 rows), a workspace of
  ``tiles * splits * 4160`` floats and ``roundup(tiles, 64)`` zeroed counters.
The backward takes the activations and output gradients by pointer, one per layer, so it
also accepts the ``Forward`` of :class:`~drvtrain.nn.mlp.MLP`.
"""
from __future__ import annotations

import numpy as np

from ..compiler import DEFAULT_OPTIONS
from ..driver import active_captures, get_device
from ..kernel import builtin_module, load_module
from ..memory import Arena, DeviceBuffer
from .layout import FlatBuffer, ParamLayout
from .mlp import Forward, _check_input, layer_count

__all__ = ["NarrowMLP"]

MAX_LAYERS = 4
MAX_WIDTH = 256
MAX_PASSES = 3
ROWS = 16  # batch rows per block of the forward and the data-gradient kernels
TILE = 64  # weight-gradient output tiles are TILE x TILE
CHUNK = 32  # batch rows per pipeline stage of the weight-gradient kernel
MAX_SPLITS = 4
PARTIAL = TILE * TILE + TILE  # floats of one split's partial tile and bias sums

_FORWARD_SIGNATURE = " ".join(["ptr"] * 9 + ["i32"] * 15 + ["ptr", "i32"])
CLUSTER_ROWS = 32  # batch rows per cluster of the cluster forward
CLUSTER_THREADS = 256
CLUSTER_WARPS = CLUSTER_THREADS // 32
CLUSTER_MAX = 8  # blocks per cluster: the portable size
CLUSTER_TILES = 4  # n8 output tiles a block of the cluster forward aims for (2 warps per tile)
_BACKWARD_SIGNATURE = " ".join(["ptr"] * 10 + ["i32"] * 15 + ["ptr"] * 3)


# The forwards built for one shape, loaded once a process and device: every NarrowMLP (and
# DQN step) of that layout, batch and depth shares the module.
_fixed_modules: dict = {}


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _cdiv(n: int, m: int) -> int:
    return -(-n // m)


class NarrowMLP:
    """The MLP of ``layout`` (ReLU after every layer but the last) in fused kernels.

    Stateless between calls, like :class:`~drvtrain.nn.mlp.MLP`: ``forward_many`` returns
    one :class:`~drvtrain.nn.mlp.Forward` per pass, and ``backward`` takes one. The forward
    runs on TF32 tensor cores (``tf32=True``) or in exact FP32; the backward always keeps
    FP32 accuracy (3xTF32). Every result is bitwise reproducible.
    """

    def __init__(self, layout: ParamLayout, *, tf32: bool = True):
        reason = self._refusal(layout)
        if reason:
            raise ValueError(f"NarrowMLP cannot run {layout!r}: {reason}; use MLP for it")
        self.layout = layout
        self.tf32 = tf32
        self.widths = layout.widths
        self.layers = len(layout.layers)
        pad = MAX_LAYERS - self.layers
        # The layout as the kernels take it: layers, w[0..4], w_off[0..3], b_off[0..3].
        self._shape = (self.layers, *self.widths, *[0] * pad,
                       *[layout.weight(k).offset for k in range(self.layers)], *[0] * pad,
                       *[layout.bias(k).offset for k in range(self.layers)], *[0] * pad)
        self.tiles = sum(_cdiv(o, TILE) * _cdiv(i, TILE) for o, i in layout.layers)
        self._kernels = None  # loaded at the first launch, so sizes can be asked for without a GPU
        self._fixed = {}  # (batch, stop) -> the forward kernels compiled for that shape (fix_shape)

    # ------------------------------------------------------------ what it takes
    @staticmethod
    def _refusal(layout) -> str | None:
        if not isinstance(layout, ParamLayout):
            return f"expected a ParamLayout, got {type(layout).__name__}"
        if len(layout.layers) > MAX_LAYERS:
            return f"it has {len(layout.layers)} weight layers, at most {MAX_LAYERS} are supported"
        wide = [w for w in layout.widths if w > MAX_WIDTH]
        if wide:
            return f"widths {layout.widths} exceed {MAX_WIDTH} (a block holds a whole row in shared memory)"
        return None

    @classmethod
    def supports(cls, layout: ParamLayout) -> bool:
        """Whether ``layout`` fits: at most 4 weight layers, every width at most 256."""
        return cls._refusal(layout) is None

    @property
    def in_features(self) -> int:
        return self.widths[0]

    @property
    def out_features(self) -> int:
        return self.widths[-1]

    @staticmethod
    def splits(batch: int) -> int:
        """Blocks that share each weight-gradient tile's batch range: one per 64 rows, at
        most 4, whole 32-row chunks each, none left empty."""
        chunks = _cdiv(batch, CHUNK)
        per = _cdiv(chunks, min(_cdiv(batch, 2 * CHUNK), MAX_SPLITS))
        return _cdiv(chunks, per)

    def _block_floats(self, batch: int, widths) -> int:
        return sum(_round_up(batch * w, 64) for w in widths)

    def forward_bytes(self, batch: int) -> int:
        """Arena bytes one forward pass takes."""
        return 4 * self._block_floats(batch, self.widths[1:])

    def backward_bytes(self, batch: int) -> int:
        """Arena bytes one backward takes (``arena.array``; the counters are in ``zeroed_bytes``)."""
        total = 4 * self._block_floats(batch, self.widths[1:-1])
        s = self.splits(batch)
        return total + (4 * self.tiles * s * PARTIAL if s > 1 else 0)

    def scratch_bytes(self, batch: int, passes: int = MAX_PASSES) -> int:
        """Arena bytes of ``passes`` forward passes and one backward at this batch size."""
        return passes * self.forward_bytes(batch) + self.backward_bytes(batch)

    def zeroed_bytes(self, batch: int) -> int:
        """``arena.zeroed`` bytes (the weight-gradient tile counters) one backward takes."""
        return 4 * _round_up(self.tiles, 64) if self.splits(batch) > 1 else 0

    # ------------------------------------------------------------ kernels
    def _kernel(self, name: str):
        if self._kernels is None:
            module = builtin_module("narrow.cu")
            suffix = "" if self.tf32 else "_f32"
            self._kernels = {
                "forward": module.kernel("narrow_forward" + suffix, _FORWARD_SIGNATURE, fixed_block=True),
                "forward_cluster": module.kernel("narrow_forward_cluster" + suffix, _FORWARD_SIGNATURE,
                                                 fixed_block=True),
                "backward_data": module.kernel("narrow_backward_data", _BACKWARD_SIGNATURE, fixed_block=True),
                "weight_grads": module.kernel("narrow_weight_grads", _BACKWARD_SIGNATURE, fixed_block=True),
            }
        return self._kernels[name]

    # ------------------------------------------------------------ kernels for one shape
    def fixed_options(self, batch: int, layers: int | None = None) -> tuple[str, ...]:
        """The NVRTC options that compile kernels/narrow.cu's forwards for ``batch`` rows and
        the first ``layers`` layers of this layout: the kernels' shape arguments, in their
        order, as -D constants (see :meth:`fix_shape`)."""
        batch, stop = self._fixed_key(batch, layers)
        shape = ",".join(str(v) for v in (batch, *self._shape))
        return (f"-DDT_NARROW_FIXED={shape}", f"-DDT_NARROW_STOP={stop}",
                f"-DDT_NARROW_RANKS={self.cluster_ranks(stop)}")

    def _fixed_key(self, batch, layers) -> tuple[int, int]:
        """(batch, stop) as plain ints, checked: the key of a fixed build."""
        if not isinstance(batch, (int, np.integer)) or isinstance(batch, (bool, np.bool_)) or batch < 1:
            raise ValueError(f"batch must be a positive int, got {batch!r}")
        return int(batch), self._stop(layers)

    def fix_shape(self, batch: int, layers: int | None = None) -> None:
        """Compile (through the kernel cache) and load forward kernels for exactly ``batch``
        rows and the first ``layers`` layers; from then on every ``forward_many`` of that
        batch and ``layers`` launches them, and any other shape the general kernels.

        The shape becomes a compile-time constant, so the kernels drop the arithmetic on
        it (the layer selects, the split of tiles over warps, the bounds checks): the same
        bits, about a fifth faster on the small DQN net (docs/perf-notes.md). Call it
        outside a stream capture: it compiles and loads a module. A fixed kernel launched
        with another shape, depth or cluster size traps rather than compute with the wrong
        one."""
        key = self._fixed_key(batch, layers)
        if key in self._fixed:
            return
        options = self.fixed_options(*key)
        if active_captures():
            raise RuntimeError("fix_shape compiles and loads a module: call it before the capture, not during it")
        device = get_device()
        module = _fixed_modules.get((device.ordinal, options))
        if module is None:
            module = _fixed_modules[(device.ordinal, options)] = load_module(
                "narrow.cu", options=DEFAULT_OPTIONS + options, device=device)
        suffix = "" if self.tf32 else "_f32"
        self._fixed[key] = {
            "forward": module.kernel("narrow_forward" + suffix, _FORWARD_SIGNATURE, fixed_block=True),
            "forward_cluster": module.kernel("narrow_forward_cluster" + suffix, _FORWARD_SIGNATURE,
                                             fixed_block=True),
        }

    def fixed_shapes(self) -> list[tuple[int, int]]:
        """The (batch, layers) pairs that :meth:`fix_shape` has loaded kernels for."""
        return sorted(self._fixed)

    def _forward_kernel(self, name: str, batch: int, stop: int):
        fixed = self._fixed.get((batch, stop))
        return fixed[name] if fixed is not None else self._kernel(name)

    # ------------------------------------------------------------ cluster forward
    def cluster_ranks(self, layers: int | None = None) -> int:
        """Blocks per cluster of the cluster forward of the first ``layers`` layers: enough
        that each holds about CLUSTER_TILES n8 tiles of the widest layer's outputs, at most 8."""
        stop = self._stop(layers)
        tiles = max(_cdiv(out, 8) for out, _ in self.layout.layers[:stop])
        return max(1, min(CLUSTER_MAX, _cdiv(tiles, CLUSTER_TILES)))

    def cluster_shared_bytes(self, layers: int | None = None) -> int:
        """Dynamic shared memory of a cluster-forward block (kernels/narrow.cu computes the
        same offsets): the inputs of the even and of the odd layers, the k-slice partials,
        and per layer the block's weight rows and bias slice."""
        stop = self._stop(layers)
        ranks = self.cluster_ranks(stop)

        def stride(k):
            return _round_up(k, 32) + 8

        even = max(stride(self.widths[k]) for k in range(0, stop, 2))
        odd = max((stride(self.widths[k]) for k in range(1, stop, 2)), default=0)
        floats = CLUSTER_ROWS * (even + odd) + CLUSTER_WARPS * 2 * 128
        for out, inp in self.layout.layers[:stop]:
            rows = 8 * _cdiv(_cdiv(out, 8), ranks)
            floats += rows * stride(inp) + _round_up(rows, 4)
        return 4 * floats

    def clusters_at_once(self, layers: int | None = None, batch: int | None = None) -> int:
        """How many clusters of the cluster forward of the first ``layers`` layers run on
        the device at once (``Kernel.max_active_clusters``); a launch of more runs in waves.
        With ``batch``, of the kernel that a launch of that batch runs (the build of
        :meth:`fix_shape` where there is one; it may take fewer registers). Loads the
        kernels, so it needs the GPU."""
        stop = self._stop(layers)
        kernel = self._kernel("forward_cluster") if batch is None else \
            self._forward_kernel("forward_cluster", self._fixed_key(batch, stop)[0], stop)
        return kernel.max_active_clusters((self.cluster_ranks(stop), 1, 1), CLUSTER_THREADS,
                                          self.cluster_shared_bytes(stop))

    def _stop(self, layers) -> int:
        return layer_count(layers, self.layers)

    def _views(self, block: DeviceBuffer, batch: int, widths) -> list[DeviceBuffer]:
        views, offset = [], 0
        for w in widths:
            views.append(block.view(np.float32, (batch, w), 4 * offset))
            offset += _round_up(batch * w, 64)
        return views

    # ------------------------------------------------------------ forward
    def forward_many(self, params_list, x_list, *, arena: Arena, stream, gate=None, layers: int | None = None,
                     cluster: bool = False) -> list[Forward]:
        """Up to three forward passes of this layout in one launch, all of the same batch:
        pass i runs ``params_list[i]`` on ``x_list[i]``. One Forward per pass.

        ``gate``: an int32 device word; while it is non-zero the launch writes nothing.
        ``layers``: run only the first ``layers`` layers (ReLU after each but the net's
        last), for a caller that computes the rest itself; each Forward then ends at that
        layer's output (see :meth:`MLP.forward <drvtrain.nn.mlp.MLP.forward>`).
        ``cluster=True`` (compute capability 9.0+, else the launch raises ValueError):
        thread block clusters split every layer's output columns, so each block reads a
        slice of the weights once and the layers hand over in distributed shared memory
        (``cluster_ranks`` blocks per 32 rows). The same results to TF32 (or FP32)
        rounding, in other bits.
        """
        params_list, x_list = list(params_list), list(x_list)
        if not 1 <= len(params_list) <= MAX_PASSES:
            raise ValueError(f"forward_many runs 1 to {MAX_PASSES} passes, got {len(params_list)}")
        if len(x_list) != len(params_list):
            raise ValueError(f"{len(params_list)} parameter sets but {len(x_list)} inputs")
        for i, params in enumerate(params_list):
            if not isinstance(params, FlatBuffer):
                raise TypeError(f"params_list[{i}] must be a FlatBuffer, got {type(params).__name__}")
            if params.layout != self.layout:
                raise ValueError(f"params_list[{i}] was made for another layout")
        first = x_list[0]
        batch = first.shape[0] if isinstance(first, DeviceBuffer) and first.shape else 0
        for i, x in enumerate(x_list):
            _check_input(f"x_list[{i}]", x, (batch, self.in_features))
        if batch < 1:
            raise ValueError("the batch must have at least one row")
        stop = self._stop(layers)
        passes = len(params_list)
        widths = self.widths[1: stop + 1]
        blocks = [arena.array(self._block_floats(batch, widths), np.float32) for _ in range(passes)]
        fill = [0] * (MAX_PASSES - passes)
        args = (*params_list, *fill, *x_list, *fill, *blocks, *fill, batch, *self._shape,
                gate if gate is not None else 0, stop)
        if cluster:
            kernel, ranks = self._forward_kernel("forward_cluster", batch, stop), self.cluster_ranks(stop)
            kernel.launch((ranks * _cdiv(batch, CLUSTER_ROWS), passes), kernel.block, *args, stream=stream,
                          cluster=(ranks, 1, 1), shared_mem=self.cluster_shared_bytes(stop))
        else:
            kernel = self._forward_kernel("forward", batch, stop)
            kernel.launch((_cdiv(batch, ROWS), passes), kernel.block, *args, stream=stream)
        return [Forward((x, *self._views(block, batch, widths))) for x, block in zip(x_list, blocks)]

    def forward(self, params: FlatBuffer, x: DeviceBuffer, *, arena: Arena, stream, gate=None) -> Forward:
        """One forward pass: every layer's output; ``.output`` is [batch, out]."""
        return self.forward_many([params], [x], arena=arena, stream=stream, gate=gate)[0]

    # ------------------------------------------------------------ backward
    def backward(self, params: FlatBuffer, grads: FlatBuffer, forward: Forward, dout: DeviceBuffer, *,
                 arena: Arena, stream, gate=None) -> None:
        """Every gradient of the loss whose derivative by ``forward.output`` is ``dout``,
        into ``grads`` (weights and biases; the padding between views is not written).
        Two launches: the output gradient of every layer, then all weight gradients."""
        if not isinstance(forward, Forward) or len(forward.activations) != self.layers + 1:
            raise TypeError("backward takes the Forward of a forward pass of this layout")
        forward.require_every_layer()
        for name, buf in (("params", params), ("grads", grads)):
            if not isinstance(buf, FlatBuffer):
                raise TypeError(f"{name} must be a FlatBuffer, got {type(buf).__name__}")
            if buf.layout != self.layout:
                raise ValueError(f"{name} was made for another layout")
        batch = forward.batch
        for k, act in enumerate(forward.activations):
            _check_input(f"forward.activations[{k}]", act, (batch, self.widths[k]))
        _check_input("dout", dout, (batch, self.out_features))
        dys = []
        if self.layers > 1:
            block = arena.array(self._block_floats(batch, self.widths[1:-1]), np.float32)
            dys = self._views(block, batch, self.widths[1:-1])
        dys.append(dout)
        s = self.splits(batch)
        workspace = arena.array(self.tiles * s * PARTIAL, np.float32) if s > 1 else 0
        counters = arena.zeroed(_round_up(self.tiles, 64), np.uint32) if s > 1 else 0
        fill = [0] * (MAX_LAYERS - self.layers)
        args = (params, grads, *forward.activations[:-1], *fill, *dys, *fill, batch, *self._shape,
                workspace, counters, gate if gate is not None else 0)
        if self.layers > 1:
            kernel = self._kernel("backward_data")
            kernel.launch(_cdiv(batch, ROWS), kernel.block, *args, stream=stream)
        kernel = self._kernel("weight_grads")
        kernel.launch((self.tiles, s), kernel.block, *args, stream=stream)
