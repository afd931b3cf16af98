#!/usr/bin/env python3
"""Benchmark the captured Double-DQN step on both configurations, against PyTorch when installed.

For each configuration: microseconds per step (median over repeats of R
back-to-back graph replays, device time over R), the graph's node count and
longest dependent chain, for the default step (per-layer GEMMs, the two `s'`
forwards on their own streams, dependent launches) and for variants that change
one thing:
- no dependent launches;
- the output layer's forwards, the loss and its dX forced into one kernel or
  forced apart (DQNConfig(fused_head=True / False); the default picks by the
  layer's size);
- everything after the backward as one cooperative launch
  (DQNConfig(fused_tail=True));
- the three forwards as one launch of thread block clusters
  (DQNConfig(cluster_forward=True)) and the fused narrow kernels
  (DQNConfig(fused=True)): small only, the large net is too wide for them;
- everything on one stream;
- the wide backward products on operands split once into TF32 parts
  (DQNConfig(presplit=True)): large only, the small net has none;
- the loss kept apart from the output layer's backward product
  (DQNConfig(fused_loss=False)): large only, where the default computes it there;
- the default step captured behind an open gate word, as a training loop
  (`drvtrain train`) captures it: what reading the gate costs a step that runs;
- eight consecutive steps captured as one graph (`DQNStep.capture(steps=8)`), where
  each step after the first draws its batch beside the step before's tail: the time
  a step when a learner takes several gradient steps in a row. Its node count and
  chain are the whole graph's.
With torch installed, the same step written plainly in PyTorch
(tools/torch_dqn.py), eager and CUDA-graph captured. Goals: <= 15 us (small)
and <= 50 us (large).
"""
import sys

import numpy as np

import _common
from drvtrain import DeviceBuffer, Stream, capture
from drvtrain.nn import MLP, ParamLayout
from drvtrain.nn.narrow import NarrowMLP
from drvtrain.rl import DQNConfig, DQNStep
from drvtrain.rl.dqn import HEAD_AUTO_WEIGHTS
from drvtrain.timing import time_graph


def measure(cfg, args, gated=False, steps=1):
    stream = Stream()
    print(f"  {cfg.obs_dim}-{'-'.join(map(str, cfg.hidden))}-{cfg.n_actions} batch {cfg.batch}, "
          f"fused={cfg.fused} dual_stream={cfg.dual_stream} dependent_launch={cfg.dependent_launch} "
          f"fused_tail={cfg.fused_tail} fused_head={cfg.fused_head} cluster_forward={cfg.cluster_forward}"
          f"{', behind an open gate' if gated else ''}{f', {steps} steps a graph' if steps > 1 else ''}"
          f": filling {cfg.capacity} transitions ...", flush=True)
    step, gate = DQNStep(cfg), None
    try:
        if gated:
            gate = DeviceBuffer.from_numpy(np.zeros(1, np.int32))
        step.fill_random(1, stream=stream)
        with capture(stream) as graph:
            step.enqueue(stream=stream, gate=gate, steps=steps)
        exe = graph.instantiate()
        try:
            us = time_graph(exe, stream, replays=args.replays, repeats=args.repeats) / steps
        finally:
            exe.close()
        step.check_errors()
        return us, len(graph.nodes()), graph.longest_chain()
    finally:
        if gate is not None:
            gate.close()
        step.close()
        stream.close()


