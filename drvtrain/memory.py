"""Device memory: buffers, the scratch arena, mapped and pinned host memory."""
from __future__ import annotations

import functools
import math

import numpy as np
from cuda.bindings import driver as cu

from .driver import (CaptureError, Closable, active_captures, check, get_device, guard_sync, note_on, release,
                     release_on_collect)

__all__ = ["DeviceBuffer", "Arena", "ArenaExhausted", "MappedBuffer", "PinnedBuffer", "ALIGNMENT",
           "pinned_total", "close_attributes", "closes_on_failure"]

ALIGNMENT = 256  # every arena slice and parameter view starts on this boundary


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def close_attributes(obj, *names: str) -> None:
    """Close ``obj``'s attributes ``names`` in order, each that is set and not None: the
    ``close()`` of an object whose ``__init__`` may have stopped part way (see
    :func:`closes_on_failure`). Every one is tried; the first error is raised after."""
    first = None
    for name in names:
        value = getattr(obj, name, None)
        if value is None:
            continue
        try:
            value.close()
        except Exception as exc:  # noqa: BLE001 (the rest still close; the first is raised)
            first = first or exc
    if first is not None:
        raise first


def closes_on_failure(init):
    """For an ``__init__`` that makes device resources one after another: when it
    raises, ``self.close()`` frees what it had made (a ``close`` that skips what is not
    there yet, as :func:`close_attributes` does) before the error goes on, so nothing
    waits for the garbage collector. An error from that ``close`` becomes a note on the
    first (Python 3.11 and later; before, a warning: :func:`drvtrain.driver.note_on`)."""
    @functools.wraps(init)
    def wrapper(self, *args, **kwargs):
        try:
            init(self, *args, **kwargs)
        except BaseException as exc:
            try:
                self.close()
            except Exception as inner:  # noqa: BLE001
                note_on(exc, f"closing the partly made {type(self).__name__} failed too: {inner!r}")
            raise
    return wrapper


def _shape_tuple(shape) -> tuple[int, ...]:
    shape = (int(shape),) if np.isscalar(shape) else tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"negative dimension in shape {shape}")
    return shape


# Called with each buffer that close() frees, before the free: kernel.py's argument packs
# forget a launch that named it, so the next launch of the very same objects packs them
# again and refuses the buffer, rather than replay its freed address.
_on_close: list = []


def _closed_message(buf) -> str:
    return f"DeviceBuffer {buf.shape} {buf.dtype} is closed: its memory was freed"


