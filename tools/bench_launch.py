#!/usr/bin/env python3
"""Launch overheads: Python cost per kernel launch, graph replay cost per node, NVRTC cache hits.

Prints a table. Targets (H200): <= 7 us per launch of an 8-argument kernel,
< 5 ms per file for a cache hit.
"""
import ctypes
import statistics
import sys
import time

import numpy as np
from cuda.bindings import driver as cu

import _common
from drvtrain import DeviceBuffer, Stream, builtin_module, capture, get_device
from drvtrain.compiler import compile_file, kernel_files
from drvtrain.timing import time_graph

ARGS8 = "ptr, ptr, ptr, ptr, i32, i32, f32, f32"


def per_call_us(fn, calls: int, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(calls)
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(samples)


def main(argv=None) -> int:
    parser = _common.tool_parser(__doc__)
    parser.add_argument("--calls", type=int, default=20000, help="launches per sample (default 20000)")
    parser.add_argument("--repeats", type=int, default=15, help="samples; the median is reported (default 15)")
    args = parser.parse_args(argv)
    dev = get_device()
    kern = builtin_module("probe.cu").kernel("noop8", ARGS8)
    stream = Stream()
    bufs = [DeviceBuffer(64, np.float32) for _ in range(4)]
    args8 = (*bufs, 1000, 7, 1.5, 2.5)
    rows = []

    # Raw bindings, arguments packed by hand once: the floor for a Python launch.
    slots = [ctypes.c_uint64(b.ptr) for b in bufs] + [ctypes.c_int32(1000), ctypes.c_int32(7),
                                                        ctypes.c_float(1.5), ctypes.c_float(2.5)]
    ptrs = (ctypes.c_void_p * 8)(*[ctypes.addressof(s) for s in slots])
    addr, fn, h = ctypes.addressof(ptrs), kern.function, stream.handle

    def raw(n):
        for _ in range(n):
            cu.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, h, addr, 0)

    def packed(n):
        for _ in range(n):
            kern.launch(1, 32, *args8, stream=stream)

    bound = kern.bind(1, 32, *args8)

    def prebound(n):
        for _ in range(n):
            bound.launch(stream)

    # The three ways are interleaved within each repeat, so a slow spell of the
    # host hits all of them alike; the medians and the per-repeat differences
    # to the raw launch are reported.
    methods = (("raw cuLaunchKernel, prepacked", raw), ("Kernel.launch, 8 args packed", packed),
               ("BoundLaunch.launch", prebound))
    for _, f in methods:
        f(1000)
    stream.synchronize()
    samples = {name: [] for name, _ in methods}
    for _ in range(args.repeats):
        for name, f in methods:
            samples[name].append(per_call_us(f, args.calls, 1))
            stream.synchronize()
    base = samples[methods[0][0]]
    for name, _ in methods:
        us = statistics.median(samples[name])
        extra = statistics.median(a - b for a, b in zip(samples[name], base))
        note = "" if name == methods[0][0] else f" (+{extra:.2f} over raw)"
        rows.append((f"launch: {name}", f"{us:.2f} us/launch{note}", "<= 7 us" if "Kernel.launch" in name else ""))

    # Graph replay: chains of N kernel nodes, device time per node.
    for nodes in (10, 100, 1000):
        with capture(stream) as graph:
            for _ in range(nodes):
                bound.launch(stream)
        exe = graph.instantiate()
        us = time_graph(exe, stream, replays=max(20, 20000 // nodes), repeats=args.repeats, warmup=5)
        rows.append((f"graph replay, {nodes} kernel nodes", f"{us / nodes:.3f} us/node", ""))
        exe.close()
        graph.close()

    # NVRTC cache hits: the time compile_file takes when the entry exists.
    for path in kernel_files():
        compile_file(path, arch=dev.arch)
        ms = statistics.median(compile_file(path, arch=dev.arch).millis for _ in range(20))
        rows.append((f"nvrtc cache hit: {path.name}", f"{ms:.3f} ms", "< 5 ms"))

    print(f"\ndevice: {dev.name} ({dev.arch}, {dev.sm_count} SMs)")
    w = max(len(r[0]) for r in rows)
    v = max(len(r[1]) for r in rows)
    print(f"{'measure':<{w}} | {'value':>{v}} | target")
    print(f"{'-' * w}-+-{'-' * v}-+-------")
    for name, value, target in rows:
        print(f"{name:<{w}} | {value:>{v}} | {target}")
    return 0


if __name__ == "__main__":
    sys.exit(_common.run(main))
