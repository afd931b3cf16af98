"""The dueling Double-DQN step's float64 reference, checked against its own specification (CPU)."""
import numpy as np
import pytest

from drvtrain.nn.layout import ParamLayout
from dqn_reference import (beta_at, dqn_loss, dqn_step, dueling_q, huber, huber_grad,
                           spectral_project)
from nn_reference import mlp_forward

TINY = [(5, 3), (4, 5), (4, 4)]  # obs_dim 3, hidden 5 and 4, n_actions 3


def outputs(rng, batch, n_actions):
    return rng.standard_normal((batch, 1 + n_actions))


def transitions(rng, batch, n_actions, done_p=0.3):
    return {"action": rng.integers(0, n_actions, batch),
            "reward": rng.standard_normal(batch),
            "done": (rng.random(batch) < done_p).astype(np.float64),
            "weights": rng.uniform(0.1, 1.0, batch)}


def loss_inputs(rng, batch, n_actions):
    tr = transitions(rng, batch, n_actions)
    return dict(q_s_out=outputs(rng, batch, n_actions), q_next_online_out=outputs(rng, batch, n_actions),
                q_next_target_out=outputs(rng, batch, n_actions), action=tr["action"], reward=tr["reward"],
                done=tr["done"], weights=tr["weights"], gamma=rng.uniform(0.5, 0.999),
                delta=rng.uniform(0.3, 2.0))


def padding_mask(layout):
    pad = np.ones(layout.size, bool)
    for s in layout.slots:
        pad[s.offset: s.offset + s.size] = False
    return pad


def make_state(rng, layout, t=None, spectral=None):
    spectral = range(len(layout.layers) - 1) if spectral is None else spectral
    pad = padding_mask(layout)

    def flat(values):
        values[pad] = 0.0
        return values

    params = layout.init_numpy(int(rng.integers(1 << 30))).astype(np.float64)
    return {"params": params,
            "target": flat(params + 0.1 * rng.standard_normal(layout.size)),
            "m": flat(1e-3 * rng.standard_normal(layout.size)),
            "v": flat(1e-6 * rng.random(layout.size)),
            "t": int(rng.integers(0, 50)) if t is None else t,
            "u": {k: rng.standard_normal(layout.layers[k][0]) for k in spectral}}


def make_batch(rng, layout, batch=7):
    obs_dim, n_actions = layout.layers[0][1], layout.layers[-1][0] - 1
    return {"obs": rng.standard_normal((batch, obs_dim)), "next_obs": rng.standard_normal((batch, obs_dim)),
            **transitions(rng, batch, n_actions)}


def make_cfg(**overrides):
    cfg = {"gamma": 0.97, "lr": 1e-2, "weight_decay": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8,
           "max_norm": 10.0, "huber_delta": 1.0, "tau": 0.05, "target_period": None,
           "spectral_layers": [0, 1], "spectral_c": 1.0}
    cfg.update(overrides)
    return cfg


def matrix_with_spectrum(rng, shape, singular):
    o, i = shape
    left, _ = np.linalg.qr(rng.standard_normal((o, len(singular))))
    right, _ = np.linalg.qr(rng.standard_normal((i, len(singular))))
    return left @ np.diag(singular) @ right.T


# ------------------------------------------------------------------ Huber

def test_huber_known_values():
    x = np.array([-3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0])
    np.testing.assert_array_equal(huber(x, 2.0), [4.0, 2.0, 0.5, 0.0, 0.5, 2.0, 4.0])
    np.testing.assert_array_equal(huber_grad(x, 2.0), [-2.0, -2.0, -1.0, 0.0, 1.0, 2.0, 2.0])
    np.testing.assert_array_equal(huber(np.array([0.5, 1.5]), 1.0), [0.125, 1.0])


