#!/usr/bin/env python3
"""Audit the captured Double-DQN step: driver calls per steady-state step, and a lint of its graph.

A counting wrapper around cuda.bindings.driver counts every driver call drvtrain
makes while N captured steps run the way a trainer runs them (graph launch,
metrics event, metrics poll, error-flag check). Synchronisations, copies,
allocations, eager launches and tensor-map encodes must all be 0 per step. The graph must have no
single-block kernel, no memset or memcpy node, the spectral projection in at
most 2 kernels, forwards on TF32 and backwards on FP32 kernels, and the target
forward concurrent with the online forward. Exit 0 when every row passes.
"""
import sys

import _common
from drvtrain import Stream
from drvtrain.audit import format_table
from drvtrain.rl import DQNConfig, DQNStep
from drvtrain.rl.dqn import audit_step


def main(argv=None) -> int:
    parser = _common.tool_parser(__doc__)
    parser.add_argument("--config", choices=["small", "large", "both"], default="both",
                        help="benchmark configuration(s) to audit (default both)")
    parser.add_argument("--steps", type=int, default=500, help="steady-state steps counted (default 500)")
    parser.add_argument("--one-stream", action="store_true", help="audit the single-stream variant instead")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    names = ["small", "large"] if args.config == "both" else [args.config]
    ok = True
    for name in names:
        cfg = getattr(DQNConfig, name)(dual_stream=not args.one_stream)
        stream = Stream()
        print(f"{name}: filling a replay of {cfg.capacity} transitions ...", flush=True)
        step = DQNStep(cfg)
        step.fill_random(1, stream=stream)
        rows, _ = audit_step(step, stream=stream, iterations=args.steps)
        print(format_table(rows, f"\n{name} configuration, {args.steps} steps, "
                                 f"{len(step.graph.nodes())} graph nodes"))
        ok &= all(r.passed for r in rows)
        step.close()
    print("\nall criteria pass" if ok else "\nSOME CRITERIA FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(_common.run(main))
