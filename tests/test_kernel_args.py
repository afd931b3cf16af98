"""Argument signatures, packing and launch-shape validation (CPU: no driver call is made)."""
import ctypes
import struct

import numpy as np
import pytest

from drvtrain.driver import DeviceLimits
from drvtrain.kernel import ArgPack, Kernel, parse_signature
from drvtrain.memory import DeviceBuffer

H200_LIKE = DeviceLimits(max_threads_per_block=1024, max_block=(1024, 1024, 64),
                         max_grid=(2**31 - 1, 65535, 65535), max_shared_per_block=48 * 1024,
                         max_shared_per_block_optin=227 * 1024)


def fake_buffer(address: int, n: int = 16) -> DeviceBuffer:
    """A DeviceBuffer view over an address, made without any driver call."""
    return DeviceBuffer._view(None, address, (n,), np.float32)


def read_packed(pack: ArgPack) -> list[bytes]:
    """The bytes each entry of the void* array points at, as the driver would read them."""
    sizes = {"ptr": 8, "i32": 4, "u32": 4, "i64": 8, "u64": 8, "f32": 4, "f64": 8}
    table = (ctypes.c_void_p * len(pack.signature)).from_address(pack.address)
    return [ctypes.string_at(table[i], sizes[k]) for i, k in enumerate(pack.signature)]


def test_signature_parsing_accepts_names_and_aliases():
    assert parse_signature("ptr, i32, f32") == ("ptr", "i32", "f32")
    assert parse_signature(["pointer", "int", "float", "double", "u64"]) == ("ptr", "i32", "f32", "f64", "u64")
    with pytest.raises(ValueError, match="unknown argument kind"):
        parse_signature("ptr, half")


def test_pack_writes_each_argument_in_its_c_layout(rng):
    addr = int(rng.integers(1, 2**40)) * 256
    n, m = int(rng.integers(-2**31, 2**31)), int(rng.integers(0, 2**32))
    x, big = float(rng.standard_normal()), int(rng.integers(-2**62, 2**62))
    pack = ArgPack(parse_signature("ptr, i32, u32, f32, f64, i64, ptr"))
    pack.pack((fake_buffer(addr), n, m, x, x, big, addr + 512))
    raw = read_packed(pack)
    assert raw[0] == struct.pack("<Q", addr)
    assert raw[1] == struct.pack("<i", n)
    assert raw[2] == struct.pack("<I", m)
    assert raw[3] == struct.pack("<f", x)
    assert raw[4] == struct.pack("<d", x)
    assert raw[5] == struct.pack("<q", big)
    assert raw[6] == struct.pack("<Q", addr + 512)


def test_pack_is_reused_and_set_rewrites_in_place(rng):
    pack = ArgPack(parse_signature("ptr, i32"))
    address = pack.address
    pack.pack((fake_buffer(4096), 5))
    pack.set(1, 77)
    pack.set(0, fake_buffer(8192))
    assert pack.address == address
    assert pack.values() == [8192, 77]


@pytest.mark.parametrize("args, error, match", [
    ((1,), TypeError, "takes 3 arguments"),
    ((1, 2, 3, 4), TypeError, "takes 3 arguments"),
    ((np.zeros(4, np.float32), 1, 1.0), TypeError, "host numpy array"),
    (("buffer", 1, 1.0), TypeError, "expected a device buffer"),
    ((None, 1, 1.0), TypeError, "expected a device buffer"),
    ((4096, 1.5, 1.0), TypeError, "expected an integer"),
    ((4096, 1, "x"), TypeError, "expected a number"),
    ((4096, 2**31, 1.0), ValueError, "does not fit i32"),
    ((-8, 1, 1.0), ValueError, "negative device address"),
])
def test_bad_arguments_fail_before_any_driver_call(args, error, match):
    pack = ArgPack(parse_signature("ptr, i32, f32"))
    with pytest.raises(error, match=match):
        pack.pack(args)


def test_objects_exposing_cuda_array_interface_are_pointers():
    class Foreign:
        __cuda_array_interface__ = {"data": (123456, False), "shape": (4,), "typestr": "<f4", "version": 3}
    pack = ArgPack(parse_signature("ptr"))
    pack.pack((Foreign(),))
    assert pack.values() == [123456]


def test_foreign_arrays_with_index_are_packed_by_address_on_every_path(rng):
    """An object without ``.ptr`` whose ``__index__`` gives its value (a one-element integer tensor) packs its
    ``__cuda_array_interface__`` address, on the validating path (first pack) and the fast path (the next)."""
    class OneElement:
        def __init__(self, address):
            self.__cuda_array_interface__ = {"data": (address, False), "shape": (1,), "typestr": "<i8",
                                             "version": 3}

        def __index__(self):
            return 5

    first, second = (int(rng.integers(1, 2**40)) * 256 for _ in range(2))
    pack = ArgPack(parse_signature("ptr, i32"))
    pack.pack((OneElement(first), 1))
    assert pack.values() == [first, 1]
    pack.pack((OneElement(second), 2))
    assert pack.values() == [second, 2]
    assert read_packed(pack)[0] == struct.pack("<Q", second)


