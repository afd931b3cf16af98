"""NVRTC to CUBIN, and the on-disk cache in front of it.

Always CUBIN for the device's own ``sm_XY``, never PTX: a driver older than
NVRTC rejects PTX from the newer compiler, while CUBIN for the exact
architecture loads.

Cache entries are keyed by the source, the contents of every local header it
includes (recursively), the options, the architecture, the name expressions
and the NVRTC version and build (its library's name and size: patch releases
of one version share ``nvrtcVersion``). Entries are written atomically (temp file, then
``os.replace``) and carry a SHA-256 of their payload; an entry that fails the
check is recompiled, never trusted.

NVRTC looks for includes in the ``-I`` folders only (``--no-source-include``).
By default it first searches the program name's folder, for a bare name the
current directory, where a header the key never saw would shadow drvtrain's own.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from cuda.bindings import nvrtc

from .driver import check, nvrtc_build, nvrtc_version
from .files import atomic_file

__all__ = [
    "CompileError", "CacheWarning", "CompiledProgram", "KernelCache", "compile_source",
    "compile_file", "kernel_dir", "kernel_files", "default_cache", "DEFAULT_OPTIONS",
]

DEFAULT_OPTIONS = ("-std=c++17", "-lineinfo")
# Always passed, whatever the caller's options; in the key too, so no entry compiled without it is reused.
_SEARCH_OPTIONS = ("--no-source-include",)
_FORMAT = 1
_MAGIC = b"DRVTCUB1"
_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*[<"]([^>"]+)[>"]', re.M)


class CompileError(RuntimeError):
    """NVRTC rejected a source or its options. ``filename`` and the full ``log`` are attached.

    ``status`` is NVRTC's status where it is not ``NVRTC_ERROR_COMPILATION``
    (e.g. ``NVRTC_ERROR_INVALID_OPTION``), else None; the message names it.
    """

    def __init__(self, filename: str, log: str, status=None):
        self.filename = filename
        self.log = log
        self.status = status
        why = f" ({status.name})" if status is not None else ""
        super().__init__(f"NVRTC failed to compile {filename}{why}:\n{log.rstrip()}")


class CacheWarning(UserWarning):
    """The kernel cache cannot be used as configured; compilation goes on without it."""


@dataclass
class CompiledProgram:
    """A CUBIN image and the lowered names of its name expressions."""
    name: str
    arch: str
    cubin: bytes
    lowered_names: dict[str, str]
    log: str = ""
    cache_hit: bool = False
    millis: float = 0.0
    key: str = ""


# ---------------------------------------------------------------- kernel sources
def kernel_dir() -> Path:
    """drvtrain's own ``kernels/`` folder: in a checkout, editable install or wheel."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "kernels", here.parent / "kernels"):
        if candidate.is_dir() and any(candidate.glob("*.cu")):
            return candidate
    import importlib.util
    spec = importlib.util.find_spec("drvtrain.kernels")
    for location in (spec.submodule_search_locations or []) if spec else []:
        if any(Path(location).glob("*.cu")):
            return Path(location)
    raise FileNotFoundError("drvtrain's kernels/ folder was not found beside the package")


def kernel_files() -> list[Path]:
    """Every ``.cu`` file drvtrain ships, sorted by name."""
    return sorted(kernel_dir().glob("*.cu"))


def _local_headers(source: str, search_dirs: list[Path]) -> list[tuple[str, str]]:
    """(path, sha256) of every header the source includes that exists locally, recursively.

    Every include, a header's too, is looked up in ``search_dirs`` in order, as
    NVRTC does under ``--no-source-include`` (which drops even the including
    header's own folder). Headers not found there belong to NVRTC or the
    toolkit, which the NVRTC version in the key already covers. Conditionals are
    ignored, so this may hash a header that is not used; it never misses one that is.
    """
    found: dict[str, str] = {}
    pending = [source]
    while pending:
        text = pending.pop()
        for name in _INCLUDE.findall(text):
            for d in search_dirs:
                path = (d / name).resolve()
                if path.is_file():
                    if str(path) not in found:
                        data = path.read_bytes()
                        found[str(path)] = hashlib.sha256(data).hexdigest()
                        pending.append(data.decode("utf-8", "replace"))
                    break
    return sorted(found.items())


