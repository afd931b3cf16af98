"""Tensor maps on the CPU: the ``tmap`` argument kind's packing, and every limit
``tensor_map_2d`` checks before it asks the driver (no driver call is made, except the
encode of a valid request, which without a driver is one NoDeviceError)."""
import ctypes

import numpy as np
import pytest

from drvtrain import NoDeviceError
from drvtrain.kernel import ArgPack, parse_signature
from drvtrain.memory import DeviceBuffer
from drvtrain.tma import TensorMap, tensor_map_2d


def fake_matrix(address: int, rows: int, cols: int, dtype=np.float32) -> DeviceBuffer:
    """A DeviceBuffer view over an address, made without any driver call."""
    return DeviceBuffer._view(None, address, (rows, cols), dtype)


def fake_map(raw: bytes) -> TensorMap:
    return TensorMap(raw, None, (1, 4), 4, (1, 4), np.dtype(np.float32), "none", "zero")


def test_tmap_kind_and_its_aliases():
    assert parse_signature("ptr, tmap, i32") == ("ptr", "tmap", "i32")
    assert parse_signature(["tensor_map", "CUtensorMap"]) == ("tmap", "tmap")


def test_a_tensor_map_packs_its_128_bytes_into_a_slot_of_its_own(rng):
    addr = int(rng.integers(1, 2**40)) * 256
    raw_a, raw_b = (bytes(rng.integers(0, 256, 128, dtype=np.uint8)) for _ in range(2))
    n, x = int(rng.integers(-2**31, 2**31)), float(rng.standard_normal())
    pack = ArgPack(parse_signature("ptr, tmap, i32, tmap, f32"))
    for _ in range(2):  # the validating path, then the fast one
        pack.pack((addr, fake_map(raw_a), n, fake_map(raw_b), x))
        table = (ctypes.c_void_p * 5).from_address(pack.address)
        got = [ctypes.string_at(table[i], size) for i, size in enumerate((8, 128, 4, 128, 4))]
        assert got == [addr.to_bytes(8, "little"), raw_a, n.to_bytes(4, "little", signed=True), raw_b,
                       np.float32(x).tobytes()]
        offsets = [table[i] - table[0] for i in range(5)]
        assert offsets == [0, 8, 136, 144, 272]  # no slot overlaps the next
    pack.set(1, fake_map(raw_b))
    assert ctypes.string_at((ctypes.c_void_p * 5).from_address(pack.address)[1], 128) == raw_b
    assert pack.values()[1] == raw_b and pack.values()[3] == raw_b


def test_a_tensor_map_of_the_wrong_size_or_kind_is_refused_by_both_paths(rng):
    pack = ArgPack(parse_signature("tmap, i32"))
    good = fake_map(bytes(128))
    pack.pack((good, 1))
    pack.pack((good, 2))  # the fast path is now in use for these types
    with pytest.raises(ValueError, match="argument 0: a tensor map is 128 bytes, got 127"):
        pack.pack((bytes(127), 3))
    with pytest.raises(TypeError, match="argument 0: expected a TensorMap"):
        pack.pack((12345, 3))
    with pytest.raises(TypeError, match="argument 0: expected a TensorMap"):
        pack.pack((bytearray(128), 3))  # mutable: a repeated launch could not trust its packing
    with pytest.raises(ValueError, match="128 bytes"):
        fake_map(bytes(100))
    with pytest.raises(AttributeError, match="read-only"):
        good.raw = bytes(128)
    assert pack.refs == ()  # a failed pack names no arguments


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(box=(128, 64)), ValueError, "wider than the 128B swizzle"),
    (dict(box=(128, 16), swizzle="32B"), ValueError, "wider than the 32B swizzle"),
    (dict(box=(300, 32)), ValueError, "at most 256"),
    (dict(box=(128, 3)), ValueError, "box row of 3 x 4 bytes is not a multiple of 16"),
    (dict(box=(128, 0)), ValueError, "box must be 2 positive ints"),
    (dict(box=128), TypeError, "box must be 2 positive ints"),
    (dict(box=(128, 32), ld=1030), ValueError, "row stride of 1030 x 4 bytes"),
    (dict(box=(128, 32), ld=1000), ValueError, "ld must be an int of at least cols = 1024"),
    (dict(box=(128, 32), shape=(513, 1024)), ValueError, "the buffer has 2097152"),
    (dict(box=(128, 32), swizzle="256B"), ValueError, "swizzle must be one of"),
    (dict(box=(128, 32), oob="ones"), ValueError, "oob must be 'zero' or 'nan'"),
])
def test_limits_are_named_before_the_driver_is_asked(kwargs, error, match):
    m = fake_matrix(1 << 30, 512, 1024)
    with pytest.raises(error, match=match):
        tensor_map_2d(m, **kwargs)


