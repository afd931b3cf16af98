#!/usr/bin/env python3
"""Where back-to-back replays of the DQN step spend their time: inside each graph, or between graphs.

For each configuration, with one and with eight steps a graph, the step is captured
between two one-thread kernels that read the GPU's %globaltimer (kernels/probe.cu's
`stamp_time`): the first is the graph's first node, so every kernel of the step
waits for it; the second is a dependent launch after the whole step, which reads
the timer once its grid wait returns, when the step's last kernels have ended (the
wait returns about 0.3 us after them, docs/perf-notes.md, twenty-sixth pass). Over
R back-to-back replays (the first --skip left out) each replay gives:
- its span: the second stamp less the first, the step's dependent chain;
- its gap: the next replay's first stamp less this one's second, what passes from
  the end of one graph to the start of the next (the graph launch's switch, the
  first stamp's launch and the second stamp's exit among it);
- its period: first stamp to first stamp, which should match the stamped graph's
  replay time.
It prints the medians next to the replay time of the graph with and without the
stamps (`drvtrain.timing.time_graph`, as tools/bench_dqn.py measures the step), so
the stamps' own cost is in the table too. Per step: divided by the steps a graph.
"""
import contextlib
import statistics
import sys

import numpy as np

import _common
from drvtrain import DeviceBuffer, Stream, builtin_module, capture, dependent_launches
from drvtrain.rl import DQNConfig, DQNStep
from drvtrain.timing import time_graph


def spans_and_gaps(stamps, skip: int = 0) -> tuple[float, float, float]:
    """(span, gap, period), the medians in us, from the stamps of consecutive replays: an
    array of shape (R, 2), each row a replay's first and second stamp in ns, in replay
    order. The first ``skip`` replays are left out: the spans are those of the R - skip
    replays kept, the gaps and periods the R - skip - 1 between consecutive ones kept.
    ValueError for fewer than two replays kept, or stamps out of order (a replay that
    ends before it starts, or starts before the one before has ended)."""
    s = np.asarray(stamps, np.int64)
    if s.ndim != 2 or s.shape[1] != 2:
        raise ValueError(f"stamps must be (replays, 2), got shape {s.shape}")
    if not 0 <= skip < len(s) - 1:
        raise ValueError(f"skipping {skip} leaves fewer than two of {len(s)} replays")
    if np.any(s[:, 1] < s[:, 0]) or np.any(s[1:, 0] < s[:-1, 1]):
        raise ValueError("stamps out of order: the replays overlap or a stamp was missed")
    kept = s[skip:]
    span = (kept[:, 1] - kept[:, 0]) / 1e3
    gap = (s[skip + 1:, 0] - s[skip:-1, 1]) / 1e3
    period = (s[skip + 1:, 0] - s[skip:-1, 0]) / 1e3
    return float(statistics.median(span)), float(statistics.median(gap)), float(statistics.median(period))


def bracketed(n_nodes: int, edges, stamps) -> bool:
    """Whether a graph of ``n_nodes`` nodes (indices 0 ..) and ``edges`` ((from, to) pairs)
    runs everything between its two ``stamps`` (node indices, the first stamp's first):
    the first is its only node that depends on none, the second its only node that none
    depends on."""
    has_in, has_out = {b for _, b in edges}, {a for a, _ in edges}
    roots = [k for k in range(n_nodes) if k not in has_in]
    leaves = [k for k in range(n_nodes) if k not in has_out]
    return len(stamps) == 2 and roots == [stamps[0]] and leaves == [stamps[1]]


