#!/usr/bin/env python3
"""Capture a graph and dump it: DOT (and SVG when graphviz is installed) plus a text summary.

The graph is the two-stream fork/join demo of real kernels; later the training
step joins the choices of --what.
"""
import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from drvtrain import NoDeviceError
from drvtrain.demo import ForkJoinDemo


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--what", choices=["demo"], default="demo",
                        help="which graph to capture (default: demo, a two-stream fork/join)")
    parser.add_argument("--out", type=Path, default=Path("graph.dot"), help="DOT file to write (default graph.dot)")
    parser.add_argument("--n", type=int, default=1 << 16, help="elements per kernel in the demo (default 65536)")
    parser.add_argument("--no-svg", action="store_true", help="skip the SVG even when `dot` is installed")
    args = parser.parse_args(argv)
    try:
        demo = ForkJoinDemo(args.n)
    except NoDeviceError as exc:
        print(f"dump_graph: {exc}", file=sys.stderr)
        return 2
    graph = demo.record()
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
    sys.exit(main())
