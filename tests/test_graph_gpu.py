"""Streams, events, capture, graph inspection and executable graphs on a real GPU."""

import numpy as np
import pytest
from cuda.bindings import driver as cu

from drvtrain import (CaptureError, DeviceBuffer, Event, GraphUpdateError, Stream, capture, check, fork, join,
                      load_source)
from drvtrain.demo import ForkJoinDemo, wait_for
from drvtrain.driver import active_captures
from late_writer import LATE_NS, CopyCase, copy_around_the_wait, late_copy, skip_unless_a_read_can_race, words

pytestmark = pytest.mark.gpu
BLOCK = 256
U32 = 2.0 ** -24  # float32 unit roundoff: round to nearest is off by at most U32 * |value|

# One thread that holds the GPU for ``ns`` nanoseconds of the global timer, then
# sets *done = 1. The global timer runs at a fixed rate, whatever the SM clock.
SPIN_SOURCE = r"""
extern "C" __global__ void spin_ns(unsigned long long ns, int* done) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
    *done = 1;
}
"""


def grid(n):
    return (n + BLOCK - 1) // BLOCK


def kernel_predecessors(graph, node) -> set[int]:
    """Indices of the kernel nodes reached backwards from ``node`` without passing another kernel.

    Whatever non-kernel nodes (event records, waits, empty nodes) a capture puts
    between two kernels, this is the set of kernels ``node`` directly waits for.
    """
    found, seen, stack = set(), {node.index}, [node]
    while stack:
        for dep in graph.dependencies(stack.pop()):
            if dep.index in seen:
                continue
            seen.add(dep.index)
            if dep.type == "kernel":
                found.add(dep.index)
            else:
                stack.append(dep)
    return found


@pytest.fixture
def demo(device, rng):
    d = ForkJoinDemo(int(rng.integers(5000, 70000)))
    yield d
    d.close()


def test_fork_join_graph_has_concurrent_branches_and_right_result(demo, rng):
    demo.start = float(rng.uniform(-10, 10))
    demo.out.poison(stream=demo.main)
    graph = demo.record()
    counts = graph.node_counts()
    assert counts.get("kernel") == 4
    kernels = {k.function: k for k in graph.kernel_nodes()}
    assert set(kernels) == {"iota_f32", "scale_f32", "add_f32"}
    assert kernels["add_f32"].block == (BLOCK, 1, 1) and kernels["add_f32"].grid[0] == grid(demo.n)
    left, right = demo.scale_nodes(graph)
    assert graph.can_run_concurrently(left, right)
    iota, add = kernels["iota_f32"].node, kernels["add_f32"].node
    assert not graph.can_run_concurrently(iota, left) and not graph.can_run_concurrently(left, add)
    assert graph.concurrent_branches() >= 2
    assert graph.longest_chain() >= 3
    # The join waits on both branches; capture may also keep the main stream's own
    # last node (iota) as a direct, redundant dependency of add.
    assert kernel_predecessors(graph, add) - {iota.index} == {left.index, right.index}
    assert kernel_predecessors(graph, left) == kernel_predecessors(graph, right) == {iota.index}
    assert kernel_predecessors(graph, iota) == set()
    exe = graph.instantiate()
    for _ in range(3):
        exe.launch(demo.main)
    got = demo.out.to_numpy().astype(np.float64)
    ref = demo.expected()  # 5 (start + i) in float64
    # The float32 path: start is rounded to float32 (<= U32 |start|), x = start + i
    # is rounded (<= U32 |x|), 2x is exact, 3x is rounded (<= 3 U32 |x|), and so is
    # the sum (<= 5 U32 |x|). So |out - ref| <= U32 (5 |start| + 13 |x|), to first
    # order; the factor 1.001 covers the second-order terms.
    bound = U32 * (5.0 * abs(np.float32(demo.start)) + 13.0 * np.abs(ref) / 5.0) * 1.001
    err = np.abs(got - ref)
    worst = int(np.argmax(err - bound))
    assert not np.isnan(got).any()
    assert np.all(err <= bound), (f"element {worst}: got {got[worst]!r}, want {ref[worst]!r}, "
                                  f"error {err[worst]:.3g} > bound {bound[worst]:.3g} (n {demo.n}, "
                                  f"start {demo.start!r})")
    exe.close()
    graph.close()


