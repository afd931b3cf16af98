#!/usr/bin/env python3
"""What one synchronisation costs on the device: a kernel boundary, a barrier, a hand-over, a cluster sum.

Each is timed in a captured graph and divided by its count:
- a kernel boundary: a chain of 200 launches of `sync_chain` (kernels/probe.cu), each
  reading what the launch before wrote for the next block, ordinary and as dependent
  launches, over 1 to 528 blocks of 256 threads;
- a grid-wide join: one cooperative launch of `sync_grid` with 1000 joins, over 1 to 264
  blocks: a grid barrier after a write by a block's last thread that thread 0 of the
  block before it reads, by `dt_grid_barrier` (kernels/common.cuh) and by two others to compare it
  with (every thread fencing, as before the sixty-third pass; a reduction arrival after
  an early read of the word); `dt_grid_barrier` handing nothing over; and a join with no
  barrier, where each block stores its value and the round's tag as one 8-byte word and
  every block polls all the words;
- a cluster barrier: one launch of `sync_cluster` with 1000 cluster barriers, each
  after a write into the next block's shared memory, for clusters of 1 to 8 blocks, one
  cluster and 16 side by side (compute capability 9.0+);
- an all-to-all hand-over in a cluster of 8: `sync_handover` with 1000 rounds, in each
  of which every block hands a 4 KB slice to every block of its cluster (32 KB arrive in
  each), by 8-byte or 16-byte remote stores and a cluster barrier, or by one bulk copy
  per receiving block completing on its mbarrier; one cluster, and 24 side by side (the
  small DQN step's cluster forward);
- the sum of a split tile's partials in a cluster (the split products' epilogue, alone):
  `sync_partials`, clusters of 2 and 3 blocks of 384 threads, each holding a 64 KB
  partial and summing its share of the rows over all of them, through the cluster
  window (the products' way), by one bulk copy a pair of blocks, and from its own
  partial alone (no network: the floor); one cluster, and as many as the products
  launch. Clocks a block a round (thread 0), those above the floor, and the network's
  bytes a clock above it.
Every hand-over and every sum is checked; a stale read or a wrong sum fails the run (exit 1).
--only picks some of these (default all).
"""
import sys

import numpy as np

import _common
from drvtrain import DeviceBuffer, Stream, builtin_module, capture, get_device
from drvtrain.timing import time_graph

NODES, ROUNDS = 200, 1000
HANDOVER_MODES = ((0, "8-byte remote stores, cluster barrier"), (1, "16-byte remote stores, cluster barrier"),
                  (2, "a bulk copy a block, mbarrier"))
PARTIAL_MODES = ((0, "16-byte loads through the cluster window"), (1, "a bulk copy a pair of blocks, then local loads"),
                 (2, "local loads of the block's own partial (no network)"))
PARTIAL_ROUNDS = 200
GRID_MODES = ((0, "dt_grid_barrier"), (1, "a barrier where every thread fences (fence.sc) before and after"),
              (2, "a barrier with a reduction arrival after an early read of the word"),
              (3, "dt_grid_barrier, nothing handed over"),
              (4, "tagged 8-byte words, every block polls all (no barrier)"))
SECTIONS = ("boundary", "grid", "cluster", "handover", "partials")


def timed(stream, enqueue, replays: int, repeats: int) -> float:
    with capture(stream) as graph:
        enqueue()
    exe = graph.instantiate()
    us = time_graph(exe, stream, replays=replays, repeats=repeats, warmup=3)
    exe.close()
    graph.close()
    return us


