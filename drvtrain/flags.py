"""Error flags raised on the device and read on the host with no copy and no sync.

A kernel cannot raise. It counts flag ``k`` in device memory and publishes the
new count to mapped host memory (``dt_raise`` in ``kernels/common.cuh``). The
host never writes either array: it reports a flag whose published count went
past the largest it has seen. A flag raised while the host is reading shows at
the next read; it can be reported twice, never lost.
"""
from __future__ import annotations

import numpy as np

from .driver import Closable
from .memory import DeviceBuffer, MappedBuffer, close_attributes, closes_on_failure

__all__ = ["ErrorFlags"]


class ErrorFlags(Closable):
    """Named flags: pass ``counts`` and ``published`` to the kernels, call ``raised()`` on the host."""

    @closes_on_failure
    def __init__(self, names):
        self.names = tuple(names)
        if not self.names:
            raise ValueError("ErrorFlags needs at least one flag name")
        n = len(self.names)
        self.counts = DeviceBuffer.from_numpy(np.zeros(n, np.uint32))
        self.published = MappedBuffer(n, np.uint32)
        self.published.view()[:] = 0
        self._seen = np.zeros(n, np.uint32)

    def raised(self) -> list[str]:
        """Names of the flags raised since the last call (never blocks, never copies)."""
        now = self.published.view().copy()
        new = now > self._seen
        np.maximum(self._seen, now, out=self._seen)
        return [name for name, hit in zip(self.names, new) if hit]

    def close(self) -> None:
        close_attributes(self, "counts", "published")
