#!/usr/bin/env python3
"""Capture a graph and dump it: DOT (and SVG when graphviz is installed) plus a text summary.

--what demo is the two-stream fork/join demo of real kernels; dqn-small and
dqn-large are the captured Double-DQN training step of the two benchmark
configurations (the replay is filled with random data first).
"""
import shutil
import subprocess
import sys
from pathlib import Path

import _common
from drvtrain import Stream
from drvtrain.demo import ForkJoinDemo
from drvtrain.rl import DQNConfig, DQNStep


def main(argv=None) -> int:
    parser = _common.tool_parser(__doc__)
    parser.add_argument("--what", choices=["demo", "dqn-small", "dqn-large"], default="demo",
                        help="which graph to capture: demo (a two-stream fork/join, the default) or the "
                             "Double-DQN step of the small or large configuration")
    parser.add_argument("--out", type=Path, default=Path("graph.dot"), help="DOT file to write (default graph.dot)")
    parser.add_argument("--n", type=int, default=1 << 16, help="elements per kernel in the demo (default 65536)")
    parser.add_argument("--no-svg", action="store_true", help="skip the SVG even when `dot` is installed")
    args = parser.parse_args(argv)
    if args.what == "demo":
        with ForkJoinDemo(args.n) as demo:
            graph = demo.record()
    else:
        with Stream() as stream, DQNStep(getattr(DQNConfig, args.what.removeprefix("dqn-"))()) as step:
            step.fill_random(1, stream=stream)
            step.capture(stream=stream).close()
            graph = step.graph  # the topology outlives the step's buffers
    with graph:
        graph.to_dot(args.out)
        print(f"wrote {args.out}")
        dot = shutil.which("dot")
        if dot and not args.no_svg:
            svg = args.out.with_suffix(".svg")
            subprocess.run([dot, "-Tsvg", str(args.out), "-o", str(svg)], check=True)
            print(f"wrote {svg}")
        elif not args.no_svg:
            print("graphviz `dot` not found: no SVG written")
        print(graph.summary())
    return 0


if __name__ == "__main__":
    sys.exit(_common.run(main))
