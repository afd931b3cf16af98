"""Checkpoints: named numpy arrays and a JSON ``meta`` in one checksummed file.

Layout (all integers little-endian)::

    magic        8 bytes   b"DRVTCKPT"
    version      u32       FORMAT_VERSION
    header_len   u64       bytes of the JSON header, padded with spaces
    payload_len  u64       bytes of the array payload
    header       JSON      {"meta": ..., "arrays": [{"name", "dtype", "shape", "offset", "nbytes"}, ...]}
    payload      raw       each array's C-order bytes at its offset, 64-byte aligned
    sha256       32 bytes  over every byte before it

A checkpoint is written to a temporary file in the same folder, fsynced and
renamed over the old one, so a crash leaves either the old file or the new one.
``load_checkpoint`` checks the magic, the version, the length and the checksum
before it parses anything, so it returns a whole checkpoint or raises.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import struct
from pathlib import Path

import numpy as np

from .files import atomic_file

__all__ = ["CheckpointError", "FORMAT_VERSION", "MAGIC", "load_checkpoint", "save_checkpoint"]

MAGIC = b"DRVTCKPT"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sIQQ")
_DIGEST_BYTES = hashlib.sha256().digest_size
_ALIGN = 64


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read: missing, truncated, corrupt or not a checkpoint."""

    def __init__(self, path, problem: str):
        self.path = Path(path)
        self.problem = problem
        super().__init__(f"checkpoint {self.path}: {problem}")


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _check_dtype(name: str, dtype: np.dtype) -> None:
    # Object arrays hold pointers and structured dtypes lose their fields in
    # ``dtype.str``: neither survives a byte copy, so both are refused.
    if dtype.hasobject or dtype.fields is not None or dtype.kind == "V":
        raise ValueError(f"array {name!r}: dtype {dtype} cannot be checkpointed (plain numeric, bool or "
                         "fixed-width string dtypes only)")


def save_checkpoint(path, arrays: dict, meta: dict) -> None:
    """Write ``arrays`` (name -> numpy array) and ``meta`` (JSON-serialisable) to ``path`` atomically."""
    path = Path(path)
    if not isinstance(meta, dict):
        raise TypeError(f"meta must be a dict, got {type(meta).__name__}")
    entries, blobs, offset = [], [], 0
    for name, value in arrays.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"array names must be non-empty strings, got {name!r}")
        array = np.asarray(value)
        if not array.flags.c_contiguous:  # (np.ascontiguousarray would turn a 0-d array into 1-d)
            array = array.copy(order="C")
        _check_dtype(name, array.dtype)
        entries.append({"name": name, "dtype": array.dtype.str, "shape": list(array.shape),
                        "offset": offset, "nbytes": array.nbytes})
        blobs.append((offset, array))
        offset = _aligned(offset + array.nbytes)
    payload_len = blobs[-1][0] + blobs[-1][1].nbytes if blobs else 0
    try:
        header = json.dumps({"meta": meta, "arrays": entries}, sort_keys=True).encode()
    except (TypeError, ValueError) as exc:
        raise ValueError(f"meta is not JSON-serialisable: {exc}") from None
    # Pad the header so the payload starts on an aligned file offset.
    header += b" " * (_aligned(_PREFIX.size + len(header)) - _PREFIX.size - len(header))

    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path, "wb") as f:
        digest = hashlib.sha256()

        def put(data) -> None:
            digest.update(data)
            f.write(data)

        put(_PREFIX.pack(MAGIC, FORMAT_VERSION, len(header), payload_len))
        put(header)
        written = 0
        for start, array in blobs:
            if start > written:
                put(bytes(start - written))
            put(array.reshape(-1).view(np.uint8).data)
            written = start + array.nbytes
        f.write(digest.digest())


