"""TrainConfig validation and its JSON round trip, and the trainer's progress report (CPU)."""
import json

import numpy as np
import pytest

from drvtrain.rl.trainer import ENV_DEFAULTS, TrainConfig, Trainer


def test_cartpole_defaults_are_valid_and_round_trip_through_json():
    cfg = TrainConfig.for_env("cartpole")
    assert cfg.n_envs == ENV_DEFAULTS["cartpole"]["n_envs"]
    again = TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg
    tweaked = TrainConfig.for_env("cartpole", seed=7, dqn=dict(lr=1e-3))
    assert tweaked.dqn["lr"] == 1e-3 and tweaked.dqn["hidden"] == ENV_DEFAULTS["cartpole"]["dqn"]["hidden"]


@pytest.mark.parametrize("overrides, match", [
    (dict(env="pong"), "unknown environment 'pong'"),
    (dict(n_envs=0), "n_envs"),
    (dict(total_steps=0), "total_steps"),
    (dict(train_every=5, n_envs=10), "train_every"),
    (dict(eps_start=1.5), "eps_start"),
    (dict(eval_episodes=0), "eval_episodes"),
    (dict(dqn=dict(lr=-1.0)), "lr"),
    (dict(dqn=dict(obs_dim=3)), "set by the trainer"),
    (dict(dqn=dict(no_such_field=1)), "not DQNConfig's"),
])
def test_bad_settings_name_the_field(overrides, match):
    env = overrides.pop("env", "cartpole")
    with pytest.raises(ValueError, match=match):
        if env != "cartpole":
            TrainConfig(env=env)
        else:
            TrainConfig.for_env(env, **overrides)


def test_unknown_settings_in_a_dict_are_refused():
    data = TrainConfig.for_env("cartpole").to_dict()
    data["learning_rate"] = 0.1
    with pytest.raises(ValueError, match="learning_rate"):
        TrainConfig.from_dict(data)


def test_epsilon_schedule_spans_a_fraction_of_the_run_and_at_least_one_step():
    cfg = TrainConfig(total_steps=10_000, eps_start=0.9, eps_end=0.1, eps_fraction=0.25)
    assert cfg.epsilon_schedule == (0.9, 0.1, 2500)
    assert TrainConfig(total_steps=10_000, eps_fraction=0.0).epsilon_schedule[2] == 1


CAPACITY, N_ACTIONS, N_ENVS, MAX_STEPS, N_PARAMS, N_U = 1000, 3, 8, 500, 40, 12


