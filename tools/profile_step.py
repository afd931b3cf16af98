#!/usr/bin/env python3
"""Per-kernel Nsight Compute table of one training step: time, achieved occupancy, limiting unit.

Runs itself under ``ncu`` (``--ncu PATH``, default /usr/local/cuda/bin/ncu),
profiling exactly one eagerly enqueued step after a few warm-up steps (the
profiler is switched on around that step only), and prints one Markdown row per
kernel launch in launch order: duration, grid x block, achieved occupancy, SM
and memory throughput as % of peak, and the limiting unit. A kernel whose SM
and memory throughput both stay under 30% of peak is reported as latency-bound:
neither unit is busy, so its time is its own chain of dependent operations.

``--hbm``: instead, the bytes each kernel reads from and writes to HBM (DRAM) and
its L2 hit rate, with the L2 left as the step leaves it: ncu neither flushes the
caches before a kernel (``--cache-control none``) nor replays a kernel on its own
(``--replay-mode application``: the whole process runs again for each pass of
metrics), so every kernel finds what the kernels before it left in L2. The bytes a
kernel writes are mostly lines that other kernels dirtied, evicted while it runs.
Its times are not those of the default table (other metrics, other passes).

``--l2``: instead, what each kernel moves through the L2 when it runs alone: the bytes
of the requests its clients (the SMs, and the copy engines and HBM fills) made of the
L2 (``lts__t_bytes``), the rate that makes over the kernel's time, and the L2's
throughput as a share of its peak (``lts__throughput``, averaged over its slices), with
the L2 left as the kernels before it left it (no cache flush, application replay, as
``--hbm``). Kernels that run side by side in the step share the L2: their rates add up
while they overlap.

``--tensor``: instead, how busy each kernel keeps the tensor cores: the tensor pipe's
active cycles as a share of its peak over the cycles the SMs ran the kernel
(``sm__pipe_tensor_cycles_active``, ``pct_of_peak_sustained_active``), and over the
kernel's whole time on every SM (``pct_of_peak_sustained_elapsed``, which counts the SMs
it left idle), with the tensor instructions it issued: the warp-group MMAs (``wgmma``) and
all of them (``sm__inst_executed_pipe_tensor_op_hmma``, which on sm_90 counts the
``wgmma`` ones as well as ``mma.sync``: the two counts are equal in a kernel that issues
only ``wgmma``). A product's first share says how well its blocks feed their tensor
cores, the second how much of the GPU's it gets.

Every table is taken at the clocks ncu fixes (the base clocks), so its times are
longer than the step's.

What is profiled: ``dqn-small`` / ``dqn-large`` (the Double-DQN step of
docs/step-spec.md) or ``engine-small`` / ``engine-large`` (the supervised step
of tools/bench_engine.py). Eager launches compute what the captured graph does,
so the table is the graph's, less the replay's own launch costs.
"""
import contextlib
import csv
import io
import os
import subprocess
import sys

import _common
from drvtrain import get_device

