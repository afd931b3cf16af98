"""Checkpoint files: bitwise round trips, and every damaged or foreign file refused whole (runs everywhere)."""
import hashlib
import json
import math
import os
import struct

import numpy as np
import pytest

from drvtrain.checkpoint import FORMAT_VERSION, MAGIC, CheckpointError, load_checkpoint, save_checkpoint

PREFIX_BYTES = struct.calcsize("<8sIQQ")
DIGEST_BYTES = 32


def random_array(rng, dtype, shape):
    """Values that use every bit of the dtype (NaN payloads, negative zeros, denormals included)."""
    dtype = np.dtype(dtype)
    n = math.prod(shape)
    if dtype.kind == "b":
        return rng.random(shape) < 0.5
    if dtype.kind == "U":
        letters = np.array(list("abcxyzäßλ中"))
        words = ["".join(rng.choice(letters, rng.integers(0, dtype.itemsize // 4 + 1))) for _ in range(n)]
        return np.array(words, dtype).reshape(shape)
    raw = rng.integers(0, 256, size=n * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def random_shape(rng, max_dims=3, max_side=9):
    return tuple(int(d) for d in rng.integers(0, max_side, size=rng.integers(1, max_dims + 1)))


def random_arrays(rng):
    dtypes = ["<f4", "<f8", "<f2", ">f8", "<i1", "<u2", "<i4", "<i8", "<u8", "|b1", "<c8", "<U5"]
    arrays = {f"a{k}.{np.dtype(d).name}": random_array(rng, d, random_shape(rng)) for k, d in enumerate(dtypes)}
    arrays["scalar"] = random_array(rng, "<f8", ())
    arrays["scalar_int"] = random_array(rng, "<i8", ())
    arrays["empty"] = np.zeros((0, int(rng.integers(1, 5))), np.float32)
    return arrays


def random_meta(rng):
    return {"env_steps": int(rng.integers(2**62)), "wall_s": float(rng.random() * 1e4),
            "config": {"env": "cartpole", "seed": int(rng.integers(2**31)), "dqn": {"hidden": [128, 128],
                                                                                  "tau": None, "tf32": True}},
            "note": "λ-return ☃ " + "".join(rng.choice(list("abcdef"), 8)),
            "values": [float(v) for v in rng.standard_normal(int(rng.integers(0, 6)))]}


def assert_bitwise_equal(got: dict, want: dict):
    assert list(got) == list(want)
    for name, expected in want.items():
        expected = np.asarray(expected)
        assert got[name].dtype == expected.dtype, name
        assert got[name].shape == expected.shape, name
        assert got[name].tobytes() == np.ascontiguousarray(expected).tobytes(), name


def test_round_trip_is_bitwise_for_every_dtype_and_shape(tmp_path, rng):
    arrays = random_arrays(rng)
    big = int(rng.integers(3_000_000, 4_000_000))
    arrays["large"] = random_array(rng, "<f4", (big,))
    arrays["strided"] = random_array(rng, "<f8", (7, 11))[::2, ::3]  # not contiguous: stored in C order
    arrays["transposed"] = random_array(rng, "<i4", (5, 6)).T
    meta = random_meta(rng)
    path = tmp_path / "run" / "state.ckpt"  # the folder is created
    save_checkpoint(path, arrays, meta)
    got, got_meta = load_checkpoint(path)
    assert_bitwise_equal(got, arrays)
    assert got_meta == meta


def test_loaded_arrays_are_independent_and_writable(tmp_path, rng):
    arrays = {f"x{k}": random_array(rng, "<f8", (int(rng.integers(1, 50)),)) for k in range(5)}
    save_checkpoint(tmp_path / "c", arrays, {})
    got, _ = load_checkpoint(tmp_path / "c")
    for name in got:
        assert got[name].flags.writeable
        got[name][...] = -1.0
    for name in arrays:  # writing one never reached into another
        assert np.all(got[name] == -1.0)
    got2, _ = load_checkpoint(tmp_path / "c")
    assert_bitwise_equal(got2, arrays)


def test_meta_round_trips_with_nan_and_nested_values(tmp_path, rng):
    meta = random_meta(rng)
    meta["loss"] = float("nan")
    meta["best"] = float("-inf")
    meta["nested"] = {"list": [random_meta(rng), None, True, "x"]}
    save_checkpoint(tmp_path / "c", {}, meta)
    arrays, got = load_checkpoint(tmp_path / "c")
    assert arrays == {}
    assert math.isnan(got.pop("loss")) and math.isnan(meta.pop("loss"))
    assert got == meta


def saved_file(tmp_path, rng):
    path = tmp_path / "state.ckpt"
    save_checkpoint(path, random_arrays(rng), random_meta(rng))
    return path, path.read_bytes()


def assert_refused(path, *needles):
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert message.startswith(f"checkpoint {path}: ") and "\n" not in message, message
    for needle in needles:
        assert needle in message, message
    return message


def test_truncation_at_any_offset_is_refused(tmp_path, rng):
    path, data = saved_file(tmp_path, rng)
    edges = [0, 1, len(MAGIC) - 1, len(MAGIC), PREFIX_BYTES - 1, PREFIX_BYTES, PREFIX_BYTES + DIGEST_BYTES,
             len(data) - DIGEST_BYTES, len(data) - 1]
    for cut in edges + [int(c) for c in rng.integers(0, len(data), 40)]:
        path.write_bytes(data[:cut])
        assert_refused(path, "truncated")


def test_trailing_bytes_are_refused(tmp_path, rng):
    path, data = saved_file(tmp_path, rng)
    path.write_bytes(data + bytes(rng.integers(0, 256, int(rng.integers(1, 100)), dtype=np.uint8)))
    assert_refused(path, "trailing bytes")


def test_a_flipped_byte_anywhere_is_refused(tmp_path, rng):
    path, data = saved_file(tmp_path, rng)
    positions = list(range(PREFIX_BYTES)) + [len(data) - 1] + [int(p) for p in rng.integers(0, len(data), 60)]
    for pos in positions:
        damaged = bytearray(data)
        damaged[pos] ^= int(rng.integers(1, 256))
        path.write_bytes(bytes(damaged))
        message = assert_refused(path)
        if pos >= PREFIX_BYTES:  # past the lengths, only the checksum can notice
            assert "checksum mismatch" in message, (pos, message)
    path.write_bytes(data)
    load_checkpoint(path)  # the undamaged bytes still load


def test_foreign_files_are_refused_as_not_checkpoints(tmp_path, rng):
    path = tmp_path / "other"
    np.save(path.with_suffix(".npy"), random_array(rng, "<f4", (16,)))
    os.replace(path.with_suffix(".npy"), path)
    assert_refused(path, "not a drvtrain checkpoint")
    noise = bytes(rng.integers(0, 256, int(rng.integers(len(MAGIC), 4096)), dtype=np.uint8))
    path.write_bytes(b"X" + noise[1:])
    assert_refused(path, "not a drvtrain checkpoint")


def test_another_format_version_is_refused(tmp_path, rng):
    path, data = saved_file(tmp_path, rng)
    version = FORMAT_VERSION + int(rng.integers(1, 1000))
    path.write_bytes(data[:len(MAGIC)] + struct.pack("<I", version) + data[len(MAGIC) + 4:])
    assert_refused(path, f"format version {version}")


def handmade(path, header: dict, payload: bytes):
    """A file with a correct frame and checksum around ``header``: what a buggy writer could produce."""
    text = json.dumps(header).encode()
    body = struct.pack("<8sIQQ", MAGIC, FORMAT_VERSION, len(text), len(payload)) + text + payload
    path.write_bytes(body + hashlib.sha256(body).digest())


def test_a_checksummed_file_with_a_bad_header_is_refused(tmp_path, rng):
    path = tmp_path / "c"
    n = int(rng.integers(1, 64))
    payload = bytes(rng.integers(0, 256, 8 * n, dtype=np.uint8))
    entry = {"name": "x", "dtype": "<f8", "shape": [n], "offset": 0, "nbytes": 8 * n}
    handmade(path, {"meta": {}, "arrays": [entry]}, payload)
    assert load_checkpoint(path)[0]["x"].tobytes() == payload  # the frame itself is right
    bad_headers = [
        {"meta": {}, "arrays": [{**entry, "offset": 8}]},               # runs past the payload
        {"meta": {}, "arrays": [{**entry, "nbytes": 8 * n - 1}]},       # does not fill its shape
        {"meta": {}, "arrays": [{**entry, "shape": [-n]}]},
        {"meta": {}, "arrays": [{**entry, "dtype": "|O"}]},             # object arrays hold pointers
        {"meta": {}, "arrays": [{**entry, "dtype": "not-a-dtype"}]},
        {"meta": {}, "arrays": [entry, entry]},                         # one name twice
        {"meta": [], "arrays": []},
        {"arrays": []},
    ]
    for header in bad_headers:
        handmade(path, header, payload)
        assert_refused(path, "header does not describe a checkpoint")


def test_a_missing_file_or_a_folder_is_refused(tmp_path):
    assert_refused(tmp_path / "nowhere.ckpt", "no such file")
    assert_refused(tmp_path, "directory")


@pytest.mark.parametrize("failing_call", ["replace", "fsync"])
def test_an_interrupted_write_keeps_the_old_checkpoint_and_leaves_no_temp_file(tmp_path, rng, monkeypatch,
                                                                               failing_call):
    path = tmp_path / "state.ckpt"
    old_arrays, old_meta = random_arrays(rng), random_meta(rng)
    save_checkpoint(path, old_arrays, old_meta)

    def interrupted(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, failing_call, interrupted)
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint(path, random_arrays(rng), random_meta(rng))
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.ckpt"]
    arrays, meta = load_checkpoint(path)
    assert_bitwise_equal(arrays, old_arrays)
    assert meta == old_meta


def test_save_refuses_what_it_cannot_store_before_touching_the_file(tmp_path, rng):
    path = tmp_path / "state.ckpt"
    arrays = random_arrays(rng)
    save_checkpoint(path, arrays, {"k": 1})
    before = path.read_bytes()
    with pytest.raises(ValueError, match="cannot be checkpointed"):
        save_checkpoint(path, {"objects": np.array([object(), None])}, {})
    with pytest.raises(ValueError, match="cannot be checkpointed"):
        save_checkpoint(path, {"records": np.zeros(3, [("a", "<f4"), ("b", "<i4")])}, {})
    with pytest.raises(ValueError, match="not JSON-serialisable"):
        save_checkpoint(path, arrays, {"bad": object()})
    with pytest.raises(ValueError, match="non-empty strings"):
        save_checkpoint(path, {"": np.zeros(1)}, {})
    with pytest.raises(TypeError, match="meta must be a dict"):
        save_checkpoint(path, arrays, [1, 2])
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.ckpt"]
