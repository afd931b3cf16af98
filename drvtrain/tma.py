"""Tensor maps for the tensor memory accelerator (TMA) of compute capability 9.0.

A tensor map describes a matrix in device memory and the tile (box) one TMA copy moves
into shared memory, with the shared-memory swizzle and the fill for elements outside the
matrix. It is encoded once on the host (``cuTensorMapEncodeTiled``) and passed to a
kernel by value: the argument kind ``tmap`` in a signature, ``const __grid_constant__
DtTensorMap`` in the kernel (``kernels/tma.cuh``, which also has the copy itself).

    a = DeviceBuffer((512, 1024), np.float32)
    tm = tensor_map_2d(a, box=(128, 32))              # 128 rows x 32 floats, 128-byte swizzle
    kernel = module.kernel("my_kernel", "tmap ptr i32")
    kernel.launch(grid, block, tm, out, n, stream=stream)

Everything the driver would refuse is checked here first, with the argument named.
The map holds the buffer's address, so the buffer must outlive every launch that uses
it (the map keeps a reference to it).
"""
from __future__ import annotations

import ctypes

import numpy as np
from cuda.bindings import driver as cu

from .driver import NoDeviceError, get_device, raise_status

__all__ = ["TensorMap", "tensor_map_2d", "SWIZZLE_BYTES"]

# Swizzle modes and the widest box row (in bytes) each allows; "none" allows any.
SWIZZLE_BYTES = {"none": None, "32B": 32, "64B": 64, "128B": 128}
_SWIZZLE = {"none": cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE,
            "32B": cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_32B,
            "64B": cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_64B,
            "128B": cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B}
_DTYPES = {np.dtype(np.float32): cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
           np.dtype(np.float64): cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT64,
           np.dtype(np.float16): cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
           np.dtype(np.int32): cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_INT32,
           np.dtype(np.uint32): cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT32,
           np.dtype(np.int64): cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_INT64,
           np.dtype(np.uint8): cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8}
_OOB = {"zero": cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        "nan": cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA}
TENSOR_MAP_BYTES = 128


class TensorMap:
    """An encoded 2-D tensor map: ``raw`` (128 bytes) is what the kernel receives.

    Read-only: a launch that is given the same map again may reuse what it packed."""

    __slots__ = ("_raw", "buffer", "shape", "ld", "box", "dtype", "swizzle", "oob")

    def __init__(self, raw: bytes, buffer, shape, ld, box, dtype, swizzle, oob):
        if len(raw) != TENSOR_MAP_BYTES:
            raise ValueError(f"a tensor map is {TENSOR_MAP_BYTES} bytes, got {len(raw)}")
        values = dict(_raw=bytes(raw), buffer=buffer, shape=tuple(shape), ld=ld, box=tuple(box), dtype=dtype,
                      swizzle=swizzle, oob=oob)  # buffer: keeps the memory the map points at alive
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name, value):
        raise AttributeError("a TensorMap is read-only; encode another with tensor_map_2d")

    @property
    def raw(self) -> bytes:
        return self._raw

    @property
    def box_bytes(self) -> int:
        """Bytes one copy moves into shared memory (elements outside the matrix included)."""
        return self.box[0] * self.box[1] * self.dtype.itemsize

    def __repr__(self) -> str:
        return (f"TensorMap({self.shape[0]}x{self.shape[1]} {self.dtype}, ld={self.ld}, "
                f"box={self.box[0]}x{self.box[1]}, swizzle={self.swizzle}, oob={self.oob})")


def _positive_ints(name: str, value, count: int) -> tuple[int, ...]:
    try:
        items = tuple(value)
    except TypeError:
        raise TypeError(f"{name} must be {count} positive ints, got {value!r}") from None
    if len(items) != count or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool)
                                      and v > 0 for v in items):
        raise ValueError(f"{name} must be {count} positive ints, got {value!r}")
    return tuple(int(v) for v in items)


