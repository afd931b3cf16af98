"""The training loop on the device: schedule, replay contents, resume, reproducibility, a solved task."""
import os

import numpy as np
import pytest

from drvtrain.rl.env import register_env
from drvtrain.rl.trainer import TrainConfig, Trainer
from per_reference import fixed_order_nodes

pytestmark = pytest.mark.gpu
CHAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "envs", "chain.cu")

SMALL_LEARNER = dict(hidden=(64, 64), batch=64, capacity=4096, lr=1e-3, tau=None, target_period=20,
                     spectral_c=None, beta=0.4)


@pytest.fixture
def chain():
    register_env("chain", CHAIN, obs_dim=8, n_actions=2, state_dim=1, max_steps=50)
    return "chain"


def small_config(env="cartpole", **overrides):
    base = dict(n_envs=4, total_steps=4000, learning_starts=400, train_every=4, eps_fraction=0.5,
                eval_every=10**9, eval_episodes=8, unroll=10, checkpoint_every=10**9, dqn=dict(SMALL_LEARNER))
    base.update(overrides)
    return TrainConfig(env=env, **base)


def test_schedule_counters_and_replay_follow_the_device(device, rng):
    cfg = small_config(seed=int(rng.integers(1 << 30)))
    trainer = Trainer(cfg)
    trainer.run()
    loop = trainer.actor.loop.to_numpy()
    assert loop[0] == trainer.env_steps == 4000 and loop[1] == trainer.iterations == 1000
    # One gradient step per 4 env steps once 400 env steps are stored: (4000 - 400) / 4 + 1.
    assert trainer.learner.steps_done() == sum(trainer._learns(i) for i in range(1000)) == 901
    replay = trainer.learner.replay
    assert replay.stored() == 4000 and replay.cursor() == 4000
    assert trainer.episodes == int(loop[2]) and trainer.episodes > 20
    trainer.learner.check_errors()
    trainer.close()


def test_the_tree_after_wrapping_inserts_and_updates_is_the_fixed_order_sum_of_its_leaves(device, rng):
    """1001 slots filled four envs at a time: the inserts wrap past the end mid-iteration, the
    learner's priority updates land between them. Every internal node is, bit for bit, the
    fixed-order sum of its children (per_reference), as a rebuild from the leaves gives."""
    cfg = small_config(total_steps=3000, seed=int(rng.integers(1 << 30)),
                       dqn=dict(SMALL_LEARNER, capacity=1001))
    trainer = Trainer(cfg)
    trainer.run()
    tree = trainer.learner.replay.tree
    assert trainer.learner.replay.cursor() == 3000 and trainer.learner.steps_done() > 500
    leaves, nodes = tree.leaves.to_numpy(), tree.nodes_numpy()
    assert len(np.unique(leaves[:1001])) > 100  # priorities written by the updates, not only the inserts'
    assert nodes.tobytes() == fixed_order_nodes(leaves, tree.levels, tree.internal).tobytes()
    tree.rebuild(stream=trainer.stream)
    trainer.stream.synchronize()
    assert tree.nodes_numpy().tobytes() == nodes.tobytes()
    trainer.learner.check_errors()
    trainer.close()


def test_a_run_stops_at_its_target_not_at_a_launch_boundary(device, rng):
    """Targets that fall inside a launch of ``unroll`` iterations: the run stops at the first
    multiple of ``n_envs`` at or past them (a shorter last launch), on the host and on the
    device, and goes on from there."""
    cfg = small_config(total_steps=1234, seed=int(rng.integers(1 << 30)))  # 309 iterations of 4 envs
    trainer = Trainer(cfg)
    trainer.run(until=555)  # 139 iterations: 13 launches of 10 and one of 9
    loop = trainer.actor.loop.to_numpy()
    assert trainer.iterations == loop[1] == 139 and trainer.env_steps == loop[0] == 556
    summary = trainer.run()
    loop = trainer.actor.loop.to_numpy()
    assert trainer.iterations == loop[1] == 309 and summary["env_steps"] == loop[0] == 1236
    assert trainer.learner.replay.stored() == 1236
    assert trainer.learner.steps_done() == sum(trainer._learns(i) for i in range(309))
    trainer.learner.check_errors()
    trainer.close()


def test_truncated_episodes_are_bootstrapped_and_store_the_true_final_obs(device, rng, chain):
    """Random policy on the chain: terminations at the goal (done = 1), truncations at 50 steps (done = 0)."""
    n = 8
    cfg = small_config(env=chain, n_envs=n, total_steps=8 * 400, learning_starts=10**9, eps_start=1.0,
                       eps_end=1.0, train_every=8, seed=int(rng.integers(1 << 30)))
    trainer = Trainer(cfg)
    trainer.run()
    replay = trainer.learner.replay
    stored = replay.stored()
    assert stored == 8 * 400
    obs, nxt = replay.obs.to_numpy()[:stored], replay.next_obs.to_numpy()[:stored]
    done, reward = replay.done.to_numpy()[:stored], replay.reward.to_numpy()[:stored]
    pos, npos = obs.argmax(1), nxt.argmax(1)
    assert np.all(obs.sum(1) == 1) and np.all(nxt.sum(1) == 1)  # one-hot: a real observation everywhere
    assert np.array_equal(done == 1, npos == 7)  # terminated exactly at the goal
    np.testing.assert_allclose(reward[done == 1], 1.0)
    # Env i's transitions sit n slots apart. Where the next one does not start at this
    # one's next_obs, the episode ended: by termination, or else by truncation, stored with
    # done = 0 and its true last observation (not the reset one).
    ends = np.flatnonzero(pos[n:] != npos[:-n])
    truncated = ends[done[ends] == 0]
    assert len(truncated) > 0
    assert np.all(pos[truncated + n] == 0)  # the next episode starts at the left end
    trainer.close()


