"""The fused narrow-MLP kernels on the GPU against float64 references: forward passes, every
gradient, determinism, graph replay, the gate, and the arena accounting."""

import numpy as np
import pytest

from drvtrain import Arena, DeviceBuffer, capture
from drvtrain.nn import MLP, FlatBuffer, ParamLayout
from drvtrain.nn.narrow import NarrowMLP
from child import run_python
from nn_reference import forward_scales, mlp_backward, mlp_forward, rel, scaled_rel

pytestmark = pytest.mark.gpu

SHAPES = [  # (batch, widths): the DQN nets, odd sizes, unaligned rows, 1 and 4 layers
    (256, [4, 256, 256, 3]),
    (128, [4, 128, 128, 3]),
    (10, [4, 128, 128, 3]),
    (1, [4, 128, 128, 3]),
    (77, [7, 33, 65, 19]),
    (64, [128, 256, 19]),
    (1000, [5, 64, 200, 256, 19]),
    (33, [9, 2]),
]
# Each (batch, widths, layers) of a fixed shape is an NVRTC build (seconds): a subset.
FIXED_SHAPES = [(256, [4, 256, 256, 3]), (1, [4, 128, 128, 3]), (77, [7, 33, 65, 19]), (1000, [5, 64, 200, 256, 19]),
                (33, [9, 2])]
# TF32 forwards: error against the size of the summands (check_forward), whose worst on
# 6,000 simulated batch-1 draws of 4-128-128-3 was 2.4e-4; FP32 and the gradients: relative.
TF32_BOUND, F32_BOUND, GRAD_BOUND = 1e-3, 1e-5, 1e-5
NAN_BITS = 0xFFFFFFFF  # what DeviceBuffer.poison writes


def random_params(layout, rng):
    return FlatBuffer(layout, layout.init_numpy(int(rng.integers(1 << 30))))  # biases are random too


def random_input(rng, batch, width):
    return rng.standard_normal((batch, width)).astype(np.float32)


def padding_of(layout):
    mask = np.ones(layout.size, bool)
    for s in layout.slots:
        mask[s.offset: s.offset + s.size] = False
    return mask


def poisoned_grads(layout):
    """Every view NaN, the padding between views 0: the kernels must fill the one and not touch the other."""
    flat = np.where(padding_of(layout), 0.0, np.nan).astype(np.float32)
    return FlatBuffer(layout, flat)


def poisoned_arena(net, batch, passes, stream):
    arena = Arena(net.scratch_bytes(batch, passes), zeroed_bytes=max(256, net.zeroed_bytes(batch)))
    poison_arena(arena, stream)
    return arena


def poison_arena(arena, stream):
    arena.reset()
    arena.alloc(arena.capacity).poison(stream=stream)  # unwritten outputs read as NaN
    arena.reset()


def check_forward(fwd, named, x, layers, bound, tf32, what=""):
    """Every layer's outputs against float64. In TF32 the error is measured against the size
    of the summands (forward_scales): a layer whose few outputs nearly cancel (batch 1, 3
    outputs) would otherwise fail a relative bound for a correct result, in about 1.6% of
    draws on 4-128-128-3."""
    ref = mlp_forward(named, x, layers)
    scales = forward_scales(named, ref)
    for k, (got, want) in enumerate(zip(fwd.activations[1:], ref[1:])):
        if tf32:
            err, kind = scaled_rel(got.to_numpy(), want, scales[k]), "error / summand size"
        else:
            err, kind = rel(got.to_numpy(), want), "rel"
        assert err < bound, f"{what}layer {k} output: {kind} {err:.3g} >= {bound}"


def check_grads(grads, named, fwd, dout):
    """Against float64 from the kernels' own activations: the backward's contract starts there."""
    acts = [a.to_numpy().astype(np.float64) for a in fwd.activations]
    want = mlp_backward(named, acts, dout)
    got = grads.to_numpy()
    for name, w in want.items():
        err = rel(got[name], w)
        assert err < GRAD_BOUND, f"{name}: rel {err:.3g} >= {GRAD_BOUND}"
    flat = grads.buffer.to_numpy()
    assert np.all(flat[padding_of(grads.layout)].view(np.uint32) == 0), "padding between views was written"


