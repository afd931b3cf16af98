"""The prioritized-replay sum tree, resident on the device.

Every operation is a kernel launch on a stream, legal inside a capture, with
nothing read back: ``update``, ``sample``, ``rebuild``; ``total()`` and
``max_priority()`` are device views for other kernels to read. The layout and
the choice of fp64 internal sums are explained in ``kernels/sumtree.cuh``.

Errors the device finds (an index out of range, a NaN or negative priority,
sampling an empty tree) cannot raise there. They raise flags
(:class:`drvtrain.flags.ErrorFlags`), which :meth:`SumTree.check_errors`
reads on the host without any copy or synchronisation and raises as
:class:`ReplayError`.
"""
from __future__ import annotations

import secrets

import numpy as np

from ..driver import Closable
from ..flags import ErrorFlags
from ..kernel import builtin_module
from ..memory import DeviceBuffer, close_attributes, closes_on_failure
from ..stream import Stream, fork

__all__ = ["SumTree", "ReplayError", "beta_schedule", "tree_levels"]

# sumtree_update's largest block (kernels/sumtree.cu).
UPDATE_THREADS = 512

# In the order of DT_ERR_INDEX, DT_ERR_PRIORITY, DT_ERR_EMPTY (kernels/sumtree.cuh).
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


def _device_array(value, dtype, name: str, n: int | None = None,
                  accepted: str = "a DeviceBuffer") -> DeviceBuffer:
    """``value`` checked as a device array of ``dtype`` with at least ``n`` elements.

    ``accepted`` names everything the caller takes, for the message.
    """
    if not isinstance(value, DeviceBuffer):
        raise TypeError(f"{name} must be {accepted}, got {type(value).__name__}")
    if value.dtype != np.dtype(dtype):
        raise TypeError(f"{name} must hold {np.dtype(dtype)}, got {value.dtype}")
    if n is not None and value.size < n:
        raise ValueError(f"{name} holds {value.size} elements, {n} needed")
    return value


def beta_schedule(beta) -> tuple[float, float, int]:
    """``(start, end, steps)`` from a constant ``beta`` or a ``(start, end, steps)`` tuple, validated.

    The sampler uses ``start + (end - start) * min(1, step / steps)``, with
    ``step`` the number of sample launches before it; a constant is
    ``(beta, beta, 1)``.
    """
    if isinstance(beta, tuple):
        if len(beta) != 3:
            raise ValueError(f"beta as a tuple must be (start, end, steps), got {beta!r}")
        start, end, steps = beta
        names = ("beta start", "beta end")
        if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)):
            raise TypeError(f"beta steps must be an integer, got {steps!r}")
        if not 1 <= steps < 2**64:
            raise ValueError(f"beta steps must be in [1, 2**64), got {steps}")
    else:
        start = end = beta
        steps = 1
        names = ("beta", "beta")
    values = []
    for name, v in zip(names, (start, end)):
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
            raise TypeError(f"{name} must be a number (or beta a (start, end, steps) tuple), got {v!r}")
        if not 0.0 <= v <= 1.0:  # NaN fails too
            raise ValueError(f"{name} must be in [0, 1], got {v}")
        values.append(float(v))
    return values[0], values[1], int(steps)


