#!/usr/bin/env python3
"""Time the small Double-DQN net's three hidden-layer forwards three ways: in clusters, per block, per layer.

The net is 4-256-256(-3), batch 256, TF32; the three passes are the step's (online on
s, online on s', target on s'), and each launch runs the two hidden layers (the output
layer is dqn_head's). Each way is timed as a captured chain of launches, ordinary and
dependent, in microseconds per forward of the three passes:
- `NarrowMLP.forward_many(cluster=True)`: one launch of thread block clusters;
- `NarrowMLP.forward_many()`: one launch, a block per 16 rows running every layer;
- both again after `NarrowMLP.fix_shape`: kernels compiled for this batch and depth;
- `MLP.forward`: a GEMM launch per layer and pass, all on one stream.
Also prints the cluster launch's plan: blocks per cluster, shared memory, and how many
clusters fit at once against how many the launch needs.
"""
import sys

import numpy as np

import _common
from drvtrain import Arena, DeviceBuffer, Stream, capture, get_device
from drvtrain.kernel import dependent_launches
from drvtrain.nn import MLP, FlatBuffer, ParamLayout
from drvtrain.nn.narrow import CLUSTER_ROWS, NarrowMLP
from drvtrain.timing import time_graph

WIDTHS, BATCH, HIDDEN = [4, 256, 256, 3], 256, 2


def main(argv=None) -> int:
    parser = _common.tool_parser(__doc__)
    parser.add_argument("--chain", type=int, default=20, help="launches of each way per graph (default 20)")
    parser.add_argument("--repeats", type=int, default=7, help="repeats; the median is reported (default 7)")
    args = parser.parse_args(argv)
    if args.chain < 1 or args.repeats < 1:
        parser.error("--chain and --repeats must be at least 1")
    dev = get_device()
    layout = ParamLayout.from_widths(WIDTHS)
    rng = np.random.default_rng(1)
    online, target = (FlatBuffer(layout, layout.init_numpy(int(rng.integers(1 << 30)))) for _ in range(2))
    s, s2 = (DeviceBuffer.from_numpy(rng.standard_normal((BATCH, WIDTHS[0])).astype(np.float32)) for _ in range(2))
    params, xs = [online, online, target], [s, s2, s2]
    net, mlp = NarrowMLP(layout, tf32=True), MLP(layout, tf32=True)
    fixed = NarrowMLP(layout, tf32=True)
    fixed.fix_shape(BATCH, HIDDEN)
    arena = Arena(3 * mlp.scratch_bytes(BATCH) + 3 * net.forward_bytes(BATCH))
    stream = Stream()
    ways = (
        ("clusters", lambda: net.forward_many(params, xs, arena=arena, stream=stream, layers=HIDDEN, cluster=True)),
        ("clusters, fixed shape",
         lambda: fixed.forward_many(params, xs, arena=arena, stream=stream, layers=HIDDEN, cluster=True)),
        ("per block", lambda: net.forward_many(params, xs, arena=arena, stream=stream, layers=HIDDEN)),
        ("per block, fixed shape", lambda: fixed.forward_many(params, xs, arena=arena, stream=stream, layers=HIDDEN)),
        ("per layer", lambda: [mlp.forward(p, x, arena=arena, stream=stream, layers=HIDDEN) for p, x in zip(params, xs)]),
    )
    rows = []
    hopper = tuple(dev.compute_capability) >= (9, 0)
    for name, enqueue in ways:
        if name.startswith("clusters") and not hopper:
            continue
        for dependent in (False, True) if hopper else (False,):
            with dependent_launches(dependent):
                with capture(stream) as graph:
                    for _ in range(args.chain):
                        arena.reset()
                        enqueue()
            exe = graph.instantiate()
            us = time_graph(exe, stream, replays=20, repeats=args.repeats) / args.chain
            exe.close()
            graph.close()
            rows.append((name, "dependent" if dependent else "ordinary", us))
    print(f"\n{dev.name}: {'-'.join(map(str, WIDTHS[:HIDDEN + 1]))} forwards, batch {BATCH}, three passes, TF32; "
          f"us per launch of all three, median of {args.repeats} repeats of {args.chain}-launch chains\n")
    print("| way | launch | us |")
    print("|---|---|---|")
    for name, launch, us in rows:
        print(f"| {name} | {launch} | {us:.2f} |")
    if hopper:
        ranks, smem = net.cluster_ranks(HIDDEN), net.cluster_shared_bytes(HIDDEN)
        fit, fit_fixed = net.clusters_at_once(HIDDEN), fixed.clusters_at_once(HIDDEN, BATCH)
        print(f"\nclusters of {ranks} blocks, {smem} bytes of shared memory a block; {fit} clusters fit at once "
              f"({fit_fixed} of the fixed-shape build), the launch has {3 * -(-BATCH // CLUSTER_ROWS)}")
    return 0


if __name__ == "__main__":
    sys.exit(_common.run(main))
