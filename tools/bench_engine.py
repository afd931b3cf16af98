#!/usr/bin/env python3
"""The engine's GEMMs and the whole supervised step, for the two configurations of docs/step-spec.md.

For every linear layer: the forward (TF32, bias and ReLU fused) and the backward (dW
with db, and dX with the ReLU mask; 3xTF32 tensor cores at FP32 accuracy) as replayed
graphs, each product launched on the kernels that split each operand tile as they load
it (tile, split-k), with achieved TFLOP/s; the whole backward on one stream, with dW on
a second stream, and with dW on two side streams (the last two layers' side by side),
without and with the pre-split products; the 512x1024x1024 products pre-split (the
products alone, and each split pass alone); then the full step (forward, MSE, backward,
clip, AdamW, metrics) as one replayed graph: us/step and its node count (default:
per-layer GEMMs, dW streams and dependent launches as RegressionStep picks them; dW on
the main stream, on one side stream, on two; with dependent launches, without; with the
fused narrow kernels; with the pre-split products). Goals: full step <= 10 us (small),
<= 45 us (large); forward TF32 GEMM 512x1024x1024 >= 150 TFLOP/s; its backward products
(dW with db, dX) >= 3x faster than the FP32 FFMA kernels' 143 us.
"""
import sys

import numpy as np

import _common
from drvtrain import Arena, DeviceBuffer, Stream, capture, dependent_launches, get_device
from drvtrain.nn import FlatBuffer, ParamLayout, RegressionStep
from drvtrain.nn.narrow import NarrowMLP
from drvtrain.nn.mlp import MLP, TILES, WGMMA_TILE, vector_width
from drvtrain.timing import time_graph

CONFIGS = {"small": (4, [256, 256], 2, 256), "large": (128, [1024, 1024], 18, 512)}


def graph_of(stream, arena, body):
    arena.reset()
    with capture(stream) as g:
        body()
    return g.instantiate(), g


def plan_text(kernels, role, m, n, k, tile=None, presplit=False) -> str:
    """tile/splits, and "c" when the splits meet in a cluster."""
    p = kernels.plan_presplit(role, m, n, k) if presplit else kernels.plan(role, m, n, k, tile=tile)
    if p is None:
        return "none"
    return f"{p.tile.name}/{p.splits}{'c' if p.cluster else ''}"


# Products for --sweep: (role, M, N, K), the large net's then the small net's.
SWEEP = (("forward_relu", 512, 1024, 1024), ("grad_input", 512, 1024, 1024), ("grad_weight", 1024, 1024, 512),
         ("forward_relu", 512, 1024, 128), ("grad_weight", 1024, 128, 512),
         ("forward_relu", 256, 256, 256), ("grad_input", 256, 256, 256), ("grad_weight", 256, 256, 256),
         ("forward", 256, 3, 256), ("grad_weight", 3, 256, 256), ("forward_relu", 256, 256, 4))


