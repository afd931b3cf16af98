"""Modules and kernels: a declared argument signature, packed once, launched cheaply.

A launch with the wrong number or kinds of arguments, or a grid or block the
device cannot run, fails here with a TypeError or ValueError before any
driver call.

A plain launch goes through ``cuLaunchKernel``. The launch options
(``dependent``, ``cluster``, ``cooperative``) go through ``cuLaunchKernelEx``, with the
``CUlaunchConfig`` built once per launch shape and reused: only its stream
changes from one launch to the next.
"""
from __future__ import annotations

import ctypes
import struct
import threading
import warnings
import weakref
from contextlib import contextmanager
from operator import is_ as _is

import numpy as np
from cuda.bindings import driver as cu

from . import driver as _driver
from .compiler import DEFAULT_OPTIONS, CompiledProgram, compile_file, compile_source
from .driver import Closable, DeviceLimits, _tls, check, get_device, release, release_on_collect
from .memory import DeviceBuffer, _closed_message, _on_close

_cuLaunchKernel = cu.cuLaunchKernel  # bound once: it is called on every launch
_cuLaunchKernelEx = cu.cuLaunchKernelEx

# Thread block clusters of up to 8 blocks run on every device that has them;
# up to 16 where the device allows a non-portable size, which a launch asks for
# by setting CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED on the function.
PORTABLE_CLUSTER_SIZE = 8
MAX_CLUSTER_SIZE = 16
# launch(cluster_policy=...): how the hardware places a launch's clusters.
CLUSTER_POLICIES = {
    "spread": cu.CUclusterSchedulingPolicy.CU_CLUSTER_SCHEDULING_POLICY_SPREAD,
    "load_balancing": cu.CUclusterSchedulingPolicy.CU_CLUSTER_SCHEDULING_POLICY_LOAD_BALANCING,
}
_OPTIONS_CC = (9, 0)  # programmatic dependent launch and clusters: Hopper and newer

__all__ = ["dependent_launches", "Module", "Kernel", "ArgPack", "BoundLaunch", "load_module", "load_source",
           "parse_signature", "builtin_module"]

# Argument kinds: their struct format and size. Every argument gets a slot of
# 8 bytes, or of its size where larger (a tensor map's 128), so each is aligned.
# (The driver copies each argument from its own host address into the kernel's
# parameter space at the kernel's own offsets; the host slots only must not overlap.)
_KINDS = {"ptr": "Q", "i32": "i", "u32": "I", "i64": "q", "u64": "Q", "f32": "f", "f64": "d", "tmap": "128s"}
_SIZES = {k: struct.calcsize(f) for k, f in _KINDS.items()}
_SLOTS = {k: max(8, s) for k, s in _SIZES.items()}
_ALIASES = {"pointer": "ptr", "int": "i32", "int32": "i32", "uint32": "u32", "int64": "i64",
            "uint64": "u64", "float": "f32", "float32": "f32", "double": "f64", "float64": "f64",
            "tensor_map": "tmap", "CUtensorMap": "tmap"}
_INT_RANGE = {"i32": (-2**31, 2**31 - 1), "u32": (0, 2**32 - 1), "i64": (-2**63, 2**63 - 1),
              "u64": (0, 2**64 - 1)}


def parse_signature(signature) -> tuple[str, ...]:
    """``"ptr, i32, f32"`` or a sequence of kind names -> a tuple of kinds."""
    parts = signature.replace(",", " ").split() if isinstance(signature, str) else list(signature)
    kinds = []
    for p in parts:
        k = _ALIASES.get(p, p)
        if k not in _KINDS:
            raise ValueError(f"unknown argument kind {p!r}; use one of {sorted(_KINDS)}")
        kinds.append(k)
    return tuple(kinds)


def _as_pointer(value, index: int) -> int:
    ptr = getattr(value, "ptr", None)
    if ptr is not None:
        return ptr
    if isinstance(value, DeviceBuffer) and value.closed:
        raise RuntimeError(f"argument {index}: {_closed_message(value)}")
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"argument {index}: negative device address {value}")
        return int(value)
    iface = getattr(value, "__cuda_array_interface__", None)
    if iface is not None:
        return int(iface["data"][0])
    if isinstance(value, np.ndarray):
        raise TypeError(f"argument {index}: a host numpy array was given where a device pointer "
                        f"is expected; upload it to a DeviceBuffer or use a MappedBuffer")
    raise TypeError(f"argument {index}: expected a device buffer or address, got {type(value).__name__}")


def _as_tensor_map(value, index: int) -> bytes:
    raw = getattr(value, "raw", value)
    if not isinstance(raw, bytes):  # immutable, so a repeated launch may reuse its packing
        raise TypeError(f"argument {index}: expected a TensorMap (drvtrain.tma) for tmap, got {type(value).__name__}")
    if len(raw) != _SIZES["tmap"]:
        raise ValueError(f"argument {index}: a tensor map is {_SIZES['tmap']} bytes, got {len(raw)}")
    return bytes(raw)