def test_huber_at_and_around_the_kink(rng):
    delta = rng.uniform(0.2, 5.0)
    while abs(delta - 1.0) < 0.05:
        delta = rng.uniform(0.2, 5.0)
    eps = 1e-9 * delta
    for sign in (-1.0, 1.0):
        at, inside, outside = sign * delta, sign * (delta - eps), sign * (delta + eps)
        assert huber(at, delta) == pytest.approx(0.5 * delta * delta, rel=1e-15)
        assert huber(inside, delta) == pytest.approx(0.5 * inside * inside, rel=1e-15)
        assert huber(outside, delta) == pytest.approx(delta * (delta + eps) - 0.5 * delta * delta, rel=1e-15)
        assert huber_grad(at, delta) == sign * delta
        assert huber_grad(inside, delta) == inside  # the quadratic branch
        assert huber_grad(outside, delta) == sign * delta  # the linear branch
        assert abs(huber(outside, delta) - huber(inside, delta)) < 3 * delta * eps


def test_huber_grad_is_continuous_and_is_the_derivative(rng):
    delta = rng.uniform(0.2, 5.0)
    x = rng.uniform(-4 * delta, 4 * delta, 400)
    x = x[np.abs(np.abs(x) - delta) > 1e-3 * delta]
    h = 1e-6 * delta
    fd = (huber(x + h, delta) - huber(x - h, delta)) / (2 * h)
    np.testing.assert_allclose(huber_grad(x, delta), fd, atol=1e-8 * delta)
    # continuous: tiny steps across the kink move the derivative by a tiny amount
    for kink in (-delta, delta):
        steps = kink + np.array([-1e-10, 0.0, 1e-10]) * delta
        assert np.ptp(huber_grad(steps, delta)) <= 2e-10 * delta
    assert np.all(np.abs(huber_grad(x, delta)) <= delta)


# ------------------------------------------------------------------ dueling head

def test_dueling_row_mean_is_value_and_advantage_shift_is_invisible(rng):
    out = outputs(rng, 9, 5)
    q = dueling_q(out)
    assert q.shape == (9, 5)
    np.testing.assert_allclose(q.mean(axis=1), out[:, 0], rtol=1e-13, atol=1e-13)
    shifted = out.copy()
    shifted[:, 1:] += rng.standard_normal((9, 1)) * 10
    np.testing.assert_allclose(dueling_q(shifted), q, rtol=1e-12, atol=1e-12)
    centred = out.copy()
    centred[:, 1:] -= centred[:, 1:].mean(axis=1, keepdims=True)
    np.testing.assert_allclose(dueling_q(centred), centred[:, :1] + centred[:, 1:], rtol=1e-13, atol=1e-13)


def test_single_action_q_is_the_value_and_its_advantage_gets_no_gradient(rng):
    args = loss_inputs(rng, 6, 1)
    res = dqn_loss(**args)
    np.testing.assert_allclose(res["q"][:, 0], args["q_s_out"][:, 0], rtol=1e-15, atol=1e-15)
    assert np.all(res["a_star"] == 0)
    np.testing.assert_array_equal(res["dout"][:, 1], 0.0)
    td = args["reward"] + args["gamma"] * (1 - args["done"]) * args["q_next_target_out"][:, 0] - args["q_s_out"][:, 0]
    np.testing.assert_allclose(res["td"], td, rtol=1e-13, atol=1e-13)


# ------------------------------------------------------------------ target and loss

def test_argmax_ties_take_the_first_maximum(rng):
    batch, n_actions = 8, 5
    args = loss_inputs(rng, batch, n_actions)
    nxt = args["q_next_online_out"]
    first = rng.integers(0, n_actions - 1, batch)
    second = np.array([rng.integers(f + 1, n_actions) for f in first])
    top = nxt[:, 1:].max(axis=1) + 1.0
    nxt[np.arange(batch), 1 + first] = top
    nxt[np.arange(batch), 1 + second] = top
    args["done"] = np.zeros(batch)
    res = dqn_loss(**args)
    np.testing.assert_array_equal(res["a_star"], first)
    qt = dueling_q(args["q_next_target_out"])
    np.testing.assert_allclose(res["y"], args["reward"] + args["gamma"] * qt[np.arange(batch), first], rtol=1e-13)