def test_replay_matches_eager_launches(demo, rng, elementwise):
    demo.start = float(rng.uniform(0, 5))
    graph = demo.record()
    exe = graph.instantiate()
    exe.launch(demo.main)
    replayed = demo.out.to_numpy()
    n, g = demo.n, grid(demo.n)
    x, a, b, out = (DeviceBuffer(n) for _ in range(4))
    s = demo.main
    elementwise["iota"].launch(g, BLOCK, x, demo.start, 1.0, n, stream=s)
    fork(s, demo.left, demo.right)
    elementwise["scale"].launch(g, BLOCK, a, x, 2.0, n, stream=demo.left)
    elementwise["scale"].launch(g, BLOCK, b, x, 3.0, n, stream=demo.right)
    join(s, demo.left, demo.right)
    elementwise["add"].launch(g, BLOCK, out, a, b, n, stream=s)
    np.testing.assert_array_equal(out.to_numpy(), replayed)


def test_exec_update_takes_new_parameters(rng, stream, elementwise):
    n = 4096
    src = rng.standard_normal(n).astype(np.float32)
    x, y = DeviceBuffer.from_numpy(src), DeviceBuffer(n)

    def record(factor, extra=False):
        with capture(stream) as g:
            elementwise["scale"].launch(grid(n), BLOCK, y, x, factor, n, stream=stream)
            if extra:
                elementwise["axpy"].launch(grid(n), BLOCK, y, x, 1.0, n, stream=stream)
        return g

    exe = record(2.0).instantiate()
    exe.launch(stream)
    np.testing.assert_array_equal(y.to_numpy(), 2.0 * src)
    exe.update(record(-3.0))
    y.poison(stream=stream)
    exe.launch(stream)
    np.testing.assert_array_equal(y.to_numpy(), -3.0 * src)
    with pytest.raises(GraphUpdateError, match="topology changed"):
        exe.update(record(5.0, extra=True))
    y.poison(stream=stream)
    exe.launch(stream)  # unchanged after the refused update
    np.testing.assert_array_equal(y.to_numpy(), -3.0 * src)


def test_dot_dump_names_the_kernels(demo, tmp_path):
    graph = demo.record()
    path = tmp_path / "graph.dot"
    graph.to_dot(path)
    text = path.read_text()
    assert text.lstrip().startswith("digraph")
    assert "scale_f32" in text and "add_f32" in text
    assert "kernel" in graph.summary() and "concurrent branches: 2" in graph.summary()


def test_stream_synchronize_inside_capture_is_refused_and_stream_survives(stream, elementwise):
    scratch = DeviceBuffer(16)
    with pytest.raises(CaptureError, match="Stream.synchronize"):
        with capture(stream):
            elementwise["fill"].launch(1, 32, scratch, 1.0, 16, stream=stream)
            stream.synchronize()
    assert not stream.is_capturing() and active_captures() == []
    out = DeviceBuffer(16)
    elementwise["fill"].launch(1, 32, out, 2.0, 16, stream=stream)
    stream.synchronize()
    np.testing.assert_array_equal(out.to_numpy(), np.full(16, 2.0, np.float32))


@pytest.mark.provokes_driver_errors
def test_raw_illegal_driver_call_inside_capture_names_the_call(stream, elementwise):
    with pytest.raises(CaptureError, match="cuCtxSynchronize: CUDA_ERROR_STREAM_CAPTURE"):
        with capture(stream):
            check(cu.cuCtxSynchronize)
    assert not stream.is_capturing()
    out = DeviceBuffer(16)
    elementwise["fill"].launch(1, 32, out, 4.0, 16, stream=stream)
    np.testing.assert_array_equal(out.to_numpy(), np.full(16, 4.0, np.float32))


