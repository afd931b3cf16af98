"""The engine on the GPU against float64 references: forward, backward, clip, AdamW, metrics, parity."""
import itertools
from fractions import Fraction

import numpy as np
import pytest

from drvtrain import Arena, DeviceBuffer, Stream, dependent_launches
from drvtrain.nn import MLP, AdamW, FlatBuffer, Metrics, ParamLayout, RegressionStep
from late_writer import LATE_NS, late_copy, words
from nn_reference import adamw, clip_scale, f32_round, mlp_backward, mlp_forward, mse, rel

pytestmark = pytest.mark.gpu

SHAPES = [  # (batch, [in, hidden..., out]): tile multiples and not
    (64, [4, 256, 256, 3]),
    (200, [6, 40, 24, 3]),
    (7, [129, 1000, 4]),
    (129, [7, 4, 129]),
    (1000, [33, 65, 7]),
    (100, [4, 48, 3]),  # two layers: the output layer is the one folded into (forward_x0)
]


def make_layout(widths):
    return ParamLayout([(o, i) for i, o in zip(widths, widths[1:])])


def random_params(layout, rng):
    return FlatBuffer(layout, layout.init_numpy(int(rng.integers(1 << 30))))


@pytest.mark.parametrize("fold", [True, False], ids=["fold", "no-fold"])
@pytest.mark.parametrize("tf32, bound", [(False, 1e-5), (True, 3e-3)])
@pytest.mark.parametrize("batch, widths", SHAPES)
def test_forward_matches_float64(device, stream, rng, batch, widths, tf32, bound, fold):
    layout = make_layout(widths)
    params = random_params(layout, rng)
    x = DeviceBuffer.from_numpy(rng.standard_normal((batch, widths[0])).astype(np.float32))
    mlp = MLP(layout, tf32=tf32, fold_first_layer=fold)
    arena = Arena(mlp.scratch_bytes(batch))
    arena.alloc(arena.capacity - 256).poison(stream=stream)  # unwritten activations would be NaN
    arena.reset()
    fwd = mlp.forward(params, x, arena=arena, stream=stream)
    out = fwd.output.to_numpy()
    ref = mlp_forward(params.to_numpy(), x.to_numpy(), len(layout.layers))
    for got, want in zip(fwd.activations[1:], ref[1:]):
        assert rel(got.to_numpy(), want) < bound
    assert rel(out, ref[-1]) < bound
    if mlp.first_layer_folded(batch):  # the first layer computed in FP32 inside the second's product
        assert fold and tf32 and widths[0] <= 8 and rel(fwd.activations[1].to_numpy(), ref[1]) < 1e-6
    elif fold and tf32 and widths[0] <= 8 and tuple(device.compute_capability) >= (9, 0):
        pytest.fail(f"{widths} at batch {batch} did not fold its first layer")


@pytest.mark.parametrize("share", [False, True], ids=["whole-device", "third-of-the-sms"])
@pytest.mark.parametrize("wgmma", [True, False], ids=["wgmma", "mma.sync"])
def test_wide_forward_on_wgmma_and_on_the_forced_fallback_match_float64(device, stream, rng, wgmma, share):
    """The large net's 1024-wide layer runs on gemm_sm90a.cu's wgmma tile on
    compute capability 9.0; MLP(wgmma=False) forces gemm.cu's mma.sync kernels.
    Both agree with float64 to TF32 accuracy, also planned for a third of the SMs
    (forward's ``sms``: other tiles and splits, the output layer's included)."""
    from drvtrain.nn.mlp import WGMMA_TILE, wgmma_available
    if wgmma and not wgmma_available(device):
        pytest.skip(f"wgmma needs compute capability 9.0; this device is {device.arch}")
    batch, widths = 512, [128, 1024, 1024, 19]
    layout = make_layout(widths)
    params = random_params(layout, rng)
    x = DeviceBuffer.from_numpy(rng.standard_normal((batch, widths[0])).astype(np.float32))
    mlp = MLP(layout, wgmma=wgmma)
    sms = device.sm_count // 3 if share else None
    fk = mlp.forward_kernels
    assert (fk.plan("forward_relu", batch, 1024, 1024, sms=sms).tile is WGMMA_TILE) == wgmma
    if share and wgmma:  # every layer on the wgmma tile, the two wide ones unsplit
        plans = [fk.plan("forward_relu", batch, 1024, k, sms=sms) for k in (128, 1024)]
        assert [(p.tile, p.splits) for p in plans] == [(WGMMA_TILE, 1)] * 2
        assert fk.plan("forward", batch, 19, 1024, sms=sms).tile is WGMMA_TILE
    arena = Arena(mlp.scratch_bytes(batch, sms=sms), zeroed_bytes=mlp.zeroed_bytes(batch, sms=sms) + 256)
    arena.alloc(arena.capacity - 256).poison(stream=stream)
    arena.reset()
    fwd = mlp.forward(params, x, arena=arena, stream=stream, sms=sms)
    assert arena.fallback_count == 0  # the accounting held every slice of the share's plans
    ref = mlp_forward(params.to_numpy(), x.to_numpy(), len(layout.layers))
    for got, want in zip(fwd.activations[1:], ref[1:]):
        got = got.to_numpy()
        assert not np.isnan(got).any()
        assert rel(got, want) < 3e-3


@pytest.mark.parametrize("batch, widths, share", [(512, [128, 1024, 1024, 19], 3), (450, [64, 1000, 1000, 24], 3),
                                                  (450, [64, 900, 900, 1], 3), (300, [64, 700, 700, 5], 6),
                                                  (300, [64, 700, 701, 5], 6)])
