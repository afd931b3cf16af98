#!/usr/bin/env python3
"""Benchmark the captured Double-DQN step on both configurations, against PyTorch when installed.

For each configuration: microseconds per step (median over repeats of R
back-to-back graph replays, device time over R), the graph's node count and
longest dependent chain, with the target forward on its own stream and with
everything on one stream, so the overlap is measured. With torch installed,
the same step written plainly in PyTorch (tools/torch_dqn.py), eager and
CUDA-graph captured. Goals: beat PyTorch's captured step on both
configurations, by >= 3x on the small one; later <= 15 us (small) and
<= 50 us (large).
"""
import sys

import _common
from drvtrain import Stream
from drvtrain.rl import DQNConfig, DQNStep
from drvtrain.timing import time_graph


def measure(cfg, args):
    stream = Stream()
    print(f"  {cfg.obs_dim}-{'-'.join(map(str, cfg.hidden))}-{cfg.n_actions} batch {cfg.batch}, "
          f"{'two streams' if cfg.dual_stream else 'one stream'}: filling {cfg.capacity} transitions ...",
          flush=True)
    step = DQNStep(cfg)
    step.fill_random(1, stream=stream)
    exe = step.capture(stream=stream)
    us = time_graph(exe, stream, replays=args.replays, repeats=args.repeats)
    step.check_errors()
    graph = step.graph
    result = (us, len(graph.nodes()), graph.longest_chain())
    exe.close()
    step.close()
    stream.close()
    return result


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


def main(argv=None) -> int:
    parser = _common.tool_parser(__doc__)
    parser.add_argument("--replays", type=int, default=500, help="back-to-back replays per repeat (default 500)")
    parser.add_argument("--repeats", type=int, default=7, help="repeats; the median is reported (default 7)")
    parser.add_argument("--config", choices=["small", "large", "both"], default="both",
                        help="configuration(s) to run (default both)")
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch baseline")
    args = parser.parse_args(argv)
    if args.replays < 500:
        parser.error("--replays must be at least 500")
    rows = []
    for name in (["small", "large"] if args.config == "both" else [args.config]):
        print(f"{name}:", flush=True)
        dual = measure(getattr(DQNConfig, name)(dual_stream=True), args)
        single = measure(getattr(DQNConfig, name)(dual_stream=False), args)
        torch_us = None if args.no_torch else torch_times(getattr(DQNConfig, name)(), args)
        rows.append((name, dual, single, torch_us))
    print("\nus per step (median of repeats of back-to-back graph replays), H2D/D2H-free, sync-free\n")
    print("| config | drvtrain, 2 streams | drvtrain, 1 stream | nodes | longest chain | torch eager | "
          "torch graph | speed-up vs torch graph | goal |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, (d_us, nodes, chain), (s_us, _, s_chain), torch_us in rows:
        t_eager, t_graph = torch_us if torch_us else (float("nan"), float("nan"))
        speedup = f"{t_graph / d_us:.1f}x" if torch_us else "n/a"
        goal = "<= 15 us, >= 3x torch" if name == "small" else "<= 50 us, > 1x torch"
        print(f"| {name} | {d_us:.2f} | {s_us:.2f} (chain {s_chain}) | {nodes} | {chain} | {t_eager:.1f} | "
              f"{t_graph:.1f} | {speedup} | {goal} |")
    return 0


if __name__ == "__main__":
    sys.exit(_common.run(main))
