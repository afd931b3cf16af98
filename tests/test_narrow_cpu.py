"""NarrowMLP without a GPU: which layouts it takes, its arena accounting, and its kernels'
CUBIN (NVRTC needs no GPU)."""
import struct

import numpy as np
import pytest

from drvtrain.compiler import compile_file
from drvtrain.nn import ParamLayout
from drvtrain.nn.narrow import NarrowMLP

KERNELS = ["narrow_forward", "narrow_forward_f32", "narrow_forward_cluster", "narrow_forward_cluster_f32",
           "narrow_backward_data", "narrow_weight_grads"]


@pytest.mark.parametrize("widths", [[4, 256, 256, 3], [4, 128, 128, 3], [128, 256, 19], [7, 33, 65, 19],
                                    [256, 256, 256, 256, 256], [1, 1], [256, 1]])
def test_supports_every_layout_of_at_most_4_layers_and_width_256(widths):
    layout = ParamLayout.from_widths(widths)
    assert NarrowMLP.supports(layout)
    assert NarrowMLP(layout).widths == widths  # builds without a GPU: kernels load at the first launch


@pytest.mark.parametrize("widths, message", [
    ([4, 64, 64, 64, 64, 3], "5 weight layers, at most 4"),
    ([257, 64, 3], "exceed 256"),
    ([4, 257, 3], "exceed 256"),
    ([4, 64, 1000], "exceed 256"),
])
def test_refuses_deeper_or_wider_layouts_with_the_reason(widths, message):
    layout = ParamLayout.from_widths(widths)
    assert not NarrowMLP.supports(layout)
    with pytest.raises(ValueError, match=message):
        NarrowMLP(layout)


def test_refuses_what_is_not_a_layout():
    assert not NarrowMLP.supports([(3, 4)])
    with pytest.raises(ValueError, match="expected a ParamLayout"):
        NarrowMLP([(3, 4)])


@pytest.mark.parametrize("batch, splits", [(1, 1), (10, 1), (64, 1), (65, 2), (77, 2), (128, 2), (129, 3),
                                           (192, 3), (193, 4), (256, 4), (1000, 4), (100000, 4)])
def test_weight_gradient_splits(batch, splits):
    assert NarrowMLP.splits(batch) == splits


def test_every_split_gets_whole_chunks_and_none_is_empty():
    for batch in range(1, 20000):
        s = NarrowMLP.splits(batch)
        chunks = -(-batch // 32)
        per = -(-chunks // s)  # as kernels/narrow.cu divides them
        assert 1 <= s <= 4 and (s - 1) * per < chunks <= s * per, batch


def test_scratch_bytes_of_the_dqn_net():
    net = NarrowMLP(ParamLayout.from_widths([4, 256, 256, 3]))
    # batch 256: layer outputs 256*256, 256*256, 256*3 floats (768, a multiple of 64)
    forward = 4 * (65536 + 65536 + 768)
    assert net.forward_bytes(256) == forward
    # dY_0, dY_1 like the outputs; dW tiles 4x1 + 4x4 + 1x4 = 24, split 4 ways, 4160 floats each
    backward = 4 * (65536 + 65536) + 4 * 24 * 4 * 4160
    assert net.backward_bytes(256) == backward
    assert net.scratch_bytes(256) == 3 * forward + backward
    assert net.scratch_bytes(256, passes=1) == forward + backward
    assert net.zeroed_bytes(256) == 256  # 24 counters, rounded to 64
    # batch 10: outputs rounded to 64 floats each, no split, so no workspace or counters
    assert net.forward_bytes(10) == 4 * (2560 + 2560 + 64)
    assert net.backward_bytes(10) == 4 * (2560 + 2560)
    assert net.zeroed_bytes(10) == 0


def test_scratch_bytes_of_one_layer_and_odd_widths():
    one = NarrowMLP(ParamLayout.from_widths([9, 2]))
    assert one.forward_bytes(33) == 4 * 128  # 66 floats, rounded to 64
    assert one.backward_bytes(33) == 0  # dY_0 is dout, the batch is not split
    odd = NarrowMLP(ParamLayout.from_widths([7, 33, 65, 19]))
    assert odd.tiles == 1 + 2 + 2
    assert odd.forward_bytes(77) == 4 * (2560 + 5056 + 1472)  # 2541, 5005, 1463 rounded to 64
    assert odd.backward_bytes(77) == 4 * (2560 + 5056) + 4 * 5 * 2 * 4160
    assert odd.zeroed_bytes(77) == 256


def test_every_arena_block_is_a_multiple_of_256_bytes():
    net = NarrowMLP(ParamLayout.from_widths([5, 64, 200, 256, 19]))
    for batch in (1, 3, 77, 1000):
        assert net.forward_bytes(batch) % 256 == 0 and net.backward_bytes(batch) % 256 == 0


def cubin_arch(cubin: bytes) -> int:
    """The SM version in a CUDA ELF's e_flags (90 for sm_90)."""
    assert cubin[:4] == b"\x7fELF", "not an ELF image: NVRTC returned something other than CUBIN"
    (flags,) = struct.unpack_from("<I", cubin, 48)
    return (flags >> 8) & 0xFF


def elf_sections(cubin: bytes) -> dict[str, int]:
    """Section name -> size, from a 64-bit ELF's section headers."""
    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    entsize, count, names = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * entsize) for i in range(count)]
    base = headers[names][4]
    out = {}
    for h in headers:
        start = base + h[0]
        out[cubin[start: cubin.index(b"\0", start)].decode()] = h[5]
    return out


