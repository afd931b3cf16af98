"""Parameter layout and the engine's numpy references (CPU)."""
import re
import numpy as np
import pytest

from drvtrain.nn.layout import ParamLayout
from nn_reference import adamw, clip_scale, f32_round, forward_scales, mlp_backward, mlp_forward, mse, rel, scaled_rel

SMALL = [(256, 4), (256, 256), (3, 256)]


def test_views_start_on_256_byte_boundaries_and_do_not_overlap():
    layout = ParamLayout([(7, 129), (1000, 7), (4, 1000)])
    spans = sorted((s.offset, s.offset + s.size) for s in layout.slots)
    assert all(s.offset % 64 == 0 for s in layout.slots)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))
    assert layout.size % 64 == 0 and layout.size >= spans[-1][1]
    assert layout.parameter_count == 7 * 129 + 7 + 1000 * 7 + 1000 + 4 * 1000 + 4
    assert layout.weight(1).shape == (1000, 7) and layout.bias(2).shape == (4,)


def test_layout_refuses_inconsistent_layers():
    with pytest.raises(ValueError, match="outputs 256 but the next layer takes 128"):
        ParamLayout([(256, 4), (3, 128)])
    with pytest.raises(ValueError, match="positive"):
        ParamLayout([(0, 4)])


def test_init_follows_torch_linear_bounds_and_is_reproducible():
    layout = ParamLayout(SMALL)
    a, b, c = layout.init_numpy(1), layout.init_numpy(1), layout.init_numpy(2)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    named = layout.unflatten(a)
    for k, (o, i) in enumerate(layout.layers):
        for name in (f"layer{k}.weight", f"layer{k}.bias"):
            assert np.abs(named[name]).max() <= 1 / np.sqrt(i)
        assert np.abs(named[f"layer{k}.weight"]).max() > 0.9 / np.sqrt(i)  # fills the range
    padding = np.ones(layout.size, bool)
    for s in layout.slots:
        padding[s.offset: s.offset + s.size] = False
    assert np.all(a[padding] == 0)


def test_save_load_round_trip_and_mismatch(tmp_path):
    layout = ParamLayout(SMALL)
    flat = layout.init_numpy(3)
    layout.save(tmp_path / "p.npz", flat)
    assert np.array_equal(layout.load(tmp_path / "p.npz"), flat)
    other = ParamLayout([(256, 4), (256, 256), (5, 256)])
    with pytest.raises(ValueError, match=r"layer2.weight has shape \(3, 256\), the layout needs \(5, 256\)"):
        other.load(tmp_path / "p.npz")
    deeper = ParamLayout(SMALL + [(2, 3)])
    with pytest.raises(ValueError, match="missing"):
        deeper.load(tmp_path / "p.npz")


def test_backward_reference_matches_finite_differences(rng):
    layout = ParamLayout([(5, 3), (4, 5), (2, 4)])
    named = layout.unflatten(layout.init_numpy(int(rng.integers(1 << 30))))
    x = rng.standard_normal((6, 3))
    target = rng.standard_normal((6, 2))

    def loss_of(params):
        return mse(mlp_forward(params, x, 3)[-1], target)[0]

    acts = mlp_forward(named, x, 3)
    _, dout = mse(acts[-1], target)
    grads = mlp_backward(named, acts, dout)
    h = 1e-6
    for name in ("layer0.weight", "layer1.bias", "layer2.weight"):
        p = {k: v.astype(np.float64) for k, v in named.items()}
        idx = tuple(rng.integers(0, s) for s in p[name].shape)
        p[name][idx] += h
        up = loss_of(p)
        p[name][idx] -= 2 * h
        down = loss_of(p)
        assert abs((up - down) / (2 * h) - grads[name][idx]) < 1e-6


def test_backward_reference_follows_given_relu_masks(rng):
    """masks equal to acts > 0 change nothing; flipping one hidden unit of one row moves
    only that row's share of the gradients that unit feeds."""
    layout = ParamLayout([(5, 3), (4, 5), (2, 4)])
    # A net this small can draw every second-layer unit dead on every row; then no gradient
    # reaches the first layer and no flip could show: draw again (a few times at most).
    for _ in range(20):
        named = layout.unflatten(layout.init_numpy(int(rng.integers(1 << 30))))
        x = rng.standard_normal((6, 3))
        acts = mlp_forward(named, x, 3)
        dout = rng.standard_normal((6, 2))
        masks = [acts[1] > 0, acts[2] > 0]
        upstream = ((dout @ named["layer2.weight"]) * masks[1]) @ named["layer1.weight"]
        if np.any(upstream != 0):
            break
    plain, same = mlp_backward(named, acts, dout), mlp_backward(named, acts, dout, masks)
    for name in plain:
        np.testing.assert_array_equal(plain[name], same[name])
    # Flip the first layer's unit with the largest gradient flowing into it (a row whose
    # second-layer units are all dead would pass nothing, and the flip would change nothing).
    row, unit = np.unravel_index(np.argmax(np.abs(upstream)), upstream.shape)
    assert upstream[row, unit] != 0
    flipped = [masks[0].copy(), masks[1]]
    flipped[0][row, unit] = not flipped[0][row, unit]
    moved = mlp_backward(named, acts, dout, flipped)
    for name in ("layer1.weight", "layer1.bias", "layer2.weight", "layer2.bias"):
        np.testing.assert_array_equal(plain[name], moved[name])
    changed = np.argwhere(plain["layer0.weight"] != moved["layer0.weight"])
    assert changed.size and np.all(changed[:, 0] == unit)  # the flipped unit's weight row only
    assert plain["layer0.bias"][unit] != moved["layer0.bias"][unit]


def test_clip_and_adamw_references(rng):
    g = rng.standard_normal(1000)
    norm, scale = clip_scale(g, max_norm=1.0)
    assert np.isclose(norm, np.linalg.norm(g)) and np.isclose(norm * scale, norm / (norm + 1e-6))
    assert clip_scale(g * 1e-3, max_norm=10.0)[1] == 1.0
    theta, m, v = rng.standard_normal(4), np.zeros(4), np.zeros(4)
    g = rng.standard_normal(4)
    new, m1, v1 = adamw(theta, m, v, g, 1, lr=0.1, b1=0.9, b2=0.999, eps=0.0, wd=0.0)
    np.testing.assert_allclose(new, theta - 0.1 * np.sign(g), rtol=1e-12)  # first step is sign-like
    bump = rng.uniform(-1, 1, theta.size)
    assert np.isclose(rel(theta + 1e-3 * bump, theta), 1e-3 * np.linalg.norm(bump) / np.linalg.norm(theta))
    assert rel(np.array([np.nan, 1.0]), np.array([1.0, 1.0])) == float("inf")


def test_forward_scales_and_the_error_against_them(rng):
    """forward_scales is |W| |a| + |b| per layer, written out element by element here; it
    bounds every output; with nothing cancelling it is the output itself, so scaled_rel is
    rel; where the terms cancel it stays the summands' size while rel grows."""
    named = {"layer0.weight": rng.standard_normal((5, 3)), "layer0.bias": rng.standard_normal(5),
             "layer1.weight": rng.standard_normal((2, 5)), "layer1.bias": rng.standard_normal(2)}
    x = rng.standard_normal((4, 3))
    acts = mlp_forward(named, x, 2)
    scales = forward_scales(named, acts)
    for k, (w, b) in enumerate([(named["layer0.weight"], named["layer0.bias"]),
                                (named["layer1.weight"], named["layer1.bias"])]):
        want = np.array([[sum(abs(w[i, j]) * abs(acts[k][r, j]) for j in range(w.shape[1])) + abs(b[i])
                          for i in range(w.shape[0])] for r in range(4)])
        np.testing.assert_allclose(scales[k], want, rtol=1e-12)
        assert np.all(np.abs(acts[k + 1]) <= scales[k] * (1 + 1e-12))
    positive = {"layer0.weight": np.abs(named["layer0.weight"]), "layer0.bias": np.abs(named["layer0.bias"])}
    a = mlp_forward(positive, np.abs(x), 1)
    got = a[1] * (1 + 1e-3 * rng.uniform(-1, 1, a[1].shape))
    assert np.isclose(scaled_rel(got, a[1], forward_scales(positive, a)[0]), rel(got, a[1]), rtol=1e-12)
    cancel = {"layer0.weight": np.array([[1.0, -1.0]]), "layer0.bias": np.zeros(1)}
    c = mlp_forward(cancel, np.array([[1.0, 1.0 - 1e-6]]), 1)
    err = np.array([[c[1][0, 0] + 1e-9]])
    assert rel(err, c[1]) > 1e-4 and scaled_rel(err, c[1], forward_scales(cancel, c)[0]) < 1e-8
    assert scaled_rel(np.array([np.nan]), np.array([1.0]), np.array([1.0])) == float("inf")


def test_f32_round_rounds_once_and_to_even(rng):
    """The exact float32 rounding the AdamW bit test relies on: numpy's float32
    product is correctly rounded, so the two must agree on every product; and a
    tie between two float32 goes to the even one, where rounding through float64
    first can go wrong."""
    from fractions import Fraction
    a = rng.standard_normal(2000).astype(np.float32)
    b = rng.standard_normal(2000).astype(np.float32)
    got = np.array([f32_round(Fraction(float(x)) * Fraction(float(y))) for x, y in zip(a, b)], np.float32)
    assert got.tobytes() == (a * b).tobytes()
    one_ulp = Fraction(1, 2 ** 23)
    assert f32_round(1 + one_ulp / 2) == np.float32(1)  # tie: to the even 1.0
    assert f32_round(1 + 3 * one_ulp / 2) == np.float32(1 + 2 * 2.0 ** -23)  # tie: to the even neighbour
    # Just above a tie, where float64 rounds to the tie and then float32 would go to even.
    above = 1 + one_ulp / 2 + Fraction(1, 2 ** 60)
    assert np.float32(float(above)) == np.float32(1) and f32_round(above) == np.nextafter(np.float32(1), 2)


def test_from_widths_matches_the_out_in_list(rng):
    widths = [int(w) for w in rng.integers(1, 300, size=int(rng.integers(2, 6)))]
    layout = ParamLayout.from_widths(widths)
    assert layout == ParamLayout([(o, i) for i, o in zip(widths, widths[1:])])
    assert layout.widths == widths
    with pytest.raises(ValueError, match="input and an output"):
        ParamLayout.from_widths([4])


# ---------------------------------------------------------------- the GEMM chooser (drvtrain.nn.mlp)
from types import SimpleNamespace

from drvtrain.memory import DeviceBuffer
from drvtrain.nn import mlp as mlp_module
from drvtrain.nn.mlp import FFMA_TILE, TILES, WGMMA_TILE, kernel_name, plan, split_count