def tensor_map_2d(buffer, box, *, shape=None, ld: int | None = None, swizzle: str = "128B",
                  oob: str = "zero") -> TensorMap:
    """A tensor map over the row-major matrix at ``buffer`` (a DeviceBuffer or view).

    ``shape = (rows, cols)`` in elements (default: the buffer's 2-D shape); rows are
    ``ld`` elements apart (default ``cols``). One copy moves the ``box = (box_rows,
    box_cols)`` tile whose top-left element is at the coordinates it is given (column
    first, as the PTX names them), laid out in shared memory with ``swizzle``: "none"
    (row after row), or "32B", "64B", "128B". With box rows as wide as the swizzle's span
    (the case the GPU tests check), the box's byte offset L lands at
    ``L ^ (((L >> 7) & m) << 4)`` for m = 1, 3, 7 from a destination aligned to 256, 512
    or 1024 bytes (so with "128B" the 16-byte chunk c of row r is at chunk ``c ^ (r % 8)``:
    the layout wgmma's 128-byte swizzled operands use). A box row may not be wider than
    the swizzle's span. Elements
    outside the matrix arrive as 0 (``oob="zero"``) or as NaN (``"nan"``, floating point
    only). The box may start before or past the matrix, but the kernel's column coordinate
    times the element size must be a multiple of 16 bytes: an unaligned copy is an illegal
    instruction on the device, which ends the context.

    Raises ValueError or TypeError for anything the driver would refuse (each limit is
    named), and NoDeviceError where there is no driver to encode with.
    """
    dtype = np.dtype(getattr(buffer, "dtype", None) or np.float32)
    if dtype not in _DTYPES:
        raise TypeError(f"tensor maps take {', '.join(str(d) for d in _DTYPES)}; the buffer is {dtype}")
    ptr, nbytes = getattr(buffer, "ptr", None), getattr(buffer, "nbytes", None)
    if not isinstance(ptr, int) or not isinstance(nbytes, int):
        raise TypeError(f"buffer must be a device buffer (with ptr and nbytes), got {type(buffer).__name__}")
    if shape is None:
        shape = getattr(buffer, "shape", ())
        if len(shape) != 2:
            raise ValueError(f"the buffer's shape {shape} is not 2-D: pass shape=(rows, cols)")
    rows, cols = _positive_ints("shape", shape, 2)
    ld = cols if ld is None else ld
    if isinstance(ld, bool) or not isinstance(ld, (int, np.integer)) or ld < cols:
        raise ValueError(f"ld must be an int of at least cols = {cols}, got {ld!r}")
    ld = int(ld)
    box_rows, box_cols = _positive_ints("box", box, 2)
    if swizzle not in _SWIZZLE:
        raise ValueError(f"swizzle must be one of {list(_SWIZZLE)}, got {swizzle!r}")
    if oob not in _OOB:
        raise ValueError(f"oob must be 'zero' or 'nan', got {oob!r}")
    if oob == "nan" and dtype.kind != "f":
        raise ValueError(f"oob='nan' needs a floating-point buffer, not {dtype}")
    item = dtype.itemsize
    if ptr % 16:
        raise ValueError(f"the matrix must start on a 16-byte boundary (address {ptr:#x})")
    if (ld * item) % 16:
        raise ValueError(f"a row stride of {ld} x {item} bytes is not a multiple of 16 bytes")
    if ld * item >= 1 << 40 or rows > 1 << 32 or cols > 1 << 32:
        raise ValueError(f"the matrix ({rows} x {cols}, ld {ld}) exceeds the tensor map's limits")
    if ((rows - 1) * ld + cols) * item > nbytes:
        raise ValueError(f"{rows} rows of {cols} elements {ld} apart need "
                         f"{((rows - 1) * ld + cols) * item} bytes; the buffer has {nbytes}")
    if box_rows > 256 or box_cols > 256:
        raise ValueError(f"box dimensions are at most 256, got {box_rows} x {box_cols}")
    if (box_cols * item) % 16:
        raise ValueError(f"a box row of {box_cols} x {item} bytes is not a multiple of 16 bytes")
    span = SWIZZLE_BYTES[swizzle]
    if span is not None and box_cols * item > span:
        raise ValueError(f"a box row of {box_cols * item} bytes is wider than the {swizzle} swizzle allows")
    raw = _encode(dtype, ptr, rows, cols, ld, box_rows, box_cols, swizzle, oob)
    return TensorMap(raw, buffer, (rows, cols), ld, (box_rows, box_cols), dtype, swizzle, oob)


_libcuda = None


def _driver_library():
    """The driver library itself, for the one entry point called through ctypes."""
    global _libcuda
    if _libcuda is None:
        try:
            _libcuda = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise NoDeviceError(f"libcuda.so.1: {exc}") from None
        fn = _libcuda.cuTensorMapEncodeTiled
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                       ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                       ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                       ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return _libcuda


def _encode_tiled(lib, *args) -> int:
    """The driver's cuTensorMapEncodeTiled (one name, so drvtrain.audit counts it)."""
    return lib.cuTensorMapEncodeTiled(*args)


def _encode(dtype, ptr, rows, cols, ld, box_rows, box_cols, swizzle, oob) -> bytes:
    # The driver writes the map to an address that must be 64-byte aligned; the binding's
    # own CUtensorMap object need not be, so the map is encoded into an aligned window of
    # a buffer of ours, through the driver's entry point.
    get_device()  # the driver initialised (or NoDeviceError)
    lib = _driver_library()
    space = (ctypes.c_uint8 * (2 * TENSOR_MAP_BYTES))()
    out = ctypes.addressof(space) + (-ctypes.addressof(space)) % 64
    item = dtype.itemsize
    status = _encode_tiled(
        lib, out, int(_DTYPES[dtype]), 2, ptr, (ctypes.c_uint64 * 2)(cols, rows), (ctypes.c_uint64 * 1)(ld * item),
        (ctypes.c_uint32 * 2)(box_cols, box_rows), (ctypes.c_uint32 * 2)(1, 1),
        int(cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE), int(_SWIZZLE[swizzle]),
        int(cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B), int(_OOB[oob]))
    if status:
        raise_status("cuTensorMapEncodeTiled", cu.CUresult(status))
    return ctypes.string_at(out, TENSOR_MAP_BYTES)