def test_the_trainer_solves_a_user_environment(device, chain):
    cfg = small_config(env=chain, n_envs=8, total_steps=20_000, learning_starts=1000, train_every=8,
                       eps_fraction=0.3, eval_episodes=16, seed=3)
    trainer = Trainer(cfg)
    summary = trainer.run()
    # Optimal: 7 moves right, 6 steps of -0.01 then +1 at the goal.
    assert summary["final_eval_return"] == pytest.approx(0.94, abs=1e-4)
    trainer.close()


def _params_after(cfg, stop=None, path=None):
    trainer = Trainer(cfg)
    if stop is not None:
        trainer.run(until=stop)
        trainer.save_checkpoint(path)
        trainer.close()
        trainer = Trainer(cfg)
        trainer.load_checkpoint(path)
    summary = trainer.run()
    state = trainer.state_arrays()
    state["final_eval_return"] = np.array(summary["final_eval_return"])
    trainer.close()
    return state


def test_resume_is_bitwise_identical_to_an_uninterrupted_run(device, tmp_path, rng):
    """Stopped inside a launch and resumed from the checkpoint: the learner, the replay, the
    envs, the loop's counters, and the evaluations after the resume (their envs start from
    random states, drawn where the evaluations before the checkpoint left off)."""
    cfg = small_config(seed=int(rng.integers(1 << 30)), total_steps=4000, eval_every=1000)
    straight = _params_after(cfg)
    again = _params_after(cfg)
    resumed = _params_after(cfg, stop=2006, path=tmp_path / "ckpt")  # inside a launch: 502 iterations
    for key in ("learner.params", "learner.target", "learner.m", "learner.v", "tree.leaves", "tree.nodes", "replay.obs",
                "env.states", "loop", "eval.rng_counters", "eval.states", "final_eval_return"):
        assert straight[key].tobytes() == again[key].tobytes(), f"same seed, {key} differs"
        assert straight[key].tobytes() == resumed[key].tobytes(), f"resumed, {key} differs"
    assert straight["eval.rng_counters"].any()
    other = _params_after(small_config(seed=cfg.seed + 1, total_steps=4000))
    assert other["learner.params"].tobytes() != straight["learner.params"].tobytes()


def test_an_env_that_ends_an_episode_every_step_is_evaluated_and_resumed(device, tmp_path, rng):
    """max_steps = 1: every step of every env ends an episode, so one launch of the
    evaluation fills its ring with as many episodes as it has slots; each evaluation
    still reads every env's first episode. The env's reset counts its resets in its
    state, so a resumed run evaluates as an uninterrupted one only if the evaluation
    envs' states are in the checkpoint."""
    register_env("blink", os.path.join(os.path.dirname(CHAIN), "blink.cu"), obs_dim=2, n_actions=2, state_dim=1,
                 max_steps=1)
    cfg = small_config(env="blink", n_envs=8, total_steps=8 * 300, learning_starts=800, train_every=8,
                       eval_every=8 * 100, eval_episodes=5, seed=int(rng.integers(1 << 30)))
    trainer = Trainer(cfg)
    summary = trainer.run()
    assert trainer.evaluations == 3 and 0.0 <= summary["final_eval_return"] <= 1.0
    assert trainer.episodes == trainer.actor.loop.to_numpy()[2] == 8 * 300
    trainer.close()
    straight = _params_after(cfg)
    resumed = _params_after(cfg, stop=8 * 151, path=tmp_path / "ckpt")
    assert straight["eval.states"].min() > 1  # the evaluations' resets counted
    for key in ("learner.params", "env.states", "eval.states", "eval.rng_counters", "final_eval_return"):
        assert straight[key].tobytes() == resumed[key].tobytes(), f"resumed, {key} differs"


def test_a_checkpoint_of_another_configuration_is_refused(device, tmp_path, rng):
    cfg = small_config(seed=int(rng.integers(1 << 30)), total_steps=400)
    trainer = Trainer(cfg)
    trainer.run()
    trainer.save_checkpoint(tmp_path / "ckpt")
    trainer.close()
    other = Trainer(small_config(seed=cfg.seed, total_steps=400, dqn=dict(SMALL_LEARNER, hidden=(32, 32))))
    before = other.state_arrays()["learner.params"]
    with pytest.raises(ValueError, match="another configuration"):
        other.load_checkpoint(tmp_path / "ckpt")
    assert other.state_arrays()["learner.params"].tobytes() == before.tobytes()
    other.close()