def load_checkpoint(path) -> tuple[dict, dict]:
    """Read a checkpoint written by ``save_checkpoint``: ``(arrays, meta)``.

    Raises ``CheckpointError`` when the file is missing, truncated, corrupt or
    not a drvtrain checkpoint; nothing is returned unless every check passed.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            smallest = _PREFIX.size + _DIGEST_BYTES
            prefix = f.read(_PREFIX.size)
            if len(prefix) >= len(MAGIC) and prefix[:len(MAGIC)] != MAGIC:
                raise CheckpointError(path, "not a drvtrain checkpoint (wrong magic bytes)")
            if size < smallest:
                raise CheckpointError(path, f"truncated: {size} bytes, a checkpoint has at least {smallest}")
            _, version, header_len, payload_len = _PREFIX.unpack(prefix)
            if version != FORMAT_VERSION:
                raise CheckpointError(path, f"format version {version}, this drvtrain reads version "
                                            f"{FORMAT_VERSION}")
            expected = smallest + header_len + payload_len
            if size < expected:
                raise CheckpointError(path, f"truncated: {size} bytes, the header announces {expected}")
            if size > expected:
                raise CheckpointError(path, f"{size - expected} unexpected trailing bytes after the checksum")
            header = f.read(header_len)
            payload = np.empty(payload_len, np.uint8)
            got = f.readinto(memoryview(payload)) if payload_len else 0
            stored = f.read(_DIGEST_BYTES)
    except FileNotFoundError:
        raise CheckpointError(path, "no such file") from None
    except IsADirectoryError:
        raise CheckpointError(path, "is a directory, not a checkpoint file") from None
    except OSError as exc:
        raise CheckpointError(path, f"cannot be read ({exc.strerror or exc})") from None
    if len(header) != header_len or got != payload_len or len(stored) != _DIGEST_BYTES:
        raise CheckpointError(path, "truncated while it was being read")
    digest = hashlib.sha256(prefix)
    digest.update(header)
    digest.update(payload.data)
    if not hmac.compare_digest(digest.digest(), stored):
        raise CheckpointError(path, "checksum mismatch: the file is corrupt")
    return _parse(path, header, payload)


def _parse(path: Path, header: bytes, payload: np.ndarray) -> tuple[dict, dict]:
    """Everything past the checksum: a file that passes it but was not written
    by ``save_checkpoint`` (or by a newer one) still gets a clear error."""
    try:
        doc = json.loads(header.decode())
        meta, entries = doc["meta"], doc["arrays"]
        if not isinstance(meta, dict) or not isinstance(entries, list):
            raise TypeError("meta must be an object and arrays a list")
        arrays = {}
        for e in entries:
            name, dtype, shape = e["name"], np.dtype(e["dtype"]), tuple(e["shape"])
            offset, nbytes = e["offset"], e["nbytes"]
            if not isinstance(name, str) or name in arrays:
                raise ValueError(f"bad or repeated array name {name!r}")
            _check_dtype(name, dtype)
            if any(not isinstance(d, int) or d < 0 for d in shape):
                raise ValueError(f"array {name!r}: bad shape {shape}")
            if nbytes != math.prod(shape) * dtype.itemsize:
                raise ValueError(f"array {name!r}: {nbytes} bytes do not fill shape {shape} of {dtype}")
            if not isinstance(offset, int) or offset < 0 or offset + nbytes > payload.size:
                raise ValueError(f"array {name!r}: bytes [{offset}, {offset + nbytes}) lie outside the payload")
            if nbytes == 0:
                arrays[name] = np.empty(shape, dtype)
            else:
                # A view of the one payload buffer: no second copy of a large replay.
                arrays[name] = payload[offset:offset + nbytes].view(dtype).reshape(shape)
    except (KeyError, TypeError, ValueError, UnicodeDecodeError, AttributeError) as exc:
        detail = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc).splitlines()[0]
        raise CheckpointError(path, f"header does not describe a checkpoint ({detail})") from None
    return arrays, meta
