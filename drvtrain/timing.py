"""Device-side timing of replayed graphs, for the benchmarks in tools/."""
from __future__ import annotations

import statistics

from .graph import GraphExec
from .stream import Event

__all__ = ["time_graph"]


def time_graph(exe: GraphExec, stream, *, replays: int, repeats: int, warmup: int = 10) -> float:
    """Median over ``repeats`` of the device time of ``replays`` back-to-back replays,
    divided by ``replays``, in microseconds. Warm-up replays come first."""
    start, end = Event(timing=True), Event(timing=True)
    for _ in range(warmup):
        exe.launch(stream)
    samples = []
    for _ in range(repeats):
        start.record(stream)
        for _ in range(replays):
            exe.launch(stream)
        end.record(stream)
        end.synchronize()
        samples.append(start.elapsed_ms(end) * 1e3 / replays)
    start.close()
    end.close()
    return statistics.median(samples)
