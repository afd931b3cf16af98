"""Prioritized replay storage on the device: a ring of transitions over a sum tree."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np

from ..driver import Closable
from ..kernel import builtin_module
from ..memory import ALIGNMENT, Arena, DeviceBuffer, close_attributes, closes_on_failure
from .sumtree import SumTree

__all__ = ["ReplayBuffer", "Batch"]


@dataclass
class Batch:
    """A sampled batch; every field is a device buffer (arena slices from ``sample``)."""
    indices: DeviceBuffer   # int32 [B]
    weights: DeviceBuffer   # float32 [B], importance weights, batch max 1
    obs: DeviceBuffer       # float32 [B, obs_dim]
    action: DeviceBuffer    # int32 [B]
    reward: DeviceBuffer    # float32 [B]
    next_obs: DeviceBuffer  # float32 [B, obs_dim]
    done: DeviceBuffer      # float32 [B], 0 or 1


_FIELDS = (("obs", np.float32, 2), ("action", np.int32, 1), ("reward", np.float32, 1),
           ("next_obs", np.float32, 2), ("done", np.float32, 1))


def _batch_slices(batch: int, obs_dim: int):
    """(field, shape, dtype) of every arena slice one ``sample`` takes, in allocation order."""
    return (("indices", (batch,), np.int32), ("weights", (batch,), np.float32),
            ("obs", (batch, obs_dim), np.float32), ("action", (batch,), np.int32),
            ("reward", (batch,), np.float32), ("next_obs", (batch, obs_dim), np.float32),
            ("done", (batch,), np.float32))


class ReplayBuffer(Closable):
    """``capacity`` transitions in per-field device arrays, with a sum tree over their priorities.

    ``insert`` overwrites the oldest entries once full; new entries enter the
    tree with the largest leaf value seen. The insertion cursor and the
    stored count live on the device (``state``: int64 [cursor, stored]), so
    inserts replay inside a graph.
    """

    @closes_on_failure
    def __init__(self, capacity: int, obs_dim: int, *, alpha: float = 0.6, seed: int | None = None,
                 max_batch: int = 4096):
        if int(obs_dim) < 1:
            raise ValueError(f"obs_dim must be at least 1, got {obs_dim}")
        self.tree = SumTree(capacity, alpha=alpha, seed=seed, max_batch=max_batch)
        self.capacity, self.obs_dim = self.tree.capacity, int(obs_dim)
        c, d = self.capacity, self.obs_dim
        self.obs = DeviceBuffer.from_numpy(np.zeros((c, d), np.float32))
        self.next_obs = DeviceBuffer.from_numpy(np.zeros((c, d), np.float32))
        self.action = DeviceBuffer.from_numpy(np.zeros(c, np.int32))
        self.reward = DeviceBuffer.from_numpy(np.zeros(c, np.float32))
        self.done = DeviceBuffer.from_numpy(np.zeros(c, np.float32))
        self._state_owner = state = DeviceBuffer.from_numpy(np.zeros(3, np.int64))
        self.state = state.view(np.int64, (2,), 0)
        self._counter = state.view(np.uint32, (1,), 16)
        self._insert = builtin_module("replay.cu").kernel(
            "replay_insert", "ptr ptr ptr ptr ptr i32 i32 ptr ptr ptr ptr ptr i32 ptr ptr ptr ptr i32 i32 ptr",
            fixed_block=True)

    # -------------------------------------------------------------- insertion
    def insert(self, obs, action, reward, next_obs, done, *, stream) -> None:
        """Append transitions: device buffers queue one launch; host arrays are validated
        (nothing changes on bad input), uploaded, and the call waits for the insert."""
        fields = (obs, action, reward, next_obs, done)
        if any(isinstance(f, np.ndarray) for f in fields):
            host = self._validate_host(fields)
            # The uploads are freed once the insert has run, not when a launch lets go of them.
            with contextlib.ExitStack() as uploads:
                staged = [uploads.enter_context(DeviceBuffer.from_numpy(a)) for a in host]
                self.insert(*staged, stream=stream)
                stream.synchronize()
            return
        n = self._validate_device(fields)
        obs, action, reward, next_obs, done = fields
        block = self._insert.block  # one warp per transition
        self._insert.launch(-(-n // (block // 32)), block,
                            self.obs, self.next_obs, self.action, self.reward, self.done,
                            self.obs_dim, self.capacity, obs, next_obs, action, reward, done, n,
                            self.state, self.tree.nodes, self.tree.leaves, self.tree.max_priority(),
                            self.tree.height, self.tree.internal, self._counter, stream=stream)

    def _check_count(self, n: int) -> int:
        if not 1 <= n <= self.capacity:
            raise ValueError(f"insert takes 1 to {self.capacity} transitions at once, got {n}")
        return n

    def _validate_device(self, fields) -> int:
        for (name, dtype, ndim), f in zip(_FIELDS, fields):
            if not isinstance(f, DeviceBuffer):
                raise TypeError(f"{name} must be a DeviceBuffer, or every field a numpy array; "
                                f"got {type(f).__name__}")
            if f.dtype != np.dtype(dtype):
                raise TypeError(f"{name} must hold {np.dtype(dtype)}, got {f.dtype}")
        n = fields[1].size
        for (name, _, ndim), f in zip(_FIELDS, fields):
            want = (n, self.obs_dim) if ndim == 2 else (n,)
            if f.size != int(np.prod(want)):
                raise ValueError(f"{name} has {f.size} elements, expected shape {want}")
        return self._check_count(n)

    def _validate_host(self, fields) -> list[np.ndarray]:
        arrays = []
        for (name, dtype, ndim), f in zip(_FIELDS, fields):
            if not isinstance(f, np.ndarray):
                raise TypeError(f"{name}: pass all fields as numpy arrays or all as DeviceBuffers")
            arrays.append(f)
        obs, action, reward, next_obs, done = arrays
        n = self._check_count(len(action))
        for name, a in (("obs", obs), ("next_obs", next_obs)):
            if a.shape != (n, self.obs_dim):
                raise ValueError(f"{name} must have shape ({n}, {self.obs_dim}), got {a.shape}")
        for name, a in (("action", action), ("reward", reward), ("done", done)):
            if a.shape != (n,):
                raise ValueError(f"{name} must have shape ({n},), got {a.shape}")
        for name, a in (("obs", obs), ("next_obs", next_obs), ("reward", reward), ("done", done)):
            if a.dtype.kind not in "fiub":
                raise TypeError(f"{name} must be numeric, got {a.dtype}")
            if not np.all(np.isfinite(a)):
                raise ValueError(f"{name} holds NaN or infinite values")
        if action.dtype.kind not in "iu":
            raise TypeError(f"action must be integers, got {action.dtype}")
        if n and (action.min() < 0 or action.max() > np.iinfo(np.int32).max):
            raise ValueError("actions must be non-negative int32 values")
        if not np.isin(done, (0, 1)).all():
            raise ValueError("done must hold only 0 and 1")
        return [np.ascontiguousarray(obs, np.float32), np.ascontiguousarray(action, np.int32),
                np.ascontiguousarray(reward, np.float32), np.ascontiguousarray(next_obs, np.float32),
                np.ascontiguousarray(done, np.float32)]

    # -------------------------------------------------------------- sampling
    def sample(self, batch: int, *, stream, beta, arena: Arena, uniforms=None,
               beta_out: DeviceBuffer | None = None, gate: DeviceBuffer | None = None,
               weights_stream=None) -> Batch:
        """A stratified batch with IS weights, gathered into arena slices in one launch
        (the weights in a second, on ``weights_stream``, when that is given).

        ``beta``, ``uniforms``, ``beta_out``, ``gate`` and ``weights_stream`` are as in
        :meth:`SumTree.sample`;
        the slices take :meth:`scratch_bytes` of the arena.
        """
        out = Batch(**{name: arena.array(shape, dtype)
                       for name, shape, dtype in _batch_slices(batch, self.obs_dim)})
        gather = (self.obs, self.next_obs, self.action, self.reward, self.done, self.obs_dim,
                  out.obs, out.next_obs, out.action, out.reward, out.done)
        self.tree.sample(batch, stream=stream, beta=beta, indices=out.indices, weights=out.weights,
                         uniforms=uniforms, gather=gather, beta_out=beta_out, gate=gate,
                         weights_stream=weights_stream)
        return out

    def scratch_bytes(self, batch: int) -> int:
        """Arena bytes one ``sample(batch)`` takes: every slice rounded up as the arena aligns it."""
        total = 0
        for _, shape, dtype in _batch_slices(batch, self.obs_dim):
            nbytes = max(1, int(np.prod(shape))) * np.dtype(dtype).itemsize
            total += -(-nbytes // ALIGNMENT) * ALIGNMENT
        return total

    def update_priorities(self, indices, priorities, *, stream, n: int | None = None,
                          skip: DeviceBuffer | None = None) -> None:
        """Write new priorities for sampled indices (see SumTree.update)."""
        self.tree.update(indices, priorities, stream=stream, n=n, skip=skip)

    def check_errors(self) -> None:
        self.tree.check_errors()

    # -------------------------------------------------------------- host side (tests, setup)
    def stored(self) -> int:
        """Transitions stored (synchronous read; not for the hot path)."""
        return int(self.state.to_numpy()[1])

    def cursor(self) -> int:
        """Transitions ever inserted (synchronous read; not for the hot path)."""
        return int(self.state.to_numpy()[0])

    def close(self) -> None:
        close_attributes(self, "tree", "obs", "next_obs", "action", "reward", "done", "_state_owner")