def partials(mod, stream, errors, sm_count: int) -> list[tuple[str, ...]]:
    """`sync_partials` in clusters of 2 and 3: one cluster, then as many as fill the SMs in whole
    tiles (the wide products' 64 and 32); a row of the table for each way, with the clocks above
    the local loads' (the floor: the same sums with no byte over the network)."""
    kernel = mod.kernel("sync_partials", "ptr ptr i32 i32")
    rows = []
    for size, many in ((2, 64), (3, 32)):
        share = -(-128 // size)
        network = (size - 1) * share * 512
        shared = 128 * 128 * 4 + size * share * 512  # the partial, the receive and the result buffers
        for clusters in (1, min(many, sm_count // size)):
            clocks = DeviceBuffer.zeros(size * clusters, np.int64)
            stats = {}
            for mode, _ in PARTIAL_MODES:
                per_round = []
                for _ in range(5):
                    kernel.launch(size * clusters, 384, errors, clocks, PARTIAL_ROUNDS, mode, stream=stream,
                                  cluster=(size, 1, 1), shared_mem=shared)
                    stream.synchronize()
                    per_round.append(clocks.to_numpy() / PARTIAL_ROUNDS)
                c = np.concatenate(per_round)
                stats[mode] = tuple(float(np.percentile(c, q)) for q in (50, 10, 90))
            clocks.close()
            floor = stats[2][0]
            for mode, way in PARTIAL_MODES:
                med, p10, p90 = stats[mode]
                over = med - floor
                rate = f"{network / over:.0f}" if mode < 2 and over > 0 else "-"
                rows.append((str(size), str(clusters), way, f"{med:.0f} [{p10:.0f}, {p90:.0f}]",
                             f"{over:.0f}" if mode < 2 else "-", f"{network / 1024:.1f}", rate))
    return rows


def main(argv=None) -> int:
    parser = _common.tool_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=7, help="repeats; the median is reported (default 7)")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS), metavar="SECTION",
                        help=f"which measurements, of {', '.join(SECTIONS)} (default all)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    only = set(args.only)
    dev = get_device()
    mod = builtin_module("probe.cu")
    chain = mod.kernel("sync_chain", "ptr ptr i32")
    grid = mod.kernel("sync_grid", "ptr ptr ptr i32 i32")
    stream = Stream()
    errors = DeviceBuffer.zeros(1, np.uint32)
    word = DeviceBuffer.zeros(1, np.uint32)
    data = DeviceBuffer.zeros(2 * 528, np.uint32)
    tagged = DeviceBuffer.zeros(2 * 264 * 2, np.uint32)  # mode 4's words: no old value can carry a tag
    hopper = tuple(dev.compute_capability) >= (9, 0)
    rows = []
    for blocks in (1, 8, 16, 66, 132, 264, 528) if "boundary" in only else ():
        for dependent in (False, True) if hopper else (False,):
            def enqueue():
                for r in range(NODES):
                    chain.launch(blocks, 256, data, errors, r, stream=stream, dependent=dependent)
            us = timed(stream, enqueue, 10, args.repeats) / NODES
            rows.append((f"kernel boundary, {blocks} blocks, {'dependent' if dependent else 'ordinary'} launch", us))
        print(f"  kernel boundaries over {blocks} blocks timed", flush=True)
    resident = grid.max_resident_blocks(256)
    for mode, way in GRID_MODES if "grid" in only else ():
        for blocks in (1, 8, 16, 66, 132, 264):
            if blocks > resident:
                continue
            us = timed(stream, lambda: grid.launch(blocks, 256, word, tagged if mode == 4 else data, errors, ROUNDS,
                                                   mode, stream=stream, cooperative=True), 5, args.repeats) / ROUNDS
            rows.append((f"grid-wide join, {blocks} blocks: {way}", us))
        print(f"  grid-wide joins timed: {way}", flush=True)
    checked = None
    partial_rows = []
    if hopper and "cluster" in only:
        clus = mod.kernel("sync_cluster", "ptr i32")
        for size in (1, 2, 4, 8):
            for clusters in (1, 16):
                us = timed(stream, lambda: clus.launch(size * clusters, 256, errors, ROUNDS, stream=stream,
                                                       cluster=(size, 1, 1)), 5, args.repeats) / ROUNDS
                rows.append((f"cluster barrier, {clusters} cluster(s) of {size}", us))
        print("  cluster barriers timed", flush=True)
    if hopper and "handover" in only:
        handover = mod.kernel("sync_handover", "ptr ptr i32 i32")
        checked = DeviceBuffer.zeros(1, np.uint64)
        for mode, way in HANDOVER_MODES:
            for clusters in (1, 24):
                us = timed(stream, lambda: handover.launch(8 * clusters, 256, errors, checked, ROUNDS, mode,
                                                           stream=stream, cluster=(8, 1, 1),
                                                           shared_mem=2 * 8 * 4096), 5, args.repeats) / ROUNDS
                rows.append((f"hand-over of a 4 KB slice to each of 8 blocks, {clusters} cluster(s): {way}", us))
        print("  hand-overs timed", flush=True)
    if hopper and "partials" in only:
        partial_rows = partials(mod, stream, errors, dev.sm_count)
        print("  cluster sums timed", flush=True)
    stream.synchronize()
    stale = int(errors.to_numpy()[0])
    if checked is not None and int(checked.to_numpy()[0]) == 0:
        print("the hand-overs checked nothing", file=sys.stderr)
        return 1
    print(f"\n{dev.name} ({dev.arch}, {dev.sm_count} SMs), 256 threads a block; us per synchronisation, "
          f"median of {args.repeats} repeats\n")
    print("| synchronisation | us |")
    print("|---|---|")
    for name, us in rows:
        print(f"| {name} | {us:.3f} |")
    if stale:
        print(f"\n{stale} stale read(s) or wrong value(s) in a hand-over, a join or a cluster sum (a tagged join "
              "counts a wrong value at each poll): an ordering is broken", file=sys.stderr)
        return 1
    if partial_rows:
        print(f"\nThe sum of a split tile's partials in a cluster ({PARTIAL_ROUNDS} rounds a launch; clocks a "
              "round, thread 0 of each block, median [p10, p90] over the blocks of 5 launches; network bytes: what "
              "a block reads of the other blocks' partials; the floor: the local loads' row):\n")
        print("| cluster | clusters | way | clocks a round | above the floor | network KB a block | "
              "bytes a clock above the floor |")
        print("|---|---|---|---|---|---|---|")
        for row in partial_rows:
            print("| " + " | ".join(row) + " |")
    print("\nof what ran, every synchronisation read what the writer wrote and every cluster sum was exact")
    if not hopper:
        print("no cluster barrier, hand-over or cluster sum ran: they need compute capability 9.0")
    return 0


if __name__ == "__main__":
    sys.exit(_common.run(main))
