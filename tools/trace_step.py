#!/usr/bin/env python3
"""Timeline of the replayed Double-DQN step: when each kernel node ends, through CUPTI.

Nsight Compute serialises kernels, so it cannot show how a replay's branches
overlap. This tool captures the step of docs/step-spec.md, replays it back to
back and records every kernel's start and end with CUPTI's activity API, which
PyTorch's profiler drives (so it needs ``torch``; drvtrain itself does not). It
prints one row per kernel node in start order: its median start in us from the
start of the replay, its median duration, their sum as its end, the graph's
stream for it and its grid. With dependent launches a kernel starts early and waits, so its
duration includes the wait: the end times are the timeline. The first
``--skip`` traced replays are left out of the medians.
"""
import json
import os
import statistics
import sys
import tempfile

import _common
from drvtrain import Stream, get_device
from drvtrain.rl import DQNConfig, DQNStep


def timeline(events, replays: int, skip: int) -> list[dict]:
    """Per kernel node, from a Chrome trace's kernel events of ``replays`` replays of
    one graph (the first ``skip`` dropped): the median start (us after the
    replay's first kernel), the median duration, and start + duration as its end.
    A node is (stream, name, how many kernels of that name came before it on that
    stream in the replay), so concurrent kernels that start in another order from
    one replay to the next are still matched with themselves."""
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    if not kernels or len(kernels) % replays:
        raise ValueError(f"{len(kernels)} kernel events do not split into {replays} replays")
    per = len(kernels) // replays
    runs = []
    for i in range(skip, replays):
        run, seen = {}, {}
        for e in kernels[i * per:(i + 1) * per]:
            key = (e.get("args", {}).get("stream"), e["name"])
            seen[key] = seen.get(key, -1) + 1
            run[key + (seen[key],)] = e
        runs.append((kernels[i * per]["ts"], run))
    if not runs:
        raise ValueError(f"--skip {skip} leaves none of {replays} replays")
    nodes = runs[0][1].keys()
    if any(run.keys() != nodes for _, run in runs):
        raise ValueError("the replays ran different kernels: not one graph replayed")
    rows = []
    for node in nodes:
        start = statistics.median(run[node]["ts"] - t0 for t0, run in runs)
        dur = statistics.median(run[node]["dur"] for _, run in runs)
        first = runs[0][1][node]
        rows.append({"name": node[1], "start": start, "end": start + dur, "dur": dur, "stream": node[0],
                     "grid": first.get("args", {}).get("grid")})
    return sorted(rows, key=lambda r: r["start"])


def main(argv=None) -> int:
    parser = _common.tool_parser(__doc__)
    parser.add_argument("--config", choices=["small", "large"], default="small",
                        help="the step's configuration (default small)")
    parser.add_argument("--replays", type=int, default=30, help="replays traced (default 30)")
    parser.add_argument("--skip", type=int, default=5, help="first traced replays left out (default 5)")
    parser.add_argument("--presplit", action="store_true",
                        help="the wide backward on operands split once (DQNConfig(presplit=True))")
    args = parser.parse_args(argv)
    if args.replays < 1 or not 0 <= args.skip < args.replays:
        parser.error("need --replays >= 1 and 0 <= --skip < --replays")
    get_device()  # no GPU: the one-line report of every tool, before anything else
    try:
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        print("trace_step: needs PyTorch (its profiler drives CUPTI); install torch", file=sys.stderr)
        return 2
    cfg = getattr(DQNConfig, args.config)(presplit=args.presplit)
    stream = Stream()
    step = DQNStep(cfg)
    print(f"{args.config}: filling {cfg.capacity} transitions, capturing ...", flush=True)
    step.fill_random(1, stream=stream)
    exe = step.capture(stream=stream)
    for _ in range(20):
        exe.launch(stream)
    stream.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.replays):
            exe.launch(stream)
        stream.synchronize()
    step.check_errors()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    rows = timeline(events, args.replays, args.skip)
    print(f"\n{args.config}: {len(rows)} kernel nodes per replay; us from the replay's start "
          f"(median of {args.replays - args.skip} replays)\n")
    print("| start | end | duration | stream | kernel | grid |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['start']:.2f} | {r['end']:.2f} | {r['dur']:.2f} | {r['stream']} | {r['name']} | {r['grid']} |")
    exe.close()
    step.close()
    stream.close()
    return 0


if __name__ == "__main__":
    sys.exit(_common.run(main))
