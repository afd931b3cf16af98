"""DQNConfig validation (CPU: no driver call is made)."""
import re

import numpy as np
import pytest

from drvtrain.nn import ParamLayout
from drvtrain.rl import dqn as dqn_module
from drvtrain.rl.dqn import DQNConfig


def test_benchmark_configurations_are_valid():
    small, large = DQNConfig.small(), DQNConfig.large()
    assert small.widths == [4, 256, 256, 3] and large.widths == [128, 1024, 1024, 19]
    assert small.projected_layers == (0, 1) and (small.batch, small.capacity) == (256, 131072)
    assert (large.batch, large.capacity) == (512, 1 << 20)
    assert DQNConfig.small(spectral_c=None).projected_layers == ()
    assert DQNConfig.small(spectral_layers=[1]).projected_layers == (1,)


@pytest.mark.parametrize("overrides, field", [
    (dict(n_actions=0), "n_actions"),
    (dict(n_actions=65), "n_actions"),
    (dict(batch=200, capacity=100), "batch"),
    (dict(obs_dim=0), "obs_dim"),
    (dict(hidden=()), "hidden"),
    (dict(hidden=(16, 0)), "hidden width"),
    (dict(tau=0.0), "tau"),
    (dict(tau=1.5), "tau"),
    (dict(tau=None), "exactly one of tau"),
    (dict(tau=0.01, target_period=10), "exactly one of tau"),
    (dict(tau=None, target_period=0), "target_period"),
    (dict(gamma=1.2), "gamma"),
    (dict(alpha=-0.1), "alpha"),
    (dict(beta=1.5), "beta"),
    (dict(beta=(0.4, 1.0, 0)), "beta steps"),
    (dict(beta=(0.4, 1.2, 100)), "beta end"),
    (dict(lr=0.0), "lr"),
    (dict(max_norm=float("nan")), "max_norm"),
    (dict(huber_delta=0.0), "huber_delta"),
    (dict(spectral_c=-1.0), "spectral_c"),
    (dict(spectral_layers=(2,)), "spectral layer index"),
    (dict(spectral_layers=(0, 0)), "repeats"),
    (dict(betas=(1.0, 0.999)), r"betas\[0\]"),
    (dict(n_actions=True), "n_actions"),
    (dict(fused_head=1), "fused_head"),
    (dict(cluster_forward="yes"), "cluster_forward"),
    (dict(fused_tail=None), "fused_tail"),
    (dict(fused_adamw=1), "fused_adamw"),
    (dict(fused_adamw=True, spectral_c=None), "no layer is projected"),
    (dict(fused_adamw=True, fused_tail=True), "fused_tail runs AdamW"),
    (dict(fused_adamw=True, hidden=(8,) * 5), "5 projected layers"),
])
def test_bad_values_name_the_field_and_the_range(overrides, field):
    with pytest.raises(ValueError, match=field):
        DQNConfig.small(**overrides)


def test_config_round_trips_through_a_dict():
    cfg = DQNConfig.small(beta=(0.4, 1.0, 1000), tau=None, target_period=100, hidden=[64, 32])
    again = DQNConfig(**cfg.to_dict())
    assert again == cfg and again.hidden == (64, 32) and again.beta == (0.4, 1.0, 1000)


def test_fused_head_takes_none_true_or_false():
    assert DQNConfig.small().fused_head is None
    for value in (None, True, False):
        assert DQNConfig.small(fused_head=value).fused_head is value


def test_target_update_is_what_the_kernels_take():
    assert DQNConfig.small(tau=0.01).target_update == (0.01, 0)
    assert DQNConfig.small(tau=None, target_period=250).target_update == (0.0, 250)


def test_fused_adamw_is_on_wherever_it_can_run():
    assert DQNConfig.small().fused_adamw is None and DQNConfig.small().fuses_adamw
    assert DQNConfig.large().fuses_adamw
    assert DQNConfig.small(fused_adamw=True).fuses_adamw and not DQNConfig.small(fused_adamw=False).fuses_adamw
    # None steps aside where the kernel cannot run; True refuses there (above).
    assert not DQNConfig.small(spectral_c=None).fuses_adamw
    assert not DQNConfig.small(fused_tail=True).fuses_adamw
    assert not DQNConfig.small(hidden=(8,) * 5).fuses_adamw
    assert DQNConfig.small(hidden=(8,) * 5, spectral_layers=(0, 2, 3, 4)).fuses_adamw


@pytest.mark.parametrize("widths, layers", [
    ([4, 256, 256, 3], (0, 1)),
    ([128, 1024, 1024, 19], (0, 1)),
    ([3, 5, 7, 2], (1, 0)),           # rows of 3 and 5 floats: ranges end inside a float4
    ([9, 33, 17, 11, 4], (2, 0)),     # unsorted, one hidden layer left out
    ([6, 10, 2], (0,)),
])
def test_adamw_columns_ranges_cover_exactly_the_projected_weights(widths, layers):
    """Every float4 holding a projected weight element is in a range and is not among
    the n_rest others; every other float4 (biases, unprojected weights, padding between
    views) is counted in n_rest, and the kernel's dense index maps onto exactly those."""
    layout = ParamLayout.from_widths(widths)
    n_rest, spans = dqn_module.adamw_columns_ranges(layout, layers)
    assert spans == sorted(spans) and len(spans) == len(layers)
    owned = np.zeros(layout.size // 4, bool)
    for k in layers:
        w = layout.weight(k)
        owned[w.offset // 4: -(-(w.offset + w.size) // 4)] = True
    in_span = np.zeros_like(owned)
    for start, end in spans:
        assert not in_span[start:end].any()
        in_span[start:end] = True
    assert np.array_equal(in_span, owned) and n_rest == int((~owned).sum())
    # The kernel's map from the r-th float4 outside the ranges to its flat index.
    def flat(r):
        for start, end in spans:
            if r >= start:
                r += end - start
        return r
    assert [flat(r) for r in range(n_rest)] == list(np.flatnonzero(~owned))


def test_adamw_columns_signature_matches_the_kernels_parameter_list():
    from drvtrain.compiler import kernel_dir
    source = (kernel_dir() / "dqn.cu").read_text()
    decl = re.search(r"adamw_spectral_columns\((.*?)\)\s*\{", source, re.S).group(1)
    kinds = {"float": "f32", "double": "f64", "int": "i32", "long long": "i64"}
    want = []
    for d in decl.split(","):
        d = " ".join(d.split()[:-1]).replace("const ", "")
        want.append("ptr" if "*" in d else kinds[d])
    assert dqn_module.ADAMW_COLUMNS_SIGNATURE.split() == want
    assert re.search(r"constexpr int ADAMW_COLUMNS_MAX_RANGES = (\d+);", source).group(1) == \
        str(dqn_module.MAX_FUSED_ADAMW_MATRICES)
