"""DQNConfig validation and the builds the step picks (CPU: no driver call is made)."""
import math
from pathlib import Path

import numpy as np
import pytest

from drvtrain.rl.dqn import MAX_SPECTRAL_LAYERS, DQNConfig, head_kernel_name, loss_dwl_kernel_name


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
    (dict(eps=1e-37), "eps = 1e-37 with beta2 = 0.999 is too small"),
    (dict(eps=1e-30, betas=(0.9, 1 - 1e-16)), "below 2\\^-126"),
    (dict(n_actions=True), "n_actions"),
    (dict(fused_head=1), "fused_head"),
    (dict(cluster_forward="yes"), "cluster_forward"),
    (dict(fused_tail=None), "fused_tail"),
    (dict(fused_loss="no"), "fused_loss"),
])
def test_bad_values_name_the_field_and_the_range(overrides, field):
    with pytest.raises(ValueError, match=field):
        DQNConfig.small(**overrides)


def test_adamw_refuses_an_eps_its_division_cannot_take():
    """AdamW's kernel divides by sqrt(v) + eps sqrt(1 - beta2^t) approximately, which
    needs that between 2^-126 and 2^126: an eps that takes it below, or one above 1e30
    (or not finite), is refused before anything is allocated (no device needed); the
    smallest float32 eps above the bound and the defaults are not."""
    from types import SimpleNamespace
    from drvtrain.nn.optim import SMALLEST_NORMAL, AdamW, check_eps
    fake = SimpleNamespace(layout="layout")  # refused before any buffer is made
    with pytest.raises(ValueError, match="too small"):
        AdamW(fake, fake, eps=1e-37)
    boundary = SMALLEST_NORMAL / math.sqrt(1 - 0.999)
    check_eps(float(np.nextafter(np.float32(boundary), np.float32(1))), 0.999)
    with pytest.raises(ValueError, match="too small"):
        check_eps(float(np.nextafter(np.float32(boundary), np.float32(0))), 0.999)
    check_eps(1e-8, 0.999)
    check_eps(1e30, 0.999)
    for big in (1e31, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="eps must be in"):
            check_eps(big, 0.999)
    assert DQNConfig.small(eps=1e-20).eps == 1e-20


def test_adamw_settings_are_checked_when_made_and_when_changed():
    """check_settings refuses each bad setting by name; AdamW's constructor refuses it before
    any buffer is made, and assigning a bad value later is refused with every setting left
    as it was (an AdamW built without buffers: no device needed). A good value takes."""
    from types import SimpleNamespace
    from drvtrain.nn.optim import AdamW, check_settings
    good = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, max_norm=10.0)
    assert check_settings(**good) == (1e-3, (0.9, 0.999), 1e-8, 1e-2, 10.0)
    assert check_settings(**{**good, "max_norm": float("inf")})[4] == float("inf")
    bad = [("lr", 0.0, "lr must"), ("lr", -1e-3, "lr must"), ("lr", float("inf"), "lr must"),
           ("lr", float("nan"), "lr must"), ("lr", 1e-50, "lr must"),  # 0 as a float32
           ("lr", 1e39, "lr must"), ("weight_decay", 1e39, "weight_decay must"),  # inf as a float32
           ("lr", None, "lr must be a real number"), ("lr", "1e-3", "lr must be a real number"),
           ("max_norm", True, "max_norm must be a real number"), ("betas", {0.9, 0.999}, "betas must"),
           ("betas", (0.9,), "betas must"), ("betas", None, "betas must"), ("betas", (0.9, 1.0), "beta2 must"),
           ("betas", (-0.1, 0.999), "beta1 must"), ("betas", (float("nan"), 0.999), "beta1 must"),
           ("weight_decay", -1e-2, "weight_decay must"), ("weight_decay", float("inf"), "weight_decay must"),
           ("max_norm", 0.0, "max_norm must"), ("max_norm", float("nan"), "max_norm must"),
           ("eps", 0.0, "eps must"), ("eps", 1e-37, "too small")]
    fake = SimpleNamespace(layout="layout")
    for name, value, message in bad:
        with pytest.raises(ValueError, match=message):
            check_settings(**{**good, name: value})
        with pytest.raises(ValueError, match=message):
            AdamW(fake, fake, **{**good, name: value})
    opt = object.__new__(AdamW)  # the settings alone, no buffers
    opt._lr, opt._betas, opt._eps, opt._weight_decay, opt._max_norm = check_settings(**good)
    before = opt._settings()
    for name, value, message in bad:
        with pytest.raises(ValueError, match=message):
            setattr(opt, name, value)
        assert opt._settings() == before, name
    opt.eps = 1e-36  # allowed with beta2 = 0.999, not with beta2 = 1 - 1e-8: eps is checked against a new beta2
    with pytest.raises(ValueError, match="too small"):
        opt.betas = (0.9, 1 - 1e-8)
    opt.lr, opt.betas, opt.max_norm, opt.eps = 3e-4, [0.8, 0.99], 1, 1e-8
    assert opt._settings() == (3e-4, (0.8, 0.99), 1e-8, 1e-2, 1.0)
    with pytest.raises(ValueError, match="lr must be finite and positive as a float32"):
        DQNConfig.small(lr=1e-46)  # the config refuses what the optimizer would


