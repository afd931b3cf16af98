"""Parameter layout and the engine's numpy references (CPU)."""
import numpy as np
import pytest

from drvtrain.nn.layout import ParamLayout
from nn_reference import adamw, clip_scale, mlp_backward, mlp_forward, mse, rel

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


def test_from_widths_matches_the_out_in_list(rng):
    widths = [int(w) for w in rng.integers(1, 300, size=int(rng.integers(2, 6)))]
    layout = ParamLayout.from_widths(widths)
    assert layout == ParamLayout([(o, i) for i, o in zip(widths, widths[1:])])
    assert layout.widths == widths
    with pytest.raises(ValueError, match="input and an output"):
        ParamLayout.from_widths([4])