@pytest.mark.parametrize("tile", TILES + (FFMA_TILE,), ids=lambda t: t.name)
def test_splits_never_leave_a_block_empty(rng, tile):
    for _ in range(3000):
        m, n = (int(v) for v in rng.integers(1, 3000, size=2))
        k = int(rng.integers(1, 5000))
        sm = int(rng.choice([1, 16, 108, 132, 144]))
        s = split_count(m, n, k, sm, tile)
        assert 1 <= s <= tile.max_splits
        k_tiles = -(-k // tile.bk)
        per = -(-k_tiles // s)
        for z in range(s):  # the kernels' k range: whole tiles, per of them each
            begin, end = min(k, z * per * tile.bk), min(k, (z + 1) * per * tile.bk)
            assert begin < end, (m, n, k, sm, s)
        assert s * per * tile.bk >= k


def test_plans_pick_the_big_tile_for_the_wide_layers_and_cover_the_sms():
    for precision in ("tf32", "3xtf32"):
        big = plan(512, 1024, 1024, 132, precision=precision)
        # 128 tiles, four splits: about four blocks per SM, the most that fit.
        assert (big.tile.name, big.splits) == ("64x64", 4)
        assert big.workspace_floats == 8 * 16 * 4 * 64 * 64 and big.counters == 8 * 16
    dw = plan(1024, 1024, 512, 132, precision="3xtf32", sums=True)
    assert (dw.tile.name, dw.splits) == ("64x64", 2)
    assert dw.workspace_floats == 16 * 16 * 2 * 64 * 64 + 16 * 2 * 64
    # 32 tiles of 64x64, split four ways, fill the SMs too.
    assert (lambda p: (p.tile.name, p.splits))(plan(1024, 128, 512, 132, precision="3xtf32")) == ("64x64", 4)
    # K = 128 is four k tiles, one split: the 128 tiles alone nearly fill the SMs.
    assert (lambda p: (p.tile.name, p.splits))(plan(512, 1024, 128, 132, precision="tf32")) == ("64x64", 1)
    for m, n, k in [(256, 256, 256), (256, 3, 256), (512, 19, 1024), (19, 1024, 512)]:
        p = plan(m, n, k, 132, precision="3xtf32", sums=True)
        assert p.tile.name == "32x32" and p.splits > 1
        rows, cols = -(-m // 32), -(-n // 32)
        assert p.workspace_floats == rows * cols * p.splits * 32 * 32 + rows * p.splits * 32
    assert plan(256, 256, 4, 132, precision="tf32").splits == 1  # one k tile
    assert plan(256, 256, 256, 132, precision="f32").tile is FFMA_TILE


class _FakeArena:
    """Arena's bookkeeping (256-byte aligned bump pointers) over fake addresses."""

    def __init__(self):
        self.offset = self.zeroed_offset = 0

    def _take(self, attr, base, shape, dtype):
        shape = tuple(shape) if isinstance(shape, tuple) else (int(shape),)
        nbytes = max(1, int(np.prod(shape))) * np.dtype(dtype).itemsize
        start = -(-getattr(self, attr) // 256) * 256
        setattr(self, attr, start + nbytes)
        return DeviceBuffer._view(None, base + start, shape, dtype)

    def array(self, shape, dtype=np.float32):
        return self._take("offset", 1 << 40, shape, dtype)

    def zeroed(self, shape, dtype=np.uint32):
        return self._take("zeroed_offset", 1 << 41, shape, dtype)


class _FakeFlat:
    def __init__(self, layout, base):
        self.layout, self.base = layout, base

    def _view(self, slot):
        return DeviceBuffer._view(None, self.base + 4 * slot.offset, slot.shape, np.float32)

    def weight(self, k):
        return self._view(self.layout.weight(k))

    def bias(self, k):
        return self._view(self.layout.bias(k))


class _FakeEvent:
    def __init__(self, launches):
        self.launches = launches

    def record(self, stream):
        self.launches.append(("record", stream, self))
        return self


def _tile_of(name: str):
    """(BM, BN) of a gemm.cu tensor-core kernel, from its name."""
    return tuple(int(v) for v in re.search(r"_(\d+)x(\d+)_cp", name).groups())


class _FakeStream:
    """Logs the events it is made to wait for."""

    def __init__(self, launches, name):
        self.launches, self.name = launches, name

    def wait(self, event):
        self.launches.append(("wait", self, event))

    def __repr__(self):
        return f"<stream {self.name}>"


def _fake_kernels(monkeypatch, launches, cc=(8, 0)):
    monkeypatch.setattr(mlp_module, "get_device", lambda: SimpleNamespace(sm_count=132, compute_capability=cc))
    monkeypatch.setattr(mlp_module, "fork", lambda parent, *children: launches.append(("fork", children)))
    monkeypatch.setattr(mlp_module, "join", lambda parent, *children: launches.append(("join", children)))

    def load(name):
        def launch(grid, block, *args, stream, shared_mem, cluster=None, cluster_policy=None):
            # gemm.cu's clusters ask for the load-balancing placement; the wgmma kernels' the default.
            assert cluster_policy == ("load_balancing" if cluster and "_wgmma_" not in name else None), name
            # gemm.cu runs its clusters on `_cluster_` kernels, and those run every product
            # of S <= 4 on the 32x32 tile where clusters are on (compute capability 9.0),
            # and the output layer's dX with its dW folded in (the 64x64 tile's `_dwl_`).
            if "_wgmma_" not in name:
                assert cluster is None or "_cluster_" in name, name
                assert ("_cluster_" in name) == (cc >= (9, 0) and ("_32x32_" in name and grid[2] <= 4
                                                                   or "_dwl_64x64_" in name)), name
            launches.append((name, grid, args, stream, shared_mem, cluster))
        # A stand-in for the occupancy query: 8 GPCs of 16 SMs, one wgmma block per SM (64
        # clusters of 2, 32 of 4, 16 of 8), 4 of the 64x64 tile's, 8 of the 32x32 tile's with
        # 16-byte copies but 6 with 4-byte copies: the plan (and the scratch) must not depend
        # on which runs.
        per_sm = (8 if "_cp16_" in name else 6) if "_32x32_" in name else 4 if "_64x64_" in name else 1
        return SimpleNamespace(block=256, launch=launch,
                               max_active_clusters=lambda c, b, shared: 8 * (16 * per_sm // (c[0] * c[1] * c[2])))

    monkeypatch.setattr(mlp_module, "_load_kernel", load)
    monkeypatch.setattr(mlp_module, "Event", lambda: _FakeEvent(launches))
    # The wgmma forward's tensor maps, as what they describe: (address, (rows, cols), ld, box).
    monkeypatch.setattr(mlp_module, "tensor_map_2d", lambda span, box, *, shape, ld: SimpleNamespace(
        raw=(span.ptr, shape, ld, box, span.nbytes)))
    monkeypatch.setattr(mlp_module, "_operand_maps", {})


def test_last_dw_plans_only_an_unsplit_64x64_dx_of_at_most_32_outputs_and_8_row_tiles(monkeypatch):
    """LinearKernels.plan_last_dw and launch_last_dw: the output layer's dX with its dW
    and db folded in runs where its own plan is the 64x64 tile unsplit, with at most 32
    outputs (one k tile) and 8 row tiles (one cluster of them), never without clusters
    (compute capability 8.0) nor in FP32 FFMA; its launch is one cluster per column of
    row tiles, its dW and db after the gate, no scratch. The kernel's names, and the
    launches the helpers refuse."""
    assert kernel_name("grad_input_dwl", "3xtf32", TILES[0], 4, cluster=True) == \
        "linear_grad_input_dwl_64x64_cp4_cluster_3xtf32"
    for bad in (dict(tile=TILES[1], vector=16, cluster=True), dict(tile=TILES[0], vector=16, cluster=False),
                dict(tile=TILES[0], vector=16, cluster=True, settled=True)):
        with pytest.raises(ValueError):
            kernel_name("grad_input_dwl", "3xtf32", **bad)
    with pytest.raises(ValueError):
        kernel_name("grad_input_dwl", "f32", TILES[0], 16, cluster=True)
    launches = []
    _fake_kernels(monkeypatch, launches, (9, 0))
    bk = mlp_module.MLP(ParamLayout.from_widths([128, 1024, 1024, 19])).backward_kernels
    p = bk.plan_last_dw(512, 1024, 19)
    assert (p.tile.name, p.splits, p.cluster, p.workspace_floats, p.counters) == ("64x64", 1, True, 0, 0)
    assert bk.plan_last_dw(512, 1024, 32) is not None and bk.plan_last_dw(300, 1400, 1) is not None
    assert bk.plan_last_dw(512, 1024, 33) is None  # two k tiles
    assert bk.plan_last_dw(513, 1024, 19) is None  # 9 row tiles
    assert bk.plan_last_dw(256, 256, 3) is None  # its own plan: the 32x32 tile
    assert bk.plan_last_dw(512, 4096, 20) is None  # its own plan: the wgmma tile (32 x 4 blocks)
    buf = lambda address, shape: DeviceBuffer._view(None, address, shape, np.float32)
    dy, w = buf(1 << 36, (450, 19)), buf(1 << 37, (19, 1000))
    dx, h = buf(1 << 38, (450, 1000)), buf(1 << 39, (450, 1000))
    dw, db = buf(1 << 40, (19, 1000)), buf(1 << 41, (19,))
    bk.launch_last_dw(dy, 19, w, 1000, dx, 1000, 450, 1000, 19, mask=h, ldm=1000, dw=dw, lddw=1000, db=db,
                      stream=None)
    name, grid, args, stream, shared_mem, cluster = launches[-1]
    assert (name, grid, cluster, shared_mem) == ("linear_grad_input_dwl_64x64_cp4_cluster_3xtf32", (16, 8, 1),
                                                 (1, 8, 1), 0)
    assert args[:13] == (dy, 19, w, 1000, dx, 1000, 450, 1000, 19, 0, h, 1000, 0)
    assert args[13:] == (0, 0, 0, dw, 1000, db)  # workspace, counters, gate; then dW, its rows' stride, db
    with pytest.raises(ValueError):
        bk.launch_last_dw(dy, 19, w, 1000, dx, 1000, 513, 1000, 19, mask=h, ldm=1000, dw=dw, lddw=1000, db=db,
                          stream=None)
    kernel = bk.last_dw[4]
    with pytest.raises(ValueError):  # the kernel needs its dW and db
        mlp_module.gemm(kernel, dy, 19, w, 1000, dx, 1000, 450, 1000, 19, None, mask=h, ldm=1000)
    for m, k, splits in ((450, 33, 1), (513, 19, 1), (450, 19, 2)):  # two k tiles, 9 row tiles, a split
        with pytest.raises(ValueError, match="last_dw is"):
            mlp_module.gemm(kernel, dy, 19, w, 1000, dx, 1000, m, 1000, k, None, mask=h, ldm=1000, splits=splits,
                            last_dw=(dw, 1000, db))
    with pytest.raises(ValueError):  # dW's rows closer than its width
        mlp_module.gemm(kernel, dy, 19, w, 1000, dx, 1000, 450, 1000, 19, None, mask=h, ldm=1000,
                        last_dw=(dw, 999, db))
    with pytest.raises(ValueError):  # only the dwl kernels take them
        mlp_module.gemm(bk.kernels[("grad_input", TILES[0], 4)], dy, 19, w, 1000, dx, 1000, 450, 1000, 19, None,
                        mask=h, ldm=1000, last_dw=(dw, 1000, db))
    assert len(launches) == 1
    # A caller's dx_last: no fold; the output layer's dW runs as a product of its own, on a
    # weight stream, within the scratch the accounting reserved for the folded backward.
    layout = ParamLayout.from_widths([128, 1024, 1024, 19])
    model = mlp_module.MLP(layout)
    assert model.last_dw_folded(512)
    arena = _FakeArena()
    params, grads = _FakeFlat(layout, 1 << 38), _FakeFlat(layout, 1 << 39)
    main, side = _FakeStream(launches, "main"), _FakeStream(launches, "side")
    fwd = model.forward(params, buf(1 << 37, (512, 128)), arena=arena, stream=main)
    start = len(launches)
    model.backward(params, grads, fwd, buf(1 << 36, (512, 19)), arena=arena, stream=main, weight_stream=side,
                   dx_last=buf(1 << 35, (512, 1024)))
    ran = [e for e in launches[start:] if e[0].startswith("linear_")]
    assert not any("_dwl_" in e[0] for e in ran)
    out_dw = [e for e in ran if "grad_weight" in e[0] and e[2][4].ptr == grads.weight(2).ptr]
    assert len(out_dw) == 1 and out_dw[0][3] is side
    assert -(-arena.offset // 256) * 256 + 1024 <= model.scratch_bytes(512)
    assert -(-arena.zeroed_offset // 256) * 256 <= model.zeroed_bytes(512)
    # last_dw_done (the DQN step's loss kernel wrote dX, dW and db): neither output-layer
    # product runs, nothing reads or writes its dW, and the chain starts from dx_last.
    start = len(launches)
    dx_last = buf(1 << 35, (512, 1024))
    model.backward(params, grads, fwd, buf(1 << 36, (512, 19)), arena=arena, stream=main, weight_stream=side,
                   dx_last=dx_last, last_dw_done=True)
    ran = [e for e in launches[start:] if e[0].startswith("linear_")]
    assert not any("_dwl_" in e[0] for e in ran)
    assert not any(a.ptr in (grads.weight(2).ptr, grads.bias(2).ptr) for e in ran for a in e[2] if hasattr(a, "ptr"))
    assert sorted(e[0].split("_")[2] for e in ran) == ["input", "weight", "weight"], [e[0] for e in ran]
    wide_dx = [e for e in ran if e[0].startswith("linear_grad_input_")]
    assert wide_dx[0][2][0].ptr == dx_last.ptr  # the wide dX reads the caller's dX
    with pytest.raises(ValueError, match="dx_last"):
        model.backward(params, grads, fwd, buf(1 << 36, (512, 19)), arena=arena, stream=main, last_dw_done=True)
    # No cluster of the row tiles fits: no fold.
    for kern in bk.last_dw.values():
        monkeypatch.setattr(kern, "kernel", SimpleNamespace(block=128, max_active_clusters=lambda c, b, s: 0))
    assert bk.plan_last_dw(512, 1024, 19) is None
    for cc, backward in (((8, 0), "3xtf32"), ((9, 0), "f32")):
        launches.clear()
        _fake_kernels(monkeypatch, launches, cc)
        model = mlp_module.MLP(ParamLayout.from_widths([128, 1024, 1024, 19]), backward=backward)
        assert model.backward_kernels.plan_last_dw(512, 1024, 19) is None and not model.last_dw_folded(512)


def test_head_plans_a_cluster_where_its_row_tiles_fit_else_the_workspace(monkeypatch):
    """LinearKernels.plan_head: a row tile's 2 to 8 column tiles as one cluster where
    every row tile's cluster fits at once (no scratch), else the shares through the
    workspace (12 floats a thread of every block, a counter a row tile); ``cluster``
    forces either, and a forced cluster that cannot run does not plan. Never split,
    never off the wgmma tile, never over 24 outputs or more than 8 column tiles in a cluster."""
    launches = []
    _fake_kernels(monkeypatch, launches, (9, 0))
    fk = mlp_module.MLP(ParamLayout.from_widths([128, 1024, 1024, 19])).forward_kernels
    p = fk.plan_head(512, 1024, 1024, 19, sms=44)  # 8 x 4 tiles; 16 clusters of 8 fit
    assert (p.tile.name, p.splits, p.cluster, p.workspace_floats, p.counters) == ("wgmma", 1, True, 0, 0)
    p = fk.plan_head(512, 1024, 1024, 19, sms=44, cluster=False)
    assert (p.cluster, p.workspace_floats, p.counters) == (False, 8 * 4 * 256 * 12, 4)
    assert fk.plan_head(512, 1024, 1024, 25, sms=44) is None  # more than 24 outputs
    assert fk.plan_head(512, 1024, 1024, 19) is None  # the whole device's plan splits k
    assert fk.plan_head(512, 1152, 1024, 19, sms=44, cluster=True) is None  # 9 column tiles
    p = fk.plan_head(512, 1152, 1024, 19, sms=44)
    assert p is not None and not p.cluster and p.counters == 4
    arena = _FakeArena()  # the workspace path's launch: its scratch from the arena, no cluster
    buf = lambda address, shape: DeviceBuffer._view(None, address, shape, np.float32)
    fk.launch_head(buf(1 << 36, (512, 1024)), 1024, buf(1 << 37, (1024, 1024)), 1024, buf(1 << 38, (512, 1024)), 1024,
                   512, 1024, 1024, bias=buf(1 << 39, (1024,)), w2=buf(1 << 40, (19, 1024)), ldw2=1024,
                   b2=buf(1 << 41, (19,)), q=buf(1 << 42, (512, 19)), ldq=19, n_out=19, arena=arena, stream=None,
                   sms=44, cluster=False)
    name, grid, args, _, shared_mem, cluster = launches[-1]
    assert (name, grid, cluster) == ("linear_forward_relu_head_wgmma_tf32", (8, 4, 1), None)
    work, counters = args[-2:]
    assert work.size == 8 * 4 * 256 * 12 and counters.size == 4 and counters.dtype == np.uint32
    assert (arena.offset, arena.zeroed_offset) == (4 * work.size, 4 * counters.size)
    monkeypatch.setattr(fk, "head", SimpleNamespace(block=256, max_active_clusters=lambda c, b, shared: 3))
    p = fk.plan_head(512, 1024, 1024, 19, sms=44)  # 4 row tiles, 3 clusters at once: the workspace
    assert (p.cluster, p.counters) == (False, 4)
    assert fk.plan_head(512, 1024, 1024, 19, sms=44, cluster=True) is None


def test_forward_without_hidden_outputs_launches_the_head_kernel_with_no_h(monkeypatch):
    """MLP.forward(store_hidden=False): where the head kernel computes Q (the large net on a
    third of the SMs, compute capability 9.0) it is launched with no H (C = 0) and that
    slot of .activations is None, the output still Q; backward refuses such a Forward.
    Where the output layer runs apart (the whole device's plan), every output is stored.
    A non-bool is refused."""
    launches = []
    _fake_kernels(monkeypatch, launches, (9, 0))
    layout = ParamLayout.from_widths([128, 1024, 1024, 19])
    model = mlp_module.MLP(layout)
    buf = lambda address, shape: DeviceBuffer._view(None, address, shape, np.float32)
    params, grads, main = _FakeFlat(layout, 1 << 38), _FakeFlat(layout, 1 << 39), _FakeStream(launches, "main")
    x = buf(1 << 37, (512, 128))
    kept = model.forward(params, x, arena=_FakeArena(), stream=main, sms=44)
    start = len(launches)
    fwd = model.forward(params, x, arena=_FakeArena(), stream=main, sms=44, store_hidden=False)
    heads = [e for e in launches if "_head_" in e[0]]
    assert len(heads) == 2 and heads[0][2][2].ptr == kept.activations[2].ptr and heads[1][2][2] == 0
    assert [e[0] for e in launches[start:]] == [e[0] for e in launches[:start]]  # the same launches otherwise
    assert fwd.activations[2] is None and fwd.activations[1] is not None
    assert heads[1][2][0][0] == fwd.activations[1].ptr  # X: the first hidden output
    assert fwd.output.shape == (512, 19) and heads[1][2][14].ptr == fwd.output.ptr  # Q
    with pytest.raises(ValueError, match="store_hidden"):
        model.backward(params, grads, fwd, buf(1 << 36, (512, 19)), arena=_FakeArena(), stream=main)
    whole = model.forward(params, x, arena=_FakeArena(), stream=main, store_hidden=False)
    assert not model.head_folded(512) and all(a is not None for a in whole.activations)
    with pytest.raises(TypeError, match="store_hidden"):
        model.forward(params, x, arena=_FakeArena(), stream=main, sms=44, store_hidden=0)


@pytest.mark.parametrize("settled", [False, True], ids=["unsettled", "settled"])
@pytest.mark.parametrize("sms", [None, 44], ids=["whole-device", "third"])
@pytest.mark.parametrize("presplit", [True, False], ids=["presplit", "no-presplit"])
@pytest.mark.parametrize("cc", [(8, 0), (9, 0)], ids=["sm80", "sm90-wgmma"])
@pytest.mark.parametrize("tf32, backward", [(True, "3xtf32"), (False, "f32"), (False, "3xtf32")])
@pytest.mark.parametrize("widths, batch", [([4, 256, 256, 3], 256), ([128, 1024, 1024, 19], 512),
                                           ([129, 1000, 4], 7), ([33, 65, 7], 1000), ([258, 64, 5], 16384)])
def test_scratch_and_zeroed_bytes_are_what_the_launches_take(monkeypatch, widths, batch, tf32, backward, cc,
                                                             presplit, sms, settled):
    """Exactly, unless a product runs on the wgmma tile: then the accounting leaves
    room for gemm.cu's fallback too (an operand that turns out misaligned). Every
    launch's arguments, stream and workspace, the pre-split products' split passes
    included; with a forward planned for a third of the SMs (``sms``) too. With
    ``weights_settled``, gemm.cu's tensor-core forward and dX products (B: a weight)
    run their `_settled_` kernels, the dW products (B: an activation) never do; the
    forward's products after its first run them either way."""
    launches = []
    _fake_kernels(monkeypatch, launches, cc)
    layout = ParamLayout.from_widths(widths)
    model = mlp_module.MLP(layout, tf32=tf32, backward=backward, presplit=presplit)
    arena = _FakeArena()
    params, grads = _FakeFlat(layout, 1 << 38), _FakeFlat(layout, 1 << 39)
    x = DeviceBuffer._view(None, 1 << 37, (batch, widths[0]), np.float32)
    dout = DeviceBuffer._view(None, 1 << 36, (batch, widths[-1]), np.float32)
    main, side = _FakeStream(launches, "main"), _FakeStream(launches, "side")
    fwd = model.forward(params, x, arena=arena, stream=main, sms=sms, weights_settled=settled)
    model.backward(params, grads, fwd, dout, arena=arena, stream=main, weight_stream=side, weights_settled=settled)
    rounded = lambda nbytes: -(-nbytes // 256) * 256
    kernels = [entry for entry in launches if entry[0] not in ("fork", "join", "record", "wait")]
    splits_run = [entry for entry in kernels if entry[0] == "tf32_split"]
    kernels = [entry for entry in kernels if entry[0] != "tf32_split"]
    on_wgmma = [entry[0] for entry in kernels if "_wgmma_" in entry[0]]
    if cc != (9, 0):
        assert not on_wgmma
    for name in on_wgmma:  # the TF32 forward and the 3xTF32 backward have wgmma kernels, FFMA has none
        assert (tf32 if "_forward_" in name else backward == "3xtf32"), name
    wide = cc == (9, 0) and backward == "3xtf32" and widths[1] == 1024
    if wide:
        kind = "presplit_" if presplit else ""
        assert {f"linear_grad_input_wgmma_{kind}3xtf32", f"linear_grad_weight_wgmma_{kind}3xtf32"} <= set(on_wgmma)
        assert model.presplit_layers(batch) == ({1: (True, True)} if presplit else {})
    else:
        assert not splits_run and model.presplit_layers(batch) == {}
    if cc == (9, 0) and tf32 and widths[0] == 258 and sms is None:
        # 16384 x 64 x 258 plans wgmma unsplit, but rows of 258 floats forbid 16-byte
        # copies: it runs on gemm.cu's 2-way split, which the accounting made room for.
        assert model.forward_kernels.plan("forward_relu", batch, 64, 258).tile.name == "wgmma"
        name, grid = kernels[0][0], kernels[0][1]
        assert "_wgmma_" not in name and grid[2] == 2
    wgmma_planned = any(p.tile.name == "wgmma" for *_, p, _ in model._plans(batch, sms=sms))
    if wgmma_planned:
        assert rounded(arena.offset) + 1024 <= model.scratch_bytes(batch, sms=sms)
        assert rounded(arena.zeroed_offset) <= model.zeroed_bytes(batch, sms=sms)
    else:
        assert rounded(arena.offset) + 1024 == model.scratch_bytes(batch, sms=sms)
        assert rounded(arena.zeroed_offset) == model.zeroed_bytes(batch, sms=sms)
    assert len(kernels) == len(model._products(batch, sms=sms))
    if cc == (9, 0) and tf32 and widths[1] == 1024 and sms is not None:
        # A third of the SMs: each forward product takes fewer, longer blocks. The
        # 1024-wide layers run unsplit on the wgmma tile (32 blocks: two thirds of 44).
        # The second, with the output layer computed in its epilogue (MLP.head_folded).
        forwards = [e for e in kernels if "_forward" in e[0]]
        assert [(e[0], e[1]) for e in forwards] == [("linear_forward_relu_wgmma_tf32", (8, 4, 1)),
                                                    ("linear_forward_relu_head_wgmma_tf32", (8, 4, 1))]
    params_end = (1 << 38) + 4 * layout.size
    in_arena = lambda address, nbytes: (1 << 40) <= address and address + nbytes <= (1 << 40) + arena.offset
    splits_of = {}  # the address of a split's big part: (rows, k, ld), as the split pass wrote it
    for name, grid, args, stream, shared_mem, cluster in splits_run:
        src, ld, rows, cols, big, small, ld_a, big_t, small_t, ld_t, gate = args
        assert name == "tf32_split" and grid == (-(-cols // 32), -(-rows // 32)) and shared_mem == 0
        assert gate == 0 and cluster is None
        for b, sm, r, c, l in ((big, small, rows, cols, ld_a), (big_t, small_t, cols, rows, ld_t)):
            if b:
                assert l % 4 == 0 and c <= l < c + 4 and b.shape == sm.shape == (r, l)
                assert in_arena(b.ptr, b.nbytes) and in_arena(sm.ptr, sm.nbytes) and b.ptr != sm.ptr
                splits_of[b.ptr] = (r, c, l, src.ptr, sm.ptr)
            else:
                assert not sm and l == 0
        activations = [a.ptr for a in fwd.activations]
        if (1 << 38) <= src.ptr < params_end:  # a weight, transposed for dX: beside the chain
            assert stream is side and not big and big_t and (rows, cols) == (widths[2], widths[1])
        elif src.ptr in activations:  # a layer's input, transposed for dW: beside the chain
            assert stream is side and not big and big_t and (rows, cols) == (batch, widths[1])
        else:  # the layer's dY, both ways (dX and dW), on the chain
            assert stream is main and big and big_t and (rows, cols) == (batch, widths[2])
    first_forward = next(i for i, entry in enumerate(kernels) if "_forward" in entry[0])
    for i, ((name, grid, args, stream, shared_mem, cluster), (m, n, k)) in enumerate(
            zip(kernels, model._products(batch, sms=sms))):
        if "_head_" in name:  # the output layer's operands, its output and its shares' scratch after the gate
            w2, ldw2, b2, q, ldq, n_out, work, head_counters = args[11:]
            assert (w2.ptr, b2.ptr, ldw2) == (params.weight(len(layout.layers) - 1).ptr,
                                              params.bias(len(layout.layers) - 1).ptr, n)
            assert (q.ptr, ldq, n_out) == (fwd.output.ptr, widths[-1], widths[-1]) and q.shape == (m, widths[-1])
            assert args[2].ptr == fwd.activations[-2].ptr  # H: stored where the output layer's input goes
            assert args[7].ptr == params.bias(len(layout.layers) - 2).ptr and args[10] == 0  # b; no gate
            # The row tile's 8 column tiles as one cluster (4 needed, 16 of 8 fit): no scratch.
            assert cluster == (grid[0], 1, 1) and work == 0 and head_counters == 0
            assert grid[2] == 1 and shared_mem == 161 * 1024 + 24 * 128 * 4 + 512 + 128 * 24 * 4 and stream is main
            args = args[:11]
        if "_wgmma_" in name and "_forward" in name:  # X and W as tensor maps of 128 x 32 boxes over m x k, n x k
            map_a, map_b, _, _, *mnk, _, workspace, counters, _ = args
            col_sum = 0
            assert map_a[1:5] == ((m, k), k, (128, 32), 4 * m * k) and map_b[1:5] == ((n, k), k, (128, 32), 4 * n * k)
            assert (1 << 38) <= map_b[0] and map_b[0] + map_b[4] <= params_end  # W: a weight of the parameters
        elif "_presplit_" in name:  # A's and B's big and small parts as maps over m x k and n x k, K-major
            maps, mnk = args[:4], args[6:9]
            col_sum, workspace, counters = args[11], args[12], args[13]
            for mp, rows in zip(maps, (m, m, n, n)):
                assert mp[0] in splits_of or any(mp[0] == v[4] for v in splits_of.values()), name
                ld = mp[2]
                assert mp[1] == (rows, k) and mp[3] == (128, 32) and ld % 4 == 0 and k <= ld < k + 4
            big_a = splits_of[maps[0][0]]
            big_b = splits_of[maps[2][0]]
            assert big_a[4] == maps[1][0] and big_b[4] == maps[3][0]  # each big part with its own small part
            dy = big_a[3]
            if "grad_input" in name:  # A: dY as it lies; B: this layer's weight, transposed
                assert (1 << 38) <= big_b[3] < params_end
                assert args[9] is not None and args[10] == n  # the ReLU mask, [m, n]
            else:  # A: dY transposed; B: the layer's input X, transposed
                assert col_sum and col_sum.shape == (m,)
                assert not (1 << 38) <= big_b[3] < params_end
            assert not (1 << 38) <= dy < params_end
        else:
            mnk = args[6:9]
            workspace, counters, col_sum = args[13], args[14], args[12]
            b_is_weight = (1 << 38) <= args[2].ptr < params_end
            assert b_is_weight == ("grad_weight" not in name), name
        # gemm.cu's tensor-core products whose B is a weight run `_settled_` where the caller
        # said so, and the forward's products after its first always; the FFMA, wgmma and
        # dW products never do, nor the output layer's dX with its dW folded in (no such kernel).
        tensor_core = "_wgmma_" not in name and not name.endswith("_f32") and "_dwl_" not in name
        later_forward = "_forward" in name and i > first_forward
        assert ("_settled_" in name) == ((settled or later_forward) and tensor_core and "grad_weight" not in name), \
            name
        assert tuple(mnk) == (m, n, k)
        if "_presplit_" in name:
            want_shared = 193 * 1024
        elif "_head_" in name:
            want_shared = shared_mem  # checked above
        else:
            want_shared = (161 if "_forward_" in name else 129) * 1024 if "_wgmma_" in name else 0
        assert shared_mem == want_shared, name
        splits = grid[2]
        if "_dw0_" in name:  # layer 1's dX with layer 0's dW and db folded in: on the 32x32 tile's clusters
            assert cc >= (9, 0) and backward == "3xtf32" and widths[0] <= mlp_module.DW0_MAX_IN and len(widths) >= 4
            assert (m, n, k) == (batch, widths[1], widths[2]) and splits <= 4 and args[4] == 0  # C: not written
            x0, ldx0, in0, dw0, db0, work, strip_counters = args[16:]
            assert (x0.ptr, ldx0, in0) == (fwd.activations[0].ptr, widths[0], widths[0])
            assert (dw0.ptr, db0.ptr) == (grads.weight(0).ptr, grads.bias(0).ptr)
            assert work.size == grid[0] * grid[1] * 32 * (in0 + 1) and strip_counters.size == grid[0]
            assert args[10].ptr == fwd.activations[1].ptr  # the mask: layer 1's input
        if "_dwl_" in name:  # the output layer's dX with its dW and db: its row tiles as one cluster
            last = len(layout.layers) - 1
            assert cc >= (9, 0) and backward == "3xtf32" and widths[-1] <= mlp_module.LAST_DW_MAX_OUT
            assert (m, n, k) == (batch, widths[-2], widths[-1]) and splits == 1 and cluster == (1, grid[1], 1)
            assert grid[1] <= 8 and grid == (-(-n // 64), -(-m // 64), 1)
            dw, ldw, db = args[16:]
            assert (dw.ptr, ldw, db.ptr) == (grads.weight(last).ptr, widths[-2], grads.bias(last).ptr)
            assert (args[0].ptr, args[1]) == (dout.ptr, widths[-1])  # A: dY of the output layer
            assert (args[2].ptr, args[3]) == (params.weight(last).ptr, widths[-2])  # B: its weight
            assert args[10].ptr == fwd.activations[last].ptr and args[11] == widths[-2]  # the mask: its input
            assert args[4].shape == (batch, widths[-2]) and in_arena(args[4].ptr, args[4].nbytes)  # dX, stored
            assert stream is main
            args = args[:16]
        if "_x0_" in name:  # layers 0 and 1 in one launch: layer 0 computed in layer 1's product
            assert cc >= (9, 0) and tf32 and widths[0] <= mlp_module.DW0_MAX_IN and stream is main
            assert (m, n, k) == (batch, widths[2], widths[1]) and splits <= 4
            x0, ldx0, in0, w0, b0 = args[16:]
            assert (x0.ptr, ldx0, in0) == (x.ptr, widths[0], widths[0])
            assert (w0.ptr, b0.ptr) == (params.weight(0).ptr, params.bias(0).ptr)
            assert (args[0].ptr, args[1]) == (fwd.activations[1].ptr, widths[1])  # H0 is stored there
            assert (args[2].ptr, args[4].ptr, args[9].ptr) == (params.weight(1).ptr, fwd.activations[2].ptr,
                                                               params.bias(1).ptr)
        # dW of every layer but the first beside the dX chain; the first layer's dW
        # follows the last dX on the main stream (or rides on it, above).
        first_dw = "grad_weight" in name and (m, n) == (widths[1], widths[0])
        assert (stream is side) == ("grad_weight" in name and not first_dw), name
        # A tensor-core product whose clusters all fit at once (compute capability 9.0)
        # launches each tile's splits as one cluster that sums them in shared memory,
        # with no workspace.
        if cluster is not None and "_head_" not in name and "_dwl_" not in name:  # those: checked above
            assert cc >= (9, 0) and not name.endswith("_f32") and splits > 1 and cluster == (1, 1, splits), name
            bm, bn = (128, 128) if "_wgmma_" in name else _tile_of(name)
            per_sm = 6 if bm == 32 else 4 if bm == 64 else 1  # the 32x32 tile: its cp4 kernels' count
            assert grid[:2] == (-(-n // bn), -(-m // bm)) and grid[0] * grid[1] <= 8 * (16 * per_sm // splits)
        if "_presplit_" in name:  # every split within the kernel's bound of k tiles
            assert -(-(-(-k // 32)) // splits) <= mlp_module.PRESPLIT_MAX_TILES
        if splits == 1 or cluster is not None:
            assert workspace == 0 and counters == 0
            continue
        if name.endswith("_f32"):  # the kernel header's contract: S * (M * N + M)
            need = splits * (m * n + m)
            bm = bn = 64
        else:  # grid.x * grid.y * S * BM * BN (+ grid.y * S * BM with db)
            bm, bn = (128, 128) if "_wgmma_" in name else _tile_of(name)
            need = grid[0] * grid[1] * splits * bm * bn + (grid[1] * splits * bm if col_sum else 0)
        assert grid[:2] == (-(-n // bn), -(-m // bm))
        assert workspace.size == need, name
        assert counters.size == grid[0] * grid[1], name
    x0_folded = cc == (9, 0) and tf32 and widths[0] <= mlp_module.DW0_MAX_IN
    assert model.first_layer_folded(batch, sms=sms) == x0_folded
    unfolded = mlp_module.MLP(layout, tf32=tf32, backward=backward, presplit=presplit, fold_first_layer=False)
    assert not unfolded.first_layer_folded(batch, sms=sms)
    assert not any(role.endswith("_x0") for role, *_ in unfolded._roles(batch, sms=sms))
    assert sum("_x0_" in e[0] for e in kernels) == x0_folded
    head = cc == (9, 0) and tf32 and widths[1] == 1024 and sms is not None  # the wide hidden layer unsplit
    assert model.head_folded(batch, sms=sms) == head
    assert sum("_head_" in e[0] for e in kernels) == head
    unheaded = mlp_module.MLP(layout, tf32=tf32, backward=backward, presplit=presplit, fold_head=False)
    assert not unheaded.head_folded(batch, sms=sms)
    assert not any(role.endswith("_head") for role, *_ in unheaded._roles(batch, sms=sms))
    assert sum("_forward" in e[0] for e in kernels) == len(layout.layers) - x0_folded - head
    folded = cc == (9, 0) and backward == "3xtf32" and widths[0] <= mlp_module.DW0_MAX_IN and len(widths) >= 4
    assert model.first_dw_folded(batch) == folded
    assert sum("_dw0_" in e[0] for e in kernels) == folded
    last_folded = cc == (9, 0) and backward == "3xtf32" and widths[1] == 1024  # 512 x 1024 x 19 on 64x64
    assert model.last_dw_folded(batch) == last_folded
    assert sum("_dwl_" in e[0] for e in kernels) == last_folded
    unfolded_last = mlp_module.MLP(layout, tf32=tf32, backward=backward, presplit=presplit, fold_last_dw=False)
    assert not unfolded_last.last_dw_folded(batch)
    assert not any(role == "grad_input_dwl" for role, *_ in unfolded_last._roles(batch, sms=sms))
    assert sum("grad_weight" in e[0] for e in kernels) == len(layout.layers) - folded - last_folded
    pre = bool(model.presplit_layers(batch))
    assert [e[0] for e in launches].count("fork") == len(layout.layers) - 1 + pre - last_folded
    assert launches[-1][0] == "join"
    if pre:  # the weights' split is recorded on the side stream, and the chain waits for it before dX
        events = [i for i, e in enumerate(launches) if e[0] in ("record", "wait")]
        assert [launches[i][0] for i in events] == ["record", "wait"]
        assert launches[events[0]][1] is side and launches[events[1]][1] is main
        dx = next(i for i, e in enumerate(launches) if e[0] == "linear_grad_input_wgmma_presplit_3xtf32")
        assert events[1] < dx


def test_a_requested_split_count_never_leaves_a_split_empty():
    for want in range(1, 12):
        for k in (1, 31, 32, 33, 100, 512, 1024):
            s = split_count(512, 1024, k, 132, TILES[0], want)
            k_tiles = -(-k // 32)
            per = -(-k_tiles // s)
            assert 1 <= s <= min(want, k_tiles) and (s - 1) * per < k_tiles


def test_the_32x32_tile_sums_up_to_4_splits_in_a_cluster_when_every_cluster_fits():
    """gemm.cu's 32x32 tile keeps the split the rule gives and launches it as
    clusters (no workspace, no counters) when the device holds all of them at once
    and the split is at most its ``cluster_splits`` (4); else, on the 64x64 tile, or
    in FFMA, through the workspace as before."""
    from drvtrain.nn.mlp import TILE_32, TILE_64
    assert (TILE_32.cluster_splits, TILE_64.cluster_splits) == (4, 0)
    for precision, sums in (("tf32", False), ("3xtf32", False), ("3xtf32", True)):
        free = plan(256, 256, 256, 132, precision=precision, sums=sums)  # the small net's hidden layer
        assert (free.tile.name, free.splits, free.cluster) == ("32x32", 4, False) and free.workspace_floats > 0
        for room, clustered in ((64, True), (63, False)):  # 64 tiles of 32x32, clusters of 4
            p = plan(256, 256, 256, 132, precision=precision, sums=sums,
                     max_clusters=lambda tile, s: room if (tile.name, s) == ("32x32", 4) else 0)
            assert (p.tile, p.splits, p.cluster) == (free.tile, 4, clustered)
            assert (p.workspace_floats, p.counters) == ((0, 0) if clustered else (free.workspace_floats, 64))
        p = plan(256, 256, 256, 132, precision=precision, sums=sums, splits=3, max_clusters=lambda tile, s: 1 << 20)
        assert (p.splits, p.cluster, p.workspace_floats) == (3, True, 0)  # a forced split is kept, not lowered
        p = plan(512, 19, 8192, 132, precision=precision, sums=sums, tile=free.tile, splits=8,
                 max_clusters=lambda tile, s: 1 << 20)
        assert p.splits == 8 and not p.cluster and p.workspace_floats > 0
        p = plan(1024, 128, 512, 132, precision=precision, sums=sums, max_clusters=lambda tile, s: 1 << 20)
        assert (p.tile, p.splits, p.cluster) == (TILE_64, 4, False) and p.workspace_floats > 0
    p = plan(256, 256, 256, 132, precision="f32", max_clusters=lambda tile, s: 1 << 20)
    assert p.splits > 1 and not p.cluster and p.workspace_floats > 0


def test_the_wgmma_tile_is_chosen_for_the_wide_tensor_core_products_only():
    from drvtrain.nn.mlp import choose_tile
    for precision, sums in (("tf32", False), ("3xtf32", False), ("3xtf32", True)):
        wide = plan(512, 1024, 1024, 132, precision=precision, sums=sums, wgmma=True)
        # 32 tiles of 128x128, four splits: one block per SM, the most that fit.
        assert (wide.tile, wide.splits, wide.cluster) == (WGMMA_TILE, 4, False)
        assert wide.workspace_floats == 32 * 4 * 128 * 128 + (4 * 4 * 128 if sums else 0) and wide.counters == 32
        # With room for all 32 clusters of 4 at once, the splits meet in a cluster instead.
        for room, clustered in ((32, True), (31, False)):
            p = plan(512, 1024, 1024, 132, precision=precision, sums=sums, wgmma=True,
                     max_clusters=lambda tile, s: room if s == 4 else 0)
            assert p.cluster == clustered and (p.workspace_floats == 0) == clustered and p.splits == 4
        # The H200's counts: 30 clusters of 4 such blocks fit at once, 39 of 3. The rule
        # takes 3 splits in clusters; a forced 4 goes through the workspace.
        h200 = lambda tile, s: {2: 66, 3: 39, 4: 30, 8: 15}.get(s) if tile is WGMMA_TILE else 0
        p = plan(512, 1024, 1024, 132, precision=precision, sums=sums, wgmma=True, max_clusters=h200)
        assert (p.splits, p.cluster, p.workspace_floats, p.counters) == (3, True, 0, 0)
        p = plan(512, 1024, 1024, 132, precision=precision, sums=sums, wgmma=True, max_clusters=h200, splits=4)
        assert (p.splits, p.cluster) == (4, False) and p.workspace_floats > 0
        # A forced split above the portable cluster size goes through the workspace.
        p = plan(512, 1024, 1024, 132, precision=precision, sums=sums, tile=WGMMA_TILE, splits=12,
                 max_clusters=lambda tile, s: 1 << 20)
        assert p.splits > 8 and not p.cluster and p.workspace_floats > 0
    # The large net's dW: 64 tiles, two splits.
    assert plan(1024, 1024, 512, 132, precision="3xtf32", sums=True, wgmma=True).splits == 2
    # 24 tiles in four splits, 96 blocks: two thirds of 132 SMs, enough for the wgmma tile.
    assert choose_tile(384, 1024, 512, 132, "tf32", wgmma=True) is WGMMA_TILE
    assert choose_tile(384, 1024, 512, 132, "tf32", wgmma=False).name == "64x64"
    assert choose_tile(384, 1024, 512, 132, "3xtf32", wgmma=True).name == "64x64"  # the backward: three quarters
    # Planned for a third of the SMs (three forwards side by side): the large net's
    # forwards take the wgmma tile unsplit, 32 blocks, and the output layer's 4 tiles
    # in 8 clustered splits; on the whole device they plan as before (here with no
    # room for clusters of the 32x32 tile).
    h200 = lambda tile, s: {2: 66, 3: 39, 4: 30, 8: 15}.get(s) if tile is WGMMA_TILE else 0
    for m, n, k, share, want in [(512, 1024, 128, 44, ("wgmma", 1, False)), (512, 1024, 1024, 44, ("wgmma", 1, False)),
                                 (512, 19, 1024, 44, ("wgmma", 8, True)), (512, 1024, 128, 132, ("64x64", 1, False)),
                                 (512, 19, 1024, 132, ("32x32", 8, False))]:
        p = plan(m, n, k, share, precision="tf32", wgmma=True, max_clusters=h200)
        assert (p.tile.name, p.splits, p.cluster) == want, (m, n, k, share)
    assert choose_tile(1024, 1024, 512, 132, "3xtf32", wgmma=True) is WGMMA_TILE
    assert choose_tile(512, 1024, 1024, 132, "tf32", wgmma=False).name == "64x64"
    assert choose_tile(512, 1024, 1024, 132, "3xtf32", wgmma=False).name == "64x64"
    assert choose_tile(512, 1024, 128, 132, "tf32", wgmma=True).name == "64x64"  # 32 blocks would idle 100 SMs
    assert choose_tile(1024, 128, 512, 132, "3xtf32", wgmma=True).name == "64x64"
    assert choose_tile(256, 256, 256, 132, "tf32", wgmma=True).name == "32x32"
    assert choose_tile(512, 1024, 1024, 132, "f32", wgmma=True).name == "f32"
    assert kernel_name("forward_relu", "tf32", WGMMA_TILE, 16) == "linear_forward_relu_wgmma_tf32"
    assert kernel_name("grad_input", "3xtf32", WGMMA_TILE, 16) == "linear_grad_input_wgmma_3xtf32"
    assert kernel_name("grad_weight", "3xtf32", WGMMA_TILE, 16) == "linear_grad_weight_wgmma_3xtf32"
    for role in ("grad_input", "forward"):
        with pytest.raises(ValueError, match="wgmma tile runs with 16-byte copies only"):
            kernel_name(role, "tf32" if role == "forward" else "3xtf32", WGMMA_TILE, 4)
    with pytest.raises(ValueError, match="tile wgmma has no f32 kernels"):
        plan(512, 1024, 1024, 132, precision="f32", tile=WGMMA_TILE)


def test_gemm_sm90a_cu_compiles_the_wgmma_kernels_for_sm_90a_and_traps_elsewhere():
    from drvtrain.compiler import compile_file
    names = [b"linear_forward_wgmma_tf32\0", b"linear_forward_relu_wgmma_tf32\0",
             b"linear_grad_input_wgmma_3xtf32\0", b"linear_grad_weight_wgmma_3xtf32\0"]
    special = compile_file("gemm_sm90a.cu", arch="sm_90a")
    assert special.arch == "sm_90a" and all(n in special.cubin for n in names)
    generic = compile_file("gemm_sm90a.cu", arch="sm_90")  # the kernels exist and trap
    assert all(n in generic.cubin for n in names) and len(generic.cubin) < len(special.cubin) // 4


def test_kernel_names_follow_the_roles_and_precisions():
    assert kernel_name("forward_relu", "tf32", TILES[0], 16) == "linear_forward_relu_64x64_cp16_tf32"
    assert kernel_name("grad_weight", "3xtf32", TILES[1], 4) == "linear_grad_weight_32x32_cp4_3xtf32"
    assert kernel_name("grad_input", "f32") == "linear_grad_input_f32"
    assert kernel_name("grad_input", "3xtf32", TILES[1], 4, cluster=True) == "linear_grad_input_32x32_cp4_cluster_3xtf32"
    assert kernel_name("forward", "tf32", WGMMA_TILE, 16, cluster=True) == "linear_forward_wgmma_tf32"
    with pytest.raises(ValueError, match="FP32 FFMA kernels have no kernels that sum their splits in a cluster"):
        kernel_name("forward", "f32", cluster=True)
    assert kernel_name("grad_input_dw0", "3xtf32", TILES[1], 16, cluster=True) == \
        "linear_grad_input_dw0_32x32_cp16_cluster_3xtf32"
    assert kernel_name("forward_relu_x0", "tf32", TILES[1], 4, cluster=True) == \
        "linear_forward_relu_x0_32x32_cp4_cluster_tf32"
    # The folded kernels: on the 32x32 tile's cluster kernels only, in their one precision.
    for role, precision in (("grad_input_dw0", "3xtf32"), ("forward_x0", "tf32"), ("forward_relu_x0", "tf32")):
        for tile, cluster in ((TILES[1], False), (TILES[0], True), (WGMMA_TILE, True)):
            with pytest.raises(ValueError, match=f"{role} runs on tile 32x32's cluster kernels only"):
                kernel_name(role, precision, tile, 16, cluster=cluster)
        with pytest.raises(ValueError, match=f"runs in {precision}"):
            kernel_name(role, "f32")
    with pytest.raises(ValueError, match="no kernels that sum their splits in a cluster"):
        kernel_name("forward", "tf32", TILES[0], 16, cluster=True)
    # Settled weights: gemm.cu's tensor-core kernels of the roles whose B is a weight.
    assert kernel_name("forward_relu", "tf32", TILES[1], 16, cluster=True, settled=True) == \
        "linear_forward_relu_32x32_cp16_cluster_settled_tf32"
    assert kernel_name("grad_input", "3xtf32", TILES[0], 4, settled=True) == "linear_grad_input_64x64_cp4_settled_3xtf32"
    assert kernel_name("grad_input_dw0", "3xtf32", TILES[1], 4, cluster=True, settled=True) == \
        "linear_grad_input_dw0_32x32_cp4_cluster_settled_3xtf32"
    for args in (("grad_weight", "3xtf32", TILES[1], 16), ("forward", "f32"), ("forward", "tf32", WGMMA_TILE, 16),
                 ("grad_input", "3xtf32", WGMMA_TILE, 16, True)):  # the last: pre-split
        with pytest.raises(ValueError, match="no settled kernel"):
            kernel_name(*args, settled=True)
    with pytest.raises(ValueError, match="runs in"):
        kernel_name("forward", "3xtf32", TILES[0])
    with pytest.raises(ValueError, match="backward must be"):
        mlp_module.MLP(ParamLayout(SMALL), backward="tf32")


def test_gemm_cu_compiles_for_sm_90_with_every_kernel_the_host_names():
    from drvtrain.compiler import compile_file
    cubin = compile_file("gemm.cu", arch="sm_90").cubin
    names = [kernel_name(role, "f32") for role in ("forward", "forward_relu", "grad_input", "grad_weight")]
    for tile in TILES:
        for vector in (16, 4):
            for cluster in (False, True) if tile.cluster_splits > 1 else (False,):
                names += [kernel_name(role, "tf32", tile, vector, cluster=cluster) for role in ("forward", "forward_relu")]
                names += [kernel_name(role, "3xtf32", tile, vector, cluster=cluster)
                          for role in ("grad_input", "grad_weight")]
    names += [kernel_name("grad_input_dw0", "3xtf32", TILES[1], vector, cluster=True) for vector in (16, 4)]
    names += [kernel_name(role, "tf32", TILES[1], vector, cluster=True)
              for role in ("forward_x0", "forward_relu_x0") for vector in (16, 4)]
    assert sum("_cluster_" in name for name in names) == 14
    # Every tensor-core kernel whose B is a weight once more, settled.
    names += [name.replace("_tf32", "_settled_tf32").replace("_3xtf32", "_settled_3xtf32") for name in names
              if not name.endswith("_f32") and "_grad_weight_" not in name]
    assert len(names) == 58 and sum("_settled_" in name for name in names) == 24
    # The output layer's dX with its dW folded in: the 64x64 tile's cluster kernels, no settled twin.
    names += [kernel_name("grad_input_dwl", "3xtf32", TILES[0], vector, cluster=True) for vector in (16, 4)]
    for name in names:
        assert name.encode() + b"\0" in cubin, name


def test_forward_layers_and_backward_dx_last(monkeypatch):
    """``forward(layers=k)`` launches the first k layers only; ``backward(dx_last=)`` launches no
    dX for the last layer and chains the next layer's dW and dX from the caller's buffer."""
    launches = []
    _fake_kernels(monkeypatch, launches)
    layout = ParamLayout.from_widths([4, 256, 256, 3])
    model = mlp_module.MLP(layout)
    arena = _FakeArena()
    params, grads = _FakeFlat(layout, 1 << 38), _FakeFlat(layout, 1 << 39)
    x = DeviceBuffer._view(None, 1 << 37, (64, 4), np.float32)
    for bad in (0, 4, True, 1.5):
        with pytest.raises(ValueError, match="layers must be"):
            model.forward(params, x, arena=arena, stream=object(), layers=bad)
    fwd = model.forward(params, x, arena=arena, stream=object(), layers=np.int64(2))
    kernels = [e for e in launches if e[0] not in ("fork", "join")]
    assert len(kernels) == 2 and len(fwd.activations) == 3 and fwd.output.shape == (64, 256)
    dout = DeviceBuffer._view(None, 1 << 36, (64, 3), np.float32)
    q = DeviceBuffer._view(None, 1 << 35, (64, 3), np.float32)
    dh = DeviceBuffer._view(None, 1 << 34, (64, 256), np.float32)
    full = mlp_module.Forward(fwd.activations + (q,))
    with pytest.raises(ValueError, match="dx_last has shape"):
        model.backward(params, grads, full, dout, arena=arena, stream=object(), dx_last=dout)
    launches.clear()
    main, side = object(), object()
    model.backward(params, grads, full, dout, arena=arena, stream=main, weight_stream=side, dx_last=dh)
    kernels = [e for e in launches if e[0] not in ("fork", "join")]
    roles = [("weight" if "grad_weight" in e[0] else "input", mlp_module._address(e[2][0]), e[3]) for e in kernels]
    # dW of layer 2 from dout (side), dW and dX of layer 1 from dh (side, main), dW of layer 0 (main)
    assert [(r, a, s) for r, a, s in roles[:3]] == [("weight", dout.ptr, side), ("weight", dh.ptr, side),
                                                    ("input", dh.ptr, main)]
    assert roles[3][0] == "weight" and roles[3][2] is main and len(roles) == 4
    # Two weight streams take the side products in turn from the last layer's on; both are joined.
    launches.clear()
    side2 = object()
    model.backward(params, grads, full, dout, arena=arena, stream=main, weight_stream=(side, side2), dx_last=dh)
    kernels = [e for e in launches if e[0] not in ("fork", "join")]
    assert [(mlp_module._address(e[2][0]), e[3]) for e in kernels if "grad_weight" in e[0]][:2] == \
        [(dout.ptr, side), (dh.ptr, side2)]
    assert [e[3] for e in kernels if "grad_input" in e[0]] == [main] and kernels[-1][3] is main
    joined = {c for e in launches if e[0] == "join" for c in e[1]}
    assert joined == {side, side2}
    for s in (side, side2):  # each joined after the last launch on it
        last = max(i for i, e in enumerate(launches) if e[0] not in ("fork", "join") and e[3] is s)
        assert any(e[0] == "join" and s in e[1] for e in launches[last + 1:]), s
    launches.clear()
    for bad in (main, (), (side, None), (side, main), (side, side)):
        with pytest.raises(ValueError, match="weight_stream must be a stream other than stream"):
            model.backward(params, grads, full, dout, arena=arena, stream=main, weight_stream=bad, dx_last=dh)
    assert launches == []
    one = mlp_module.MLP(ParamLayout.from_widths([4, 3]))
    one_fwd = one.forward(_FakeFlat(one.layout, 1 << 38), x, arena=arena, stream=main)
    with pytest.raises(ValueError, match="dx_last needs a hidden layer"):
        one.backward(_FakeFlat(one.layout, 1 << 38), _FakeFlat(one.layout, 1 << 39), one_fwd,
                     DeviceBuffer._view(None, 1 << 36, (64, 3), np.float32), arena=arena, stream=main,
                     dx_last=dh)
    launches.clear()
    one.backward(_FakeFlat(one.layout, 1 << 38), _FakeFlat(one.layout, 1 << 39), one_fwd,
                 DeviceBuffer._view(None, 1 << 36, (64, 3), np.float32), arena=arena, stream=main,
                 weight_stream=side)
    assert [e[0] for e in launches if e[0] in ("fork", "join")] == []  # nothing forked, nothing joined


def _presplit_net(monkeypatch, widths, batch, **options):
    """A pre-split MLP on the fakes (compute capability 9.0; ``options`` to MLP), with its
    parameters and gradients, a main and a side stream, a forward queued on main, dout,
    and the log."""
    launches = []
    _fake_kernels(monkeypatch, launches, (9, 0))
    layout = ParamLayout.from_widths(widths)
    model = mlp_module.MLP(layout, tf32=False, presplit=True, **options)
    arena = _FakeArena()
    params, grads = _FakeFlat(layout, 1 << 38), _FakeFlat(layout, 1 << 39)
    main, side = _FakeStream(launches, "main"), _FakeStream(launches, "side")
    x = DeviceBuffer._view(None, 1 << 37, (batch, widths[0]), np.float32)
    fwd = model.forward(params, x, arena=arena, stream=main)
    dout = DeviceBuffer._view(None, 1 << 36, (batch, widths[-1]), np.float32)
    return launches, model, arena, params, grads, main, side, fwd, dout


def test_backward_checks_weight_splits_before_queuing_anything(monkeypatch):
    launches, model, arena, params, grads, main, side, fwd, dout = _presplit_net(monkeypatch, [128, 1024, 1024, 19],
                                                                                 512)
    ws = model.split_weights(params, 512, arena=arena, stream=side)
    assert set(ws.weights) == {1} and ws.event is not None and ws.stream is side
    (w1,) = ws.weights.values()
    assert (w1.rows, w1.k) == (1024, 1024)  # layer 1's W [1024 out, 1024 in], transposed
    queued = len(launches)
    with pytest.raises(ValueError, match="batch of 256, not 512"):
        model.backward(params, grads, fwd, dout, arena=arena, stream=main,
                       weight_splits=mlp_module.WeightSplits(256, ws.weights, side, ws.event))
    with pytest.raises(ValueError, match=r"layer\(s\) \[1\]"):
        model.backward(params, grads, fwd, dout, arena=arena, stream=main,
                       weight_splits=mlp_module.WeightSplits(512, {}, side, ws.event))
    assert len(launches) == queued
    model.backward(params, grads, fwd, dout, arena=arena, stream=main, weight_splits=ws)
    names = [e[0] for e in launches[queued:]]
    assert names.count("tf32_split") == 2  # X^T, then dY both ways; W^T was given
    assert ("wait", main, ws.event) in launches[queued:]


@pytest.mark.parametrize("fold_last_dw", [True, False], ids=["last-dw-folded", "last-dw-apart"])
@pytest.mark.parametrize("weight_stream", [1, 2, 0], ids=["weight-stream", "two-weight-streams", "one-stream"])
def test_every_presplit_product_follows_its_splits_on_its_own_stream(monkeypatch, weight_stream, fold_last_dw):
    """A first layer 512 -> 1024 runs its dW pre-split on the main stream: its input's
    split goes there too, ahead of it (not beside the chain, where nothing would order
    the two). Every pre-split product's operands are split earlier on the product's
    stream, or on a stream it waited for. With two weight streams the output layer's
    dW runs on the first, the hidden layer's (and its input's split) on the second,
    and both are joined back; where the output layer's dW is folded into its dX, it
    runs there, on the main stream."""
    launches, model, arena, params, grads, main, side, fwd, dout = _presplit_net(
        monkeypatch, [512, 1024, 1024, 19], 512, fold_last_dw=fold_last_dw)
    assert model.last_dw_folded(512) == fold_last_dw
    side2 = _FakeStream(launches, "side2")
    assert model.presplit_layers(512) == {0: (False, True), 1: (True, True)}
    start = len(launches)
    sides = (side, side2)[:weight_stream]
    model.backward(params, grads, fwd, dout, arena=arena, stream=main,
                   weight_stream=sides[0] if weight_stream == 1 else sides or None)
    log = launches[start:]
    # What each stream is ordered after: the split parts it wrote, or was made to wait for
    # (a fork orders the child after main; a join or an event wait orders main after them).
    seen = {main: set(), side: set(), side2: set()}
    queued = {main: 0, side: 0, side2: 0}  # launches a stream holds that main has not joined yet
    snapshots = {}
    for entry in log:
        if entry[0] == "tf32_split":
            args, stream = entry[2], entry[3]
            seen[stream] |= {part.ptr for part in (args[4], args[5], args[7], args[8]) if part}
        elif entry[0] == "fork":
            for child in entry[1]:
                seen[child] |= seen[main]
        elif entry[0] == "join":
            for child in entry[1]:
                seen[main] |= seen[child]
                queued[child] = 0
        elif entry[0] == "record":
            snapshots[id(entry[2])] = set(seen[entry[1]])
        elif entry[0] == "wait":
            seen[entry[1]] |= snapshots[id(entry[2])]
        elif "_presplit_" in entry[0]:
            for m in entry[2][:4]:  # every map's part split before, in this stream's order
                assert m[0] in seen[entry[3]], (entry[0], entry[3])
        if entry[0] not in ("fork", "join", "record", "wait"):
            queued[entry[3]] += 1
    assert queued[side] == queued[side2] == 0, "work left on a weight stream, not joined"
    dws = [e for e in log if e[0] == "linear_grad_weight_wgmma_presplit_3xtf32"]
    assert len(dws) == 2 and dws[-1][3] is main  # the first layer's dW, on the chain
    if weight_stream == 2:  # the output layer's dW (not pre-split) and the hidden layer's, side by side
        out_dw = [e for e in log if e[0].startswith("linear_grad_weight_") and "_presplit_" not in e[0]]
        if model.last_dw_folded(512):  # the output layer's dW rides on its dX, on the chain
            dwl = [e for e in log if "_dwl_" in e[0]]
            assert not out_dw and len(dwl) == 1 and dwl[0][3] is main and dws[0][3] is side2
        else:
            assert len(out_dw) == 1 and out_dw[0][3] is side and dws[0][3] is side2
    first_input = fwd.activations[0].ptr
    split_of_x = [e for e in log if e[0] == "tf32_split" and e[2][0].ptr == first_input]
    assert len(split_of_x) == 1 and split_of_x[0][3] is main and log.index(split_of_x[0]) < log.index(dws[-1])


def test_weight_splits_not_needed_are_still_waited_for(monkeypatch):
    """Given dx_last, the last layer's dX is not launched, so split_weights skips its
    weight; weights split on another stream that no dX reads are still joined."""
    batch = 8192
    launches, model, arena, params, grads, main, early, fwd, dout = _presplit_net(monkeypatch, [4, 256, 256], batch)
    assert model.presplit_layers(batch)[1][0] and model.dx_presplit_layers(batch, dx_last=True) == []
    assert model.split_weights(params, batch, arena=arena, stream=early, dx_last=True).weights == {}
    ws = model.split_weights(params, batch, arena=arena, stream=early)  # every layer's: the last one's too
    assert set(ws.weights) == {1}
    dx_last = DeviceBuffer._view(None, 1 << 35, (batch, 256), np.float32)
    start = len(launches)
    model.backward(params, grads, fwd, dout, arena=arena, stream=main, dx_last=dx_last, weight_splits=ws)
    assert ("wait", main, ws.event) in launches[start:]
    assert not any(e[0] == "linear_grad_input_wgmma_presplit_3xtf32" for e in launches[start:])


def test_forward_refuses_a_bad_share_before_taking_anything(monkeypatch):
    launches = []
    _fake_kernels(monkeypatch, launches, (9, 0))
    layout = ParamLayout.from_widths([128, 1024, 19])
    model = mlp_module.MLP(layout)
    arena = _FakeArena()
    params = _FakeFlat(layout, 1 << 38)
    x = DeviceBuffer._view(None, 1 << 37, (512, 128), np.float32)
    for sms in (0, 133, 1.5, True, "44"):
        with pytest.raises(ValueError, match=r"sms must be an int in \[1, 132\]"):
            model.forward(params, x, arena=arena, stream=None, sms=sms)
        with pytest.raises(ValueError, match=r"sms must be an int"):
            model.scratch_bytes(512, sms=sms)
    assert launches == [] and arena.offset == 0 and arena.zeroed_offset == 0
    with pytest.raises(TypeError):  # a share is named, never a second positional (NarrowMLP's is a pass count)
        model.scratch_bytes(512, 3)


def test_presplit_launch_refuses_before_queuing_anything(monkeypatch):
    launches = []
    _fake_kernels(monkeypatch, launches, (9, 0))
    kernels = mlp_module.LinearKernels(("grad_input", "grad_weight"), "3xtf32", 132, wgmma=True, presplit=True)
    arena = _FakeArena()
    a = DeviceBuffer._view(None, 1 << 37, (16384, 512), np.float32)
    b = DeviceBuffer._view(None, 1 << 36, (512, 64), np.float32)
    c = DeviceBuffer._view(None, 1 << 35, (16384, 64), np.float32)
    with pytest.raises(ValueError, match="no pre-split launch"):  # one tile wide: nothing to share
        kernels.launch("grad_input", a, 512, b, 64, c, 64, 16384, 64, 512, arena=arena, stream=None, presplit=True)
    for forced in ({"vector": 16}, {"sms": 66}):
        with pytest.raises(ValueError, match="no tile, vector or sms"):
            kernels.launch("grad_input", a, 512, b, 64, c, 64, 16384, 64, 512, arena=arena, stream=None,
                           presplit=True, **forced)
    for sms in (0, 133, 1.5, True):  # not a share of this device's 132 SMs
        with pytest.raises(ValueError, match=r"sms must be an int in \[1, 132\]"):
            kernels.launch("grad_input", a, 512, b, 64, c, 64, 16384, 64, 512, arena=arena, stream=None, sms=sms)
    assert launches == [] and arena.offset == 0
    assert mlp_module.LinearKernels(("grad_input",), "3xtf32", 132, wgmma=True).presplit == {}  # off unless asked
    with pytest.raises(ValueError, match="at most"):
        kernels.split(a, 512, 65535 * 32 + 1, 4, arena=arena, stream=None)


def test_the_presplit_bound_is_the_kernels():
    import re
    from drvtrain.compiler import kernel_dir
    source = (kernel_dir() / "gemm_sm90a.cu").read_text()
    (bound,) = re.findall(r"constexpr int PRESPLIT_MAX_TILES = (\d+);", source)
    assert int(bound) == mlp_module.PRESPLIT_MAX_TILES
    (stages,) = re.findall(r"constexpr int PRESPLIT_STAGES = (\d+);", source)
    assert mlp_module.WGMMA_PRESPLIT_SHARED_BYTES == int(stages) * 4 * 128 * 32 * 4 + 1024


def test_split_parts_rows_are_padded_to_16_bytes_and_counted(monkeypatch):
    launches = []
    _fake_kernels(monkeypatch, launches, (9, 0))
    kernels = mlp_module.LinearKernels(("grad_input",), "3xtf32", 132, wgmma=True, presplit=True)
    arena = _FakeArena()
    x = DeviceBuffer._view(None, 1 << 37, (77, 45), np.float32)
    a, t = kernels.split(x, 45, 77, 45, arena=arena, stream=None, transposed=True)
    assert (a.rows, a.k, a.ld) == (77, 45, 48) and (t.rows, t.k, t.ld) == (45, 77, 80)
    assert a.big.shape == a.small.shape == (77, 48) and t.big.shape == t.small.shape == (45, 80)
    assert -(-arena.offset // 256) * 256 == mlp_module.split_bytes(77, 45) + mlp_module.split_bytes(45, 77)


def test_regression_step_refuses_a_bad_weight_streams_before_touching_the_device():
    from drvtrain.nn import RegressionStep
    for bad in (3, -1, True, 1.5, 2.0, "2"):
        with pytest.raises(ValueError, match="weight_streams must be 0, 1, 2 or None"):
            RegressionStep(ParamLayout.from_widths([4, 8, 2]), 16, weight_streams=bad)
    with pytest.raises(ValueError, match="fused narrow kernels run their backward on the caller's stream"):
        RegressionStep(ParamLayout.from_widths([4, 8, 2]), 16, fused=True, weight_streams=2)
    # The default: side streams for the nets they measured faster on (256 wide), none at 1024.
    assert RegressionStep.default_weight_streams(ParamLayout.from_widths([4, 256, 256, 3])) == 2
    assert RegressionStep.default_weight_streams(ParamLayout.from_widths([128, 1024, 1024, 19])) == 0
    assert RegressionStep.default_weight_streams(ParamLayout.from_widths([257, 8])) == 0
    assert RegressionStep.narrow(ParamLayout.from_widths([4, 256, 3])) and \
        not RegressionStep.narrow(ParamLayout.from_widths([4, 512, 3]))


def test_the_folded_first_layer_dw_bound_is_the_kernels():
    """DW0_MAX_IN sizes the kernel's registers (kernels/gemm.cu) and the host's rule."""
    from drvtrain.compiler import kernel_dir
    source = (kernel_dir() / "gemm.cu").read_text()
    assert re.search(r"constexpr int DW0_MAX_IN = (\d+);", source).group(1) == str(mlp_module.DW0_MAX_IN)


def test_gemm_cu_kernel_signatures_match_their_parameter_lists():
    """The host's argument types for gemm.cu's kernels, against the source's macros:
    as many as DT_GEMM_PARAMS declares (and DT_DW0_PARAMS after them), pointer for
    pointer."""
    from drvtrain.compiler import kernel_dir
    source = (kernel_dir() / "gemm.cu").read_text()

    def params(macro):
        lines = source[source.index(f"#define {macro}"):].splitlines()
        body = []
        for line in lines:  # the #define line and its continuations
            body.append(line.rstrip("\\"))
            if not line.endswith("\\"):
                break
        decls = " ".join(body)[len(f"#define {macro}"):].split(",")
        return ["ptr" if "*" in d else "i32" for d in decls if d.strip()]

    plain = params("DT_GEMM_PARAMS")
    assert mlp_module._signature("linear_grad_input_32x32_cp16_cluster_3xtf32").split() == plain
    assert mlp_module._signature("linear_forward_f32").split() == plain
    assert mlp_module._signature("linear_grad_input_dw0_32x32_cp4_cluster_3xtf32").split() == \
        plain + params("DT_DW0_PARAMS")


def test_first_dw_folds_only_where_the_rule_allows(monkeypatch):
    """On compute capability 9.0: folded for a narrow first layer on the 32x32 tile's
    cluster kernels up to FIRST_DW_MAX_ROW_TILES row tiles (batch 512), not past them
    (544), not where the product leaves the tile (1024: 64x64), not for 9 inputs, not for
    a two-layer net, and never below 9.0."""
    _fake_kernels(monkeypatch, [], (9, 0))
    net = lambda widths: mlp_module.MLP(ParamLayout.from_widths(widths))
    assert mlp_module.FIRST_DW_MAX_ROW_TILES * 32 == 512
    assert [net([4, 256, 256, 3]).first_dw_folded(b) for b in (256, 512, 544, 1024)] == [True, True, False, False]
    assert net([8, 256, 256, 3]).first_dw_folded(256) and not net([9, 256, 256, 3]).first_dw_folded(256)
    assert not net([4, 256, 3]).first_dw_folded(256)
    assert not mlp_module.MLP(ParamLayout.from_widths([4, 256, 256, 3]), backward="f32", tf32=False) \
        .first_dw_folded(256)
    _fake_kernels(monkeypatch, [], (8, 0))
    assert not net([4, 256, 256, 3]).first_dw_folded(256)


def test_folded_backward_with_dx_last_and_two_weight_streams(monkeypatch):
    """The DQN step's backward (compute capability 9.0): dx_last given, two weight
    streams. The output layer's dW and the hidden layer's on the side streams, the
    folded kernel on the main stream from dx_last, no other dX and no first-layer dW;
    every scratch byte as the accounting says."""
    launches = []
    _fake_kernels(monkeypatch, launches, (9, 0))
    layout = ParamLayout.from_widths([4, 256, 256, 3])
    model = mlp_module.MLP(layout)
    arena = _FakeArena()
    params, grads = _FakeFlat(layout, 1 << 38), _FakeFlat(layout, 1 << 39)
    x = DeviceBuffer._view(None, 1 << 37, (256, 4), np.float32)
    fwd = model.forward(params, x, arena=arena, stream=object(), layers=2)
    q = DeviceBuffer._view(None, 1 << 35, (256, 3), np.float32)
    dout = DeviceBuffer._view(None, 1 << 36, (256, 3), np.float32)
    dh = DeviceBuffer._view(None, 1 << 34, (256, 256), np.float32)
    launches.clear()
    main, side, side2 = object(), object(), object()
    model.backward(params, grads, mlp_module.Forward(fwd.activations + (q,)), dout, arena=arena, stream=main,
                   weight_stream=(side, side2), dx_last=dh)
    kernels = [e for e in launches if e[0] not in ("fork", "join")]
    assert [(e[0].split("_3xtf32")[0], e[3]) for e in kernels] == [
        ("linear_grad_weight_32x32_cp4_cluster", side),  # dW2 = dout^T H2 (3 rows: 4-byte copies)
        ("linear_grad_weight_32x32_cp16_cluster", side2),  # dW1 = dh^T H1
        ("linear_grad_input_dw0_32x32_cp16_cluster", main)]  # dX1 from dh, folded into dW0 and db0
    folded = kernels[-1][2]
    assert folded[0].ptr == dh.ptr and folded[16].ptr == x.ptr and folded[19].ptr == grads.weight(0).ptr


@pytest.mark.parametrize("defer", [False, True], ids=["summed-here", "deferred"])
def test_folded_backward_defers_the_strip_sums_only_when_asked(monkeypatch, defer):
    """MLP.backward(defer_first_dw=True): the folded kernel gets no strip counters (its
    tiles only write their shares) and the backward returns what AdamW.step needs to
    sum them: the shares it wrote, dW0's and db0's offsets, in0, the columns, the row
    tiles and the strip width. By default the kernel sums them itself (counters) and
    the backward returns None."""
    launches = []
    _fake_kernels(monkeypatch, launches, (9, 0))
    layout = ParamLayout.from_widths([5, 200, 96, 3])  # 200 columns: a partial last strip
    model = mlp_module.MLP(layout)
    arena = _FakeArena()
    params, grads = _FakeFlat(layout, 1 << 38), _FakeFlat(layout, 1 << 39)
    x = DeviceBuffer._view(None, 1 << 37, (300, 5), np.float32)
    fwd = model.forward(params, x, arena=arena, stream=object())
    dout = DeviceBuffer._view(None, 1 << 36, (300, 3), np.float32)
    launches.clear()
    got = model.backward(params, grads, fwd, dout, arena=arena, stream=object(), defer_first_dw=defer)
    folded = [e for e in launches if e[0].startswith("linear_grad_input_dw0_")]
    assert len(folded) == 1
    args = folded[0][2]  # ..., X0, ldx0, in0, dW0, db0, work, counters
    assert args[18] == 5 and args[19].ptr == grads.weight(0).ptr and args[20].ptr == grads.bias(0).ptr
    if not defer:
        assert got is None and args[22] != 0
        return
    assert args[22] == 0
    assert isinstance(got, mlp_module.FirstDwShares) and got.grads is grads and got.shares.ptr == args[21].ptr
    assert (got.dw0_at, got.db0_at) == (layout.weight(0).offset, layout.bias(0).offset)
    assert (got.in0, got.cols, got.rows, got.bn) == (5, 200, 10, 32)  # 300 rows: 10 row tiles of 32
    assert folded[0][1][:2] == (7, 10)  # the launch's strips and row tiles
    assert got.shares.size == mlp_module.LinearKernels.first_dw_scratch(300, 200, 5)[0] == 10 * 7 * 32 * 6
    assert got.kernel_args() == (got.shares, got.dw0_at, got.db0_at, 5, 200, 10, 32)


def test_metrics_words_split_into_the_step_and_the_fields_bits(rng):
    """A metrics word as the kernels store it (kernels/common.cuh, dt_metric_store):
    little-endian, the float32 field first, then the step's low 32 bits."""
    import struct

    from drvtrain.nn.metrics import split_words
    values = rng.standard_normal(6).astype(np.float32)
    values[2], values[4] = np.nan, -np.inf  # the NaN guard's fields keep their bits
    steps = rng.integers(1, 1 << 32, 6, dtype=np.uint64)
    words = np.array([struct.unpack("<Q", struct.pack("<fI", v, int(t)))[0] for v, t in zip(values, steps)],
                     np.uint64)
    tags, got = split_words(words)
    assert tags.dtype == np.uint32 and tags.tolist() == steps.tolist()
    assert got.dtype == np.float32 and got.tobytes() == values.tobytes()
