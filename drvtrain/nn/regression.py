"""A whole supervised regression step: forward, MSE loss, backward, clip, AdamW, metrics."""
from __future__ import annotations

import numpy as np

from ..driver import Closable, get_device
from ..graph import GraphExec, capture
from ..kernel import builtin_module, dependent_launches
from ..memory import Arena, DeviceBuffer, close_attributes, closes_on_failure
from ..stream import Stream
from .layout import FlatBuffer, ParamLayout
from .metrics import Metrics
from .mlp import MLP
from .narrow import NarrowMLP
from .optim import AdamW

__all__ = ["RegressionStep"]


# The widest net whose step ran faster with side streams and with dependent launches (H200).
NARROW_MAX_WIDTH = 256


class RegressionStep(Closable):
    """Fits an MLP to targets with mean squared error; every buffer is allocated up front.

    ``x`` and ``target`` are fixed device buffers: fill them, then ``enqueue``
    one step eagerly or ``capture`` it once and replay the graph. Activations
    and gradients of activations come from the arena, rewound every step.

    ``weight_streams`` (0, 1 or 2): the streams of the step's own on which the
    backward runs every layer's dW but the first's (and but the output layer's where
    :meth:`MLP.last_dw_folded`) beside the dX chain
    (:meth:`MLP.backward`'s ``weight_stream``; with two, the last two layers' side
    by side); 0 keeps the whole backward on the caller's stream. Either way the
    results are the same bits. The fused narrow kernels (``fused``) run their
    backward in two kernels on the caller's stream: with them 1 or 2 is refused.
    None (the default) picks by what the H200 measured (docs/perf-notes.md,
    sixteenth pass): 2 for a net no wider than ``NARROW_MAX_WIDTH`` (256 wide:
    45.4 -> 39.4 us a step), else 0 (1024 wide: 107.6 -> 117.3 us with 2).

    ``dependent_launch``: every kernel a dependent launch (programmatic dependent
    launch). None (the default) picks it for a net no wider than
    ``NARROW_MAX_WIDTH`` (256 wide, with two side streams: 39.4 -> 36.1 us a step)
    and not for wider ones (1024 wide: 107.3 -> 116.6 us with it; seventeenth pass).
    The results are the same bits either way.

    ``close()`` (or leaving a ``with`` block) gives back every buffer, stream and event now;
    an ``__init__`` that fails part way gives back what it had made before the error
    goes on.
    """

    @closes_on_failure
    def __init__(self, layout: ParamLayout, batch: int, *, lr: float = 1e-3, weight_decay: float = 0.0,
                 max_norm: float = 10.0, tf32: bool = True, seed: int = 0, arena_active: bool = True,
                 metrics_slots: int = 1024, params: np.ndarray | None = None,
                 dependent_launch: bool | None = None, fused: bool = False, presplit: bool = False,
                 weight_streams: int | None = None):
        fused_net = fused and NarrowMLP.supports(layout)
        if weight_streams is None:
            weight_streams = 0 if fused_net else self.default_weight_streams(layout)
        if not isinstance(weight_streams, (int, np.integer)) or isinstance(weight_streams, bool) \
                or weight_streams not in (0, 1, 2):
            raise ValueError(f"weight_streams must be 0, 1, 2 or None, got {weight_streams!r}")
        if fused_net and weight_streams:
            raise ValueError(f"weight_streams={weight_streams}: the fused narrow kernels run their backward on "
                             "the caller's stream; pass 0 or None with fused=True")
        self.layout, self.batch = layout, int(batch)
        self.dependent_launch = self.narrow(layout) if dependent_launch is None else bool(dependent_launch)
        self.params = FlatBuffer(layout, layout.init_numpy(seed) if params is None else params)
        self.grads = FlatBuffer(layout)
        self.mlp = MLP(layout, tf32=tf32, presplit=presplit)  # MLP's docstring; off by default
        # fused: a narrow net in one forward kernel and two backward kernels (drvtrain.nn.narrow);
        # off by default, the per-layer GEMMs measure faster (docs/perf-notes.md).
        self.net = NarrowMLP(layout, tf32=tf32) if fused_net else self.mlp
        self.weight_streams = ()
        for _ in range(int(weight_streams)):  # one at a time: a failed one leaves the others to close
            self.weight_streams += (Stream(),)
        self.x = DeviceBuffer((self.batch, layout.layers[0][1]), np.float32)
        self.target = DeviceBuffer((self.batch, layout.layers[-1][0]), np.float32)
        self.loss = DeviceBuffer(1, np.float32)
        n = self.batch * layout.layers[-1][0]
        self._loss_grid = max(2, min(2 * get_device().sm_count, -(-n // 1024)))
        self._loss_partials = DeviceBuffer(self._loss_grid, np.float64)
        self._loss_counter = DeviceBuffer.from_numpy(np.zeros(1, np.uint32))
        self._mse = builtin_module("loss.cu").kernel("mse_loss", "ptr ptr i32 ptr ptr ptr ptr", fixed_block=True)
        self.metrics = Metrics(metrics_slots)
        self.optimizer = AdamW(self.params, self.grads, lr=lr, weight_decay=weight_decay, max_norm=max_norm,
                               loss=self.loss, metrics=self.metrics)
        scratch = self.net.scratch_bytes(self.batch, 1) if fused_net else self.mlp.scratch_bytes(self.batch)
        self.arena = Arena(scratch + 4 * n + 256,  # + dout
                           zeroed_bytes=self.net.zeroed_bytes(self.batch) + 256, active=arena_active)

    def close(self) -> None:
        """Give back every stream, event and device buffer now (also what a failed ``__init__`` had
        made). ``graph``, the last capture's ``Graph``, stays open, so its topology can still be
        read; the executable graphs made from it replay freed buffers: close them first."""
        for stream in getattr(self, "weight_streams", ()):
            stream.close()
        close_attributes(self, "arena", "optimizer", "metrics", "_loss_counter", "_loss_partials", "loss",
                         "target", "x", "grads", "params")

    @staticmethod
    def narrow(layout: ParamLayout) -> bool:
        """Whether no layer of ``layout`` is wider than ``NARROW_MAX_WIDTH``: the nets
        that take side streams and dependent launches by default."""
        return max(max(layer) for layer in layout.layers) <= NARROW_MAX_WIDTH

    @staticmethod
    def default_weight_streams(layout: ParamLayout) -> int:
        """``weight_streams`` for None: 2 for a :meth:`narrow` net, else 0."""
        return 2 if RegressionStep.narrow(layout) else 0

    def enqueue(self, *, stream) -> None:
        """Queue one step on ``stream`` (eagerly, or into a capture); with
        ``dependent_launch`` every kernel is a dependent launch."""
        with dependent_launches(self.dependent_launch):
            self._enqueue(stream)

    def _enqueue(self, stream) -> None:
        self.arena.reset()
        fwd = self.net.forward(self.params, self.x, arena=self.arena, stream=stream)
        out = fwd.output
        dout = self.arena.array(out.shape, np.float32)
        self._mse.launch(self._loss_grid, self._mse.block, out, self.target, out.size, dout,
                         self._loss_partials, self._loss_counter, self.loss, stream=stream)
        first_dw = None  # the first layer's dW left for the norm to sum (MLP.backward's defer_first_dw)
        if self.net is self.mlp:
            # The weights are settled for the backward (its products follow the loss);
            # not for the forward's first product, whose kernel before it may be the last
            # step's AdamW (MLP.forward settles the later ones itself).
            first_dw = self.mlp.backward(self.params, self.grads, fwd, dout, arena=self.arena, stream=stream,
                                         weight_stream=self.weight_streams or None, defer_first_dw=True,
                                         weights_settled=True)
        else:
            self.net.backward(self.params, self.grads, fwd, dout, arena=self.arena, stream=stream)
        self.optimizer.step(stream=stream, first_dw=first_dw)

    def capture(self, *, stream) -> GraphExec:
        """The step as one executable graph; replay it with ``launch(stream)``."""
        with capture(stream) as graph:
            self.enqueue(stream=stream)
        self.graph = graph
        return graph.instantiate()

    def predict(self, x: DeviceBuffer, *, stream) -> np.ndarray:
        """The network's output for ``x`` (a host copy: tests and tools)."""
        batch = x.shape[0]
        arena = Arena(self.mlp.scratch_bytes(batch), zeroed_bytes=self.mlp.zeroed_bytes(batch) + 256)
        try:
            return self.mlp.forward(self.params, x, arena=arena, stream=stream).output.to_numpy()
        finally:
            arena.close()