def learner_state(rng, n=40, n_u=12, t=5, step=9):
    """A learner state as DQNStep.state_numpy() returns it (random values, counters as it types them)."""
    state = {k: rng.standard_normal(n).astype(np.float32) for k in ("params", "target", "m")}
    state["v"] = rng.uniform(1e-6, 1e-2, n).astype(np.float32)
    state["u"] = rng.standard_normal(n_u).astype(np.float32)
    state["t"], state["step"] = np.array(t, np.int64), np.array([step], np.int64)
    return state


def test_learner_state_is_checked_before_a_load():
    """check_learner_state returns what load_state writes (float32 arrays, t as int32,
    step as int64) and refuses, naming it, every state no run leaves: a missing array, a
    wrong size, a value that is not finite, a negative v, counters out of range or t
    above step, counters that are not one integer."""
    from drvtrain.rl.dqn import check_learner_state
    rng = np.random.default_rng(7)
    state = learner_state(rng)
    got = check_learner_state(state, 40, 12)
    for key in ("params", "target", "m", "v", "u"):
        assert got[key].dtype == np.float32 and got[key].tobytes() == state[key].tobytes(), key
    assert got["t"].dtype == np.int32 and got["t"].tolist() == [5]
    assert got["step"].dtype == np.int64 and got["step"].tolist() == [9]
    assert check_learner_state(learner_state(rng, t=0, step=0), 40, 12)["t"].tolist() == [0]
    assert check_learner_state(learner_state(rng, t=2**31 - 2, step=2**62), 40, 12)["t"].tolist() == [2**31 - 2]

    def refused(match, n=40, n_u=12, **change):
        bad = learner_state(rng)
        for key, value in change.items():
            if value is None:
                del bad[key]
            else:
                bad[key] = value
        with pytest.raises(ValueError, match=match):
            check_learner_state(bad, n, n_u)

    refused(r"lacks \['m', 'step'\]", m=None, step=None)
    refused("params holds 40 values, this learner needs 41", n=41)
    refused("u holds 12 values, this learner needs 13", n_u=13)
    refused("target holds 39 values, this learner needs 40", target=np.ones(39, np.float32))
    refused("u holds 1 values that are not finite", u=np.r_[np.ones(11, np.float32), np.nan])
    poisoned = learner_state(rng)["params"]
    poisoned[[3, 17]] = np.nan
    refused("params holds 2 values that are not finite", params=poisoned)
    refused("m holds 1 values that are not finite", m=np.r_[np.ones(39, np.float32), np.inf])
    refused("v .* negative", v=np.r_[np.ones(39, np.float32), -1e-9])
    refused("target must hold numbers", target=np.array(["x"] * 40))
    refused(r"t \(AdamW updates applied\) must be in", t=np.array(-1))
    refused(r"t \(AdamW updates applied\) must be in", t=np.array(2**31 - 1), step=np.array([2**31]))
    refused(r"step .* must be in \[t, 2\^63\), got 4 with t = 5", step=np.array([4]))
    refused("t must be one integer", t=np.array(5.0))
    refused("t must be one integer, got bool", t=np.array(True))
    refused("step must be one integer", step=np.array([9, 10]))


def test_config_round_trips_through_a_dict():
    cfg = DQNConfig.small(beta=(0.4, 1.0, 1000), tau=None, target_period=100, hidden=[64, 32])
    again = DQNConfig(**cfg.to_dict())
    assert again == cfg and again.hidden == (64, 32) and again.beta == (0.4, 1.0, 1000)


def test_the_projection_takes_at_most_the_finish_pass_table():
    """The finish pass stages the spectral table in shared memory (FINISH_MAX_MATS
    entries in kernels/dqn_step.cu); a config with more projected layers is refused
    before anything is allocated, and naming fewer, or none, is accepted."""
    deep = dict(obs_dim=4, hidden=(8,) * (MAX_SPECTRAL_LAYERS + 1), n_actions=2)
    with pytest.raises(ValueError, match=f"at most {MAX_SPECTRAL_LAYERS} layers, got {MAX_SPECTRAL_LAYERS + 1}"):
        DQNConfig(**deep)
    assert len(DQNConfig(**deep, spectral_layers=range(MAX_SPECTRAL_LAYERS)).projected_layers) == 64
    assert DQNConfig(**deep, spectral_c=None).projected_layers == ()
    text = (Path(__file__).parents[1] / "kernels" / "dqn_step.cu").read_text()
    assert f"constexpr int FINISH_MAX_MATS = {MAX_SPECTRAL_LAYERS};" in text