class SumTree(Closable):
    """A sum tree over ``capacity`` leaves holding ``priority ** alpha``.

    Every launch that writes leaves (``update``, a replay's insert, the trainer's
    acting kernel) ends by writing the sums above them, recomputed from their
    children, and ``rebuild`` writes every sum: two such launches must not run at
    the same time (queue them on one stream, or join the streams between them), or
    one may write sums of leaves the other has since changed. A draw may run beside
    none of them either."""

    @closes_on_failure
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
        # (u32 each), the largest leaf value written so far (f32), and the beta a
        # split draw's first launch hands to its second (f32).
        state = np.zeros(6, np.uint32)
        state[4] = np.float32(initial_priority ** self.alpha).view(np.uint32)
        self._state = DeviceBuffer.from_numpy(state)
        self.step = self._state.view(np.uint64, (1,), 0)
        self._sample_counter = self._state.view(np.uint32, (1,), 8)
        self._rebuild_counter = self._state.view(np.uint32, (1,), 12)
        self._max_leaf = self._state.view(np.float32, (1,), 16)
        self._split_beta = self._state.view(np.float32, (1,), 20)
        # A split draw's leaf values, between its two launches.
        self._drawn = DeviceBuffer(self.max_batch, np.float32)
        self.flags = ErrorFlags(_FLAGS)
        mod = builtin_module("sumtree.cu")
        # update runs on any block that is a multiple of 32 up to UPDATE_THREADS; rebuild
        # and sample are written for one block size each, read from the CUBIN.
        self._update = mod.kernel("sumtree_update", "ptr ptr ptr ptr ptr f32 i32 i32 i32 i32 ptr ptr ptr ptr")
        # The update's last-block counter, apart from the draw's and the rebuild's.
        self._update_counter = DeviceBuffer.from_numpy(np.zeros(1, np.uint32))
        self._rebuild = mod.kernel("sumtree_rebuild", "ptr ptr i32 i32 i32 ptr", fixed_block=True)
        self._sample = mod.kernel("sumtree_sample",
                                  "ptr ptr i32 i32 i32 u64 ptr ptr f32 f32 u64 ptr ptr ptr ptr ptr ptr "
                                  "ptr ptr ptr ptr ptr i32 ptr ptr ptr ptr ptr ptr", fixed_block=True)
        self._weights = mod.kernel("sumtree_weights", "ptr i32 ptr ptr ptr ptr ptr", fixed_block=True)

    # -------------------------------------------------------------- device views
    def total(self) -> DeviceBuffer:
        """The sum of all leaves, as a one-element fp64 device view (the root)."""
        return self.nodes.view(np.float64, (1,), 0)

    def max_priority(self) -> DeviceBuffer:
        """The largest leaf value ever written, as a one-element fp32 device view."""
        return self._max_leaf

    # -------------------------------------------------------------- operations
    def update(self, indices, priorities, *, stream, n: int | None = None,
               skip: DeviceBuffer | None = None) -> None:
        """Set ``leaf[indices[t]] = priorities[t] ** alpha`` for ``t < n``; duplicates are legal
        (the leaf ends as one of the values written to it). Every sum above a written leaf
        is then recomputed from its children in the fixed order ``rebuild`` uses, by the
        launch's last block to finish its share of the leaves.

        Device buffers (int32 and float32) queue one launch. Two numpy arrays
        are validated first (nothing changes on bad input), uploaded, and the
        call waits for the update: a setup and test convenience. ``skip``, an
        int32 device buffer of one element, makes the launch change nothing
        when it holds a non-zero value at the time the kernel runs.
        """
        if skip is not None:
            _device_array(skip, np.int32, "skip", 1, "a DeviceBuffer or None")
        if isinstance(indices, np.ndarray) or isinstance(priorities, np.ndarray):
            if isinstance(indices, DeviceBuffer) or isinstance(priorities, DeviceBuffer):
                raise TypeError(f"indices and priorities must both be numpy arrays or both DeviceBuffers, "
                                f"got {type(indices).__name__} and {type(priorities).__name__}")
            if n is not None:
                raise ValueError("n applies to DeviceBuffers only; slice the numpy arrays instead")
            idx, pri = self._validate_host(indices, priorities)
            if idx.size == 0:
                return  # as the device path: nothing to set
            # The uploads are freed once the update has run, not when a launch lets go of them.
            with DeviceBuffer.from_numpy(idx) as d_idx, DeviceBuffer.from_numpy(pri) as d_pri:
                self.update(d_idx, d_pri, stream=stream, skip=skip)
                stream.synchronize()
            return
        indices_ok = "a DeviceBuffer, or a numpy array when priorities is one too"
        priorities_ok = "a DeviceBuffer, or a numpy array when indices is one too"
        _device_array(indices, np.int32, "indices", None, indices_ok)
        n = indices.size if n is None else int(n)
        if n < 0:
            raise ValueError(f"n must be non-negative, got {n}")
        _device_array(indices, np.int32, "indices", n, indices_ok)
        _device_array(priorities, np.float32, "priorities", n, priorities_ok)
        if n == 0:
            return
        # Blocks of about n threads (the last one refreshes the sums a thread a node), at
        # least two, each writing its share of the leaves: no step runs a one-block kernel
        # (the step's audit).
        block = min(UPDATE_THREADS, _round32(n))
        grid = max(2, min(-(-n // block), 4096))
        self._update.launch(grid, block, self.nodes, self.leaves, self._max_leaf, indices, priorities,
                            self.alpha, n, self.capacity, self.height, self.internal,
                            skip if skip is not None else 0, self.flags.counts, self.flags.published,
                            self._update_counter, stream=stream)

    def update_operands(self, indices: DeviceBuffer, priorities: DeviceBuffer) -> tuple:
        """The arguments of an update of every element of ``indices`` (int32) and
        ``priorities`` (float32), device buffers of one size, for kernels that run
        the update as a phase of their own: ``dt_tree_update`` (sumtree.cuh) writes the
        leaves, then, once every block's leaves are visible (a grid barrier), one block
        must call ``dt_tree_refresh`` over the same indices, or the sums keep the old
        leaves' values (``dqn_step.cu``'s cooperative tail does both). The tuple:
        (nodes, leaves, max_leaf, indices, priorities, alpha, n, capacity, height,
        internal, error counts, error published)."""
        what = "a DeviceBuffer"
        _device_array(indices, np.int32, "indices", None, what)
        _device_array(priorities, np.float32, "priorities", indices.size, what)
        return (self.nodes, self.leaves, self._max_leaf, indices, priorities, self.alpha, indices.size,
                self.capacity, self.height, self.internal, self.flags.counts, self.flags.published)

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

    def rebuild(self, *, stream) -> None:
        """Recompute every internal node from the leaves, bit-reproducibly, in one launch."""
        level1_nodes = self.levels[-1][1]
        block = self._rebuild.block
        self._rebuild.launch(-(-level1_nodes // (block // 32)), block, self.nodes, self.leaves, self.capacity,
                             self.height, self.internal, self._rebuild_counter, stream=stream)

    def sample(self, batch: int, *, stream, beta, indices: DeviceBuffer, weights: DeviceBuffer,
               uniforms: DeviceBuffer | None = None, gather=None,
               beta_out: DeviceBuffer | None = None, gate: DeviceBuffer | None = None,
               weights_stream=None) -> None:
        """Draw a stratified batch into ``indices`` (int32) and IS ``weights`` (float32).

        ``beta`` is a constant in [0, 1] or a schedule ``(start, end, steps)``
        that the device evaluates at ``step``, the sample launches before this
        one: ``start + (end - start) * min(1, step / steps)``, so a replayed
        graph anneals beta with no host involvement. ``beta_out`` (float32, one
        element) receives the beta used. ``uniforms`` (float64, one per
        sample) replaces the Philox draws, for tests. ``gather`` is
        ``(storage, batch)`` from the replay buffer, which copies the sampled
        transitions in the same launch. ``gate`` (int32, one element): while
        non-zero the launch draws nothing and writes nothing, not even ``step``.

        The weights need the batch's smallest drawn leaf. By default one
        launch draws, gathers and then, in its last block, writes the weights.
        With ``weights_stream`` (a stream, which may be ``stream`` itself) the
        draw takes two launches: the draw and the gather on ``stream``, then,
        forked from it, the weights, ``beta_out`` and the advance of ``step``
        on ``weights_stream``. Work queued next on ``stream`` that reads only
        the indices or the gathered rows then waits for no last block. Join
        ``weights_stream`` into every stream that reads the weights,
        ``beta_out`` or ``step``, and before the tree samples again. The bits
        are the same either way.
        """
        if not 1 <= batch <= self.max_batch:
            raise ValueError(f"batch must be in [1, {self.max_batch}], got {batch}")
        beta_start, beta_end, beta_steps = beta_schedule(beta)
        _device_array(indices, np.int32, "indices", batch)
        _device_array(weights, np.float32, "weights", batch)
        if uniforms is not None:
            _device_array(uniforms, np.float64, "uniforms", batch, "a DeviceBuffer or None")
        if beta_out is not None:
            _device_array(beta_out, np.float32, "beta_out", 1, "a DeviceBuffer or None")
        rows = gather if gather is not None else (0,) * 11
        gate_ptr = gate if gate is not None else 0
        beta_ptr = beta_out if beta_out is not None else 0
        split = weights_stream is not None
        if split and not isinstance(weights_stream, Stream):  # checked before the draw launches
            raise TypeError(f"weights_stream must be a Stream or None, got {type(weights_stream).__name__}")
        block = self._sample.block
        # A split draw's first launch leaves the leaf values and beta to its second
        # (no counter: no last block, and no staging in shared memory).
        self._sample.launch(-(-batch // (block // 32)), block,
                            self.nodes, self.leaves, self.capacity, self.height, batch, self.seed, self.step,
                            uniforms if uniforms is not None else 0, beta_start, beta_end, beta_steps,
                            self._split_beta if split else beta_ptr, indices, self._drawn if split else weights,
                            0 if split else self._sample_counter, self.flags.counts, self.flags.published, *rows,
                            gate_ptr, stream=stream, shared_mem=0 if split else 4 * batch)
        if split:
            if weights_stream is not stream:
                fork(stream, weights_stream)
            # An ordinary launch on a forked stream: a second programmatic dependent of
            # one kernel has measured slower (docs/perf-notes.md, nineteenth pass).
            block = self._weights.block
            self._weights.launch(-(-batch // block), block, self._drawn, batch, self._split_beta, self.step,
                                 beta_ptr, weights, gate_ptr, stream=weights_stream,
                                 dependent=False if weights_stream is not stream else None)

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
        stream = Stream()
        self.rebuild(stream=stream)
        stream.synchronize()
        stream.close()

    def check_errors(self) -> None:
        """Raise ReplayError naming every flag the device raised since the last check.

        Reads mapped memory: no copy, no synchronisation, and nothing is
        cleared, so a flag the device raises during the check shows at the
        next one. Flags from work still running appear at a later check.
        """
        raised = self.flags.raised()
        if raised:
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
        close_attributes(self, "nodes", "leaves", "_state", "_update_counter", "_drawn", "flags")