@pytest.mark.parametrize("tf32, bound", [(True, TF32_BOUND), (False, F32_BOUND)], ids=["tf32", "f32"])
@pytest.mark.parametrize("batch, widths", SHAPES)
def test_forward_matches_float64(device, stream, rng, batch, widths, tf32, bound):
    layout = ParamLayout.from_widths(widths)
    params = random_params(layout, rng)
    x = random_input(rng, batch, widths[0])
    net = NarrowMLP(layout, tf32=tf32)
    arena = poisoned_arena(net, batch, 1, stream)
    fwd = net.forward(params, DeviceBuffer.from_numpy(x), arena=arena, stream=stream)
    assert fwd.batch == batch and fwd.output.shape == (batch, widths[-1])
    check_forward(fwd, params.to_numpy(), x, len(layout.layers), bound, tf32)


@pytest.mark.parametrize("batch, widths", SHAPES)
def test_gradients_match_float64(device, stream, rng, batch, widths):
    layout = ParamLayout.from_widths(widths)
    params, grads = random_params(layout, rng), poisoned_grads(layout)
    x, dout = random_input(rng, batch, widths[0]), random_input(rng, batch, widths[-1])
    net = NarrowMLP(layout)
    arena = poisoned_arena(net, batch, 1, stream)
    fwd = net.forward(params, DeviceBuffer.from_numpy(x), arena=arena, stream=stream)
    net.backward(params, grads, fwd, DeviceBuffer.from_numpy(dout), arena=arena, stream=stream)
    check_grads(grads, params.to_numpy(), fwd, dout)


@pytest.mark.parametrize("tf32, bound", [(True, TF32_BOUND), (False, F32_BOUND)], ids=["tf32", "f32"])
@pytest.mark.parametrize("batch, widths", [(256, [4, 256, 256, 3]), (77, [7, 33, 65, 19])])
def test_three_passes_each_match_float64(device, stream, rng, batch, widths, tf32, bound):
    layout = ParamLayout.from_widths(widths)
    params = [random_params(layout, rng) for _ in range(3)]
    xs = [random_input(rng, batch, widths[0]) for _ in range(3)]
    net = NarrowMLP(layout, tf32=tf32)
    arena = poisoned_arena(net, batch, 3, stream)
    fwds = net.forward_many(params, [DeviceBuffer.from_numpy(x) for x in xs], arena=arena, stream=stream)
    assert len(fwds) == 3
    for i, (fwd, p, x) in enumerate(zip(fwds, params, xs)):
        check_forward(fwd, p.to_numpy(), x, len(layout.layers), bound, tf32, what=f"pass {i} ")