def test_spectral_block_shapes_match_the_kernels():
    """The host sizes the spectral grids and the rows phase's staged W from the kernels'
    constants: the same numbers on both sides, and the staged bytes of the benchmark
    configurations (16 rows of the widest projected matrix's first 1024 columns)."""
    from drvtrain.rl import dqn
    kernels = Path(__file__).parents[1] / "kernels"
    header, spectral = ((kernels / name).read_text() for name in ("dqn.cuh", "spectral.cuh"))
    assert f"constexpr int DT_SPECTRAL_COLS_PER_BLOCK = {dqn._SPECTRAL_COLS_PER_BLOCK};" in header
    assert f"constexpr int DT_SPECTRAL_ROWS_PER_BLOCK = {dqn._SPECTRAL_ROWS_PER_BLOCK};" in header
    assert f"constexpr int SPECTRAL_V_CHUNK = {dqn._SPECTRAL_V_CHUNK};" in spectral
    assert dqn.spectral_stage_bytes([4, 256]) == 16 * 256 * 4
    assert dqn.spectral_stage_bytes([128, 1024]) == 16 * 1024 * 4
    assert dqn.spectral_stage_bytes([4200, 3]) == 16 * 1024 * 4
    assert dqn.spectral_stage_bytes([]) == 0
    # The rows kernel by its grid on a 132-SM device: the small configuration's 32 blocks
    # staged, the large one's 128 in registers; the boundary at half the SMs.
    assert dqn.spectral_rows_kernel(32, 132) == "spectral_rows_staged"
    assert dqn.spectral_rows_kernel(66, 132) == "spectral_rows_staged"
    assert dqn.spectral_rows_kernel(67, 132) == "spectral_rows"
    assert dqn.spectral_rows_kernel(128, 132) == "spectral_rows"
    text = (kernels / "dqn.cu").read_text()
    assert " spectral_rows(" in text and " spectral_rows_staged(" in text


def test_priority_update_shape_matches_the_kernels():
    """dqn_priority_update's blocks hold the guard's 256 shares (the order of AdamW's sum of
    the norm's partials) and at most its launch bound; a thread an index up to that bound, in
    each of the blocks that split the tree."""
    from drvtrain.rl import dqn
    kernels = Path(__file__).parents[1] / "kernels"
    step, optim, tree = ((kernels / name).read_text() for name in ("dqn_step.cu", "optim.cuh", "sumtree.cu"))
    assert "constexpr int GUARD_SHARES = ADAM_THREADS;" in step
    assert f"constexpr int ADAM_THREADS = {dqn._GUARD_SHARES};" in optim
    assert f"constexpr int PRIORITY_THREADS = {dqn.UPDATE_THREADS};" in step
    assert f"constexpr int UPDATE_THREADS = {dqn.UPDATE_THREADS};" in tree
    assert [dqn.priority_update_shape(n) for n in (1, 100, 256, 257, 512, 513, 5000)] == \
        [(4, 256), (4, 256), (4, 256), (4, 288), (4, 512), (4, 512), (4, 512)]


def test_fused_head_takes_none_true_or_false():
    assert DQNConfig.small().fused_head is None
    for value in (None, True, False):
        assert DQNConfig.small(fused_head=value).fused_head is value


def test_target_update_is_what_the_kernels_take():
    assert DQNConfig.small(tau=0.01).target_update == (0.01, 0)
    assert DQNConfig.small(tau=None, target_period=250).target_update == (0.0, 250)


def test_the_step_picks_the_builds_compiled_for_its_count_of_actions():
    """Two actions take the head compiled for two, 18 the fused loss compiled for 18;
    every other count the builds that take any (test_compiler checks each is in its CUBIN)."""
    assert head_kernel_name(2) == "dqn_head_a2"
    assert [head_kernel_name(a) for a in (1, 3, 18, 64)] == ["dqn_head"] * 4
    for vec in (4, 16):
        assert loss_dwl_kernel_name(18, vec) == f"dqn_loss_dwl_a18_64x64_cp{vec}_cluster_3xtf32"
        assert {loss_dwl_kernel_name(a, vec) for a in (1, 2, 17, 19, 31)} == \
            {f"dqn_loss_dwl_64x64_cp{vec}_cluster_3xtf32"}