def torch_times(cfg, args):
    import importlib.util
    if importlib.util.find_spec("torch") is None:
        return None
    from torch_dqn import TorchDQNStep
    t = TorchDQNStep(cfg.obs_dim, list(cfg.hidden), cfg.n_actions, cfg.batch, cfg.capacity, gamma=cfg.gamma,
                     alpha=cfg.alpha, beta=cfg.beta, tau=cfg.tau, max_norm=cfg.max_norm, lr=cfg.lr,
                     weight_decay=cfg.weight_decay, seed=1)
    eager = t.time_us(replays=max(50, args.replays // 5), repeats=args.repeats, graph=False)
    graphed = t.time_us(replays=args.replays, repeats=args.repeats, graph=True)
    del t
    return eager, graphed


# (label, DQNConfig overrides, captured behind an open gate word, steps a graph);
# --default-only measures the first two
VARIANTS = (
    ("default", {}, False, 1),
    ("default, 8 consecutive steps a graph (nodes and chain: the graph's)", {}, False, 8),
    ("no dependent launch", {"dependent_launch": False}, False, 1),
    ("output layer fused (dqn_head)", {"fused_head": True}, False, 1),
    ("output layer separate", {"fused_head": False}, False, 1),
    ("cooperative tail", {"fused_tail": True}, False, 1),
    ("three forwards in clusters", {"cluster_forward": True}, False, 1),
    ("fused narrow kernels", {"fused": True}, False, 1),
    ("one stream", {"dual_stream": False}, False, 1),
    ("pre-split wide backward", {"presplit": True}, False, 1),
    ("loss apart (dqn_loss)", {"fused_loss": False}, False, 1),
    ("gated (open), as a training loop runs it", {}, True, 1),
)


def main(argv=None) -> int:
    parser = _common.tool_parser(__doc__)
    parser.add_argument("--replays", type=int, default=500, help="back-to-back replays per repeat (default 500)")
    parser.add_argument("--repeats", type=int, default=7, help="repeats; the median is reported (default 7)")
    parser.add_argument("--config", choices=["small", "large", "both"], default="both",
                        help="configuration(s) to run (default both)")
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch baseline")
    parser.add_argument("--default-only", action="store_true",
                        help="measure only the default step, one and eight steps a graph")
    args = parser.parse_args(argv)
    if args.replays < 500:
        parser.error("--replays must be at least 500")
    rows, torch_rows = [], []
    for name in (["small", "large"] if args.config == "both" else [args.config]):
        print(f"{name}:", flush=True)
        for label, overrides, gated, steps in VARIANTS[:2] if args.default_only else VARIANTS:
            cfg = getattr(DQNConfig, name)(**overrides)
            if (overrides.get("fused") or "cluster_forward" in overrides) and \
                    not NarrowMLP.supports(ParamLayout.from_widths(cfg.widths)):
                continue
            if "presplit" in overrides and \
                    not MLP(ParamLayout.from_widths(cfg.widths), presplit=True).presplit_layers(cfg.batch):
                continue  # no product of this net runs pre-split: the default already is this
            if "fused_loss" in overrides and (
                    HEAD_AUTO_WEIGHTS[0] <= (1 + cfg.n_actions) * cfg.hidden[-1] <= HEAD_AUTO_WEIGHTS[1]
                    or not MLP(ParamLayout.from_widths(cfg.widths)).last_dw_folded(cfg.batch)):
                continue  # the default keeps the loss apart already (or dqn_head computes it)
            rows.append((name, label, *measure(cfg, args, gated, steps)))
        torch_us = None if args.no_torch else torch_times(getattr(DQNConfig, name)(), args)
        if torch_us:
            torch_rows.append((name, *torch_us))
    print("\nus per step (median of repeats of back-to-back graph replays, over the steps a graph), "
          "H2D/D2H-free, sync-free\n")
    print("| config | variant | us per step | nodes | longest chain | goal |")
    print("|---|---|---|---|---|---|")
    for name, label, us, nodes, chain in rows:
        goal = "<= 15" if name == "small" else "<= 50"
        print(f"| {name} | {label} | {us:.2f} | {nodes} | {chain} | {goal} |")
    if torch_rows:
        print("\n| config | torch eager us | torch graph us | default step speed-up vs torch graph |")
        print("|---|---|---|---|")
        for name, eager, graphed in torch_rows:
            ours = next(us for n, label, us, _, _ in rows if n == name and label == "default")
            print(f"| {name} | {eager:.1f} | {graphed:.1f} | {graphed / ours:.1f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(_common.run(main))