def _convert(kind: str, value, index: int):
    if kind == "ptr":
        return _as_pointer(value, index)
    if kind == "tmap":
        return _as_tensor_map(value, index)
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"argument {index}: expected a number for {kind}, got {type(value).__name__}")
    if kind in ("f32", "f64"):
        return float(value)
    if isinstance(value, (float, np.floating)):
        raise TypeError(f"argument {index}: expected an integer for {kind}, got {value!r}")
    lo, hi = _INT_RANGE[kind]
    if not lo <= value <= hi:
        raise ValueError(f"argument {index}: {value} does not fit {kind}")
    return int(value)


# Every live pack, for DeviceBuffer.close(): a pack whose last arguments named the
# buffer forgets them, so Kernel.launch, which skips packing the very same objects
# again, packs them and refuses the closed buffer (a cost at close, none at launch).
_packs: "weakref.WeakSet[ArgPack]" = weakref.WeakSet()


def _forget_closed_buffer(buf) -> None:
    for pack in list(_packs):
        if any(ref is buf for ref in pack.refs):
            pack.refs = ()


_on_close.append(_forget_closed_buffer)


class ArgPack:
    """Kernel arguments packed into one buffer, plus the ``void*[]`` cuLaunchKernel reads.

    Built once and rewritten in place; the driver copies the values at
    launch, so one pack serves every launch of a kernel. The common case is a
    single ``struct.pack_into``; only a failure takes the slow path, which
    names the offending argument.
    """

    def __init__(self, signature: tuple[str, ...]):
        self.signature = signature
        n = len(signature)
        self._struct = struct.Struct("<" + "".join(
            _KINDS[k] + "x" * (_SLOTS[k] - _SIZES[k]) for k in signature))
        self._offsets = [sum(_SLOTS[k] for k in signature[:i]) for i in range(n)]
        self._buffer = bytearray(max(8, self._struct.size))
        self._view = (ctypes.c_char * len(self._buffer)).from_buffer(self._buffer)
        base = ctypes.addressof(self._view)
        self._pointers = (ctypes.c_void_p * max(1, n))(*[base + off for off in self._offsets])
        self.address = ctypes.addressof(self._pointers) if n else 0
        self.fast_pack = _fast_packer(signature, self._struct.pack_into, self._buffer)
        self.refs: tuple = ()  # the Python objects behind the packed arguments
        self._accepted_types: tuple | None = None  # argument types the validating path accepted
        _packs.add(self)

    def pack(self, args) -> None:
        """Pack ``args``; on any error the pack names no arguments, so nothing stale is reused."""
        if len(args) != len(self.signature):
            raise TypeError(f"kernel takes {len(self.signature)} arguments "
                            f"({', '.join(self.signature)}), got {len(args)}")
        # A failed pack_into may have rewritten part of the buffer: until this
        # pack succeeds the buffer matches no arguments.
        self.refs = ()
        types = tuple(map(type, args))
        if types != self._accepted_types:
            # Types not yet seen: the validating path decides, so the fast path
            # only ever packs type combinations that path accepted (a bool is
            # never an i32). Values are still range-checked by struct.
            values = [_convert(k, a, i) for i, (k, a) in enumerate(zip(self.signature, args))]
            self._struct.pack_into(self._buffer, 0, *values)
            self._accepted_types = types
        else:
            try:
                self.fast_pack(args)
            except (struct.error, TypeError, OverflowError):
                values = [_convert(k, a, i) for i, (k, a) in enumerate(zip(self.signature, args))]
                self._struct.pack_into(self._buffer, 0, *values)
        self.refs = args

    def set(self, index: int, value) -> None:
        """Rewrite one argument in place."""
        kind = self.signature[index]
        value_packed = _convert(kind, value, index)
        struct.pack_into("<" + _KINDS[kind], self._buffer, self._offsets[index], value_packed)
        refs = list(self.refs)
        refs[index] = value
        self.refs = tuple(refs)

    def values(self) -> list:
        """The packed values, as the kernel will see them."""
        return [v for v in self._struct.unpack_from(self._buffer, 0)]


def _fast_packer(signature: tuple[str, ...], pack_into, buffer):
    """A function that packs ``args`` with one ``pack_into`` call, unrolled for the signature.

    Generated because this runs on every launch: no per-argument loop, and a
    buffer costs one ``getattr`` (a plain int address also a type check, a
    tensor map one size check). It does not check the count or the kinds;
    anything it cannot pack raises, and ``ArgPack.pack`` retries on the
    validating path.

    A pointer is packed as it stands only from ``.ptr`` or a plain int; any
    other object goes through ``_as_pointer``. struct would pack an object
    with ``__index__`` (a one-element integer tensor, say) by its value, where
    ``_as_pointer`` reads its ``__cuda_array_interface__`` address.
    """
    terms = [f"(p{i} if (p{i} := getattr(args[{i}], 'ptr', None)) is not None else "
             f"args[{i}] if type(args[{i}]) is int else pointer(args[{i}], {i}))" if k == "ptr" else
             f"tmap(args[{i}], {i})" if k == "tmap" else f"args[{i}]"
             for i, k in enumerate(signature)]
    return eval(f"lambda args, pack_into=pack_into, buffer=buffer: pack_into(buffer, 0, {', '.join(terms)})",
                {"tmap": _as_tensor_map, "pointer": _as_pointer}, {"pack_into": pack_into, "buffer": buffer})