@pytest.mark.parametrize("cluster", [False, True], ids=["blocks", "clusters"])
@pytest.mark.parametrize("tf32, bound", [(True, TF32_BOUND), (False, F32_BOUND)], ids=["tf32", "f32"])
@pytest.mark.parametrize("batch, widths", SHAPES)
def test_first_layers_of_three_passes_match_float64(device, stream, rng, batch, widths, tf32, bound, cluster):
    """forward_many(layers=k) for every k, in blocks and in clusters: each pass's first k
    layers' outputs (ReLU after each but the net's last), against float64 of the whole net;
    nothing past layer k is computed or allocated."""
    layout = ParamLayout.from_widths(widths)
    net = NarrowMLP(layout, tf32=tf32)
    n = len(layout.layers)
    for stop in range(1, n + 1):
        params = [random_params(layout, rng) for _ in range(3)]
        xs = [random_input(rng, batch, widths[0]) for _ in range(3)]
        arena = poisoned_arena(net, batch, 3, stream)
        fwds = net.forward_many(params, [DeviceBuffer.from_numpy(x) for x in xs], arena=arena, stream=stream,
                                layers=stop, cluster=cluster)
        assert arena.offset == 3 * sum(4 * (-(-batch * w // 64) * 64) for w in widths[1: stop + 1])
        for i, (fwd, p, x) in enumerate(zip(fwds, params, xs)):
            assert len(fwd.activations) == stop + 1 and fwd.output.shape == (batch, widths[stop])
            check_forward(fwd, p.to_numpy(), x, n, bound, tf32, what=f"layers={stop} pass {i} ")


@pytest.mark.parametrize("cluster", [False, True], ids=["blocks", "clusters"])
@pytest.mark.parametrize("tf32, bound", [(True, TF32_BOUND), (False, F32_BOUND)], ids=["tf32", "f32"])
@pytest.mark.parametrize("batch, widths", FIXED_SHAPES)
def test_kernels_fixed_to_a_shape_give_the_general_kernels_bits(device, stream, rng, batch, widths, tf32, bound,
                                                               cluster):
    """fix_shape(batch, k) for every k: forward_many of that batch and k launches the kernels
    compiled for it, whose outputs match float64 and are bit for bit the general kernels';
    another batch or another k still runs (the general kernels) and matches float64."""
    layout = ParamLayout.from_widths(widths)
    general, fixed = NarrowMLP(layout, tf32=tf32), NarrowMLP(layout, tf32=tf32)
    n = len(layout.layers)
    other = batch + 3
    for stop in range(1, n + 1):
        fixed.fix_shape(batch, stop)
        assert (batch, stop) in fixed.fixed_shapes()
        name = "forward_cluster" if cluster else "forward"
        assert fixed._forward_kernel(name, batch, stop) is not general._forward_kernel(name, batch, stop)
        params = [random_params(layout, rng) for _ in range(3)]
        xs = [random_input(rng, batch, widths[0]) for _ in range(3)]
        outs = []
        for net in (general, fixed):
            arena = poisoned_arena(net, batch, 3, stream)
            fwds = net.forward_many(params, [DeviceBuffer.from_numpy(x) for x in xs], arena=arena, stream=stream,
                                    layers=stop, cluster=cluster)
            outs.append([[y.to_numpy() for y in f.activations[1:]] for f in fwds])
            for i, (fwd, p, x) in enumerate(zip(fwds, params, xs)):
                check_forward(fwd, p.to_numpy(), x, n, bound, tf32, what=f"layers={stop} pass {i} ")
        for i, (a, b) in enumerate(zip(*outs)):
            for k, (ya, yb) in enumerate(zip(a, b)):
                assert ya.tobytes() == yb.tobytes(), f"layers={stop} pass {i} layer {k}: fixed != general"
        # A shape it was not fixed to: the general kernels (a fixed one would trap).
        x = random_input(rng, other, widths[0])
        arena = poisoned_arena(fixed, other, 1, stream)
        fwd, = fixed.forward_many(params[:1], [DeviceBuffer.from_numpy(x)], arena=arena, stream=stream,
                                  layers=stop, cluster=cluster)
        check_forward(fwd, params[0].to_numpy(), x, n, bound, tf32, what=f"batch {other} layers={stop} ")
    assert fixed.fixed_shapes() == [(batch, stop) for stop in range(1, n + 1)]


@pytest.mark.provokes_driver_errors
def test_a_fixed_kernel_launched_with_another_shape_traps(device):
    """The device's own check of a fixed build: launched (past the host's routing) with a
    batch it was not built for, the kernel traps and the launch fails, rather than compute
    with the wrong shape. In a child process, since a trap ends the CUDA context."""
    code = """
        import numpy as np
        from drvtrain import Arena, DeviceBuffer, Stream
        from drvtrain.nn import FlatBuffer, ParamLayout
        from drvtrain.nn.narrow import NarrowMLP
        layout = ParamLayout.from_widths([4, 64, 3])
        net = NarrowMLP(layout)
        net.fix_shape(32, 2)
        net._fixed[(16, 2)] = net._fixed[(32, 2)]  # route batch 16 to the batch-32 build
        p = FlatBuffer(layout, layout.init_numpy(1))
        x = DeviceBuffer.from_numpy(np.ones((16, 4), np.float32))
        stream = Stream()
        net.forward_many([p], [x], arena=Arena(net.forward_bytes(16)), stream=stream)
        stream.synchronize()
        print("no trap")
    """
    done = run_python(code)
    assert done.returncode != 0 and "no trap" not in done.stdout, (done.stdout, done.stderr[-2000:])
    assert "CUDA_ERROR" in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize("tf32", [True, False], ids=["tf32", "f32"])
def test_three_pass_launch_is_bitwise_three_single_launches(device, stream, rng, tf32):
    widths, batch = [7, 33, 65, 19], 77
    layout = ParamLayout.from_widths(widths)
    params = [random_params(layout, rng) for _ in range(3)]
    xs = [DeviceBuffer.from_numpy(random_input(rng, batch, widths[0])) for _ in range(3)]
    net = NarrowMLP(layout, tf32=tf32)
    arena = poisoned_arena(net, batch, 6, stream)
    together = net.forward_many(params, xs, arena=arena, stream=stream)
    alone = [net.forward(p, x, arena=arena, stream=stream) for p, x in zip(params, xs)]
    for i, (a, b) in enumerate(zip(together, alone)):
        for k, (ya, yb) in enumerate(zip(a.activations[1:], b.activations[1:])):
            assert ya.to_numpy().tobytes() == yb.to_numpy().tobytes(), f"pass {i} layer {k}"


@pytest.mark.parametrize("cluster", [False, True], ids=["blocks", "clusters"])
def test_runs_are_bitwise_identical_eager_and_graph_replay(device, stream, rng, cluster):
    """A Double-DQN step's shape: online on s and s', target on s', backward of the first.
    Batch 256 splits the weight gradients over blocks, so the counters must reset too."""
    widths, batch = [4, 256, 256, 3], 256
    layout = ParamLayout.from_widths(widths)
    online, target = random_params(layout, rng), random_params(layout, rng)
    grads = poisoned_grads(layout)
    poison = grads.buffer.to_numpy()
    s, s2 = (DeviceBuffer.from_numpy(random_input(rng, batch, widths[0])) for _ in range(2))
    dout = random_input(rng, batch, widths[-1])
    d = DeviceBuffer.from_numpy(dout)
    net = NarrowMLP(layout)
    assert net.splits(batch) > 1
    arena = Arena(net.scratch_bytes(batch, 3), zeroed_bytes=net.zeroed_bytes(batch))

    def enqueue():
        arena.reset()
        fwds = net.forward_many([online, online, target], [s, s2, s2], arena=arena, stream=stream, cluster=cluster)
        net.backward(online, grads, fwds[0], d, arena=arena, stream=stream)
        return fwds

    def results(fwds):
        stream.synchronize()
        return [a.to_numpy().tobytes() for f in fwds for a in f.activations[1:]] + [grads.buffer.to_numpy().tobytes()]

    def fresh():
        poison_arena(arena, stream)
        grads.buffer.copy_from_numpy(poison)

    fresh()
    fwds = enqueue()
    first = results(fwds)
    check_grads(grads, online.to_numpy(), fwds[0], dout)
    fresh()
    assert results(enqueue()) == first, "two eager runs differ"
    with capture(stream) as graph:
        captured = enqueue()
    kernels = [k.function for k in graph.kernel_nodes()]
    forward = "narrow_forward_cluster" if cluster else "narrow_forward"
    assert kernels == [forward, "narrow_backward_data", "narrow_weight_grads"], kernels
    exe = graph.instantiate()
    for replay in range(3):
        fresh()
        exe.launch(stream)
        assert results(captured) == first, f"graph replay {replay} differs from the eager run"


@pytest.mark.parametrize("cluster", [False, True], ids=["blocks", "clusters"])
def test_gate_skips_every_write(device, stream, rng, cluster):
    widths, batch = [7, 33, 65, 19], 200  # split weight gradients: the counters must stay zero
    layout = ParamLayout.from_widths(widths)
    params = [random_params(layout, rng) for _ in range(3)]
    xs = [random_input(rng, batch, widths[0]) for _ in range(3)]
    dxs = [DeviceBuffer.from_numpy(x) for x in xs]
    dout = random_input(rng, batch, widths[-1])
    d = DeviceBuffer.from_numpy(dout)
    grads = poisoned_grads(layout)
    poison = grads.buffer.to_numpy()
    net = NarrowMLP(layout)
    assert net.splits(batch) > 1
    arena = poisoned_arena(net, batch, 3, stream)
    gate = DeviceBuffer.from_numpy(np.array([int(rng.integers(1, 1 << 30))], np.int32))
    for _ in range(2):
        arena.reset()
        fwds = net.forward_many(params, dxs, arena=arena, stream=stream, gate=gate, cluster=cluster)
        net.backward(params[0], grads, fwds[0], d, arena=arena, stream=stream, gate=gate)
    stream.synchronize()
    for i, fwd in enumerate(fwds):
        for k, y in enumerate(fwd.activations[1:]):
            assert np.all(y.to_numpy().view(np.uint32) == NAN_BITS), f"pass {i} layer {k} was written"
    assert grads.buffer.to_numpy().tobytes() == poison.tobytes(), "gradients were written"

    gate.copy_from_numpy(np.zeros(1, np.int32))
    arena.reset()
    fwds = net.forward_many(params, dxs, arena=arena, stream=stream, gate=gate, cluster=cluster)
    net.backward(params[0], grads, fwds[0], d, arena=arena, stream=stream, gate=gate)
    for i, (fwd, p, x) in enumerate(zip(fwds, params, xs)):
        check_forward(fwd, p.to_numpy(), x, len(layout.layers), TF32_BOUND, True, what=f"pass {i} ")
    check_grads(grads, params[0].to_numpy(), fwds[0], dout)


@pytest.mark.parametrize("batch, widths", [(256, [4, 256, 256, 3]), (77, [7, 33, 65, 19]), (10, [4, 128, 128, 3]),
                                           (1000, [5, 64, 200, 256, 19]), (33, [9, 2])])
def test_scratch_and_zeroed_bytes_are_exact(device, stream, rng, batch, widths):
    layout = ParamLayout.from_widths(widths)
    params = random_params(layout, rng)
    net = NarrowMLP(layout)
    arena = Arena(net.scratch_bytes(batch, 3), zeroed_bytes=max(256, net.zeroed_bytes(batch)))
    xs = [DeviceBuffer.from_numpy(random_input(rng, batch, widths[0])) for _ in range(3)]
    fwds = net.forward_many([params] * 3, xs, arena=arena, stream=stream)
    assert arena.offset == 3 * net.forward_bytes(batch)
    net.backward(params, FlatBuffer(layout), fwds[0], DeviceBuffer((batch, widths[-1])), arena=arena,
                 stream=stream)
    stream.synchronize()
    assert arena.offset == net.scratch_bytes(batch, 3)
    assert arena.zeroed_offset == net.zeroed_bytes(batch)
    assert arena.fallback_count == 0


def test_forwards_interchange_with_mlp(device, stream, rng):
    """NarrowMLP.backward takes an MLP forward's activations, and MLP.backward a narrow one's."""
    widths, batch = [7, 33, 65, 19], 77
    layout = ParamLayout.from_widths(widths)
    params = random_params(layout, rng)
    x, dout = random_input(rng, batch, widths[0]), random_input(rng, batch, widths[-1])
    dx, d = DeviceBuffer.from_numpy(x), DeviceBuffer.from_numpy(dout)
    mlp, net = MLP(layout, tf32=False), NarrowMLP(layout, tf32=False)
    arena = Arena(2 * (mlp.scratch_bytes(batch) + net.scratch_bytes(batch, 1)),
                  zeroed_bytes=mlp.zeroed_bytes(batch) + net.zeroed_bytes(batch) + 256)
    named = params.to_numpy()

    grads = poisoned_grads(layout)
    fwd = mlp.forward(params, dx, arena=arena, stream=stream)
    net.backward(params, grads, fwd, d, arena=arena, stream=stream)
    check_grads(grads, named, fwd, dout)

    grads = poisoned_grads(layout)
    fwd = net.forward(params, dx, arena=arena, stream=stream)
    mlp.backward(params, grads, fwd, d, arena=arena, stream=stream)
    check_grads(grads, named, fwd, dout)


def test_bad_inputs_fail_before_launch(device, stream, rng):
    layout = ParamLayout.from_widths([4, 16, 2])
    net, params = NarrowMLP(layout), random_params(layout, rng)
    arena = Arena(1 << 20)
    x = DeviceBuffer.from_numpy(random_input(rng, 8, 4))
    with pytest.raises(ValueError, match=r"x_list\[0\] has shape \(8, 5\), expected \(8, 4\)"):
        net.forward(params, DeviceBuffer((8, 5)), arena=arena, stream=stream)
    with pytest.raises(TypeError, match="float32"):
        net.forward(params, DeviceBuffer((8, 4), np.float64), arena=arena, stream=stream)
    with pytest.raises(TypeError, match="DeviceBuffer"):
        net.forward(params, np.zeros((8, 4), np.float32), arena=arena, stream=stream)
    with pytest.raises(ValueError, match="another layout"):
        net.forward(FlatBuffer(ParamLayout.from_widths([4, 16, 3])), x, arena=arena, stream=stream)
    with pytest.raises(ValueError, match="1 to 3 passes"):
        net.forward_many([params] * 4, [x] * 4, arena=arena, stream=stream)
    with pytest.raises(ValueError, match="2 parameter sets but 1 inputs"):
        net.forward_many([params] * 2, [x], arena=arena, stream=stream)
    with pytest.raises(ValueError, match=r"x_list\[1\] has shape \(9, 4\), expected \(8, 4\)"):
        net.forward_many([params] * 2, [x, DeviceBuffer((9, 4))], arena=arena, stream=stream)
    fwd = net.forward(params, x, arena=arena, stream=stream)
    with pytest.raises(ValueError, match=r"dout has shape \(8, 3\), expected \(8, 2\)"):
        net.backward(params, FlatBuffer(layout), fwd, DeviceBuffer((8, 3)), arena=arena, stream=stream)
    with pytest.raises(TypeError, match="Forward"):
        net.backward(params, FlatBuffer(layout), fwd.output, DeviceBuffer((8, 2)), arena=arena, stream=stream)
    with pytest.raises(ValueError, match="grads was made for another layout"):
        net.backward(params, FlatBuffer(ParamLayout.from_widths([4, 16, 3])), fwd, DeviceBuffer((8, 2)),
                     arena=arena, stream=stream)
