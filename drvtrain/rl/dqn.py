"""The dueling Double-DQN step with prioritized replay, resident on the device as one graph.

The maths is in ``docs/step-spec.md``. One step, in launch order:
PER sample and the gathered batch, with the IS weights by a second launch on
a third stream (with side streams); the online forward on ``s`` (main
stream) while the online forward on ``s'`` and the target forward on ``s'``
run on two streams forked from it, all joined before the loss; the fused loss
(dueling combine, Double-DQN argmax and target, IS-weighted Huber, the output
gradient, new priorities, metrics sums); the backward; the gradient-norm
clip, which is also the NaN guard; AdamW, and beside it, on a second stream
forked after the norm, the priority update (which decides the NaN guard from the
norm's partials itself); the spectral power iteration (two launches); and one last
pass that applies the spectral scales, updates the target network, counts the
step and writes the metrics slot. No host branch anywhere: a captured step
replays unchanged.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..audit import CallCounts, Criterion, classify, count_driver_calls
from ..driver import Closable, active_captures, get_device
from ..flags import ErrorFlags
from ..graph import Graph, GraphExec, capture, capture_frontier
from ..kernel import builtin_module, dependent_launches
from ..memory import Arena, DeviceBuffer, MappedBuffer, close_attributes, closes_on_failure
from ..nn.layout import FlatBuffer, ParamLayout
from ..nn.metrics import Metrics
from ..nn.mlp import MLP, Forward
from ..nn.narrow import NarrowMLP
from ..nn.optim import AdamW, check_settings
from ..stream import Stream, fork, join
from .replay import ReplayBuffer
from .sumtree import UPDATE_THREADS

__all__ = ["DQNConfig", "DQNStep", "TrainingError", "METRIC_FIELDS", "audit_step", "check_learner_state",
           "lint_step_graph"]

METRIC_FIELDS = ("loss", "grad_norm", "clip_scale", "mean_q", "mean_abs_td", "sigma_max", "beta")

# The table of spectral matrices, byte for byte as kernels/dqn.cuh lays it out.
_SPECTRAL_DTYPE = np.dtype([("w_offset", "<i8"), ("rows", "<i4"), ("cols", "<i4"), ("u_offset", "<i4"),
                            ("v_offset", "<i4"), ("first_block_cols", "<i4"), ("first_block_rows", "<i4")])
_SPECTRAL_COLS_PER_BLOCK = 16  # DT_SPECTRAL_COLS_PER_BLOCK
MAX_ACTIONS = 64  # DQN_MAX_ACTIONS in kernels/dqn.cu: the loss kernel stages rows in shared memory
_SPECTRAL_ROWS_PER_BLOCK = 16  # DT_SPECTRAL_ROWS_PER_BLOCK
_SPECTRAL_V_CHUNK = 1024  # SPECTRAL_V_CHUNK in kernels/spectral.cuh: columns of W a rows block stages
MAX_SPECTRAL_LAYERS = 64  # FINISH_MAX_MATS in kernels/dqn_step.cu: the finish pass stages the table
_HEAD_ROWS = 4  # DQN_HEAD_ROWS in kernels/dqn.cu: batch rows per dqn_head block
# DQNConfig(fused_head=None) fuses output layers of this many weights (measured, docs/perf-notes.md).
HEAD_AUTO_WEIGHTS = (512, 3072)
LOSS_SIGNATURE = "ptr ptr ptr ptr ptr ptr ptr i32 i32 f32 f32 ptr ptr ptr ptr ptr ptr ptr"
# kernels/dqn_step.cu's dqn_priority_update: SumTree.update_operands' first ten, the norm's
# partials and their count, the loss, the gate, the tree's error flags, a last-block counter.
PRIORITY_UPDATE_SIGNATURE = "ptr ptr ptr ptr ptr f32 i32 i32 i32 i32 ptr i32 ptr ptr ptr ptr ptr"
_GUARD_SHARES = 256  # ADAM_THREADS in kernels/optim.cuh (dqn_step.cu's GUARD_SHARES): the guard's sum's threads
_PRIORITY_BLOCKS = 4  # the blocks that share the update's refresh (docs/perf-notes.md, fifty-sixth pass)
MEANS_SIGNATURE = "ptr i32 i32 ptr ptr"
HEAD_SIGNATURE = "ptr ptr ptr i32 ptr ptr ptr ptr ptr ptr ptr ptr i32 i32 f32 f32 ptr ptr ptr ptr ptr ptr ptr ptr ptr ptr ptr"
# gemm.cu's dqn_loss_dwl kernels: a grad-input product's arguments (dout as A), the output
# layer's dW, ldw and db, then the loss's (its Q rows, per-sample operands, gamma, delta,
# priorities, partials, their 32-row block count, a*).
LOSS_DWL_SIGNATURE = ("ptr i32 ptr i32 ptr i32 i32 i32 i32 ptr ptr i32 ptr ptr ptr ptr ptr i32 ptr "
                      "ptr ptr ptr ptr ptr ptr ptr f32 f32 ptr ptr i32 ptr")


def priority_update_shape(n: int) -> tuple[int, int]:
    """(grid, block) of dqn_priority_update for ``n`` indices: blocks that split the tree
    between them, each reading every index, a thread an index up to UPDATE_THREADS, and at
    least the guard's 256 threads."""
    return _PRIORITY_BLOCKS, max(_GUARD_SHARES, min(UPDATE_THREADS, -(-n // 32) * 32))


def head_kernel_name(n_actions: int) -> str:
    """The ``dqn_head`` build for ``n_actions``: ``dqn_head_a2``, compiled for two actions
    (the same bits, a shorter loss), or ``dqn_head``, which takes any count."""
    return "dqn_head_a2" if n_actions == 2 else "dqn_head"


def loss_dwl_kernel_name(n_actions: int, vec: int) -> str:
    """gemm.cu's ``dqn_loss_dwl`` build for ``n_actions`` and copies of ``vec`` bytes: the
    one compiled for 18 actions (Atari's full set; the same bits, a shorter loss), or the
    one that takes any count."""
    build = "_a18" if n_actions == 18 else ""
    return f"dqn_loss_dwl{build}_64x64_cp{vec}_cluster_3xtf32"


def head_shared_bytes(hidden: int, n_actions: int) -> int:
    """Dynamic shared memory of one ``dqn_head`` block: both nets' output layers
    ([1 + n_actions, hidden] each), its rows of the three inputs and their Q rows."""
    cols = 1 + n_actions
    return 4 * (2 * cols * hidden + 3 * _HEAD_ROWS * (hidden + cols))


class TrainingError(RuntimeError):
    """The device skipped a step (a non-finite loss or gradient norm) or flagged bad replay input;
    or the training loop found an evaluation whose episodes did not end, or an episode ring
    overwritten before it was read."""


def spectral_stage_bytes(columns) -> int:
    """Dynamic shared memory for spectral_rows_staged over matrices of these column counts:
    each block copies its 16 rows of its matrix's first 1024 columns there before its grid
    wait (kernels/spectral.cuh); with less, it reads them after the wait (the same bits)."""
    widest = max((min(int(c), _SPECTRAL_V_CHUNK) for c in columns), default=0)
    return _SPECTRAL_ROWS_PER_BLOCK * widest * 4


def spectral_rows_kernel(row_blocks: int, sm_count: int) -> str:
    """The rows phase's kernel for a grid of ``row_blocks``: ``spectral_rows_staged`` (W in
    shared memory, 64 registers) where the grid covers at most half the SMs, else
    ``spectral_rows`` (W in registers, a block to an SM); measured, docs/perf-notes.md."""
    return "spectral_rows_staged" if 2 * row_blocks <= sm_count else "spectral_rows"


def _positive_int(name, value, low=1, high=None):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bound}, got {value}")


def _real(name, value, low, high, *, low_open=False, high_open=False):
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    too_low = value <= low if low_open else value < low
    too_high = value >= high if high_open else value > high
    if too_low or too_high:
        lo, hi = "(" if low_open else "[", ")" if high_open else "]"
        raise ValueError(f"{name} must be in {lo}{low}, {high}{hi}, got {value}")


LEARNER_STATE_KEYS = ("params", "target", "m", "v", "t", "u", "step")


def check_learner_state(arrays: dict, n_params: int, n_u: int) -> dict:
    """A learner's state (``DQNStep.state_numpy()``'s arrays) checked and converted to what
    ``DQNStep.load_state`` writes, or ValueError saying what is wrong: a missing array, a
    size other than this learner's, a value that is not finite, a negative second moment,
    or counters the kernels cannot go on from (t, the updates applied, an int32 the
    kernels advance, so at most 2^31 - 2; step, the steps counted, skipped ones too, so
    at least t)."""
    missing = [k for k in LEARNER_STATE_KEYS if k not in arrays]
    if missing:
        raise ValueError(f"the learner state lacks {missing}")
    out = {}
    for key, size in (("params", n_params), ("target", n_params), ("m", n_params), ("v", n_params), ("u", n_u)):
        a = np.asarray(arrays[key])
        if a.size != size:
            raise ValueError(f"{key} holds {a.size} values, this learner needs {size}")
        if a.dtype.kind not in "fiu":
            raise ValueError(f"{key} must hold numbers, not {a.dtype}")
        a = a.astype(np.float32).reshape(-1)
        if not np.isfinite(a).all():
            raise ValueError(f"{key} holds {int((~np.isfinite(a)).sum())} values that are not finite")
        out[key] = a
    if (out["v"] < 0).any():
        raise ValueError("v (AdamW's second moment) holds negative values")
    counters = {}
    for key in ("t", "step"):
        a = np.asarray(arrays[key])
        if a.size != 1 or a.dtype.kind not in "iu":
            raise ValueError(f"{key} must be one integer, got {a.dtype} of shape {a.shape}")
        counters[key] = int(a.reshape(-1)[0])
    t, step = counters["t"], counters["step"]
    if not 0 <= t <= 2**31 - 2:
        raise ValueError(f"t (AdamW updates applied) must be in [0, 2^31 - 2], got {t}")
    if not t <= step < 2**63:
        raise ValueError(f"step (steps counted, skipped ones too) must be in [t, 2^63), got {step} with t = {t}")
    out["t"], out["step"] = np.array([t], np.int32), np.array([step], np.int64)
    return out


@dataclass(frozen=True)
class DQNConfig:
    """Everything that defines a DQN learner. Every field is checked at construction.

    ``beta`` is a constant or ``(start, end, steps)``: a linear schedule over
    sample launches, evaluated on the device. Exactly one of ``tau`` (Polyak)
    and ``target_period`` (hard copy every K optimizer steps) is set.
    ``spectral_c`` None turns the spectral projection off; ``spectral_layers``
    None means every hidden layer (every layer but the output layer). At most
    ``MAX_SPECTRAL_LAYERS`` (64) layers are projected.
    ``fused``: when the net is narrow (every width <= 256, at most 4 weight
    layers) the three forwards run in one kernel and the backward in two
    (drvtrain.nn.narrow); ``dual_stream`` then has nothing to overlap. Off by
    default: on the H200 the per-layer GEMMs with the two ``s'`` forwards on
    their own streams measure faster (docs/perf-notes.md).
    ``dual_stream``: the online forward of ``s'`` and the target forward run on
    streams of their own, beside the online forward of ``s``, and each of the three
    plans its products for a third of the SMs (``MLP.forward``'s ``sms``), so that
    their blocks all fit at once (with ``cluster_forward`` one launch runs them
    all, and nothing is planned that way); the weight gradients run beside the
    data gradients' chain; on a third stream the sampler's IS weights run beside
    the forwards (``SumTree.sample``'s ``weights_stream``) and the loss's means
    beside the backward. With ``fused`` there are no side streams.
    ``dependent_launch`` launches every kernel of the step as a programmatic
    dependent launch (compute capability 9.0+; ignored below): each kernel's
    launch overlaps the tail of the one before, and no result changes.
    ``fused_tail`` runs everything after the backward (the norm, the priority
    update, AdamW, the spectral projection, the finish pass) as one cooperative
    kernel with grid barriers between the phases (``dqn_tail``) instead of six
    launches: the same bits, five fewer nodes on the step's chain. Off by
    default: on the H200 it measured no faster (docs/perf-notes.md).
    ``fused_head`` runs the output layer's three forwards, the loss and the
    output layer's data gradient as one row-parallel kernel (``dqn_head``, in
    FP32) instead of three forward products, ``dqn_loss`` and a dX product:
    three launches fewer on the step's chain, but each block stages both nets'
    output layers in its shared memory (:func:`head_shared_bytes`) and computes
    every column of its rows. ``None`` (the default) fuses when the output
    layer holds between 512 and 3072 weights ((1 + n_actions) * hidden[-1]),
    the range where it measured faster on the H200 (docs/perf-notes.md):
    smaller heads run faster as separate products, larger ones spend more on
    the copies and the dot products than the launches cost. ``True`` fuses
    wherever the layers fit one block (a 1024-wide last hidden layer up to 20
    actions on a 227 KiB device; elsewhere it warns and runs them apart),
    ``False`` never. With ``fused`` on a net the narrow kernels take, they run
    the whole forward and backward, and ``fused_head`` has nothing to do.
    ``cluster_forward`` runs the three forward passes (up to the output layer
    when ``dqn_head`` computes that one) as one launch of thread block clusters
    (``NarrowMLP.forward_many(cluster=True)``): each cluster holds 32 rows of
    a pass, each block a slice of every layer's columns, and the layers hand
    over in distributed shared memory. Narrow nets only (every width <= 256,
    at most 4 weight layers) on compute capability 9.0+; ``True`` raises a
    ValueError where it cannot run, and the launch raises one where the device
    has less shared memory a block than the kernel needs
    (``NarrowMLP.cluster_shared_bytes``). Off by default: on the H200 it
    measured slower than the per-layer products on three streams
    (docs/perf-notes.md). ``fused`` takes precedence: with it set,
    ``cluster_forward`` is ignored.
    ``presplit``: the wide 3xTF32 backward products (compute capability 9.0) run
    on operands split once into TF32 parts (``MLP(presplit=True)``); with
    ``dual_stream`` the weights' split runs on the target stream beside the
    sampler. The same dX and dW bits; db rounds differently, within FP32. Off by
    default: on the H200 the large step measured 29 us slower with it; the two
    pre-split products, faster alone, take longer side by side in the step than the
    default's, even with the split passes left out (docs/perf-notes.md).
    ``fused_loss``: where the output layer's backward product also sums that layer's
    dW (``MLP.last_dw_folded``) and no ``dqn_head`` runs (the large configuration),
    the loss is computed in that product too (gemm.cu's ``dqn_loss_dwl`` kernels):
    each block computes the loss of its 64 rows from their Q rows, as ``dqn_loss``
    does, and takes the gradient rows as its operand; the first column of blocks
    stores them, the priorities and the loss's partials. One launch fewer on the
    step's chain and the same bits. ``False`` keeps ``dqn_loss`` apart; with
    ``fused`` (the narrow kernels run the backward) it has nothing to do.
    """
    obs_dim: int
    n_actions: int
    hidden: tuple = (256, 256)
    tf32: bool = True
    batch: int = 256
    capacity: int = 131072
    alpha: float = 0.6
    beta: float | tuple = 0.4
    gamma: float = 0.99
    lr: float = 1e-4
    weight_decay: float = 1e-2
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    max_norm: float = 10.0
    huber_delta: float = 1.0
    tau: float | None = 0.005
    target_period: int | None = None
    spectral_c: float | None = 1.0
    spectral_layers: tuple | None = None
    seed: int = 0
    dual_stream: bool = True
    fused: bool = False
    dependent_launch: bool = True
    fused_tail: bool = False
    fused_head: bool | None = None
    cluster_forward: bool = False
    presplit: bool = False
    fused_loss: bool = True

    def __post_init__(self):
        object.__setattr__(self, "hidden", tuple(self.hidden))
        if self.spectral_layers is not None:
            object.__setattr__(self, "spectral_layers", tuple(self.spectral_layers))
        if isinstance(self.beta, list):
            object.__setattr__(self, "beta", tuple(self.beta))
        _positive_int("obs_dim", self.obs_dim)
        _positive_int("n_actions", self.n_actions, 1, MAX_ACTIONS)
        if not self.hidden:
            raise ValueError("hidden must name at least one hidden width")
        for w in self.hidden:
            _positive_int("hidden width", w)
        _positive_int("capacity", self.capacity, 1, 2**31 - 1)
        _positive_int("batch", self.batch, 1, min(self.capacity, 32768))
        _real("alpha", self.alpha, 0.0, 1.0)
        if isinstance(self.beta, tuple):
            if len(self.beta) != 3:
                raise ValueError(f"beta must be a number or (start, end, steps), got {self.beta!r}")
            _real("beta start", self.beta[0], 0.0, 1.0)
            _real("beta end", self.beta[1], 0.0, 1.0)
            _positive_int("beta steps", self.beta[2])
        else:
            _real("beta", self.beta, 0.0, 1.0)
        _real("gamma", self.gamma, 0.0, 1.0)
        _real("lr", self.lr, 0.0, 1.0, low_open=True)
        _real("weight_decay", self.weight_decay, 0.0, 1.0)
        if len(self.betas) != 2:
            raise ValueError(f"betas must be (beta1, beta2), got {self.betas!r}")
        _real("betas[0]", self.betas[0], 0.0, 1.0, high_open=True)
        _real("betas[1]", self.betas[1], 0.0, 1.0, high_open=True)
        _real("eps", self.eps, 0.0, 1.0, low_open=True)
        _real("max_norm", self.max_norm, 0.0, 1e30, low_open=True)
        check_settings(self.lr, self.betas, self.eps, self.weight_decay, self.max_norm)  # as AdamW will, eps too
        _real("huber_delta", self.huber_delta, 0.0, 1e30, low_open=True)
        if (self.tau is None) == (self.target_period is None):
            raise ValueError("set exactly one of tau (Polyak averaging) and target_period (hard copy), "
                             f"got tau={self.tau!r}, target_period={self.target_period!r}")
        if self.tau is not None:
            _real("tau", self.tau, 0.0, 1.0, low_open=True)
        else:
            _positive_int("target_period", self.target_period)
        if self.spectral_c is not None:
            _real("spectral_c", self.spectral_c, 0.0, 1e30, low_open=True)
        n_hidden = len(self.hidden)
        for k in self.spectral_layers or ():
            _positive_int("spectral layer index", k, 0, n_hidden - 1)
        if self.spectral_layers is not None and len(set(self.spectral_layers)) != len(self.spectral_layers):
            raise ValueError(f"spectral_layers repeats a layer: {self.spectral_layers}")
        if len(self.projected_layers) > MAX_SPECTRAL_LAYERS:
            raise ValueError(f"the spectral projection takes at most {MAX_SPECTRAL_LAYERS} layers, got "
                             f"{len(self.projected_layers)}: name fewer in spectral_layers, or set spectral_c=None")
        _positive_int("seed", self.seed, 0, 2**63 - 1)
        if self.fused_head is not None and not isinstance(self.fused_head, (bool, np.bool_)):
            raise ValueError(f"fused_head must be True, False or None, got {self.fused_head!r}")
        for flag in ("tf32", "dual_stream", "fused", "dependent_launch", "fused_tail", "cluster_forward", "presplit",
                     "fused_loss"):
            if not isinstance(getattr(self, flag), (bool, np.bool_)):
                raise ValueError(f"{flag} must be True or False, got {getattr(self, flag)!r}")

    @property
    def widths(self) -> list[int]:
        return [self.obs_dim, *self.hidden, 1 + self.n_actions]

    @property
    def projected_layers(self) -> tuple:
        if self.spectral_c is None:
            return ()
        return self.spectral_layers if self.spectral_layers is not None else tuple(range(len(self.hidden)))

    @property
    def target_update(self) -> tuple[float, int]:
        """(tau, period) as the kernels take them: (tau, 0) for Polyak averaging,
        (0.0, target_period) for a hard copy every ``target_period`` optimizer steps."""
        return (float(self.tau), 0) if self.tau is not None else (0.0, int(self.target_period))

    def beta_schedule(self):
        return self.beta

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def small(cls, **overrides) -> "DQNConfig":
        """The benchmark's small configuration."""
        return cls(**{**dict(obs_dim=4, hidden=(256, 256), n_actions=2, batch=256, capacity=131072), **overrides})

    @classmethod
    def large(cls, **overrides) -> "DQNConfig":
        """The benchmark's large configuration."""
        return cls(**{**dict(obs_dim=128, hidden=(1024, 1024), n_actions=18, batch=512, capacity=1 << 20),
                      **overrides})


@dataclass
class _Captured:
    """What one enqueue left behind: device views tests read after the step."""
    batch: object = None
    q_s: DeviceBuffer | None = None
    q_next_online: DeviceBuffer | None = None
    q_next_target: DeviceBuffer | None = None
    dout: DeviceBuffer | None = None
    priorities: DeviceBuffer | None = None
    extra: dict = field(default_factory=dict)


class DQNStep(Closable):
    """Owns the online and target parameters, gradients, Adam moments, the replay,
    the arena and the metrics ring; ``enqueue`` queues one step (or several in a
    row), ``capture`` records them as one executable graph. ``last`` describes the
    last step queued."""

    @closes_on_failure
    def __init__(self, config: DQNConfig, *, arena_active: bool = True, metrics_slots: int = 1024):
        if not isinstance(config, DQNConfig):
            raise TypeError(f"DQNStep takes a DQNConfig, got {type(config).__name__}")
        self.config = cfg = config
        self.layout = ParamLayout.from_widths(cfg.widths)
        device = get_device()
        rng = np.random.default_rng(cfg.seed)
        init = self.layout.init_numpy(int(rng.integers(2**62)))
        self.params = FlatBuffer(self.layout, init)
        self.target = FlatBuffer(self.layout, init)
        self.grads = FlatBuffer(self.layout)
        # The first layer is not folded into the second's forward: with the three forwards
        # side by side the folded products measured 2.6 to 2.9 us slower on the small step
        # (docs/perf-notes.md, twenty-fourth pass). The output layer's dW is folded into its
        # dX where that plans (MLP.last_dw_folded: the large step), 0.55 us faster with its
        # share on the tensor cores (thirty-seventh pass).
        self.online_mlp = MLP(self.layout, tf32=cfg.tf32, presplit=cfg.presplit, fold_first_layer=False)
        self.metrics = Metrics(metrics_slots, METRIC_FIELDS)
        # scalars: loss, mean Q, mean |td| (the loss kernel), then the sampler's beta.
        self._scalars = DeviceBuffer.from_numpy(np.zeros(4, np.float32))
        self.loss = self._scalars.view(np.float32, (1,), 0)
        self._beta_used = self._scalars.view(np.float32, (1,), 12)
        self.optimizer = AdamW(self.params, self.grads, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                               weight_decay=cfg.weight_decay, max_norm=cfg.max_norm, loss=self.loss,
                               nan_guard=True)
        self.replay = ReplayBuffer(cfg.capacity, cfg.obs_dim, alpha=cfg.alpha,
                                   seed=int(rng.integers(2**63)), max_batch=cfg.batch)
        b, a = cfg.batch, cfg.n_actions
        mod = builtin_module("dqn.cu")
        self._loss_kernel = mod.kernel("dqn_loss", LOSS_SIGNATURE, fixed_block=True)
        self._loss_grid = -(-b // self._loss_kernel.block)
        self._loss_partials = DeviceBuffer(3 * self._loss_grid, np.float64)
        self._setup_spectral(mod, rng)
        self._finish = builtin_module("dqn_step.cu").kernel(
            "dqn_finish", "ptr ptr i64 ptr i32 ptr ptr f32 ptr ptr f32 i32 ptr ptr ptr ptr ptr ptr ptr i32 ptr ptr ptr",
            fixed_block=True)
        self._finish_grid = max(2, min(4 * device.sm_count, -(-self.layout.size // (4 * self._finish.block))))
        # The priority update with its own NaN guard, so that it can start once the norm's
        # partials are written (dqn_priority_update), and its last-block counter.
        self._priority = builtin_module("dqn_step.cu").kernel("dqn_priority_update", PRIORITY_UPDATE_SIGNATURE)
        self._priority_counter = DeviceBuffer.zeros(1, np.uint32)
        self._tail = None
        if cfg.fused_tail:
            self._tail = builtin_module("dqn_step.cu").kernel(
                "dqn_tail", "ptr ptr ptr ptr i64 i32 ptr f32 ptr f32 f64 f64 f32 f32 ptr ptr ptr ptr "
                "ptr ptr ptr ptr ptr f32 i32 i32 i32 i32 ptr ptr "
                "ptr i32 i32 i32 ptr ptr f32 ptr ptr ptr "
                "ptr f32 i32 ptr ptr ptr ptr i32 ptr ptr ptr ptr", fixed_block=True)
            # One block per SM at most: a barrier costs more with more arrivals, and
            # the phases with blocks of their own have about that many or fewer;
            # the elementwise phases stride over the grid.
            cb, rb = self._spectral_grids
            want = max(cb, rb, self.optimizer.norm_grid, -(-self.layout.size // (16 * self._tail.block)))
            self._tail_grid = max(2, min(device.sm_count, self._tail.max_resident_blocks(self._tail.block), want))
            self._tail_barrier = DeviceBuffer.zeros(1, np.uint32)
        self._step_counter = DeviceBuffer.zeros(1, np.int64)
        self.skips = ErrorFlags(["skipped"])
        self._skipped_step = MappedBuffer(1, np.int64)
        self._skipped_step.view()[:] = 0
        self.narrow = NarrowMLP(self.layout, tf32=cfg.tf32) if cfg.fused and NarrowMLP.supports(self.layout) \
            else None
        self.cluster_net = self._cluster_forward_net(cfg, device)
        # With three streams and per-layer products the three forwards run side by side:
        # each plans its products for a third of the SMs (MLP.forward's sms), so that all
        # their blocks fit at once (docs/perf-notes.md, eleventh pass).
        dual = cfg.dual_stream and self.narrow is None
        side_by_side = dual and self.cluster_net is None
        self._forward_sms = max(1, device.sm_count // 3) if side_by_side else None
        if self.narrow is not None:
            net_bytes, zeroed = self.narrow.scratch_bytes(b, 3), self.narrow.zeroed_bytes(b)
        else:
            net_bytes = 3 * self.online_mlp.scratch_bytes(b, sms=self._forward_sms)
            zeroed = 3 * self.online_mlp.zeroed_bytes(b, sms=self._forward_sms)
            if self.cluster_net is not None:
                net_bytes += 3 * self.cluster_net.forward_bytes(b)
        out_bytes = 4 * b * (1 + a)
        self.arena = Arena(self.replay.scratch_bytes(b) + net_bytes + 2 * out_bytes + 8 * b + 4096,
                           zeroed_bytes=zeroed + 1024, active=arena_active)
        self.streams = ()
        for _ in range(2 if dual else 0):  # one at a time: a failed second leaves the first to close()
            self.streams += (Stream(),)
        # The sampler's IS weights (sumtree_weights) beside the forwards, joined before
        # the loss; later the loss's batch means (dqn_means_*) beside the backward,
        # joined before the optimizer, their first reader. Inline on one stream.
        self._means_stream = Stream() if dual else None
        self._head = None
        head_weights = (1 + a) * self.layout.layers[-1][1]
        fuse_head = cfg.fused_head if cfg.fused_head is not None else \
            HEAD_AUTO_WEIGHTS[0] <= head_weights <= HEAD_AUTO_WEIGHTS[1]
        if fuse_head and self.narrow is None:
            head = mod.kernel(head_kernel_name(a), HEAD_SIGNATURE, fixed_block=True)
            self._head_shared = head_shared_bytes(self.layout.layers[-1][1], a)
            if self._head_shared <= head.max_dynamic_shared():
                self._head = head
                self._head_grid = -(-b // _HEAD_ROWS)
                self._head_partials = DeviceBuffer(3 * self._head_grid, np.float64)
            elif cfg.fused_head:
                warnings.warn(f"fused_head=True: the output layers take {self._head_shared} bytes of shared "
                              f"memory in a dqn_head block, this device allows {head.max_dynamic_shared()}; "
                              "the output layer, the loss and its dX run as separate kernels", stacklevel=2)
        # The loss in the output layer's backward product (DQNConfig.fused_loss): where
        # that product folds the layer's dW and no dqn_head runs. Its B is the layer's W.
        self._loss_dwl = None
        if cfg.fused_loss and self._head is None and self.narrow is None and self.online_mlp.last_dw_folded(b):
            last = len(self.layout.layers) - 1
            inp = self.layout.layers[last][1]
            vec = 16 if inp % 4 == 0 and self.params.weight(last).ptr % 16 == 0 else 4
            kernel = builtin_module("gemm.cu").kernel(loss_dwl_kernel_name(a, vec), LOSS_DWL_SIGNATURE,
                                                      fixed_block=True)
            # Its own registers: a cluster of the row tiles must fit it too (else dqn_loss apart).
            if kernel.max_active_clusters((1, -(-b // 64), 1), kernel.block, 0) >= 1:
                self._loss_dwl = kernel
        # The means kernel has the block size of the kernel whose partials it sums (the same tree).
        self._means = mod.kernel("dqn_means_256" if self._head is not None else "dqn_means_32", MEANS_SIGNATURE,
                                 fixed_block=True)
        # The weights a pre-split dX reads are split at the step's start on the target
        # stream, beside the sampler (MLP.split_weights; dqn_head computes the last dX).
        self._early_weight_splits = bool(self.streams) and bool(
            self.online_mlp.dx_presplit_layers(b, dx_last=self._head is not None))
        # The backward's weight gradients beside its dX chain: on both side streams
        # (the output layer's and the hidden layer's dW side by side, where the output
        # layer's is not summed in its dX product; where it is, the first of them has no
        # product to take) unless the second holds the early weight splits.
        self._weight_streams = self.streams[:1] if self._early_weight_splits else self.streams
        # Consecutive steps draw beside the tail where the priority update runs on a
        # stream of its own (the second side stream), not inside the cooperative tail.
        self._draws_beside_the_tail = bool(self.streams) and self._tail is None
        # The step's forwards always run this batch through the same layers: when a narrow
        # net runs them, its kernels are compiled for that one shape (the same bits, fewer
        # instructions: NarrowMLP.fix_shape).
        self._forward_net = self.narrow if self.narrow is not None else self.cluster_net  # None: per-layer GEMMs
        if self._forward_net is not None:
            self._forward_net.fix_shape(b, self._forward_layers())
        self.last = _Captured()
        self.graph: Graph | None = None

    # ------------------------------------------------------------------ setup
    def _forward_layers(self) -> int:
        """The layers the step's forward passes run: all but the output layer when
        dqn_head runs that one."""
        return len(self.layout.layers) - (self._head is not None)

    def _cluster_forward_net(self, cfg, device) -> NarrowMLP | None:
        """The NarrowMLP whose cluster kernel runs the three forwards, or None (see
        DQNConfig.cluster_forward)."""
        if not cfg.cluster_forward or cfg.fused:
            return None
        reason = None
        if not NarrowMLP.supports(self.layout):
            reason = f"the net {self.layout.widths} is not narrow (every width <= 256, at most 4 weight layers)"
        elif tuple(device.compute_capability) < (9, 0):
            reason = f"thread block clusters need compute capability 9.0+, the device has {device.arch}"
        if reason is not None:
            raise ValueError(f"cluster_forward=True cannot run: {reason}")
        return NarrowMLP(self.layout, tf32=cfg.tf32)

    def _setup_spectral(self, mod, rng) -> None:
        cfg = self.config
        layers = cfg.projected_layers
        table = np.zeros(max(1, len(layers)), _SPECTRAL_DTYPE)
        u_parts, u_off, v_off, cb, rb = [], 0, 0, 0, 0
        for m, k in enumerate(layers):
            rows, cols = self.layout.layers[k]
            table[m] = (self.layout.weight(k).offset, rows, cols, u_off, v_off, cb, rb)
            u = rng.standard_normal(rows)
            u_parts.append(u / max(np.linalg.norm(u), 1e-12))
            u_off += rows
            v_off += cols
            cb += -(-cols // _SPECTRAL_COLS_PER_BLOCK)
            rb += -(-rows // _SPECTRAL_ROWS_PER_BLOCK)
        self.spectral_table = table[: len(layers)]
        self.n_spectral = len(layers)
        self._spectral_mats = DeviceBuffer.from_numpy(table.view(np.uint8))
        self.u = DeviceBuffer.from_numpy(np.concatenate(u_parts).astype(np.float32) if u_parts
                                         else np.zeros(1, np.float32))
        self._v = DeviceBuffer(max(1, v_off), np.float32)
        self._spectral_grids = (cb, rb)
        self._spectral_partials = DeviceBuffer(max(1, cb + 2 * rb), np.float64)
        # What the rows phase writes, after the columns phase's partials: its partials of
        # ||y||^2, then ||x||^2 of each row block's matrix; the finish pass reads both.
        self._row_partials = (self._spectral_partials.view(np.float64, (2 * rb,), 8 * cb) if rb
                              else self._spectral_partials)
        n = max(1, len(layers))
        self._sigma_scale = DeviceBuffer.from_numpy(np.concatenate([np.zeros(n), np.ones(n)]).astype(np.float32))
        self.sigma = self._sigma_scale.view(np.float32, (n,), 0)
        self.spectral_scale = self._sigma_scale.view(np.float32, (n,), 4 * n)
        self._spectral_columns = mod.kernel("spectral_columns", "ptr ptr i32 ptr ptr ptr ptr", fixed_block=True)
        # The rows phase holds its first chunk of W across its wait in registers
        # (spectral_rows: a block takes its SM's whole register file) or, where its grid
        # covers at most half the SMs, in shared memory (spectral_rows_staged: 64
        # registers, so its blocks start beside others'). Measured: the small step faster
        # staged, the large one (a rows block on nearly every SM) faster with registers
        # (docs/perf-notes.md, fortieth and forty-first passes). The same bits either way.
        name = spectral_rows_kernel(rb, get_device().sm_count)
        staged = name == "spectral_rows_staged"
        self._spectral_rows = mod.kernel(name, "ptr ptr i32 ptr ptr ptr ptr", fixed_block=True)
        self._spectral_stage = spectral_stage_bytes(table["cols"][: len(layers)]) if staged else 0

    # ------------------------------------------------------------------ the step
    def enqueue(self, *, stream, uniforms=None, gate=None, steps: int = 1) -> None:
        """Queue whole steps on ``stream`` (eagerly, or into a capture): one, or
        ``steps`` consecutive ones with nothing between them.

        ``uniforms`` (float64 device buffer, one per sample) replaces the
        sampler's Philox draws: tests feed known strata (one step only). ``gate``
        (an int32 device word) lets the device decide: while it is non-zero the
        steps' kernels return at once and nothing changes, counters and metrics
        included (a training loop captures the step once and gates it).

        Consecutive steps: with side streams (``dual_stream``) and the separate
        tail kernels (not ``fused_tail``), the defaults, each step after the first
        draws its batch on the update stream right after the step before has
        written its priorities, beside that step's AdamW, spectral phases and
        finish pass, so its forward finds the batch ready when the parameters are;
        otherwise the steps follow one another as single steps do. The results
        are those of ``steps`` single steps, bit for bit (docs/perf-notes.md,
        twenty-seventh pass). A host that polls ``metrics`` records ``steps``
        times after each such launch (:meth:`Metrics.record` marks one step), so
        ``steps`` is at most the ring's slots. Use ``steps > 1`` only for
        gradient steps with no transitions inserted between them; a training
        loop that inserts between gradient steps queues them one at a time.
        """
        self._check_steps(steps, uniforms)
        with dependent_launches(self.config.dependent_launch):
            for k in range(steps):
                self._enqueue(stream, uniforms, gate, after_a_step=k > 0)

    def _check_steps(self, steps, uniforms) -> None:
        _positive_int("steps", steps, 1, self.metrics.slots)
        if steps > 1 and uniforms is not None:
            raise ValueError("uniforms replace one step's draws: pass them with steps=1")

    def _enqueue(self, stream, uniforms, gate, after_a_step=False) -> None:
        cfg = self.config
        b, a = cfg.batch, cfg.n_actions
        arena, mlp = self.arena, self.online_mlp
        arena.reset()
        # With side streams the weights take a second launch on the means stream, so the
        # forwards wait for no last block; joined with the forwards before the loss.
        weights_stream = self._means_stream
        sample = lambda on: self.replay.sample(b, stream=on, beta=cfg.beta, arena=arena, uniforms=uniforms,
                                               beta_out=self._beta_used, gate=gate, weights_stream=weights_stream)
        batch = None
        if after_a_step and self._draws_beside_the_tail:
            # The update stream's last work is the step before's priority update, the
            # last writer of what the draw reads (the tree; the batch's arena slices
            # were last read by that update). The IS weights' launch writes the beta
            # that the step before's finish pass publishes: it waits for that pass.
            fork(stream, weights_stream)
            batch = sample(self.streams[1])
            join(stream, self.streams[1])
        weight_splits = None
        if self._early_weight_splits:  # joined by the backward's wait for its event
            fork(stream, self.streams[1])
            weight_splits = mlp.split_weights(self.params, b, arena=arena, stream=self.streams[1], gate=gate,
                                              dx_last=self._head is not None)
        if batch is None:
            batch = sample(stream)
        capturing = bool(active_captures())
        head = self._head
        hidden_layers = self._forward_layers()
        net = self._forward_net
        if net is not None:  # all three passes in one launch
            f_online, f_next, f_target = net.forward_many(
                [self.params, self.params, self.target], [batch.obs, batch.next_obs, batch.next_obs],
                arena=arena, stream=stream, gate=gate, layers=hidden_layers, cluster=net is self.cluster_net)
            target_leaves = online_leaves = capture_frontier(stream) if capturing else []
        else:
            if self.streams:
                next_stream, target_stream = self.streams
                fork(stream, next_stream, target_stream)
            else:
                next_stream = target_stream = stream
            # No weights_settled (MLP.forward): with it every forward and dX product ran
            # `_settled_` kernels, 0.2 us slower (docs/perf-notes.md, twenty-fifth pass).
            # Each pass's products after its first run them without it, 0.3 us faster
            # (twenty-sixth pass).
            # The loss reads only the Q of these two: their last hidden output is not stored
            # where the head kernel computes Q (docs/perf-notes.md, thirty-eighth pass).
            f_target = mlp.forward(self.target, batch.next_obs, arena=arena, stream=target_stream, gate=gate,
                                   layers=hidden_layers, sms=self._forward_sms, store_hidden=False)
            target_leaves = capture_frontier(target_stream) if capturing else []
            f_next = mlp.forward(self.params, batch.next_obs, arena=arena, stream=next_stream, gate=gate,
                                 layers=hidden_layers, sms=self._forward_sms, store_hidden=False)
            f_online = mlp.forward(self.params, batch.obs, arena=arena, stream=stream, gate=gate,
                                   layers=hidden_layers, sms=self._forward_sms)
            online_leaves = capture_frontier(stream) if capturing else []
            if self.streams:
                join(stream, next_stream, target_stream)
        if weights_stream is not None:  # the loss reads the weights
            join(stream, weights_stream)
        dout = arena.array((b, 1 + a), np.float32)
        priorities = arena.array(b, np.float32)
        a_star = arena.array(b, np.int32)
        dh = None
        if head is not None:
            last, hidden = len(self.layout.layers) - 1, self.layout.layers[-1][1]
            q = [arena.array((b, 1 + a), np.float32) for _ in range(3)]
            dh = arena.array((b, hidden), np.float32)
            head.launch(self._head_grid, head.block, f_online.output, f_next.output, f_target.output, hidden,
                        self.params.weight(last), self.params.bias(last), self.target.weight(last),
                        self.target.bias(last), batch.action, batch.reward, batch.done, batch.weights, b, a,
                        cfg.gamma, cfg.huber_delta, *q, dout, dh, priorities, self._scalars, self._head_partials,
                        0, a_star, gate if gate is not None else 0, stream=stream, shared_mem=self._head_shared)
            f_online, f_next, f_target = (Forward(f.activations + (out,))
                                          for f, out in zip((f_online, f_next, f_target), q))
        elif self._loss_dwl is not None:  # the loss, the output layer's dX, dW and db in one launch
            last = len(self.layout.layers) - 1
            out, inp = self.layout.layers[last]
            dh = arena.array((b, inp), np.float32)
            grid = (-(-inp // 64), -(-b // 64), 1)
            self._loss_dwl.launch(grid, self._loss_dwl.block, dout, out, self.params.weight(last), inp, dh, inp, b,
                                  inp, out, 0, f_online.activations[last], inp, 0, 0, 0,
                                  gate if gate is not None else 0, self.grads.weight(last), inp,
                                  self.grads.bias(last), f_online.output, f_next.output, f_target.output,
                                  batch.action, batch.reward, batch.done, batch.weights, cfg.gamma, cfg.huber_delta,
                                  priorities, self._loss_partials, self._loss_grid, a_star, stream=stream,
                                  cluster=(1, grid[1], 1), cluster_policy="load_balancing")
        else:
            self._loss_kernel.launch(self._loss_grid, self._loss_kernel.block, f_online.output, f_next.output,
                                     f_target.output, batch.action, batch.reward, batch.done, batch.weights, b, a,
                                     cfg.gamma, cfg.huber_delta, dout, priorities, self._scalars,
                                     self._loss_partials, 0, a_star, gate if gate is not None else 0, stream=stream)
        # Each loss block left its partials (no counter): the means are summed off the chain,
        # by an ordinary launch. As a second dependent launch of the loss kernel it made the
        # large step's first backward product 8 us slower (docs/perf-notes.md, nineteenth pass).
        means_stream = self._means_stream or stream
        if means_stream is not stream:
            fork(stream, means_stream)
        grid, partials = (self._head_grid, self._head_partials) if head is not None else \
            (self._loss_grid, self._loss_partials)
        self._means.launch(3, self._means.block, partials, grid, b, self._scalars, gate if gate is not None else 0,
                           stream=means_stream, dependent=False if means_stream is not stream else None)
        first_dw = None  # the first layer's dW left for the norm to sum (MLP.backward's defer_first_dw)
        if self.narrow is not None:
            self.narrow.backward(self.params, self.grads, f_online, dout, arena=arena, stream=stream, gate=gate)
        else:
            first_dw = mlp.backward(self.params, self.grads, f_online, dout, arena=arena, stream=stream, gate=gate,
                                    weight_stream=self._weight_streams or None, dx_last=dh,
                                    last_dw_done=self._loss_dwl is not None,
                                    weight_splits=weight_splits, defer_first_dw=self._tail is None)
        if means_stream is not stream:  # the optimizer reads the loss for its NaN guard
            join(stream, means_stream)
        # The priority update needs the loss's priorities and the norm's NaN guard, which
        # it decides from the norm's partials itself: on a second stream, forked once the
        # norm is queued, it runs beside AdamW, the spectral launches and the finish pass,
        # off the chain. On one stream it follows AdamW, as the NaN guard's other readers do.
        if self._tail is not None:
            self._enqueue_tail(batch, priorities, stream, gate)
        else:
            update_stream = self.streams[1] if self.streams else stream
            update = lambda: self._enqueue_priority_update(batch, priorities, stream, update_stream, gate)
            self.optimizer.step(stream=stream, gate=gate, first_dw=first_dw,
                                after_norm=update if update_stream is not stream else None)
            if update_stream is stream:
                update()
            self._enqueue_spectral_and_finish(stream)
            if update_stream is not stream:
                join(stream, update_stream)
        self.last = _Captured(batch, f_online.output, f_next.output, f_target.output, dout, priorities,
                              {"target_forward_nodes": target_leaves, "online_forward_nodes": online_leaves,
                               "a_star": a_star, "online_forward": f_online})

    def _enqueue_priority_update(self, batch, priorities, stream, update_stream, gate) -> None:
        """dqn_priority_update on ``update_stream`` (forked from ``stream`` when it is another)."""
        if update_stream is not stream:
            fork(stream, update_stream)
        opt, tree = self.optimizer, self.replay.tree.update_operands(batch.indices, priorities)
        grid, block = priority_update_shape(batch.indices.size)
        # The tree's operands, with the guard's (partials, their count, the loss, the gate)
        # before its error flags.
        self._priority.launch(grid, block, *tree[:10], opt.norm_partials, opt.norm_grid, self.loss,
                              gate if gate is not None else 0, *tree[10:], self._priority_counter,
                              stream=update_stream)

    def _enqueue_tail(self, batch, priorities, stream, gate) -> None:
        cfg, opt = self.config, self.optimizer
        tau, period = cfg.target_update
        cb, rb = self._spectral_grids
        self._tail.launch(
            self._tail_grid, self._tail.block,
            self.params, self.grads, opt.m, opt.v, self.layout.size, opt.norm_grid, opt.norm_partials, opt.max_norm,
            self.loss, opt.lr, opt.betas[0], opt.betas[1], opt.eps, opt.weight_decay, opt.clip, opt.t, opt.skip,
            gate if gate is not None else 0,
            *self.replay.tree.update_operands(batch.indices, priorities),
            self._spectral_mats, self.n_spectral, cb, rb, self.u, self._v, float(cfg.spectral_c or 1.0), self.sigma,
            self.spectral_scale, self._spectral_partials,
            self.target, tau, period, self._scalars, self._beta_used, self._step_counter, self.metrics.ptr,
            self.metrics.slots, self.skips.counts, self.skips.published, self._skipped_step.ptr, self._tail_barrier,
            stream=stream, cooperative=True)

    def _enqueue_spectral_and_finish(self, stream) -> None:
        cfg, skip = self.config, self.optimizer.skip
        if self.n_spectral:
            cb, rb = self._spectral_grids
            self._spectral_columns.launch(cb, self._spectral_columns.block, self.params, self._spectral_mats,
                                          self.n_spectral, self.u, self._v, self._spectral_partials, skip,
                                          stream=stream)
            self._spectral_rows.launch(rb, self._spectral_rows.block, self.params, self._spectral_mats,
                                       self.n_spectral, self.u, self._v, self._spectral_partials, skip,
                                       stream=stream, shared_mem=self._spectral_stage)
        self._launch_finish(stream)

    def _launch_finish(self, stream) -> None:
        """dqn_finish: directly after spectral_rows where a layer is projected (it reads
        what neither spectral phase writes before its grid wait)."""
        cfg, skip = self.config, self.optimizer.skip
        tau, period = cfg.target_update
        self._finish.launch(self._finish_grid, self._finish.block, self.params, self.target, self.layout.size,
                            self._spectral_mats, self.n_spectral, self.u, self._row_partials,
                            float(cfg.spectral_c or 1.0), self.spectral_scale, self.sigma, tau, period,
                            self.optimizer.t, skip, self._scalars, self.optimizer.clip, self._beta_used,
                            self._step_counter, self.metrics.ptr, self.metrics.slots, self.skips.counts,
                            self.skips.published, self._skipped_step.ptr, stream=stream)

    def capture(self, *, stream, steps: int = 1) -> GraphExec:
        """The whole step (or ``steps`` consecutive ones, see :meth:`enqueue`) as one
        executable graph; replay it with ``launch(stream)``."""
        self._check_steps(steps, None)
        with capture(stream) as graph:
            self.enqueue(stream=stream, steps=steps)
        self.graph = graph
        return graph.instantiate()

    # ------------------------------------------------------------------ host side
    def fill_random(self, seed: int, *, stream, done_fraction: float = 0.05, chunk: int = 1 << 18) -> None:
        """Fill the whole replay as the benchmark does: normal observations and
        rewards, ``done_fraction`` terminal, priorities uniform in [0.1, 1.1).
        Synchronous setup, in chunks so host memory stays bounded."""
        cfg = self.config
        rng = np.random.default_rng(seed)
        for start in range(0, cfg.capacity, chunk):
            n = min(chunk, cfg.capacity - start)
            self.replay.insert(rng.standard_normal((n, cfg.obs_dim), dtype=np.float32),
                               rng.integers(0, cfg.n_actions, n, dtype=np.int32),
                               rng.standard_normal(n, dtype=np.float32),
                               rng.standard_normal((n, cfg.obs_dim), dtype=np.float32),
                               (rng.random(n) < done_fraction).astype(np.float32), stream=stream)
        self.replay.tree.set_priorities(rng.uniform(0.1, 1.1, cfg.capacity).astype(np.float32))

    def check_errors(self) -> None:
        """Raise for what the device flagged since the last check: bad replay input
        (ReplayError) or a skipped step (TrainingError). Reads mapped memory only."""
        self.replay.check_errors()
        if self.skips.raised():
            count = int(self.skips.published.view()[0])
            step = int(self._skipped_step.view()[0])
            raise TrainingError(f"step {step} was skipped: its loss or gradient norm was not finite; "
                                f"parameters, moments, target and priorities were left as they were "
                                f"({count} step(s) skipped so far)")

    def steps_done(self) -> int:
        """Steps run on the device, skipped ones included (synchronous read)."""
        return int(self._step_counter.to_numpy()[0])

    def q_values(self, obs: np.ndarray, *, stream) -> np.ndarray:
        """Q(obs, .) of the online network, [N, n_actions], as a host array (tests, evaluation)."""
        obs = np.ascontiguousarray(obs, np.float32)
        if obs.ndim != 2 or obs.shape[1] != self.config.obs_dim:
            raise ValueError(f"obs must have shape (N, {self.config.obs_dim}), got {obs.shape}")
        n = obs.shape[0]
        with Arena(self.online_mlp.scratch_bytes(n), zeroed_bytes=self.online_mlp.zeroed_bytes(n) + 256) as arena, \
                DeviceBuffer.from_numpy(obs) as x:
            out = self.online_mlp.forward(self.params, x, arena=arena, stream=stream).output.to_numpy()
        v, adv = out[:, :1].astype(np.float64), out[:, 1:].astype(np.float64)
        return (v + adv - adv.mean(axis=1, keepdims=True)).astype(np.float32)

    def state_numpy(self) -> dict:
        """Every learner array as host copies: params, target, m, v, t, u (synchronous)."""
        return {"params": self.params.buffer.to_numpy(), "target": self.target.buffer.to_numpy(),
                "m": self.optimizer.m.buffer.to_numpy(), "v": self.optimizer.v.buffer.to_numpy(),
                "t": np.array(self.optimizer.read_state()[2], np.int64), "u": self.u.to_numpy(),
                "step": self._step_counter.to_numpy()}

    def save(self, path) -> None:
        """Write the learner (not the replay) to ``path`` (.npz), atomically."""
        path = Path(path)
        state = self.state_numpy()
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            np.savez(f, layers=np.array(self.layout.layers, np.int64), **state)
        tmp.replace(path)

    def load(self, path) -> None:
        """Read a file written by ``save``; a file of another network is refused and nothing changes."""
        with np.load(Path(path)) as data:
            missing = {"layers", *LEARNER_STATE_KEYS} - set(data.files)
            if missing:
                raise ValueError(f"{path}: not a DQN checkpoint (missing {sorted(missing)})")
            layers = [tuple(int(v) for v in row) for row in data["layers"]]
            if layers != self.layout.layers:
                raise ValueError(f"{path}: saved network {layers} differs from this one {self.layout.layers}")
            arrays = {k: data[k] for k in data.files if k != "layers"}
        self.load_state(arrays)

    def load_state(self, arrays: dict) -> None:
        """Restore ``state_numpy()``'s arrays; every one is checked
        (:func:`check_learner_state`) before anything is written."""
        s = check_learner_state(arrays, self.layout.size, self.u.size)
        self.params.buffer.copy_from_numpy(s["params"])
        self.target.buffer.copy_from_numpy(s["target"])
        self.optimizer.m.buffer.copy_from_numpy(s["m"])
        self.optimizer.v.buffer.copy_from_numpy(s["v"])
        self.optimizer.t.copy_from_numpy(s["t"])
        self.u.copy_from_numpy(s["u"].reshape(self.u.shape))
        self._step_counter.copy_from_numpy(s["step"])

    def close(self) -> None:
        """Give back every stream and device buffer now (also what a failed ``__init__`` had
        made). ``graph``, the last capture's ``Graph``, stays open, so its topology can still be
        read; the executable graphs made from it replay freed buffers: close them first."""
        for s in getattr(self, "streams", ()):
            s.close()
        close_attributes(self, "_means_stream", "replay", "arena", "metrics", "optimizer", "skips", "_skipped_step",
                         "params", "target", "grads", "_scalars", "_loss_partials", "_step_counter",
                         "_spectral_mats", "u", "_v", "_spectral_partials", "_sigma_scale", "_head_partials",
                         "_tail_barrier", "_priority_counter")


def lint_step_graph(step: DQNStep) -> list[Criterion]:
    """The captured step's graph against the hot-path rules (``step.capture`` first)."""
    graph = step.graph
    if graph is None:
        raise RuntimeError("capture the step first: lint_step_graph reads step.graph")
    kernels = graph.kernel_nodes()
    counts = graph.node_counts()
    single = [k.function for k in kernels if k.grid == (1, 1, 1)]
    copies = counts.get("memset", 0) + counts.get("memcpy", 0)
    spectral = [k for k in kernels if k.function.startswith("spectral_")]
    forwards = [k for k in kernels if k.function.startswith(("linear_forward", "narrow_forward"))]
    backwards = [k.function for k in kernels if k.function.startswith(("linear_grad", "narrow_backward",
                                                                        "narrow_weight", "dqn_loss_dwl_"))]
    # Forward names end in _f32 for exact FP32, anything else is TF32. The backward
    # must keep FP32 accuracy: FFMA (_f32) or split-operand tensor cores (_3xtf32,
    # and the narrow kernels, which always split).
    want_fwd = "TF32" if step.config.tf32 else "FP32"
    fwd_ok = [k for k in forwards if ("FP32" if k.function.endswith("_f32") else "TF32") == want_fwd]
    bwd_ok = [f for f in backwards if f.endswith(("_f32", "_3xtf32")) or f.startswith("narrow_")]
    programmatic = len(graph.programmatic_edges())
    want_programmatic = step.config.dependent_launch and get_device().compute_capability >= (9, 0)
    rows = [
        Criterion("kernels with grid (1,1,1)", "0", str(len(single)), not single),
        Criterion("memset and memcpy nodes", "0", str(copies), copies == 0),
        Criterion("spectral projection kernel nodes", "<= 2", str(len(spectral)), len(spectral) <= 2),
        Criterion(f"forward products on {want_fwd} kernels", f"{len(forwards)}/{len(forwards)}",
                  f"{len(fwd_ok)}/{len(forwards)}", bool(forwards) and len(fwd_ok) == len(forwards)),
        Criterion("backward products at FP32 accuracy", f"{len(backwards)}/{len(backwards)}",
                  f"{len(bwd_ok)}/{len(backwards)}", bool(backwards) and len(bwd_ok) == len(backwards)),
    ]
    if step.narrow is not None or step.cluster_net is not None:
        fused = [k for k in forwards if k.grid[1] == 3]
        rows.append(Criterion("three forwards in one fused launch", "1 node", f"{len(forwards)} node(s)",
                              len(forwards) == 1 and len(fused) == 1))
    else:
        target = [graph.node_for(h) for h in step.last.extra.get("target_forward_nodes", [])]
        online = [graph.node_for(h) for h in step.last.extra.get("online_forward_nodes", [])]
        overlap = bool(target and online) and all(graph.can_run_concurrently(x, y) for x in target for y in online)
        want_overlap = step.config.dual_stream
        rows.append(Criterion("target forward concurrent with online forward",
                              "yes" if want_overlap else "no (one stream)", "yes" if overlap else "no",
                              overlap == want_overlap))
    if step._head is not None:
        heads = [k for k in kernels if k.function == head_kernel_name(step.config.n_actions)]
        losses = [k for k in kernels if k.function == "dqn_loss"]
        rows.append(Criterion("output layer's forwards, loss and dX: one node", "1", str(len(heads)),
                              len(heads) == 1 and not losses))
    if step._loss_dwl is not None:
        fused = [k for k in kernels if k.function.startswith("dqn_loss_dwl_")]
        apart = [k for k in kernels if k.function == "dqn_loss" or k.function.startswith("linear_grad_input_dwl_")]
        rows.append(Criterion("loss and output layer's dX, dW, db: one node", "1", str(len(fused)),
                              len(fused) == 1 and not apart))
    if step.config.fused_tail:
        tails = [k for k in kernels if k.function == "dqn_tail"]
        replaced = [k for k in kernels if k.function in ("grad_norm_partials", "grad_norm_partials_first_dw",
                                                         "adamw_clip_step", "grad_norm_clip",
                                                         "adamw_step", "sumtree_update", "dqn_priority_update",
                                                         "dqn_finish")
                    or k.function.startswith("spectral_")]
        rows.append(Criterion("norm, priority update, AdamW, projection, finish: one node", "1", str(len(tails)),
                              len(tails) == 1 and not replaced))
    rows.append(Criterion("programmatic (dependent-launch) edges", ">= 1" if want_programmatic else "0",
                          str(programmatic), programmatic >= 1 if want_programmatic else programmatic == 0))
    return rows


def audit_step(step: DQNStep, *, stream, iterations: int = 200) -> tuple[list[Criterion], CallCounts]:
    """Capture the step, run ``iterations`` steady-state steps while counting every
    driver call drvtrain makes, and lint the graph. Returns the table rows and the counts.

    The loop is what a trainer runs: launch the graph, record the step's
    event, poll the metrics ring, check the device's error flags.
    """
    exe = step.capture(stream=stream)
    for _ in range(5):  # warm up outside the count
        exe.launch(stream)
        step.metrics.record(stream)
    stream.synchronize()
    step.metrics.poll()
    with count_driver_calls() as calls:
        for _ in range(iterations):
            exe.launch(stream)
            step.metrics.record(stream)
            step.metrics.poll()
            while step.metrics.in_flight >= step.metrics.slots - 1:  # back-pressure, never a sync
                step.metrics.poll()
            step.check_errors()
    stream.synchronize()
    step.metrics.poll()
    counts = CallCounts(calls, iterations)
    rows = classify(counts)
    allowed = {"cuGraphLaunch", "cuEventRecord", "cuEventQuery"}
    others = sorted(set(calls) - allowed)
    rows.append(Criterion("graph launches per step", "1", f"{counts.per_iteration('cuGraphLaunch'):g}",
                          counts.per_iteration("cuGraphLaunch") == 1))
    rows.append(Criterion("other driver calls", "none", ", ".join(others) or "none", not others))
    rows.extend(lint_step_graph(step))
    return rows, counts