def sweep(stream, timed, rng, chain: int) -> None:
    """Every tensor-core tile (the wgmma tile too, on compute capability 9.0)
    at 1, 2, 3, 4, 6 and 8 splits (the wgmma tile where the operands allow
    16-byte copies), for each product of SWEEP: a
    graph of ``chain`` launches of the product back to back, ordinary and
    dependent, in us per launch. The data behind ``choose_tile`` and ``split_count``."""
    dev = get_device()
    kernels = {"forward_relu": MLP(ParamLayout([(8, 8)])).forward_kernels,
               "grad_input": MLP(ParamLayout([(8, 8)])).backward_kernels}
    kernels["forward"] = kernels["forward_relu"]
    kernels["grad_weight"] = kernels["grad_input"]
    print(f"\nsweep: us per launch in a replayed chain of {chain}, median of repeats; * = the plan's choice; "
          f"c = the splits meet in a cluster")
    print("| role | MxNxK | tile | splits | blocks | us | us dependent | TFLOP/s |\n|---|---|---|---|---|---|---|---|")
    for role, m, n, k in SWEEP:
        lk = kernels[role]
        a_rows, a_cols = (k, m) if role == "grad_weight" else (m, k)
        b_rows, b_cols = (k, n) if role in ("grad_weight", "grad_input") else (n, k)
        a = DeviceBuffer.from_numpy(rng.standard_normal((a_rows, a_cols)).astype(np.float32))
        b = DeviceBuffer.from_numpy(rng.standard_normal((b_rows, b_cols)).astype(np.float32))
        c = DeviceBuffer((m, n))
        extra = {"grad_input": {"mask": DeviceBuffer.from_numpy(rng.standard_normal((m, n)).astype(np.float32)),
                                "ldm": n},
                 "grad_weight": {"col_sum": DeviceBuffer((m,))}}.get(role)
        if extra is None:
            extra = {"bias": DeviceBuffer.from_numpy(rng.standard_normal(n).astype(np.float32))}
        chosen = lk.plan(role, m, n, k)
        wide = lk.wgmma and vector_width(a, a_cols, b, b_cols) == 16  # the wgmma tile copies 16 bytes
        for tile in TILES + ((WGMMA_TILE,) if wide else ()):
            seen = set()
            for want in (1, 2, 3, 4, 6, 8):
                p = lk.plan(role, m, n, k, tile=tile, splits=want)
                if p.splits in seen:
                    continue
                seen.add(p.splits)
                arena = Arena(chain * (4 * p.workspace_floats + 1024), zeroed_bytes=chain * (4 * p.counters + 256))
                times = []
                for dependent in (False, True):
                    def body():
                        with dependent_launches(dependent):
                            for _ in range(chain):
                                lk.launch(role, a, a_cols, b, b_cols, c, n, m, n, k, arena=arena, stream=stream,
                                          tile=tile, splits=want, **extra)
                    exe, _ = graph_of(stream, arena, body)
                    times.append(timed(exe) / chain)
                    exe.close()
                gx, gy, gz = p.grid(m, n)
                mark = " *" if (p.tile, p.splits) == (chosen.tile, chosen.splits) else ""
                print(f"| {role} | {m}x{n}x{k} | {tile.name} | {p.splits}{'c' if p.cluster else ''}{mark} | "
                      f"{gx * gy * gz} | {times[0]:.2f} | "
                      f"{times[1]:.2f} | {2.0 * m * n * k / min(times) / 1e6:.1f} |")
                arena.close()
    print(f"({dev.sm_count} SMs; TFLOP/s from the faster column, counting one product, not the three of 3xTF32)")