def test_terminal_transitions_take_the_reward_as_target(rng):
    args = loss_inputs(rng, 10, 4)
    args["done"] = np.r_[np.ones(5), np.zeros(5)]
    res = dqn_loss(**args)
    np.testing.assert_array_equal(res["y"][:5], args["reward"][:5])
    a_star = dueling_q(args["q_next_online_out"][5:]).argmax(axis=1)
    bootstrap = dueling_q(args["q_next_target_out"][5:])[np.arange(5), a_star]
    np.testing.assert_allclose(res["y"][5:], args["reward"][5:] + args["gamma"] * bootstrap, rtol=1e-13)
    assert np.all(res["y"][5:] != args["reward"][5:])


def test_unit_weights_give_the_plain_mean_huber_loss(rng):
    batch, n_actions = 12, 3
    args = loss_inputs(rng, batch, n_actions)
    args["weights"] = np.ones(batch)
    res = dqn_loss(**args)
    rows = np.arange(batch)
    q_next = dueling_q(args["q_next_target_out"])[rows, dueling_q(args["q_next_online_out"]).argmax(axis=1)]
    y = args["reward"] + args["gamma"] * (1 - args["done"]) * q_next
    td = y - dueling_q(args["q_s_out"])[rows, args["action"]]
    delta = args["delta"]
    plain = np.mean([0.5 * d * d if abs(d) < delta else delta * (abs(d) - 0.5 * delta) for d in td])
    assert res["loss"] == pytest.approx(plain, rel=1e-13)
    weighted = dqn_loss(**{**args, "weights": rng.uniform(0.1, 1.0, batch)})
    assert weighted["loss"] < res["loss"]  # weights below 1 shrink every term


def test_priorities_and_metrics_come_from_the_td_errors(rng):
    args = loss_inputs(rng, 11, 4)
    res = dqn_loss(**args)
    rows = np.arange(11)
    np.testing.assert_array_equal(res["priorities"], np.abs(res["td"]) + 1e-6)
    assert res["mean_abs_td"] == pytest.approx(np.abs(res["td"]).mean(), rel=1e-14)
    assert res["mean_q"] == pytest.approx(res["q"][rows, args["action"]].mean(), rel=1e-13, abs=1e-15)
    assert res["mean_abs_q"] == pytest.approx(np.abs(res["q"][rows, args["action"]]).mean(), rel=1e-14)
    assert res["mean_abs_q"] >= abs(res["mean_q"])
    assert res["a_star"].dtype.kind == "i"


def test_output_gradient_matches_finite_differences(rng):
    batch, n_actions = 9, 4
    args = loss_inputs(rng, batch, n_actions)
    args["q_s_out"] *= 3.0  # spread the TD errors over both Huber branches
    res = dqn_loss(**args)
    fd = np.empty_like(args["q_s_out"])
    h = 1e-6
    for idx in np.ndindex(fd.shape):
        p = args["q_s_out"].copy()
        p[idx] += h
        up = dqn_loss(**{**args, "q_s_out": p})["loss"]
        p[idx] -= 2 * h
        down = dqn_loss(**{**args, "q_s_out": p})["loss"]
        fd[idx] = (up - down) / (2 * h)
    np.testing.assert_allclose(res["dout"], fd, atol=1e-8)
    # The next-state outputs only build the target: the loss has no gradient through them
    assert np.all(res["dout"][:, 0] == -args["weights"] * huber_grad(res["td"], args["delta"]) / batch)


# ------------------------------------------------------------------ spectral projection

def test_spectral_projection_known_case():
    w = np.diag([3.0, 1.0])
    w_new, u_new, sigma = spectral_project(w, np.array([2.0, 0.0]), c=1.0)
    assert sigma == 3.0
    np.testing.assert_array_equal(u_new, [1.0, 0.0])
    np.testing.assert_allclose(w_new, np.diag([1.0, 1.0 / 3.0]), rtol=1e-15)