def test_output_layer_in_the_epilogue_matches_float64_and_the_unfolded_forward(device, stream, rng, batch, widths,
                                                                                share):
    """The last hidden layer planned unsplit on the wgmma tile (for a third of the SMs,
    as each of the DQN step's forwards, or a sixth) computes the output layer in its
    epilogue (``linear_forward_relu_head_wgmma_tf32``; rows and columns off the tiles'
    edges in three shapes, 24, 5 and 1 outputs, 8 column tiles and 6, whose cluster
    splits the 128 rows unevenly; an odd width, whose rows of H the kernel stores 4 bytes
    at a time): every activation within TF32 accuracy of float64
    (poisoned first), H bit for bit the unfolded forward's, and Q too where the
    unfolded output layer sums the same 128-deep shares (8 clustered splits on the
    wgmma tile: the large net; measured, not promised by the kernel); the same bits
    over graph replays with Q poisoned between them, the shares summed through the
    workspace (the counters left zeroed for the next replay) and in a cluster of the
    row tile's column tiles alike; launched with no H, the same Q and H left poisoned, and
    ``forward(store_hidden=False)`` the same Q with no last hidden output; nothing
    written while the gate is set, with or without the hidden output."""
    from drvtrain import capture
    from drvtrain.nn.mlp import WGMMA_TILE, wgmma_available
    if not wgmma_available(device):
        pytest.skip(f"wgmma needs compute capability 9.0; this device is {device.arch}")
    layout = make_layout(widths)
    params = random_params(layout, rng)
    x = DeviceBuffer.from_numpy(rng.standard_normal((batch, widths[0])).astype(np.float32))
    sms = device.sm_count // share
    ref = mlp_forward(params.to_numpy(), x.to_numpy(), len(layout.layers))
    outs = {}
    for fold in (True, False):
        mlp = MLP(layout, fold_head=fold)
        assert mlp.head_folded(batch, sms=sms) == fold
        arena = Arena(mlp.scratch_bytes(batch, sms=sms), zeroed_bytes=mlp.zeroed_bytes(batch, sms=sms) + 256)
        arena.alloc(arena.capacity - 256).poison(stream=stream)
        arena.reset()
        fwd = mlp.forward(params, x, arena=arena, stream=stream, sms=sms)
        assert arena.fallback_count == 0
        outs[fold] = [a.to_numpy() for a in fwd.activations[1:]]
        for got, want in zip(outs[fold], ref[1:]):
            assert rel(got, want) < 3e-3
    hidden, n_out = widths[-2], widths[-1]
    for got, want in zip(outs[True][:-1], outs[False][:-1]):
        assert np.array_equal(got, want)
    p = MLP(layout, fold_head=False).forward_kernels.plan("forward", batch, n_out, hidden, sms=sms)
    k_tiles = -(-hidden // 32)
    same_shares = p.tile is WGMMA_TILE and p.splits == -(-hidden // 128) and -(-k_tiles // p.splits) == 4
    assert same_shares or hidden != 1024  # the large net's output layer sums the same shares
    if same_shares:  # 128 deep each, added in the same order
        assert np.array_equal(outs[True][-1], outs[False][-1])
    # The shares through the workspace and in a cluster of the row tile's column tiles
    # (every row tile's cluster fits at once on the H200): the same sums in the same
    # order, so the forward's bits either way, over graph replays with H and Q poisoned
    # before each.
    mlp = MLP(layout)
    fk, last = mlp.forward_kernels, len(layout.layers) - 1
    h_in = DeviceBuffer.from_numpy(outs[True][-3])
    for cluster in (False, True):
        assert fk.plan_head(batch, hidden, widths[-3], n_out, sms=sms, cluster=cluster).cluster == cluster
        arena = Arena(4 * batch * (hidden + n_out) + (1 << 20), zeroed_bytes=4096)
        h, q = arena.array((batch, hidden), np.float32), arena.array((batch, n_out), np.float32)
        with capture(stream) as g:
            fk.launch_head(h_in, widths[-3], params.weight(last - 1), widths[-3], h, hidden, batch, hidden,
                           widths[-3], bias=params.bias(last - 1), w2=params.weight(last), ldw2=hidden,
                           b2=params.bias(last), q=q, ldq=n_out, n_out=n_out, arena=arena, stream=stream, sms=sms,
                           cluster=cluster)
        exe = g.instantiate()
        with capture(stream) as g:  # no H: Q alone (the loss-only forwards of the DQN step)
            fk.launch_head(h_in, widths[-3], params.weight(last - 1), widths[-3], None, hidden, batch, hidden,
                           widths[-3], bias=params.bias(last - 1), w2=params.weight(last), ldw2=hidden,
                           b2=params.bias(last), q=q, ldq=n_out, n_out=n_out, arena=arena, stream=stream, sms=sms,
                           cluster=cluster)
        exe_q = g.instantiate()
        for _ in range(3):
            h.poison(stream=stream)
            q.poison(stream=stream)
            exe.launch(stream)
            stream.synchronize()
            assert np.array_equal(h.to_numpy(), outs[True][-2]) and np.array_equal(q.to_numpy(), outs[True][-1])
            h.poison(stream=stream)
            q.poison(stream=stream)
            exe_q.launch(stream)
            stream.synchronize()
            assert np.isnan(h.to_numpy()).all() and np.array_equal(q.to_numpy(), outs[True][-1])
        exe.close()
        exe_q.close()
    arena = Arena(mlp.scratch_bytes(batch, sms=sms), zeroed_bytes=mlp.zeroed_bytes(batch, sms=sms) + 256)
    arena.alloc(arena.capacity - 256).poison(stream=stream)
    arena.reset()
    fwd = mlp.forward(params, x, arena=arena, stream=stream, sms=sms, store_hidden=False)
    assert fwd.activations[-2] is None and np.array_equal(fwd.output.to_numpy(), outs[True][-1])
    for got, want in zip(fwd.activations[1:-2], outs[True][:-2]):
        assert np.array_equal(got.to_numpy(), want)
    gate = DeviceBuffer.from_numpy(np.array([1], np.int32))
    arena = Arena(mlp.scratch_bytes(batch, sms=sms), zeroed_bytes=mlp.zeroed_bytes(batch, sms=sms) + 256)
    arena.alloc(arena.capacity - 256).poison(stream=stream)
    arena.reset()
    fwd = mlp.forward(params, x, arena=arena, stream=stream, sms=sms, gate=gate)
    assert all(np.isnan(a.to_numpy()).all() for a in fwd.activations[1:])
    arena.reset()
    arena.alloc(arena.capacity - 256).poison(stream=stream)
    arena.reset()
    fwd = mlp.forward(params, x, arena=arena, stream=stream, sms=sms, gate=gate, store_hidden=False)
    assert fwd.activations[-2] is None
    assert all(np.isnan(a.to_numpy()).all() for a in fwd.activations[1:] if a is not None)


@pytest.mark.parametrize("batch, widths, share, ldh", [(300, [64, 700, 701, 5], 6, 702),
                                                       (300, [64, 700, 701, 5], 6, 704),
                                                       (300, [64, 700, 703, 5], 6, 704),
                                                       (450, [64, 1000, 1000, 24], 3, 1004),
                                                       (450, [64, 1000, 1000, 24], 3, 1002)])
def test_head_kernel_stores_a_padded_hidden_output(device, stream, rng, batch, widths, share, ldh):
    """The head kernel's H in rows of ``ldh`` floats, wider than the layer (a padded H):
    an odd width in rows of an even stride (8-byte stores but for each row's last column)
    and of a stride that is a multiple of 4 (16-byte stores but for the row's last, part
    filled, four columns: one of them, and three), an even width in rows of 4-float and
    2-float multiples. With the shares through the workspace and in a cluster: H and Q
    within TF32 accuracy of float64 (poisoned first), the padding left unwritten."""
    from drvtrain.nn.mlp import wgmma_available
    if not wgmma_available(device):
        pytest.skip(f"wgmma needs compute capability 9.0; this device is {device.arch}")
    layout = make_layout(widths)
    params = random_params(layout, rng)
    sms = device.sm_count // share  # as the head test plans these shapes
    fk, last = MLP(layout).forward_kernels, len(layout.layers) - 1
    hidden, n_out, k = widths[-2], widths[-1], widths[-3]
    x = DeviceBuffer.from_numpy(rng.standard_normal((batch, k)).astype(np.float32))
    named = params.to_numpy()
    w1, b1 = (named[f"layer{last - 1}.{v}"].astype(np.float64) for v in ("weight", "bias"))
    w2, b2 = (named[f"layer{last}.{v}"].astype(np.float64) for v in ("weight", "bias"))
    ref_h = np.maximum(x.to_numpy().astype(np.float64) @ w1.T + b1, 0.0)
    ref_q = ref_h @ w2.T + b2
    for cluster in (False, True):
        p = fk.plan_head(batch, hidden, k, n_out, sms=sms, cluster=cluster)
        assert p.cluster == cluster
        arena = Arena(4 * p.workspace_floats + 1024, zeroed_bytes=4 * p.counters + 256)
        h, q = DeviceBuffer((batch, ldh), np.float32), DeviceBuffer((batch, n_out), np.float32)
        h.poison(stream=stream)
        q.poison(stream=stream)
        fk.launch_head(x, k, params.weight(last - 1), k, h, ldh, batch, hidden, k, bias=params.bias(last - 1),
                       w2=params.weight(last), ldw2=hidden, b2=params.bias(last), q=q, ldq=n_out, n_out=n_out,
                       arena=arena, stream=stream, sms=sms, cluster=cluster)
        got_h, got_q = h.to_numpy(), q.to_numpy()
        where = f"cluster={cluster}"
        assert rel(got_h[:, :hidden], ref_h) < 3e-3 and rel(got_q, ref_q) < 3e-3, where
        assert np.isnan(got_h[:, hidden:]).all(), f"{where}: the padding written"
        arena.close()


@pytest.mark.parametrize("m, n, k", [(512, 1024, 19), (450, 1000, 32), (300, 1400, 1), (129, 4000, 5),
                                     (60, 6400, 8), (450, 1001, 19)])
def test_output_layer_dw_in_its_dx_matches_float64(device, stream, rng, m, n, k):
    """The output layer's dX product with its dW and db summed in the same launch
    (``linear_grad_input_dwl_64x64_*_cluster_3xtf32``, the row tiles of a column as one
    cluster; 8, 8 ragged, 5, 3, 1 ragged and 8 ragged row tiles, columns off the tile's
    edge, 19, 32, 1, 5, 8 and 19 outputs, the fifth with 16-byte copies of a partial k
    tile, the last with an odd width: H's tile in 4-byte copies, dX in single stores):
    dX, dW and db within 1e-5 of float64 with every output poisoned first,
    dX bit for bit the plain grad-input kernel's; dW with rows wider apart than its
    width; the same bits over graph replays with the outputs poisoned between them;
    nothing written while the gate is set."""
    from drvtrain import capture
    from drvtrain.nn.mlp import LinearKernels, vector_width
    if tuple(device.compute_capability) < (9, 0):
        pytest.skip(f"the fold runs its row tiles as a cluster: compute capability 9.0; this is {device.arch}")
    bk = LinearKernels(("grad_input", "grad_weight"), "3xtf32", device.sm_count)
    assert bk.plan_last_dw(m, n, k) is not None
    dy_h = rng.standard_normal((m, k)).astype(np.float32)
    w_h = rng.standard_normal((k, n)).astype(np.float32)
    h_h = np.maximum(rng.standard_normal((m, n)), 0.0).astype(np.float32)  # a ReLU's output: half zeros
    want_dx = (dy_h.astype(np.float64) @ w_h.astype(np.float64)) * (h_h > 0)
    want_dw = dy_h.T.astype(np.float64) @ h_h.astype(np.float64)
    want_db = dy_h.astype(np.float64).sum(axis=0)
    dy, w, h = (DeviceBuffer.from_numpy(a) for a in (dy_h, w_h, h_h))
    ldw = n + 3  # dW's rows wider apart than n: the columns past n stay poisoned
    dx, dx_plain = DeviceBuffer((m, n), np.float32), DeviceBuffer((m, n), np.float32)
    dw, db = DeviceBuffer((k, ldw), np.float32), DeviceBuffer((k,), np.float32)
    outs = (dx, dw, db)

    def launch(gate=None):
        return bk.launch_last_dw(dy, k, w, n, dx, n, m, n, k, mask=h, ldm=n, dw=dw, lddw=ldw, db=db, stream=stream,
                                 gate=gate)

    for buf in outs + (dx_plain,):
        buf.poison(stream=stream)
    kernel = launch()
    assert kernel.name == f"linear_grad_input_dwl_64x64_cp{vector_width(dy, k, w, n)}_cluster_3xtf32"
    arena = Arena(1 << 20, zeroed_bytes=4096)
    plain = bk.launch("grad_input", dy, k, w, n, dx_plain, n, m, n, k, arena=arena, stream=stream, mask=h, ldm=n)
    assert plain.tile.name == "64x64" and "_dwl_" not in plain.name
    stream.synchronize()
    got_dx, got_dw, got_db = dx.to_numpy(), dw.to_numpy(), db.to_numpy()
    assert not np.isnan(got_dx).any() and not np.isnan(got_dw[:, :n]).any() and not np.isnan(got_db).any()
    assert np.isnan(got_dw[:, n:]).all()  # past dW's width: untouched
    assert rel(got_dx, want_dx) < 1e-5 and rel(got_dw[:, :n], want_dw) < 1e-5 and rel(got_db, want_db) < 1e-5
    assert np.array_equal(got_dx, dx_plain.to_numpy())
    with capture(stream) as g:
        launch()
    exe = g.instantiate()
    for _ in range(3):
        for buf in outs:
            buf.poison(stream=stream)
        exe.launch(stream)
        stream.synchronize()
        assert np.array_equal(dx.to_numpy(), got_dx)
        assert np.array_equal(dw.to_numpy()[:, :n], got_dw[:, :n]) and np.array_equal(db.to_numpy(), got_db)
    exe.close()
    gate = DeviceBuffer.from_numpy(np.array([1], np.int32))
    for buf in outs:
        buf.poison(stream=stream)
    launch(gate=gate)
    stream.synchronize()
    assert all(np.isnan(buf.to_numpy()).all() for buf in outs)


def test_output_layer_dw_folded_in_the_backward_matches_float64_and_the_unfolded_one(device, stream, rng):
    """MLP.last_dw_folded on the large net (512 rows, 19 outputs): every gradient
    within 1e-5 of float64 either way, and every gradient but the output layer's dW
    and db bit for bit the unfolded backward's (the output layer's dX is the same
    product on the same tile)."""
    if tuple(device.compute_capability) < (9, 0):
        pytest.skip(f"the fold runs its row tiles as a cluster: compute capability 9.0; this is {device.arch}")
    batch, layout = 512, make_layout([128, 1024, 1024, 19])
    params = random_params(layout, rng)
    x = DeviceBuffer.from_numpy(rng.standard_normal((batch, 128)).astype(np.float32))
    dout = DeviceBuffer.from_numpy(rng.standard_normal((batch, 19)).astype(np.float32))
    got = {}
    for fold in (True, False):
        mlp = MLP(layout, fold_last_dw=fold)
        assert mlp.last_dw_folded(batch) == fold
        grads = FlatBuffer(layout)
        grads.buffer.poison(stream=stream)
        arena = Arena(mlp.scratch_bytes(batch), zeroed_bytes=mlp.zeroed_bytes(batch) + 256)
        fwd = mlp.forward(params, x, arena=arena, stream=stream)
        mlp.backward(params, grads, fwd, dout, arena=arena, stream=stream)
        assert arena.fallback_count == 0
        acts = [x.to_numpy().astype(np.float64)] + [a.to_numpy().astype(np.float64) for a in fwd.activations[1:]]
        want = mlp_backward(params.to_numpy(), acts, dout.to_numpy())
        got[fold] = grads.to_numpy()
        for name, v in want.items():
            assert not np.isnan(got[fold][name]).any(), name
            assert rel(got[fold][name], v) < 1e-5, f"{name}: rel {rel(got[fold][name], v):.3g}"
    last = {f"layer{len(layout.layers) - 1}.weight", f"layer{len(layout.layers) - 1}.bias"}
    assert last <= set(got[True])
    for name in got[True]:
        if name not in last:
            assert np.array_equal(got[True][name], got[False][name]), name


def check_gradients(mlp, layout, batch, stream, rng):
    """Every gradient of a random loss within 1e-5 of float64 (poisoned first: none unwritten)."""
    widths = [layout.layers[0][1]] + [o for o, _ in layout.layers]
    params = random_params(layout, rng)
    grads = FlatBuffer(layout)
    grads.buffer.poison(stream=stream)
    x = rng.standard_normal((batch, widths[0])).astype(np.float32)
    dout = rng.standard_normal((batch, widths[-1])).astype(np.float32)
    arena = Arena(mlp.scratch_bytes(batch), zeroed_bytes=mlp.zeroed_bytes(batch) + 256)
    fwd = mlp.forward(params, DeviceBuffer.from_numpy(x), arena=arena, stream=stream)
    mlp.backward(params, grads, fwd, DeviceBuffer.from_numpy(dout), arena=arena, stream=stream)
    # From the device's activations: the backward's contract starts there, and a ReLU
    # mask decided in float64 could differ where a pre-activation rounds to zero.
    acts = [x.astype(np.float64)] + [a.to_numpy().astype(np.float64) for a in fwd.activations[1:]]
    want = mlp_backward(params.to_numpy(), acts, dout)
    got = grads.to_numpy()
    for name, w in want.items():
        assert not np.isnan(got[name]).any(), name
        assert rel(got[name], w) < 1e-5, f"{name}: rel {rel(got[name], w):.3g}"


@pytest.mark.parametrize("wgmma", [True, False], ids=["wgmma", "mma.sync"])
def test_wide_backward_on_wgmma_and_on_the_forced_fallback_match_float64(device, stream, rng, wgmma):
    """The large net's 1024-wide dX and dW run on gemm_sm90a.cu's 3xTF32 wgmma
    kernels on compute capability 9.0, gemm.cu's mma.sync kernels when forced:
    every gradient within 1e-5 of float64 either way, nothing left unwritten."""
    from drvtrain.nn.mlp import WGMMA_TILE, wgmma_available
    if wgmma and not wgmma_available(device):
        pytest.skip(f"wgmma needs compute capability 9.0; this device is {device.arch}")
    batch, layout = 512, make_layout([128, 1024, 1024, 19])
    mlp = MLP(layout, tf32=False, wgmma=wgmma)
    for role, m, n, k in (("grad_input", batch, 1024, 1024), ("grad_weight", 1024, 1024, batch)):
        assert (mlp.backward_kernels.plan(role, m, n, k).tile is WGMMA_TILE) == wgmma, role
    check_gradients(mlp, layout, batch, stream, rng)


@pytest.mark.parametrize("batch, widths", SHAPES)
def test_gradients_match_float64(device, stream, rng, batch, widths):
    """On compute capability 9.0 the nets of three layers and a narrow input fold the
    first layer's dW into the second layer's dX (MLP.first_dw_folded): checked the same."""
    layout = make_layout(widths)
    mlp = MLP(layout, tf32=False)
    assert mlp.first_dw_folded(batch) == (tuple(device.compute_capability) >= (9, 0) and widths[0] <= 8
                                          and len(widths) >= 4)
    check_gradients(mlp, layout, batch, stream, rng)


def test_grad_norm_and_clip(device, stream, rng):
    layout = make_layout([33, 300, 5])
    params, grads = random_params(layout, rng), FlatBuffer(layout)
    flat = np.zeros(layout.size, np.float32)
    for s in layout.slots:
        flat[s.offset: s.offset + s.size] = rng.standard_normal(s.size)
    grads.buffer.copy_from_numpy(flat)
    true_norm, _ = clip_scale(flat, 1.0)
    for max_norm in (true_norm * 2, true_norm / 3):
        opt = AdamW(params, grads, max_norm=max_norm)
        opt.clip_grad_norm(stream=stream)
        norm, scale, t = opt.read_state()
        assert abs(norm - true_norm) / true_norm < 1e-6 and t == 1
        if max_norm > true_norm:
            assert scale == 1.0
        else:
            assert abs(norm * scale - max_norm * norm / (norm + 1e-6)) / max_norm < 1e-6
    bits = []
    for _ in range(3):  # bitwise identical run to run
        opt = AdamW(params, grads, max_norm=1.0)
        opt.clip_grad_norm(stream=stream)
        bits.append(opt.clip.to_numpy().tobytes())
    assert bits[0] == bits[1] == bits[2]


@pytest.mark.parametrize("batch, widths", [(256, [4, 256, 256, 3]), (300, [5, 200, 96, 3]), (512, [3, 72, 40, 2]),
                                          (33, [8, 40, 64, 7]), (1, [1, 36, 40, 2]), (100, [3, 70, 33, 5])])
def test_first_dw_summed_by_the_norm_keeps_every_bit(device, stream, rng, batch, widths):
    """MLP.backward(defer_first_dw=True), then AdamW.step(first_dw=...): the norm kernel
    sums the first layer's dW and db from the tiles' shares (partial strips, float4s
    across columns, 1 to 16 row tiles). The gradients (dW0 and db0 poisoned first), the
    norm and scale, the parameters and both moments equal those of the backward that
    sums them itself, bit for bit, and the gradients are within 1e-5 of float64. 70
    columns end dW0 (210 floats) and db0 mid-float4: the padding after them holds
    random values in both runs, and must keep them."""
    layout = make_layout(widths)
    mlp = MLP(layout, tf32=False)
    if not mlp.first_dw_folded(batch):
        assert tuple(device.compute_capability) < (9, 0)
        pytest.skip(f"the first dW folds on compute capability 9.0 only; this device is {device.arch}")
    theta = random_params(layout, rng).to_numpy()
    x = DeviceBuffer.from_numpy(rng.standard_normal((batch, widths[0])).astype(np.float32))
    dout_host = rng.standard_normal((batch, widths[-1])).astype(np.float32)
    dout = DeviceBuffer.from_numpy(dout_host)
    padded = (rng.standard_normal(layout.size) * 1e-3).astype(np.float32)  # every float, padding included
    runs = []
    for defer in (False, True):
        params, grads = FlatBuffer(layout), FlatBuffer(layout)
        params.load_numpy(theta)
        grads.buffer.copy_from_numpy(padded)
        grads.weight(0).poison(stream=stream)
        grads.bias(0).poison(stream=stream)
        opt = AdamW(params, grads, lr=1e-2, max_norm=1e-3)  # clipped: the norm's bits reach the update
        arena = Arena(mlp.scratch_bytes(batch), zeroed_bytes=mlp.zeroed_bytes(batch) + 256)
        fwd = mlp.forward(params, x, arena=arena, stream=stream)
        shares = mlp.backward(params, grads, fwd, dout, arena=arena, stream=stream, defer_first_dw=defer)
        assert (shares is not None) == defer
        opt.step(stream=stream, first_dw=shares)
        acts = [a.to_numpy() for a in fwd.activations]
        runs.append(dict(grads=grads.buffer.to_numpy(), params=params.buffer.to_numpy(),
                         m=opt.m.buffer.to_numpy(), v=opt.v.buffer.to_numpy(), clip=opt.clip.to_numpy(), acts=acts))
        got = grads.to_numpy()
        arena.close()
        opt.close()
    for key in ("grads", "params", "m", "v", "clip"):
        assert runs[0][key].tobytes() == runs[1][key].tobytes(), key
    pad = np.ones(layout.size, bool)
    for slot in layout.slots:
        pad[slot.offset: slot.offset + slot.size] = False
    assert pad.any() and runs[1]["grads"][pad].tobytes() == padded[pad].tobytes()
    want = mlp_backward(theta, [a.astype(np.float64) for a in runs[1]["acts"]], dout_host)
    for name, w in want.items():
        assert rel(got[name], w) < 1e-5, f"{name}: rel {rel(got[name], w):.3g}"


def test_adamw_step_refuses_shares_it_cannot_sum(device, stream, rng):
    """first_dw must be MLP.backward's FirstDwShares, of this optimizer's gradients, for
    this layout's first layer in 32-wide strips, of 1 to FIRST_DW_MAX_ROW_TILES row tiles,
    in a buffer that holds them all: anything else is refused before a launch."""
    from drvtrain.nn.mlp import FIRST_DW_MAX_ROW_TILES, FirstDwShares
    layout = make_layout([4, 64, 64, 2])
    params, grads, other = random_params(layout, rng), FlatBuffer(layout), FlatBuffer(layout)
    opt = AdamW(params, grads)
    shares = DeviceBuffer(64 * 5 * 2, np.float32)  # 2 row tiles of 64 columns x (4 + 1)
    w0, b0 = layout.weight(0).offset, layout.bias(0).offset
    ok = FirstDwShares(grads, shares, w0, b0, 4, 64, 2, 32)
    with pytest.raises(TypeError, match="FirstDwShares"):
        opt.step(stream=stream, first_dw=ok.kernel_args())
    with pytest.raises(ValueError, match="another gradient buffer"):
        opt.step(stream=stream, first_dw=FirstDwShares(other, *ok.kernel_args()))
    for at, in0, cols, bn in (((w0 + 4, b0), 4, 64, 32), ((w0, layout.weight(1).offset), 4, 64, 32),
                              ((w0, b0), 3, 64, 32), ((w0, b0), 4, 80, 32), ((w0, b0), 4, 64, 16)):
        with pytest.raises(ValueError, match="first layer"):
            opt.step(stream=stream, first_dw=FirstDwShares(grads, shares, *at, in0, cols, 2, bn))
    for rows in (0, FIRST_DW_MAX_ROW_TILES + 1):
        with pytest.raises(ValueError, match="row tiles"):
            opt.step(stream=stream, first_dw=FirstDwShares(grads, shares, w0, b0, 4, 64, rows, 32))
    with pytest.raises(ValueError, match="shares hold"):
        opt.step(stream=stream, first_dw=FirstDwShares(grads, shares, w0, b0, 4, 64, 3, 32))
    stream.synchronize()
    assert opt.read_state()[2] == 0  # nothing ran
    shares.close()


def test_adamw_update_reads_only_params_and_moments_before_its_wait(device, stream, rng):
    """adamw_clip_step (AdamW.step's second kernel) loads its first float4 of params, m and
    v before its grid wait (the norm kernel before it writes none of them) and the
    gradient after it. After two steps (moments not zero), a third: the gradients are
    poisoned after the norm kernel and written again by `late_copy`, launched just before
    the update, both dependent launches. Parameters, moments and the state words are the
    bits of an ordinary AdamW.step from the same state: an update that read the gradient
    before its wait would meet the poison."""
    if tuple(device.compute_capability) < (9, 0):
        pytest.skip(f"programmatic dependent launch needs compute capability 9.0; this device is {device.arch}")
    layout = make_layout([17, 100, 3])
    theta0 = layout.init_numpy(int(rng.integers(1 << 30)))
    mask = np.zeros(layout.size, bool)
    for s in layout.slots:
        mask[s.offset: s.offset + s.size] = True
    steps = [np.where(mask, rng.standard_normal(layout.size), 0).astype(np.float32) for _ in range(3)]
    a, b = (AdamW(FlatBuffer(layout, theta0), FlatBuffer(layout), lr=1e-2, max_norm=5.0) for _ in range(2))
    for g in steps[:2]:
        for opt in (a, b):
            opt.grads.buffer.copy_from_numpy(g)
            opt.step(stream=stream)
    a.grads.buffer.copy_from_numpy(steps[2])
    a.step(stream=stream)
    b.grads.buffer.copy_from_numpy(steps[2])
    b._partials.launch(b.norm_grid, b._partials.block, b.grads, b.n, b.norm_partials, b.t, b._t_next, 0,
                       stream=stream)
    saved = DeviceBuffer.from_numpy(steps[2])
    b.grads.buffer.poison(stream=stream)
    writer = late_copy()
    with dependent_launches(True):
        writer.launch(1, 128, b.grads.buffer, saved, words(saved), 0, 0, 0, LATE_NS, stream=stream)
        b._launch_clip_update(stream=stream)
    got = b.params.buffer.to_numpy()
    assert np.isfinite(got).all() and b.read_state()[2] == 3
    for want, have in ((a.params, b.params), (a.m, b.m), (a.v, b.v)):
        assert want.buffer.to_numpy().tobytes() == have.buffer.to_numpy().tobytes()
    assert a._state.to_numpy().tobytes() == b._state.to_numpy().tobytes()


def test_hundred_adamw_steps_match_float64_recurrence(device, stream, rng):
    layout = make_layout([17, 100, 3])
    theta0 = layout.init_numpy(int(rng.integers(1 << 30)))
    params, grads = FlatBuffer(layout, theta0), FlatBuffer(layout)
    lr, wd, b1, b2, eps, max_norm = 1e-2, 1e-2, 0.9, 0.999, 1e-8, 5.0
    opt = AdamW(params, grads, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, max_norm=max_norm)
    theta, m, v = theta0.astype(np.float64), np.zeros(layout.size), np.zeros(layout.size)
    mask = np.zeros(layout.size, bool)
    for s in layout.slots:
        mask[s.offset: s.offset + s.size] = True
    for t in range(1, 101):
        g = np.where(mask, rng.standard_normal(layout.size) * rng.uniform(0.1, 3), 0).astype(np.float32)
        grads.buffer.copy_from_numpy(g)
        opt.step(stream=stream)
        _, scale = clip_scale(g, max_norm)
        theta, m, v = adamw(theta, m, v, g.astype(np.float64) * scale, t, lr, b1, b2, eps, wd)
    got = params.buffer.to_numpy()
    assert rel(got, theta) < 1e-5
    assert rel(opt.m.buffer.to_numpy(), m) < 1e-5 and rel(opt.v.buffer.to_numpy(), v) < 1e-5
    assert np.all(got[~mask] == 0)
    assert opt.read_state()[2] == 100


def test_adamw_takes_t_from_the_norm_kernel_when_its_guess_is_wrong(device, stream, rng):
    """adamw_clip_step computes the bias corrections before its wait from a guess,
    the step counter plus one, and keeps them only if t_next (the norm kernel's)
    agrees. Here the counter is changed between the two kernels, so the guess is
    wrong: the update must still be the float64 AdamW step for the norm kernel's t,
    and t must be published as that t."""
    layout = make_layout([17, 100, 3])
    params, grads = FlatBuffer(layout, layout.init_numpy(int(rng.integers(1 << 30)))), FlatBuffer(layout)
    lr, wd, b1, b2, eps, max_norm = 1e-2, 1e-2, 0.9, 0.999, 1e-8, 5.0
    opt = AdamW(params, grads, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, max_norm=max_norm)
    theta = params.buffer.to_numpy().astype(np.float64)
    m = (rng.standard_normal(layout.size) * 0.1).astype(np.float32)
    v = rng.uniform(1e-4, 1e-2, layout.size).astype(np.float32)
    g = (rng.standard_normal(layout.size) * rng.uniform(0.1, 3)).astype(np.float32)
    opt.m.buffer.copy_from_numpy(m)
    opt.v.buffer.copy_from_numpy(v)
    grads.buffer.copy_from_numpy(g)
    opt.t.copy_from_numpy(np.array([2], np.int32))
    norm = opt._partials
    norm.launch(opt.norm_grid, norm.block, grads, opt.n, opt.norm_partials, opt.t, opt._t_next, 0, stream=stream)
    stream.synchronize()
    assert int(opt._t_next.to_numpy()[0]) == 3
    opt.t.copy_from_numpy(np.array([40], np.int32))  # the guess: t = 41
    opt._launch_clip_update(stream=stream)
    stream.synchronize()
    _, scale = clip_scale(g, max_norm)
    want, want_m, want_v = adamw(theta, m.astype(np.float64), v.astype(np.float64), g.astype(np.float64) * scale,
                                 3, lr, b1, b2, eps, wd)
    assert rel(params.buffer.to_numpy(), want) < 1e-5
    assert rel(opt.m.buffer.to_numpy(), want_m) < 1e-5 and rel(opt.v.buffer.to_numpy(), want_v) < 1e-5
    assert opt.read_state()[2] == 3


def test_norm_kernel_gate_writes_nothing_and_an_open_gate_sums_every_square(device, stream, rng):
    """grad_norm_partials with a closed gate: its partials and t_next keep their
    poison. Open: the partials add up to sum g^2 (float64) and t_next is t + 1. Over
    256 K parameters, so that threads of the norm's grid take more than one float4."""
    layout = make_layout([300, 900, 7])
    params, grads = FlatBuffer(layout, layout.init_numpy(int(rng.integers(1 << 30)))), FlatBuffer(layout)
    opt = AdamW(params, grads, lr=1e-2, max_norm=5.0)
    g = (rng.standard_normal(layout.size) * rng.uniform(0.1, 3)).astype(np.float32)
    grads.buffer.copy_from_numpy(g)
    opt.t.copy_from_numpy(np.array([6], np.int32))
    gate = DeviceBuffer.from_numpy(np.ones(1, np.int32))
    norm = opt._partials
    for closed in (1, 0):
        gate.copy_from_numpy(np.full(1, closed, np.int32))
        opt.norm_partials.poison(stream=stream)
        opt._t_next.poison(stream=stream)
        norm.launch(opt.norm_grid, norm.block, grads, opt.n, opt.norm_partials, opt.t, opt._t_next, gate,
                    stream=stream)
        stream.synchronize()
        partials, t_next = opt.norm_partials.to_numpy(), int(opt._t_next.to_numpy()[0])
        if closed:
            assert np.all(partials.view(np.uint32) == 0xFFFFFFFF) and t_next == -1
        else:
            want = float(np.sum(g.astype(np.float64) ** 2))
            assert abs(partials.sum() - want) / want < 1e-12 and t_next == 7
    gate.close()


def test_step_is_clip_grad_norm_then_apply_bit_for_bit(device, stream, rng):
    """AdamW.step decides the clip in every block of the update from the norm
    kernel's partials; clip_grad_norm then apply decide it in the norm's last
    block. On a net of over 256 K parameters (on an H200, more norm partials than a
    block has threads, so each thread adds two), with a loss, a metrics ring and the NaN
    guard, six steps run both ways: one with a NaN gradient (skipped) and one
    gated (not due). Every step leaves the same bits in params, m, v, the clip,
    t and the flag, and the same ring slots; t and the flag are what they must be."""
    layout = make_layout([300, 900, 7])
    theta0 = layout.init_numpy(int(rng.integers(1 << 30)))
    seed, loss_value = int(rng.integers(1 << 30)), np.float32(rng.uniform(0.1, 2.0))
    runs = {}
    for fused in (True, False):
        params, grads = FlatBuffer(layout, theta0), FlatBuffer(layout)
        loss = DeviceBuffer.from_numpy(np.array([loss_value], np.float32))
        ring = Metrics(slots=8)
        opt = AdamW(params, grads, lr=1e-2, max_norm=300.0, loss=loss, metrics=ring, nan_guard=True)
        # More partials than threads where the grid allows it (2 per SM: over 128 SMs).
        assert (opt.norm_grid > 256) == (2 * device.sm_count > 256)
        gate = DeviceBuffer.from_numpy(np.zeros(1, np.int32))
        g_rng = np.random.default_rng(seed)
        states = []
        for k in range(6):
            g = (g_rng.standard_normal(layout.size) * g_rng.uniform(0.3, 1.5)).astype(np.float32)
            if k == 3:
                g[int(g_rng.integers(layout.size))] = np.nan
            grads.buffer.copy_from_numpy(g)
            gate.copy_from_numpy(np.array([1 if k == 4 else 0], np.int32))
            if fused:
                opt.step(stream=stream, gate=gate)
            else:
                opt.clip_grad_norm(stream=stream, gate=gate)
                opt.apply(stream=stream)
            stream.synchronize()
            states.append([b.buffer.to_numpy().tobytes() for b in (params, opt.m, opt.v)]
                          + [opt.clip.to_numpy().tobytes(), int(opt.t.to_numpy()[0]), int(opt.skip.to_numpy()[0])])
        runs[fused] = states, ring.ring.view().copy()
        for b in (params, grads, loss, gate):
            b.close()
        opt.close()
        ring.close()
    (fused, fused_ring), (plain, plain_ring) = runs[True], runs[False]
    assert [s[4:] for s in fused] == [[1, 0], [2, 0], [3, 0], [3, 1], [3, 2], [4, 0]]
    assert fused[0][0] != theta0.astype(np.float32).tobytes()  # the first step moved the parameters
    for k, (a, b) in enumerate(zip(fused, plain)):
        assert a == b, f"step {k}"
    assert fused_ring.tobytes() == plain_ring.tobytes()
    tags = fused_ring >> np.uint64(32)
    assert (tags == tags[:, :1]).all()  # every word of a slot carries its step
    assert sorted(int(s) for s in tags[:, 0] if s) == [1, 2, 3, 4]


def test_adamw_weight_decay_factor_is_rounded_once(device, stream, rng):
    """theta * (1 - lr wd) takes the factor rounded once from the exact 1 - lr wd
    (one fma), as the kernel always has. With zero gradients and moments one
    AdamW step is exactly theta times that factor, so the bits show the rounding.
    (lr, wd) are drawn until rounding once and rounding lr wd first differ."""
    for _ in range(100_000):
        lr, wd = np.float32(10 ** rng.uniform(-4, -1)), np.float32(10 ** rng.uniform(-3, 0))
        once = f32_round(1 - Fraction(float(lr)) * Fraction(float(wd)))
        twice = f32_round(1 - Fraction(float(f32_round(Fraction(float(lr)) * Fraction(float(wd))))))
        if once != twice:
            break
    assert once != twice
    layout = make_layout([17, 100, 3])
    theta = layout.init_numpy(int(rng.integers(1 << 30))).astype(np.float32)
    params, grads = FlatBuffer(layout, theta), FlatBuffer(layout)
    opt = AdamW(params, grads, lr=float(lr), weight_decay=float(wd))
    opt.step(stream=stream)
    stream.synchronize()
    want = theta * once
    assert params.buffer.to_numpy().tobytes() == want.tobytes()
    assert np.any(theta * twice != want)  # the other rounding would fail the test
    for b in (params, grads):
        b.close()
    opt.close()


def teacher_batch(rng, layout, batch):
    teacher = layout.unflatten(layout.init_numpy(int(rng.integers(1 << 30))))
    teacher[f"layer{len(layout.layers) - 1}.weight"] *= 3.0
    x = rng.standard_normal((batch, layout.layers[0][1])).astype(np.float32)
    y = mlp_forward(teacher, x, len(layout.layers))[-1].astype(np.float32)
    return x, y


def run_losses(layout, x, y, steps, *, graph, arena_active, seed, weight_streams=2, dependent_launch=None):
    stream = Stream()
    step = RegressionStep(layout, len(x), lr=1e-3, seed=seed, arena_active=arena_active,
                          weight_streams=weight_streams, dependent_launch=dependent_launch)
    step.x.copy_from_numpy(x)
    step.target.copy_from_numpy(y)
    losses = []
    exe = step.capture(stream=stream) if graph else None
    for _ in range(steps):
        exe.launch(stream) if graph else step.enqueue(stream=stream)
        step.metrics.record(stream)
        losses.extend(m.loss for m in step.metrics.poll())
    stream.synchronize()
    losses.extend(m.loss for m in step.metrics.poll())
    assert step.metrics.missed == 0
    return np.array(losses, np.float32), step


def test_losses_are_bitwise_identical_eager_graph_and_arena_modes(device, rng):
    layout = make_layout([8, 64, 64, 2])
    x, y = teacher_batch(rng, layout, 96)
    seed = int(rng.integers(1 << 30))
    eager, _ = run_losses(layout, x, y, 200, graph=False, arena_active=True, seed=seed)
    replay, step = run_losses(layout, x, y, 200, graph=True, arena_active=True, seed=seed)
    assert step.dependent_launch and len(step.weight_streams) == 2
    inactive, _ = run_losses(layout, x, y, 200, graph=False, arena_active=False, seed=seed)
    # The weight gradients beside the dX chain or on the caller's stream: the same bits.
    one_stream, _ = run_losses(layout, x, y, 200, graph=True, arena_active=True, seed=seed, weight_streams=0)
    side, _ = run_losses(layout, x, y, 200, graph=True, arena_active=True, seed=seed, weight_streams=1)
    # Dependent launches (the default for this 64-wide net) or ordinary ones: the same bits.
    ordinary, step = run_losses(layout, x, y, 200, graph=True, arena_active=True, seed=seed, dependent_launch=False)
    assert not step.dependent_launch
    assert len(eager) == 200 and np.all(np.isfinite(eager))
    assert eager.tobytes() == replay.tobytes() == inactive.tobytes() == one_stream.tobytes() == side.tobytes() \
        == ordinary.tobytes()
    assert eager[-1] < eager[0]


@pytest.mark.parametrize("weight_streams", [0, 2])
@pytest.mark.parametrize("tf32, bound", [(False, 1e-5), (True, 1e-5)])
def test_step_matches_reference_for_one_step(device, stream, rng, tf32, bound, weight_streams):
    """Given the forward the device computed, the loss, every gradient and the clip norm to
    FP32 accuracy (the backward is FP32-accurate for either forward precision), with
    the weight gradients on the caller's stream or on two of the step's own.

    The float64 reference starts from the device's own activations: a ReLU whose input
    rounds to the other side of zero in TF32 (or FP32) changes a gradient row by its whole
    value, which no relative bound on the float64 forward's masks can cover. The forward's
    own accuracy is test_forward_matches_float64's."""
    layout = make_layout([5, 40, 24, 3])
    x, y = teacher_batch(rng, layout, 50)
    step = RegressionStep(layout, 50, lr=1e-3, weight_decay=1e-2, max_norm=0.5, tf32=tf32,
                          seed=int(rng.integers(1 << 30)), weight_streams=weight_streams)
    assert len(step.weight_streams) == weight_streams
    step.x.copy_from_numpy(x)
    step.target.copy_from_numpy(y)
    named = step.params.to_numpy()
    # The same kernels on the same inputs: bitwise the forward inside the step.
    scratch = Arena(step.net.scratch_bytes(50, 1) if step.net is not step.mlp else step.mlp.scratch_bytes(50),
                    zeroed_bytes=step.net.zeroed_bytes(50) + 256)
    fwd = step.net.forward(step.params, step.x, arena=scratch, stream=stream)
    acts = [x.astype(np.float64)] + [a.to_numpy().astype(np.float64) for a in fwd.activations[1:]]
    scratch.close()
    step.enqueue(stream=stream)
    loss, dout = mse(acts[-1], y)
    grads = mlp_backward(named, acts, dout)
    assert abs(step.loss.to_numpy()[0] - loss) / loss < bound
    got_grads = step.grads.to_numpy()
    for name, want in grads.items():
        assert rel(got_grads[name], want) < bound, name
    g = layout.flatten({k: v.astype(np.float32) for k, v in grads.items()}).astype(np.float64)
    norm, scale = clip_scale(g, 0.5)
    assert abs(step.optimizer.read_state()[0] - norm) / norm < bound
    if not tf32:  # AdamW's first step is sign-like: TF32 gradient noise flips tiny components
        theta, _, _ = adamw(layout.flatten(named).astype(np.float64), 0, 0, g * scale, 1, 1e-3, 0.9, 0.999,
                            1e-8, 1e-2)
        assert rel(step.params.buffer.to_numpy(), theta) < 1e-5


def test_metrics_ring_under_fast_replay_has_no_torn_or_missing_slots(device, rng):
    layout = make_layout([8, 32, 2])
    x, y = teacher_batch(rng, layout, 64)
    stream = Stream()
    step = RegressionStep(layout, 64, metrics_slots=64, seed=1)
    step.x.copy_from_numpy(x)
    step.target.copy_from_numpy(y)
    exe = step.capture(stream=stream)
    seen = []
    for i in range(2000):
        exe.launch(stream)
        step.metrics.record(stream)
        if i % 16 == 0:
            seen.extend(step.metrics.poll())
        while step.metrics.in_flight >= step.metrics.slots - 1:  # back-pressure: never lap the ring
            seen.extend(step.metrics.poll())
    stream.synchronize()
    seen.extend(step.metrics.poll())
    assert step.metrics.missed == 0
    assert [m.step for m in seen] == list(range(1, 2001))
    assert all(np.isfinite(m.loss) and m.grad_norm > 0 and 0 < m.clip_scale <= 1 for m in seen)


def run_recorded_steps(rng, slots: int, steps: int, seed: int = 1) -> RegressionStep:
    """A small regression step run `steps` times eagerly, each recorded in its
    metrics ring of `slots` slots, then synchronised; nothing polled yet."""
    layout = make_layout([8, 32, 2])
    x, y = teacher_batch(rng, layout, 64)
    stream = Stream()
    step = RegressionStep(layout, 64, metrics_slots=slots, seed=seed)
    step.x.copy_from_numpy(x)
    step.target.copy_from_numpy(y)
    for _ in range(steps):
        step.enqueue(stream=stream)
        step.metrics.record(stream)
    stream.synchronize()
    return step


def test_missed_steps_are_counted_not_returned(device, rng):
    step = run_recorded_steps(rng, 8, 20)
    got = step.metrics.poll()
    assert step.metrics.missed == 12 and [m.step for m in got] == list(range(13, 21))


def test_metrics_words_hold_the_fields_bits_under_the_step(device, rng):
    """Each field of a slot is one 8-byte word: the float's bits in the low half,
    the step in the high half (Metrics; dt_metric_store). Checked word by word
    against the loss and the optimizer's norm and scale as the device holds them."""
    step = run_recorded_steps(rng, 4, 6, seed=int(rng.integers(1 << 30)))  # laps the ring once
    norm, scale, t = step.optimizer.read_state()
    assert t == 6
    fields = np.array([step.loss.to_numpy()[0], norm, scale], np.float32)
    want = (np.uint64(6) << np.uint64(32)) | fields.view(np.uint32).astype(np.uint64)
    words = step.metrics.ring.view()
    assert words[6 % 4].tolist() == want.tolist()
    assert (words >> np.uint64(32)).tolist() == [[4] * 3, [5] * 3, [6] * 3, [3] * 3]
    tags, values = step.metrics.read_slot(6)
    assert tags.tolist() == [6] * 3 and values.tobytes() == fields.tobytes()


def test_a_slot_holding_a_word_of_another_step_is_not_returned(device, rng):
    """The host takes a slot only when every word carries the step it wants: a word
    of a newer step (a writer lapping the ring) or of an older one marks it missed."""
    step = run_recorded_steps(rng, 8, 3)
    words = step.metrics.ring.view()
    words[1, 2] = (words[1, 2] & np.uint64(0xFFFFFFFF)) | (np.uint64(1 + 8) << np.uint64(32))  # lapped
    words[3, 0] = (words[3, 0] & np.uint64(0xFFFFFFFF)) | (np.uint64(3 - 1) << np.uint64(32))  # stale
    got = step.metrics.poll()
    assert [m.step for m in got] == [2] and step.metrics.missed == 2


def test_step_graph_has_no_single_block_kernels_or_memsets(device):
    layout = make_layout([4, 256, 256, 3])
    stream = Stream()
    step = RegressionStep(layout, 256)
    step.capture(stream=stream)
    counts = step.graph.node_counts()
    assert set(counts) == {"kernel"}, counts
    for k in step.graph.kernel_nodes():
        assert k.grid[0] * k.grid[1] * k.grid[2] > 1, f"{k.function} launches a single block"
    # Its backward's dX products (the one folded into dW0 included) run the `_settled_`
    # kernels (weights_settled), and so does its forward's second product (the output
    # layer; the first folds in the first layer): its first product and dW products do not.
    names = [k.function for k in step.graph.kernel_nodes()]
    forwards = [i for i, name in enumerate(names) if name.startswith("linear_forward")]
    assert len(forwards) == 2 and "_x0_" in names[forwards[0]], names
    want = [name for i, name in enumerate(names) if name.startswith("linear_grad_input") or i == forwards[1]]
    assert [name for name in names if "_settled_" in name] == want, names


def test_bad_inputs_fail_before_launch(device, stream, rng):
    layout = make_layout([4, 16, 2])
    mlp, params = MLP(layout), random_params(layout, rng)
    arena = Arena(1 << 16)
    with pytest.raises(ValueError, match=r"x has shape \(8, 5\), expected \(8, 4\)"):
        mlp.forward(params, DeviceBuffer((8, 5)), arena=arena, stream=stream)
    with pytest.raises(TypeError, match="float32"):
        mlp.forward(params, DeviceBuffer((8, 4), np.float64), arena=arena, stream=stream)
    with pytest.raises(TypeError, match="DeviceBuffer"):
        mlp.forward(params, np.zeros((8, 4), np.float32), arena=arena, stream=stream)
    with pytest.raises(ValueError, match="another layout"):
        mlp.forward(FlatBuffer(make_layout([4, 16, 3])), DeviceBuffer((8, 4)), arena=arena, stream=stream)
    with pytest.raises(ValueError, match="C-contiguous"):
        params.buffer.copy_from_numpy(np.zeros((layout.size, 2), np.float32)[:, 0])
    fwd = mlp.forward(params, DeviceBuffer.from_numpy(rng.standard_normal((8, 4)).astype(np.float32)),
                      arena=arena, stream=stream)
    with pytest.raises(ValueError, match=r"dout has shape"):
        mlp.backward(params, FlatBuffer(layout), fwd, DeviceBuffer((8, 3)), arena=arena, stream=stream)
    with pytest.raises(TypeError, match="the Forward"):
        mlp.backward(params, FlatBuffer(layout), fwd.output, DeviceBuffer((8, 2)), arena=arena, stream=stream)
    with pytest.raises(RuntimeError, match="clip_grad_norm first"):
        AdamW(params, FlatBuffer(layout)).apply(stream=stream)


def test_save_load_through_the_device(device, tmp_path, rng):
    layout = make_layout([6, 20, 2])
    params = random_params(layout, rng)
    params.save(tmp_path / "p.npz")
    other = FlatBuffer(layout)
    other.load(tmp_path / "p.npz")
    assert np.array_equal(other.buffer.to_numpy(), params.buffer.to_numpy())
    with pytest.raises(ValueError, match="layout needs"):
        FlatBuffer(make_layout([6, 20, 3])).load(tmp_path / "p.npz")


@pytest.mark.parametrize("graph", [False, True])
def test_two_forwards_on_two_streams_do_not_interfere(device, rng, graph):
    """Online and target forwards of different parameters run concurrently, each
    with its own split-k counters, and the backward uses the online activations."""
    from drvtrain import capture, fork, join
    widths = [4, 256, 256, 3]  # 64-row products split k over several blocks per tile
    layout = make_layout(widths)
    batch = 64
    online, target = random_params(layout, rng), random_params(layout, rng)
    grads = FlatBuffer(layout)
    s_obs = rng.standard_normal((batch, widths[0])).astype(np.float32)
    n_obs = rng.standard_normal((batch, widths[0])).astype(np.float32)
    dout = rng.standard_normal((batch, widths[-1])).astype(np.float32)
    x, x2, d = DeviceBuffer.from_numpy(s_obs), DeviceBuffer.from_numpy(n_obs), DeviceBuffer.from_numpy(dout)
    mlp = MLP(layout, tf32=False)
    assert max(_splits(mlp, batch)) > 1
    arena = Arena(3 * mlp.scratch_bytes(batch), zeroed_bytes=3 * mlp.zeroed_bytes(batch) + 256)
    main, side = Stream(), Stream()
    outs = {}

    def enqueue():
        arena.reset()
        fork(main, side)
        outs["target"] = mlp.forward(target, x2, arena=arena, stream=side)
        outs["online"] = mlp.forward(online, x, arena=arena, stream=main)
        join(main, side)
        mlp.backward(online, grads, outs["online"], d, arena=arena, stream=main)

    for _ in range(5):  # repeated runs: a counter race would show as a wrong sum sooner or later
        grads.buffer.poison(stream=main)
        if graph:
            with capture(main) as g:
                enqueue()
            nodes = [k.node for k in g.kernel_nodes()]
            assert any(g.can_run_concurrently(a, b) for a, b in itertools.combinations(nodes, 2))
            g.instantiate().launch(main)
        else:
            enqueue()
        main.synchronize()
        n_layers = len(layout.layers)
        ref_online = mlp_forward(online.to_numpy(), s_obs, n_layers)
        ref_target = mlp_forward(target.to_numpy(), n_obs, n_layers)
        assert rel(outs["online"].output.to_numpy(), ref_online[-1]) < 1e-5
        assert rel(outs["target"].output.to_numpy(), ref_target[-1]) < 1e-5
        # The backward from the device's own activations, as in check_gradients: a ReLU mask
        # decided in float64 could differ where a pre-activation rounds to zero, and move a whole
        # row of the gradient. They must still be the online forward's as float64 computes them:
        # read after the backward, this shows that nothing (the target's forward, say) wrote over
        # them before it ran.
        acts = [s_obs.astype(np.float64)] + [a.to_numpy().astype(np.float64) for a in outs["online"].activations[1:]]
        for k in range(1, n_layers):
            assert rel(acts[k], ref_online[k]) < 1e-5, f"activation {k}"
        want = mlp_backward(online.to_numpy(), acts, dout)
        got = grads.to_numpy()
        for name, w in want.items():
            assert rel(got[name], w) < 1e-5, name


def _splits(mlp, batch):
    from drvtrain.nn.mlp import split_count
    return [split_count(m, n, k, mlp._sm_count) for m, n, k in mlp._products(batch)]


def test_nan_guard_skips_the_update_and_keeps_t(device, stream, rng):
    layout = make_layout([9, 40, 3])
    params, grads = random_params(layout, rng), FlatBuffer(layout)
    opt = AdamW(params, grads, lr=1e-2, nan_guard=True)
    g = np.zeros(layout.size, np.float32)
    for s in layout.slots:
        g[s.offset: s.offset + s.size] = rng.standard_normal(s.size)
    grads.buffer.copy_from_numpy(g)
    opt.step(stream=stream)
    before = [b.buffer.to_numpy() for b in (params, opt.m, opt.v)]
    bad = g.copy()
    bad[int(rng.integers(layout.slots[0].size))] = np.nan
    grads.buffer.copy_from_numpy(bad)
    opt.step(stream=stream)
    after = [b.buffer.to_numpy() for b in (params, opt.m, opt.v)]
    assert all(a.tobytes() == b.tobytes() for a, b in zip(before, after))
    assert opt.read_state()[2] == 1 and opt.skip.to_numpy()[0] == 1
    grads.buffer.copy_from_numpy(g)
    opt.step(stream=stream)
    assert opt.read_state()[2] == 2 and opt.skip.to_numpy()[0] == 0
    assert params.buffer.to_numpy().tobytes() != after[0].tobytes()


def test_hundred_adamw_steps_match_torch(device, stream, rng):
    torch = pytest.importorskip("torch")
    layout = make_layout([17, 100, 3])
    theta0 = layout.init_numpy(int(rng.integers(1 << 30)))
    params, grads = FlatBuffer(layout, theta0), FlatBuffer(layout)
    lr, wd, b1, b2, eps = 3e-3, 5e-2, 0.85, 0.995, 1e-7
    opt = AdamW(params, grads, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, max_norm=1e30)
    ref = torch.tensor(theta0.astype(np.float64), requires_grad=True)
    ref_opt = torch.optim.AdamW([ref], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    mask = np.zeros(layout.size, bool)
    for s in layout.slots:
        mask[s.offset: s.offset + s.size] = True
    for _ in range(100):
        g = np.where(mask, rng.standard_normal(layout.size) * rng.uniform(0.1, 3), 0).astype(np.float32)
        grads.buffer.copy_from_numpy(g)
        opt.step(stream=stream)
        ref.grad = torch.from_numpy(g.astype(np.float64))
        ref_opt.step()
    assert rel(params.buffer.to_numpy(), ref.detach().numpy()) < 1e-5
