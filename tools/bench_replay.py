#!/usr/bin/env python3
"""Prioritized replay on the device against the same work in PyTorch.

For C = 2^17 (obs_dim 4) and C = 2^20 (obs_dim 128), B = 256 and 512, each as
a replayed graph: the priority update, the stratified sample with IS weights
and gather, and sample-then-update. PyTorch does the same work with cumsum +
searchsorted + index_put, eager and as a torch CUDA graph. Prints a table and
how far the fp64 tree's fixed-order sums lie from exact sums (math.fsum) after the
benchmark's updates.
Goal: sample + gather + update <= 10 us at C = 2^20, B = 512, >= 5x PyTorch.
"""
import math
import statistics
import sys

import numpy as np

import _common
from drvtrain import Arena, DeviceBuffer, Stream, capture, get_device
from drvtrain.rl import ReplayBuffer, SumTree
from drvtrain.timing import time_graph

ALPHA, BETA = 0.6, 0.4


def filled_buffer(torch, c, d, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    data = {
        "obs": torch.randn(c, d, device="cuda", generator=gen),
        "action": torch.randint(0, 18, (c,), device="cuda", generator=gen, dtype=torch.int32),
        "reward": torch.randn(c, device="cuda", generator=gen),
        "next_obs": torch.randn(c, d, device="cuda", generator=gen),
        "done": (torch.rand(c, device="cuda", generator=gen) < 0.05).float(),
        "priority": torch.rand(c, device="cuda", generator=gen) + 0.1,
    }
    torch.cuda.synchronize()
    return data


def drvtrain_times(torch, data, c, d, b, stream, replays, repeats):
    rb = ReplayBuffer(c, d, alpha=ALPHA, seed=7, max_batch=b)
    view = DeviceBuffer.from_cuda_array
    rb.insert(view(data["obs"]), view(data["action"]), view(data["reward"]), view(data["next_obs"]),
              view(data["done"]), stream=stream)
    rb.tree.update(view(torch.arange(c, device="cuda", dtype=torch.int32)), view(data["priority"]),
                   stream=stream)
    stream.synchronize()
    idx = view(torch.randint(0, c, (b,), device="cuda", dtype=torch.int32))
    new_p = view(torch.rand(b, device="cuda") + 0.1)
    arena = Arena(8 * b * (2 * d + 8))
    times = {}

    def graph_of(body):
        arena.reset()
        with capture(stream) as g:
            body()
        return g.instantiate()

    update = graph_of(lambda: rb.update_priorities(idx, new_p, stream=stream))
    times["update"] = time_graph(update, stream, replays=replays, repeats=repeats)
    sample = graph_of(lambda: rb.sample(b, stream=stream, beta=BETA, arena=arena))
    times["sample+IS+gather"] = time_graph(sample, stream, replays=replays, repeats=repeats)

    def combined():
        batch = rb.sample(b, stream=stream, beta=BETA, arena=arena)
        rb.update_priorities(batch.indices, new_p, stream=stream)

    times["sample+gather+update"] = time_graph(graph_of(combined), stream, replays=replays, repeats=repeats)
    rb.check_errors()
    return times, rb


def torch_step(torch, data, c, b, new_p):
    p = data["priority_leaf"]
    cs = torch.cumsum(p.double(), 0)
    total = cs[-1]
    mass = (torch.arange(b, device="cuda", dtype=torch.float64)
            + torch.rand(b, device="cuda", dtype=torch.float64)) * total / b
    idx = torch.searchsorted(cs, mass, right=True).clamp_(max=c - 1)
    pj = p[idx].double()
    w = (c * pj / total) ** -BETA
    w = (w / w.max()).float()
    batch = (data["obs"][idx], data["action"][idx], data["reward"][idx], data["next_obs"][idx],
             data["done"][idx], w)
    p.index_put_((idx,), new_p ** ALPHA)
    return batch


def torch_times(torch, data, c, b, stream_unused, replays, repeats):
    data["priority_leaf"] = data["priority"] ** ALPHA
    new_p = torch.rand(b, device="cuda") + 0.1
    out = {}

    def timed(fn):
        for _ in range(10):
            fn()
        samples = []
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(repeats):
            start.record()
            for _ in range(replays):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3 / replays)
        return statistics.median(samples)

    out["eager"] = timed(lambda: torch_step(torch, data, c, b, new_p))
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                torch_step(torch, data, c, b, new_p)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            torch_step(torch, data, c, b, new_p)
        out["graph"] = timed(g.replay)
    except Exception as exc:  # report what ran
        print(f"torch CUDA graph capture failed: {exc}", file=sys.stderr)
    return out


