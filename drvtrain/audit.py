"""The hot-loop audit: every driver call drvtrain makes while a loop runs, and a lint of a graph.

``count_driver_calls`` installs a counting wrapper around ``cuda.bindings.driver``
as drvtrain's modules see it (each module's ``cu`` name, the two launch
functions bound once in ``kernel.py`` and the tensor-map encoder that ``tma.py``
calls through ctypes), runs the loop, and restores everything.
It counts calls; it does not grep source code, so a call hidden behind any
helper is still seen.
"""
from __future__ import annotations

import contextlib
import sys
from collections import Counter
from dataclasses import dataclass

from cuda.bindings import driver as _real_driver

__all__ = ["CallCounts", "count_driver_calls", "Criterion", "classify", "format_table"]

# Driver calls by the rule of the hot loop they would break.
_CATEGORIES = {
    "synchronisations": ("cuStreamSynchronize", "cuEventSynchronize", "cuCtxSynchronize"),
    "host-to-device copies": ("cuMemcpyHtoD", "cuMemcpyHtoDAsync", "cuMemcpyHtoD_v2", "cuMemcpyHtoDAsync_v2"),
    "device-to-host copies": ("cuMemcpyDtoH", "cuMemcpyDtoHAsync", "cuMemcpyDtoH_v2", "cuMemcpyDtoHAsync_v2"),
    "device-to-device copies": ("cuMemcpyDtoD", "cuMemcpyDtoDAsync", "cuMemcpy", "cuMemcpyAsync"),
    "allocations and frees": ("cuMemAlloc", "cuMemAlloc_v2", "cuMemFree", "cuMemFree_v2", "cuMemHostAlloc",
                              "cuMemFreeHost", "cuMemAllocAsync", "cuMemFreeAsync", "cuMemAllocHost"),
    "kernel launches outside a graph": ("cuLaunchKernel", "cuLaunchKernelEx", "cuLaunchCooperativeKernel"),
    "memsets": ("cuMemsetD8", "cuMemsetD32", "cuMemsetD8Async", "cuMemsetD32Async"),
    "tensor maps encoded": ("cuTensorMapEncodeTiled",),
}


@dataclass
class CallCounts:
    """Driver calls by name over ``iterations`` iterations of a loop."""
    calls: Counter
    iterations: int

    def per_iteration(self, name: str) -> float:
        return self.calls.get(name, 0) / max(1, self.iterations)

    def category(self, category: str) -> int:
        return sum(self.calls.get(n, 0) for n in _CATEGORIES[category])


class _CountingDriver:
    """Looks like ``cuda.bindings.driver``; counts every ``cu*`` function called through it."""

    def __init__(self, real, calls: Counter):
        self._real = real
        self._calls = calls
        self._wrapped = {}

    def __getattr__(self, name):
        attr = getattr(self._real, name)
        if not (name.startswith("cu") and callable(attr)) or isinstance(attr, type):
            return attr
        wrapped = self._wrapped.get(name)
        if wrapped is None:
            calls = self._calls

            def wrapped(*args, _fn=attr, _name=name):
                calls[_name] += 1
                return _fn(*args)
            wrapped.__name__ = name
            self._wrapped[name] = wrapped
        return wrapped


@contextlib.contextmanager
def count_driver_calls():
    """Yield a Counter that fills with the driver calls drvtrain makes inside the block."""
    calls: Counter = Counter()
    proxy = _CountingDriver(_real_driver, calls)
    patched = []  # (module, attribute, original), in the order installed

    def count(module, attr: str, name: str) -> None:
        # Names bound once, which the module's `cu` does not reach: each call is counted and passed on.
        original = getattr(module, attr)

        def counted(*args):
            calls[name] += 1
            return original(*args)
        patched.append((module, attr, original))
        setattr(module, attr, counted)

    try:  # a failure while installing undoes what was installed
        for name, module in list(sys.modules.items()):
            if (name == "drvtrain" or name.startswith("drvtrain.")) and getattr(module, "cu", None) is _real_driver:
                patched.append((module, "cu", _real_driver))
                module.cu = proxy
        from . import kernel, tma
        count(kernel, "_cuLaunchKernel", "cuLaunchKernel")
        count(kernel, "_cuLaunchKernelEx", "cuLaunchKernelEx")  # dependent, cluster and cooperative launches
        count(tma, "_encode_tiled", "cuTensorMapEncodeTiled")
        yield calls
    finally:
        for module, attr, original in reversed(patched):
            setattr(module, attr, original)


@dataclass(frozen=True)
class Criterion:
    name: str
    required: str
    measured: str
    passed: bool


def classify(counts: CallCounts) -> list[Criterion]:
    """The hot-loop rules: none of these calls may happen per step."""
    rows = []
    for category in _CATEGORIES:
        n = counts.category(category)
        rows.append(Criterion(f"{category} per step", "0", f"{n / max(1, counts.iterations):g}", n == 0))
    return rows


def format_table(rows: list[Criterion], title: str = "") -> str:
    width = max(len(r.name) for r in rows)
    req = max(len("required"), *(len(r.required) for r in rows))
    mea = max(len("measured"), *(len(r.measured) for r in rows))
    lines = [title] if title else []
    lines.append(f"{'criterion':<{width}}  {'required':<{req}}  {'measured':<{mea}}  pass")
    lines.append(f"{'-' * width}  {'-' * req}  {'-' * mea}  ----")
    for r in rows:
        lines.append(f"{r.name:<{width}}  {r.required:<{req}}  {r.measured:<{mea}}  {'yes' if r.passed else 'NO'}")
    return "\n".join(lines)
