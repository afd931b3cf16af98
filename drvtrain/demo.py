"""Small end-to-end programs over the library: the doctor's self-checks and the graph demo.

Each returns what it found, so the CLI, the tools and the tests share them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .driver import Closable
from .graph import Graph, capture
from .kernel import builtin_module
from .memory import Arena, DeviceBuffer, MappedBuffer, close_attributes, closes_on_failure
from .stream import Event, Stream, fork, join

__all__ = ["ForkJoinDemo", "mapped_readback", "wait_for", "arena_check"]

BLOCK = 256


def _grid(n: int) -> int:
    return min((n + BLOCK - 1) // BLOCK, 4096)


def wait_for(event: Event, timeout_s: float = 10.0) -> None:
    """Poll ``event.query()`` (never blocking) until it reports done."""
    deadline = time.perf_counter() + timeout_s
    while not event.query():
        if time.perf_counter() > deadline:
            raise TimeoutError(f"event not reached after {timeout_s} s")
        time.sleep(0)


class ForkJoinDemo(Closable):
    """``out = 2x + 3x`` with the two products on two streams forked from and joined to a main one.

    Captured as one graph: iota on the main stream, the two scales on side
    streams (concurrent branches), the add after the join.
    """

    @closes_on_failure
    def __init__(self, n: int = 1 << 16):
        self.n = n
        mod = builtin_module("elementwise.cu")
        self.iota = mod.kernel("iota_f32", "ptr, f32, f32, i32")
        self.scale = mod.kernel("scale_f32", "ptr, ptr, f32, i32")
        self.add = mod.kernel("add_f32", "ptr, ptr, ptr, i32")
        self.main = Stream()  # one at a time: a failed one leaves the others to close
        self.left = Stream()
        self.right = Stream()
        self.arena = Arena(4 * n * 4)
        self.out = DeviceBuffer(n, np.float32)
        self.start = 0.0

    def record(self) -> Graph:
        """Capture one step into a graph; the arena is reset first so addresses repeat."""
        n, g = self.n, _grid(self.n)
        self.arena.reset()
        with capture(self.main) as graph:
            x = self.arena.array(n)
            a = self.arena.array(n)
            b = self.arena.array(n)
            self.iota.launch(g, BLOCK, x, self.start, 1.0, n, stream=self.main)
            fork(self.main, self.left, self.right)
            self.scale.launch(g, BLOCK, a, x, 2.0, n, stream=self.left)
            self.scale.launch(g, BLOCK, b, x, 3.0, n, stream=self.right)
            join(self.main, self.left, self.right)
            self.add.launch(g, BLOCK, self.out, a, b, n, stream=self.main)
        return graph

    def expected(self) -> np.ndarray:
        return 5.0 * (self.start + np.arange(self.n, dtype=np.float64))

    def scale_nodes(self, graph: Graph):
        """The two kernel nodes of the side branches."""
        return [k.node for k in graph.kernel_nodes() if k.function == "scale_f32"]

    def close(self) -> None:
        """Give back the streams and buffers now (also what a failed ``__init__`` had made)."""
        close_attributes(self, "main", "left", "right", "arena", "out")


def mapped_readback(n: int = 4096) -> np.ndarray:
    """A kernel writes 0..n-1 into mapped host memory; read on the host after Event.query()."""
    iota = builtin_module("elementwise.cu").kernel("iota_f32", "ptr, f32, f32, i32")
    stream, done = Stream(), Event()
    mapped = MappedBuffer(n, np.float32)
    view = mapped.view()
    view[:] = np.nan
    iota.launch(_grid(n), BLOCK, mapped, 0.0, 1.0, n, stream=stream)
    done.record(stream)
    wait_for(done)
    got = view.copy()
    mapped.close()
    stream.close()
    done.close()
    return got


@dataclass
class ArenaReport:
    first: list[int]
    second: list[int]
    high_water: int
    aligned: bool


def arena_check() -> ArenaReport:
    """Three allocations, a reset, the same three again: addresses repeat and are aligned."""
    arena = Arena(1 << 16)
    try:
        sizes = (100, 1000, 3)
        first = [arena.alloc(s).ptr for s in sizes]
        arena.reset()
        second = [arena.alloc(s).ptr for s in sizes]
        return ArenaReport(first, second, arena.high_water, all(p % 256 == 0 for p in first))
    finally:
        arena.close()
