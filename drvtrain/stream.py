"""Streams, events and the fork/join helpers that tie streams together."""
from __future__ import annotations

from cuda.bindings import driver as cu

from .driver import Closable, check, get_device, guard_sync, raise_status, release, release_on_collect

__all__ = ["Stream", "Event", "fork", "join"]


class Event(Closable):
    """A CUDA event; without timing unless asked, since timing costs a little."""

    def __init__(self, timing: bool = False):
        get_device()
        self.timing = timing
        flags = cu.CUevent_flags.CU_EVENT_DEFAULT if timing else cu.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self.handle = check(cu.cuEventCreate, flags)
        self._finalizer = release_on_collect(self, release, cu.cuEventDestroy, self.handle)

    def record(self, stream: "Stream") -> "Event":
        check(cu.cuEventRecord, self.handle, stream.handle)
        return self

    def query(self) -> bool:
        """True when the recorded work has finished. Never blocks."""
        status, = cu.cuEventQuery(self.handle)
        if status == cu.CUresult.CUDA_SUCCESS:
            return True
        if status == cu.CUresult.CUDA_ERROR_NOT_READY:
            return False
        raise_status("cuEventQuery", status)

    def synchronize(self) -> None:
        guard_sync("Event.synchronize")
        check(cu.cuEventSynchronize, self.handle)

    def elapsed_ms(self, end: "Event") -> float:
        """Milliseconds from this event to ``end``; both need ``timing=True``."""
        if not (self.timing and end.timing):
            raise ValueError("elapsed_ms needs two events created with timing=True")
        return float(check(cu.cuEventElapsedTime, self.handle, end.handle))

    def close(self) -> None:
        self._finalizer()


class Stream(Closable):
    """A ``CU_STREAM_NON_BLOCKING`` stream; the legacy stream is never used.

    A non-blocking stream does not synchronise with the legacy stream, so a
    stray legacy-stream call elsewhere can neither stall nor join a capture.
    """

    def __init__(self, priority: int = 0):
        get_device()
        self.priority = priority
        self.handle = check(cu.cuStreamCreateWithPriority,
                            cu.CUstream_flags.CU_STREAM_NON_BLOCKING, priority)
        self._finalizer = release_on_collect(self, release, cu.cuStreamDestroy, self.handle)
        self._marker = None  # an event reused by fork/join

    @property
    def marker(self) -> Event:
        if self._marker is None:
            self._marker = Event()
        return self._marker

    def is_capturing(self) -> bool:
        status = check(cu.cuStreamIsCapturing, self.handle)
        return status != cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE

    def record(self, event: Event | None = None) -> Event:
        """Record ``event`` (or a new one) on this stream and return it."""
        return (event or Event()).record(self)

    def wait(self, event: Event) -> None:
        """Make later work on this stream wait for ``event``; the host does not wait."""
        check(cu.cuStreamWaitEvent, self.handle, event.handle, 0)

    def query(self) -> bool:
        """True when all work on the stream has finished. Never blocks."""
        status, = cu.cuStreamQuery(self.handle)
        if status == cu.CUresult.CUDA_ERROR_NOT_READY:
            return False
        if status:
            raise_status("cuStreamQuery", status)
        return True

    def synchronize(self) -> None:
        guard_sync("Stream.synchronize")
        check(cu.cuStreamSynchronize, self.handle)

    def close(self) -> None:
        if self._marker is not None:
            self._marker.close()
        self._finalizer()

    def __repr__(self) -> str:
        return f"<Stream {int(self.handle):#x} priority {self.priority}>"


def fork(parent: Stream, *children: Stream) -> None:
    """Make work queued next on each child wait for what ``parent`` has queued so far.

    Inside a capture this pulls the children into the parent's graph.
    """
    event = parent.marker.record(parent)
    for child in children:
        child.wait(event)


def join(parent: Stream, *children: Stream) -> None:
    """Make later work on ``parent`` wait for everything queued on the children."""
    for child in children:
        parent.wait(child.marker.record(child))
