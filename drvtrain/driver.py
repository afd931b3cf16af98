"""Errors, ``check()``, the device and its primary context.

The bottom layer: it imports nothing else of drvtrain. Every driver and NVRTC
call in the library goes through :func:`check`, which unpacks the
``(status, *values)`` tuples of ``cuda.bindings`` and turns a failing status
into an exception that names the call.
"""
from __future__ import annotations

import os
import threading
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path

from cuda.bindings import driver as cu
from cuda.bindings import nvrtc

__all__ = [
    "DriverError", "NoDeviceError", "CaptureError", "Closable", "check", "Device",
    "get_device", "driver_version", "nvrtc_version", "guard_sync",
]


class DriverError(RuntimeError):
    """A driver or NVRTC call failed: ``cuGraphInstantiate: CUDA_ERROR_INVALID_VALUE (invalid argument)``."""

    def __init__(self, call: str, status=None, message: str = ""):
        self.call = call
        self.status = status
        self.status_name = getattr(status, "name", None) if status is not None else None
        self.detail = message
        if status is None:
            text = f"{call}: {message}"
        else:
            text = f"{call}: {self.status_name} ({message})" if message else f"{call}: {self.status_name}"
        super().__init__(text)


class CaptureError(DriverError):
    """A call that is illegal while a stream is capturing, or a capture that broke."""


class NoDeviceError(RuntimeError):
    """No usable CUDA driver or GPU on this machine."""

    def __init__(self, detail: str = ""):
        self.detail = detail
        text = "no CUDA driver/GPU found"
        super().__init__(f"{text} ({detail})" if detail else text)


# Statuses from any call that mean "this machine cannot run CUDA", not "the program is wrong"
# (an invalid device from a later call is the program's error). Named directly, so a name the
# bindings lack fails at import instead of dropping out. Every failure of a start-up call
# (`_start_up`) means no device too.
_NO_DEVICE = {
    cu.CUresult.CUDA_ERROR_NO_DEVICE,
    cu.CUresult.CUDA_ERROR_STUB_LIBRARY,
    cu.CUresult.CUDA_ERROR_SYSTEM_DRIVER_MISMATCH,
    cu.CUresult.CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE,
    cu.CUresult.CUDA_ERROR_DEVICE_UNAVAILABLE,
}

_CAPTURE_STATUSES = {
    cu.CUresult.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
    cu.CUresult.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
    cu.CUresult.CUDA_ERROR_STREAM_CAPTURE_MERGE,
    cu.CUresult.CUDA_ERROR_STREAM_CAPTURE_UNMATCHED,
    cu.CUresult.CUDA_ERROR_STREAM_CAPTURE_UNJOINED,
    cu.CUresult.CUDA_ERROR_STREAM_CAPTURE_ISOLATION,
    cu.CUresult.CUDA_ERROR_STREAM_CAPTURE_IMPLICIT,
    cu.CUresult.CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD,
    cu.CUresult.CUDA_ERROR_CAPTURED_EVENT,
}

# What a capture status usually means, for the reader of the exception.
_CAPTURE_HINTS = {
    cu.CUresult.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED:
        "this call is not permitted while a stream is capturing",
    cu.CUresult.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED:
        "an earlier illegal call invalidated the capture",
    cu.CUresult.CUDA_ERROR_STREAM_CAPTURE_UNJOINED:
        "a forked stream was not joined back into the capturing stream",
    cu.CUresult.CUDA_ERROR_STREAM_CAPTURE_IMPLICIT:
        "the call touched the legacy stream, which implicitly synchronises",
    cu.CUresult.CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD:
        "capture was ended from another thread than the one that began it",
}


def _status_text(status) -> str:
    try:
        if isinstance(status, cu.CUresult):
            err, text = cu.cuGetErrorString(status)
            return text.decode() if not err and text else ""
        if isinstance(status, nvrtc.nvrtcResult):
            err, text = nvrtc.nvrtcGetErrorString(status)
            return text.decode() if not err and text else ""
    except Exception:  # the driver library itself may be missing
        pass
    return ""