class DeviceBuffer(Closable):
    """Device memory with a shape and dtype: an owning ``cuMemAlloc`` or a view.

    Views (``view()``, arena slices, parameter views) keep their owner alive
    and never free anything themselves.
    """

    __slots__ = ("ptr", "shape", "dtype", "nbytes", "_owner", "_finalizer", "__weakref__")

    def __init__(self, shape, dtype=np.float32):
        shape = _shape_tuple(shape)
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes <= 0:
            raise ValueError(f"DeviceBuffer needs a positive size, got shape {shape} of {dtype}")
        get_device()
        if active_captures():
            raise CaptureError("cuMemAlloc", None, "device allocation while a stream is capturing; "
                               "allocate before the capture or take the memory from an Arena")
        ptr = int(check(cu.cuMemAlloc, nbytes))
        self._init(ptr, shape, dtype, nbytes, None)
        self._finalizer = release_on_collect(self, release, cu.cuMemFree, ptr)

    def _init(self, ptr, shape, dtype, nbytes, owner):
        self.ptr = ptr
        self.shape = shape
        self.dtype = dtype
        self.nbytes = nbytes
        self._owner = owner
        self._finalizer = None

    @classmethod
    def _view(cls, owner, ptr: int, shape, dtype) -> "DeviceBuffer":
        buf = cls.__new__(cls)
        shape = _shape_tuple(shape)
        dtype = np.dtype(dtype)
        buf._init(ptr, shape, dtype, math.prod(shape) * dtype.itemsize, owner)
        return buf

    @classmethod
    def from_cuda_array(cls, obj, *, stream=None) -> "DeviceBuffer":
        """A view of any object exposing ``__cuda_array_interface__`` (a torch or CuPy array).

        The view keeps ``obj`` alive; it must be C-contiguous. When the
        interface names the producer's stream (protocol v3), the data may
        still be being written there: with ``stream`` given, work queued next
        on ``stream`` waits for it (no host wait); without, the host waits for
        the producer's stream here.
        """
        iface = getattr(obj, "__cuda_array_interface__", None)
        if iface is None:
            raise TypeError(f"{type(obj).__name__} does not expose __cuda_array_interface__")
        shape, dtype = tuple(iface["shape"]), np.dtype(iface["typestr"])
        strides = iface.get("strides")
        if strides is not None and tuple(strides) != tuple(np.empty(shape, dtype).strides):
            raise ValueError("only C-contiguous device arrays can be viewed")
        if math.prod(shape) == 0:
            raise ValueError(f"cannot view an empty device array of shape {shape}")
        producer = iface.get("stream")
        if producer is not None:
            _wait_for_producer(int(producer), stream)
        return cls._view(obj, int(iface["data"][0]), shape, dtype)

    @classmethod
    def zeros(cls, shape, dtype=np.float32) -> "DeviceBuffer":
        """A new buffer filled with zero bytes (synchronous; setup only). A failed fill
        frees the buffer before the error goes on."""
        guard_sync("DeviceBuffer.zeros")  # before the allocation: a refusal leaves nothing to free
        buf = cls(shape, dtype)
        try:
            check(cu.cuMemsetD8, buf.ptr, 0, buf.nbytes)
            # A memset of device memory returns before it is done, and kernels on our
            # non-blocking streams would not wait for it.
            check(cu.cuCtxSynchronize)
        except BaseException:
            buf.close()
            raise
        return buf

    @classmethod
    def from_numpy(cls, array) -> "DeviceBuffer":
        """A new buffer holding a copy of a host array (setup and tests only). A failed
        copy frees the buffer before the error goes on."""
        array = _host_array(array)
        buf = cls(array.shape, array.dtype)
        try:
            buf.copy_from_numpy(array)
        except BaseException:
            buf.close()
            raise
        return buf

    # ------------------------------------------------------------ properties
    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def is_view(self) -> bool:
        return self._owner is not None

    @property
    def __cuda_array_interface__(self) -> dict:
        return {
            "shape": self.shape,
            "typestr": self.dtype.str,
            "data": (self._address(), False),
            "strides": None,
            "version": 3,
        }

    def view(self, dtype=None, shape=None, offset: int = 0) -> "DeviceBuffer":
        """A view of ``shape`` elements of ``dtype`` starting ``offset`` bytes in."""
        dtype = self.dtype if dtype is None else np.dtype(dtype)
        if shape is None:
            if (self.nbytes - offset) % dtype.itemsize:
                raise ValueError(f"{self.nbytes - offset} bytes do not hold whole {dtype} elements")
            shape = ((self.nbytes - offset) // dtype.itemsize,)
        shape = _shape_tuple(shape)
        need = math.prod(shape) * dtype.itemsize
        if offset < 0 or offset + need > self.nbytes:
            raise ValueError(f"view of {need} bytes at offset {offset} exceeds the buffer's {self.nbytes} bytes")
        ptr = self._address()
        if (ptr + offset) % dtype.alignment:
            raise ValueError(f"offset {offset} is not aligned for {dtype}")
        owner = self._owner if self._owner is not None else self  # never bool(): a torch owner raises
        return DeviceBuffer._view(owner, ptr + offset, shape, dtype)

    # ------------------------------------------------------------ copies
    def copy_from_numpy(self, array) -> None:
        """Synchronous upload of a host array of the same shape and dtype."""
        array = _host_array(array)
        if array.shape != self.shape or array.dtype != self.dtype:
            raise ValueError(f"host array {array.shape} {array.dtype} does not match "
                             f"buffer {self.shape} {self.dtype}")
        ptr = self._address()
        guard_sync("DeviceBuffer.copy_from_numpy")
        # Our streams are non-blocking, so a plain copy would not wait for them.
        check(cu.cuCtxSynchronize)
        check(cu.cuMemcpyHtoD, ptr, array.ctypes.data, self.nbytes)
        # From pageable memory the call may return while its DMA is still in flight,
        # and kernels on our non-blocking streams would not wait for it.
        check(cu.cuCtxSynchronize)

    def to_numpy(self) -> np.ndarray:
        """Synchronous download into a new host array (tests and setup only)."""
        ptr = self._address()
        guard_sync("DeviceBuffer.to_numpy")
        out = np.empty(self.shape, self.dtype)
        check(cu.cuCtxSynchronize)
        check(cu.cuMemcpyDtoH, out.ctypes.data, ptr, self.nbytes)
        return out

    def fill_u32(self, word: int, *, stream) -> None:
        """Fill with a 32-bit pattern on ``stream`` (async; legal inside a capture)."""
        if self.nbytes % 4:
            raise ValueError("fill_u32 needs a size that is a multiple of 4 bytes")
        check(cu.cuMemsetD32Async, self._address(), word & 0xFFFFFFFF, self.nbytes // 4, stream.handle)

    def poison(self, *, stream) -> None:
        """Fill with 0xFFFFFFFF (NaN as float32, -1 as int32) so unwritten elements show."""
        self.fill_u32(0xFFFFFFFF, stream=stream)

    def copy_from(self, other: "DeviceBuffer", *, stream) -> None:
        """Async device-to-device copy of ``other`` into this buffer on ``stream``."""
        if other.nbytes != self.nbytes:
            raise ValueError(f"copy of {other.nbytes} bytes into a buffer of {self.nbytes}")
        source = other._address() if isinstance(other, DeviceBuffer) else other.ptr
        check(cu.cuMemcpyDtoDAsync, self._address(), source, self.nbytes, stream.handle)

    def close(self) -> None:
        """Free the memory now (owning buffers only; views do nothing). A closed buffer
        has no ``ptr``: a launch that names it, a bind, a copy or a view raises one
        ``RuntimeError`` that says it is closed, and a kernel whose last launch named
        it packs its arguments again. Views taken from it, launches bound and graphs
        captured with it before hold its raw address: drop them (close graphs) first."""
        if self._finalizer is None:
            return
        try:
            del self.ptr  # first: no reader sees the address once it may be freed
        except AttributeError:  # closed before (or by another thread)
            return
        for forget in _on_close:
            forget(self)
        self._finalizer()

    @property
    def closed(self) -> bool:
        """True once ``close()`` freed this buffer's memory (never for a view)."""
        return self._finalizer is not None and not hasattr(self, "ptr")

    def _address(self) -> int:
        """``ptr``, or the error that says this buffer is closed (the paths off a launch's)."""
        try:
            return self.ptr
        except AttributeError:
            raise RuntimeError(_closed_message(self)) from None

    def __repr__(self) -> str:
        kind = "view" if self.is_view else "buffer"
        if self.closed:
            return f"<DeviceBuffer {kind} {self.shape} {self.dtype}, closed>"
        return f"<DeviceBuffer {kind} {self.shape} {self.dtype} at 0x{self.ptr:x}>"


def _wait_for_producer(producer: int, stream) -> None:
    # __cuda_array_interface__ v3: 0 is not allowed, 1 is the legacy stream,
    # 2 the per-thread default stream, anything else a stream handle.
    if producer == 0:
        raise ValueError("__cuda_array_interface__ gives stream 0, which the protocol forbids")
    handle = cu.CUstream(producer)
    if stream is None:
        guard_sync("DeviceBuffer.from_cuda_array")
        check(cu.cuStreamSynchronize, handle)
        return
    event = check(cu.cuEventCreate, cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
    try:
        check(cu.cuEventRecord, event, handle)
        check(cu.cuStreamWaitEvent, stream.handle, event, 0)
    finally:
        cu.cuEventDestroy(event)  # legal with a wait pending: released once it completes


def _host_array(array) -> np.ndarray:
    if not isinstance(array, np.ndarray):
        raise TypeError(f"expected a numpy array, got {type(array).__name__}")
    if not array.flags.c_contiguous:
        raise ValueError("host array must be C-contiguous; pass np.ascontiguousarray(a)")
    return array


# ---------------------------------------------------------------- arena
class ArenaExhausted(MemoryError):
    """The arena's slab ran out while a stream was capturing."""

    def __init__(self, needed: int, offset: int, capacity: int):
        self.needed, self.offset, self.capacity = needed, offset, capacity
        super().__init__(
            f"arena exhausted during capture: an allocation of {needed} bytes at offset {offset} "
            f"does not fit the {capacity}-byte slab (at least {offset + needed} bytes needed); "
            f"the capture was ended, create the Arena larger")


class Arena(Closable):
    """A bump-pointer scratch slab, rewound by ``reset()`` every step.

    The same sequence of ``alloc`` calls after ``reset()`` returns the same
    addresses, which is what keeps a captured graph valid on every replay.
    Outside a capture a full slab falls back to a tracked ``cuMemAlloc``,
    freed at the next reset and counted in ``fallback_count``. Inside a
    capture it raises :class:`ArenaExhausted`. An inactive arena does plain
    allocations and frees them at reset (for A/B parity tests).

    A second, smaller slab serves ``zeroed()``: memory that starts as zero
    bytes, for the self-resetting counters of last-block reductions. Each call
    site gets counters of its own, so two products running on two streams
    never share one.
    """

    @closes_on_failure
    def __init__(self, nbytes: int, *, active: bool = True, zeroed_bytes: int = 16384):
        if nbytes <= 0:
            raise ValueError(f"arena size must be positive, got {nbytes}")
        if zeroed_bytes <= 0:
            raise ValueError(f"zeroed_bytes must be positive, got {zeroed_bytes}")
        self.capacity = _round_up(int(nbytes), ALIGNMENT)
        self.zeroed_capacity = _round_up(int(zeroed_bytes), ALIGNMENT)
        self.active = active
        self._slab = DeviceBuffer(self.capacity, np.uint8)
        self._zeroed_slab = DeviceBuffer.zeros(self.zeroed_capacity, np.uint8)
        self.zeroed_offset = 0
        self.offset = 0
        self.high_water = 0
        self.fallback_count = 0  # allocations that missed the slab, ever
        self.fallback_bytes = 0
        self._loose: list[DeviceBuffer] = []  # fallback or inactive allocations until reset

    @property
    def base(self) -> int:
        return self._slab.ptr

    def alloc(self, nbytes: int) -> DeviceBuffer:
        """``nbytes`` of scratch as a uint8 buffer, 256-byte aligned."""
        nbytes = int(nbytes)
        if nbytes <= 0:
            raise ValueError(f"arena allocation must be positive, got {nbytes}")
        if self.active:
            start = _round_up(self.offset, ALIGNMENT)
            end = start + nbytes
            if end <= self.capacity:
                self.offset = end
                self.high_water = max(self.high_water, end)
                return DeviceBuffer._view(self._slab, self._slab.ptr + start, (nbytes,), np.uint8)
            if active_captures():
                raise ArenaExhausted(nbytes, start, self.capacity)
            self.fallback_count += 1
            self.fallback_bytes += nbytes
        elif active_captures():
            raise CaptureError("Arena.alloc", None, "an inactive arena allocates with cuMemAlloc, "
                               "which is illegal while a stream is capturing")
        buf = DeviceBuffer(nbytes, np.uint8)
        self._loose.append(buf)
        return buf

    def array(self, shape, dtype=np.float32) -> DeviceBuffer:
        """Scratch typed as ``shape`` of ``dtype``."""
        shape = _shape_tuple(shape)
        dtype = np.dtype(dtype)
        raw = self.alloc(max(1, math.prod(shape)) * dtype.itemsize)
        return raw.view(dtype, shape)

    def zeroed(self, shape, dtype=np.uint32) -> DeviceBuffer:
        """Scratch that holds zero bytes when handed out, for counters that their
        kernels leave at zero when they finish (dt_last_block does). The same
        calls after ``reset()`` return the same addresses, still zero."""
        shape = _shape_tuple(shape)
        dtype = np.dtype(dtype)
        nbytes = max(1, math.prod(shape)) * dtype.itemsize
        if self.active:
            start = _round_up(self.zeroed_offset, ALIGNMENT)
            if start + nbytes <= self.zeroed_capacity:
                self.zeroed_offset = start + nbytes
                return DeviceBuffer._view(self._zeroed_slab, self._zeroed_slab.ptr + start, shape, dtype)
            if active_captures():
                raise ArenaExhausted(nbytes, start, self.zeroed_capacity)
            self.fallback_count += 1
            self.fallback_bytes += nbytes
        elif active_captures():
            raise CaptureError("Arena.zeroed", None, "an inactive arena allocates with cuMemAlloc, "
                               "which is illegal while a stream is capturing")
        buf = DeviceBuffer.zeros(nbytes, np.uint8)
        self._loose.append(buf)
        return buf.view(dtype, shape)

    def reset(self) -> None:
        """Rewind the slab and free every fallback allocation."""
        if self._loose:
            if active_captures():
                raise CaptureError("Arena.reset", None, "freeing fallback allocations while a "
                                   "stream is capturing; reset the arena before the capture")
            for buf in self._loose:
                buf.close()  # cuMemFree waits for work still using the memory
            self._loose.clear()
        self.offset = 0
        self.zeroed_offset = 0

    def close(self) -> None:
        if getattr(self, "_loose", None) is not None:
            self.reset()
        close_attributes(self, "_slab", "_zeroed_slab")

    def __repr__(self) -> str:
        return (f"<Arena {self.offset}/{self.capacity} bytes, high water {self.high_water}, "
                f"{self.fallback_count} fallbacks{'' if self.active else ', inactive'}>")


# ---------------------------------------------------------------- host memory
_pinned = {"count": 0, "bytes": 0}


def pinned_total() -> tuple[int, int]:
    """(allocations, bytes) of page-locked host memory drvtrain holds now."""
    return _pinned["count"], _pinned["bytes"]


def _free_host(ptr: int, nbytes: int) -> None:
    _pinned["count"] -= 1
    _pinned["bytes"] -= nbytes
    release(cu.cuMemFreeHost, ptr)


class _HostAllocation:
    """Owns one ``cuMemHostAlloc``. The buffer and every numpy view of it point
    here, and this points at nothing of theirs: no reference cycle, so the
    memory is freed as soon as the last of them goes, with no help from the GC
    (numpy arrays are not tracked by the cycle collector)."""

    __slots__ = ("ptr", "nbytes", "_finalizer", "__weakref__")

    def __init__(self, nbytes: int, flags: int):
        self.ptr = int(check(cu.cuMemHostAlloc, nbytes, flags))
        self.nbytes = nbytes
        _pinned["count"] += 1
        _pinned["bytes"] += nbytes
        self._finalizer = release_on_collect(self, _free_host, self.ptr, nbytes)


class _HostArrayView:
    """Exposes host memory to numpy while keeping its allocation alive."""

    def __init__(self, allocation: _HostAllocation, shape, dtype):
        self.allocation = allocation
        self.__array_interface__ = {
            "shape": shape, "typestr": dtype.str, "data": (allocation.ptr, False), "version": 3}


class _HostBuffer(Closable):
    _flags = 0

    def __init__(self, shape, dtype=np.float32):
        self.shape = _shape_tuple(shape)
        self.dtype = np.dtype(dtype)
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize
        if self.nbytes <= 0:
            raise ValueError(f"{type(self).__name__} needs a positive size, got shape {self.shape}")
        get_device()
        self._allocation = _HostAllocation(self.nbytes, self._flags)
        self.host_ptr = self._allocation.ptr
        self._array = np.asarray(_HostArrayView(self._allocation, self.shape, self.dtype))

    def view(self) -> np.ndarray:
        """The host-side numpy view (valid until ``close()``)."""
        return self._array

    def close(self) -> None:
        """Free the memory now; numpy views taken earlier must not be used after this."""
        self._allocation._finalizer()


class MappedBuffer(_HostBuffer):
    """Page-locked host memory mapped into the device's address space.

    Kernels write it through ``ptr``; the host reads ``view()`` with no copy.
    Read it only after an event says the writing work has finished.
    """

    _flags = cu.CU_MEMHOSTALLOC_DEVICEMAP | cu.CU_MEMHOSTALLOC_PORTABLE

    def __init__(self, shape, dtype=np.float32):
        super().__init__(shape, dtype)
        self.ptr = int(check(cu.cuMemHostGetDevicePointer, self.host_ptr, 0))

    def __repr__(self) -> str:
        return f"<MappedBuffer {self.shape} {self.dtype} host 0x{self.host_ptr:x} device 0x{self.ptr:x}>"


class PinnedBuffer(_HostBuffer):
    """Page-locked host memory, the source or target of async copies."""

    _flags = cu.CU_MEMHOSTALLOC_PORTABLE

    def copy_to_device_async(self, dst: DeviceBuffer, *, stream) -> None:
        if dst.nbytes != self.nbytes:
            raise ValueError(f"copy of {self.nbytes} bytes into a buffer of {dst.nbytes}")
        check(cu.cuMemcpyHtoDAsync, dst.ptr, self.host_ptr, self.nbytes, stream.handle)

    def copy_from_device_async(self, src: DeviceBuffer, *, stream) -> None:
        if src.nbytes != self.nbytes:
            raise ValueError(f"copy of {src.nbytes} bytes into a pinned buffer of {self.nbytes}")
        check(cu.cuMemcpyDtoHAsync, self.host_ptr, src.ptr, self.nbytes, stream.handle)

    def __repr__(self) -> str:
        return f"<PinnedBuffer {self.shape} {self.dtype} at 0x{self.host_ptr:x}>"