def trainer_state(rng, iterations=90):
    """A consistent Trainer.state_arrays() for a 1000-slot replay, 8 envs, 3 actions:
    random transitions and priorities, the tree's sums from its leaves, the largest leaf
    seen equal to the largest leaf (as inserts leave it), the counters of `iterations`
    iterations (90: 720 transitions, the replay not yet full; 0: a trainer just made)."""
    import math

    from drvtrain.rl.sumtree import tree_levels
    steps = iterations * N_ENVS
    stored = min(steps, CAPACITY)
    leaves = np.zeros(-(-CAPACITY // 32) * 32, np.float32)
    leaves[:stored] = rng.uniform(0.1, 2.0, stored).astype(np.float32)
    levels = tree_levels(CAPACITY)
    nodes = np.zeros(sum(size for _, _, size in levels))
    children = leaves.astype(np.float64)
    for offset, real, _ in reversed(levels):
        padded = np.zeros(real * 32)
        padded[: min(len(children), real * 32)] = children[: real * 32]
        nodes[offset: offset + real] = padded.reshape(real, 32).sum(axis=1)
        children = nodes[offset: offset + real]
    tree_state = np.zeros(6, np.uint32)
    tree_state[4] = np.float32(leaves.max() if stored else 1.0).view(np.uint32)
    arrays = {
        "learner.params": rng.standard_normal(N_PARAMS).astype(np.float32),
        "learner.target": rng.standard_normal(N_PARAMS).astype(np.float32),
        "learner.m": rng.standard_normal(N_PARAMS).astype(np.float32),
        "learner.v": rng.uniform(1e-6, 1e-2, N_PARAMS).astype(np.float32),
        "learner.u": rng.standard_normal(N_U).astype(np.float32),
        "learner.t": np.array([5], np.int32), "learner.step": np.array([9], np.int64),
        "tree.nodes": nodes, "tree.leaves": leaves, "tree.state": tree_state,
        "replay.obs": rng.standard_normal((CAPACITY, 4)).astype(np.float32),
        "replay.next_obs": rng.standard_normal((CAPACITY, 4)).astype(np.float32),
        "replay.action": rng.integers(0, N_ACTIONS, CAPACITY).astype(np.int32),
        "replay.reward": rng.standard_normal(CAPACITY).astype(np.float32),
        "replay.done": (rng.random(CAPACITY) < 0.1).astype(np.float32),
        "replay.state": np.array([steps, stored], np.int64),
        "env.states": rng.standard_normal((N_ENVS, 4)).astype(np.float32),
        "env.obs": rng.standard_normal((N_ENVS, 4)).astype(np.float32),
        "env.episode_steps": rng.integers(0, MAX_STEPS, N_ENVS).astype(np.int32),
        "env.rng_counters": rng.integers(0, 2**32, N_ENVS).astype(np.uint32),
        "env.ep_return": rng.uniform(0, 100, N_ENVS).astype(np.float32),
        "loop": np.array([steps, iterations, 31 if steps else 0], np.int64), "gate": np.array([1], np.int32),
        "host": np.array([iterations, 2, 31, 31, 40] if steps else [0] * 5, np.int64),
        "host.recent": np.array([12.0, 30.0]),
    }
    assert math.isclose(nodes[0], float(leaves.astype(np.float64).sum()))
    return arrays, levels


def check(arrays, levels):
    from drvtrain.rl.trainer import check_trainer_state
    check_trainer_state(arrays, capacity=CAPACITY, levels=levels, n_actions=N_ACTIONS, n_envs=N_ENVS,
                        max_steps=MAX_STEPS, n_params=N_PARAMS, n_u=N_U)


def _set(key, index, value):
    def breaks(arrays):
        arrays[key] = arrays[key].copy()
        arrays[key].reshape(-1)[index] = value
    return breaks


def _node_nudge(arrays):  # a leaf changed without its sums: another run's tree
    arrays["tree.leaves"] = arrays["tree.leaves"].copy()
    arrays["tree.leaves"][7] *= 0.5


def _inserted_only(arrays):  # a full replay whose insert count alone is off
    arrays["loop"] = np.array([1600, 200, 31], np.int64)
    arrays["host"] = arrays["host"].copy()
    arrays["host"][0] = 200
    arrays["replay.state"] = np.array([1592, CAPACITY], np.int64)


def _root_gap(times):
    def breaks(arrays):  # the root off its children by `times` the tolerance
        max_leaf = float(arrays["tree.state"][4:5].view(np.float32)[0])
        arrays["tree.nodes"] = arrays["tree.nodes"].copy()
        arrays["tree.nodes"][0] += times * 1e-9 * CAPACITY * max_leaf
    return breaks


# What is broken, and a part of the refusal's message.
BROKEN_TRAINER_STATE = {
    "learner v negative": (_set("learner.v", 3, -1.0), "learner: v"),
    "learner t past step": (_set("learner.t", 0, 10), "learner: step"),
    "action out of range": (_set("replay.action", 5, N_ACTIONS), "replay.action"),
    "action negative": (_set("replay.action", 5, -1), "replay.action"),
    "done not 0 or 1": (_set("replay.done", 9, 0.5), "replay.done"),
    "obs nan": (_set("replay.obs", 17, np.nan), "replay.obs holds 1 values"),
    "next obs inf": (_set("replay.next_obs", 3, np.inf), "replay.next_obs"),
    "reward nan": (_set("replay.reward", 0, np.nan), "replay.reward"),
    "env obs nan": (_set("env.obs", 2, np.nan), "env.obs"),
    "episode return inf": (_set("env.ep_return", 1, -np.inf), "env.ep_return"),
    "episode steps at the limit": (_set("env.episode_steps", 0, MAX_STEPS), "env.episode_steps"),
    "episode steps negative": (_set("env.episode_steps", 0, -1), "env.episode_steps"),
    "loop steps not iterations x envs": (_set("loop", 0, 90 * N_ENVS + 1), "loop counters"),
    "loop episodes negative": (_set("loop", 2, -1), "loop counters"),
    "host iterations not the loop's": (_set("host", 0, 89), "host counters"),
    "host count negative": (_set("host", 3, -2), "host counters"),
    "gate not 0 or 1": (_set("gate", 0, 2), "gate"),
    "replay inserted not env steps": (_inserted_only, "replay counters [1592, 1000]"),
    "replay stored wrong": (_set("replay.state", 1, 700), "replay counters"),
    "leaf negative": (_set("tree.leaves", 4, -0.25), "negative"),
    "leaf nan": (_set("tree.leaves", 4, np.nan), "tree.leaves holds 1 values"),
    "leaf past the stored count": (_set("tree.leaves", 900, 0.5), "past the 720 stored"),
    "leaf just past the stored count": (_set("tree.leaves", 720, 0.5), "past the 720 stored"),
    "largest leaf seen below a leaf": (_set("tree.state", 4, np.float32(1.5).view(np.uint32)), "largest leaf"),
    "draw's last-block counter not 0": (_set("tree.state", 2, 1), "last-block counters [1, 0]"),
    "rebuild's last-block counter not 0": (_set("tree.state", 3, 7), "last-block counters [0, 7]"),
    "largest leaf seen inf": (_set("tree.state", 4, np.float32(np.inf).view(np.uint32)), "largest leaf"),
    "tree root off by twice the tolerance": (_root_gap(2.0), "not the sum of its leaves"),
    "tree sums of other leaves": (_node_nudge, "not the sum of its leaves"),
    "tree root off": (_set("tree.nodes", 0, 1.0), "not the sum of its leaves"),
    "tree padding": (_set("tree.nodes", 1, 0.5), "padding"),
    "tree sum nan": (_set("tree.nodes", 0, np.nan), "tree.nodes holds 1 values"),
}


@pytest.mark.parametrize("case", sorted(BROKEN_TRAINER_STATE))
def test_a_trainer_state_it_cannot_go_on_from_is_refused(rng, case):
    """check_trainer_state (Trainer.load_state_arrays runs it before writing anything)
    refuses each of these with a message naming the array; the consistent state passes."""
    arrays, levels = trainer_state(rng)
    check(arrays, levels)
    breaks, message = BROKEN_TRAINER_STATE[case]
    breaks(arrays)
    with pytest.raises(ValueError) as info:
        check(arrays, levels)
    assert message in str(info.value), str(info.value)


def test_states_a_trainer_goes_on_from_pass(rng):
    """A trainer just made (nothing stored, the tree empty, the largest leaf seen at its
    initial 1); a replay past its capacity (stored = capacity, every leaf live); internal
    sums off their leaves by float64 rounding of many updates (1e-12 relative), or by half
    the tolerance; an environment's own state not finite (only its observations must be)."""
    arrays, levels = trainer_state(rng, iterations=0)
    assert arrays["replay.state"].tolist() == [0, 0] and not arrays["tree.nodes"].any()
    check(arrays, levels)
    arrays, levels = trainer_state(rng, iterations=200)
    assert arrays["replay.state"].tolist() == [1600, CAPACITY]
    check(arrays, levels)
    arrays["tree.nodes"] = arrays["tree.nodes"] * (1 + 1e-12)
    check(arrays, levels)
    arrays, levels = trainer_state(rng)
    _root_gap(0.5)(arrays)
    arrays["env.states"] = arrays["env.states"].copy()
    arrays["env.states"][0, 1] = np.inf
    check(arrays, levels)


def test_the_rate_counts_only_the_steps_of_this_run(rng, monkeypatch):
    """After a resume at S env steps, steps/s is (steps now - S) over this run()'s wall time,
    not every step the run ever took."""
    trainer = object.__new__(Trainer)  # no device: only the report's arithmetic
    n = int(rng.integers(1, 64))
    trainer.config = TrainConfig(env="cartpole", n_envs=n, train_every=max(10, n))
    resumed_at, now_at = int(rng.integers(10**5, 10**6)), int(rng.integers(10**3, 10**5))
    trainer.iterations = (resumed_at + now_at) // trainer.config.n_envs
    trainer.episodes, trainer.recent, trainer.last_loss = 0, [], float("nan")
    clock = float(rng.integers(1000, 2000))
    monkeypatch.setattr("drvtrain.rl.trainer.time.perf_counter", lambda: clock)
    progress = trainer._progress(clock - 4.0, resumed_at, None)
    assert progress["steps_per_s"] == (trainer.env_steps - resumed_at) / 4.0
    assert progress["wall_s"] == 4.0 and progress["env_steps"] == trainer.env_steps


def test_register_env_checks_the_dimensions_it_is_given(monkeypatch):
    """Each dimension may be left out (the struct's is read when an env is built); one given is
    checked for its type and range at once, and a refused registration changes nothing."""
    from drvtrain.rl import env as env_module
    monkeypatch.setattr(env_module, "ENVIRONMENTS", dict(env_module.ENVIRONMENTS))
    env_module.register_env("mine", "mine.cu", obs_dim=3)
    spec = env_module.ENVIRONMENTS["mine"]
    assert (spec.obs_dim, spec.n_actions, spec.state_dim, spec.max_steps) == (3, None, None, None)
    for bad, error, match in ((dict(obs_dim=0), ValueError, r"obs_dim must be in 1\.\.1048576, got 0"),
                              (dict(max_steps=-1), ValueError, r"max_steps must be in 0\.\."),
                              (dict(n_actions=True), TypeError, "n_actions must be an integer, got bool"),
                              (dict(state_dim=2.0), TypeError, "state_dim must be an integer, got float")):
        with pytest.raises(error, match=match):
            env_module.register_env("other", "other.cu", **bad)
    assert "other" not in env_module.known_envs()
