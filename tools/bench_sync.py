#!/usr/bin/env python3
"""What one synchronisation costs on the device: a kernel boundary, a grid barrier, a cluster barrier, a hand-over.

Each is timed in a captured graph and divided by its count:
- a kernel boundary: a chain of 200 launches of `sync_chain` (kernels/probe.cu), each
  reading what the launch before wrote for the next block, ordinary and as dependent
  launches, over 1 to 528 blocks of 256 threads;
- a grid barrier: one cooperative launch of `sync_grid` with 1000 `dt_grid_barrier`s,
  each after a write the next block reads, over 1 to 264 blocks;
- a cluster barrier: one launch of `sync_cluster` with 1000 cluster barriers, each
  after a write into the next block's shared memory, for clusters of 1 to 8 blocks, one
  cluster and 16 side by side (compute capability 9.0+);
- an all-to-all hand-over in a cluster of 8: `sync_handover` with 1000 rounds, in each
  of which every block hands a 4 KB slice to every block of its cluster (32 KB arrive in
  each), by 8-byte or 16-byte remote stores and a cluster barrier, or by one bulk copy
  per receiving block completing on its mbarrier; one cluster, and 24 side by side (the
  small DQN step's cluster forward).
Every hand-over is checked; a stale read fails the run (exit 1).
"""
import sys

import numpy as np

import _common
from drvtrain import DeviceBuffer, Stream, builtin_module, capture, get_device
from drvtrain.timing import time_graph

NODES, ROUNDS = 200, 1000
HANDOVER_MODES = ((0, "8-byte remote stores, cluster barrier"), (1, "16-byte remote stores, cluster barrier"),
                  (2, "a bulk copy a block, mbarrier"))


def timed(stream, enqueue, replays: int, repeats: int) -> float:
    with capture(stream) as graph:
        enqueue()
    exe = graph.instantiate()
    us = time_graph(exe, stream, replays=replays, repeats=repeats, warmup=3)
    exe.close()
    graph.close()
    return us


def main(argv=None) -> int:
    parser = _common.tool_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=7, help="repeats; the median is reported (default 7)")
    args = parser.parse_args(argv)
    dev = get_device()
    mod = builtin_module("probe.cu")
    chain = mod.kernel("sync_chain", "ptr ptr i32")
    grid = mod.kernel("sync_grid", "ptr ptr ptr i32")
    stream = Stream()
    errors = DeviceBuffer.zeros(1, np.uint32)
    word = DeviceBuffer.zeros(1, np.uint32)
    data = DeviceBuffer.zeros(2 * 528, np.uint32)
    hopper = tuple(dev.compute_capability) >= (9, 0)
    rows = []
    for blocks in (1, 8, 16, 66, 132, 264, 528):
        for dependent in (False, True) if hopper else (False,):
            def enqueue():
                for r in range(NODES):
                    chain.launch(blocks, 256, data, errors, r, stream=stream, dependent=dependent)
            us = timed(stream, enqueue, 10, args.repeats) / NODES
            rows.append((f"kernel boundary, {blocks} blocks, {'dependent' if dependent else 'ordinary'} launch", us))
        print(f"  kernel boundaries over {blocks} blocks timed", flush=True)
    resident = grid.max_resident_blocks(256)
    for blocks in (1, 8, 16, 66, 132, 264):
        if blocks > resident:
            continue
        us = timed(stream, lambda: grid.launch(blocks, 256, word, data, errors, ROUNDS, stream=stream,
                                               cooperative=True), 5, args.repeats) / ROUNDS
        rows.append((f"grid barrier, {blocks} blocks", us))
    print("  grid barriers timed", flush=True)
    if hopper:
        clus = mod.kernel("sync_cluster", "ptr i32")
        for size in (1, 2, 4, 8):
            for clusters in (1, 16):
                us = timed(stream, lambda: clus.launch(size * clusters, 256, errors, ROUNDS, stream=stream,
                                                       cluster=(size, 1, 1)), 5, args.repeats) / ROUNDS
                rows.append((f"cluster barrier, {clusters} cluster(s) of {size}", us))
        print("  cluster barriers timed", flush=True)
        handover = mod.kernel("sync_handover", "ptr ptr i32 i32")
        checked = DeviceBuffer.zeros(1, np.uint64)
        for mode, way in HANDOVER_MODES:
            for clusters in (1, 24):
                us = timed(stream, lambda: handover.launch(8 * clusters, 256, errors, checked, ROUNDS, mode,
                                                           stream=stream, cluster=(8, 1, 1),
                                                           shared_mem=2 * 8 * 4096), 5, args.repeats) / ROUNDS
                rows.append((f"hand-over of a 4 KB slice to each of 8 blocks, {clusters} cluster(s): {way}", us))
        print("  hand-overs timed", flush=True)
    stream.synchronize()
    stale = int(errors.to_numpy()[0])
    if hopper and int(checked.to_numpy()[0]) == 0:
        print("the hand-overs checked nothing", file=sys.stderr)
        return 1
    print(f"\n{dev.name} ({dev.arch}, {dev.sm_count} SMs), 256 threads a block; us per synchronisation, "
          f"median of {args.repeats} repeats\n")
    print("| synchronisation | us |")
    print("|---|---|")
    for name, us in rows:
        print(f"| {name} | {us:.3f} |")
    if stale:
        print(f"\n{stale} stale hand-over read(s): an ordering is broken", file=sys.stderr)
        return 1
    print("\nevery hand-over read what the writer wrote")
    return 0


if __name__ == "__main__":
    sys.exit(_common.run(main))
