"""The ``drvtrain`` command line."""
from __future__ import annotations

import argparse
import sys

import numpy as np

from . import __version__

EXIT_NO_DEVICE = 2


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _fail(message: str, code: int) -> int:
    print(f"drvtrain: {message}", file=sys.stderr)
    return code


def doctor(args) -> int:
    from .compiler import CompileError, compile_file, default_cache, kernel_files
    from .driver import NoDeviceError, driver_version, get_device, nvrtc_version

    print(f"drvtrain {__version__}")
    print(f"nvrtc        {'.'.join(map(str, nvrtc_version()))}")
    try:
        major, minor = driver_version()
        dev = get_device(args.device)
    except NoDeviceError as exc:
        return _fail(str(exc), EXIT_NO_DEVICE)
    except ValueError as exc:  # an ordinal the machine does not have
        return _fail(f"--device {args.device}: {exc}", EXIT_NO_DEVICE)
    lim = dev.limits
    print(f"driver       CUDA {major}.{minor}")
    print(f"device {dev.ordinal}     {dev.name}, {dev.arch}, {dev.sm_count} SMs, L2 {_mib(dev.l2_bytes)}, "
          f"shared/block {lim.max_shared_per_block // 1024} KiB "
          f"({lim.max_shared_per_block_optin // 1024} KiB opt-in), memory {dev.total_memory / 2**30:.1f} GiB")

    cache = default_cache()
    print(f"kernels      cache {cache.directory}")
    for path in kernel_files():
        try:
            prog = compile_file(path, arch=dev.arch)
        except CompileError as exc:
            first = next((line for line in exc.log.splitlines() if "error" in line), exc.log.strip()[:200])
            return _fail(f"NVRTC could not compile {exc.filename}: {first.strip()}", 1)
        print(f"  {path.name:<20} {'hit ' if prog.cache_hit else 'miss'} {prog.millis:8.1f} ms")
    if not cache.writable:
        print("  (cache not writable: compiled without caching)")

    from .demo import ForkJoinDemo, arena_check, mapped_readback
    failures = 0

    def report(name: str, ok: bool, detail: str) -> None:
        nonlocal failures
        failures += not ok
        print(f"  {name:<18} {'ok  ' if ok else 'FAIL'} {detail}")

    print("self-check")
    a = arena_check()
    report("arena", a.first == a.second and a.aligned,
           f"3 allocations, same addresses after reset, 256-byte aligned, high water {a.high_water} B")
    got = mapped_readback(4096)
    report("mapped readback", bool(np.array_equal(got, np.arange(4096, dtype=np.float32))),
           "4096 floats written by a kernel into mapped memory, read after Event.query()")
    demo = ForkJoinDemo(1 << 16)
    graph = demo.record()
    exe = graph.instantiate()
    replays = 10
    for _ in range(replays):
        exe.launch(demo.main)
    demo.main.synchronize()
    result = demo.out.to_numpy()
    side = demo.scale_nodes(graph)
    concurrent = len(side) == 2 and graph.can_run_concurrently(*side)
    report("fork/join graph", bool(np.array_equal(result, demo.expected())) and concurrent,
           f"{len(graph.nodes())} nodes, branches concurrent: {concurrent}, {replays} replays, result checked")
    exe.close()
    graph.close()
    demo.close()
    print("all checks passed" if not failures else f"{failures} check(s) FAILED")
    return 1 if failures else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="drvtrain",
        description="GPU-resident training over the raw CUDA driver API.")
    parser.add_argument("--version", action="version", version=f"drvtrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("doctor", help="check the driver, NVRTC, kernel compilation and the device",
                       description="Print the driver, NVRTC and device; compile every kernel "
                                   "(cache hit or miss, milliseconds); run a short self-check. "
                                   "Exits 2 when no CUDA driver or GPU is found, 1 when a check fails.")
    p.add_argument("--device", type=int, default=0, help="device ordinal (default 0)")
    p.set_defaults(func=doctor)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
