"""Device buffers, the arena, mapped and pinned memory on a real GPU."""
import numpy as np
import pytest

from drvtrain import (Arena, ArenaExhausted, CaptureError, DeviceBuffer, Event, MappedBuffer,
                      PinnedBuffer, capture)
from drvtrain.demo import mapped_readback, wait_for
from drvtrain.driver import active_captures

pytestmark = pytest.mark.gpu
BLOCK = 256


def grid(n):
    return (n + BLOCK - 1) // BLOCK


def test_device_buffer_round_trip(rng, stream):
    host = rng.standard_normal((37, 129)).astype(np.float32)
    buf = DeviceBuffer.from_numpy(host)
    assert buf.shape == (37, 129) and buf.nbytes == host.nbytes
    np.testing.assert_array_equal(buf.to_numpy(), host)
    with pytest.raises(ValueError, match="does not match"):
        buf.copy_from_numpy(host.astype(np.float64))
    with pytest.raises(ValueError, match="C-contiguous"):
        buf.copy_from_numpy(np.asfortranarray(host))


def test_poison_then_kernel_writes_every_element(rng, stream, elementwise):
    n = int(rng.integers(1000, 5000))
    x = DeviceBuffer.from_numpy(rng.standard_normal(n).astype(np.float32))
    y = DeviceBuffer(n, np.float32)
    y.poison(stream=stream)
    a = float(rng.uniform(0.5, 2.0))
    elementwise["scale"].launch(grid(n), BLOCK, y, x, a, n, stream=stream)
    got = y.to_numpy()
    ref = a * x.to_numpy().astype(np.float64)
    assert not np.isnan(got).any()
    assert np.max(np.abs(got - ref)) / np.max(np.abs(ref)) < 1e-6


def test_a_closed_buffer_refuses_launches_copies_and_views(rng, stream, elementwise):
    """close() frees the memory and every later use of the buffer raises one clear
    RuntimeError before any driver call: a launch of the very same objects as the last
    (which skips packing until the close), a bind, a copy either way and a view. Another
    buffer launches as before."""
    fill = elementwise["fill"]
    n = 1024
    buf, other = DeviceBuffer(n), DeviceBuffer(n)
    value = float(rng.uniform(1.0, 2.0))
    fill.launch(grid(n), BLOCK, buf, value, n, stream=stream)
    stream.synchronize()
    np.testing.assert_array_equal(buf.to_numpy(), np.full(n, value, np.float32))
    buf.close()
    assert buf.closed and not other.closed
    for use in (lambda: fill.launch(grid(n), BLOCK, buf, value, n, stream=stream),
                lambda: fill.bind(grid(n), BLOCK, buf, value, n),
                lambda: buf.to_numpy(), lambda: buf.copy_from_numpy(np.zeros(n, np.float32)),
                lambda: buf.view(np.float32, (16,))):
        with pytest.raises(RuntimeError, match="is closed"):
            use()
    fill.launch(grid(n), BLOCK, other, value, n, stream=stream)
    stream.synchronize()
    np.testing.assert_array_equal(other.to_numpy(), np.full(n, value, np.float32))


def test_cuda_array_interface_is_seen_by_torch(rng, stream):
    torch = pytest.importorskip("torch")
    host = rng.standard_normal(1000).astype(np.float32)
    buf = DeviceBuffer.from_numpy(host)
    t = torch.as_tensor(buf, device="cuda")
    assert t.data_ptr() == buf.ptr and t.dtype == torch.float32 and tuple(t.shape) == (1000,)
    np.testing.assert_array_equal(t.cpu().numpy(), host)
    t.mul_(2.0)
    torch.cuda.synchronize()
    np.testing.assert_array_equal(buf.to_numpy(), 2.0 * host)


def test_arena_slices_are_aligned_and_repeat_after_reset(rng):
    arena = Arena(1 << 20)
    sizes = [int(s) for s in rng.integers(1, 5000, size=20)]
    first = [arena.alloc(s) for s in sizes]
    assert all(b.ptr % 256 == 0 for b in first)
    spans = sorted((b.ptr, b.ptr + b.nbytes) for b in first)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:])), "slices overlap"
    end = max(b.ptr + b.nbytes for b in first) - arena.base
    assert arena.high_water == end == arena.offset
    arena.reset()
    assert arena.offset == 0 and arena.high_water == end
    second = [arena.alloc(s) for s in sizes]
    assert [b.ptr for b in second] == [b.ptr for b in first]
    arena.reset()
    arena.alloc(16)
    assert arena.high_water == end, "high water is the peak, not the latest"
    arena.close()