@pytest.mark.provokes_driver_errors
def test_ignored_illegal_call_surfaces_at_capture_end(stream):
    with pytest.raises(CaptureError, match="cuStreamEndCapture.*invalidated"):
        with capture(stream):
            cu.cuCtxSynchronize()  # raw binding, status ignored: the capture is now invalid
    assert not stream.is_capturing()


@pytest.mark.provokes_driver_errors
def test_unjoined_fork_is_reported(stream, elementwise):
    side, scratch = Stream(), DeviceBuffer(16)
    with pytest.raises(CaptureError, match="cuStreamEndCapture"):
        with capture(stream):
            fork(stream, side)
            elementwise["fill"].launch(1, 32, scratch, 1.0, 16, stream=side)
    assert not stream.is_capturing() and not side.is_capturing()


def test_event_query_never_blocks_and_times(stream):
    spin_ms = 300
    spin = load_source(SPIN_SOURCE, "spin.cu").kernel("spin_ns", "u64, ptr")
    done = DeviceBuffer(1, np.int32)
    done.poison(stream=stream)
    stream.synchronize()
    start, end = Event(timing=True), Event(timing=True)
    start.record(stream)
    spin.launch(1, 1, spin_ms * 1_000_000, done, stream=stream)
    end.record(stream)
    # The kernel holds the GPU for spin_ms: a query that waited for the event would
    # have returned True. (No wall-clock bound: the answer itself shows it.)
    assert end.query() is False
    assert stream.query() is False
    wait_for(end, timeout_s=30)
    assert end.query() is True and stream.query() is True
    assert done.to_numpy()[0] == 1
    assert start.elapsed_ms(end) >= 0.5 * spin_ms  # the spin ran between the two events
    with pytest.raises(ValueError, match="timing=True"):
        Event().elapsed_ms(end)


def test_dropping_a_module_waits_for_its_running_kernels(stream):
    """What the README and `Module` warn of: the driver's unload of a module waits for
    its running kernels, so a module dropped while its kernel spins leaves that kernel
    ended; a module held leaves it running."""
    done = DeviceBuffer(1, np.int32)
    for hold in (True, False):
        done.poison(stream=stream)
        stream.synchronize()
        module = load_source(SPIN_SOURCE, "spin.cu")
        module.kernel("spin_ns", "u64, ptr").launch(1, 1, 300_000_000, done, stream=stream)
        end = stream.record()
        if not hold:
            del module  # with its only kernel: the unload runs here
        assert end.query() is (not hold)
        wait_for(end, timeout_s=30)
        assert done.to_numpy()[0] == 1


@pytest.mark.counts_device_memory
def test_garbage_collected_during_capture_is_freed_after_it(device, stream, elementwise):
    import gc

    class Cycle:
        pass

    out = DeviceBuffer(16)
    # The driver's first graph launch in a process (and the kernel's first load)
    # keep memory of their own: do both before counting, so the test holds alone.
    with capture(stream) as warm:
        elementwise["fill"].launch(1, 32, out, 5.0, 16, stream=stream)
    warm_exe = warm.instantiate()
    warm_exe.launch(stream)
    stream.synchronize()
    warm_exe.close()
    warm.close()
    gc.collect()
    before = device.memory_info()[0]
    junk = Cycle()
    junk.self, junk.buf = junk, DeviceBuffer(64 << 20, np.uint8)  # only the cyclic GC frees this
    del junk
    assert device.memory_info()[0] < before
    with capture(stream) as graph:
        elementwise["fill"].launch(1, 32, out, 6.0, 16, stream=stream)
        gc.collect()  # runs the buffer's finalizer mid-capture: its cuMemFree must wait
        elementwise["fill"].launch(1, 32, out, 7.0, 16, stream=stream)
    assert graph.node_counts() == {"kernel": 2}
    exe = graph.instantiate()
    exe.launch(stream)
    np.testing.assert_array_equal(out.to_numpy(), np.full(16, 7.0, np.float32))
    exe.close()
    assert device.memory_info()[0] == before, "the buffer freed by the GC mid-capture was not released"


