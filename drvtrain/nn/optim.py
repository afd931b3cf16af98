"""Global gradient-norm clipping and AdamW, on the device, over flat buffers."""
from __future__ import annotations

import math

import numpy as np

from ..driver import Closable, get_device
from ..kernel import builtin_module
from ..memory import DeviceBuffer, close_attributes, closes_on_failure
from .layout import FlatBuffer
from .mlp import FIRST_DW_MAX_ROW_TILES, TILE_32, FirstDwShares

__all__ = ["AdamW", "check_eps", "check_settings"]

# The AdamW kernel divides by sqrt(v) + eps sqrt(1 - beta2^t) with the approximate
# division (kernels/optim.cuh), accurate for divisors from the smallest normal float
# up to 2^126. The term is smallest at t = 1 and below eps always.
SMALLEST_NORMAL = 2.0 ** -126
MAX_EPS = 1e30


def check_eps(eps: float, beta2: float) -> None:
    """Refuse an eps above MAX_EPS (1e30), or one whose scaled form eps * sqrt(1 - beta2)
    (the kernel's, at t = 1) falls below the smallest normal float32, 2^-126: the AdamW
    kernel's approximate division needs its divisor in between (with beta2 = 0.999, an
    eps below about 3.7e-37 is too small)."""
    if not 0 < eps <= MAX_EPS:
        raise ValueError(f"eps must be in (0, {MAX_EPS:g}], got {eps!r}")
    scaled = float(np.float32(eps)) * math.sqrt(1.0 - float(beta2))
    if not scaled >= SMALLEST_NORMAL:
        raise ValueError(f"eps = {eps!r} with beta2 = {beta2!r} is too small: eps * sqrt(1 - beta2) = {scaled:.3g} "
                         f"is below 2^-126 ({SMALLEST_NORMAL:.3g}), where AdamW's division loses accuracy")


def check_settings(lr, betas, eps, weight_decay, max_norm) -> tuple:
    """AdamW's settings as its kernels take them, ``(lr, (beta1, beta2), eps,
    weight_decay, max_norm)`` as floats, or ValueError naming the first bad one: every
    setting a real number (not a bool or a string); lr finite and positive as a float32
    (the kernels take it in float32); betas a (beta1, beta2) tuple or list, each in
    [0, 1); weight_decay not negative and finite as a float32; max_norm positive (inf:
    no clipping); eps as :func:`check_eps`."""
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"betas must be (beta1, beta2), got {betas!r}")
    named = (("lr", lr), ("beta1", betas[0]), ("beta2", betas[1]), ("eps", eps), ("weight_decay", weight_decay),
             ("max_norm", max_norm))
    for name, value in named:
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise ValueError(f"{name} must be a real number, got {value!r}")
    lr, b1, b2, eps, weight_decay, max_norm = (float(value) for _, value in named)
    with np.errstate(over="ignore"):
        lr32, weight_decay32 = np.float32(lr), np.float32(weight_decay)
    if not (np.isfinite(lr32) and lr32 > 0):
        raise ValueError(f"lr must be finite and positive as a float32, got {lr!r}")
    for name, b in (("beta1", b1), ("beta2", b2)):
        if not 0 <= b < 1:
            raise ValueError(f"{name} must be in [0, 1), got {b!r}")
    if not (np.isfinite(weight_decay32) and weight_decay >= 0):
        raise ValueError(f"weight_decay must be finite as a float32 and not negative, got {weight_decay!r}")
    if not max_norm > 0:
        raise ValueError(f"max_norm must be positive, got {max_norm!r}")
    check_eps(eps, b2)
    return lr, (b1, b2), eps, weight_decay, max_norm