def _is_missing_library(exc: BaseException) -> bool:
    # cuda.bindings loads libcuda lazily through cuda.pathfinder; when it is
    # absent the first call raises from there (or an OSError from dlopen).
    mod = type(exc).__module__ or ""
    if mod.startswith("cuda.pathfinder") or isinstance(exc, OSError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("dlopen" in text or "libcuda" in text)


def raise_status(call: str, status):
    """Raise the exception for a failing ``status`` returned by ``call``."""
    if status in _NO_DEVICE:
        raise NoDeviceError(f"{call}: {status.name}")
    message = _status_text(status)
    if status in _CAPTURE_STATUSES:
        hint = _CAPTURE_HINTS.get(status)
        raise CaptureError(call, status, f"{message}; {hint}" if hint else message)
    raise DriverError(call, status, message)


def check(fn, *args):
    """Call the binding ``fn(*args)``; return its values, or raise on a bad status.

    Returns None, the single value, or a tuple, as the binding returned.
    """
    try:
        result = fn(*args)
    except Exception as exc:
        if _is_missing_library(exc):
            raise NoDeviceError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None
        raise
    status = result[0]
    if status:
        raise_status(fn.__name__, status)
    n = len(result)
    if n == 1:
        return None
    if n == 2:
        return result[1]
    return result[1:]


def _start_up(fn, *args):
    """``check(fn, *args)`` for a call that brings the driver or a device up (``cuInit``,
    ``cuDeviceGetCount``, ``cuDeviceGet``, ``cuDevicePrimaryCtxRetain``): any failure there,
    ``CUDA_ERROR_SYSTEM_NOT_READY`` or ``CUDA_ERROR_UNKNOWN`` say, means no usable GPU."""
    try:
        return check(fn, *args)
    except DriverError as exc:
        raise NoDeviceError(str(exc)) from None


# ---------------------------------------------------------------- capture state
# Streams capturing in this thread. drvtrain captures in thread-local mode, so
# only calls made from the capturing thread can invalidate its capture; this
# registry lets synchronising helpers refuse early, with a readable message.
_tls = threading.local()


def active_captures() -> list:
    captures = getattr(_tls, "captures", None)
    if captures is None:
        captures = _tls.captures = []
    return captures


def guard_sync(what: str) -> None:
    """Raise CaptureError if this thread is capturing; ``what`` names the call."""
    if getattr(_tls, "captures", None):
        raise CaptureError(
            what, None,
            "would synchronise with the device while a stream is capturing, which "
            "invalidates the capture; move it outside the capture block")


# ---------------------------------------------------------------- device
_init_lock = threading.Lock()
_initialised = False


def _init() -> None:
    global _initialised
    if _initialised:
        return
    with _init_lock:
        if not _initialised:
            _start_up(cu.cuInit, 0)
            if _start_up(cu.cuDeviceGetCount) < 1:
                raise NoDeviceError("the driver reports no devices")
            _initialised = True


def driver_version() -> tuple[int, int]:
    """The CUDA driver's version as (major, minor)."""
    _init()
    v = check(cu.cuDriverGetVersion)
    return v // 1000, (v % 1000) // 10


def nvrtc_version() -> tuple[int, int]:
    """NVRTC's version as (major, minor); needs no GPU."""
    major, minor = check(nvrtc.nvrtcVersion)
    return major, minor


_nvrtc_build: list | None = None


def nvrtc_build() -> list:
    """What tells NVRTC's builds of one (major, minor) apart, which ``nvrtcVersion``
    does not: the name and size of the loaded library and of its builtins library
    beside it (13.0.48 and 13.0.88 are both 13.0, and their CUBIN may differ). Read
    once a process; empty where the library cannot be located (the key then has
    the version alone)."""
    global _nvrtc_build
    if _nvrtc_build is None:
        try:
            from cuda.pathfinder import load_nvidia_dynamic_lib
            path = Path(os.path.realpath(load_nvidia_dynamic_lib("nvrtc").abs_path))
            files = [path] + sorted(path.parent.glob("*nvrtc-builtins*"))
            _nvrtc_build = [[f.name, f.stat().st_size] for f in files]
        except Exception:  # an NVRTC found some other way: the version alone keys the cache
            _nvrtc_build = []
    return _nvrtc_build


@dataclass(frozen=True)
class DeviceLimits:
    """The launch limits a kernel launch is validated against."""
    max_threads_per_block: int
    max_block: tuple[int, int, int]
    max_grid: tuple[int, int, int]
    max_shared_per_block: int
    max_shared_per_block_optin: int


# ---------------------------------------------------------------- releasing
# Releases that arrive while this thread is capturing wait here. A finalizer can
# run at any allocation (Python's cyclic GC), and a cuMemFree or cuModuleUnload
# issued mid-capture would invalidate the capture.
_deferred: list = []


class Closable:
    """For the owners of device resources: ``with owner:`` closes it when the block
    ends, however it ends. When the block raised, that error goes on, and an error
    from ``close()`` becomes a note on it (a ``RuntimeWarning`` on Python 3.10:
    :func:`note_on`). Every owner's ``close()`` may be called again: the second call
    does nothing."""
    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, kind, error, trace) -> None:
        if error is None:
            self.close()
            return
        try:
            self.close()
        except Exception as inner:  # noqa: BLE001 (the block's error is the one that goes on)
            note_on(error, f"closing the {type(self).__name__} at the end of the block failed too: {inner!r}")