@pytest.mark.parametrize("dependent,early", [(True, 1), (True, 0), (False, 1)],
                         ids=["dependent-read-before-the-wait", "dependent-read-after-the-wait",
                              "ordinary-read-before-the-wait"])
def test_a_dependent_launch_on_a_forked_stream_is_a_programmatic_dependent(device, stream, rng, dependent, early):
    """In a capture, a dependent launch's edges from the kernels it waits for are
    programmatic also across streams, through `fork`'s event: the forked stream's
    kernel starts while the parent's kernel runs. The late writer lets dependents
    start, then spins 1 ms before it writes x: a dependent reader that reads x before
    its wait meets the poison in every element, and after its wait the values. An
    ordinary launch on the forked stream starts only once the writer has ended."""
    skip_unless_a_read_can_race(device, early and dependent)
    case = CopyCase(rng)
    writer, reader = late_copy(), copy_around_the_wait()
    child = Stream()
    with capture(stream) as graph:
        writer.launch(1, 128, case.x, case.source, words(case.x), 0, 0, 0, LATE_NS, stream=stream)
        fork(stream, child)
        reader.launch(case.n // 256, 256, case.out, case.x, case.n, early, stream=child, dependent=dependent)
        join(stream, child)
    kernels = {k.function: k.node.index for k in graph.kernel_nodes()}
    edge = (kernels["late_copy"], kernels["copy_around_the_wait"])
    assert kernel_predecessors(graph, graph.nodes()[edge[1]]) == {edge[0]}
    assert (edge in graph.programmatic_edges()) == dependent
    exe = graph.instantiate()
    for _ in range(2):
        case.poison(stream)
        exe.launch(stream)
        case.check(read_before_the_writer=bool(early and dependent))
    exe.close()
    child.close()


def test_a_dependent_stamp_reads_the_timer_after_its_wait(device):
    """probe.cu's stamp_time (tools/stamp_replays.py) reads %globaltimer after its grid wait:
    launched as a dependent after `late_copy`, which lets it start at once and then spins
    1 ms, its stamp is at least 1 ms after the stamp before the writer (a stamp taken
    before the wait would be microseconds after it); the counter counts the two, and the
    ring's other slots stay as they were; three more stamps fill it, the last wrapping
    round to the first slot."""
    from drvtrain import builtin_module, dependent_launches
    skip_unless_a_read_can_race(device, early=True)
    stamp = builtin_module("probe.cu").kernel("stamp_time", "ptr ptr i32")
    ring = DeviceBuffer.from_numpy(np.full(4, 7, np.uint64))
    counter = DeviceBuffer.zeros(1, np.uint32)
    src = DeviceBuffer.from_numpy(np.arange(1, 33, dtype=np.float32))
    dst = DeviceBuffer.zeros(32, np.float32)
    stream = Stream()
    writer = late_copy()
    with dependent_launches(True):
        stamp.launch(1, 32, ring, counter, 4, stream=stream, dependent=False)
        writer.launch(1, 128, dst, src, words(src), 0, 0, 0, LATE_NS, stream=stream)
        stamp.launch(1, 32, ring, counter, 4, stream=stream)
    stream.synchronize()
    t = ring.to_numpy().astype(np.int64)
    assert int(counter.to_numpy()[0]) == 2 and t[2:].tolist() == [7, 7]
    assert t[1] - t[0] >= LATE_NS
    assert dst.to_numpy().tobytes() == src.to_numpy().tobytes()
    # Three more go to slots 2, 3 and, wrapping, 0: each later than the one before.
    for _ in range(3):
        stamp.launch(1, 32, ring, counter, 4, stream=stream)
    stream.synchronize()
    later = ring.to_numpy().astype(np.int64)
    assert int(counter.to_numpy()[0]) == 5 and later[1] == t[1]
    assert t[1] <= later[2] <= later[3] <= later[0]
    for buf in (ring, counter, src, dst):
        buf.close()
    stream.close()