def test_buffer_views_keep_offsets_and_bounds():
    buf = fake_buffer(1 << 20, 64)
    v = buf.view(np.float32, (8,), offset=128)
    assert v.ptr == (1 << 20) + 128 and v.nbytes == 32 and v.is_view
    assert v.__cuda_array_interface__["data"] == ((1 << 20) + 128, False)
    with pytest.raises(ValueError, match="exceeds"):
        buf.view(np.float32, (64,), offset=4)
    with pytest.raises(ValueError, match="not aligned"):
        buf.view(np.float64, (2,), offset=4)


def make_kernel(signature="ptr, i32", max_threads=1024) -> Kernel:
    return Kernel(None, "k", signature, H200_LIKE, max_threads)


@pytest.mark.parametrize("grid, block, shared, match", [
    (0, 256, 0, "grid dimension x = 0"),
    ((1, 70000), 256, 0, "grid dimension y"),
    (1, 2048, 0, "block dimension x"),
    (1, (32, 32, 2), 0, "2048 threads"),
    (1, (1, 1, 65), 0, "block dimension z"),
    (1, 256, 300 * 1024, "shared memory"),
    ((1, 2, 3, 4), 32, 0, "1 to 3 dimensions"),
])
def test_launch_shape_is_checked_against_device_limits(grid, block, shared, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make_kernel().check_launch(grid, block, shared)


def test_kernel_specific_thread_limit_applies():
    with pytest.raises(ValueError, match="limit of 256"):
        make_kernel(max_threads=256).check_launch(1, 512)
    assert make_kernel().check_launch((4, 2), (32, 8)) == ((4, 2, 1), (32, 8, 1))


def test_launch_needs_a_stream_object():
    k = make_kernel()
    with pytest.raises(TypeError, match="legacy stream"):
        k.launch(1, 32, fake_buffer(4096), 3, stream=None)


def test_repeated_launches_pack_only_what_changed(monkeypatch):
    import drvtrain.kernel as kernel_module
    seen = []

    def fake_launch(function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        table = (ctypes.c_void_p * 2).from_address(params)
        seen.append((ctypes.string_at(table[0], 8), ctypes.string_at(table[1], 4), (gx, bx)))
        return (0,)

    monkeypatch.setattr(kernel_module, "_cuLaunchKernel", fake_launch)

    class FakeStream:
        handle = 0

    k = make_kernel("ptr, i32")
    a, b = fake_buffer(4096), fake_buffer(8192)
    k.launch(2, 64, a, 5, stream=FakeStream())
    k.launch(2, 64, a, 5, stream=FakeStream())  # identical: served from the pack as it is
    k.launch(3, 64, b, 6, stream=FakeStream())
    assert seen == [(struct.pack("<Q", 4096), struct.pack("<i", 5), (2, 64))] * 2 + [
        (struct.pack("<Q", 8192), struct.pack("<i", 6), (3, 64))]
    with pytest.raises(TypeError, match="host numpy array"):
        k.launch(3, 64, np.zeros(4, np.float32), 6, stream=FakeStream())
    with pytest.raises(TypeError, match="expected an integer"):
        k.launch(3, 64, b, 6.0, stream=FakeStream())


@pytest.mark.parametrize("kind, value", [("i32", True), ("f32", False), ("u64", True), ("ptr", True),
                                         ("f64", np.True_), ("i32", 1.5), ("i32", np.float32(2.0)),
                                         ("ptr", -1), ("ptr", 3.0), ("u32", -1), ("i32", 2**31)])
def test_fast_and_validating_paths_refuse_the_same_inputs(kind, value):
    """Whatever the order of calls, a value the validating path refuses never gets packed."""
    good = {"ptr": 4096, "i32": 7, "u32": 7, "i64": 7, "u64": 7, "f32": 0.5, "f64": 0.5}[kind]
    sig = parse_signature(f"{kind}, i32")
    for warm in (False, True):
        pack = ArgPack(sig)
        if warm:  # an accepted pack first, so the fast path is armed
            pack.pack((good, 1))
        with pytest.raises((TypeError, ValueError, OverflowError)):
            pack.pack((value, 1))
        assert pack.refs == ()


def test_failed_pack_never_leaves_stale_arguments_behind(rng):
    """launch(A) ok, launch(B) fails half-way, launch(A) again: the pack holds A exactly."""
    sig = parse_signature("ptr, i32, f32, i32")
    a = (fake_buffer(int(rng.integers(1, 2**30)) * 256), int(rng.integers(-1000, 1000)),
         float(rng.standard_normal()), int(rng.integers(-1000, 1000)))
    pack = ArgPack(sig)
    pack.pack(a)
    want = pack.values()
    b = (fake_buffer(int(rng.integers(1, 2**30)) * 256), int(rng.integers(1000, 2000)), 0.25, 2**40)
    with pytest.raises((ValueError, OverflowError)):
        pack.pack(b)  # the last argument does not fit i32: the first ones may already be written
    assert pack.refs == ()
    pack.pack(a)
    assert pack.values() == want


def test_kernel_launch_repacks_after_a_failed_launch(rng):
    """Kernel.launch skips packing for the very same argument objects; after a failure it must not."""
    kern = Kernel(None, "k", "ptr, i32", H200_LIKE)
    sent = []
    import drvtrain.kernel as kmod
    original = kmod._cuLaunchKernel
    kmod._cuLaunchKernel = lambda *args: (sent.append(list(kern._pack.values())), (0,))[1]
    try:
        class FakeStream:
            handle = 0
        a = (fake_buffer(4096), 5)
        kern.launch(1, 32, *a, stream=FakeStream())
        with pytest.raises(ValueError):
            kern.launch(1, 32, fake_buffer(8192), 2**40, stream=FakeStream())
        kern.launch(1, 32, *a, stream=FakeStream())
    finally:
        kmod._cuLaunchKernel = original
    assert sent == [[4096, 5], [4096, 5]]


def test_fixed_block_kernels_refuse_other_blocks():
    kern = Kernel(None, "reduce", "ptr", H200_LIKE, max_threads=256, fixed_block=True)
    assert kern.block == 256
    kern.check_launch(4, 256)
    for block in (128, 512, (256, 2), (16, 16)):
        with pytest.raises(ValueError, match=r"exactly \(256, 1, 1\)"):
            kern.check_launch(4, block)
    assert Kernel(None, "free", "ptr", H200_LIKE, max_threads=256).block is None


def owning_fake(address: int, freed: list) -> DeviceBuffer:
    """An owning DeviceBuffer over an address, its cuMemFree a stand-in that records it."""
    import weakref
    buf = fake_buffer(address)
    buf._finalizer = weakref.finalize(buf, freed.append, address)
    return buf


def test_a_closed_buffer_is_refused_by_both_packing_paths_and_says_so(rng):
    """DeviceBuffer.close() takes ``ptr`` away before it frees: the fast path (types
    seen before) and the validating path (types new to the pack) both refuse the
    buffer with one error naming the argument, nothing stale stays packed, and
    ``repr``, ``closed``, views and a second close agree; a view's close frees nothing."""
    addr = int(rng.integers(1, 2**40)) * 256
    freed = []
    pack = ArgPack(parse_signature("ptr, i32"))
    buf, fresh = owning_fake(addr, freed), owning_fake(addr + 256, freed)
    pack.pack((buf, 3))  # the types are now the fast path's
    assert read_packed(pack)[0] == struct.pack("<Q", addr)
    buf.close()
    buf.close()  # a second close frees nothing more
    assert freed == [addr] and buf.closed and not fresh.closed
    assert "closed" in repr(buf) and f"{addr:x}" not in repr(buf) and not hasattr(buf, "ptr")
    for p in (pack, ArgPack(parse_signature("ptr, i32"))):  # fast path, then validating path
        with pytest.raises(RuntimeError, match=r"argument 0: DeviceBuffer \(16,\) float32 is closed"):
            p.pack((buf, 3))
        assert p.refs == ()
    for use in (lambda: buf.view(np.float32, (4,)), lambda: buf.__cuda_array_interface__):
        with pytest.raises(RuntimeError, match="is closed: its memory was freed"):
            use()
    pack.pack((fresh, 4))  # the pack still takes a buffer that is open
    assert read_packed(pack)[0] == struct.pack("<Q", addr + 256)
    view = fake_buffer(addr + 512)
    view.close()
    assert not view.closed and view.ptr == addr + 512 and freed == [addr]


def test_a_launch_of_the_very_same_objects_after_a_close_packs_again_and_refuses(rng, monkeypatch):
    """Kernel.launch skips packing when every argument is the object it packed last; a
    close of one of them makes the next launch pack, and so refuse it, before any
    driver call; bound launches of other buffers are untouched."""
    import drvtrain.kernel as kmod
    sent = []
    monkeypatch.setattr(kmod, "_cuLaunchKernel", lambda *args: (sent.append(list(kern._pack.values())), (0,))[1])

    class FakeStream:
        handle = 0
    addr = int(rng.integers(1, 2**40)) * 256
    freed = []
    kern = Kernel(None, "k", "ptr, i32", H200_LIKE)
    buf, other = owning_fake(addr, freed), owning_fake(addr + 256, freed)
    n = 1024
    kern.launch(1, 32, buf, n, stream=FakeStream())
    kern.launch(1, 32, buf, n, stream=FakeStream())  # the very same objects: not packed again
    bound = kern.bind(1, 32, other, n)
    buf.close()
    with pytest.raises(RuntimeError, match="argument 0: DeviceBuffer .* is closed"):
        kern.launch(1, 32, buf, n, stream=FakeStream())
    assert bound.pack.refs == (other, n)  # a pack that did not name it keeps its arguments
    kern.launch(1, 32, other, n, stream=FakeStream())
    assert sent == [[addr, n], [addr, n], [addr + 256, n]] and freed == [addr]