def _dims(value, what: str) -> tuple[int, int, int]:
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        dims = (int(value), 1, 1)
    else:
        try:
            dims = tuple(int(v) for v in value) if not isinstance(value, (str, bytes)) else None
        except (TypeError, ValueError):  # not iterable, or items that are not numbers
            dims = None
        if dims is None:
            raise TypeError(f"{what} must be an int or a tuple of up to 3 ints, got {value!r}")
        if not 1 <= len(dims) <= 3:
            raise TypeError(f"{what} must have 1 to 3 dimensions, got {value!r}")
        dims = dims + (1,) * (3 - len(dims))
    return dims


class _DynamicShared:
    """A function's dynamic shared memory allowance, shared by every Kernel made from it.

    Two Kernels of one ``CUfunction`` (say with and without ``fixed_block``)
    share one ``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES``: one must
    never lower what the other raised. Read from the driver on first need.
    Also whether the function may run clusters above the portable size.
    """
    __slots__ = ("allowed", "static", "non_portable")

    def __init__(self):
        self.allowed: int | None = None  # the attribute as last read or set
        self.static = 0  # bytes of the function's own __shared__ arrays
        self.non_portable = False  # CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED set


class Kernel:
    """A ``CUfunction`` with its argument signature and the limits its launches obey.

    ``compute_capability`` gates the launch options that need Hopper; it is
    the module's device's unless given, and unknown (options refused) for a
    kernel made without either.
    """

    def __init__(self, function, name: str, signature, limits: DeviceLimits,
                 max_threads: int | None = None, module=None, fixed_block: bool = False,
                 compute_capability: tuple[int, int] | None = None, dynamic_shared=None):
        self.function = function
        self.name = name
        self.closed = False  # set when its module is closed: every launch is refused from then on
        self.signature = parse_signature(signature)
        self.limits = limits
        self.max_threads = max_threads or limits.max_threads_per_block
        # A kernel whose shared arrays and reductions are sized for one block
        # declares it once, in `__launch_bounds__(N)` in its .cu file; the
        # launch reads it here and refuses any other block.
        self.block: int | None = self.max_threads if fixed_block else None
        self._module = module  # keeps the module loaded while the kernel lives
        self._pack = ArgPack(self.signature)
        self._validated: dict = {}  # launch shapes already checked
        self._configs: dict = {}  # launch shapes with options: (grid, block, CUlaunchConfig)
        self.signature_checked = False  # set when the CUBIN's parameter sizes confirmed it
        if compute_capability is None and module is not None:
            compute_capability = module.device.compute_capability
        self.compute_capability = tuple(compute_capability) if compute_capability else None
        self._dependent_capable = bool(self.compute_capability) and self.compute_capability >= _OPTIONS_CC
        self._dynamic_shared = dynamic_shared if dynamic_shared is not None else _DynamicShared()

    # -------------------------------------------------------------- validation
    def check_launch(self, grid, block, shared_mem: int = 0) -> tuple[tuple, tuple]:
        """Normalise grid and block to 3-tuples and check them against the limits."""
        try:
            return self._validated[(grid, block, shared_mem)]
        except (KeyError, TypeError):  # not seen yet, or unhashable (a list)
            pass
        g, b = _dims(grid, "grid"), _dims(block, "block")
        lim = self.limits
        for axis, (n, top) in enumerate(zip(g, lim.max_grid)):
            if not 1 <= n <= top:
                raise ValueError(f"{self.name}: grid dimension {'xyz'[axis]} = {n} outside 1..{top}")
        for axis, (n, top) in enumerate(zip(b, lim.max_block)):
            if not 1 <= n <= top:
                raise ValueError(f"{self.name}: block dimension {'xyz'[axis]} = {n} outside 1..{top}")
        threads = b[0] * b[1] * b[2]
        if self.block is not None and b != (self.block, 1, 1):
            raise ValueError(f"{self.name}: launched with block {b}, but the kernel is written for "
                             f"exactly ({self.block}, 1, 1) threads (its __launch_bounds__); "
                             f"launch with kernel.block")
        if threads > self.max_threads:
            raise ValueError(f"{self.name}: block of {threads} threads exceeds this kernel's "
                             f"limit of {self.max_threads}")
        if isinstance(shared_mem, bool) or not isinstance(shared_mem, (int, np.integer)):
            raise TypeError(f"{self.name}: shared_mem must be a number of bytes, got {shared_mem!r}")
        if shared_mem < 0:
            raise ValueError(f"{self.name}: shared_mem = {shared_mem} bytes is negative")
        if shared_mem > lim.max_shared_per_block_optin:
            raise ValueError(f"{self.name}: {shared_mem} bytes of dynamic shared memory requested; the "
                             f"device allows at most {lim.max_shared_per_block_optin} per block "
                             f"(its opt-in maximum)")
        if shared_mem and self.function is not None:
            self._allow_dynamic_shared(int(shared_mem))
        if len(self._validated) < 64:
            try:
                self._validated[(grid, block, shared_mem)] = (g, b)
            except TypeError:
                pass
        return g, b

    def max_dynamic_shared(self) -> int:
        """The most dynamic shared memory (bytes) one block of this kernel may ask
        for: the device's opt-in maximum less the kernel's static ``__shared__`` arrays."""
        state = self._dynamic_shared
        if state.allowed is None:
            self._allow_dynamic_shared(0)  # reads the attributes, changes nothing
        return self.limits.max_shared_per_block_optin - state.static

    def _allow_dynamic_shared(self, shared_mem: int) -> None:
        """Raise the function's dynamic shared memory attribute to ``shared_mem`` if it is lower.

        Beyond 48 KiB a block must opt in, per function. The attribute only
        ever grows, so launches of any smaller size stay valid; what the
        function's static ``__shared__`` arrays take counts against the
        device's opt-in maximum too.
        """
        if self.closed:
            raise _closed_kernel(self)
        state = self._dynamic_shared
        attr = cu.CUfunction_attribute
        if state.allowed is None:
            state.static = check(cu.cuFuncGetAttribute, attr.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
                                 self.function)
            state.allowed = check(cu.cuFuncGetAttribute,
                                  attr.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, self.function)
        if shared_mem <= state.allowed:
            return
        optin = self.limits.max_shared_per_block_optin
        if shared_mem + state.static > optin:
            raise ValueError(f"{self.name}: {shared_mem} bytes of dynamic shared memory requested; the "
                             f"device's opt-in maximum is {optin} bytes per block and the kernel's "
                             f"static __shared__ arrays take {state.static}, so at most "
                             f"{optin - state.static} are available")
        check(cu.cuFuncSetAttribute, self.function,
              attr.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared_mem)
        state.allowed = shared_mem

    def max_resident_blocks(self, block, shared_mem: int = 0) -> int:
        """How many blocks of ``block`` threads (and ``shared_mem`` bytes of dynamic
        shared memory) the whole device holds at once: the occupancy per SM times
        the SMs. A cooperative launch may have at most this many."""
        b = _dims(block, "block")

        def query():
            if shared_mem:
                self._allow_dynamic_shared(int(shared_mem))  # else the occupancy of that much is 0
            per_sm = check(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor, self.function, b[0] * b[1] * b[2],
                           int(shared_mem))
            return int(per_sm) * self._module.device.sm_count

        return self._occupancy(("resident", b, shared_mem), query)

    def max_active_clusters(self, cluster, block, shared_mem: int = 0) -> int:
        """How many clusters of shape ``cluster`` (blocks of ``block`` threads and
        ``shared_mem`` bytes of dynamic shared memory) the device runs at once
        (``cuOccupancyMaxActiveClusters``). A cluster's blocks share one GPC, so
        this can be less than ``max_resident_blocks`` divided by the cluster's
        size: a grid of more clusters than this runs in more than one wave.
        Compute capability 9.0+ and at most 16 blocks a cluster, as for
        ``launch(cluster=...)``; otherwise a ``ValueError``. 0 means the device
        cannot run one such cluster at all (say 16 blocks that each need an SM
        where a GPC has fewer free)."""
        b = _dims(block, "block")
        c = _dims(cluster, "cluster")
        query = lambda: int(check(cu.cuOccupancyMaxActiveClusters, self.function,
                                  self._launch_config(c, b, shared_mem, False, c)[2]))
        return self._occupancy(("clusters", c, b, shared_mem), query)

    def _occupancy(self, key, query) -> int:
        """An occupancy count, queried once per shape (the kernel must be loaded)."""
        if self.closed:
            raise _closed_kernel(self)
        try:
            return self._configs[key]
        except KeyError:
            pass
        if self.function is None or self._module is None:
            raise ValueError(f"{self.name}: occupancy needs a loaded kernel")
        self._configs[key] = value = query()
        return value

    def _launch_config(self, grid, block, shared_mem, dependent, cluster, cooperative=False,
                       cluster_policy=None) -> tuple:
        """``(grid, block, CUlaunchConfig)`` for a launch with options, checked and memoised.

        The config and its attributes are built once per shape; a launch only
        sets its stream.
        """
        if self.closed:
            raise _closed_kernel(self)
        key = (grid, block, shared_mem, dependent, cluster, cooperative, cluster_policy)
        try:
            return self._configs[key]
        except (KeyError, TypeError):
            pass
        g, b = self.check_launch(grid, block, shared_mem)
        if not isinstance(dependent, (bool, np.bool_)):
            raise TypeError(f"{self.name}: dependent must be True or False, got {dependent!r}")
        attrs = []
        if dependent:
            self._require_options_cc("dependent=True (programmatic dependent launch)")
            a = cu.CUlaunchAttribute()
            a.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            a.value.programmaticStreamSerializationAllowed = 1
            attrs.append(a)
        if not isinstance(cooperative, (bool, np.bool_)):
            raise TypeError(f"{self.name}: cooperative must be True or False, got {cooperative!r}")
        if cooperative:
            if cluster is not None:
                raise ValueError(f"{self.name}: a launch is either cooperative or in clusters, not both")
            blocks, resident = g[0] * g[1] * g[2], self.max_resident_blocks(b, shared_mem)
            if blocks > resident:
                raise ValueError(f"{self.name}: a cooperative launch of {blocks} blocks, but at most {resident} "
                                 f"blocks of {b[0] * b[1] * b[2]} threads fit on the device at once "
                                 f"(max_resident_blocks)")
            a = cu.CUlaunchAttribute()
            a.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_COOPERATIVE
            a.value.cooperative = 1
            attrs.append(a)
        if cluster is not None:
            c = self._check_cluster(cluster, g)
            a = cu.CUlaunchAttribute()
            a.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            a.value.clusterDim.x, a.value.clusterDim.y, a.value.clusterDim.z = c
            attrs.append(a)
        if cluster_policy is not None:
            if cluster_policy not in CLUSTER_POLICIES:
                raise ValueError(f"{self.name}: cluster_policy must be one of {sorted(CLUSTER_POLICIES)} or None, "
                                 f"got {cluster_policy!r}")
            if cluster is None:
                raise ValueError(f"{self.name}: cluster_policy={cluster_policy!r} places clusters; "
                                 f"the launch has none (cluster=None)")
            a = cu.CUlaunchAttribute()
            a.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE
            a.value.clusterSchedulingPolicyPreference = CLUSTER_POLICIES[cluster_policy]
            attrs.append(a)
        config = cu.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = g
        config.blockDimX, config.blockDimY, config.blockDimZ = b
        config.sharedMemBytes = int(shared_mem)
        config.attrs = attrs  # copied into the config's own array
        config.numAttrs = len(attrs)
        entry = (g, b, config)
        if len(self._configs) < 64:
            try:
                self._configs[key] = entry
            except TypeError:
                pass
        return entry

    def _check_cluster(self, cluster, g) -> tuple[int, int, int]:
        c = _dims(cluster, "cluster")
        self._require_options_cc(f"cluster={cluster!r} (thread block clusters)")
        if min(c) < 1:
            raise ValueError(f"{self.name}: cluster dimensions must be at least 1, got {c}")
        size = c[0] * c[1] * c[2]
        if size > MAX_CLUSTER_SIZE:
            raise ValueError(f"{self.name}: a cluster of {c} is {size} blocks; at most {MAX_CLUSTER_SIZE} "
                             f"(the portable maximum is {PORTABLE_CLUSTER_SIZE}; above it the function is "
                             f"allowed the non-portable size)")
        for axis in range(3):
            if g[axis] % c[axis]:
                raise ValueError(f"{self.name}: grid {g} is not divisible by cluster {c} along "
                                 f"{'xyz'[axis]}")
        if size > PORTABLE_CLUSTER_SIZE:
            self._allow_non_portable_clusters()
        return c

    def _allow_non_portable_clusters(self) -> None:
        """Let the function run clusters above the portable size (once per function)."""
        state = self._dynamic_shared
        if state.non_portable or self.function is None:
            return
        check(cu.cuFuncSetAttribute, self.function,
              cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
        state.non_portable = True

    def _require_options_cc(self, what: str) -> None:
        cc = self.compute_capability
        if cc is None or cc < _OPTIONS_CC:
            have = "an unknown device" if cc is None else f"compute capability {cc[0]}.{cc[1]}"
            raise ValueError(f"{self.name}: {what} needs compute capability "
                             f"{_OPTIONS_CC[0]}.{_OPTIONS_CC[1]} or newer; the kernel's device has {have}")

    # -------------------------------------------------------------- launching
    def launch(self, grid, block, *args, stream, shared_mem: int = 0, dependent: bool | None = None,
               cluster=None, cooperative: bool = False, cluster_policy: str | None = None) -> None:
        """Pack ``args`` into the kernel's reusable pack and launch on ``stream``.

        The hot path of every eager launch: a memoised shape check, and
        arguments that are the very objects of the previous launch are not
        packed again.

        ``shared_mem``: bytes of dynamic (``extern __shared__``) shared memory.
        Above 48 KiB the function's limit is raised once, up to the device's
        opt-in maximum less the kernel's static shared arrays; more is refused.

        ``dependent=True``: programmatic dependent launch (compute capability
        9.0+). The kernel may start while the kernel before it on the stream
        is still running, eagerly and in a captured graph (a programmatic
        edge). The contract: the kernel calls ``dt_wait_prior_grid()``
        (common.cuh) in every thread before its first global memory access,
        read or write, that could touch what earlier work writes or reads;
        that call returns once the previous kernel has finished and its
        writes are visible. Work before it (index math, shared memory setup)
        overlaps the previous kernel's tail; a kernel that never calls it is
        not ordered after the previous kernel at all. The previous kernel may
        call ``dt_allow_dependents()`` to let this one start even earlier.
        After work that is not a kernel (a copy, an event wait) the launch is
        ordered as usual. ``dependent=None`` (the default) follows the
        enclosing ``dependent_launches`` scope; ``dependent=False`` is an
        ordinary launch even inside one.

        ``cluster=(x, y, z)``: launch as thread block clusters of that shape
        (compute capability 9.0+); the grid must divide by it, and a cluster
        is at most 16 blocks. Up to 8 (the portable size) run on every device
        with clusters; above 8 the function is first allowed the non-portable
        size, and the device may still refuse the launch (``max_active_clusters``
        says 0 then). ``cluster_policy`` (with
        ``cluster`` only): how the hardware places the clusters on the GPU's
        SMs, ``"spread"`` or ``"load_balancing"`` (the driver's scheduling-policy
        preference); None leaves the default.

        ``cooperative=True``: every block of the grid is resident at once, so
        the kernel may wait for all of them (``dt_grid_barrier`` in common.cuh).
        The grid may have at most ``max_resident_blocks(block, shared_mem)``
        blocks; more is refused. It combines with ``dependent``, not with
        ``cluster``.
        """
        if dependent is None:
            dependent = _scope.dependent and self._dependent_capable
        if dependent or cluster is not None or cooperative or cluster_policy is not None:
            self._launch_with_options(grid, block, args, stream, shared_mem, dependent, cluster, cooperative,
                                      cluster_policy)
            return
        try:
            g, b = self._validated[(grid, block, shared_mem)]
        except (KeyError, TypeError):
            g, b = self.check_launch(grid, block, shared_mem)
        pack = self._pack
        # The very same objects as last time (buffers, numbers): already packed and checked.
        if len(args) != len(pack.refs) or not all(map(_is, args, pack.refs)):
            pack.pack(args)
        _launch(self, g, b, shared_mem, stream, pack)

    def _launch_with_options(self, grid, block, args, stream, shared_mem, dependent, cluster,
                             cooperative=False, cluster_policy=None) -> None:
        # Every option is checked before the pack is touched, so a refused
        # launch leaves the pack matching its references.
        _, _, config = self._launch_config(grid, block, shared_mem, dependent, cluster, cooperative, cluster_policy)
        pack = self._pack
        if len(args) != len(pack.refs) or not all(map(_is, args, pack.refs)):
            pack.pack(args)
        _launch_ex(self, config, stream, pack)

    def bind(self, grid, block, *args, shared_mem: int = 0, dependent: bool | None = None,
             cluster=None, cooperative: bool = False, cluster_policy: str | None = None) -> "BoundLaunch":
        """A launch with its arguments packed once, for replaying many times.

        The options are those of :meth:`launch`; ``dependent=None`` follows the
        ``dependent_launches`` scope around this call (not around the replays).
        """
        if self.closed:
            raise _closed_kernel(self)
        if dependent is None:
            dependent = _scope.dependent and self._dependent_capable
        if dependent or cluster is not None or cooperative or cluster_policy is not None:
            g, b, config = self._launch_config(grid, block, shared_mem, dependent, cluster, cooperative,
                                               cluster_policy)
            pack = ArgPack(self.signature)
            pack.pack(args)
            cluster_dims = None if cluster is None else _dims(cluster, "cluster")
            return _BoundLaunchWithOptions(self, g, b, shared_mem, pack, config, bool(dependent), cluster_dims)
        g, b = self.check_launch(grid, block, shared_mem)
        pack = ArgPack(self.signature)
        pack.pack(args)
        return BoundLaunch(self, g, b, shared_mem, pack)

    def __repr__(self) -> str:
        return f"<Kernel {self.name}({', '.join(self.signature)})>"


class _Scope(threading.local):
    # Per thread, like captures: another thread's launches are not made dependent.
    dependent = False


_scope = _Scope()


@contextmanager
def dependent_launches(enabled: bool = True):
    """Inside the block, every ``Kernel.launch`` that does not pass ``dependent``
    is a dependent launch (``dependent=True``) on devices of compute capability
    9.0+; elsewhere the block changes nothing. For code that queues only kernels honouring the
    ``dt_wait_prior_grid()`` contract, as every kernel of drvtrain does: a
    training step wraps its enqueue in it, eagerly and under capture alike.
    ``enabled=False`` makes the block a no-op, so callers can pass a setting.
    Scopes nest; the outer setting is restored on exit."""
    previous = _scope.dependent
    _scope.dependent = bool(enabled) or previous
    try:
        yield
    finally:
        _scope.dependent = previous


def _keep_for_captures(captures, kernel, refs) -> None:
    # What a captured graph uses must outlive its replays: the buffers, and
    # the kernel, which keeps its module loaded.
    for capture in captures:
        capture.keepalive.append((kernel, refs))


def _closed_kernel(kernel: Kernel) -> RuntimeError:
    return RuntimeError(f"{kernel.name}: its module is closed; load the module again for a new kernel")


def _launch(kernel: Kernel, g, b, shared_mem, stream, pack: ArgPack) -> None:
    try:
        handle = stream.handle
    except AttributeError:
        raise TypeError("stream must be a drvtrain Stream; the legacy stream is never used") from None
    if kernel.closed:
        raise _closed_kernel(kernel)
    captures = getattr(_tls, "captures", None)
    if captures:
        _keep_for_captures(captures, kernel, pack.refs)
    status, = _cuLaunchKernel(kernel.function, g[0], g[1], g[2], b[0], b[1], b[2],
                              shared_mem, handle, pack.address, 0)
    if status:
        _driver.raise_status("cuLaunchKernel", status)


def _launch_ex(kernel: Kernel, config, stream, pack: ArgPack) -> None:
    """``cuLaunchKernelEx`` with a memoised config: only the stream is set per launch.

    Like the pack, the config is the kernel's own; a Kernel is launched from
    one thread at a time.
    """
    try:
        handle = stream.handle
    except AttributeError:
        raise TypeError("stream must be a drvtrain Stream; the legacy stream is never used") from None
    if kernel.closed:
        raise _closed_kernel(kernel)
    captures = getattr(_tls, "captures", None)
    if captures:
        _keep_for_captures(captures, kernel, pack.refs)
    config.hStream = handle
    status, = _cuLaunchKernelEx(config, kernel.function, pack.address, 0)
    if status:
        _driver.raise_status("cuLaunchKernelEx", status)


class BoundLaunch:
    """A kernel, its launch shape and its packed arguments."""

    dependent = False
    cluster = None

    def __init__(self, kernel: Kernel, grid, block, shared_mem: int, pack: ArgPack):
        self.kernel, self.grid, self.block, self.shared_mem, self.pack = kernel, grid, block, shared_mem, pack

    def set(self, index: int, value) -> None:
        self.pack.set(index, value)

    def launch(self, stream) -> None:
        _launch(self.kernel, self.grid, self.block, self.shared_mem, stream, self.pack)


class _BoundLaunchWithOptions(BoundLaunch):
    """A BoundLaunch with launch options: replayed through ``cuLaunchKernelEx``."""

    def __init__(self, kernel: Kernel, grid, block, shared_mem: int, pack: ArgPack, config,
                 dependent: bool, cluster):
        super().__init__(kernel, grid, block, shared_mem, pack)
        self.config, self.dependent, self.cluster = config, dependent, cluster

    def launch(self, stream) -> None:
        _launch_ex(self.kernel, self.config, stream, self.pack)


class Module(Closable):
    """A loaded CUBIN and the kernels taken from it.

    Each ``Kernel`` keeps its module loaded. Once the module and its last kernel
    are dropped the module unloads, and the driver's unload waits for running
    kernels (the module's own at least): keep the module (or a kernel of it)
    alive while launches of it should overlap the host and later work."""

    def __init__(self, program: CompiledProgram, device=None):
        self.device = device or get_device()
        # sm_90a (arch-specific features such as wgmma) runs on exactly sm_90.
        if program.arch not in (self.device.arch, self.device.arch + "a"):
            raise ValueError(f"{program.name} was compiled for {program.arch}, the device is {self.device.arch}")
        self.program = program
        self.handle = check(cu.cuModuleLoadData, program.cubin)
        self._finalizer = release_on_collect(self, release, cu.cuModuleUnload, self.handle)
        # Weak: a kernel keeps its module loaded, not the other way round, so
        # dropping the last reference frees a module without waiting for the GC.
        self._kernels: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._dynamic_shared: dict[str, _DynamicShared] = {}  # per function symbol
        self._graphs: weakref.WeakSet = weakref.WeakSet()  # executable graphs that replay its kernels

    def kernel(self, name: str, signature, *, fixed_block: bool = False) -> Kernel:
        """The kernel ``name`` (a function name or a compiled name expression).

        The signature is checked against the parameter sizes in the CUBIN.
        ``fixed_block=True``: the kernel only works with the block of its
        ``__launch_bounds__``; ``Kernel.block`` holds it and other blocks are refused.
        """
        key = (name, parse_signature(signature), fixed_block)
        self._require_open()
        kern = self._kernels.get(key)
        if kern is None:
            symbol = self.program.lowered_names.get(name, name)
            function = check(cu.cuModuleGetFunction, self.handle, symbol.encode())
            max_threads = check(cu.cuFuncGetAttribute,
                                cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, function)
            kern = Kernel(function, name, key[1], self.device.limits, max_threads, module=self,
                          fixed_block=fixed_block,
                          dynamic_shared=self._dynamic_shared.setdefault(symbol, _DynamicShared()))
            _check_param_sizes(kern, function)
            self._kernels[key] = kern
        return kern

    def _require_open(self) -> None:
        if self.handle is None:
            raise RuntimeError(f"the module {self.program.name} is closed")

    def read_global(self, name: str, dtype, count: int) -> np.ndarray:
        """A host copy of ``count`` elements of ``dtype`` from the start of the module's
        device variable ``name`` (an ``extern "C"`` ``__device__`` or ``__constant__``
        array), read synchronously. ``KeyError`` when the module has no such variable."""
        _driver.guard_sync("Module.read_global")
        self._require_open()
        status, ptr, size = cu.cuModuleGetGlobal(self.handle, name.encode())
        if status == cu.CUresult.CUDA_ERROR_NOT_FOUND:
            raise KeyError(f"{self.program.name} has no device variable {name}")
        if status:
            _driver.raise_status("cuModuleGetGlobal", status)
        out = np.empty(count, dtype)
        if out.nbytes > size:
            raise ValueError(f"{name} holds {size} bytes, {out.nbytes} requested")
        check(cu.cuCtxSynchronize)  # kernels on non-blocking streams may still write it
        check(cu.cuMemcpyDtoH, out.ctypes.data, ptr, out.nbytes)
        return out

    def close(self) -> None:
        """Unload the module now. Its kernels refuse every later launch, and graphs
        captured with them can no longer be instantiated. Refused (nothing changes)
        while an executable graph that replays its kernels is open: close those first."""
        if self.handle is None:
            return
        live = [exe for exe in self._graphs if not exe.closed]
        if live:
            raise RuntimeError(f"the module {self.program.name} is still replayed by {len(live)} executable "
                               f"graph{'s' if len(live) > 1 else ''}: close {'them' if len(live) > 1 else 'it'} "
                               f"first")
        for kern in list(self._kernels.values()):
            kern.closed, kern.function = True, None
        self._kernels.clear()
        self._finalizer()
        self.handle = None


def _param_count(function) -> int | None:
    """The kernel's parameter count from the driver, or None where the driver cannot say."""
    get_count = getattr(cu, "cuFuncGetParamCount", None)
    if get_count is None:
        return None
    try:
        status, count = get_count(function)
    except RuntimeError:  # the bindings know the call, the installed driver does not
        return None
    return None if status else int(count)


_unchecked_warned = False


def _check_param_sizes(kernel: Kernel, function) -> None:
    """Compare the declared signature with the parameter count and sizes in the CUBIN.

    Asks only for parameters that exist, so the driver never reports a failed
    query. Where the driver cannot count parameters, the declared ones are
    checked (a declared parameter the kernel lacks is found; an extra one the
    declaration lacks is not); where it offers no parameter queries at all,
    the check is unavailable: one warning, and ``kernel.signature_checked``
    stays False.
    """
    global _unchecked_warned
    declared = len(kernel.signature)
    count = _param_count(function)
    if count is not None and count != declared:
        raise TypeError(f"kernel {kernel.name} takes {count} parameters, "
                        f"the declared signature has {declared}: {kernel.signature}")
    get_info = getattr(cu, "cuFuncGetParamInfo", None)
    for i, kind in enumerate(kernel.signature):
        try:
            status, _offset, size = get_info(function, i) if get_info else (True, 0, 0)
        except RuntimeError:  # not in the installed driver
            status = True
        if status:
            if count is None and i > 0:
                raise TypeError(f"kernel {kernel.name} takes {i} parameters, "
                                f"the declared signature has {declared}: {kernel.signature}")
            if not _unchecked_warned:
                _unchecked_warned = True
                warnings.warn("this CUDA driver cannot report kernel parameters: kernel signatures "
                              "are not checked against the CUBIN", RuntimeWarning, stacklevel=3)
            return
        if size != _SIZES[kind]:
            raise TypeError(f"kernel {kernel.name} parameter {i} is {size} bytes, "
                            f"declared {kind} is {_SIZES[kind]}")
    kernel.signature_checked = True


def _check_arch_specific(device, arch_specific: bool) -> None:
    if arch_specific and tuple(device.compute_capability) < (9, 0):
        raise ValueError(f"arch-specific targets (sm_90a and later) need compute capability 9.0 or newer; "
                         f"this device is {device.arch}")


def load_module(path, *, include_dirs=(), options=DEFAULT_OPTIONS, name_expressions=(),
                cache=None, device=None, arch_specific: bool = False) -> Module:
    """Compile (through the cache) and load a ``.cu`` file for the current device.

    A bare file name such as ``"elementwise.cu"`` means drvtrain's own kernels/.
    ``arch_specific``: compile for the device's arch-specific target (``sm_90a``
    on an sm_90 device), whose features (wgmma, ...) run on that architecture
    only.
    """
    device = device or get_device()
    _check_arch_specific(device, arch_specific)
    program = compile_file(path, arch=device.arch + ("a" if arch_specific else ""), include_dirs=include_dirs,
                           options=options, name_expressions=name_expressions, cache=cache)
    return Module(program, device)


def load_source(source: str, name: str = "source.cu", *, include_dirs=(), options=DEFAULT_OPTIONS,
                name_expressions=(), cache=None, device=None, arch_specific: bool = False) -> Module:
    """Compile (through the cache) and load a CUDA C++ source string
    (``arch_specific``: see :func:`load_module`)."""
    device = device or get_device()
    _check_arch_specific(device, arch_specific)
    program = compile_source(source, name, arch=device.arch + ("a" if arch_specific else ""),
                             include_dirs=include_dirs, options=options, name_expressions=name_expressions,
                             cache=cache)
    return Module(program, device)


_module_cache: dict[tuple, Module] = {}


def builtin_module(filename: str, *, arch_specific: bool = False) -> Module:
    """drvtrain's own kernel file, compiled and loaded once per process and device
    (``arch_specific``: see :func:`load_module`)."""
    device = get_device()
    key = (device.ordinal, filename, arch_specific)
    mod = _module_cache.get(key)
    if mod is None or mod.handle is None:  # not loaded yet, or closed by a caller
        mod = _module_cache[key] = load_module(filename, device=device, arch_specific=arch_specific)
    return mod