class AdamW(Closable):
    """PyTorch AdamW with clipping to ``max_norm``, two launches per step, no host scalars.

    ``clip_grad_norm`` launches the norm kernel (norm, clip scale and the step
    counter ``t``, all in device memory, plus the metrics slot when a ring is
    given); ``apply`` launches the AdamW kernel, which reads the scale and
    ``t`` from device memory. Graph replays therefore need nothing from the
    host.

    ``step`` does the same in a pair of kernels with no last block: the norm
    kernel only writes its blocks' partial sums (and, given ``first_dw``, the
    first layer's gradients it sums first), and every block of the AdamW
    kernel adds them (in the order the norm's last block would) and decides the
    scale itself; its block 0 publishes what ``clip_grad_norm`` would. The
    results are the same bits as ``clip_grad_norm`` then ``apply``, one
    reduction sooner.

    ``eps`` must lie in (0, 1e30] with eps * sqrt(1 - beta2) at least 2^-126
    (:func:`check_eps`): the kernel divides by sqrt(v) + eps sqrt(1 - beta2^t) with
    the approximate division, whose divisor must stay in the normal range.

    The settings (``lr``, ``betas``, ``eps``, ``weight_decay``, ``max_norm``) are
    checked by :func:`check_settings`, here and whenever one is assigned later, and
    go to the kernels as launch arguments: a change applies to launches after it. A
    graph captured before it replays the values it captured; capture again.

    With ``nan_guard=True`` the step also sets ``skip`` (an int32 device
    buffer) when the gradient norm or ``loss`` is not finite; the update then
    changes nothing and ``t`` does not advance. Other kernels of a step may
    read ``skip`` too, once the update has run.
    """

    @closes_on_failure
    def __init__(self, params: FlatBuffer, grads: FlatBuffer, *, lr: float = 1e-3, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, max_norm: float = 10.0,
                 loss: DeviceBuffer | None = None, metrics=None, nan_guard: bool = False):
        if params.layout != grads.layout:
            raise ValueError("params and grads must share one layout")
        self._lr, self._betas, self._eps, self._weight_decay, self._max_norm = check_settings(
            lr, betas, eps, weight_decay, max_norm)
        self.params, self.grads = params, grads
        self.m = FlatBuffer(params.layout)
        self.v = FlatBuffer(params.layout)
        if metrics is not None and metrics.width != 3:
            raise ValueError("the norm kernel writes {loss, grad_norm, clip_scale} slots; "
                             f"this ring has fields {metrics.fields}")
        self.loss, self.metrics = loss, metrics
        n = params.layout.size
        self.n = n
        # Fixed grids: the norm's reduction order, and so its bits, depend on them.
        # norm_grid and norm_partials are public for kernels that run the norm as
        # a phase of their own (drvtrain.rl.dqn's cooperative tail).
        self.norm_grid = max(2, min(2 * get_device().sm_count, -(-n // 1024)))
        self._adam_grid = max(2, min(4 * get_device().sm_count, -(-n // 1024)))
        self.norm_partials = DeviceBuffer(self.norm_grid, np.float64)
        state = DeviceBuffer.from_numpy(np.zeros(6, np.int32))  # norm, scale, t, counter, skip, t + 1
        self._state = state
        self.clip = state.view(np.float32, (2,), 0)
        self.t = state.view(np.int32, (1,), 8)
        self._counter = state.view(np.uint32, (1,), 12)
        self.skip = state.view(np.int32, (1,), 16) if nan_guard else None
        self._t_next = state.view(np.int32, (1,), 20)
        self._norm_queued = False
        mod = builtin_module("optim.cu")
        self._norm = mod.kernel("grad_norm_clip", "ptr i64 ptr ptr f32 ptr ptr ptr ptr i32 ptr ptr",
                                fixed_block=True)
        self._adamw = mod.kernel("adamw_step", "ptr ptr ptr ptr i64 f32 f64 f64 f32 f32 ptr ptr ptr",
                                 fixed_block=True)
        self._partials = mod.kernel("grad_norm_partials", "ptr i64 ptr ptr ptr ptr", fixed_block=True)
        self._partials_first_dw = mod.kernel("grad_norm_partials_first_dw",
                                             "ptr i64 ptr ptr ptr ptr ptr i64 i64 i32 i32 i32 i32", fixed_block=True)
        self._adamw_clip = mod.kernel("adamw_clip_step",
                                      "ptr ptr ptr ptr i64 f32 f64 f64 f32 f32 ptr i32 f32 ptr ptr ptr ptr ptr i32 "
                                      "ptr ptr", fixed_block=True)

    def _settings(self) -> tuple:
        return self._lr, self._betas, self._eps, self._weight_decay, self._max_norm

    def _change(self, index: int, value) -> None:
        settings = list(self._settings())
        settings[index] = value
        self._lr, self._betas, self._eps, self._weight_decay, self._max_norm = check_settings(*settings)

    lr = property(lambda self: self._lr, lambda self, value: self._change(0, value),
                  doc="The learning rate (a float32 for the kernels).")
    betas = property(lambda self: self._betas, lambda self, value: self._change(1, value),
                     doc="(beta1, beta2), each in [0, 1).")
    eps = property(lambda self: self._eps, lambda self, value: self._change(2, value),
                   doc="The denominator's eps (check_eps).")
    weight_decay = property(lambda self: self._weight_decay, lambda self, value: self._change(3, value),
                            doc="Decoupled weight decay, lr * weight_decay a step.")
    max_norm = property(lambda self: self._max_norm, lambda self, value: self._change(4, value),
                        doc="The gradient norm clipped to.")

    def _ring(self) -> tuple[int, int]:
        return (self.metrics.ptr, self.metrics.slots) if self.metrics is not None else (0, 1)

    def clip_grad_norm(self, *, stream, gate=None) -> None:
        """Norm, clip scale and ``t += 1`` on the device (and the metrics slot).

        ``gate`` (int32 device word, needs ``nan_guard``): while non-zero the
        kernel only sets ``skip`` to 2, and ``apply`` then changes nothing."""
        if gate is not None and self.skip is None:
            raise ValueError("a gated clip_grad_norm needs AdamW(..., nan_guard=True)")
        ring, slots = self._ring()
        self._norm.launch(self.norm_grid, self._norm.block, self.grads, self.n, self.norm_partials, self._counter,
                          self.max_norm, self.clip, self.t, self.loss if self.loss is not None else 0,
                          ring, slots, self.skip if self.skip is not None else 0,
                          gate if gate is not None else 0, stream=stream)
        self._norm_queued = True

    def apply(self, *, stream) -> None:
        """The AdamW update with the scale and ``t`` the last ``clip_grad_norm`` left."""
        if not self._norm_queued:
            raise RuntimeError("AdamW.apply needs clip_grad_norm first: it sets the step counter t "
                               "(t = 0 would divide by 1 - beta**0 = 0) and the clip scale")
        b1, b2 = self.betas
        self._adamw.launch(self._adam_grid, self._adamw.block, self.params, self.grads, self.m, self.v, self.n,
                           self.lr, b1, b2, self.eps, self.weight_decay, self.clip, self.t,
                           self.skip if self.skip is not None else 0, stream=stream)

    def step(self, *, stream, gate=None, first_dw=None, after_norm=None) -> None:
        """Clip and update: the results of ``clip_grad_norm`` then ``apply``, bit for
        bit, with the clip decided in every block of the update (class docstring).
        ``gate`` as ``clip_grad_norm``.

        ``first_dw``: the :class:`~drvtrain.nn.mlp.FirstDwShares` that
        ``MLP.backward(..., defer_first_dw=True)`` returned for these gradients
        (None: nothing to sum). The norm kernel sums the first layer's dW and db
        from them into the gradient buffer before it squares them, so the
        gradients, the norm and the update are the bits they would be had the
        backward summed them itself.

        ``after_norm``: called with no arguments once the norm kernel is queued on
        ``stream`` and before AdamW is. Work it forks from ``stream`` waits for the
        norm's partials (``norm_partials``, ``norm_grid`` of them) and not for AdamW,
        which stays the norm kernel's dependent launch: drvtrain.rl.dqn starts its
        priority update there, deciding the NaN guard from the partials itself."""
        if gate is not None and self.skip is None:
            raise ValueError("a gated step needs AdamW(..., nan_guard=True)")
        if first_dw is not None:
            if not isinstance(first_dw, FirstDwShares):
                raise TypeError(f"first_dw must be the FirstDwShares MLP.backward returned, not "
                                f"{type(first_dw).__name__}")
            if first_dw.grads is not self.grads:
                raise ValueError("first_dw holds shares of another gradient buffer than this optimizer's")
            # The kernel relies on the layout: dW0 and db0 start on a float4, and no
            # float4 of theirs reaches into another tensor (every slot is padded to 64 floats).
            layout, f = self.grads.layout, first_dw
            w0, b0 = layout.weight(0), layout.bias(0)
            if (f.dw0_at, f.db0_at, (f.cols, f.in0), f.bn) != (w0.offset, b0.offset, w0.shape, TILE_32.bn):
                raise ValueError(f"first_dw describes dW0 {(f.cols, f.in0)} at {f.dw0_at}, db0 at {f.db0_at} in "
                                 f"strips of {f.bn}; this layout's first layer is {w0.shape} at {w0.offset}, "
                                 f"its bias at {b0.offset}, and the tiles are {TILE_32.bn} wide")
            if not 1 <= f.rows <= FIRST_DW_MAX_ROW_TILES:
                raise ValueError(f"first_dw has {f.rows} row tiles; a folded backward has 1 to "
                                 f"{FIRST_DW_MAX_ROW_TILES}")
            need = f.rows * -(-f.cols // f.bn) * f.bn * (f.in0 + 1)
            if f.shares.size < need:
                raise ValueError(f"first_dw's shares hold {f.shares.size} floats; {f.rows} row tiles of "
                                 f"{f.cols} x {f.in0 + 1} need {need}")
        gate = gate if gate is not None else 0
        norm, fold = (self._partials, ()) if first_dw is None else (self._partials_first_dw, first_dw.kernel_args())
        norm.launch(self.norm_grid, norm.block, self.grads, self.n, self.norm_partials, self.t, self._t_next, gate,
                    *fold, stream=stream)
        if after_norm is not None:
            after_norm()
        self._launch_clip_update(stream=stream, gate=gate)
        self._norm_queued = True

    def _launch_clip_update(self, *, stream, gate=0, partials=None, partials_count=None) -> None:
        """Launch ``step``'s second kernel, adamw_clip_step, on ``stream``. It adds
        ``partials_count`` norm partials from ``partials`` (both None: ``norm_partials``,
        ``norm_grid`` of them); ``gate`` is an int32 device word, or 0 for none."""
        if (partials is None) != (partials_count is None):
            raise ValueError("partials and partials_count go together")
        if partials is None:
            partials, partials_count = self.norm_partials, self.norm_grid
        ring, slots = self._ring()
        b1, b2 = self.betas
        self._adamw_clip.launch(self._adam_grid, self._adamw_clip.block, self.params, self.grads, self.m, self.v,
                                self.n, self.lr, b1, b2, self.eps, self.weight_decay, partials, partials_count,
                                self.max_norm, self.loss if self.loss is not None else 0,
                                self._t_next, self.clip, self.t, ring, slots,
                                self.skip if self.skip is not None else 0, gate, stream=stream)

    def read_state(self) -> tuple[float, float, int]:
        """(norm, scale, t), read synchronously: tests and setup only."""
        s = self._state.to_numpy()
        return float(s[:2].view(np.float32)[0]), float(s[:2].view(np.float32)[1]), int(s[2])

    def close(self) -> None:
        close_attributes(self, "m", "v", "norm_partials", "_state")