def test_spectral_sigma_converges_to_the_largest_singular_value(rng):
    o, i = int(rng.integers(3, 9)), int(rng.integers(3, 9))
    top = rng.uniform(1.5, 4.0)
    rest = rng.uniform(0.05, 0.7 * top, min(o, i) - 1)
    w = matrix_with_spectrum(rng, (o, i), np.r_[top, rest])
    u = rng.standard_normal(o)
    c = rng.uniform(0.3, 0.9) * top
    for _ in range(200):
        w_new, u, sigma = spectral_project(w, u, c)
    assert sigma == pytest.approx(np.linalg.norm(w, 2), rel=1e-12)
    assert np.linalg.norm(w_new, 2) <= c * (1 + 1e-12)
    assert np.linalg.norm(u) == pytest.approx(1.0, rel=1e-14)
    # below the bound the weight is returned exactly as it was, while u still moves
    loose = sigma * rng.uniform(1.01, 3.0)
    u0 = rng.standard_normal(o)
    w_same, u1, s1 = spectral_project(w, u0, loose)
    assert s1 <= loose and np.array_equal(w_same, w) and not np.allclose(u1, u0)


def test_spectral_projection_of_a_zero_vector_leaves_the_weight(rng):
    w = rng.standard_normal((4, 6))
    w_new, u_new, sigma = spectral_project(w, np.zeros(4), 1.0)
    assert sigma == 0.0 and np.array_equal(w_new, w) and np.array_equal(u_new, np.zeros(4))


# ------------------------------------------------------------------ beta schedule