def measure(cfg, steps: int, args, stream) -> dict:
    """One configuration's row: the replay times with and without the stamps, and the
    stamps' medians, for ``steps`` steps a graph."""
    with contextlib.ExitStack() as made:  # closed last made first, each even if another fails
        step = DQNStep(cfg)
        made.callback(step.close)
        stamp = builtin_module("probe.cu").kernel("stamp_time", "ptr ptr i32")
        ring = DeviceBuffer.zeros(2 * args.replays, np.uint64)
        made.callback(ring.close)
        counter = DeviceBuffer.zeros(1, np.uint32)
        made.callback(counter.close)
        step.fill_random(1, stream=stream)
        with capture(stream) as plain:
            step.enqueue(stream=stream, steps=steps)
        made.callback(plain.close)
        with capture(stream) as stamped:
            stamp.launch(1, 32, ring, counter, 2 * args.replays, stream=stream, dependent=False)
            step.enqueue(stream=stream, steps=steps)
            with dependent_launches(cfg.dependent_launch):  # as the step's kernels: where the device has them
                stamp.launch(1, 32, ring, counter, 2 * args.replays, stream=stream)
        made.callback(stamped.close)
        ends = [k.node.index for k in stamped.kernel_nodes() if k.function == "stamp_time"]
        if not bracketed(len(stamped.nodes()), stamped.edges(), sorted(ends)):
            raise RuntimeError("the stamped graph is not the step between its two stamps")
        plain_exe = plain.instantiate()
        made.callback(plain_exe.close)
        stamped_exe = stamped.instantiate()
        made.callback(stamped_exe.close)
        made.callback(stream.synchronize)  # first at exit: nothing is freed while a replay may run
        row = {"plain": time_graph(plain_exe, stream, replays=args.replays, repeats=args.repeats),
               "stamped": time_graph(stamped_exe, stream, replays=args.replays, repeats=args.repeats)}
        stream.synchronize()
        counter.copy_from_numpy(np.zeros(1, np.uint32))
        for _ in range(args.replays):
            stamped_exe.launch(stream)
        stream.synchronize()
        if int(counter.to_numpy()[0]) != 2 * args.replays:
            raise RuntimeError(f"{int(counter.to_numpy()[0])} stamps for {args.replays} replays")
        row["span"], row["gap"], row["period"] = spans_and_gaps(ring.to_numpy().reshape(-1, 2), args.skip)
        return row


def main(argv=None) -> int:
    parser = _common.tool_parser(__doc__)
    parser.add_argument("--config", choices=["small", "large", "both"], default="both",
                        help="which DQN configuration (default both)")
    parser.add_argument("--replays", type=int, default=500,
                        help="back-to-back replays stamped, and per repeat of the timing (default 500)")
    parser.add_argument("--repeats", type=int, default=7, help="repeats of the timing; the median (default 7)")
    parser.add_argument("--skip", type=int, default=20, help="stamped replays left out at the start (default 20)")
    args = parser.parse_args(argv)
    if args.replays < 2 or args.repeats < 1:
        parser.error("need --replays >= 2 and --repeats >= 1")
    if not 0 <= args.skip < args.replays - 1:
        parser.error(f"--skip must leave at least two of the {args.replays} replays")
    names = ["small", "large"] if args.config == "both" else [args.config]
    rows = []
    stream = Stream()
    try:
        for name in names:
            for steps in (1, 8):
                print(f"{name}, {steps} step{'s' if steps > 1 else ''} a graph ...", flush=True)
                row = measure(getattr(DQNConfig, name)(), steps, args, stream)
                rows.append((name, steps, row))
                print(f"  span {row['span']:.2f} us, gap {row['gap']:.2f} us", flush=True)
    finally:
        stream.close()
    print(f"\nus a replay (timing: median of {args.repeats} repeats of {args.replays} replays; stamps: "
          f"medians over the last {args.replays - args.skip} replays' spans and the gaps between them); "
          "last column: the span over the steps a graph")
    print("| config | steps a graph | replay, no stamps | replay, stamped | period | span | gap | span a step |")
    print("|---|---|---|---|---|---|---|---|")
    for name, steps, r in rows:
        print(f"| {name} | {steps} | {r['plain']:.2f} | {r['stamped']:.2f} | {r['period']:.2f} | {r['span']:.2f} "
              f"| {r['gap']:.2f} | {r['span'] / steps:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(_common.run(main))