METRICS = {
    "gpu__time_duration.sum": "time",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occupancy",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm",
    "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed": "mem",
    "launch__grid_size": "grid",
    "launch__block_size": "block",
}
HBM_METRICS = {
    "gpu__time_duration.sum": "time",
    "dram__bytes_read.sum": "read",
    "dram__bytes_write.sum": "written",
    "lts__t_sector_hit_rate.pct": "l2_hit",
    "launch__grid_size": "grid",
    "launch__block_size": "block",
}
L2_METRICS = {
    "gpu__time_duration.sum": "time",
    "lts__t_bytes.sum": "l2",
    "lts__throughput.avg.pct_of_peak_sustained_elapsed": "l2_peak",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occupancy",
    "launch__grid_size": "grid",
    "launch__block_size": "block",
}
TENSOR_METRICS = {
    "gpu__time_duration.sum": "time",
    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active": "tensor_active",
    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed": "tensor_elapsed",
    "sm__inst_executed_pipe_tensor_op_gmma.sum": "wgmma",
    "sm__inst_executed_pipe_tensor_op_hmma.sum": "tensor_inst",
    "launch__grid_size": "grid",
    "launch__block_size": "block",
}
WHAT = ("dqn-small", "dqn-large", "engine-small", "engine-large")
TIME_UNITS = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "ns": 1e-3, "us": 1.0}
BYTE_UNITS = {"byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9}


def child(what: str, warmup: int) -> int:
    """The profiled process: build the step, warm up, profile one step."""
    import numpy as np
    from cuda.bindings import driver

    from drvtrain import Stream, check
    kind, size = what.split("-")
    with contextlib.ExitStack() as owned:  # the stream and the step closed at its end, also on an error
        stream = owned.enter_context(Stream())
        if kind == "dqn":
            from drvtrain.rl import DQNConfig, DQNStep
            step = owned.enter_context(DQNStep(getattr(DQNConfig, size)()))
            step.fill_random(1, stream=stream)
        else:
            from drvtrain.nn import ParamLayout, RegressionStep
            obs, hidden, actions, batch = {"small": (4, [256, 256], 2, 256),
                                           "large": (128, [1024, 1024], 18, 512)}[size]
            widths = [obs] + hidden + [1 + actions]
            rng = np.random.default_rng(0)
            step = owned.enter_context(RegressionStep(ParamLayout.from_widths(widths), batch, lr=1e-4,
                                                      weight_decay=1e-2))
            step.x.copy_from_numpy(rng.standard_normal((batch, obs)).astype(np.float32))
            step.target.copy_from_numpy(rng.standard_normal((batch, 1 + actions)).astype(np.float32))
        for _ in range(warmup):
            step.enqueue(stream=stream)
        stream.synchronize()
        check(driver.cuProfilerStart)
        step.enqueue(stream=stream)
        stream.synchronize()
        check(driver.cuProfilerStop)
    return 0


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return float("nan")


def table(csv_text: str, metrics: dict = METRICS) -> list[dict]:
    """ncu's ``--page raw --csv`` output as rows of the fields in ``metrics`` (METRICS,
    HBM_METRICS, L2_METRICS or TENSOR_METRICS: bytes in MB, 10^6 bytes), times in us."""
    lines = [line for line in csv_text.splitlines() if line.startswith('"')]
    reader = list(csv.reader(io.StringIO("\n".join(lines))))
    if len(reader) < 3:
        return []
    header, units, data = reader[0], reader[1], reader[2:]
    col = {name: i for i, name in enumerate(header)}
    rows = []
    for rec in data:
        row = {"kernel": rec[col["Kernel Name"]].split("(")[0]}
        for metric, key in metrics.items():
            value = rec[col[metric]] if metric in col else ""
            unit = units[col[metric]] if metric in col else ""
            if key == "time":
                row[key] = _number(value) * TIME_UNITS.get(unit, 1e-3)
            elif key in ("read", "written", "l2"):
                row[key] = _number(value) * BYTE_UNITS.get(unit, float("nan")) / 1e6
            elif key in ("grid", "block"):
                row[key] = value.replace(",", "")
            else:
                row[key] = _number(value)
        if "sm" in row:
            busiest = max(row["sm"], row["mem"])
            row["limit"] = ("latency" if busiest < 30 else "SM" if row["sm"] >= row["mem"] else "memory")
        rows.append(row)
    return rows


def print_table(what: str, rows: list[dict]) -> None:
    total = sum(r["time"] for r in rows)
    print(f"\n{what}: {len(rows)} kernels, {total:.1f} us of kernel time (sum of durations)\n")
    print("| # | kernel | us | grid x block | occupancy % | SM % | memory % | limit |")
    print("|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows):
        print(f"| {i} | {r['kernel']} | {r['time']:.2f} | {r['grid']} x {r['block']} | {r['occupancy']:.1f} | "
              f"{r['sm']:.1f} | {r['mem']:.1f} | {r['limit']} |")


def print_hbm_table(what: str, rows: list[dict]) -> None:
    read, written = sum(r["read"] for r in rows), sum(r["written"] for r in rows)
    print(f"\n{what}: {len(rows)} kernels, {read:.2f} MB read from HBM and {written:.2f} MB written to it, "
          f"the L2 left as the step leaves it\n")
    print("| # | kernel | us | grid x block | HBM read MB | HBM written MB | L2 hit % |")
    print("|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows):
        print(f"| {i} | {r['kernel']} | {r['time']:.2f} | {r['grid']} x {r['block']} | {r['read']:.2f} | "
              f"{r['written']:.2f} | {r['l2_hit']:.1f} |")


def print_l2_table(what: str, rows: list[dict]) -> None:
    total = sum(r["l2"] for r in rows)
    print(f"\n{what}: {len(rows)} kernels, {total:.2f} MB through the L2, each kernel alone "
          f"(the L2 left as the kernels before it left it)\n")
    print("| # | kernel | us | grid x block | L2 MB | L2 TB/s | L2 % of peak | occupancy % |")
    print("|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows):
        rate = r["l2"] / r["time"] if r["time"] > 0 else float("nan")  # MB / us = TB/s
        print(f"| {i} | {r['kernel']} | {r['time']:.2f} | {r['grid']} x {r['block']} | {r['l2']:.2f} | "
              f"{rate:.2f} | {r['l2_peak']:.1f} | {r['occupancy']:.1f} |")


def print_tensor_table(what: str, rows: list[dict]) -> None:
    print(f"\n{what}: {len(rows)} kernels, {sum(r['time'] for r in rows):.1f} us of kernel time; the tensor pipe's "
          f"busy share of its peak over the SMs' active cycles and over the kernel's time on every SM\n")
    print("| # | kernel | us | grid x block | tensor % (active) | tensor % (all SMs) | wgmma inst | tensor inst |")
    print("|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows):
        print(f"| {i} | {r['kernel']} | {r['time']:.2f} | {r['grid']} x {r['block']} | {r['tensor_active']:.1f} | "
              f"{r['tensor_elapsed']:.1f} | {r['wgmma']:.0f} | {r['tensor_inst']:.0f} |")


# Each table: its metrics and its printer.
MODES = {"default": (METRICS, print_table), "hbm": (HBM_METRICS, print_hbm_table), "l2": (L2_METRICS, print_l2_table),
         "tensor": (TENSOR_METRICS, print_tensor_table)}


def ncu_command(ncu: str, what: str, warmup: int, mode: str = "default") -> list[str]:
    """The ncu command line that profiles ``what`` (the child run of this script) for
    ``mode``'s metrics (MODES)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    cmd = [ncu, "--profile-from-start", "off", "--csv", "--page", "raw"]
    if mode in ("hbm", "l2"):  # every kernel finds the L2 as the step leaves it
        cmd += ["--cache-control", "none", "--replay-mode", "application"]
    cmd += ["--metrics", ",".join(MODES[mode][0])]
    return cmd + [sys.executable, os.path.abspath(__file__), "--child", "--warmup", str(warmup), what]


def main(argv=None) -> int:
    parser = _common.tool_parser(__doc__)
    parser.add_argument("what", nargs="*", metavar="WHAT",
                        help=f"steps to profile (default all: {', '.join(WHAT)})")
    parser.add_argument("--ncu", default="/usr/local/cuda/bin/ncu", help="the ncu executable")
    parser.add_argument("--warmup", type=int, default=3, help="eager steps before the profiled one (default 3)")
    table_kind = parser.add_mutually_exclusive_group()
    table_kind.add_argument("--hbm", action="store_true",
                            help="HBM bytes read and written and the L2 hit rate per kernel, with the L2 left as the "
                                 "step leaves it (no cache flush, application replay), instead of the default table")
    table_kind.add_argument("--l2", action="store_true",
                            help="the bytes each kernel moves through the L2, their rate (TB/s) and the L2's "
                                 "throughput as a share of its peak, each kernel alone, with the L2 left as the step "
                                 "leaves it (no cache flush, application replay), instead of the default table")
    table_kind.add_argument("--tensor", action="store_true",
                            help="the tensor pipe's busy share of its peak per kernel (over the SMs' active cycles, "
                                 "and over its time on every SM) and the tensor instructions it issued (wgmma, and "
                                 "all), instead of the default table")
    parser.add_argument("--child", action="store_true", help=argparse_hidden())
    args = parser.parse_args(argv)
    args.what = args.what or list(WHAT)
    unknown = [w for w in args.what if w not in WHAT]
    if unknown:
        parser.error(f"unknown step(s) {', '.join(unknown)}; choose from {', '.join(WHAT)}")
    if args.child:
        return child(args.what[0], args.warmup)
    get_device()  # no GPU: one line and exit 2, before starting the profiler
    if not os.path.exists(args.ncu):
        parser.error(f"--ncu {args.ncu}: no such file")
    mode = "hbm" if args.hbm else "l2" if args.l2 else "tensor" if args.tensor else "default"
    metrics, printer = MODES[mode]
    status = 0
    for what in args.what:
        print(f"profiling {what} ...", flush=True)
        proc = subprocess.run(ncu_command(args.ncu, what, args.warmup, mode), capture_output=True, text=True)
        rows = table(proc.stdout, metrics)
        if proc.returncode != 0 or not rows:
            print(f"ncu failed for {what} (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}",
                  file=sys.stderr)
            status = 1
            continue
        printer(what, rows)
    return status


def argparse_hidden():
    import argparse
    return argparse.SUPPRESS


if __name__ == "__main__":
    sys.exit(_common.run(main))
