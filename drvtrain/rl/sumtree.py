"""The prioritized-replay sum tree, resident on the device.

Every operation is a kernel launch on a stream, legal inside a capture, with
nothing read back: ``update``, ``sample``, ``rebuild``; ``total()`` and
``max_priority()`` are device views for other kernels to read. The layout and
the choice of fp64 internal sums are explained in ``kernels/sumtree.cuh``.

Errors the device finds (an index out of range, a NaN or negative priority,
sampling an empty tree) cannot raise there. They set flags in mapped host
memory, which :meth:`SumTree.check_errors` reads on the host without any
copy or synchronisation and raises as :class:`ReplayError`.
"""
from __future__ import annotations

import secrets

import numpy as np

from ..kernel import builtin_module
from ..memory import DeviceBuffer, MappedBuffer

__all__ = ["SumTree", "ReplayError", "SAMPLES_PER_BLOCK", "tree_levels"]

SAMPLES_PER_BLOCK = 4  # one warp per sample, 4 warps per block
_FLAGS = ("index out of range", "negative, NaN or infinite priority", "sampled an empty tree")


def _round32(n: int) -> int:
    return (n + 31) // 32 * 32


def tree_levels(capacity: int) -> list[tuple[int, int, int]]:
    """(offset in nodes, real nodes, padded size) of each internal level, root first.

    The device computes the same layout (kernels/sumtree.cuh): level h holds
    ceil(capacity / 32^h) nodes padded to a multiple of 32, root level first.
    """
    real = []
    n = capacity
    while True:
        n = -(-n // 32)
        real.append(n)
        if n == 1:
            break
    levels, offset = [], 0
    for count in reversed(real):
        levels.append((offset, count, _round32(count)))
        offset += _round32(count)
    return levels


class ReplayError(RuntimeError):
    """The device flagged bad input since the last check."""


def _device_array(value, dtype, name: str, n: int | None = None) -> DeviceBuffer:
    if not isinstance(value, DeviceBuffer):
        raise TypeError(f"{name} must be a DeviceBuffer or a numpy array, got {type(value).__name__}")
    if value.dtype != np.dtype(dtype):
        raise TypeError(f"{name} must hold {np.dtype(dtype)}, got {value.dtype}")
    if n is not None and value.size < n:
        raise ValueError(f"{name} holds {value.size} elements, {n} needed")
    return value


class SumTree:
    """A sum tree over ``capacity`` leaves holding ``priority ** alpha``."""

    def __init__(self, capacity: int, *, alpha: float = 0.6, seed: int | None = None,
                 max_batch: int = 4096, initial_priority: float = 1.0):
        if int(capacity) < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        if not (np.isfinite(initial_priority) and initial_priority > 0):
            raise ValueError(f"initial_priority must be positive and finite, got {initial_priority}")
        self.capacity = int(capacity)
        self.alpha = float(alpha)
        self.seed = secrets.randbits(64) if seed is None else int(seed) & (2**64 - 1)
        if not 1 <= int(max_batch) <= 32768:
            raise ValueError(f"max_batch must be in [1, 32768] (the sampler stages a batch in shared "
                             f"memory), got {max_batch}")
        self.max_batch = int(max_batch)
        self.levels = tree_levels(self.capacity)
        self.height = len(self.levels)
        self.internal = sum(size for _, _, size in self.levels)
        self.nodes = DeviceBuffer.from_numpy(np.zeros(self.internal, np.float64))
        self.leaves = DeviceBuffer.from_numpy(np.zeros(_round32(self.capacity), np.float32))
        # Device state: the RNG step (u64), the sample and rebuild launch counters
        # (u32 each), the largest leaf value written so far (f32).
        state = np.zeros(6, np.uint32)
        state[4] = np.float32(initial_priority ** self.alpha).view(np.uint32)
        self._state = DeviceBuffer.from_numpy(state)
        self.step = self._state.view(np.uint64, (1,), 0)
        self._sample_counter = self._state.view(np.uint32, (1,), 8)
        self._rebuild_counter = self._state.view(np.uint32, (1,), 12)
        self._max_leaf = self._state.view(np.float32, (1,), 16)
        self.errors = MappedBuffer(4, np.int32)
        self.errors.view()[:] = 0
        mod = builtin_module("sumtree.cu")
        self._update = mod.kernel("sumtree_update", "ptr ptr ptr ptr ptr f32 i32 i32 i32 i32 ptr")
        self._rebuild = mod.kernel("sumtree_rebuild", "ptr ptr i32 i32 i32 ptr")
        self._sample = mod.kernel("sumtree_sample", "ptr ptr i32 i32 i32 u64 ptr ptr f32 ptr ptr ptr ptr "
                                                    "ptr ptr ptr ptr ptr i32 ptr ptr ptr ptr ptr")

    # -------------------------------------------------------------- device views
    def total(self) -> DeviceBuffer:
        """The sum of all leaves, as a one-element fp64 device view (the root)."""
        return self.nodes.view(np.float64, (1,), 0)

    def max_priority(self) -> DeviceBuffer:
        """The largest leaf value ever written, as a one-element fp32 device view."""
        return self._max_leaf

    # -------------------------------------------------------------- operations
    def update(self, indices, priorities, stream, n: int | None = None) -> None:
        """Set ``leaf[indices[t]] = priorities[t] ** alpha``; duplicates are legal.

        Device buffers (int32 and float32) queue one launch. Host arrays are
        validated first (nothing changes on bad input), uploaded, and the
        call waits for the update: a setup and test convenience.
        """
        if isinstance(indices, np.ndarray) or isinstance(priorities, np.ndarray):
            idx, pri = self._validate_host(indices, priorities)
            d_idx, d_pri = DeviceBuffer.from_numpy(idx), DeviceBuffer.from_numpy(pri)
            self.update(d_idx, d_pri, stream)
            stream.synchronize()
            return
        n = indices.size if n is None else int(n)
        _device_array(indices, np.int32, "indices", n)
        _device_array(priorities, np.float32, "priorities", n)
        if n == 0:
            return
        # Small blocks, so even a batch of 128 spreads over several SMs.
        grid = min(-(-n // 64), 4096)
        self._update.launch(grid, 64, self.nodes, self.leaves, self._max_leaf, indices, priorities,
                            self.alpha, n, self.capacity, self.height, self.internal, self.errors,
                            stream=stream)

    def _validate_host(self, indices, priorities) -> tuple[np.ndarray, np.ndarray]:
        indices, priorities = np.asarray(indices), np.asarray(priorities)
        if indices.ndim != 1 or priorities.shape != indices.shape:
            raise ValueError(f"indices and priorities must be 1-D of one length, got "
                             f"{indices.shape} and {priorities.shape}")
        if indices.dtype.kind not in "iu":
            raise TypeError(f"indices must be integers, got {indices.dtype}")
        if priorities.dtype.kind not in "fiu":
            raise TypeError(f"priorities must be real numbers, got {priorities.dtype}")
        if indices.size and (indices.min() < 0 or indices.max() >= self.capacity):
            raise IndexError(f"indices must lie in [0, {self.capacity}), got "
                             f"[{indices.min()}, {indices.max()}]")
        pri = priorities.astype(np.float32)
        if not np.all(np.isfinite(pri)) or (pri < 0).any():
            raise ValueError("priorities must be finite and non-negative (NaN, inf or a negative value given)")
        return np.ascontiguousarray(indices, np.int32), np.ascontiguousarray(pri)

    def rebuild(self, stream) -> None:
        """Recompute every internal node from the leaves, bit-reproducibly, in one launch."""
        level1_nodes = self.levels[-1][1]
        self._rebuild.launch(-(-level1_nodes // 32), 1024, self.nodes, self.leaves, self.capacity,
                             self.height, self.internal, self._rebuild_counter, stream=stream)

    def sample(self, batch: int, stream, *, beta: float, indices: DeviceBuffer, weights: DeviceBuffer,
               uniforms: DeviceBuffer | None = None, gather=None) -> None:
        """Draw a stratified batch into ``indices`` (int32) and IS ``weights`` (float32).

        ``uniforms`` (float64, one per sample) replaces the Philox draws, for
        tests. ``gather`` is ``(storage, batch)`` from the replay buffer,
        which copies the sampled transitions in the same launch.
        """
        if not 1 <= batch <= self.max_batch:
            raise ValueError(f"batch must be in [1, {self.max_batch}], got {batch}")
        _device_array(indices, np.int32, "indices", batch)
        _device_array(weights, np.float32, "weights", batch)
        if uniforms is not None:
            _device_array(uniforms, np.float64, "uniforms", batch)
        rows = gather if gather is not None else (0,) * 11
        self._sample.launch(-(-batch // SAMPLES_PER_BLOCK), 32 * SAMPLES_PER_BLOCK,
                            self.nodes, self.leaves, self.capacity, self.height, batch, self.seed, self.step,
                            uniforms if uniforms is not None else 0, float(beta), indices, weights,
                            self._sample_counter, self.errors, *rows, stream=stream, shared_mem=4 * batch)

    # -------------------------------------------------------------- host side
    def set_priorities(self, priorities) -> None:
        """Setup: every leaf from a host array of ``capacity`` priorities, then an exact rebuild."""
        pri = np.asarray(priorities)
        if pri.shape != (self.capacity,):
            raise ValueError(f"expected {self.capacity} priorities, got shape {pri.shape}")
        _, pri = self._validate_host(np.arange(self.capacity), pri)
        leaves = np.zeros(self.leaves.size, np.float32)
        leaves[: self.capacity] = pri.astype(np.float64) ** self.alpha
        self.leaves.copy_from_numpy(leaves)
        largest = max(self._max_leaf.to_numpy()[0], leaves.max())
        self._max_leaf.copy_from_numpy(np.array([largest], np.float32))
        from ..stream import Stream
        stream = Stream()
        self.rebuild(stream)
        stream.synchronize()
        stream.close()

    def check_errors(self) -> None:
        """Raise ReplayError for any flag the device set since the last check, and clear them.

        Reads mapped memory: no copy, no synchronisation. Flags from work still
        running appear at a later check.
        """
        flags = self.errors.view()
        raised = [text for i, text in enumerate(_FLAGS) if flags[i]]
        if raised:
            flags[:] = 0
            raise ReplayError("the device reported: " + "; ".join(raised))

    def drift(self) -> tuple[float, float]:
        """(root vs exact sum of the leaves, worst node vs the sum of its children), relative.

        A synchronous host-side diagnostic: it reads the whole tree back.
        """
        import math
        leaves = self.leaves.to_numpy().astype(np.float64)
        nodes = self.nodes_numpy()
        exact = math.fsum(leaves)
        root = abs(nodes[0] - exact) / exact if exact else abs(nodes[0])
        worst, children = 0.0, leaves
        for offset, real, _ in reversed(self.levels):
            padded = np.zeros(real * 32)
            padded[: min(len(children), real * 32)] = children[: real * 32]
            sums = np.array([math.fsum(row) for row in padded.reshape(real, 32)])
            stored = nodes[offset: offset + real]
            worst = max(worst, float(np.max(np.abs(stored - sums) / np.maximum(np.abs(sums), 1e-300))))
            children = stored
        return root, worst

    def leaves_numpy(self) -> np.ndarray:
        return self.leaves.to_numpy()[: self.capacity]

    def nodes_numpy(self) -> np.ndarray:
        return self.nodes.to_numpy()

    def read_total(self) -> float:
        return float(self.total().to_numpy()[0])

    def close(self) -> None:
        for buf in (self.nodes, self.leaves, self._state, self.errors):
            buf.close()