def test_arena_falls_back_when_full_and_frees_at_reset(rng, stream, elementwise):
    arena = Arena(4096)
    inside = arena.alloc(4000)
    spill = arena.alloc(10_000)
    assert arena.fallback_count == 1 and arena.fallback_bytes == 10_000
    assert not (arena.base <= spill.ptr < arena.base + arena.capacity)
    n = 10_000 // 4
    v = spill.view(np.float32, (n,))
    elementwise["iota"].launch(grid(n), BLOCK, v, 1.0, 2.0, n, stream=stream)
    np.testing.assert_array_equal(v.to_numpy(), 1.0 + 2.0 * np.arange(n, dtype=np.float32))
    arena.reset()
    assert arena._loose == [] and arena.fallback_count == 1
    assert arena.alloc(4000).ptr == inside.ptr
    arena.close()


def test_arena_exhaustion_inside_capture_ends_capture_cleanly(stream, elementwise):
    arena = Arena(1024)
    with pytest.raises(ArenaExhausted, match="2048 bytes") as info:
        with capture(stream):
            arena.alloc(512)
            arena.alloc(2048)
    assert info.value.needed == 2048 and info.value.capacity == 1024
    assert not stream.is_capturing() and active_captures() == []
    assert arena.fallback_count == 0
    out = arena.array(16)  # the stream and arena still work
    elementwise["fill"].launch(1, 32, out, 3.5, 16, stream=stream)
    np.testing.assert_array_equal(out.to_numpy(), np.full(16, 3.5, np.float32))
    arena.close()


def test_inactive_arena_allocates_plainly_and_refuses_capture(stream):
    arena = Arena(1 << 16, active=False)
    a, b = arena.alloc(100), arena.alloc(100)
    assert a.ptr != b.ptr and not a.is_view and arena.offset == 0
    arena.reset()
    assert arena._loose == []
    with pytest.raises(CaptureError, match="inactive arena"):
        with capture(stream):
            arena.alloc(100)
    assert not stream.is_capturing()
    arena.close()


def test_kernel_writes_mapped_memory_read_after_query(rng):
    n = int(rng.integers(1000, 10_000))
    got = mapped_readback(n)
    np.testing.assert_array_equal(got, np.arange(n, dtype=np.float32))


def test_mapped_buffer_written_by_scale_kernel(rng, stream, elementwise):
    n = 3000
    src = rng.standard_normal(n).astype(np.float32)
    x = DeviceBuffer.from_numpy(src)
    mapped = MappedBuffer(n, np.float32)
    mapped.view()[:] = np.nan
    done = Event()
    elementwise["scale"].launch(grid(n), BLOCK, mapped, x, -3.0, n, stream=stream)
    done.record(stream)
    wait_for(done)
    np.testing.assert_array_equal(mapped.view(), (-3.0 * src.astype(np.float64)).astype(np.float32))
    mapped.close()


def test_pinned_async_copies_round_trip(rng, stream):
    n = 4097
    pinned_in, pinned_out = PinnedBuffer(n, np.float32), PinnedBuffer(n, np.float32)
    pinned_in.view()[:] = rng.standard_normal(n)
    pinned_out.view()[:] = np.nan
    dev = DeviceBuffer(n, np.float32)
    pinned_in.copy_to_device_async(dev, stream=stream)
    pinned_out.copy_from_device_async(dev, stream=stream)
    stream.synchronize()
    np.testing.assert_array_equal(pinned_out.view(), pinned_in.view())


def test_allocation_and_sync_copies_inside_capture_are_refused(stream):
    buf = DeviceBuffer(16, np.float32)
    for action, name in ((lambda: DeviceBuffer(16), "cuMemAlloc"),
                         (buf.to_numpy, "DeviceBuffer.to_numpy"),
                         (lambda: buf.copy_from_numpy(np.ones(16, np.float32)), "copy_from_numpy")):
        with pytest.raises(CaptureError, match=name):
            with capture(stream):
                action()
        assert not stream.is_capturing()
