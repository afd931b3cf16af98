"""Per-step metrics in mapped host memory: written by kernels, read with no copy and no sync."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..memory import MappedBuffer
from ..stream import Event

__all__ = ["Metrics", "StepMetrics"]


@dataclass(frozen=True)
class StepMetrics:
    step: int
    loss: float
    grad_norm: float
    clip_scale: float


class Metrics:
    """A ring of K slots in a MappedBuffer, one per step: {loss, grad norm, clip scale, step}.

    The optimizer's norm kernel writes slot ``t mod K`` for step ``t`` and
    stores ``t`` last. The host calls :meth:`record` after queuing each step;
    :meth:`poll` returns the steps finished since the last poll, in order,
    deciding with a non-blocking ``Event.query()`` per step. It never
    synchronises, never copies, and never returns a slot still being written.
    Steps that fell out of the ring before a poll (more than K queued) are
    counted in ``missed``.
    """

    def __init__(self, slots: int = 1024):
        if slots < 2:
            raise ValueError(f"a metrics ring needs at least 2 slots, got {slots}")
        self.slots = int(slots)
        self.ring = MappedBuffer((self.slots, 4), np.float32)
        self._values = self.ring.view()
        self._values[:] = 0.0
        self._steps = self._values.view(np.int32)[:, 3]
        self._events = [Event() for _ in range(self.slots)]
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
            elif int(self._steps[slot]) != step:
                self.missed += 1  # a step recorded without an optimizer step behind it
            else:
                loss, norm, scale = (float(v) for v in self._values[slot, :3])
                out.append(StepMetrics(step, loss, norm, scale))
            self.polled = step
        return out

    def close(self) -> None:
        for e in self._events:
            e.close()
        self.ring.close()
