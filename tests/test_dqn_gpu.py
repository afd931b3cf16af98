"""The Double-DQN step on the GPU against the float64 reference of docs/step-spec.md."""
import dataclasses
import math

import numpy as np
import pytest

from drvtrain import DeviceBuffer, Stream, capture, dependent_launches
from drvtrain.rl import DQNConfig, DQNStep, TrainingError
from drvtrain.nn.mlp import WGMMA_TILE, wgmma_available
from drvtrain.rl.dqn import audit_step, head_kernel_name, loss_dwl_kernel_name
from child import run_python
from dqn_reference import dqn_loss, dqn_step, dueling_q, spectral_project
from late_writer import LATE_NS, late_copy, skip_unless_a_read_can_race, words
from nn_reference import mlp_backward, mlp_forward, rel
from per_reference import fixed_order_nodes, tree_inconsistency

pytestmark = pytest.mark.gpu

ODD = dict(obs_dim=3, hidden=(70, 33), n_actions=4, batch=100, capacity=1000)  # no tile multiples


def fill(step, rng, stream, done_fraction=0.05, priorities=None):
    """Random transitions and priorities in [0.1, 1.1), as the benchmark fills its replay."""
    cfg = step.config
    c, d = cfg.capacity, cfg.obs_dim
    data = dict(obs=rng.standard_normal((c, d)).astype(np.float32),
                action=rng.integers(0, cfg.n_actions, c).astype(np.int32),
                reward=rng.standard_normal(c).astype(np.float32),
                next_obs=rng.standard_normal((c, d)).astype(np.float32),
                done=(rng.random(c) < done_fraction).astype(np.float32))
    step.replay.insert(data["obs"], data["action"], data["reward"], data["next_obs"], data["done"], stream=stream)
    if priorities is None:
        priorities = rng.uniform(0.1, 1.1, c)
    step.replay.tree.set_priorities(np.asarray(priorities, np.float32))
    return data


def ref_config(cfg):
    return dict(gamma=cfg.gamma, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=cfg.betas, eps=cfg.eps,
                max_norm=cfg.max_norm, huber_delta=cfg.huber_delta, tau=cfg.tau, target_period=cfg.target_period,
                spectral_layers=list(cfg.projected_layers), spectral_c=cfg.spectral_c or 1.0)


def ref_state(step):
    s = step.state_numpy()
    u = {}
    for row, k in zip(step.spectral_table, step.config.projected_layers):
        u[k] = s["u"][row["u_offset"]: row["u_offset"] + row["rows"]].astype(np.float64)
    return dict(params=s["params"], target=s["target"], m=s["m"], v=s["v"], t=int(s["t"]), u=u)


def sampled_batch(step, data):
    b = step.last.batch
    idx = b.indices.to_numpy()
    assert np.all((idx >= 0) & (idx < step.config.capacity))
    batch = dict(obs=data["obs"][idx], next_obs=data["next_obs"][idx], action=data["action"][idx],
                 reward=data["reward"][idx], done=data["done"][idx], weights=b.weights.to_numpy(),
                 a_star=step.last.extra["a_star"].to_numpy())
    np.testing.assert_array_equal(b.obs.to_numpy(), batch["obs"])  # the fused gather
    np.testing.assert_array_equal(b.next_obs.to_numpy(), batch["next_obs"])
    np.testing.assert_array_equal(b.action.to_numpy(), batch["action"])
    assert np.all(np.isfinite(batch["weights"])) and batch["weights"].max() == 1.0
    return idx, batch


def device_relu_masks(step, params, obs):
    """The ReLU decisions of the device's online pass over s, for the float64 reference to
    follow. Float32 and float64 may decide a pre-activation within rounding of 0 either way,
    and one such unit moves a whole row of its layer's gradient; anywhere else the two
    must agree, which this checks."""
    named = step.layout.unflatten(params)
    layers = len(step.layout.layers)
    acts = mlp_forward(named, obs, layers)
    device_acts = step.last.extra["online_forward"].activations
    masks = []
    for k in range(layers - 1):
        w, b = (named[f"layer{k}.{p}"].astype(np.float64) for p in ("weight", "bias"))
        z = acts[k] @ w.T + b
        keep = device_acts[k + 1].to_numpy() > 0
        differ = keep != (z > 0)
        scale = np.sqrt(np.mean(z * z))
        assert np.all(np.abs(z[differ]) <= 1e-4 * scale), \
            f"layer {k}: {differ.sum()} ReLU decisions differ, up to |z| = {np.abs(z[differ]).max():.3g}"
        masks.append(keep)
    return masks


def assert_state_close(step, want, bound, params_bound=None, reference_u=True):
    """m and v carry the gradient itself: held to ``bound``. AdamW's update is
    sign-like early on (m / sqrt(v) is about +-1 at t = 1), so a gradient
    component that cancels down to float32 rounding noise can flip its update:
    params and target get ``params_bound``. u is held to ``bound`` unless
    ``reference_u`` is False: one such flip moves W, and u with it, by far more
    than rounding (assert_spectral_from_device_weights checks u from the device's
    own W instead)."""
    got = ref_state(step)
    for key in ("m", "v"):
        assert rel(got[key], want[key]) < bound, key
    for key in ("params", "target"):
        assert rel(got[key], want[key]) < (params_bound or bound), key
    assert got["t"] == want["t"]
    if reference_u:
        for k, u in want["u"].items():
            assert rel(got["u"][k], u) < bound, f"u of layer {k}"


def adamw_of_device_moments(step, before, cfg):
    """The state after the step, and the parameters AdamW makes of ``before`` with the
    device's own new m and v, in float64: the weights the spectral projection starts from."""
    after = ref_state(step)
    b1, b2 = cfg.betas
    t = after["t"]
    theta = before["params"].astype(np.float64) * (1 - cfg.lr * cfg.weight_decay)
    m_hat, v_hat = after["m"] / (1 - b1 ** t), after["v"] / (1 - b2 ** t)
    theta -= cfg.lr * m_hat / (np.sqrt(v_hat) + cfg.eps)
    return after, theta


def assert_spectral_from_device_weights(step, before, cfg, bound=1e-5):
    """Each projected layer's u, sigma and scale are spectral_project, in float64, of the
    weights the device's AdamW left (made from its own m and v) and the u it held before
    the step, to ``bound``. From the reference step's weights they would not hold so
    tightly: a gradient component that float32 and float64 round to opposite signs moves
    its weight by about 2 lr under AdamW's sign-like update, and u and sigma with it."""
    after, theta = adamw_of_device_moments(step, before, cfg)
    sigma, scale = step.sigma.to_numpy(), step.spectral_scale.to_numpy()
    c = float(np.float32(cfg.spectral_c or 1.0))
    for m, (row, k) in enumerate(zip(step.spectral_table, cfg.projected_layers)):
        rows, cols, wo = (int(row[key]) for key in ("rows", "cols", "w_offset"))
        _, u_want, sigma_want = spectral_project(theta[wo: wo + rows * cols].reshape(rows, cols), before["u"][k], c)
        assert rel(after["u"][k], u_want) < bound, f"u of layer {k}"
        assert abs(sigma[m] - sigma_want) <= bound * sigma_want, (f"sigma of layer {k}", sigma[m], sigma_want)
        assert abs(scale[m] - min(1.0, c / sigma_want)) <= bound, (f"scale of layer {k}", scale[m], sigma_want)


def assert_adamw_and_projection_exact(step, before, cfg):
    """The parameters are AdamW of the device's own m and v, then the spectral scale:
    the update arithmetic itself, to float32 rounding."""
    after, theta = adamw_of_device_moments(step, before, cfg)
    scales = step.spectral_scale.to_numpy()
    for row, s in zip(step.spectral_table, scales[: step.n_spectral]):
        w = slice(row["w_offset"], row["w_offset"] + row["rows"] * row["cols"])
        theta[w] *= s
    assert rel(after["params"], theta) < 1e-6


def one_step(cfg, rng, bound=1e-5, done_fraction=0.05, priorities=None):
    stream = Stream()
    step = DQNStep(cfg)
    data = fill(step, rng, stream, done_fraction, priorities)
    before = ref_state(step)
    step.enqueue(stream=stream)
    step.metrics.record(stream)
    stream.synchronize()
    idx, batch = sampled_batch(step, data)
    batch["masks"] = device_relu_masks(step, before["params"], batch["obs"])
    # The device's a* is the float64 argmax wherever the top two Q values are not a near tie.
    q_next = dueling_q(mlp_forward(step.layout.unflatten(before["params"]), batch["next_obs"],
                                   len(step.layout.layers))[-1])
    top = np.sort(q_next, axis=1)
    clear = ((top[:, -1] - top[:, -2] > 1e-4 * (1 + np.abs(top[:, -1]))) if cfg.n_actions > 1
             else np.ones(len(idx), bool))
    # A near tie belongs to a transition, and prioritized sampling can draw one transition many
    # times (a heavy leaf can take nearly a third of the batch): each sampled transition counts once.
    _, first = np.unique(idx, return_index=True)
    assert clear[first].mean() > 0.8
    np.testing.assert_array_equal(batch["a_star"][clear], np.argmax(q_next, axis=1)[clear])
    want = dqn_step(step.layout, before, batch, ref_config(cfg))
    assert not want["skipped"]
    # u from the device's own weights: from the reference step's, one AdamW sign flip at t = 1
    # moves u by more than rounding (assert_state_close says why).
    assert_state_close(step, want, bound, params_bound=1e-4, reference_u=False)
    assert_spectral_from_device_weights(step, before, cfg, bound)
    assert_adamw_and_projection_exact(step, before, cfg)
    assert rel(step.last.priorities.to_numpy(), want["priorities"]) < bound
    leaves = step.replay.tree.leaves_numpy()
    once = np.flatnonzero(np.bincount(idx, minlength=cfg.capacity)[idx] == 1)
    assert rel(leaves[idx[once]], want["priorities"][once] ** cfg.alpha) < bound
    (m,) = step.metrics.poll()
    assert m.step == 1
    for name in ("loss", "grad_norm", "clip_scale", "mean_q", "mean_abs_td", "sigma_max"):
        scale = want["mean_abs_q"] if name == "mean_q" else abs(want[name])  # a mean of Q can cancel to ~0
        assert abs(getattr(m, name) - want[name]) <= bound * max(scale, 1e-3), name
    assert m.beta == pytest.approx(cfg.beta, abs=1e-7)
    return step, data


@pytest.mark.parametrize("overrides", [
    dict(ODD, tf32=False),
    dict(ODD, tf32=False, n_actions=1),
    dict(ODD, tf32=False, tau=None, target_period=1, spectral_layers=(1,), spectral_c=0.5),
    dict(ODD, tf32=False, spectral_c=None, huber_delta=0.3, max_norm=0.01),
    dict(obs_dim=4, hidden=(256, 256), n_actions=2, batch=256, capacity=4096, tf32=False),
    dict(obs_dim=128, hidden=(1024, 1024), n_actions=18, batch=512, capacity=4096, tf32=False),
    dict(ODD, tf32=False, fused=True),
    dict(obs_dim=4, hidden=(256, 256), n_actions=2, batch=256, capacity=4096, tf32=False, fused=True),
    dict(ODD, tf32=False, n_actions=1, batch=102, fused_head=True),
    dict(obs_dim=128, hidden=(1024, 1024), n_actions=18, batch=512, capacity=4096, tf32=False, fused_head=True),
    dict(obs_dim=128, hidden=(1024, 1024), n_actions=18, batch=512, capacity=4096, tf32=False, presplit=True),
    dict(obs_dim=128, hidden=(1024, 1024), n_actions=18, batch=512, capacity=4096, tf32=False, fused_head=True,
         presplit=True, dual_stream=False),
    dict(ODD, tf32=False, batch=102, fused_head=True),
    # Projected layers wider than the spectral kernels' 1024-column chunk: float4 and scalar rows.
    dict(obs_dim=3, hidden=(1100, 40), n_actions=3, batch=64, capacity=1024, tf32=False),
    dict(obs_dim=3, hidden=(1030, 24), n_actions=3, batch=64, capacity=1024, tf32=False),
    # Six projected layers: the finish pass sums ||y|| four matrices at a time, so two rounds.
    dict(obs_dim=3, hidden=(40, 24, 33, 17, 20, 28), n_actions=3, batch=64, capacity=1024, tf32=False),
    # A projected layer of 4200 rows: 263 row partials, more than a finish block's threads.
    dict(obs_dim=3, hidden=(4200, 8), n_actions=3, batch=64, capacity=1024, tf32=False),
    # The three forwards as one launch of thread block clusters.
    dict(ODD, tf32=False, cluster_forward=True),
    dict(obs_dim=4, hidden=(256, 256), n_actions=2, batch=256, capacity=4096, tf32=False, cluster_forward=True),
    dict(ODD, tf32=False, batch=102, fused_head=True, cluster_forward=True),
], ids=["odd-shapes", "one-action", "hard-copy-spectral-c", "no-spectral-clipped", "small", "large",
        "odd-shapes-fused", "small-fused", "one-action-fused-head", "large-fused-head", "large-presplit",
        "large-fused-head-presplit-one-stream",
        "odd-shapes-fused-head", "wide-rows-float4", "wide-rows-scalar", "six-projected-layers",
        "tall-projected-layer", "odd-shapes-cluster-forward",
        "small-cluster-forward", "odd-shapes-fused-head-cluster-forward"])