def measure_drift(stream, capacity=1 << 20, updates=10**6, per_launch=10_000):
    """How far the fp64 sums lie from exact ones after many updates with a wide range of
    priorities: the rounding of each node's fixed-order sum, which no update accumulates."""
    rng = np.random.default_rng()
    tree = SumTree(capacity, alpha=ALPHA, seed=1)
    tree.set_priorities(np.exp(rng.normal(0, 4, capacity)).astype(np.float32))
    idx = DeviceBuffer.from_numpy(rng.integers(0, capacity, updates).astype(np.int32))
    pri = DeviceBuffer.from_numpy(np.exp(rng.normal(0, 4, updates)).astype(np.float32))
    for start in range(0, updates, per_launch):
        tree.update(idx.view(np.int32, (per_launch,), 4 * start),
                    pri.view(np.float32, (per_launch,), 4 * start), stream=stream)
    stream.synchronize()
    tree.check_errors()
    result = tree.drift()
    tree.close()
    return result


def main(argv=None) -> int:
    parser = _common.tool_parser(__doc__)
    parser.add_argument("--replays", type=int, default=1000, help="graph replays per sample (default 1000)")
    parser.add_argument("--repeats", type=int, default=5, help="samples; the median is reported (default 5)")
    args = parser.parse_args(argv)
    dev = get_device()
    try:
        import torch
    except ImportError:
        print("bench_replay: PyTorch is needed for the comparison", file=sys.stderr)
        return 2
    stream = Stream()
    rows = []
    drift = None
    for c, d in ((1 << 17, 4), (1 << 20, 128)):
        data = filled_buffer(torch, c, d, seed=c)
        for b in (256, 512):
            ours, rb = drvtrain_times(torch, data, c, d, b, stream, args.replays, args.repeats)
            theirs = torch_times(torch, data, c, b, stream, max(100, args.replays // 5), args.repeats)
            best_torch = min(theirs.values())
            for name, us in ours.items():
                ratio = f"{best_torch / us:6.1f}x" if name == "sample+gather+update" else ""
                torch_col = (" / ".join(f"{k} {v:.1f}" for k, v in theirs.items())
                             if name == "sample+gather+update" else "")
                rows.append((f"C=2^{c.bit_length() - 1} B={b} D={d}", name, f"{us:8.2f}", torch_col, ratio))
            if c == 1 << 20 and b == 512:
                leaves = rb.tree.leaves.to_numpy().astype(np.float64)
                exact = math.fsum(leaves)
                drift = abs(rb.tree.read_total() - exact) / exact
            rb.close()
        del data
        torch.cuda.empty_cache()
    print(f"\ndevice: {dev.name} ({dev.arch}, {dev.sm_count} SMs); times are us per replayed step, "
          f"median of {args.repeats}")
    header = ("config", "operation", "drvtrain us", "PyTorch us (eager / graph)", "speed-up")
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(5)]
    print(" | ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("-+-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(str(v).ljust(w) for v, w in zip(r, widths)))
    if drift is not None:
        print(f"\nfp64 tree at C=2^20 after the benchmark's updates: root vs fsum(leaves) {drift:.2e}")
    root, node = measure_drift(stream)
    print(f"fp64 tree at C=2^20 after 10^6 updates of log-normal priorities (7 decades), against exact sums: "
          f"root {root:.2e}, worst node {node:.2e} (relative)")
    print("goal: sample+gather+update <= 10 us at C=2^20, B=512, and >= 5x PyTorch")
    return 0


if __name__ == "__main__":
    sys.exit(_common.run(main))
