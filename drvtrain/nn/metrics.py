"""Per-step metrics in mapped host memory: written by kernels, read with no copy and no sync."""
from __future__ import annotations

import numpy as np

from ..driver import Closable
from ..memory import MappedBuffer, close_attributes, closes_on_failure
from ..stream import Event

__all__ = ["Metrics", "StepMetrics", "split_words"]


def split_words(words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Metrics words (uint64) as (tags, values): the high halves as uint32 steps
    and the low halves as float32 fields."""
    words = np.asarray(words, np.uint64)
    return (words >> np.uint64(32)).astype(np.uint32), (words & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(
        np.float32)


class StepMetrics:
    """One step's metrics: ``step`` and one float attribute per field of the ring."""

    __slots__ = ("step", "values")

    def __init__(self, step: int, values: dict):
        self.step = step
        self.values = values

    def __getattr__(self, name: str) -> float:
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(f"no metric {name!r}; this ring has {sorted(self.values)}") from None

    def __eq__(self, other) -> bool:
        return isinstance(other, StepMetrics) and (self.step, self.values) == (other.step, other.values)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v:.6g}" for k, v in self.values.items())
        return f"StepMetrics(step={self.step}, {fields})"


class Metrics(Closable):
    """A ring of K slots in a MappedBuffer, one per step, one 8-byte word per field.

    Default fields {loss, grad norm, clip scale}: the optimizer's norm kernel
    writes slot ``t mod K`` for step ``t``. Each word holds a field's float32
    bits in its low half and the step's low 32 bits (its tag) in its high half,
    written by one store the host sees whole, so a slot whose every tag is the
    step is complete, in whatever order its words arrived (``dt_metric_store``
    in ``kernels/common.cuh``; no fence on the device). The host calls
    :meth:`record` after queuing each step; :meth:`poll` returns the steps
    finished since the last poll, in order, deciding with a non-blocking
    ``Event.query()`` per step. It never synchronises, never copies, and never
    returns a slot with a word of another step. Steps that fell out of the ring
    before a poll (more than K queued), or whose slot no kernel wrote, are
    counted in ``missed``.
    """

    @closes_on_failure
    def __init__(self, slots: int = 1024, fields=("loss", "grad_norm", "clip_scale")):
        if slots < 2:
            raise ValueError(f"a metrics ring needs at least 2 slots, got {slots}")
        self.fields = tuple(fields)
        if not self.fields or len(set(self.fields)) != len(self.fields):
            raise ValueError(f"metrics fields must be distinct names, got {fields}")
        self.slots = int(slots)
        self.width = len(self.fields)  # 8-byte words a slot
        self.ring = MappedBuffer((self.slots, self.width), np.uint64)
        self._words = self.ring.view()
        self._words[:] = 0  # tag 0: no step has written a slot yet (steps count from 1)
        self._events = []
        for _ in range(self.slots):
            self._events.append(Event())
        self.recorded = 0
        self.polled = 0
        self.missed = 0

    @property
    def in_flight(self) -> int:
        """Steps recorded but not yet polled. Keep it below ``slots``: a step that
        falls more than ``slots`` behind loses its slot to a newer one."""
        return self.recorded - self.polled

    @property
    def ptr(self) -> int:
        """The ring's device address, for the kernel that writes it."""
        return self.ring.ptr

    def read_slot(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Slot ``index`` as it is now: the tags (uint32, one per field) and the
        values (float32). Each word is read once, on its own, with one aligned
        8-byte load; the device writes it with one aligned 8-byte store, which
        reaches host memory as one write (a bus write of an aligned 8 bytes is
        not split), so a word's tag and value always belong together."""
        row = self._words[index % self.slots]
        return split_words(np.array([row[f] for f in range(self.width)], np.uint64))

    def record(self, stream) -> None:
        """Mark the end of the step just queued on ``stream``."""
        self.recorded += 1
        self._events[self.recorded % self.slots].record(stream)

    def poll(self) -> list[StepMetrics]:
        out = []
        while self.polled < self.recorded:
            step = self.polled + 1
            slot = step % self.slots
            if self.recorded - step >= self.slots:  # its slot and event were reused
                self.missed += 1
            elif not self._events[slot].query():
                break
            else:
                tags, values = self.read_slot(slot)
                if np.any(tags != np.uint32(step & 0xFFFFFFFF)):
                    self.missed += 1  # no optimizer step wrote it, or a newer step is writing it
                else:
                    out.append(StepMetrics(step, dict(zip(self.fields, values.tolist()))))
            self.polled = step
        return out

    def close(self) -> None:
        for e in getattr(self, "_events", ()):
            e.close()
        close_attributes(self, "ring")