def note_on(error: BaseException, text: str) -> None:
    """Say ``text`` of a second failure while ``error`` goes on: a note on ``error``
    (Python 3.11 and later), else a ``RuntimeWarning`` naming both, so that it is not
    lost on Python 3.10. Where warnings are made errors (``-W error``), the warning is
    dropped rather than raised, so that ``error`` is still the one that goes on."""
    add_note = getattr(error, "add_note", None)
    if add_note is not None:
        add_note(text)
        return
    try:
        warnings.warn(f"{text} (while {error!r} goes on)", RuntimeWarning, stacklevel=3)
    except RuntimeWarning:
        pass


def release_on_collect(owner, func, *args) -> weakref.finalize:
    """The finalizer of an object that owns a driver resource: ``func(*args)`` once,
    when ``owner`` is collected or its ``close()`` calls the finalizer, but not by
    weakref's exit hook, and (as for every finalizer) not at all once that hook
    has run. Whatever is alive then is freed by the process dropping its context;
    a driver call made during the teardown would run while other libraries (a
    profiler, another runtime on the same context) tear down their own state."""
    finalizer = weakref.finalize(owner, func, *args)
    finalizer.atexit = False
    return finalizer


def release(fn, handle) -> None:
    """Free a driver resource: the function every drvtrain finalizer calls.

    Errors are swallowed: the resource may already be gone with its context.
    """
    if getattr(_tls, "captures", None):
        _deferred.append((fn, handle))
        return
    try:
        fn(handle)
    except Exception:
        pass


def release_deferred() -> None:
    """Run the releases held back during a capture (called when it ends)."""
    while _deferred and not getattr(_tls, "captures", None):
        fn, handle = _deferred.pop()
        try:
            fn(handle)
        except Exception:
            pass


class Device:
    """One GPU and its retained primary context."""

    def __init__(self, ordinal: int = 0):
        _init()
        count = _start_up(cu.cuDeviceGetCount)
        if not 0 <= ordinal < count:
            raise ValueError(f"device ordinal {ordinal} out of range: {count} device(s) present")
        self.ordinal = ordinal
        self.handle = _start_up(cu.cuDeviceGet, ordinal)
        self.context = _start_up(cu.cuDevicePrimaryCtxRetain, self.handle)
        self._finalizer = release_on_collect(self, release, cu.cuDevicePrimaryCtxRelease, self.handle)
        self.make_current()
        self.name = check(cu.cuDeviceGetName, 256, self.handle).split(b"\0", 1)[0].decode()
        a = cu.CUdevice_attribute
        self.compute_capability = (
            self.attribute(a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
            self.attribute(a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
        )
        self.sm_count = self.attribute(a.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        self.l2_bytes = self.attribute(a.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)
        self.total_memory = check(cu.cuDeviceTotalMem, self.handle)
        self.limits = DeviceLimits(
            max_threads_per_block=self.attribute(a.CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK),
            max_block=(self.attribute(a.CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X),
                       self.attribute(a.CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y),
                       self.attribute(a.CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z)),
            max_grid=(self.attribute(a.CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X),
                      self.attribute(a.CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y),
                      self.attribute(a.CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z)),
            max_shared_per_block=self.attribute(a.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK),
            max_shared_per_block_optin=self.attribute(
                a.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
        )

    @property
    def arch(self) -> str:
        """The NVRTC target for this device, e.g. ``sm_90``."""
        return "sm_%d%d" % self.compute_capability

    @property
    def max_shared_per_block(self) -> int:
        return self.limits.max_shared_per_block

    def attribute(self, attr) -> int:
        return check(cu.cuDeviceGetAttribute, attr, self.handle)

    def make_current(self) -> None:
        """Make the primary context current in the calling thread."""
        check(cu.cuCtxSetCurrent, self.context)
        _tls.device = self

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of device memory, from ``cuMemGetInfo``."""
        free, total = check(cu.cuMemGetInfo)
        return free, total

    def synchronize(self) -> None:
        guard_sync("Device.synchronize")
        check(cu.cuCtxSynchronize)

    def close(self) -> None:
        """Release the primary context. Resources made on it must be closed first."""
        _devices.pop(self.ordinal, None)
        if getattr(_tls, "device", None) is self:
            _tls.device = None
        self._finalizer()

    def __repr__(self) -> str:
        return f"<Device {self.ordinal}: {self.name} {self.arch}, {self.sm_count} SMs>"


_devices: dict[int, Device] = {}
_devices_lock = threading.Lock()


def get_device(ordinal: int = 0) -> Device:
    """The Device for ``ordinal``, with its context current in this thread.

    Raises NoDeviceError when the machine has no driver or GPU.
    """
    dev = getattr(_tls, "device", None)
    if dev is not None and dev.ordinal == ordinal:
        return dev
    with _devices_lock:
        dev = _devices.get(ordinal)
        if dev is None:
            dev = _devices[ordinal] = Device(ordinal)
    dev.make_current()
    return dev