def test_narrow_kernels_compile_to_cubin_within_48k_static_shared_memory(cache_dir):
    prog = compile_file("narrow.cu", arch="sm_90")
    assert cubin_arch(prog.cubin) == 90
    sections = elf_sections(prog.cubin)
    for name in KERNELS:
        assert f".text.{name}" in sections, f"{name} missing from the CUBIN"
        assert sections.get(f".nv.shared.{name}", 0) <= 48 * 1024, f"{name} needs more than 48 KiB"


def _cluster_floats(widths, stop, ranks):
    """The cluster forward's shared memory from its description in kernels/narrow.cu,
    written out independently of narrow.py: 32 input rows of the even and of the odd
    layers (stride: k rounded up to 32, plus 8), 8 warps x 2 partial m16n8 tiles, then
    per layer the block's ceil(ceil(n / 8) / C) n8 tiles of weight rows and their biases
    (rounded up to 4 floats)."""
    def stride(k):
        return (k + 31) // 32 * 32 + 8
    even = max(stride(widths[k]) for k in range(0, stop, 2))
    odd = max([stride(widths[k]) for k in range(1, stop, 2)] or [0])
    floats = 32 * (even + odd) + 8 * 256
    for k in range(stop):
        rows = 8 * -(-(-(-widths[k + 1] // 8)) // ranks)
        floats += rows * stride(widths[k]) + (rows + 3) // 4 * 4
    return floats


@pytest.mark.parametrize("widths", [[4, 256, 256, 3], [7, 33, 65, 19], [256, 256, 256, 256, 256], [9, 2],
                                    [1, 1], [128, 256, 19], [5, 64, 200, 256, 19]])
def test_cluster_forward_plan_fits_every_narrow_layout(widths):
    """Every layer's tiles fit a block's 8 warps (at most 2 n8 tiles each), the cluster is
    at most the portable 8 blocks, and the shared memory is what the kernel lays out and
    fits the 227 KiB a block of an sm_90 device may take."""
    net = NarrowMLP(ParamLayout.from_widths(widths))
    for stop in range(1, len(widths)):
        ranks = net.cluster_ranks(stop)
        assert 1 <= ranks <= 8
        widest = max(-(-n // 8) for n in widths[1: stop + 1])
        assert -(-widest // ranks) <= 16
        assert ranks == min(8, -(-widest // 4))
        got = net.cluster_shared_bytes(stop)
        assert got == 4 * _cluster_floats(widths, stop, ranks)
        assert got <= 227 * 1024
    assert net.cluster_ranks() == net.cluster_ranks(len(widths) - 1)


@pytest.mark.parametrize("layers", [0, 4, -1, 1.0, True, "2"])
def test_cluster_forward_refuses_a_layer_count_out_of_range(layers):
    net = NarrowMLP(ParamLayout.from_widths([4, 256, 256, 3]))
    with pytest.raises(ValueError, match=r"layers must be an int in \[1, 3\]"):
        net.cluster_ranks(layers)


def test_backward_refuses_a_forward_that_kept_no_hidden_output():
    """A Forward of ``MLP.forward(..., store_hidden=False)`` has a None slot; the narrow
    backward says so before it looks at anything else (here nothing else is real)."""
    from drvtrain.nn.mlp import Forward
    net = NarrowMLP(ParamLayout.from_widths([4, 256, 256, 3]))
    kept_none = Forward((object(), object(), None, object()))
    with pytest.raises(ValueError, match=r"kept no hidden output \(MLP.forward\(\.\.\., store_hidden=False\)\)"):
        net.backward(None, None, kept_none, None, arena=None, stream=None)
    with pytest.raises(TypeError, match="the Forward of a forward pass of this layout"):
        net.backward(None, None, Forward((object(), None, object())), None, arena=None, stream=None)


def _define(options, name):
    (value,) = [o.split("=", 1)[1] for o in options if o.startswith(f"-D{name}=")]
    return value


@pytest.mark.parametrize("widths, batch, stop", [([4, 256, 256, 3], 256, 2), ([7, 33, 65, 19], 77, 3),
                                                 ([9, 2], 1, 1), ([5, 64, 200, 256, 19], 1000, 4)])
def test_fixed_shape_options_spell_the_launch_arguments(widths, batch, stop):
    """fix_shape's -D constants are the forwards' 15 shape arguments in kernels/narrow.cu's
    order (batch, layers, w[0..4], w_off[0..3], b_off[0..3], zero past the net), written
    out here from the layout, plus stop and the cluster size."""
    layout = ParamLayout.from_widths(widths)
    net = NarrowMLP(layout)
    n = len(widths) - 1
    pad = [0] * (4 - n)
    want = [batch, n, *widths, *[0] * (5 - len(widths)), *[layout.weight(k).offset for k in range(n)], *pad,
            *[layout.bias(k).offset for k in range(n)], *pad]
    options = net.fixed_options(batch, stop)
    assert [int(v) for v in _define(options, "DT_NARROW_FIXED").split(",")] == want
    assert int(_define(options, "DT_NARROW_STOP")) == stop
    assert int(_define(options, "DT_NARROW_RANKS")) == net.cluster_ranks(stop)
    assert net.fixed_options(batch) == net.fixed_options(batch, n)


def test_fixed_shape_takes_a_numpy_batch_as_the_int_it_is():
    """A DQNConfig may carry its batch as a numpy integer; the fixed build and its key
    are the same as for the plain int."""
    net = NarrowMLP(ParamLayout.from_widths([4, 256, 256, 3]))
    assert net.fixed_options(np.int64(256), np.int32(2)) == net.fixed_options(256, 2)
    assert net._fixed_key(np.int64(256), 2) == (256, 2) and type(net._fixed_key(np.int64(256), 2)[0]) is int


@pytest.mark.parametrize("batch", [0, -3, 2.0, True, np.bool_(True), np.int64(0), "256", None])
def test_fixed_shape_refuses_a_batch_that_is_not_a_positive_int(batch):
    net = NarrowMLP(ParamLayout.from_widths([4, 256, 256, 3]))
    with pytest.raises(ValueError, match="batch must be a positive int"):
        net.fixed_options(batch, 2)
    with pytest.raises(ValueError, match="batch must be a positive int"):
        net.fix_shape(batch, 2)
    assert net.fixed_shapes() == []


def test_fixed_shape_refuses_a_layer_count_out_of_range():
    net = NarrowMLP(ParamLayout.from_widths([4, 256, 256, 3]))
    with pytest.raises(ValueError, match=r"layers must be an int in \[1, 3\]"):
        net.fixed_options(256, 4)


def test_fixed_shape_build_holds_the_four_forwards_for_sm_90(cache_dir):
    """The build for one shape compiles to an sm_90 CUBIN with the forwards (per block and
    in clusters, TF32 and FP32) and nothing else."""
    net = NarrowMLP(ParamLayout.from_widths([7, 33, 65, 19]))
    fixed = compile_file("narrow.cu", arch="sm_90", options=("-std=c++17",) + net.fixed_options(77, 2))
    assert cubin_arch(fixed.cubin) == 90
    sections = elf_sections(fixed.cubin)
    forwards = [k for k in KERNELS if k.startswith("narrow_forward")]
    assert sorted(k for k in KERNELS if f".text.{k}" in sections) == sorted(forwards)


def test_fix_shape_refuses_to_build_during_a_capture():
    """Loading a module has no place in a stream capture: fix_shape says so before it
    compiles or touches the device."""
    from drvtrain.driver import active_captures
    net = NarrowMLP(ParamLayout.from_widths([4, 256, 256, 3]))
    captures = active_captures()
    captures.append(object())
    try:
        with pytest.raises(RuntimeError, match="before the capture"):
            net.fix_shape(256, 2)
    finally:
        captures.pop()
    assert net.fixed_shapes() == []
