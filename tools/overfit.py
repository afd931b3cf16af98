#!/usr/bin/env python3
"""Synthetic regression smoke: an MLP learns a fixed random teacher MLP on random inputs.

The whole step (forward, MSE, backward, clip, AdamW, metrics) is captured once
and replayed; the loss curve is printed from the mapped metrics ring as it
trains, with no synchronisation and no copy. Exits 0 when the loss falls from
>= 0.3 to < 1e-3, 1 otherwise, 2 with no GPU.
"""
import contextlib
import sys
import time

import numpy as np

import _common
from drvtrain import Arena, Stream, get_device
from drvtrain.nn import FlatBuffer, MLP, ParamLayout, RegressionStep


def main(argv=None) -> int:
    parser = _common.tool_parser(__doc__)
    parser.add_argument("--steps", type=int, default=3000, help="training steps (default 3000)")
    parser.add_argument("--batch", type=int, default=256, help="batch size (default 256)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden width (default 256)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    parser.add_argument("--seed", type=int, default=0, help="seed for data, teacher and student (default 0)")
    parser.add_argument("--print-every", type=int, default=250, help="print every N steps (default 250)")
    args = parser.parse_args(argv)
    for flag, value in (("--steps", args.steps), ("--batch", args.batch), ("--hidden", args.hidden),
                        ("--print-every", args.print_every)):
        if value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    if args.seed < 0:
        parser.error(f"--seed must be at least 0, got {args.seed}")
    if not 0.0 < args.lr < float("inf"):
        parser.error(f"--lr must be a positive number, got {args.lr}")
    get_device()
    rng = np.random.default_rng(args.seed)
    inp, out, h = 16, 4, args.hidden
    layout = ParamLayout([(h, inp), (h, h), (out, h)])
    with contextlib.ExitStack() as owned:  # every buffer, stream and graph closed at its end
        stream = owned.enter_context(Stream())

        # The teacher: a random MLP of the same shape whose output layer is scaled up,
        # so the untrained student starts far from it.
        teacher_flat = layout.init_numpy(args.seed + 1)
        named = layout.unflatten(teacher_flat)
        named["layer2.weight"] *= 8.0
        teacher = owned.enter_context(FlatBuffer(layout, layout.flatten(named)))
        x = rng.standard_normal((args.batch, inp)).astype(np.float32)
        step = owned.enter_context(RegressionStep(layout, args.batch, lr=args.lr, weight_decay=0.0, max_norm=10.0,
                                                  seed=args.seed + 2))
        step.x.copy_from_numpy(x)
        teacher_mlp = MLP(layout, tf32=False)
        arena = owned.enter_context(Arena(teacher_mlp.scratch_bytes(args.batch),
                                          zeroed_bytes=teacher_mlp.zeroed_bytes(args.batch) + 256))
        target = teacher_mlp.forward(teacher, step.x, arena=arena, stream=stream).output
        step.target.copy_from(target, stream=stream)
        stream.synchronize()

        exe = owned.enter_context(step.capture(stream=stream))
        owned.enter_context(step.graph)  # the captured topology: the step leaves it open
        print(f"layout {layout.layers}, batch {args.batch}, {len(step.graph.nodes())} graph nodes per step")
        first = last = None
        started = time.perf_counter()
        for i in range(args.steps):
            exe.launch(stream)
            step.metrics.record(stream)
            for m in step.metrics.poll():
                first = m.loss if first is None else first
                last = m.loss
                if m.step == 1 or m.step % args.print_every == 0:
                    print(f"step {m.step:6d}  loss {m.loss:.6e}  grad norm {m.grad_norm:.4e}")
        stream.synchronize()
        for m in step.metrics.poll():
            last = m.loss
            if m.step % args.print_every == 0:
                print(f"step {m.step:6d}  loss {m.loss:.6e}  grad norm {m.grad_norm:.4e}")
        elapsed = time.perf_counter() - started
        print(f"first loss {first:.6e}, last loss {last:.6e}, {args.steps} steps in {elapsed:.2f} s "
              f"({elapsed / args.steps * 1e6:.1f} us/step wall), {step.metrics.missed} metrics missed")
        ok = first is not None and first >= 0.3 and last < 1e-3
        print("converged" if ok else "did NOT converge (want first >= 0.3 and last < 1e-3)")
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(_common.run(main))
