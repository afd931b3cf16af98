"""drvtrain: GPU-resident training over the raw CUDA driver API.

Layers, bottom up (imports go only downward):
``driver`` (errors, device) -> ``memory``, ``stream``, ``compiler`` ->
``kernel`` -> ``graph`` -> ``demo`` -> ``cli``.
Importing drvtrain never touches the GPU; the first call that needs one does.
"""
from .compiler import CacheWarning, CompileError, compile_file, compile_source, kernel_dir, kernel_files
from .driver import CaptureError, Closable, Device, DriverError, NoDeviceError, check, get_device
from .graph import Graph, GraphExec, GraphUpdateError, capture
from .kernel import Kernel, Module, builtin_module, dependent_launches, load_module, load_source
from .memory import Arena, ArenaExhausted, DeviceBuffer, MappedBuffer, PinnedBuffer
from .stream import Event, Stream, fork, join

__version__ = "0.1.0"

__all__ = [
    "Arena", "ArenaExhausted", "CacheWarning", "CaptureError", "Closable", "CompileError", "Device",
    "DeviceBuffer", "DriverError", "Event", "Graph", "GraphExec", "GraphUpdateError", "Kernel",
    "MappedBuffer", "Module", "NoDeviceError", "PinnedBuffer", "Stream", "builtin_module",
    "capture", "check", "dependent_launches", "compile_file", "compile_source", "fork", "get_device", "join",
    "kernel_dir", "kernel_files", "load_module", "load_source",
]