def test_beta_schedule_is_linear_then_flat(rng):
    start, end, steps = rng.uniform(0.2, 0.6), rng.uniform(0.7, 1.0), int(rng.integers(10, 1000))
    assert beta_at(0, start, end, steps) == start
    assert beta_at(steps // 2, start, end, steps) == pytest.approx(start + (end - start) * (steps // 2) / steps)
    assert beta_at(steps, start, end, steps) == pytest.approx(end, rel=1e-15)
    assert beta_at(10 * steps, start, end, steps) == beta_at(steps, start, end, steps)
    assert beta_at(3, start, end, 0) == end


# ------------------------------------------------------------------ the whole step

def step_loss(layout, params, target, batch, cfg):
    """The step's loss as a function of the online parameters (a fresh forward each call)."""
    n = len(layout.layers)
    online, tgt = layout.unflatten(params), layout.unflatten(target)
    res = dqn_loss(mlp_forward(online, batch["obs"], n)[-1], mlp_forward(online, batch["next_obs"], n)[-1],
                   mlp_forward(tgt, batch["next_obs"], n)[-1], batch["action"], batch["reward"],
                   batch["done"], batch["weights"], cfg["gamma"], cfg["huber_delta"])
    return res["loss"]


def test_step_gradient_matches_finite_differences(rng):
    layout = ParamLayout(TINY)
    state, batch = make_state(rng, layout), make_batch(rng, layout)
    batch["obs"] *= 3.0
    cfg = make_cfg(betas=(0.0, 0.999), max_norm=1e9, huber_delta=rng.uniform(0.3, 1.5))
    out = dqn_step(layout, state, batch, cfg)
    assert not out["skipped"] and out["clip_scale"] == 1.0
    grad = out["m"]  # with b1 = 0 the first moment is the step's gradient
    pad = padding_mask(layout)
    assert np.all(grad[pad] == 0.0)
    h = 1e-6
    fd = np.zeros(layout.size)
    for k in np.flatnonzero(~pad):
        p = state["params"].copy()
        p[k] += h
        up = step_loss(layout, p, state["target"], batch, cfg)
        p[k] -= 2 * h
        down = step_loss(layout, p, state["target"], batch, cfg)
        fd[k] = (up - down) / (2 * h)
    np.testing.assert_allclose(grad, fd, atol=1e-8)
    assert out["grad_norm"] == pytest.approx(np.linalg.norm(fd), rel=1e-6)
    assert out["loss"] == pytest.approx(step_loss(layout, state["params"], state["target"], batch, cfg), rel=1e-14)


def test_step_clips_the_gradient_before_adamw(rng):
    layout = ParamLayout(TINY)
    state, batch = make_state(rng, layout), make_batch(rng, layout)
    free = dqn_step(layout, state, batch, make_cfg(betas=(0.0, 0.999), max_norm=1e9))
    max_norm = free["grad_norm"] * rng.uniform(0.1, 0.9)
    clipped = dqn_step(layout, state, batch, make_cfg(betas=(0.0, 0.999), max_norm=max_norm))
    scale = max_norm / (free["grad_norm"] + 1e-6)
    assert clipped["clip_scale"] == pytest.approx(scale, rel=1e-14)
    np.testing.assert_allclose(clipped["m"], scale * free["m"], rtol=1e-13, atol=1e-300)
    assert clipped["grad_norm"] == free["grad_norm"]


def test_step_projects_after_adamw_and_the_target_follows_the_projection(rng):
    layout = ParamLayout(TINY)
    state, batch = make_state(rng, layout), make_batch(rng, layout)
    tau = rng.uniform(0.01, 0.5)
    plain = dqn_step(layout, state, batch, make_cfg(tau=tau, spectral_layers=[]))
    assert plain["sigma"] == {} and plain["sigma_max"] == 0.0
    # c below both layers' estimated spectral norms (one power iteration from the state's
    # u; a fixed c sat above one of them for about 1 seed in 400), so both are scaled
    weights = [plain["params"][layout.weight(k).offset: layout.weight(k).offset + layout.weight(k).size]
               .reshape(layout.weight(k).shape) for k in (0, 1)]
    c = 0.5 * min(spectral_project(w, state["u"][k], 1.0)[2] for k, w in enumerate(weights))
    proj = dqn_step(layout, state, batch, make_cfg(tau=tau, spectral_layers=[0, 1], spectral_c=c))
    expected = plain["params"].copy()
    for k in (0, 1):
        slot = layout.weight(k)
        w = plain["params"][slot.offset: slot.offset + slot.size].reshape(slot.shape)
        w_new, u_new, sigma = spectral_project(w, state["u"][k], c)
        assert sigma > c and proj["sigma"][k] == pytest.approx(sigma, rel=1e-14)
        np.testing.assert_allclose(proj["u"][k], u_new, rtol=1e-14)
        expected[slot.offset: slot.offset + slot.size] = w_new.reshape(-1)
    np.testing.assert_allclose(proj["params"], expected, rtol=1e-14, atol=1e-300)
    assert proj["sigma_max"] == max(proj["sigma"].values())
    np.testing.assert_array_equal(proj["m"], plain["m"])  # the projection does not touch the moments
    np.testing.assert_allclose(proj["target"], state["target"] + tau * (proj["params"] - state["target"]),
                               rtol=1e-14, atol=1e-300)
    assert proj["t"] == state["t"] + 1


def test_default_spectral_layers_are_all_but_the_output(rng):
    layout = ParamLayout(TINY)
    state, batch = make_state(rng, layout), make_batch(rng, layout)
    out = dqn_step(layout, state, batch, make_cfg(spectral_layers=None))
    assert sorted(out["sigma"]) == [0, 1]


def test_hard_copy_happens_only_when_t_is_a_multiple_of_the_period(rng):
    layout = ParamLayout(TINY)
    period = int(rng.integers(2, 5))
    state, batch = make_state(rng, layout, t=int(rng.integers(0, 20))), make_batch(rng, layout)
    cfg = make_cfg(tau=None, target_period=period)
    steps, t0, copies = 2 * period + 1, state["t"], 0
    for _ in range(steps):
        before = state["target"]
        state = dqn_step(layout, state, batch, cfg)
        if state["t"] % period == 0:
            copies += 1
            np.testing.assert_array_equal(state["target"], state["params"])
        else:
            np.testing.assert_array_equal(state["target"], before)
            assert not np.array_equal(state["target"], state["params"])
    assert copies == (t0 + steps) // period - t0 // period >= 2


def test_polyak_moves_the_target_every_step(rng):
    layout = ParamLayout(TINY)
    tau = rng.uniform(0.001, 0.1)
    state, batch = make_state(rng, layout), make_batch(rng, layout)
    out = dqn_step(layout, state, batch, make_cfg(tau=tau))
    np.testing.assert_allclose(out["target"], (1 - tau) * state["target"] + tau * out["params"], rtol=1e-13, atol=1e-300)
    assert np.all(out["target"][padding_mask(layout)] == 0.0)


def test_step_refuses_an_ambiguous_target_rule(rng):
    layout = ParamLayout(TINY)
    state, batch = make_state(rng, layout), make_batch(rng, layout)
    for tau, period in ((0.01, 5), (None, None)):
        with pytest.raises(ValueError, match="exactly one of tau"):
            dqn_step(layout, state, batch, make_cfg(tau=tau, target_period=period))
    with pytest.raises(ValueError, match="no spectral u vector for layers \\[1\\]"):
        dqn_step(layout, {**state, "u": {0: state["u"][0]}}, batch, make_cfg())


def test_step_priorities_and_metrics_use_the_parameters_before_the_update(rng):
    layout = ParamLayout(TINY)
    state, batch = make_state(rng, layout), make_batch(rng, layout)
    cfg = make_cfg()
    out = dqn_step(layout, state, batch, cfg)
    n = len(layout.layers)
    online, tgt = layout.unflatten(state["params"]), layout.unflatten(state["target"])
    res = dqn_loss(mlp_forward(online, batch["obs"], n)[-1], mlp_forward(online, batch["next_obs"], n)[-1],
                   mlp_forward(tgt, batch["next_obs"], n)[-1], batch["action"], batch["reward"],
                   batch["done"], batch["weights"], cfg["gamma"], cfg["huber_delta"])
    np.testing.assert_allclose(out["priorities"], res["priorities"], rtol=1e-14)
    assert out["mean_q"] == pytest.approx(res["mean_q"], rel=1e-14, abs=1e-15)
    assert out["mean_abs_td"] == pytest.approx(res["mean_abs_td"], rel=1e-14)


def test_nan_reward_skips_the_step_and_changes_nothing(rng):
    layout = ParamLayout(TINY)
    state, batch = make_state(rng, layout), make_batch(rng, layout)
    batch["reward"][int(rng.integers(0, len(batch["reward"])))] = np.nan
    snapshot = {k: np.array(state[k]) for k in ("params", "target", "m", "v")}
    u_before = {k: vec.copy() for k, vec in state["u"].items()}
    out = dqn_step(layout, state, batch, make_cfg())
    assert out["skipped"] and np.isnan(out["loss"]) and out["priorities"] is None
    assert out["clip_scale"] == 0.0 and out["sigma"] == {} and out["sigma_max"] == 0.0
    for k, before in snapshot.items():
        np.testing.assert_array_equal(out[k], before)
        np.testing.assert_array_equal(state[k], before)  # the inputs are not modified either
    assert out["t"] == state["t"]
    assert out["u"].keys() == u_before.keys()
    for k in u_before:
        np.testing.assert_array_equal(out["u"][k], u_before[k])
    # the same batch with a finite reward is not skipped and does change the state
    batch["reward"] = np.nan_to_num(batch["reward"])
    ok = dqn_step(layout, state, batch, make_cfg())
    assert not ok["skipped"] and ok["t"] == state["t"] + 1 and not np.array_equal(ok["params"], state["params"])
