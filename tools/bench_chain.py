#!/usr/bin/env python3
"""What each kernel of the DQN step's tail costs as a node of a dependent chain: the slope of graphs of K launches.

For each configuration, a step is built and replayed a few times (trained weights,
a filled replay), then for each kernel a graph of K launches of that kernel alone
(dependent launches, as in the step) is captured for two values of K; the time a
launch adds is (T(K_high) - T(K_low)) / (K_high - K_low), each T the median over
repeats of back-to-back replays. The kernels:
- trivial: `scale_f32` in place, one float a thread on AdamW's grid (one load round
  trip and one store): the floor a dependent node on that grid costs;
- norm: `grad_norm_partials`;
- norm+adamw: AdamW.step (the norm kernel and `adamw_clip_step`, the pair the step
  runs); AdamW's own cost is this less the norm;
- columns, rows, finish: `spectral_columns`, the rows kernel the step uses,
  `dqn_finish`; columns+rows+finish: the three in the step's order.
The launches change the learner's state (each as one more step of that kernel
would), which changes no kernel's work. What a kernel spends beyond the trivial
node is its own chain: take a part of it out (a copy of the tree, wrong values,
timing only) and the slope says what the part cost (docs/perf-notes.md, forty-first
pass).
"""
import sys

import numpy as np

import _common
from drvtrain import DeviceBuffer, Stream, builtin_module, capture, dependent_launches
from drvtrain.rl import DQNConfig, DQNStep
from drvtrain.timing import time_graph

KERNELS = ("trivial", "norm", "norm+adamw", "columns", "rows", "finish", "columns+rows+finish")


class Chain:
    """One configuration's step and what each kernel's launch needs."""

    def __init__(self, cfg, stream):
        self.stream = stream
        self.step = step = DQNStep(cfg)
        step.fill_random(1, stream=stream)
        exe = step.capture(stream=stream)
        for _ in range(3):
            exe.launch(stream)
        stream.synchronize()
        self.opt = step.optimizer
        self.scale = builtin_module("elementwise.cu").kernel("scale_f32", "ptr ptr f32 i32")
        self.floats = DeviceBuffer.from_numpy(np.ones(step.layout.size, np.float32))
        # One float a thread of AdamW's grid: the kernel's grid-stride loop makes one round trip.
        self.trivial_n = min(step.layout.size, self.opt._adam_grid * 256)

    def launch(self, kernel: str) -> None:
        step, opt, stream = self.step, self.opt, self.stream
        cb, rb = step._spectral_grids
        if kernel == "trivial":
            self.scale.launch(opt._adam_grid, 256, self.floats, self.floats, 1.0, self.trivial_n, stream=stream)
        elif kernel == "norm":
            opt._partials.launch(opt.norm_grid, opt._partials.block, opt.grads, opt.n, opt.norm_partials, opt.t,
                                 opt._t_next, 0, stream=stream)
        elif kernel == "norm+adamw":
            opt.step(stream=stream)
        elif kernel == "columns":
            step._spectral_columns.launch(cb, step._spectral_columns.block, step.params, step._spectral_mats,
                                          step.n_spectral, step.u, step._v, step._spectral_partials, opt.skip,
                                          stream=stream)
        elif kernel == "rows":
            step._spectral_rows.launch(rb, step._spectral_rows.block, step.params, step._spectral_mats,
                                       step.n_spectral, step.u, step._v, step._spectral_partials, opt.skip,
                                       stream=stream, shared_mem=step._spectral_stage)
        elif kernel == "finish":
            step._launch_finish(stream)
        else:
            step._enqueue_spectral_and_finish(stream)

    def time(self, kernel: str, launches: int, args) -> float:
        with capture(self.stream) as graph, dependent_launches(True):
            for _ in range(launches):
                self.launch(kernel)
        exe = graph.instantiate()
        try:
            return time_graph(exe, self.stream, replays=args.replays, repeats=args.repeats)
        finally:
            exe.close()
            graph.close()

    def close(self) -> None:
        self.floats.close()
        self.step.close()


def main(argv=None) -> int:
    parser = _common.tool_parser(__doc__)
    parser.add_argument("--config", choices=["small", "large", "both"], default="both",
                        help="which DQN configuration (default both)")
    parser.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS), metavar="KERNEL",
                        help=f"which kernels, of {', '.join(KERNELS)} (default all)")
    parser.add_argument("--low", type=int, default=2, help="launches in the shorter graph (default 2)")
    parser.add_argument("--high", type=int, default=10, help="launches in the longer graph (default 10)")
    parser.add_argument("--replays", type=int, default=200, help="back-to-back replays per repeat (default 200)")
    parser.add_argument("--repeats", type=int, default=7, help="repeats; the median is reported (default 7)")
    args = parser.parse_args(argv)
    if not 1 <= args.low < args.high:
        parser.error(f"need 1 <= --low < --high, got {args.low} and {args.high}")
    if args.replays < 1 or args.repeats < 1:
        parser.error("--replays and --repeats must be at least 1")
    configs = {"small": DQNConfig.small(), "large": DQNConfig.large()}
    names = list(configs) if args.config == "both" else [args.config]
    rows = []
    for name in names:
        print(f"{name}: building and replaying the step ...", flush=True)
        stream = Stream()
        chain = Chain(configs[name], stream)
        try:
            for kernel in args.kernels:
                if chain.step.n_spectral == 0 and kernel in ("columns", "rows", "columns+rows+finish"):
                    print(f"  {kernel}: skipped, no layer is projected", flush=True)
                    continue
                low, high = chain.time(kernel, args.low, args), chain.time(kernel, args.high, args)
                slope = (high - low) / (args.high - args.low)
                rows.append((name, kernel, low, high, slope))
                print(f"  {kernel}: {slope:.2f} us a launch", flush=True)
        finally:
            chain.close()
            stream.close()
    print(f"\nus a graph (median of {args.repeats} repeats of {args.replays} replays) and a launch's slope")
    print(f"| config | kernel | {args.low} launches | {args.high} launches | us a launch |")
    print("|---|---|---|---|---|")
    for name, kernel, low, high, slope in rows:
        print(f"| {name} | {kernel} | {low:.2f} | {high:.2f} | {slope:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(_common.run(main))