def main(argv=None) -> int:
    parser = _common.tool_parser(__doc__)
    parser.add_argument("--replays", type=int, default=200, help="graph replays per sample (default 200)")
    parser.add_argument("--repeats", type=int, default=5, help="samples; the median is reported (default 5)")
    parser.add_argument("--sweep", action="store_true",
                        help="only time every tile at 1, 2, 3, 4, 6 and 8 splits for the products of both nets, "
                             "as chains of launches")
    parser.add_argument("--chain", type=int, default=10, help="launches per graph in --sweep (default 10)")
    args = parser.parse_args(argv)
    dev = get_device()
    stream, side, side2 = Stream(), Stream(), Stream()
    rng = np.random.default_rng(0)
    timed = lambda exe: time_graph(exe, stream, replays=args.replays, repeats=args.repeats)
    if args.sweep:
        sweep(stream, timed, rng, args.chain)
        return 0
    rows, backwards, steps = [], [], []
    for name, (obs, hidden, actions, batch) in CONFIGS.items():
        widths = [obs] + hidden + [1 + actions]
        layout = ParamLayout.from_widths(widths)
        params = FlatBuffer(layout, layout.init_numpy(1))
        grads = FlatBuffer(layout)
        mlp = MLP(layout, tf32=True)
        presplit = MLP(layout, tf32=True, presplit=True)
        fk, bk = mlp.forward_kernels, mlp.backward_kernels
        arena = Arena(mlp.scratch_bytes(batch), zeroed_bytes=mlp.zeroed_bytes(batch) + 256)  # the activations
        # each graph's scratch
        work = Arena(max(mlp.scratch_bytes(batch), presplit.scratch_bytes(batch)),
                     zeroed_bytes=max(mlp.zeroed_bytes(batch), presplit.zeroed_bytes(batch)) + 256)
        x = DeviceBuffer.from_numpy(rng.standard_normal((batch, obs)).astype(np.float32))
        fwd_result = mlp.forward(params, x, arena=arena, stream=stream)
        acts = fwd_result.activations
        last = len(layout.layers) - 1
        for k, (out, inp) in enumerate(layout.layers):
            flops = 2.0 * batch * out * inp
            role = "forward" if k == last else "forward_relu"
            y = DeviceBuffer((batch, out))
            exe, _ = graph_of(stream, work, lambda: fk.launch(role, acts[k], inp, params.weight(k), inp, y, out,
                                                              batch, out, inp, arena=work, stream=stream,
                                                              bias=params.bias(k)))
            fwd = timed(exe)
            dy = DeviceBuffer.from_numpy(rng.standard_normal((batch, out)).astype(np.float32))
            dx = DeviceBuffer((batch, inp))

            def backward():
                bk.launch("grad_weight", dy, out, acts[k], inp, grads.weight(k), inp, out, inp, batch, arena=work,
                          stream=stream, col_sum=grads.bias(k))
                if k > 0:
                    bk.launch("grad_input", dy, out, params.weight(k), inp, dx, inp, batch, inp, out, arena=work,
                              stream=stream, mask=acts[k], ldm=inp)

            exe, _ = graph_of(stream, work, backward)
            bwd = timed(exe)
            bwd_flops = flops * (2 if k > 0 else 1)
            bwd_plan = plan_text(bk, "grad_weight", out, inp, batch)
            if k > 0:
                bwd_plan += " + " + plan_text(bk, "grad_input", batch, inp, out)
            rows.append((name, f"{batch}x{out}x{inp}", plan_text(fk, role, batch, out, inp), f"{fwd:7.2f}",
                         f"{flops / fwd / 1e6:7.2f}", bwd_plan, f"{bwd:7.2f}", f"{bwd_flops / bwd / 1e6:7.2f}"))
        # The whole backward, dW/db on the chain's stream or on a stream of their own.
        dout = DeviceBuffer.from_numpy(rng.standard_normal((batch, 1 + actions)).astype(np.float32))
        for net in (mlp, presplit):
            if net is presplit and not presplit.presplit_layers(batch):
                continue  # no product runs pre-split: the rows above already are this
            for weight_stream in (None, side, (side, side2)):
                exe, _ = graph_of(stream, work, lambda: net.backward(params, grads, fwd_result, dout, arena=work,
                                                                     stream=stream, weight_stream=weight_stream))
                how = {None: "one stream", side: "two streams"}.get(weight_stream, "three streams") + \
                    (", pre-split" if net is presplit else "")
                backwards.append((name, how, timed(exe)))
        x = rng.standard_normal((batch, obs)).astype(np.float32)
        y = rng.standard_normal((batch, 1 + actions)).astype(np.float32)
        for how, options in (("default", {}), ("dW on the main stream", {"weight_streams": 0}),
                             ("dW on one side stream", {"weight_streams": 1}),
                             ("dW on two side streams", {"weight_streams": 2}),
                             ("dependent launch", {"dependent_launch": True}),
                             ("no dependent launch", {"dependent_launch": False}),
                             ("fused narrow kernels", {"fused": True}), ("pre-split", {"presplit": True})):
            if options.get("fused") and not NarrowMLP.supports(layout):
                continue  # a wide net has no fused path: the default already is per-layer
            if "presplit" in options and not presplit.presplit_layers(batch):
                continue  # nothing runs pre-split: the default already is this
            with RegressionStep(layout, batch, lr=1e-4, weight_decay=1e-2, max_norm=10.0, **options) as step:
                step.x.copy_from_numpy(x)
                step.target.copy_from_numpy(y)
                with step.capture(stream=stream) as exe, step.graph:
                    us = timed(exe)
                    steps.append((name, how, us, len(step.graph.nodes()), "<= 10" if name == "small" else "<= 45"))
    # The products the goals name: 512 x 1024 x 1024 forward (TF32) and its backward (3xTF32).
    layout = ParamLayout([(1024, 1024)])
    mlp = MLP(layout, presplit=True)  # its pre-split kernels too
    big = DeviceBuffer.from_numpy(rng.standard_normal((512, 1024)).astype(np.float32))
    mask = DeviceBuffer.from_numpy(np.maximum(rng.standard_normal((512, 1024)), 0).astype(np.float32))
    w = DeviceBuffer.from_numpy((rng.standard_normal((1024, 1024)) / 32).astype(np.float32))
    b = DeviceBuffer.from_numpy(np.zeros(1024, np.float32))
    yb, dxb, dwb = DeviceBuffer((512, 1024)), DeviceBuffer((512, 1024)), DeviceBuffer((1024, 1024))
    arena = Arena(mlp.scratch_bytes(512), zeroed_bytes=mlp.zeroed_bytes(512) + 256)
    fk, bk = mlp.forward_kernels, mlp.backward_kernels
    exe, _ = graph_of(stream, arena, lambda: fk.launch("forward_relu", big, 1024, w, 1024, yb, 1024, 512, 1024, 1024,
                                                       arena=arena, stream=stream, bias=b))
    t_fwd = timed(exe)
    # The same forward forced onto gemm.cu's mma.sync kernels (the fallback off compute capability 9.0).
    exe, _ = graph_of(stream, arena, lambda: fk.launch("forward_relu", big, 1024, w, 1024, yb, 1024, 512, 1024, 1024,
                                                       arena=arena, stream=stream, bias=b, tile=TILES[0]))
    t_fwd_mma = timed(exe)
    exe, _ = graph_of(stream, arena, lambda: bk.launch("grad_weight", big, 1024, mask, 1024, dwb, 1024, 1024, 1024, 512,
                                                       arena=arena, stream=stream, col_sum=b))
    t_dw = timed(exe)
    exe, _ = graph_of(stream, arena, lambda: bk.launch("grad_input", big, 1024, w, 1024, dxb, 1024, 512, 1024, 1024,
                                                       arena=arena, stream=stream, mask=mask, ldm=1024))
    t_dx = timed(exe)
    # The backward forced onto gemm.cu's mma.sync kernels too.
    exe, _ = graph_of(stream, arena, lambda: bk.launch("grad_weight", big, 1024, mask, 1024, dwb, 1024, 1024, 1024, 512,
                                                       arena=arena, stream=stream, col_sum=b, tile=TILES[0]))
    t_dw_mma = timed(exe)
    exe, _ = graph_of(stream, arena, lambda: bk.launch("grad_input", big, 1024, w, 1024, dxb, 1024, 512, 1024, 1024,
                                                       arena=arena, stream=stream, mask=mask, ldm=1024,
                                                       tile=TILES[0]))
    t_dx_mma = timed(exe)
    # Pre-split: the products on split operands alone (the passes queued once, outside
    # the graph), and the passes alone.
    split_arena, pre_arena = Arena(32 << 20), Arena(32 << 20)  # 20 MB of split operands; each graph's
    _, dyt = bk.split(big, 1024, 512, 1024, arena=split_arena, stream=stream, as_is=False, transposed=True)
    _, xt = bk.split(mask, 1024, 512, 1024, arena=split_arena, stream=stream, as_is=False, transposed=True)
    dys, _ = bk.split(big, 1024, 512, 1024, arena=split_arena, stream=stream)
    _, wt = bk.split(w, 1024, 1024, 1024, arena=split_arena, stream=stream, as_is=False, transposed=True)
    pre = dict(arena=pre_arena, stream=stream)
    exe, _ = graph_of(stream, pre_arena, lambda: bk.launch_presplit("grad_weight", dyt, xt, dwb, 1024, 1024, 1024,
                                                                    512, col_sum=b, **pre))
    t_dw_pre = timed(exe)
    exe, _ = graph_of(stream, pre_arena, lambda: bk.launch_presplit("grad_input", dys, wt, dxb, 1024, 512, 1024,
                                                                    1024, mask=mask, ldm=1024, **pre))
    t_dx_pre = timed(exe)
    exe, _ = graph_of(stream, pre_arena, lambda: bk.split(big, 1024, 512, 1024, transposed=True, **pre))
    t_split_dy = timed(exe)
    exe, _ = graph_of(stream, pre_arena, lambda: bk.split(w, 1024, 1024, 1024, as_is=False, transposed=True, **pre))
    t_split_w = timed(exe)
    exe, _ = graph_of(stream, pre_arena, lambda: bk.split(mask, 1024, 512, 1024, as_is=False, transposed=True,
                                                          **pre))
    t_split_x = timed(exe)
    flops = 2.0 * 512 * 1024 * 1024

    print(f"\ndevice: {dev.name} ({dev.arch}, {dev.sm_count} SMs); us per replayed graph, median of {args.repeats}; "
          f"plan = tile/splits, c: the splits meet in a cluster")
    header = ("config", "GEMM MxNxK", "fwd plan", "fwd TF32 us", "TFLOP/s", "bwd plans", "bwd 3xTF32 us", "TFLOP/s")
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    print(" | ".join(h.ljust(wd) for h, wd in zip(header, widths)))
    print("-+-".join("-" * wd for wd in widths))
    for r in rows:
        print(" | ".join(str(v).ljust(wd) for v, wd in zip(r, widths)))
    print(f"\nforward TF32 GEMM 512x1024x1024 ({plan_text(fk, 'forward_relu', 512, 1024, 1024)}): {t_fwd:.2f} us, "
          f"{flops / t_fwd / 1e6:.1f} TFLOP/s (goal >= 150); on mma.sync "
          f"({plan_text(fk, 'forward_relu', 512, 1024, 1024, TILES[0])}): {t_fwd_mma:.2f} us, "
          f"{flops / t_fwd_mma / 1e6:.1f} TFLOP/s")
    print(f"backward 3xTF32 512x1024x1024: dW+db ({plan_text(bk, 'grad_weight', 1024, 1024, 512)}) {t_dw:.2f} us "
          f"{flops / t_dw / 1e6:.1f} TFLOP/s, dX ({plan_text(bk, 'grad_input', 512, 1024, 1024)}) {t_dx:.2f} us "
          f"{flops / t_dx / 1e6:.1f} TFLOP/s; together {t_dw + t_dx:.2f} us, {143.0 / (t_dw + t_dx):.1f}x the FFMA "
          f"kernels' 143 us (goal >= 3x); on mma.sync ({plan_text(bk, 'grad_weight', 1024, 1024, 512, TILES[0])} + "
          f"{plan_text(bk, 'grad_input', 512, 1024, 1024, TILES[0])}): {t_dw_mma:.2f} + {t_dx_mma:.2f} = "
          f"{t_dw_mma + t_dx_mma:.2f} us")
    print(f"pre-split 3xTF32 512x1024x1024: dW+db ({plan_text(bk, 'grad_weight', 1024, 1024, 512, presplit=True)}) "
          f"{t_dw_pre:.2f} us {flops / t_dw_pre / 1e6:.1f} TFLOP/s, dX "
          f"({plan_text(bk, 'grad_input', 512, 1024, 1024, presplit=True)}) {t_dx_pre:.2f} us "
          f"{flops / t_dx_pre / 1e6:.1f} TFLOP/s; together {t_dw_pre + t_dx_pre:.2f} us; the passes: dY both ways "
          f"{t_split_dy:.2f} us, W transposed {t_split_w:.2f} us, X transposed {t_split_x:.2f} us")
    print("\nconfig | whole backward | us")
    for name, how, us in backwards:
        print(f"{name:<6} | {how:<14} | {us:.2f}")
    print("\n| config | variant | full step us | graph nodes | goal us |\n|---|---|---|---|---|")
    for name, how, us, nodes, goal in steps:
        print(f"| {name} | {how} | {us:.2f} | {nodes} | {goal} |")
    return 0


if __name__ == "__main__":
    sys.exit(_common.run(main))