# ---------------------------------------------------------------- the cache
def _default_cache_dir() -> Path:
    env = os.environ.get("DRVTRAIN_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "drvtrain"


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    writes: int = 0


@dataclass
class KernelCache:
    """CUBINs on disk, one file per key."""
    directory: Path
    writable: bool = True
    stats: CacheStats = field(default_factory=CacheStats)

    def __post_init__(self):
        self.directory = Path(self.directory)
        self._warned = False

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.cubin"

    def load(self, key: str) -> tuple[bytes, dict] | None:
        try:
            blob = self.path(key).read_bytes()
        except OSError:
            return None
        entry = _decode_entry(blob)
        if entry is None:
            self.stats.corrupt += 1
        return entry

    def store(self, key: str, cubin: bytes, meta: dict) -> None:
        if not self.writable:
            return
        blob = _encode_entry(cubin, meta)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._write_atomic(self.path(key), blob)
            self.stats.writes += 1
        except OSError as exc:
            self.writable = False
            if not self._warned:
                self._warned = True
                warnings.warn(f"drvtrain: kernel cache {self.directory} is not writable "
                              f"({exc.strerror or exc}); compiling without caching",
                              CacheWarning, stacklevel=4)

    def _write_atomic(self, path: Path, blob: bytes) -> None:
        # A cache entry need not survive a power cut: its checksum catches a torn one.
        with atomic_file(path, "wb", durable=False) as f:
            f.write(blob)

    def clear(self) -> int:
        """Delete every entry; returns how many were removed."""
        n = 0
        for p in self.directory.glob("*.cubin"):
            p.unlink(missing_ok=True)
            n += 1
        return n


def _encode_entry(cubin: bytes, meta: dict) -> bytes:
    meta_bytes = json.dumps(meta, sort_keys=True).encode()
    payload = struct.pack("<I", len(meta_bytes)) + meta_bytes + cubin
    return _MAGIC + hashlib.sha256(payload).digest() + payload


def _decode_entry(blob: bytes) -> tuple[bytes, dict] | None:
    head = len(_MAGIC) + 32
    if len(blob) < head + 4 or not blob.startswith(_MAGIC):
        return None
    digest, payload = blob[len(_MAGIC):head], blob[head:]
    if hashlib.sha256(payload).digest() != digest:
        return None
    (n,) = struct.unpack_from("<I", payload)
    try:
        meta = json.loads(payload[4:4 + n])
    except ValueError:
        return None
    cubin = payload[4 + n:]
    return (cubin, meta) if cubin else None


_caches: dict[Path, KernelCache] = {}


def default_cache() -> KernelCache:
    """The cache in ``$DRVTRAIN_CACHE_DIR``, else ``~/.cache/drvtrain``."""
    directory = _default_cache_dir()
    cache = _caches.get(directory)
    if cache is None:
        cache = _caches[directory] = KernelCache(directory)
    return cache


# ---------------------------------------------------------------- compilation
def _nvrtc_compile(source: str, name: str, options: list[str], name_expressions) -> tuple[bytes, dict, str]:
    prog = check(nvrtc.nvrtcCreateProgram, source.encode(), name.encode(), 0, [], [])
    try:
        for expr in name_expressions:
            check(nvrtc.nvrtcAddNameExpression, prog, expr.encode())
        status, = nvrtc.nvrtcCompileProgram(prog, len(options), [o.encode() for o in options])
        size = check(nvrtc.nvrtcGetProgramLogSize, prog)
        buf = bytearray(size)
        check(nvrtc.nvrtcGetProgramLog, prog, buf)
        log = bytes(buf).rstrip(b"\0").decode("utf-8", "replace")
        if status == nvrtc.nvrtcResult.NVRTC_ERROR_COMPILATION:
            raise CompileError(name, log)
        if status:
            # Any other failure (an invalid option, say) leaves its reason in the log too.
            raise CompileError(name, log, status)
        size = check(nvrtc.nvrtcGetCUBINSize, prog)
        if size == 0:
            raise CompileError(name, "NVRTC produced no CUBIN; the target must be a real sm_XY\n" + log)
        cubin = bytearray(size)
        check(nvrtc.nvrtcGetCUBIN, prog, cubin)
        lowered = {expr: check(nvrtc.nvrtcGetLoweredName, prog, expr.encode()).decode()
                   for expr in name_expressions}
        return bytes(cubin), lowered, log
    finally:
        check(nvrtc.nvrtcDestroyProgram, prog)


def _normalise_arch(arch: str) -> str:
    arch = arch.strip()
    if re.fullmatch(r"\d{2,3}a?", arch):
        arch = "sm_" + arch
    if not re.fullmatch(r"sm_\d{2,3}a?", arch):
        raise ValueError(f"arch must be a real architecture such as 'sm_90' (CUBIN, never PTX), got {arch!r}")
    return arch


def cuda_include_dir() -> Path:
    """The CUDA toolkit headers, found by cuda.pathfinder, for kernels that need them."""
    from cuda.pathfinder import find_nvidia_header_directory
    found = find_nvidia_header_directory("cudart")
    if not found:
        raise FileNotFoundError("CUDA runtime headers not found; install nvidia-cuda-runtime")
    return Path(found)


def compile_source(source: str, name: str = "source.cu", *, arch: str, include_dirs=(),
                   options=DEFAULT_OPTIONS, name_expressions=(), cache: KernelCache | None = None,
                   use_cache: bool = True, source_dir: Path | None = None) -> CompiledProgram:
    """Compile CUDA C++ ``source`` to CUBIN for ``arch``, through the disk cache.

    ``include_dirs`` are searched for ``#include``, after ``source_dir`` (the
    source file's folder, for ``compile_file``) and before drvtrain's
    ``kernels/`` folder, so user code can include its headers. Nothing else is
    searched: not the current directory, nor an including header's own folder.
    ``name_expressions`` (e.g. ``"scale<float>"``) are instantiated and their
    lowered names returned.
    """
    arch = _normalise_arch(arch)
    dirs = ([Path(source_dir)] if source_dir else []) + [Path(d) for d in include_dirs]
    try:
        dirs.append(kernel_dir())
    except FileNotFoundError:
        pass
    options = list(options) + list(_SEARCH_OPTIONS)
    flags = options + [f"--gpu-architecture={arch}"] + [f"-I{d}" for d in dirs]
    name_expressions = tuple(name_expressions)
    started = time.perf_counter()
    key_material = json.dumps({
        "format": _FORMAT,
        "nvrtc": list(nvrtc_version()),
        "nvrtc_build": nvrtc_build(),
        "arch": arch,
        "options": options,
        "source": hashlib.sha256(source.encode()).hexdigest(),
        "headers": [h for _, h in _local_headers(source, dirs)],
        "names": list(name_expressions),
    }, sort_keys=True)
    key = hashlib.sha256(key_material.encode()).hexdigest()[:40]
    cache = (cache or default_cache()) if use_cache else None
    if cache is not None:
        entry = cache.load(key)
        if entry is not None:
            cache.stats.hits += 1
            cubin, meta = entry
            return CompiledProgram(name, arch, cubin, meta.get("lowered", {}), meta.get("log", ""),
                                   True, (time.perf_counter() - started) * 1e3, key)
        cache.stats.misses += 1
    cubin, lowered, log = _nvrtc_compile(source, name, flags, name_expressions)
    if cache is not None:
        cache.store(key, cubin, {"name": name, "arch": arch, "lowered": lowered, "log": log})
    return CompiledProgram(name, arch, cubin, lowered, log, False,
                           (time.perf_counter() - started) * 1e3, key)


def compile_file(path, *, arch: str, include_dirs=(), options=DEFAULT_OPTIONS,
                 name_expressions=(), cache: KernelCache | None = None,
                 use_cache: bool = True) -> CompiledProgram:
    """Compile a ``.cu`` file; a bare name (``"elementwise.cu"``) means drvtrain's own kernels/."""
    path = Path(path)
    if not path.is_absolute() and not path.exists() and len(path.parts) == 1:
        path = kernel_dir() / path
    try:
        source = path.read_text()
    except OSError as exc:
        raise FileNotFoundError(f"kernel source {path}: {exc.strerror or exc}") from None
    return compile_source(source, path.name, arch=arch, include_dirs=include_dirs, options=options,
                          name_expressions=name_expressions, cache=cache, use_cache=use_cache,
                          source_dir=path.parent)
