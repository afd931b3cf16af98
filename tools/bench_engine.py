#!/usr/bin/env python3
"""The engine's GEMMs and the whole supervised step, for the two configurations of docs/step-spec.md.

For every linear layer: the forward (TF32, bias and ReLU fused) and the backward
(dW with db, and dX with the ReLU mask; FP32) as replayed graphs, with achieved
TFLOP/s; then the full step (forward, MSE, backward, clip, AdamW, metrics) as one
replayed graph: us/step and its node count. Goals: full step <= 15 us (small),
<= 50 us (large); forward TF32 GEMM 512x1024x1024 >= 150 TFLOP/s.
"""
import sys

import numpy as np

import _common
from drvtrain import Arena, DeviceBuffer, Stream, capture, get_device
from drvtrain.nn import FlatBuffer, ParamLayout, RegressionStep
from drvtrain.nn.mlp import MLP, gemm
from drvtrain.timing import time_graph

CONFIGS = {"small": (4, [256, 256], 2, 256), "large": (128, [1024, 1024], 18, 512)}


def graph_of(stream, body):
    with capture(stream) as g:
        body()
    return g.instantiate(), g


def main(argv=None) -> int:
    parser = _common.tool_parser(__doc__)
    parser.add_argument("--replays", type=int, default=200, help="graph replays per sample (default 200)")
    parser.add_argument("--repeats", type=int, default=5, help="samples; the median is reported (default 5)")
    args = parser.parse_args(argv)
    dev = get_device()
    stream = Stream()
    rng = np.random.default_rng(0)
    rows, steps = [], []
    for name, (obs, hidden, actions, batch) in CONFIGS.items():
        widths = [obs] + hidden + [1 + actions]
        layout = ParamLayout([(o, i) for i, o in zip(widths, widths[1:])])
        params = FlatBuffer(layout, layout.init_numpy(1))
        grads = FlatBuffer(layout)
        mlp = MLP(layout, tf32=True)
        arena = Arena(mlp.scratch_bytes(batch), zeroed_bytes=mlp.zeroed_bytes(batch) + 256)
        x = DeviceBuffer.from_numpy(rng.standard_normal((batch, obs)).astype(np.float32))
        acts = mlp.forward(params, x, arena=arena, stream=stream).activations
        last = len(layout.layers) - 1
        for k, (out, inp) in enumerate(layout.layers):
            flops = 2.0 * batch * out * inp
            fwd_kernel = mlp.output_kernel if k == last else mlp.hidden_kernel
            y = acts[k + 1]
            exe, _ = graph_of(stream, lambda: gemm(fwd_kernel, acts[k], inp, params.weight(k), inp, y, out,
                                                   batch, out, inp, stream, bias=params.bias(k)))
            fwd = time_graph(exe, stream, replays=args.replays, repeats=args.repeats)
            dy = DeviceBuffer.from_numpy(rng.standard_normal((batch, out)).astype(np.float32))
            dx = DeviceBuffer((batch, inp))

            def backward():
                gemm(mlp.weight_grad_kernel, dy, out, acts[k], inp, grads.weight(k), inp, out, inp, batch, stream,
                     col_sum=grads.bias(k))
                if k > 0:
                    gemm(mlp.input_grad_kernel, dy, out, params.weight(k), inp, dx, inp, batch, inp, out, stream,
                         mask=acts[k], ldm=inp)

            exe, _ = graph_of(stream, backward)
            bwd = time_graph(exe, stream, replays=args.replays, repeats=args.repeats)
            bwd_flops = flops * (2 if k > 0 else 1)
            rows.append((name, f"{batch}x{out}x{inp}", f"{fwd:7.2f}", f"{flops / fwd / 1e6:7.2f}",
                         f"{bwd:7.2f}", f"{bwd_flops / bwd / 1e6:7.2f}"))
        step = RegressionStep(layout, batch, lr=1e-4, weight_decay=1e-2, max_norm=10.0)
        step.x.copy_from_numpy(rng.standard_normal((batch, obs)).astype(np.float32))
        step.target.copy_from_numpy(rng.standard_normal((batch, 1 + actions)).astype(np.float32))
        exe = step.capture(stream=stream)
        us = time_graph(exe, stream, replays=args.replays, repeats=args.repeats)
        steps.append((name, us, len(step.graph.nodes()), "<= 15" if name == "small" else "<= 50"))
    # The forward GEMM the goal names: 512 x 1024 x 1024, TF32.
    big = DeviceBuffer.from_numpy(rng.standard_normal((512, 1024)).astype(np.float32))
    w = DeviceBuffer.from_numpy((rng.standard_normal((1024, 1024)) / 32).astype(np.float32))
    b = DeviceBuffer.from_numpy(np.zeros(1024, np.float32))
    yb = DeviceBuffer((512, 1024))
    kern = MLP(ParamLayout([(1024, 1024)])).hidden_kernel
    exe, _ = graph_of(stream, lambda: gemm(kern, big, 1024, w, 1024, yb, 1024, 512, 1024, 1024, stream, bias=b))
    t = time_graph(exe, stream, replays=args.replays, repeats=args.repeats)

    print(f"\ndevice: {dev.name} ({dev.arch}, {dev.sm_count} SMs); us per replayed graph, median of {args.repeats}")
    header = ("config", "GEMM MxNxK", "fwd TF32 us", "TFLOP/s", "bwd FP32 us", "TFLOP/s")
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(6)]
    print(" | ".join(h.ljust(wd) for h, wd in zip(header, widths)))
    print("-+-".join("-" * wd for wd in widths))
    for r in rows:
        print(" | ".join(str(v).ljust(wd) for v, wd in zip(r, widths)))
    print(f"\nforward TF32 GEMM 512x1024x1024: {t:.2f} us, {2 * 512 * 1024 * 1024 / t / 1e6:.1f} TFLOP/s "
          f"(goal >= 150)")
    print("\nconfig | full step us | graph nodes | goal us")
    for name, us, nodes, goal in steps:
        print(f"{name:<6} | {us:12.2f} | {nodes:11d} | {goal}")
    return 0


if __name__ == "__main__":
    sys.exit(_common.run(main))