def test_one_fp32_step_matches_float64(device, rng, overrides):
    step, _ = one_step(DQNConfig(seed=int(rng.integers(1 << 30)), **overrides), rng)
    # A share of the SMs for each forward only where three per-layer forwards run side by side.
    side_by_side = bool(step.streams) and step._forward_net is None
    assert step._forward_sms == (device.sm_count // 3 if side_by_side else None)
    assert side_by_side == (overrides.get("dual_stream", True) and not overrides.get("cluster_forward")
                            and not (overrides.get("fused") and step.narrow is not None))
    nodes = step_kernels(step)
    names = {k.function for k in nodes}
    want_cluster = bool(overrides.get("cluster_forward"))
    assert (step.cluster_net is not None) == want_cluster
    assert ("narrow_forward_cluster_f32" in names) == want_cluster, names
    # A narrow net running the three forwards runs kernels compiled for the step's shape:
    # the captured forward node is that build's function, not the general one.
    forward_net = step.narrow if step.narrow is not None else step.cluster_net
    if forward_net is not None:
        hidden = len(step.layout.layers) - (step._head is not None)
        assert forward_net.fixed_shapes() == [(step.config.batch, hidden)]
        which = "forward_cluster" if want_cluster else "forward"
        fixed = forward_net._fixed[(step.config.batch, hidden)][which]
        forwards = [k for k in nodes if k.function == fixed.name]
        assert len(forwards) == 1 and forwards[0].handle == int(fixed.function), forwards
        assert forwards[0].handle != int(forward_net._kernel(which).function)


def loss_scales(res) -> tuple:
    """What the loss kernels' loss, mean Q and mean |td| are compared against: each its own
    size (at least 1e-3), and for the mean of Q, which can cancel to about 0, the mean of |Q|:
    a float32 sum of B values errs by some ulp of the sum of their sizes."""
    return (max(abs(res["loss"]), 1e-3), max(abs(res["mean_q"]), res["mean_abs_q"], 1e-3),
            max(abs(res["mean_abs_td"]), 1e-3))


def step_kernels(step):
    """The kernel nodes of the step, captured and not run."""
    stream = Stream()
    with capture(stream) as graph:
        step.enqueue(stream=stream)
    nodes = graph.kernel_nodes()
    graph.close()
    return nodes


def test_terminal_transitions_and_duplicate_indices(device, rng):
    """Three heavy leaves take most of the mass, so strata repeat them; 60% terminal.
    The tree stays consistent."""
    cfg = DQNConfig(seed=int(rng.integers(1 << 30)), tf32=False, **dict(ODD, capacity=64, batch=64))
    priorities = rng.uniform(0.1, 0.2, 64)
    priorities[rng.choice(64, 3, replace=False)] = 500.0
    step, _ = one_step(cfg, rng, done_fraction=0.6, priorities=priorities)
    idx = step.last.batch.indices.to_numpy()
    assert len(np.unique(idx)) < len(idx)
    tree = step.replay.tree
    nodes = tree.nodes_numpy()
    assert nodes.tobytes() == fixed_order_nodes(tree.leaves.to_numpy(), tree.levels, tree.internal).tobytes()
    assert tree_inconsistency(nodes, tree.leaves.to_numpy(), tree.levels) <= 1e-12
    leaves = tree.leaves_numpy()
    written = step.last.priorities.to_numpy().astype(np.float64) ** cfg.alpha
    for i in np.unique(idx):  # a duplicated leaf ends as one of the values written to it
        assert np.min(np.abs(written[idx == i] - leaves[i]) / written[idx == i]) < 1e-6


LARGE = dict(obs_dim=128, hidden=(1024, 1024), n_actions=18, batch=512, capacity=4096)


@pytest.mark.parametrize("fused_head, cluster_forward, shape", [
    (False, False, ODD), (True, False, ODD), (False, True, ODD), (True, True, ODD), (False, False, LARGE)],
    ids=["separate-head", "fused-head", "cluster-forward", "fused-head-cluster-forward", "large"])
def test_tf32_step_matches_float64_at_tf32_accuracy(device, rng, fused_head, cluster_forward, shape):
    cfg = DQNConfig(seed=int(rng.integers(1 << 30)), tf32=True, fused_head=fused_head,
                    cluster_forward=cluster_forward, **shape)
    stream = Stream()
    step = DQNStep(cfg)
    # The DQN step keeps the first layer's own launch (MLP(fold_first_layer=False)).
    assert not step.online_mlp.first_layer_folded(cfg.batch)
    assert not any("_x0_" in k.function for k in step_kernels(step))
    if shape is LARGE and wgmma_available(device):
        # The three forwards run side by side, each planned for a third of the SMs: the
        # 1024-wide layers on the wgmma tile unsplit, the second with the output layer
        # computed in its epilogue (MLP.head_folded).
        assert step._forward_sms == device.sm_count // 3
        assert step.online_mlp.head_folded(cfg.batch, sms=step._forward_sms)
        nodes = step_kernels(step)
        for name in ("linear_forward_relu_wgmma_tf32", "linear_forward_relu_head_wgmma_tf32"):
            grids = [tuple(k.grid) for k in nodes if k.function == name]
            assert grids == [(8, 4, 1)] * 3, (name, grids)
        assert not any(k.function == "linear_forward_wgmma_tf32" for k in nodes)
    data = fill(step, rng, stream)
    before = ref_state(step)
    step.enqueue(stream=stream)
    stream.synchronize()
    _, batch = sampled_batch(step, data)
    named = step.layout.unflatten(before["params"])
    target_named = step.layout.unflatten(before["target"])
    n = len(step.layout.layers)
    acts = mlp_forward(named, batch["obs"], n)
    outs = {"q_s": acts[-1], "q_next_online": mlp_forward(named, batch["next_obs"], n)[-1],
            "q_next_target": mlp_forward(target_named, batch["next_obs"], n)[-1]}
    got = {k: getattr(step.last, k).to_numpy() for k in outs}
    for k in outs:  # the hidden layers run on TF32 tensor cores (and the output layer too, unless fused)
        assert rel(got[k], outs[k]) < 3e-3, k
    # The loss kernel is FP32: fed the device's own network outputs it matches to 1e-5.
    res = dqn_loss(got["q_s"], got["q_next_online"], got["q_next_target"], batch["action"], batch["reward"],
                   batch["done"], batch["weights"], cfg.gamma, cfg.huber_delta)
    assert rel(step.last.dout.to_numpy(), res["dout"]) < 1e-5
    assert rel(step.last.priorities.to_numpy(), res["priorities"]) < 1e-5
    assert abs(step.loss.to_numpy()[0] - res["loss"]) < 1e-5 * res["loss"]
    # The FP32 backward, fed the TF32 forward's own activations: FP32 accuracy.
    device_acts = [a.to_numpy().astype(np.float64) for a in step.last.extra["online_forward"].activations]
    want = mlp_backward(named, device_acts, step.last.dout.to_numpy())
    got_grads = step.grads.to_numpy()
    for name, w in want.items():
        assert rel(got_grads[name], w) < 1e-5, name


def test_fifty_fp32_steps_each_match_float64_from_the_device_state(device, rng):
    """Fifty steps, each checked against one float64 reference step from the state the
    device holds before it: the schedules (beta, the step count, the target update), the
    moments and the priorities that steer the next step's sample all carry over. The
    reference restarts from the device's state every step, since two float32 runs of
    fifty AdamW steps drift apart by more than their rounding once an update component
    that cancels to noise flips sign. For the same reason, at this lr even within one
    step, u, sigma and the scale are checked from the device's own AdamW weights."""
    cfg = DQNConfig(seed=int(rng.integers(1 << 30)), tf32=False, lr=3e-3, beta=(0.4, 1.0, 30), **ODD)
    stream = Stream()
    step = DQNStep(cfg)
    data = fill(step, rng, stream)
    rcfg = ref_config(cfg)
    for k in range(50):
        before = ref_state(step)
        step.enqueue(stream=stream)
        step.metrics.record(stream)
        stream.synchronize()
        idx, batch = sampled_batch(step, data)
        batch["masks"] = device_relu_masks(step, before["params"], batch["obs"])
        want = dqn_step(step.layout, before, batch, rcfg)
        assert not want["skipped"]
        # u from the device's own W: see assert_state_close.
        assert_state_close(step, want, 1e-5, params_bound=1e-4, reference_u=False)
        assert_spectral_from_device_weights(step, before, cfg)
        assert_adamw_and_projection_exact(step, before, cfg)
        assert rel(step.last.priorities.to_numpy(), want["priorities"]) < 1e-5
        leaves = step.replay.tree.leaves_numpy()
        once = np.flatnonzero(np.bincount(idx, minlength=cfg.capacity)[idx] == 1)
        assert rel(leaves[idx[once]], want["priorities"][once] ** cfg.alpha) < 1e-5
        (m,) = step.metrics.poll()
        assert m.step == k + 1
        assert m.beta == pytest.approx(0.4 + 0.6 * min(1.0, k / 30), abs=1e-6)


def random_transitions(rng, cfg) -> dict:
    """A full replay's worth of transitions for ``cfg`` (3-dimensional observations, 4 actions)."""
    c = cfg.capacity
    return dict(obs=rng.standard_normal((c, 3)).astype(np.float32), action=rng.integers(0, 4, c).astype(np.int32),
                reward=rng.standard_normal(c).astype(np.float32),
                next_obs=rng.standard_normal((c, 3)).astype(np.float32),
                done=(rng.random(c) < 0.05).astype(np.float32),
                priorities=rng.uniform(0.1, 1.1, c).astype(np.float32))


def run_losses(cfg, data, steps, *, graph, arena_active):
    stream = Stream()
    step = DQNStep(cfg, arena_active=arena_active)
    step.replay.insert(data["obs"], data["action"], data["reward"], data["next_obs"], data["done"], stream=stream)
    step.replay.tree.set_priorities(data["priorities"])
    exe = step.capture(stream=stream) if graph else None
    losses = []
    for _ in range(steps):
        exe.launch(stream) if graph else step.enqueue(stream=stream)
        step.metrics.record(stream)
        losses.extend(m.loss for m in step.metrics.poll())
    stream.synchronize()
    losses.extend(m.loss for m in step.metrics.poll())
    assert step.metrics.missed == 0 and len(losses) == steps
    tree = step.replay.tree
    state = dict(step.state_numpy(), nodes=tree.nodes_numpy(), leaves=tree.leaves.to_numpy())
    # The sums above the updated leaves are recomputed in a fixed order: the nodes are a function of the leaves.
    assert state["nodes"].tobytes() == fixed_order_nodes(state["leaves"], tree.levels, tree.internal).tobytes()
    return np.array(losses, np.float32), state


def test_eager_graph_and_inactive_arena_are_bitwise_identical(device, rng):
    cfg = DQNConfig(seed=int(rng.integers(1 << 30)), **ODD)
    data = random_transitions(rng, cfg)
    eager, s1 = run_losses(cfg, data, 200, graph=False, arena_active=True)
    replay, s2 = run_losses(cfg, data, 200, graph=True, arena_active=True)
    inactive, s3 = run_losses(cfg, data, 200, graph=False, arena_active=False)
    # Dependent launches only move when a kernel may start, never what it computes.
    assert cfg.dependent_launch
    ordinary, s4 = run_losses(dataclasses.replace(cfg, dependent_launch=False), data, 200, graph=True,
                              arena_active=True)
    # The cooperative tail runs the very code of the six kernels it replaces.
    assert not cfg.fused_tail
    tail, s5 = run_losses(dataclasses.replace(cfg, fused_tail=True), data, 200, graph=True, arena_active=True)
    assert np.all(np.isfinite(eager))
    assert eager.tobytes() == replay.tobytes() == inactive.tobytes() == ordinary.tobytes() == tail.tobytes()
    for key in ("params", "target", "m", "v", "u", "nodes", "leaves"):
        assert s1[key].tobytes() == s2[key].tobytes() == s3[key].tobytes() == s4[key].tobytes() \
            == s5[key].tobytes(), key


def run_steps_a_graph(cfg, data_seed, steps, per_graph, eager=False):
    """``steps`` steps from one filled replay, ``per_graph`` of them a replayed graph (or
    an eager ``enqueue``): their metrics (float32 words, every field), the learner's
    state and the tree's, and the graph (captured, not launched, when eager)."""
    stream = Stream()
    step = DQNStep(cfg)
    fill(step, np.random.default_rng(data_seed), stream)
    exe = step.capture(stream=stream, steps=per_graph)
    for _ in range(steps // per_graph):
        if eager:
            step.enqueue(stream=stream, steps=per_graph)
        else:
            exe.launch(stream)
        for _ in range(per_graph):
            step.metrics.record(stream)
    stream.synchronize()
    metrics = step.metrics.poll()
    assert step.metrics.missed == 0 and [m.step for m in metrics] == list(range(1, steps + 1))
    words = np.array([[m.values[f] for f in step.metrics.fields] for m in metrics], np.float32)
    state = step.state_numpy()
    tree = step.replay.tree
    state.update(leaves=tree.leaves.to_numpy(), nodes=tree.nodes.to_numpy(), drawn=tree.step.to_numpy())
    step.check_errors()
    exe.close()
    graph, draws_beside = step.graph, step._draws_beside_the_tail
    step.close()
    stream.close()
    return words, state, graph, draws_beside


@pytest.mark.parametrize("shape, eager", [
    (ODD, False), (ODD, True), (dict(obs_dim=4, hidden=(256, 256), n_actions=2, batch=256, capacity=8192), False),
    (dict(obs_dim=128, hidden=(1024, 1024), n_actions=18, batch=512, capacity=8192, presplit=True), False),
    (dict(ODD, dependent_launch=False), False), (dict(ODD, dual_stream=False), False),
    (dict(ODD, fused_tail=True), False)],
    ids=["odd-widths", "odd-widths-eager", "small", "large-presplit", "no-dependent-launch", "one-stream",
         "cooperative-tail"])
def test_consecutive_steps_in_one_graph_are_the_single_steps_bit_for_bit(device, rng, shape, eager):
    """Four steps captured as one graph (or queued eagerly, four an enqueue) give every
    metric and every state word that four replays of the one-step graph give, over
    twelve steps; beta anneals, so each
    step publishes a beta of its own. With side streams each step after the first
    draws on the update stream after the step before's priority update, beside its
    spectral phases and finish pass, and its IS weights (which write the beta that
    finish pass publishes) wait for that pass."""
    cfg = DQNConfig(seed=int(rng.integers(1 << 30)), beta=(0.3, 1.0, 10), **shape)
    data_seed = int(rng.integers(1 << 30))
    one, one_state, _, _ = run_steps_a_graph(cfg, data_seed, 12, 1)
    four, four_state, graph, draws_beside = run_steps_a_graph(cfg, data_seed, 12, 4, eager=eager)
    # beta is the last field: 0.3 + 0.7 min(1, k / 10) at the k-th draw, k = 0 .. 11
    assert np.all(np.isfinite(one)) and len(set(one[:, -1].tolist())) == 11
    assert one.tobytes() == four.tobytes()
    for key in one_state:
        assert np.asarray(one_state[key]).tobytes() == np.asarray(four_state[key]).tobytes(), key
    assert draws_beside == (cfg.dual_stream and not cfg.fused_tail)
    kernels = graph.kernel_nodes()
    assert len(graph.nodes()) == len(kernels)  # so a node's dependencies are kernels
    named = lambda name: [k.node for k in kernels if k.function == name]
    draws, updates, weights = named("sumtree_sample"), named("dqn_priority_update"), named("sumtree_weights")
    finishes = named("dqn_finish") or named("dqn_tail")
    assert len(draws) == len(finishes) == 4
    for before, after in zip(range(3), range(1, 4)):
        if draws_beside:
            assert graph.dependencies(draws[after]) == [updates[before]]
            assert graph.can_run_concurrently(draws[after], finishes[before])
            assert {finishes[before].index, draws[after].index} <= {n.index for n in graph.dependencies(
                weights[after])}
        else:
            assert not graph.can_run_concurrently(draws[after], finishes[before])


def test_consecutive_steps_refuse_a_bad_count_and_fixed_draws(device, rng):
    cfg = DQNConfig(seed=int(rng.integers(1 << 30)), **ODD)
    stream = Stream()
    step = DQNStep(cfg)
    for bad in (True, 2.0):
        with pytest.raises(ValueError, match="steps must be an integer"):
            step.enqueue(stream=stream, steps=bad)
    for bad in (0, -1, step.metrics.slots + 1):  # more steps a launch than the metrics ring holds
        with pytest.raises(ValueError, match=rf"steps must be in \[1, {step.metrics.slots}\]"):
            step.enqueue(stream=stream, steps=bad)
        with pytest.raises(ValueError, match=r"steps must be in"):
            step.capture(stream=stream, steps=bad)
    assert not stream.is_capturing()
    uniforms = DeviceBuffer.from_numpy(rng.random(cfg.batch))
    with pytest.raises(ValueError, match="uniforms replace one step's draws"):
        step.enqueue(stream=stream, uniforms=uniforms, steps=2)
    step.close()
    stream.close()


def test_tail_with_more_spectral_blocks_than_its_grid_matches_the_six_kernels(device, rng):
    """Layers of 2200 rows and 2200 columns: both spectral phases have more blocks
    than the cooperative tail's grid (at most one per SM), so its blocks loop over
    phase blocks; the result is still the separate kernels' bit for bit (whose
    maths the float64 reference tests check)."""
    cfg = DQNConfig(obs_dim=3, hidden=(2200, 40), n_actions=4, batch=64, capacity=1024, spectral_c=0.5,
                    seed=int(rng.integers(1 << 30)), fused_tail=True)
    data = random_transitions(rng, cfg)
    step = DQNStep(cfg)
    cb, rb = step._spectral_grids
    assert min(cb, rb) > step._tail_grid, (cb, rb, step._tail_grid)
    step.close()
    fused, s1 = run_losses(cfg, data, 30, graph=True, arena_active=True)
    separate, s2 = run_losses(dataclasses.replace(cfg, fused_tail=False), data, 30, graph=True, arena_active=True)
    assert np.all(np.isfinite(fused)) and fused.tobytes() == separate.tobytes()
    for key in ("params", "target", "m", "v", "u"):
        assert s1[key].tobytes() == s2[key].tobytes(), key


@pytest.mark.parametrize("target", [dict(), dict(tau=None, target_period=1)], ids=["polyak", "hard-copy"])
def test_finish_pass_reads_only_what_no_spectral_phase_writes_before_its_wait(device, rng, target):
    """dqn_finish loads the skip flag, t, its first float4 of params and target and the
    metrics' operands before its grid wait (the spectral phases write none of them), and
    the rows phase's partials and y after it. With both poisoned, then written by
    `late_copy`, the kernel before it under dependent launch, the parameters, the target
    network, u, sigma, the scale, the step counter and the metrics slot are the bits of an
    ordinary launch: a finish pass that read y or the partials before its wait would meet
    the poison. Both target rules: Polyak averaging, and a hard copy due every step (t
    read before the wait decides it)."""
    skip_unless_a_read_can_race(device, early=False)
    stream = Stream()
    step = trained_step(rng, stream, obs_dim=4, hidden=(64, 48), **target)
    assert step.n_spectral > 0 and int(step.optimizer.skip.to_numpy()[0]) == 0
    cb, rb = step._spectral_grids
    for kernel, grid in ((step._spectral_columns, cb), (step._spectral_rows, rb)):
        kernel.launch(grid, kernel.block, step.params, step._spectral_mats, step.n_spectral, step.u, step._v,
                      step._spectral_partials, step.optimizer.skip, stream=stream)
    stream.synchronize()
    y, partials = step.u.to_numpy(), step._spectral_partials.to_numpy()
    y_buf, partials_buf = DeviceBuffer.from_numpy(y), DeviceBuffer.from_numpy(partials)
    params0, target0 = step.params.buffer.to_numpy(), step.target.buffer.to_numpy()
    restore, state = finish_pass_harness(step, stream, (step.params.buffer, step.target.buffer, step.u, step.sigma,
                                                        step.spectral_scale, step._step_counter))
    restore()
    step._launch_finish(stream)
    want = state()
    assert want[0] != params0.tobytes() or want[1] != target0.tobytes()
    assert want[2] != y.tobytes() and step.metrics.ring.view().any()
    writer = late_copy()
    for _ in range(2):
        restore()
        for buf in (step.u, step._spectral_partials):
            buf.poison(stream=stream)
        with dependent_launches(True):
            writer.launch(1, 128, step.u, y_buf, words(y_buf), step._spectral_partials, partials_buf,
                          words(partials_buf), LATE_NS, stream=stream)
            step._launch_finish(stream)
        assert state() == want
    for buf in (y_buf, partials_buf):
        buf.close()
    step.close()


def test_finish_pass_without_a_projected_layer_reads_the_parameters_after_its_wait(device, rng):
    """With no projected layer (spectral_c=None) the kernel before dqn_finish is AdamW,
    which writes the parameters, so the finish pass loads them after its wait. With the
    parameters poisoned, then written by `late_copy` under dependent launch, the target
    network (Polyak averaging), the parameters, the step counter and the metrics slot are
    the bits of an ordinary launch."""
    skip_unless_a_read_can_race(device, early=False)
    stream = Stream()
    step = trained_step(rng, stream, obs_dim=4, hidden=(64, 48), spectral_c=None)
    assert step.n_spectral == 0 and int(step.optimizer.skip.to_numpy()[0]) == 0
    params0, target0 = step.params.buffer.to_numpy(), step.target.buffer.to_numpy()
    params_buf = DeviceBuffer.from_numpy(params0)
    restore, state = finish_pass_harness(step, stream, (step.params.buffer, step.target.buffer, step._step_counter))
    restore()
    step._launch_finish(stream)
    want = state()
    assert want[1] != target0.tobytes() and step.metrics.ring.view().any()
    writer = late_copy()
    for _ in range(2):
        restore()
        step.params.buffer.poison(stream=stream)
        with dependent_launches(True):
            writer.launch(1, 128, step.params.buffer, params_buf, words(params_buf), 0, 0, 0, LATE_NS,
                          stream=stream)
            step._launch_finish(stream)
        assert state() == want
    params_buf.close()
    step.close()


@pytest.mark.parametrize("hidden", [(40, 24, 33, 17, 20, 28), (4200, 8)],
                         ids=["six-projected-layers", "tall-projected-layer"])
def test_tail_matches_the_six_kernels_over_every_finish_branch(device, rng, hidden):
    """Six projected matrices (the finish pass sums ||y|| four at a time, so two rounds)
    and a matrix of 4200 rows (263 row partials, more than a block's threads): the
    cooperative tail and the separate kernels run the same finish code and give the
    same bits over ten steps with the projection active (c = 0.5)."""
    cfg = DQNConfig(obs_dim=3, hidden=hidden, n_actions=4, batch=64, capacity=1024, spectral_c=0.5,
                    seed=int(rng.integers(1 << 30)), fused_tail=True)
    data = random_transitions(rng, cfg)
    fused, s1 = run_losses(cfg, data, 10, graph=True, arena_active=True)
    separate, s2 = run_losses(dataclasses.replace(cfg, fused_tail=False), data, 10, graph=True, arena_active=True)
    assert np.all(np.isfinite(fused)) and fused.tobytes() == separate.tobytes()
    for key in ("params", "target", "m", "v", "u"):
        assert s1[key].tobytes() == s2[key].tobytes(), key


def _block_sum_bits(shares: np.ndarray) -> float:
    """dt_block_sum (kernels/common.cuh) over 256 threads, in float64 numpy: lane l of each
    warp takes thread values l, l + 32, ..., the eight are added in a pairwise tree, then
    the lanes by shuffles down (a lane past the end adds its own value). IEEE double adds
    round the same on both sides, so this gives the kernel's bits."""
    r = [np.array(shares[32 * k: 32 * k + 32], np.float64) for k in range(8)]
    h = 4
    while h >= 1:
        for k in range(h):
            r[k] = r[k] + r[k + h]
        h //= 2
    x = r[0]
    for w in (16, 8, 4, 2, 1):
        x = np.concatenate([x[:32 - w] + x[w:], x[32 - w:] + x[32 - w:]])
    return float(x[0])


def _partials_sum_bits(partials) -> float:
    """dt_partials_sum<256> (kernels/common.cuh) in float64 numpy: thread t's share adds
    partials t, t + 256, ... to 0 in turn, then the block tree (_block_sum_bits). The order
    in which adamw_clip_step and dqn_priority_update's guard add the norm's partials."""
    shares = np.zeros(256)
    for t in range(256):
        acc = 0.0
        for b in range(t, len(partials), 256):
            acc += float(partials[b])
        shares[t] = acc
    return _block_sum_bits(shares)


def _columns_phase_bits(W: np.ndarray, u: np.ndarray):
    """spectral_columns (kernels/spectral.cuh) in float64 numpy, in the kernel's order, so
    the bits match: per 16-column block, thread t takes column quad t % 4 and rows t // 4,
    t // 4 + 64, ... in turn (a float32 product is exact in float64, so each fused
    multiply-add rounds as one add here); then a butterfly over the 8 row lanes of a warp
    (xor 4, 8, 16), the 8 warps added in order, and the block's squares added in column
    order. Returns x (float32, as stored) and the blocks' partials."""
    rows, cols = W.shape
    w64, u64 = W.astype(np.float64), u.astype(np.float64)
    t = np.arange(256)
    quad, lane_row = t % 4, t // 4
    x, partials = np.zeros(cols, np.float32), []
    for block in range(-(-cols // 16)):
        acc = np.zeros((256, 4))
        for k in range(-(-rows // 64)):
            i = lane_row + 64 * k
            for e in range(4):
                j = block * 16 + 4 * quad + e
                ok = (i < rows) & (j < cols) & (block * 16 + 4 * quad < cols)
                acc[ok, e] = acc[ok, e] + w64[i[ok], j[ok]] * u64[i[ok]]
        for off in (4, 8, 16):
            acc = acc + acc[t ^ off]
        warp_sums = acc.reshape(8, 32, 4)[:, :4, :].reshape(8, 16)  # lanes 0-3: quads 0-3, 4 columns each
        col = np.zeros(16)
        for w in range(8):
            col = col + warp_sums[w]
        j = block * 16 + np.arange(16)
        x[j[j < cols]] = col[j < cols].astype(np.float32)
        squares = np.where(j < cols, col * col, 0.0)
        s = 0.0
        for c in range(16):
            s = s + squares[c]
        partials.append(s)
    return x, np.array(partials)


def finish_pass_harness(step, stream, buffers):
    """For the finish pass's race tests: restore() puts back the parameters, the target
    network and the step counter as they are now and clears the metrics ring; state()
    synchronises and returns the bits of `buffers` and of the ring."""
    params0, target0 = step.params.buffer.to_numpy(), step.target.buffer.to_numpy()
    counter0 = step._step_counter.to_numpy()

    def restore():
        step.params.buffer.copy_from_numpy(params0)
        step.target.buffer.copy_from_numpy(target0)
        step._step_counter.copy_from_numpy(counter0)
        step.metrics.ring.view()[:] = 0

    def state():
        stream.synchronize()
        return [b.to_numpy().tobytes() for b in buffers] + [step.metrics.ring.view().tobytes()]

    return restore, state


def trained_step(rng, stream, *, obs_dim, hidden, **overrides):
    """A small step (4 actions, batch 64, spectral_c 0.5 unless overridden) after one whole
    step on a filled replay, so that its weights are trained ones; the stream synchronised."""
    cfg = DQNConfig(**{**dict(obs_dim=obs_dim, hidden=hidden, n_actions=4, batch=64, capacity=1024, spectral_c=0.5,
                              seed=int(rng.integers(1 << 30))), **overrides})
    step = DQNStep(cfg)
    fill(step, rng, stream)
    step.enqueue(stream=stream)
    stream.synchronize()
    return step


@pytest.mark.parametrize("rows", [1, 63, 64, 65, 511, 512, 513, 1100])
def test_spectral_columns_phase_is_its_order_bit_for_bit(device, rng, rows):
    """x = W^T u and the partial ||x||^2 of each 16-column block, from spectral_columns,
    against the float64 emulation of its summation order: bit for bit, for one matrix on
    the float4 path (20 columns) and one on the scalar path (19 columns) in one table, at
    row counts around the 64 row lanes and the 8 rows a thread loads at once."""
    from drvtrain.kernel import builtin_module
    from drvtrain.rl.dqn import _SPECTRAL_DTYPE
    shapes = [(rows, 20), (rows + 7, 19)]
    mats = [rng.standard_normal(shape).astype(np.float32) for shape in shapes]
    us = [rng.standard_normal(shape[0]).astype(np.float32) for shape in shapes]
    table = np.zeros(2, _SPECTRAL_DTYPE)
    offsets = [0, -(-(rows * 20) // 64) * 64]
    params = np.concatenate([mats[0].ravel(), np.zeros(offsets[1] - rows * 20, np.float32), mats[1].ravel()])
    table[0] = (offsets[0], rows, 20, 0, 0, 0, 0)
    table[1] = (offsets[1], rows + 7, 19, rows, 20, 2, -(-rows // 16))
    stream = Stream()
    kernel = builtin_module("dqn.cu").kernel("spectral_columns", "ptr ptr i32 ptr ptr ptr ptr", fixed_block=True)
    p_buf, t_buf = DeviceBuffer.from_numpy(params), DeviceBuffer.from_numpy(table.view(np.uint8))
    u_buf = DeviceBuffer.from_numpy(np.concatenate(us))
    v_buf, partials = DeviceBuffer(39, np.float32), DeviceBuffer(4, np.float64)
    for buf in (v_buf, partials):
        buf.poison(stream=stream)
    kernel.launch(4, kernel.block, p_buf, t_buf, 2, u_buf, v_buf, partials, 0, stream=stream)
    stream.synchronize()
    v, got = v_buf.to_numpy(), partials.to_numpy()
    x0, p0 = _columns_phase_bits(mats[0], us[0])
    x1, p1 = _columns_phase_bits(mats[1], us[1])
    assert np.all(np.isfinite(v)) and np.all(np.isfinite(got))
    assert v.tobytes() == np.concatenate([x0, x1]).tobytes()
    assert got.tobytes() == np.concatenate([p0, p1]).tobytes()
    # And the formula itself, to float64 rounding.
    for w, u, x in ((mats[0], us[0], x0), (mats[1], us[1], x1)):
        want = w.astype(np.float64).T @ u.astype(np.float64)
        assert rel(x, want) < 1e-6


@pytest.mark.parametrize("variant", [("spectral_rows", False), ("spectral_rows_staged", True),
                                     ("spectral_rows_staged", False)],
                         ids=["w-in-registers", "w-in-shared-memory", "w-after-the-wait"])
def test_spectral_rows_reads_only_its_weights_before_its_wait(device, rng, variant):
    """spectral_rows holds its rows of W across its grid wait in registers,
    spectral_rows_staged in shared memory (cp.async; the kernel before it, the columns
    phase, writes no W); both read x, the columns phase's partials and the flag after it.
    With v and the partials poisoned, then written by `late_copy`, the kernel before it
    under dependent launch, y and the row partials are the bits of an ordinary launch of
    the step's own rows kernel, nothing unwritten, on the float4 path (every width a
    multiple of 4): a rows phase that read x or the partials before its wait would meet
    the poison. The staged kernel given no shared memory for W reads it after its wait:
    the same bits again."""
    from drvtrain.kernel import builtin_module
    skip_unless_a_read_can_race(device, early=False)
    stream = Stream()
    step = trained_step(rng, stream, obs_dim=4, hidden=(64, 48))
    assert step.n_spectral > 0 and all(int(row["cols"]) % 4 == 0 for row in step.spectral_table)
    assert int(step.optimizer.skip.to_numpy()[0]) == 0
    cb, rb = step._spectral_grids
    # The step takes the staged kernel for a rows grid of at most half the SMs (7 blocks here).
    assert step._spectral_rows.name == "spectral_rows_staged" and step._spectral_stage == 16 * 64 * 4
    columns = step._spectral_columns
    name, staged = variant
    rows = builtin_module("dqn.cu").kernel(name, "ptr ptr i32 ptr ptr ptr ptr", fixed_block=True)
    shared_mem = step._spectral_stage if staged else 0
    args = (step.params, step._spectral_mats, step.n_spectral, step.u, step._v, step._spectral_partials,
            step.optimizer.skip)
    columns.launch(cb, columns.block, *args, stream=stream)
    x, partials = (DeviceBuffer.from_numpy(buf.to_numpy()) for buf in (step._v, step._spectral_partials))
    u0 = step.u.to_numpy()
    step._spectral_rows.launch(rb, step._spectral_rows.block, *args, stream=stream, shared_mem=step._spectral_stage)
    y_want, partials_want = step.u.to_numpy(), step._spectral_partials.to_numpy()
    assert np.isfinite(y_want).all() and np.isfinite(partials_want).all() and not np.array_equal(y_want, u0)
    writer = late_copy()
    for _ in range(2):
        for buf in (step._v, step._spectral_partials, step.u):
            buf.poison(stream=stream)
        with dependent_launches(True):
            writer.launch(1, 128, step._v, x, words(x), step._spectral_partials, partials, words(partials), LATE_NS,
                          stream=stream)
            rows.launch(rb, rows.block, *args, stream=stream, shared_mem=shared_mem)
        assert step.u.to_numpy().tobytes() == y_want.tobytes()
        assert step._spectral_partials.to_numpy().tobytes() == partials_want.tobytes()
    step.close()


@pytest.mark.parametrize("config", ["small", "large"])
def test_rows_kernel_follows_the_rows_grid(device, rng, config):
    """The step stages the rows phase's W in shared memory where its grid covers at most
    half the SMs (the small configuration's 32 blocks), and keeps it in registers where it
    covers more (the large one's 128 on 132 SMs); the captured graph has the chosen
    kernel (the audit test checks that it follows spectral_columns alone)."""
    cfg = getattr(DQNConfig, config)(capacity=8192, seed=int(rng.integers(1 << 30)))
    step = DQNStep(cfg)
    rb = step._spectral_grids[1]
    staged = 2 * rb <= device.sm_count
    assert rb == (32 if config == "small" else 128)
    assert step._spectral_rows.name == ("spectral_rows_staged" if staged else "spectral_rows")
    assert step._spectral_stage == (16 * (256 if config == "small" else 1024) * 4 if staged else 0)
    stream = Stream()
    fill(step, rng, stream)
    step.capture(stream=stream)
    names = [k.function for k in step.graph.kernel_nodes()]
    assert names.count(step._spectral_rows.name) == 1
    assert not {"spectral_rows", "spectral_rows_staged"} - {step._spectral_rows.name} & set(names)
    step.close()


@pytest.mark.parametrize("hidden", [(40, 24, 33, 17, 20, 28), (4200, 300)],
                         ids=["six-projected-layers", "tall-projected-layer"])
def test_finish_pass_spectral_results_are_the_formula_bit_for_bit(device, rng, hidden):
    """From the partials and y' = W x that spectral_rows leaves, numpy in float64 reproduces
    the finish pass's sigma, scale, u = y' / (||x|| ||y||) and scaled weights bit for bit:
    every thread's share of the partials in order, the block tree, the square roots, the
    divisions. Every row block's ||x||^2 is the columns phase's partials summed in that
    order, bit for bit, and its partial of ||y||^2 its rows' y'^2 over ||x||^2. Six
    matrices take two groups of four; the tall layer has 263 row partials, more than a
    block's threads, and the next (300 x 4200) 263 column partials, summed in every one of
    its 19 row blocks. The partials are poisoned first: a slot no block writes fails."""
    stream = Stream()
    step = trained_step(rng, stream, obs_dim=3, hidden=hidden)
    assert int(step.optimizer.skip.to_numpy()[0]) == 0
    u0 = step.u.to_numpy()
    cb, rb = step._spectral_grids
    step._spectral_partials.poison(stream=stream)
    for kernel, grid in ((step._spectral_columns, cb), (step._spectral_rows, rb)):
        kernel.launch(grid, kernel.block, step.params, step._spectral_mats, step.n_spectral, step.u, step._v,
                      step._spectral_partials, step.optimizer.skip, stream=stream)
    stream.synchronize()
    y, partials, params = step.u.to_numpy(), step._row_partials.to_numpy(), step.params.buffer.to_numpy()
    column_partials = step._spectral_partials.to_numpy()[:cb]
    step.u.copy_from_numpy(u0)
    for buf in (step.sigma, step.spectral_scale):
        buf.poison(stream=stream)
    step._enqueue_spectral_and_finish(stream)  # the same two phases again, then the finish pass
    stream.synchronize()
    assert step._row_partials.to_numpy().tobytes() == partials.tobytes()
    sigma, scale, u, after = (step.sigma.to_numpy(), step.spectral_scale.to_numpy(), step.u.to_numpy(),
                              step.params.buffer.to_numpy())
    c = float(np.float32(step.config.spectral_c))

    def partials_sum(part):  # dt_partials_sum: each thread's share in order, then the block tree
        assert np.all(np.isfinite(part)) and np.all(part > 0)
        return _partials_sum_bits(part)

    projected = 0
    for m, row in enumerate(step.spectral_table):
        first, count = int(row["first_block_rows"]), -(-int(row["rows"]) // 16)
        col_first, col_count = int(row["first_block_cols"]), -(-int(row["cols"]) // 16)
        x_squared = partials_sum(column_partials[col_first: col_first + col_count])
        assert np.all(partials[rb + first: rb + first + count] == x_squared), f"||x||^2 of matrix {m}"
        uo, rows = int(row["u_offset"]), int(row["rows"])
        y_rows = y[uo: uo + rows].astype(np.float64) ** 2
        block_sums = np.add.reduceat(y_rows, np.arange(0, rows, 16))
        assert rel(partials[first: first + count] * x_squared, block_sums) < 1e-6, f"row partials of matrix {m}"
        y_squared = partials_sum(partials[first: first + count])
        y_norm = max(math.sqrt(y_squared), 1e-12)
        sig = y_squared / y_norm
        want_scale = np.float32(c / sig) if sig > c else np.float32(1.0)
        projected += sig > c
        assert sigma[m].tobytes() == np.float32(sig).tobytes(), f"sigma of matrix {m}"
        assert scale[m].tobytes() == want_scale.tobytes(), f"scale of matrix {m}"
        u_den = max(math.sqrt(x_squared), 1e-12) * y_norm
        want_u = (y[uo: uo + rows].astype(np.float64) / u_den).astype(np.float32)
        assert u[uo: uo + rows].tobytes() == want_u.tobytes(), f"u of matrix {m}"
        wo, n = int(row["w_offset"]), rows * int(row["cols"])
        assert after[wo: wo + n].tobytes() == (params[wo: wo + n] * want_scale).tobytes(), f"weights of matrix {m}"
    assert projected >= 1, "c = 0.5 scaled no matrix: the scale's branch went untested"
    step.close()
    stream.close()


# The smallest sum of squares whose float norm is infinite: dt_clip_decide_value (kernels/optim.cuh)
# takes the norm as (float)sqrt(total), and the square root of this double is the midpoint between
# FLT_MAX and 2^128, which rounds (to even) to infinity; the double below it gives FLT_MAX.
F32_NORM_LIMIT = (2.0 ** 128 - 2.0 ** 103) ** 2


def float_norm(total: float) -> np.float32:
    """dt_clip_decide_value's norm: the double square root of the sum, rounded to float
    (infinite from F32_NORM_LIMIT on)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.float32(np.sqrt(np.float64(total)))


def left_to_right_sum(partials) -> float:
    """The partials added in turn from the first: the order the guard must not take."""
    acc = 0.0
    for p in partials:
        acc += float(p)
    return acc


def order_sensitive_partials(count: int, kernel_overflows: bool) -> np.ndarray:
    """``count`` norm partials whose float norm is finite in one order of addition and
    infinite in the other (count >= 3 but 4, where two of them reach the large one as
    exactly u / 2, a tie, and both orders overflow). One is the largest sum whose float
    norm is finite (F32_NORM_LIMIT less its ulp u); every other one is below u / 2, so
    that one alone added to it rounds away.
    kernel_overflows: the large one is partial 1, the others 5u/16 each. Left to right it
    takes them one at a time and stays; in dt_partials_sum's order at least two of them
    meet first (partials 0 and 2 of three; shares of the tree's first level of more),
    5u/8 > u / 2, and the sum rounds up to the limit.
    Otherwise the large one is the last partial and the others add to 3u/4. Left to right
    they are summed first and carry it up to the limit; in dt_partials_sum's order it
    meets them in parts, the largest about half of them (the tree's last level), each
    below u / 2, and stays."""
    large = np.nextafter(F32_NORM_LIMIT, 0.0)
    u = F32_NORM_LIMIT - large
    if kernel_overflows:
        partials = np.full(count, 5 * u / 16)
        partials[1] = large
    else:
        partials = np.full(count, 3 * u / (4 * (count - 1)))
        partials[-1] = large
    return partials


# One to five levels. The update's four blocks split each tree at the highest level below the
# root with at least four nodes (dt_tree_split_level), and the last block refreshes the levels
# above it: at the leaves for 70 (level 1 has 3 nodes), at level 1 of the three-level tree
# (63, 2 and 1 nodes), at level 3 of 2^20 + 33 (33 nodes, then 2 and 1). The three-level
# tree's 290 indices take 320 threads, 256 of them the guard's sum.
PRIORITY_TREES = [(20, 8), (70, 16), (1000, 100), (2000, 290), (1 << 17, 256), ((1 << 20) + 33, 512)]


def launch_priority_update(tree, idx, pri, partials, loss, gate, stream, counter):
    """dqn_priority_update as the step launches it, on host arrays; waits for it."""
    from drvtrain import builtin_module
    from drvtrain.rl.dqn import PRIORITY_UPDATE_SIGNATURE, priority_update_shape
    kernel = builtin_module("dqn_step.cu").kernel("dqn_priority_update", PRIORITY_UPDATE_SIGNATURE)
    d_partials = DeviceBuffer.from_numpy(np.asarray(partials, np.float64))
    d_loss = DeviceBuffer.from_numpy(np.array([0.0 if loss is None else loss], np.float32))
    d_gate = DeviceBuffer.from_numpy(np.array([gate], np.int32))
    operands = list(tree.update_operands(DeviceBuffer.from_numpy(idx), DeviceBuffer.from_numpy(pri)))
    grid, block = priority_update_shape(len(idx))
    kernel.launch(grid, block, *operands[:10], d_partials, len(partials), 0 if loss is None else d_loss, d_gate,
                  *operands[10:], counter, stream=stream)
    stream.synchronize()


@pytest.mark.parametrize("capacity, n", PRIORITY_TREES)
def test_priority_update_takes_the_nan_guards_verdict_from_the_norms_partials(device, rng, capacity, n):
    """dqn_priority_update decides AdamW's NaN guard itself, from the norm's partials, the
    loss and the gate: it updates when the norm (the float square root of the partials' sum)
    and the loss are finite and the gate is 0, and changes nothing otherwise, the tree's
    leaves, sums and maximum bit for bit. An update's leaves are checked against float64
    ``p ** alpha``, its sums against the fixed-order sums of the new leaves (the ancestors
    of its indices poisoned before every launch, so a skipped launch keeps the poison); its
    maximum moves (each launch's priorities exceed every leaf before it)."""
    from drvtrain.rl import SumTree
    from per_reference import poison_ancestors
    stream = Stream()
    counter = DeviceBuffer.zeros(1, np.uint32)
    tree = SumTree(capacity, alpha=0.6, seed=int(rng.integers(2**63)))
    tree.set_priorities(rng.uniform(0.1, 1.1, capacity).astype(np.float32))
    blocks = int(rng.integers(2, 700))  # the step's norm grids have up to 2 x the SMs
    finite = lambda: rng.uniform(0.5, 2.0, blocks)
    with_one = lambda value: np.concatenate([finite()[:-1], [value]])[rng.permutation(blocks)]
    cases = [  # (what, partials, loss (None: no loss), gate, updates)
        ("finite", finite(), 0.7, 0, True),
        ("no loss", finite(), None, 0, True),
        ("a norm of 2^127, inside the float range", with_one(2.0 ** 254), 0.7, 0, True),
        ("an infinite partial", with_one(np.inf), 0.7, 0, False),
        ("a NaN partial", with_one(np.nan), 0.7, 0, False),
        ("a finite sum whose norm overflows a float", with_one(F32_NORM_LIMIT * 1.001), 0.7, 0, False),
        ("a NaN loss", finite(), np.nan, 0, False),
        ("an infinite loss", finite(), -np.inf, 0, False),
        ("gated", finite(), 0.7, int(rng.integers(1, 2**31)), False),
    ]
    updated = 0
    for k, (what, partials, loss, gate, updates) in enumerate(cases):
        idx = rng.integers(0, capacity, n).astype(np.int32)
        pri = (rng.uniform(2.0, 20.0, n) * 100.0 ** k).astype(np.float32)  # above every leaf so far
        clean = tree.nodes_numpy()
        nodes = poison_ancestors(clean, tree.levels, idx)
        tree.nodes.copy_from_numpy(nodes)
        leaves, top = tree.leaves_numpy(), tree.max_priority().to_numpy()
        launch_priority_update(tree, idx, pri, partials, loss, gate, stream, counter)
        if updates:
            got, written = tree.leaves_numpy(), pri.astype(np.float64) ** 0.6
            kept = np.setdiff1d(np.arange(capacity), idx)
            assert got[kept].tobytes() == leaves[kept].tobytes(), what
            for i in np.unique(idx):  # a duplicated index: the leaf ends as one of the values written to it
                assert np.min(np.abs(written[idx == i] - got[i]) / written[idx == i]) < 1e-6, what
            assert tree.nodes_numpy().tobytes() == fixed_order_nodes(got, tree.levels, tree.internal).tobytes(), what
            assert top[0] < written.max() and tree.max_priority().to_numpy()[0] == pytest.approx(
                written.max(), rel=1e-6), what
            updated += 1
        else:
            assert tree.leaves_numpy().tobytes() == leaves.tobytes(), what
            assert tree.nodes_numpy().tobytes() == nodes.tobytes(), what
            assert tree.max_priority().to_numpy().tobytes() == top.tobytes(), what
            tree.nodes.copy_from_numpy(clean)
        assert int(counter.to_numpy()[0]) == 0, what
    assert updated == 3
    tree.check_errors()


@pytest.mark.parametrize("capacity, n", PRIORITY_TREES)
def test_priority_update_raises_each_bad_entry_once_and_writes_the_rest(device, rng, capacity, n):
    """The blocks of dqn_priority_update split the tree between them and each reads every
    index: an index outside the tree still raises its flag once, a bad priority once (by
    the block whose leaf it is), and every other leaf is written and summed."""
    from drvtrain.rl import SumTree
    stream = Stream()
    counter = DeviceBuffer.zeros(1, np.uint32)
    tree = SumTree(capacity, alpha=0.6, seed=int(rng.integers(2**63)))
    tree.set_priorities(rng.uniform(0.1, 1.1, capacity).astype(np.float32))
    leaves = tree.leaves_numpy()
    idx = rng.integers(0, capacity, n).astype(np.int32)
    pri = rng.uniform(0.05, 5.0, n).astype(np.float32)
    bad_index, bad_priority = np.split(rng.permutation(n)[:max(2, n // 8)], 2)
    idx[bad_index] = rng.choice([-1, capacity, capacity + 31, -(2**31)], bad_index.size)
    pri[bad_priority] = rng.choice([np.nan, -1.0, np.inf], bad_priority.size)
    launch_priority_update(tree, idx, pri, rng.uniform(0.5, 2.0, 67), 0.7, 0, stream, counter)
    counts = tree.flags.counts.to_numpy()
    assert (counts[0], counts[1]) == (bad_index.size, bad_priority.size)
    good = np.setdiff1d(np.arange(n), np.concatenate([bad_index, bad_priority]))
    got, written = tree.leaves_numpy(), np.zeros(n)
    written[good] = pri[good].astype(np.float64) ** 0.6
    kept = np.setdiff1d(np.arange(capacity), idx[good])
    assert got[kept].tobytes() == leaves[kept].tobytes()
    for i in np.unique(idx[good]):
        mine = good[idx[good] == i]
        assert np.min(np.abs(written[mine] - got[i]) / written[mine]) < 1e-6
    assert tree.nodes_numpy().tobytes() == fixed_order_nodes(got, tree.levels, tree.internal).tobytes()
    assert int(counter.to_numpy()[0]) == 0


@pytest.mark.parametrize("count", [3, 255, 256, 257, 513])
def test_priority_update_and_adamw_agree_where_the_order_of_the_norms_sum_decides(device, rng, count):
    """dqn_priority_update decides AdamW's NaN guard itself, and must take adamw_clip_step's
    verdict: both add the norm's partials in dt_partials_sum's order (thread t of 256 adds
    partials t, t + 256, ... in turn, then the block tree). Here the order decides it: at
    the edge of the float range, partials whose float norm is finite in that order and
    infinite left to right, then the other way round (order_sensitive_partials, both sums
    checked in float64 first); counts below, at and above 256 and past the 512 partials
    AdamW loads before its loop. The update writes its leaves and sums exactly when the
    norm is finite in the kernels' order, AdamW's *skip is 0 exactly then (else 1) and its
    published norm is that order's (FLT_MAX or infinity): a kernel that added left to
    right, or in any order that gives the other verdict, fails."""
    from drvtrain.nn import AdamW, FlatBuffer, ParamLayout
    from drvtrain.rl import SumTree
    stream = Stream()
    counter = DeviceBuffer.zeros(1, np.uint32)
    capacity, n = 2000, 290
    tree = SumTree(capacity, alpha=0.6, seed=int(rng.integers(2**63)))
    tree.set_priorities(rng.uniform(0.1, 1.1, capacity).astype(np.float32))
    layout = ParamLayout([(16, 8)])
    loss = DeviceBuffer.from_numpy(np.array([0.7], np.float32))
    opt = AdamW(FlatBuffer(layout), FlatBuffer(layout), loss=loss, nan_guard=True)
    opt._t_next.copy_from_numpy(np.array([1], np.int32))  # as the norm kernel leaves it before step 1
    assert not np.isfinite(float_norm(F32_NORM_LIMIT))
    assert float_norm(np.nextafter(F32_NORM_LIMIT, 0.0)) == np.finfo(np.float32).max
    for k, kernel_overflows in enumerate((False, True)):
        what = f"{count} partials, infinite in the kernels' order: {kernel_overflows}"
        partials = order_sensitive_partials(count, kernel_overflows)
        norm = float_norm(_partials_sum_bits(partials))
        assert np.isfinite(norm) == (not kernel_overflows), what
        assert np.isfinite(float_norm(left_to_right_sum(partials))) == kernel_overflows, what
        idx = rng.integers(0, capacity, n).astype(np.int32)
        pri = (rng.uniform(2.0, 20.0, n) * 100.0 ** k).astype(np.float32)  # above every leaf so far
        leaves, nodes = tree.leaves_numpy(), tree.nodes_numpy()
        launch_priority_update(tree, idx, pri, partials, 0.7, 0, stream, counter)
        got = tree.leaves_numpy()
        kept = np.setdiff1d(np.arange(capacity), idx)
        updated = bool(np.all(got[idx] > leaves[idx]))
        assert got[kept].tobytes() == leaves[kept].tobytes(), what
        if updated:
            assert tree.nodes_numpy().tobytes() == fixed_order_nodes(got, tree.levels, tree.internal).tobytes(), what
        else:
            assert got.tobytes() == leaves.tobytes() and tree.nodes_numpy().tobytes() == nodes.tobytes(), what
        d_partials = DeviceBuffer.from_numpy(partials)
        opt.skip.copy_from_numpy(np.array([-1], np.int32))
        opt.clip.copy_from_numpy(np.full(2, np.nan, np.float32))
        opt._launch_clip_update(stream=stream, partials=d_partials, partials_count=count)
        stream.synchronize()
        skip = int(opt.skip.to_numpy()[0])
        assert opt.clip.to_numpy()[:1].tobytes() == norm.tobytes(), what
        assert skip == (1 if kernel_overflows else 0), what
        assert updated == (skip == 0) == np.isfinite(norm), what
        assert int(counter.to_numpy()[0]) == 0, what
    tree.check_errors()
    opt.close()


@pytest.mark.parametrize("shape", [ODD, dict(ODD, obs_dim=4, hidden=(64, 48))], ids=["odd-widths", "float4-widths"])
def test_nan_reward_skips_the_step_and_is_reported(device, rng, shape):
    """A NaN loss: nothing of the state changes, the skip is reported once, and the next
    step runs. The float4 widths take the spectral rows phase's early loads of W."""
    cfg = DQNConfig(seed=int(rng.integers(1 << 30)), **shape)
    stream = Stream()
    step = DQNStep(cfg)
    data = fill(step, rng, stream)
    exe = step.capture(stream=stream)
    exe.launch(stream)
    stream.synchronize()
    step.check_errors()
    before = step.state_numpy()
    leaves = step.replay.tree.leaves.to_numpy()
    bad = data["reward"].copy()
    bad[:] = np.nan  # whatever is sampled, the loss is NaN
    step.replay.reward.copy_from_numpy(bad)
    exe.launch(stream)
    stream.synchronize()
    after = step.state_numpy()
    for key in ("params", "target", "m", "v", "t", "u"):
        assert before[key].tobytes() == after[key].tobytes(), key
    assert step.replay.tree.leaves.to_numpy().tobytes() == leaves.tobytes()
    with pytest.raises(TrainingError, match="step 2 was skipped"):
        step.check_errors()
    step.check_errors()  # reported once
    step.replay.reward.copy_from_numpy(data["reward"])
    exe.launch(stream)
    stream.synchronize()
    step.check_errors()
    assert step.state_numpy()["t"] == before["t"] + 1 and step.steps_done() == 3


@pytest.mark.parametrize("fused_tail", [False, True], ids=["six-tail-kernels", "cooperative-tail"])
def test_a_skipped_steps_metrics_say_nothing_was_applied(device, rng, fused_tail):
    """docs/step-spec.md, metrics: on a skipped step clip_scale and sigma_max are 0 (a NaN
    norm alone would give a scale of 1, and sigma[] still holds the step before's)."""
    cfg = DQNConfig(seed=int(rng.integers(1 << 30)), fused_tail=fused_tail, **ODD)
    stream = Stream()
    step = DQNStep(cfg)
    data = fill(step, rng, stream)
    exe = step.capture(stream=stream)
    exe.launch(stream)
    step.metrics.record(stream)
    bad = data["reward"].copy()
    bad[:] = np.nan
    stream.synchronize()
    step.replay.reward.copy_from_numpy(bad)
    exe.launch(stream)
    step.metrics.record(stream)
    stream.synchronize()
    good, skipped = step.metrics.poll()
    assert (good.step, skipped.step) == (1, 2)
    assert np.isfinite(good.loss) and 0 < good.clip_scale <= 1 and good.sigma_max > 0
    assert np.isnan(skipped.loss) and np.isnan(skipped.grad_norm)
    assert skipped.clip_scale == 0.0 and skipped.sigma_max == 0.0
    with pytest.raises(TrainingError, match="step 2 was skipped"):
        step.check_errors()


def test_hard_copy_every_k_steps_decided_on_the_device(device, rng):
    cfg = DQNConfig(seed=int(rng.integers(1 << 30)), tau=None, target_period=3, **ODD)
    stream = Stream()
    step = DQNStep(cfg)
    fill(step, rng, stream)
    initial = step.target.buffer.to_numpy()
    exe = step.capture(stream=stream)
    for k in range(1, 7):
        exe.launch(stream)
        stream.synchronize()
        target, params = step.target.buffer.to_numpy(), step.params.buffer.to_numpy()
        if k % 3 == 0:
            assert target.tobytes() == params.tobytes()
            initial = target
        else:
            assert target.tobytes() == initial.tobytes() and params.tobytes() != target.tobytes()


@pytest.mark.parametrize("u_scale", [0.0, 1e-30, 1e-18], ids=["zero-u", "tiny-u", "small-u"])
def test_spectral_projection_of_a_vanishing_u_takes_the_floored_branches(device, rng, u_scale):
    """u at 0, or at 1e-30 of a random vector: ||W^T u|| and ||W v|| fall below their
    1e-12 floors; at 1e-18, ||W^T u|| alone (||W v|| is about 1e-5, so u_new is a unit
    vector). sigma and u_new match the float64 formula (dqn_reference.spectral_project),
    and W is left as it was: sigma is far below c."""
    stream = Stream()
    step = trained_step(rng, stream, obs_dim=3, hidden=(40, 24))
    u0 = (u_scale * rng.standard_normal(step.u.to_numpy().size)).astype(np.float32)
    step.u.copy_from_numpy(u0)
    params = step.params.buffer.to_numpy()
    for buf in (step.sigma, step.spectral_scale):
        buf.poison(stream=stream)
    step._enqueue_spectral_and_finish(stream)
    stream.synchronize()
    sigma, scale, u, after = (step.sigma.to_numpy(), step.spectral_scale.to_numpy(), step.u.to_numpy(),
                              step.params.buffer.to_numpy())
    assert step.n_spectral == 2
    for m, row in enumerate(step.spectral_table):
        rows, cols, wo, uo = (int(row[k]) for k in ("rows", "cols", "w_offset", "u_offset"))
        w = params[wo: wo + rows * cols].reshape(rows, cols)
        w_new, u_want, sigma_want = spectral_project(w, u0[uo: uo + rows], float(np.float32(step.config.spectral_c)))
        assert np.array_equal(w_new, w) and sigma_want < (1e-12 if u_scale < 1e-20 else 1e-3)
        if u_scale == 0.0:
            assert sigma[m] == 0.0 and not u[uo: uo + rows].any()
        else:
            assert 0.0 < sigma[m] and rel(sigma[m], sigma_want) < 1e-5, (sigma[m], sigma_want)
            assert u_want.any() and rel(u[uo: uo + rows], u_want) < 1e-5
        assert scale[m] == 1.0
        assert after[wo: wo + rows * cols].tobytes() == w.astype(np.float32).tobytes()
    step.close()
    stream.close()


def test_spectral_projection_bounds_sigma(device, rng):
    """With c below the layers' norms, the projection holds every projected layer's
    spectral norm near c. One power iteration a step tracks the largest singular value
    of a moving W only as fast as the gaps below it let it, so after 60 training steps
    the norms are checked loosely (with the rng seed 2922353956014068357 a layer ended
    2.9 % above c there); then the spectral phase alone, which only rescales each W,
    runs 600 times, far more than u needs to converge, and no norm may exceed c by 2 %
    (float64 SVD). The projection only ever shrinks W, so a layer that training left
    below c stays there: from below, each norm must be within 2 % of the smaller of c
    and its norm after training."""
    c = 0.3
    cfg = DQNConfig(seed=int(rng.integers(1 << 30)), spectral_c=c, **ODD)
    stream = Stream()
    step = DQNStep(cfg)
    fill(step, rng, stream)
    exe = step.capture(stream=stream)

    def spectral_norms():
        named = step.params.to_numpy()
        return [np.linalg.norm(named[f"layer{k}.weight"].astype(np.float64), 2) for k in cfg.projected_layers]

    for _ in range(60):  # the persistent u converges over steps
        exe.launch(stream)
    stream.synchronize()
    trained = spectral_norms()
    assert all(0.9 * c < norm < 1.15 * c for norm in trained), trained
    assert np.all(step.sigma.to_numpy() > 0)
    for _ in range(600):
        step._enqueue_spectral_and_finish(stream)
    stream.synchronize()
    norms = spectral_norms()
    assert all(0.98 * min(before, c) <= norm < 1.02 * c for norm, before in zip(norms, trained)), (norms, trained)


@pytest.mark.parametrize("fused_tail", [False, True], ids=["six-tail-kernels", "cooperative-tail"])
@pytest.mark.parametrize("config", ["small", "large"])
@pytest.mark.parametrize("dual_stream", [True, False])
def test_audit_of_the_captured_step_passes(device, rng, config, dual_stream, fused_tail):
    cfg = getattr(DQNConfig, config)(capacity=8192, seed=int(rng.integers(1 << 30)), dual_stream=dual_stream,
                                     fused_tail=fused_tail)
    stream = Stream()
    step = DQNStep(cfg)
    fill(step, rng, stream)
    rows, counts = audit_step(step, stream=stream, iterations=50)
    failed = [r for r in rows if not r.passed]
    assert not failed, failed
    assert counts.per_iteration("cuGraphLaunch") == 1 and counts.per_iteration("cuEventRecord") == 1
    names = {k.function for k in step.graph.kernel_nodes()}
    # The small step folds the first layer's dW into the second layer's dX and leaves its
    # strip sums to the norm kernel (MLP.backward's defer_first_dw); the large one does not.
    folded = step.online_mlp.first_dw_folded(cfg.batch)
    assert folded == (config == "small" and tuple(device.compute_capability) >= (9, 0))
    norm = "grad_norm_partials_first_dw" if folded else "grad_norm_partials"
    separate = {norm, "adamw_clip_step", "dqn_priority_update", "dqn_finish"}
    assert not {"grad_norm_partials", "grad_norm_partials_first_dw"} - {norm} & names
    # The small net's 3 x 256 output layer runs in one dqn_head node (forwards, loss, dX); the
    # large net's 19 x 1024 one as separate products and dqn_loss (DQNConfig.fused_head=None).
    fused = config == "small"
    assert (step._head is not None) == fused
    assert step.cluster_net is None and not any(n.startswith("narrow_") for n in names)
    assert [r.measured for r in rows if r.name.startswith("output layer's forwards")] == (["1"] if fused else [])
    # The large step computes its loss in the output layer's backward product (dqn_loss_dwl).
    loss_in_backward = step._loss_dwl is not None
    assert loss_in_backward == (config == "large" and tuple(device.compute_capability) >= (9, 0))
    # Two actions: the head compiled for two (the same bits as dqn_head, test_head_kernel_matches_float64).
    assert ("dqn_head_a2" in names) == fused and "dqn_head" not in names
    assert ("dqn_loss" in names) == (not fused and not loss_in_backward)
    assert any(n.startswith("dqn_loss_dwl_") for n in names) == loss_in_backward
    # 18 actions: the build for them (the same bits, test_loss_in_the_output_layers_backward_matches_float64...).
    assert any(n.startswith("dqn_loss_dwl_a18_") for n in names) == loss_in_backward
    # Pre-split products only when asked for (DQNConfig.presplit). `_settled_` kernels only
    # where MLP.forward takes them on its own: each pass's products after its first that
    # run on gemm.cu's tiles (the small net's second hidden layer; the large net's output
    # layer where it is planned for the whole device, not on wgmma). The step asks for no
    # more (measured slower: docs/perf-notes.md, twenty-fifth pass).
    assert not names & PRESPLIT_KERNELS
    layers, mlp = step.layout.layers, step.online_mlp
    later = [mlp.forward_kernels.plan("forward" if k == len(layers) - 1 else "forward_relu", cfg.batch, *layers[k],
                                      sms=step._forward_sms) for k in range(1, step._forward_layers())]
    nodes = [k.function for k in step.graph.kernel_nodes()]
    # The output layer's dW: the large step folds it into that layer's dX (one dwl node,
    # no product of its own); the small net's dX is dqn_head's, so its dW stays apart.
    folds = step.online_mlp.last_dw_folded(cfg.batch) and not fused
    assert folds == (config == "large" and tuple(device.compute_capability) >= (9, 0))
    assert sum("_dwl_" in name for name in nodes) == folds, nodes
    settled = [name for name in nodes if "_settled_" in name]
    assert len(settled) == 3 * sum(p.tile is not WGMMA_TILE for p in later), nodes
    assert all(name.startswith("linear_forward") for name in settled), nodes
    assert config == "large" or len(settled) == 3, nodes
    # The loss's means: one node of three blocks; with side streams an ordinary launch (no
    # programmatic edge into it) beside every backward product, else inline on the chain.
    graph = step.graph
    kernels = graph.kernel_nodes()
    means = [k for k in kernels if k.function.startswith("dqn_means_")]
    assert len(means) == 1 and means[0].grid == (3, 1, 1) and means[0].function.endswith("256" if fused else "32")
    assert any(b == means[0].node.index for _, b in graph.programmatic_edges()) == (not dual_stream)
    backward = [k for k in kernels if k.function.startswith("linear_grad")]
    assert backward and all(graph.can_run_concurrently(means[0].node, k.node) for k in backward) == dual_stream
    # The IS weights: with side streams a second launch of the draw (a warp per 32 samples,
    # an ordinary launch) beside every forward product and before the loss kernel; else the
    # sampler's last block.
    weights = [k for k in kernels if k.function == "sumtree_weights"]
    assert len(weights) == int(dual_stream)
    if dual_stream:
        assert weights[0].grid == (-(-cfg.batch // 32), 1, 1) and weights[0].block == (32, 1, 1)
        assert not any(b == weights[0].node.index for _, b in graph.programmatic_edges())
        forwards = [k for k in kernels if k.function.startswith("linear_forward")]
        assert forwards and all(graph.can_run_concurrently(weights[0].node, k.node) for k in forwards)
        loss = [k for k in kernels
                if k.function in ("dqn_head", "dqn_head_a2", "dqn_loss") or k.function.startswith("dqn_loss_dwl_")]
        assert len(loss) == 1 and not graph.can_run_concurrently(weights[0].node, loss[0].node)
    # Every forward and weight-gradient product starts on programmatic edges alone, those
    # on the forked streams too: a dependent launch's edges through fork's event are
    # programmatic (the next-state and target forwards from the sampler, each side dW
    # from the head or the dX before its fork).
    products = [k for k in kernels if k.function.startswith(("linear_forward", "linear_grad_weight"))]
    assert any(k.function.startswith("linear_grad_weight") for k in products), names
    if cfg.dependent_launch and tuple(device.compute_capability) >= (9, 0):
        for k in products:
            into = [(a, b) for a, b in graph.edges() if b == k.node.index]
            assert into and set(into) <= set(graph.programmatic_edges()), k.function
    if fused_tail:  # one cooperative node instead of the six
        assert [r.measured for r in rows if r.name.startswith("norm, priority update")] == ["1"]
        assert "dqn_tail" in names and not separate & names
    else:
        assert "dqn_tail" not in names and separate <= names
        # Three kernels read before their wait what the kernel before them does not write,
        # which holds only for that kernel before: spectral_rows (W) directly after
        # spectral_columns, dqn_finish (params, target, the flags) directly after
        # spectral_rows, adamw_clip_step (params and moments) directly after the norm
        # kernel, each its only predecessor, over a programmatic edge.
        rows_kernel = step._spectral_rows.name
        for reader, writer in ((rows_kernel, "spectral_columns"), ("dqn_finish", rows_kernel),
                               ("adamw_clip_step", norm)):
            after, before = ([k for k in kernels if k.function == f] for f in (reader, writer))
            assert len(after) == len(before) == 1, (reader, writer)
            assert graph.dependencies(after[0].node) == [before[0].node], reader
            assert (before[0].node.index, after[0].node.index) in graph.programmatic_edges(), reader
        # The priority update decides the NaN guard from the norm's partials itself: with side
        # streams it is forked once the norm kernel is queued and runs beside AdamW; on one
        # stream it follows AdamW. Its side stream ran the target forward and backward products
        # earlier in the capture, and a capture's wait adds the forking stream's nodes to the
        # waiting stream's own: any dependency besides the norm kernel's node comes before it.
        update, adamw, norm_node = ([k.node for k in kernels if k.function == f]
                                    for f in ("dqn_priority_update", "adamw_clip_step", norm))
        assert len(update) == len(adamw) == len(norm_node) == 1
        update, adamw, norm_node = update[0], adamw[0], norm_node[0]
        into = {d.index for d in graph.dependencies(update)}
        if dual_stream:
            edges, above, frontier = graph.edges(), set(), {norm_node.index}
            while frontier:  # the norm kernel's ancestors
                frontier = {a for a, b in edges if b in frontier} - above
                above |= frontier
            assert norm_node.index in into and into - {norm_node.index} <= above, into
            assert graph.can_run_concurrently(update, adamw)
        else:
            assert into == {adamw.index}, into


PRESPLIT_KERNELS = {"tf32_split", "linear_grad_input_wgmma_presplit_3xtf32",
                    "linear_grad_weight_wgmma_presplit_3xtf32"}


@pytest.mark.parametrize("dual_stream", [True, False])
def test_audit_of_the_large_step_with_the_presplit_backward_passes(device, rng, dual_stream):
    """The 1024 x 1024 backward on split operands: the weights' split at the step's
    start on the target stream (dual_stream) or in the backward; either way no host
    synchronisation, copy or allocation per step, and the pre-split kernels in the graph."""
    cfg = DQNConfig.large(capacity=8192, seed=int(rng.integers(1 << 30)), dual_stream=dual_stream, presplit=True)
    stream = Stream()
    step = DQNStep(cfg)
    fill(step, rng, stream)
    rows, counts = audit_step(step, stream=stream, iterations=20)
    failed = [r for r in rows if not r.passed]
    assert not failed, failed
    assert counts.per_iteration("cuGraphLaunch") == 1
    names = [k.function for k in step.graph.kernel_nodes()]
    assert PRESPLIT_KERNELS <= set(names)
    # dual stream: W^T first (on the target stream), X^T, then dY both ways; one stream: the same three
    assert names.count("tf32_split") == 3
    step.close()


def test_audit_of_the_small_step_with_the_cluster_forward_passes(device, rng):
    cfg = DQNConfig.small(capacity=8192, seed=int(rng.integers(1 << 30)), cluster_forward=True)
    stream = Stream()
    step = DQNStep(cfg)
    assert step.cluster_net is not None and step._head is not None
    fill(step, rng, stream)
    rows, _ = audit_step(step, stream=stream, iterations=50)
    assert [r.measured for r in rows if r.name.startswith("three forwards in one")] == ["1 node(s)"]
    assert not [r for r in rows if not r.passed]
    names = [k.function for k in step.graph.kernel_nodes()]
    assert names.count("narrow_forward_cluster") == 1 and head_kernel_name(cfg.n_actions) in names
    assert not any(n.startswith("linear_forward") for n in names)


def test_cluster_forward_true_refuses_a_net_it_cannot_run(device):
    with pytest.raises(ValueError, match=r"cluster_forward=True cannot run: the net .* is not narrow"):
        DQNStep(DQNConfig(obs_dim=3, hidden=(300,), n_actions=2, batch=32, capacity=256, cluster_forward=True))


def test_audit_of_the_fused_step_passes(device, rng):
    cfg = DQNConfig.small(capacity=8192, seed=int(rng.integers(1 << 30)), fused=True)
    stream = Stream()
    step = DQNStep(cfg)
    assert step.narrow is not None
    fill(step, rng, stream)
    rows, _ = audit_step(step, stream=stream, iterations=50)
    failed = [r for r in rows if not r.passed]
    assert not failed, failed


def test_save_and_load_restore_the_learner(device, rng, tmp_path):
    cfg = DQNConfig(seed=int(rng.integers(1 << 30)), **ODD)
    stream = Stream()
    step = DQNStep(cfg)
    fill(step, rng, stream)
    for _ in range(3):
        step.enqueue(stream=stream)
    step.save(tmp_path / "learner.npz")
    saved = step.state_numpy()
    for _ in range(3):
        step.enqueue(stream=stream)
    assert step.state_numpy()["params"].tobytes() != saved["params"].tobytes()
    step.load(tmp_path / "learner.npz")
    restored = step.state_numpy()
    for key in saved:
        assert saved[key].tobytes() == restored[key].tobytes(), key
    other = DQNStep(DQNConfig(seed=1, **dict(ODD, hidden=(70, 34))))
    with pytest.raises(ValueError, match="differs"):
        other.load(tmp_path / "learner.npz")
    # A state the kernels cannot go on from is refused whole: the learner keeps every bit.
    other_values = {k: saved[k] + 1 for k in ("params", "target", "m", "v", "u")}
    for change, match in ((dict(t=np.array(-1)), r"t \(AdamW updates applied\) must be in"),
                          (dict(step=saved["t"] - 1), r"step .* must be in \[t"),
                          (dict(v=-saved["v"] - 1), "negative")):
        with pytest.raises(ValueError, match=match):
            step.load_state({**saved, **other_values, **change})
        now = step.state_numpy()
        for key in saved:
            assert saved[key].tobytes() == now[key].tobytes(), key


def test_q_values_are_the_dueling_combination(device, rng):
    cfg = DQNConfig(seed=int(rng.integers(1 << 30)), tf32=False, **ODD)
    step = DQNStep(cfg)
    obs = rng.standard_normal((37, 3)).astype(np.float32)
    q = step.q_values(obs, stream=Stream())
    out = mlp_forward(step.params.to_numpy(), obs, len(step.layout.layers))[-1]
    want = out[:, :1] + out[:, 1:] - out[:, 1:].mean(axis=1, keepdims=True)
    assert q.shape == (37, 4) and rel(q, want) < 1e-5


def test_gate_lets_the_device_decide_whether_the_captured_step_runs(device, rng):
    """A step captured with a gate does nothing at all while the gate is set."""
    from drvtrain import DeviceBuffer, capture
    cfg = DQNConfig(seed=int(rng.integers(1 << 30)), **ODD)
    stream = Stream()
    step = DQNStep(cfg)
    fill(step, rng, stream)
    gate = DeviceBuffer.from_numpy(np.array([int(rng.integers(1, 1 << 30))], np.int32))
    with capture(stream) as graph:
        step.enqueue(stream=stream, gate=gate)
    exe = graph.instantiate()
    before = step.state_numpy()
    before["grads"] = step.grads.buffer.to_numpy()  # the norm kernel sums dW0 into them when it runs
    tree = step.replay.tree
    leaves, sampled = tree.leaves.to_numpy(), tree.step.to_numpy()
    for _ in range(3):
        exe.launch(stream)
        step.metrics.record(stream)
    stream.synchronize()
    after = step.state_numpy()
    after["grads"] = step.grads.buffer.to_numpy()
    for key in before:
        assert before[key].tobytes() == after[key].tobytes(), key
    assert tree.leaves.to_numpy().tobytes() == leaves.tobytes() and tree.step.to_numpy() == sampled
    step.check_errors()  # a gated step is not a skipped one
    assert step.metrics.poll() == []
    gate.copy_from_numpy(np.zeros(1, np.int32))
    exe.launch(stream)
    stream.synchronize()
    assert step.steps_done() == 1 and step.state_numpy()["t"] == before["t"] + 1
    assert tree.step.to_numpy() == sampled + 1


def _head_case(rng, hidden, n_actions, batch):
    cols = 1 + n_actions
    return dict(h=[np.maximum(rng.standard_normal((batch, hidden)), 0).astype(np.float32) for _ in range(3)],
                w=[(rng.standard_normal((cols, hidden)) / np.sqrt(hidden)).astype(np.float32) for _ in range(2)],
                bias=[rng.standard_normal(cols).astype(np.float32) for _ in range(2)],
                action=rng.integers(0, n_actions, batch).astype(np.int32),
                reward=rng.standard_normal(batch).astype(np.float32),
                done=(rng.random(batch) < 0.3).astype(np.float32),
                weights=rng.uniform(0.1, 1.0, batch).astype(np.float32))


def _run_head(case, hidden, n_actions, batch, gamma, delta, stream, gate=0, means="last block", name="dqn_head"):
    """dqn_head (or the build ``name``) on the case, every output poisoned first; returns the
    outputs as host arrays. ``means``: "last block" (a counter), "kernel" (no counter, then
    dqn_means_256, as the step runs it) or "none" (no counter and nothing after)."""
    from drvtrain import builtin_module
    from drvtrain.rl.dqn import HEAD_SIGNATURE, MEANS_SIGNATURE, _HEAD_ROWS, head_shared_bytes
    kernel = builtin_module("dqn.cu").kernel(name, HEAD_SIGNATURE, fixed_block=True)
    cols = 1 + n_actions
    dev = [DeviceBuffer.from_numpy(x) for x in (*case["h"], case["w"][0], case["bias"][0], case["w"][1],
                                                case["bias"][1], case["action"], case["reward"], case["done"],
                                                case["weights"])]
    outs = [DeviceBuffer((batch, cols)) for _ in range(4)] + [DeviceBuffer((batch, hidden)), DeviceBuffer(batch),
                                                              DeviceBuffer(4), DeviceBuffer(batch, np.int32)]
    grid = -(-batch // _HEAD_ROWS)
    partials, counter = DeviceBuffer(3 * grid, np.float64), DeviceBuffer.zeros(1, np.uint32)
    for buf in outs:
        buf.poison(stream=stream)
    q_s, q_next, q_target, dout, dh, priorities, scalars, a_star = outs
    kernel.launch(grid, kernel.block, *dev[:3], hidden, *dev[3:11], batch, n_actions, gamma, delta,
                  q_s, q_next, q_target, dout, dh, priorities, scalars, partials,
                  counter if means == "last block" else 0, a_star, gate,
                  stream=stream, shared_mem=head_shared_bytes(hidden, n_actions))
    if means == "kernel":
        sums = builtin_module("dqn.cu").kernel("dqn_means_256", MEANS_SIGNATURE, fixed_block=True)
        sums.launch(3, sums.block, partials, grid, batch, scalars, gate, stream=stream)
    stream.synchronize()
    assert counter.to_numpy()[0] == 0
    names = ("q_s", "q_next", "q_target", "dout", "dh", "priorities", "scalars", "a_star")
    return {name: buf.to_numpy() for name, buf in zip(names, outs)}


@pytest.mark.parametrize("hidden, n_actions, batch, broken", [
    (33, 4, 10, False), (256, 2, 256, False), (1024, 18, 61, False), (64, 1, 7, False), (40, 3, 9, True),
    (36, 2, 11, True)],
    ids=["odd-scalar-copies", "small", "large-partial-block", "one-action", "nan-and-bad-action",
         "two-actions-nan-and-bad-action"])
def test_head_kernel_matches_float64(device, rng, hidden, n_actions, batch, broken):
    """dqn_head alone: the output layer's three forwards, the loss and the output
    layer's dX, against float64, every output poisoned first; a last block with
    fewer than its rows; hidden widths with and without 16-byte copies. With
    ``broken``, row 1 of h(s) holds a NaN, row 3 an action past the last and row 4 a
    negative one: those rows' gradients and priorities and the scalars are NaN, the
    others exact. And
    dqn_loss fed the head's own Q rows gives the very same bits."""
    gamma, delta = 0.97, 0.8
    case = _head_case(rng, hidden, n_actions, batch)
    clean_case = {k: ([x.copy() for x in v] if isinstance(v, list) else v.copy()) for k, v in case.items()}
    clean = np.ones(batch, bool)
    if broken:
        case["h"][0][1, 5] = np.nan
        case["action"][3] = n_actions
        case["action"][4] = -1
        clean[[1, 3, 4]] = False
    stream = Stream()
    got = _run_head(case, hidden, n_actions, batch, gamma, delta, stream)
    # The step's way: no counter, the means from dqn_means_256 after the head: the same
    # bits everywhere; and with no counter and nothing after, the scalars stay poisoned.
    split = _run_head(case, hidden, n_actions, batch, gamma, delta, stream, means="kernel")
    for name in got:
        assert got[name].tobytes() == split[name].tobytes(), name
    alone = _run_head(case, hidden, n_actions, batch, gamma, delta, stream, means="none")
    assert np.all(alone["scalars"].view(np.uint32) == 0xFFFFFFFF)
    assert alone["dh"].tobytes() == got["dh"].tobytes()
    if n_actions == 2:  # the build for two actions: every output the same bits, both means paths
        for means, want in (("last block", got), ("kernel", split)):
            two = _run_head(case, hidden, n_actions, batch, gamma, delta, stream, means=means, name="dqn_head_a2")
            for name in want:
                assert two[name].tobytes() == want[name].tobytes(), ("dqn_head_a2", means, name)
    f64 = lambda x: np.asarray(x, np.float64)
    h, w, bias = clean_case["h"], clean_case["w"], clean_case["bias"]
    want_q = [f64(h[0]) @ f64(w[0]).T + bias[0], f64(h[1]) @ f64(w[0]).T + bias[0], f64(h[2]) @ f64(w[1]).T + bias[1]]
    for name, want in zip(("q_s", "q_next", "q_target"), want_q):
        assert rel(got[name][clean], want[clean]) < 1e-6, name
    res = dqn_loss(*want_q, clean_case["action"], clean_case["reward"], clean_case["done"], clean_case["weights"],
                   gamma, delta)
    assert rel(got["dout"][clean], res["dout"][clean]) < 1e-5
    assert rel(got["priorities"][clean], res["priorities"][clean]) < 1e-5
    want_dh = (res["dout"] @ f64(w[0])) * (h[0] > 0)
    assert rel(got["dh"][clean], want_dh[clean]) < 1e-5
    if broken:
        assert np.isnan(got["dout"][~clean]).all() and np.isnan(got["priorities"][~clean]).all()
        assert np.isnan(got["scalars"][:3]).all()
    else:
        wants = (res["loss"], res["mean_q"], res["mean_abs_td"])
        for value, want, scale in zip(got["scalars"][:3], wants, loss_scales(res)):
            assert abs(value - want) <= 1e-5 * scale
    top = np.sort(dueling_q(want_q[1]), axis=1)
    sure = clean & ((top[:, -1] - top[:, -2] > 1e-4) if n_actions > 1 else True)
    np.testing.assert_array_equal(got["a_star"][sure], res["a_star"][sure])

    # dqn_loss on the head's own Q rows: the same per-sample loss, bit for bit, NaN rows included,
    # with its Q rows on 16-byte boundaries (16-byte copies), all 4 bytes past them, and only
    # the second of the three 4 bytes past (4-byte copies: every array is checked).
    from drvtrain import builtin_module
    from drvtrain.rl.dqn import LOSS_SIGNATURE, MEANS_SIGNATURE
    loss = builtin_module("dqn.cu").kernel("dqn_loss", LOSS_SIGNATURE, fixed_block=True)
    sums = builtin_module("dqn.cu").kernel("dqn_means_32", MEANS_SIGNATURE, fixed_block=True)
    per_sample = [DeviceBuffer.from_numpy(case[k]) for k in ("action", "reward", "done", "weights")]
    grid = -(-batch // loss.block)
    scalars = {}
    for offsets in ((0, 0, 0), (4, 4, 4), (0, 4, 0)):
        q = []
        for k, offset in zip(("q_s", "q_next", "q_target"), offsets):
            host = np.concatenate([rng.standard_normal(offset // 4).astype(np.float32), got[k].ravel()])
            q.append(DeviceBuffer.from_numpy(host).view(np.float32, got[k].shape, offset))
        outs = [DeviceBuffer((batch, 1 + n_actions)), DeviceBuffer(batch), DeviceBuffer(4),
                DeviceBuffer(batch, np.int32)]
        for buf in outs:
            buf.poison(stream=stream)
        loss.launch(grid, loss.block, *q, *per_sample, batch, n_actions, gamma, delta, outs[0], outs[1], outs[2],
                    DeviceBuffer(3 * grid, np.float64), DeviceBuffer.zeros(1, np.uint32), outs[3], 0, stream=stream)
        # No counter, then dqn_means_32 (the step's way): the same scalars, bit for bit.
        partials, later = DeviceBuffer(3 * grid, np.float64), DeviceBuffer(4)
        later.poison(stream=stream)
        loss.launch(grid, loss.block, *q, *per_sample, batch, n_actions, gamma, delta, outs[0], outs[1], later,
                    partials, 0, outs[3], 0, stream=stream)
        sums.launch(3, sums.block, partials, grid, batch, later, 0, stream=stream)
        stream.synchronize()
        assert later.to_numpy()[:3].tobytes() == outs[2].to_numpy()[:3].tobytes(), f"means, offsets {offsets}"
        for name, buf in zip(("dout", "priorities", "a_star"), (outs[0], outs[1], outs[3])):
            np.testing.assert_array_equal(buf.to_numpy(), got[name], err_msg=f"{name}, offsets {offsets}")
        scalars[offsets] = outs[2].to_numpy()[:3]
    for offsets in scalars:
        np.testing.assert_array_equal(scalars[offsets], scalars[(0, 0, 0)], err_msg=f"scalars, offsets {offsets}")
    if not broken:
        wants = (res["loss"], res["mean_q"], res["mean_abs_td"])
        for value, want, scale in zip(scalars[(0, 0, 0)], wants, loss_scales(res)):
            assert abs(value - want) <= 1e-5 * scale


def test_head_kernel_gate_writes_nothing(device, rng):
    """While the gate word is non-zero dqn_head writes nothing (it tests the gate once its first
    loads are issued): every output keeps its poison."""
    stream = Stream()
    gate = DeviceBuffer.from_numpy(np.ones(1, np.int32))
    case = _head_case(rng, 64, 3, 20)
    two = _head_case(rng, 64, 2, 20)
    for means in ("last block", "kernel"):  # dqn_means_256 follows the gate too
        for got in (_run_head(case, 64, 3, 20, 0.99, 1.0, stream, gate=gate, means=means),
                    _run_head(two, 64, 2, 20, 0.99, 1.0, stream, gate=gate, means=means, name="dqn_head_a2")):
            for name, value in got.items():  # DeviceBuffer.poison's pattern
                assert np.all(value.view(np.uint32) == 0xFFFFFFFF), (means, name)


@pytest.mark.parametrize("kernel_name, n_actions", [("dqn_head", 0), ("dqn_head", 65), ("dqn_head_a2", 3),
                                                    ("dqn_head_a2", 1)])
def test_head_kernel_with_a_bad_action_count_writes_nan_means_only(device, rng, kernel_name, n_actions):
    """n_actions outside [1, 64] (dqn_head), or other than 2 (dqn_head_a2): the kernel writes
    NaN means and nothing else, whether its last block writes them or (no counter)
    dqn_means_256 sums the partials it left."""
    stream = Stream()
    case = _head_case(rng, 64, 3, 20)
    for means in ("last block", "kernel"):
        got = _run_head(case, 64, n_actions, 20, 0.99, 1.0, stream, means=means, name=kernel_name)
        assert np.isnan(got["scalars"][:3]).all(), means
        for name, value in got.items():
            if name != "scalars":
                assert np.all(value.view(np.uint32) == 0xFFFFFFFF), (means, name)


def test_fused_head_only_where_the_output_layers_fit(device):
    """Forced: both 1024 x (1 + 18) output layers fit one block's shared memory (201 KiB); 1024 x 31
    do not, and that step warns and takes the separate forward, loss and dX kernels. Automatic:
    only output layers of 512 to 3072 weights."""
    with pytest.warns(UserWarning, match="fused_head=True: the output layers take"):
        DQNStep(DQNConfig(obs_dim=8, batch=64, capacity=256, hidden=(1024,), n_actions=30,
                          fused_head=True)).close()
    cases = [(dict(hidden=(1024,), n_actions=18, fused_head=True), True),
             (dict(hidden=(256,), n_actions=2, fused_head=False), False),
             (dict(hidden=(256,), n_actions=2), True), (dict(hidden=(512,), n_actions=5), True),
             (dict(hidden=(64,), n_actions=2), False), (dict(hidden=(1024,), n_actions=18), False)]
    for overrides, fused in cases:
        step = DQNStep(DQNConfig(obs_dim=8, batch=64, capacity=256, **overrides))
        try:
            assert (step._head is not None) == fused, overrides
        finally:
            step.close()


@pytest.mark.parametrize("batch, hidden, n_actions, w_offset, q_offset, broken", [
    (512, 1024, 18, 0, 0, False), (450, 1000, 31, 4, 0, False), (129, 4000, 4, 0, 0, True),
    (60, 6400, 1, 4, 0, False), (450, 1000, 18, 4, 0, False), (450, 1000, 18, 0, 0, True),
    (512, 1024, 18, 0, 4, False), (450, 1000, 31, 0, 12, True)],
    ids=["large", "ragged-32-outputs-4-byte-copies", "nan-and-bad-action", "one-ragged-row-tile-one-action",
         "eighteen-actions-4-byte-copies", "eighteen-actions-nan-and-bad-action", "large-q-rows-4-byte-copies",
         "ragged-32-outputs-q-rows-4-byte-copies-nan"])
def test_loss_in_the_output_layers_backward_matches_float64_and_the_kernels_apart(device, rng, batch, hidden,
                                                                                  n_actions, w_offset, q_offset,
                                                                                  broken):
    """gemm.cu's dqn_loss_dwl: the loss of each block's rows, then the output layer's dX,
    dW and db from them, in one launch (the row tiles of a column as one cluster), every
    output poisoned first. dout, the priorities, a* and the loss's partials (summed by
    dqn_means_32) are dqn_loss's bit for bit; dX, dW and db are the fold's
    (linear_grad_input_dwl) on that dout, bit for bit; all of them match float64. With
    ``broken``, row 1 of Q(s') holds a NaN, row 3 an action past the last, row 4 a negative
    one, row 5 of Q_target(s') and row 6 of Q(s) a NaN (those two rows' advantage means are taken by the
    block's other warps): those rows' gradients and priorities are NaN, and so are dW, db
    and the means. Nothing is written while the gate is set. With 18 actions the step's
    build for them (``_a18``) runs, and the build for any count gives every output the
    same bits. ``q_offset`` (bytes, not a multiple of 16) starts the three Q arrays off
    16-byte alignment, where the kernel copies Q(s') and Q_target(s') 4 bytes at a time."""
    from drvtrain import builtin_module
    from drvtrain.nn.mlp import LinearKernels
    from drvtrain.rl.dqn import LOSS_DWL_SIGNATURE, LOSS_SIGNATURE, MEANS_SIGNATURE
    if tuple(device.compute_capability) < (9, 0):
        pytest.skip(f"the kernel runs its row tiles as a cluster: compute capability 9.0; this is {device.arch}")
    stream = Stream()
    k, gamma, delta = 1 + n_actions, 0.97, 0.8
    qs = [rng.standard_normal((batch, k)).astype(np.float32) for _ in range(3)]
    action = rng.integers(0, n_actions, batch).astype(np.int32)
    reward = rng.standard_normal(batch).astype(np.float32)
    done = (rng.random(batch) < 0.3).astype(np.float32)
    weights = rng.uniform(0.1, 1.0, batch).astype(np.float32)
    clean = np.ones(batch, bool)
    clean_qs, clean_action = [x.copy() for x in qs], action.copy()  # the float64 reference's
    if broken:  # a NaN in each of the three rows a sample's loss reads, an action out of range
        qs[1][1, 2] = np.nan
        action[3] = n_actions
        action[4] = -1
        qs[2][5, 1] = np.nan
        qs[0][6, 1] = np.nan  # A_0: the row's advantage mean, not V
        clean[[1, 3, 4, 5, 6]] = False
    h_h = np.maximum(rng.standard_normal((batch, hidden)), 0.0).astype(np.float32)
    w_h = (rng.standard_normal((k, hidden)) / np.sqrt(hidden)).astype(np.float32)
    w_all = DeviceBuffer.from_numpy(np.concatenate([rng.standard_normal(w_offset // 4).astype(np.float32),
                                                    w_h.ravel()]))
    w = w_all.view(np.float32, (k, hidden), w_offset)
    q_all = [DeviceBuffer.from_numpy(np.concatenate([rng.standard_normal(q_offset // 4).astype(np.float32),
                                                     x.ravel()])) for x in qs]
    q = [buf.view(np.float32, (batch, k), q_offset) for buf in q_all]
    per_sample = [DeviceBuffer.from_numpy(x) for x in (action, reward, done, weights)]
    h = DeviceBuffer.from_numpy(h_h)
    blocks = -(-batch // 32)

    def outputs():
        outs = dict(dout=DeviceBuffer((batch, k)), priorities=DeviceBuffer(batch), a_star=DeviceBuffer(batch, np.int32),
                    partials=DeviceBuffer(3 * blocks, np.float64), scalars=DeviceBuffer(4),
                    dx=DeviceBuffer((batch, hidden)), dw=DeviceBuffer((k, hidden)), db=DeviceBuffer(k))
        for buf in outs.values():
            buf.poison(stream=stream)
        return outs

    gemm_mod, dqn_mod = builtin_module("gemm.cu"), builtin_module("dqn.cu")
    sums = dqn_mod.kernel("dqn_means_32", MEANS_SIGNATURE, fixed_block=True)
    # Apart: dqn_loss, dqn_means_32, then the fold on its dout.
    apart = outputs()
    loss = dqn_mod.kernel("dqn_loss", LOSS_SIGNATURE, fixed_block=True)
    loss.launch(blocks, loss.block, *q, *per_sample, batch, n_actions, gamma, delta, apart["dout"],
                apart["priorities"], apart["scalars"], apart["partials"], 0, apart["a_star"], 0, stream=stream)
    sums.launch(3, sums.block, apart["partials"], blocks, batch, apart["scalars"], 0, stream=stream)
    bk = LinearKernels(("grad_input", "grad_weight"), "3xtf32", device.sm_count)
    assert bk.plan_last_dw(batch, hidden, k) is not None
    bk.launch_last_dw(apart["dout"], k, w, hidden, apart["dx"], hidden, batch, hidden, k, mask=h, ldm=hidden,
                      dw=apart["dw"], lddw=hidden, db=apart["db"], stream=stream)
    # In one launch.
    vec = 4 if w_offset % 16 else 16
    name = loss_dwl_kernel_name(n_actions, vec)
    assert ("_a18_" in name) == (n_actions == 18)
    fused = gemm_mod.kernel(name, LOSS_DWL_SIGNATURE, fixed_block=True)
    grid = (-(-hidden // 64), -(-batch // 64), 1)

    def launch(outs, gate=0, kernel=fused):
        kernel.launch(grid, kernel.block, outs["dout"], k, w, hidden, outs["dx"], hidden, batch, hidden, k, 0, h,
                      hidden, 0, 0, 0, gate, outs["dw"], hidden, outs["db"], *q, *per_sample, gamma, delta,
                      outs["priorities"], outs["partials"], blocks, outs["a_star"], stream=stream,
                      cluster=(1, grid[1], 1), cluster_policy="load_balancing")

    def run(kernel=fused):
        outs = outputs()
        launch(outs, kernel=kernel)
        sums.launch(3, sums.block, outs["partials"], blocks, batch, outs["scalars"], 0, stream=stream)
        stream.synchronize()
        return {name: buf.to_numpy() for name, buf in outs.items()}

    got = run()
    for name, buf in apart.items():
        assert buf.to_numpy().tobytes() == got[name].tobytes(), name
    if n_actions == 18:  # the build for any count: the same bits
        anyk = run(gemm_mod.kernel(f"dqn_loss_dwl_64x64_cp{vec}_cluster_3xtf32", LOSS_DWL_SIGNATURE,
                                   fixed_block=True))
        for name, value in got.items():
            assert value.tobytes() == anyk[name].tobytes(), ("any count", name)
    # Against float64.
    res = dqn_loss(*clean_qs, clean_action, reward, done, weights, gamma, delta)
    assert rel(got["dout"][clean], res["dout"][clean]) < 1e-5
    assert rel(got["priorities"][clean], res["priorities"][clean]) < 1e-5
    # a* wherever the top two Q(s') are not a near tie, which float32 and float64 may break
    # either way (as in test_head_kernel_matches_float64); nearly every row is clear of one.
    top = np.sort(dueling_q(clean_qs[1]), axis=1)
    sure = clean & ((top[:, -1] - top[:, -2] > 1e-4) if n_actions > 1 else True)
    assert sure.sum() >= 0.95 * clean.sum()
    np.testing.assert_array_equal(got["a_star"][sure], res["a_star"][sure])
    want_dx = (res["dout"] @ w_h.astype(np.float64)) * (h_h > 0)
    assert rel(got["dx"][clean], want_dx[clean]) < 1e-5
    if broken:
        assert np.isnan(got["dout"][~clean]).all() and np.isnan(got["priorities"][~clean]).all()
        # Every dW and db sum takes rows 1 and 3, whose gradient rows are NaN.
        assert np.isnan(got["scalars"][:3]).all() and np.isnan(got["db"]).all() and np.isnan(got["dw"]).all()
    else:
        assert rel(got["dw"], res["dout"].T @ h_h.astype(np.float64)) < 1e-5
        # db: a float32 sum of the batch's gradients, which can cancel to far below their
        # sizes (one action: V's column of TD errors), errs by some ulp of the sum of the
        # sizes, as loss_scales says of the means: each column against its own (a NaN fails).
        db_err = np.abs(got["db"].astype(np.float64) - res["dout"].sum(axis=0))
        assert (db_err <= 1e-5 * np.abs(res["dout"]).sum(axis=0)).all(), db_err
        wants = (res["loss"], res["mean_q"], res["mean_abs_td"])
        for value, want, scale in zip(got["scalars"][:3], wants, loss_scales(res)):
            assert abs(value - want) <= 1e-5 * scale
    # The gate: nothing written.
    gated = outputs()
    launch(gated, gate=DeviceBuffer.from_numpy(np.ones(1, np.int32)))
    stream.synchronize()
    for name, buf in gated.items():
        assert np.all(buf.to_numpy().view(np.uint8) == 0xFF), name


@pytest.mark.provokes_driver_errors
@pytest.mark.parametrize("build", ["a18", "any"])
def test_the_loss_built_for_18_actions_traps_on_another_count(device, build):
    """The device's own check of dqn_loss_dwl_a18: launched (past the host's routing) with
    four actions, it traps and the launch fails, rather than read Q's rows with the wrong
    stride; the build for any count runs the same launch to the end. In a child process,
    since a trap ends the CUDA context."""
    if tuple(device.compute_capability) < (9, 0):
        pytest.skip(f"the kernel runs its row tiles as a cluster: compute capability 9.0; this is {device.arch}")
    name = "dqn_loss_dwl_a18_64x64_cp16_cluster_3xtf32" if build == "a18" else loss_dwl_kernel_name(4, 16)
    code = f"""
        import numpy as np
        from drvtrain import DeviceBuffer, Stream, builtin_module
        from drvtrain.rl.dqn import LOSS_DWL_SIGNATURE
        rng = np.random.default_rng(0)
        batch, hidden, k = 64, 64, 5
        f32 = lambda *shape: DeviceBuffer.from_numpy(rng.standard_normal(shape).astype(np.float32))
        kernel = builtin_module("gemm.cu").kernel("{name}", LOSS_DWL_SIGNATURE, fixed_block=True)
        dout, w, dx, h, dw, db = f32(batch, k), f32(k, hidden), f32(batch, hidden), f32(batch, hidden), \
            f32(k, hidden), f32(k)
        q = [f32(batch, k) for _ in range(3)]
        action = DeviceBuffer.from_numpy(rng.integers(0, k - 1, batch).astype(np.int32))
        per_sample = [action, f32(batch), DeviceBuffer.from_numpy(np.zeros(batch, np.float32)), f32(batch)]
        priorities, a_star = f32(batch), DeviceBuffer(batch, np.int32)
        partials = DeviceBuffer(3 * 2, np.float64)
        stream = Stream()
        kernel.launch((1, 1, 1), kernel.block, dout, k, w, hidden, dx, hidden, batch, hidden, k, 0, h, hidden,
                      0, 0, 0, 0, dw, hidden, db, *q, *per_sample, 0.99, 1.0, priorities, partials, 2, a_star,
                      stream=stream, cluster=(1, 1, 1), cluster_policy="load_balancing")
        stream.synchronize()
        print("no trap")
    """
    done = run_python(code)
    if build == "any":  # the same launch is sound: what fails below is the check
        assert done.returncode == 0 and "no trap" in done.stdout, (done.stdout, done.stderr[-2000:])
    else:
        assert done.returncode != 0 and "no trap" not in done.stdout, (done.stdout, done.stderr[-2000:])
        assert "CUDA_ERROR" in done.stderr, done.stderr[-2000:]


@pytest.mark.provokes_driver_errors
@pytest.mark.parametrize("shape", ["sound", "k_past_one_tile", "split"])
def test_the_folded_output_layer_traps_on_a_launch_it_cannot_sum(device, shape):
    """The device's own check of the grad_input_dwl kernels (the output layer's dX with its
    dW and db folded in), made before any copy: launched past the host's plan with K past
    one k tile (40 > 32) or split over k (gridDim.z = 2), the kernel traps and the launch
    fails, rather than sum a dW share of one tile or two splits' shares; the sound launch
    (K = 19, unsplit) runs to the end. In a child process, since a trap ends the CUDA
    context."""
    if tuple(device.compute_capability) < (9, 0):
        pytest.skip(f"the kernel runs its row tiles as a cluster: compute capability 9.0; this is {device.arch}")
    k = 40 if shape == "k_past_one_tile" else 19
    splits = 2 if shape == "split" else 1
    code = f"""
        import numpy as np
        from drvtrain import DeviceBuffer, Stream, builtin_module
        from drvtrain.nn.mlp import _LAST_DW_SIGNATURE
        rng = np.random.default_rng(0)
        m, n, k = 64, 64, {k}
        f32 = lambda *shape: DeviceBuffer.from_numpy(rng.standard_normal(shape).astype(np.float32))
        kernel = builtin_module("gemm.cu").kernel("linear_grad_input_dwl_64x64_cp4_cluster_3xtf32",
                                                  _LAST_DW_SIGNATURE, fixed_block=True)
        dy, w, dx, h, dw, db = f32(m, k), f32(k, n), f32(m, n), f32(m, n), f32(k, n), f32(k)
        # a split-k workspace and zeroed counters, so that a split launch fails only at the check
        work, counters = f32(4 * m * n), DeviceBuffer.from_numpy(np.zeros(64, np.uint32))
        stream = Stream()
        kernel.launch((1, 1, {splits}), kernel.block, dy, k, w, n, dx, n, m, n, k, 0, h, n, 0, work, counters, 0,
                      dw, n, db, stream=stream, cluster=(1, 1, 1), cluster_policy="load_balancing")
        stream.synchronize()
        print("no trap")
    """
    done = run_python(code)
    if shape == "sound":  # the same launch with a shape the kernel sums: what fails below is the check
        assert done.returncode == 0 and "no trap" in done.stdout, (done.stdout, done.stderr[-2000:])
    else:
        assert done.returncode != 0 and "no trap" not in done.stdout, (done.stdout, done.stderr[-2000:])
        assert "CUDA_ERROR" in done.stderr, done.stderr[-2000:]


def test_large_step_with_the_loss_in_the_backward_is_the_step_apart_bit_for_bit(device, rng):
    """DQNConfig(fused_loss=...): the large step computes its loss in the output layer's
    backward product (dqn_loss_dwl: one node, no dqn_loss) or apart, and three steps from
    the same state give the same parameters, moments, target, gradients, priorities and
    scalars bit for bit either way."""
    if tuple(device.compute_capability) < (9, 0):
        pytest.skip(f"the fold runs its row tiles as a cluster: compute capability 9.0; this is {device.arch}")
    seed = int(rng.integers(1 << 30))
    states = {}
    for fused in (True, False):
        cfg = DQNConfig(seed=seed, **LARGE, fused_loss=fused)
        stream = Stream()
        step = DQNStep(cfg)
        names = [k.function for k in step_kernels(step)]
        assert any(n.startswith("dqn_loss_dwl_") for n in names) == fused, names
        assert ("dqn_loss" in names) != fused, names
        fill(step, np.random.default_rng(seed), stream)
        exe = step.capture(stream=stream)
        for _ in range(3):
            exe.launch(stream)
        stream.synchronize()
        states[fused] = {**step.state_numpy(), "priorities": step.replay.tree.leaves_numpy(),
                         "scalars": step._scalars.to_numpy(), "grads": step.grads.buffer.to_numpy()}
        exe.close()
        step.close()
    for name, value in states[True].items():
        assert np.asarray(value).tobytes() == np.asarray(states[False][name]).tobytes(), name


def test_the_loss_only_forwards_store_no_hidden_output(device, rng):
    """The large step runs its target forward and its online forward of s' with
    ``store_hidden=False`` (the loss reads only their Q) and the online forward of s,
    whose activations the backward reads, without; where the head kernel computes Q,
    those two launch it with no H."""
    cfg = DQNConfig.large(capacity=4096, seed=int(rng.integers(1 << 30)))
    stream = Stream()
    step = DQNStep(cfg)
    try:
        fill(step, rng, stream)
        mlp = step.online_mlp
        stores, heads = [], []
        real_forward, real_head = mlp.forward, mlp.forward_kernels.launch_head

        def forward(*args, **kwargs):
            stores.append(kwargs.get("store_hidden", True))
            return real_forward(*args, **kwargs)

        def launch_head(*args, **kwargs):
            heads.append(args[4] is not None)  # H
            return real_head(*args, **kwargs)

        mlp.forward, mlp.forward_kernels.launch_head = forward, launch_head
        step.enqueue(stream=stream)
        stream.synchronize()
        assert sorted(stores) == [False, False, True]
        folded = mlp.head_folded(cfg.batch, sms=step._forward_sms)
        assert folded == (tuple(device.compute_capability) >= (9, 0))
        assert sorted(heads) == ([False, False, True] if folded else [])
    finally:
        step.close()