def test_alignment_dtype_and_shape_limits():
    with pytest.raises(ValueError, match="16-byte boundary"):
        tensor_map_2d(fake_matrix((1 << 30) + 4, 64, 64), (64, 32))
    with pytest.raises(TypeError, match="tensor maps take"):
        tensor_map_2d(fake_matrix(1 << 30, 64, 64, np.int16), (64, 32))
    with pytest.raises(ValueError, match="needs a floating-point buffer"):
        tensor_map_2d(fake_matrix(1 << 30, 64, 64, np.int32), (64, 32), oob="nan")
    with pytest.raises(ValueError, match="not 2-D"):
        tensor_map_2d(DeviceBuffer._view(None, 1 << 30, (4096,), np.float32), (64, 32))
    with pytest.raises(TypeError, match="must be a device buffer"):
        tensor_map_2d(np.zeros((64, 64), np.float32), (64, 32))


def test_a_valid_request_reaches_the_driver(rng):
    """Without a driver that is one NoDeviceError; with one, a 128-byte map."""
    m = fake_matrix(int(rng.integers(1, 2**30)) * 256, 512, 1024)
    sub = DeviceBuffer._view(None, m.ptr + 4 * 8, (512 * 1024 - 8,), np.float32)  # from column 8 on
    for buf, kwargs in ((m, {}), (m, dict(swizzle="none", box=(7, 12))), (sub, dict(shape=(100, 40), ld=1024))):
        try:
            tm = tensor_map_2d(buf, kwargs.pop("box", (128, 32)), **kwargs)
        except NoDeviceError as exc:
            assert "no CUDA driver/GPU found" in str(exc)
        else:
            assert len(tm.raw) == 128 and tm.buffer is buf


def test_the_audit_counts_an_encode(monkeypatch):
    """The encoder is called through ctypes, not the binding: the audit still sees it."""
    import drvtrain.tma as tma
    from drvtrain.audit import CallCounts, count_driver_calls
    monkeypatch.setattr(tma, "get_device", lambda: None)
    monkeypatch.setattr(tma, "_driver_library", lambda: type("Lib", (), {
        "cuTensorMapEncodeTiled": staticmethod(lambda *args: 0)})())
    with count_driver_calls() as calls:
        tensor_map_2d(fake_matrix(1 << 20, 64, 64), (32, 32))
        tensor_map_2d(fake_matrix(1 << 21, 64, 64), (32, 32))
    counts = CallCounts(calls, 2)
    assert calls["cuTensorMapEncodeTiled"] == 2 and counts.category("tensor maps encoded") == 2
    tensor_map_2d(fake_matrix(1 << 20, 64, 64), (32, 32))
    assert calls["cuTensorMapEncodeTiled"] == 2  # counted inside the block only


def test_the_forwards_operand_maps_are_encoded_once_per_address_and_shape(monkeypatch, rng):
    import drvtrain.nn.mlp as mlp
    encoded = []

    def fake(span, box, *, shape, ld):
        encoded.append((span.ptr, shape, ld, box))
        return type("Map", (), {"raw": bytes(rng.integers(0, 256, 128, dtype=np.uint8))})()
    monkeypatch.setattr(mlp, "tensor_map_2d", fake)
    monkeypatch.setattr(mlp, "_operand_maps", {})
    x = fake_matrix(1 << 24, 512, 1024)
    first = mlp.operand_map(x, 1024, 512, 1024, "X")
    assert mlp.operand_map(x, 1024, 512, 1024, "X") is first and len(encoded) == 1
    assert mlp.operand_map(x.ptr, 1024, 512, 1024) is first  # a raw address of the same matrix
    assert mlp.operand_map(x, 1024, 256, 1024) is not first  # another shape, another map
    assert mlp.operand_map(x, 1024, 512, 1020) is not first and len(encoded) == 3
    assert encoded[0] == (x.ptr, (512, 1024), 1024, (128, 32))
    with pytest.raises(ValueError, match=r"^W: 512 rows of 1024 floats 1028 apart need"):
        mlp.operand_map(x, 1028, 512, 1024, "W")  # past the buffer's end
    monkeypatch.setattr(mlp, "_OPERAND_MAPS_KEPT", 3)  # full: the next new map starts the cache afresh
    mlp.operand_map(fake_matrix(1 << 25, 8, 8), 8, 8, 8)
    assert len(mlp._operand_maps) == 1
    assert mlp.operand_map(x, 1024, 512, 1024) is not first and len(encoded) == 5


def test_an_operand_no_map_can_describe_is_named(monkeypatch):
    import drvtrain.nn.mlp as mlp
    monkeypatch.setattr(mlp, "_operand_maps", {})
    with pytest.raises(ValueError, match=r"^X: the matrix must start on a 16-byte boundary"):
        mlp.operand_map((1 << 24) + 4, 64, 8, 64, "X")
