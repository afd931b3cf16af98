"""Device environments: CartPole against the float64 reference, auto-reset, episode statistics,
the reset distribution, a user's own environment source, determinism."""
import math
from pathlib import Path

import numpy as np
import pytest

import cartpole_reference as ref
from per_reference import philox4x32_10
from drvtrain import DeviceBuffer, capture
from drvtrain.rl.env import ENVIRONMENTS, DeviceEnv, known_envs, make_env, register_env

pytestmark = pytest.mark.gpu

CHAIN = Path(__file__).resolve().parent / "envs" / "chain.cu"
CHAIN_LENGTH, CHAIN_MAX_STEPS, CHAIN_OPTIMAL_RETURN = 8, 50, 0.94
OUTPUTS = ("obs", "final_obs", "reward", "terminated", "truncated")
LOW, HIGH = np.float32(ref.RESET_LOW), np.float32(ref.RESET_HIGH)


def new_seed(rng) -> int:
    return int(rng.integers(0, 2**64, dtype=np.uint64))


def step(env, actions, buffer, stream) -> dict:
    """Upload ``actions``, step, and read every output back."""
    buffer.copy_from_numpy(np.ascontiguousarray(actions, np.int32))
    env.step(buffer, stream=stream)
    return {k: getattr(env, k).to_numpy() for k in OUTPUTS}


def chain_env(n, seed) -> DeviceEnv:
    return DeviceEnv(CHAIN, "chain", n, seed=seed, obs_dim=CHAIN_LENGTH, n_actions=2, state_dim=1,
                     max_steps=CHAIN_MAX_STEPS)


def one_hot(cells) -> np.ndarray:
    return np.eye(CHAIN_LENGTH, dtype=np.float32)[cells]


def in_reset_range(obs) -> bool:
    return bool(((obs >= LOW) & (obs <= HIGH)).all())


# ---------------------------------------------------------------- CartPole dynamics
def test_cartpole_step_matches_the_float64_reference(device, stream, rng):
    n = 16384
    states = ref.random_states(rng, n).astype(np.float32)
    actions = rng.integers(0, 2, n).astype(np.int32)
    steps = rng.integers(0, ref.MAX_STEPS - 1, n).astype(np.int32)  # none reaches the step limit
    env = make_env("cartpole", n, seed=new_seed(rng))
    assert env.block == 128 and env.grid == n // 128
    env.load_state(states, steps)
    out = step(env, actions, DeviceBuffer(n, np.int32), stream)
    want, want_terminated = ref.step(states.astype(np.float64), actions)
    err = np.abs(out["final_obs"].astype(np.float64) - want).max()
    assert err <= 1e-5, f"max abs error {err:.3g}"
    terminated = out["terminated"] == 1
    assert np.isin(out["terminated"], (0.0, 1.0)).all()
    near = ref.threshold_distance(want) < 1e-6
    mismatch = (terminated != want_terminated) & ~near
    assert not mismatch.any(), f"{mismatch.sum()} terminated flags differ, e.g. state {states[mismatch][0]}"
    # Teeth: many steps end up close to, but farther than 1e-6 from, a threshold.
    assert np.count_nonzero((ref.threshold_distance(want) < 1e-3) & ~near) > 1000
    assert 0.2 < want_terminated.mean() < 0.8 and near.mean() < 0.25
    assert (out["reward"] == 1.0).all() and (out["truncated"] == 0.0).all()
    after = env.state_numpy()
    np.testing.assert_array_equal(after["episode_steps"], np.where(terminated, 0, steps + 1))
    np.testing.assert_array_equal(out["obs"][~terminated], out["final_obs"][~terminated])
    np.testing.assert_array_equal(after["states"], out["obs"])  # CartPole observes its whole state


def finishing_states(rng, n):
    """Float32 states of four kinds: 0 continues, 1 terminates, 2 is truncated, 3 terminates
    on the last allowed step. Returns (states, episode_steps, kind)."""
    kind = rng.integers(0, 4, n)
    states = rng.uniform(-0.05, 0.05, (n, 4))  # one step from here stays far inside the bounds
    falls = kind % 2 == 1
    on_x = rng.random(n) < 0.5
    side = rng.choice([-1.0, 1.0], n)
    beyond = rng.uniform(0.01, 0.1, n)  # a velocity of at most 0.05 cannot bring it back inside
    fx, ft = falls & on_x, falls & ~on_x
    states[fx, 0] = side[fx] * (ref.X_THRESHOLD + beyond[fx])
    states[ft, 2] = side[ft] * (ref.THETA_THRESHOLD + beyond[ft])
    steps = rng.integers(0, ref.MAX_STEPS - 1, n)
    steps[kind >= 2] = ref.MAX_STEPS - 1
    return states.astype(np.float32), steps.astype(np.int32), kind


def test_finished_episodes_reset_and_keep_their_final_observation(device, stream, rng):
    n = 4096
    env = make_env("cartpole", n, seed=new_seed(rng))
    env.reset(stream=stream)
    states, steps, kind = finishing_states(rng, n)
    env.load_state(states, steps)  # counters kept: 4 draws by the reset
    counters = env.state_numpy()["rng_counters"]
    np.testing.assert_array_equal(counters, np.full(n, 4, np.uint32))
    actions = rng.integers(0, 2, n).astype(np.int32)
    out = step(env, actions, DeviceBuffer(n, np.int32), stream)
    after = env.state_numpy()
    want, want_terminated = ref.step(states.astype(np.float64), actions)
    falls, finished = kind % 2 == 1, kind != 0
    assert np.array_equal(want_terminated, falls)  # the construction did what it says
    np.testing.assert_array_equal(out["terminated"], falls.astype(np.float32))
    # Truncated only when the limit is reached without terminating; the two are kept apart.
    np.testing.assert_array_equal(out["truncated"], (kind == 2).astype(np.float32))
    assert np.abs(out["final_obs"].astype(np.float64) - want).max() <= 1e-5
    assert (out["reward"] == 1.0).all()
    # A finished env starts again: a fresh first observation, a new step count, 4 more draws.
    assert in_reset_range(out["obs"][finished])
    assert not (out["obs"][finished] == out["final_obs"][finished]).all(axis=1).any()
    np.testing.assert_array_equal(out["obs"][~finished], out["final_obs"][~finished])
    np.testing.assert_array_equal(after["states"], out["obs"])
    np.testing.assert_array_equal(after["episode_steps"], np.where(finished, 0, steps + 1))
    np.testing.assert_array_equal(after["rng_counters"], counters + 4 * finished.astype(np.uint32))


def test_a_balanced_pole_is_truncated_at_step_500(device, stream, rng):
    n = 256
    env = make_env("cartpole", n, seed=new_seed(rng))
    env.reset(stream=stream)
    gains = np.array([1.0, 1.0, 10.0, 2.0])  # keeps |x| < 0.2 and |theta| < 0.06 from any start
    buffer = DeviceBuffer(n, np.int32)
    obs = env.obs.to_numpy()
    for t in range(1, ref.MAX_STEPS + 1):
        out = step(env, (obs.astype(np.float64) @ gains > 0).astype(np.int32), buffer, stream)
        assert not out["terminated"].any(), f"terminated at step {t}"
        assert (out["truncated"] == float(t == ref.MAX_STEPS)).all(), f"truncated wrong at step {t}"
        obs = out["obs"]
    assert not ref.terminated(out["final_obs"].astype(np.float64)).any()
    assert in_reset_range(out["obs"])
    np.testing.assert_array_equal(env.state_numpy()["episode_steps"], np.zeros(n, np.int32))


# ---------------------------------------------------------------- statistics
def device_random_episode_lengths(env, rng, stream) -> np.ndarray:
    """The length of every env's first episode under uniformly random actions (unbiased:
    every env's first episode is waited for)."""
    n = env.n_envs
    env.reset(stream=stream)
    buffer = DeviceBuffer(n, np.int32)
    lengths = np.zeros(n, np.int64)
    for t in range(1, ref.MAX_STEPS + 1):
        out = step(env, rng.integers(0, 2, n), buffer, stream)
        done = (out["terminated"] + out["truncated"]) > 0
        lengths[done & (lengths == 0)] = t
        if lengths.all():
            break
    assert lengths.all(), "an episode outlived the step limit"
    return lengths


def gymnasium_random_episode_lengths(gym, rng, episodes) -> np.ndarray:
    env = gym.make("CartPole-v1")
    env.reset(seed=int(rng.integers(2**31)))
    lengths = np.zeros(episodes, np.int64)
    for e in range(episodes):
        env.reset()
        done = False
        while not done:
            _, _, terminated, truncated, _ = env.step(int(rng.integers(2)))
            lengths[e] += 1
            done = terminated or truncated
    env.close()
    return lengths


def reference_random_episode_lengths(rng, episodes) -> np.ndarray:
    states = rng.uniform(ref.RESET_LOW, ref.RESET_HIGH, (episodes, 4))
    lengths = np.zeros(episodes, np.int64)
    alive = np.arange(episodes)
    for t in range(1, ref.MAX_STEPS + 1):
        states, terminated = ref.step(states, rng.integers(0, 2, len(alive)))
        done = terminated | (t == ref.MAX_STEPS)
        lengths[alive[done]] = t
        alive, states = alive[~done], states[~done]
        if not len(alive):
            break
    return lengths


def test_random_policy_episode_lengths_match_gymnasium(device, stream, rng):
    got = device_random_episode_lengths(make_env("cartpole", 4096, seed=new_seed(rng)), rng, stream)
    try:
        import gymnasium
    except ImportError:  # the reference is Gymnasium's dynamics bit for bit (test_cartpole_reference)
        want = reference_random_episode_lengths(rng, 20_000)
    else:
        want = gymnasium_random_episode_lengths(gymnasium, rng, 4000)
    se = math.sqrt(got.var(ddof=1) / got.size + want.var(ddof=1) / want.size)
    print(f"mean episode length: device {got.mean():.3f}, comparison {want.mean():.3f}, se {se:.3f}")
    assert 15 < want.mean() < 30  # about 22 for CartPole-v1 under random actions
    # 5 standard errors: at 4 a correct device would fail about one run in 16,000 by chance,
    # at 5 about one in 1.7 million; the bound widens by only one standard error.
    assert abs(got.mean() - want.mean()) < 5 * se


def ks_statistic(samples, low, high) -> float:
    """The one-sample Kolmogorov-Smirnov statistic against U(low, high)."""
    u = np.sort((np.asarray(samples, np.float64) - low) / (high - low)).clip(0.0, 1.0)
    i = np.arange(1, u.size + 1)
    return float(max((i / u.size - u).max(), (u - (i - 1) / u.size).max()))


def ks_critical(n, alpha) -> float:
    """The asymptotic critical value of the KS statistic for n samples at level alpha."""
    return math.sqrt(-math.log(alpha / 2) / 2) / math.sqrt(n)


# DtRandom (kernels/env.cuh): draw c of env i is word x of Philox4x32-10 at counter
# (c, i, stream, ENV_TAG) under the seed's two halves; 24 bits of it make a float in [0, 1).
RNG_ENV, ENV_TAG = 0, 0x454E5631


def reset_reference(seed, n, first_counter) -> np.ndarray:
    """CartPole's reset draws of n envs whose counters stand at ``first_counter``, from the
    published Philox (per_reference, checked against its known answers) and the reset's rule
    low + (high - low) u, in float64."""
    counters = np.empty((n, 4, 4), np.uint32)
    counters[..., 0] = first_counter + np.arange(4, dtype=np.uint32)  # one draw a state variable
    counters[..., 1] = np.arange(n, dtype=np.uint32)[:, None]
    counters[..., 2], counters[..., 3] = RNG_ENV, ENV_TAG
    words = philox4x32_10(counters.reshape(-1, 4), (seed & 0xFFFFFFFF, seed >> 32))[:, 0].reshape(n, 4)
    u = (words >> 8).astype(np.float64) / 2.0**24
    return ref.RESET_LOW + (ref.RESET_HIGH - ref.RESET_LOW) * u


def test_resets_draw_each_variable_uniformly(device, stream, rng):
    n = 8192
    seed = new_seed(rng)
    env = make_env("cartpole", n, seed=seed)
    draws = []
    for _ in range(2):  # a second reset draws fresh numbers from the advanced counters
        env.obs.poison(stream=stream)
        env.reset(stream=stream)
        draws.append(env.obs.to_numpy())
    assert np.mean(draws[0] == draws[1]) < 0.01
    np.testing.assert_array_equal(env.state_numpy()["rng_counters"], np.full(n, 8, np.uint32))
    for first, got in zip((0, 4), draws):  # the draws themselves, to float32 rounding (a few 2^-28)
        np.testing.assert_allclose(got, reset_reference(seed, n, first), rtol=0, atol=2.0**-26)
    samples = np.concatenate(draws)
    assert in_reset_range(samples)
    # The distribution, whatever generator made it: at 1e-6 over the four variables a sound
    # generator fails about once a million runs, and a shift of 3 % of the range still fails.
    critical = ks_critical(len(samples), alpha=1e-6 / 4)
    for k in range(4):
        d = ks_statistic(samples[:, k], ref.RESET_LOW, ref.RESET_HIGH)
        assert d < critical, f"variable {k}: KS statistic {d:.4g} >= {critical:.4g}"
    # The four draws of one reset are independent of each other.
    corr = np.corrcoef(samples.T.astype(np.float64))
    assert np.abs(corr[~np.eye(4, dtype=bool)]).max() < 5 / math.sqrt(len(samples))
    # The statistic has the power to see a slightly narrower range.
    narrow = rng.uniform(ref.RESET_LOW, 0.9 * ref.RESET_HIGH, len(samples))
    assert ks_statistic(narrow, ref.RESET_LOW, ref.RESET_HIGH) > critical


# ---------------------------------------------------------------- a user's environment
def test_chain_from_a_user_source_reaches_its_end_in_seven_moves(device, stream, rng):
    n = 200
    env = chain_env(n, new_seed(rng))
    env.reset(stream=stream)
    np.testing.assert_array_equal(env.obs.to_numpy(), one_hot(np.zeros(n, int)))
    buffer = DeviceBuffer(n, np.int32)
    rewards = []
    for k in range(1, CHAIN_LENGTH):
        out = step(env, np.ones(n), buffer, stream)
        rewards.append(out["reward"].astype(np.float64))
        last = k == CHAIN_LENGTH - 1
        np.testing.assert_array_equal(out["final_obs"], one_hot(np.full(n, k)))
        np.testing.assert_array_equal(out["obs"], one_hot(np.full(n, 0 if last else k)))
        np.testing.assert_array_equal(out["reward"], np.full(n, 1.0 if last else -0.01, np.float32))
        np.testing.assert_array_equal(out["terminated"], np.full(n, float(last), np.float32))
        np.testing.assert_array_equal(out["truncated"], np.zeros(n, np.float32))
    np.testing.assert_allclose(np.sum(rewards, axis=0), CHAIN_OPTIMAL_RETURN, rtol=1e-6)


def test_chain_follows_its_documented_rules_under_random_actions(device, stream, rng):
    n, steps = 512, 160
    register_env("chain", CHAIN, obs_dim=CHAIN_LENGTH, n_actions=2, state_dim=1, max_steps=CHAIN_MAX_STEPS)
    assert "chain" in known_envs()
    env = make_env("chain", n, seed=new_seed(rng))
    assert (env.obs_dim, env.state_dim, env.max_steps) == (CHAIN_LENGTH, 1, CHAIN_MAX_STEPS)
    env.reset(stream=stream)
    buffer = DeviceBuffer(n, np.int32)
    cell, count = np.zeros(n, int), np.zeros(n, int)
    ends = {"terminated": 0, "truncated": 0}
    for t in range(steps):
        actions = rng.integers(0, 2, n)
        out = step(env, actions, buffer, stream)
        cell = np.where(actions == 1, cell + 1, np.maximum(cell - 1, 0))
        count += 1
        terminated = cell == CHAIN_LENGTH - 1
        truncated = ~terminated & (count >= CHAIN_MAX_STEPS)
        np.testing.assert_array_equal(out["final_obs"], one_hot(cell), err_msg=f"step {t}")
        np.testing.assert_array_equal(out["reward"], np.where(terminated, 1.0, -0.01).astype(np.float32))
        np.testing.assert_array_equal(out["terminated"], terminated.astype(np.float32))
        np.testing.assert_array_equal(out["truncated"], truncated.astype(np.float32))
        done = terminated | truncated
        cell[done], count[done] = 0, 0
        np.testing.assert_array_equal(out["obs"], one_hot(cell))
        ends["terminated"] += terminated.sum()
        ends["truncated"] += truncated.sum()
    np.testing.assert_array_equal(env.state_numpy()["episode_steps"], count)
    assert min(ends.values()) > 50, ends


def test_an_env_wider_than_the_registers_follows_its_rules(device, stream, rng):
    """72 floats of state and of observation (tests/envs/wide.cu), more than the kernels
    keep in registers: its functions work on the state in memory. Every step against a
    float32 model of its rules, started from the device's own resets; each reset draws
    72 numbers from the env's counter."""
    n, dim = 300, 72
    env = DeviceEnv(Path(__file__).resolve().parent / "envs" / "wide.cu", "wide", n, seed=new_seed(rng),
                    obs_dim=dim, n_actions=2, state_dim=dim, max_steps=4)
    env.reset(stream=stream)
    obs = env.obs.to_numpy()
    assert ((obs >= 0) & (obs < 2)).all() and len(np.unique(obs)) > n * dim // 2
    state = obs / np.float32(2)
    count, resets, ends = np.zeros(n, int), np.ones(n, int), np.zeros(2, int)
    ramp = np.arange(1, dim + 1, dtype=np.float32)
    buffer = DeviceBuffer(n, np.int32)
    for t in range(12):
        actions = (rng.random(n) < 0.7).astype(np.int32)
        out = step(env, actions, buffer, stream)
        state = state + np.where(actions == 1, np.float32(1), np.float32(-1))[:, None] * ramp
        count += 1
        terminated = state[:, 0] > 3
        truncated = ~terminated & (count >= 4)
        np.testing.assert_array_equal(out["final_obs"], np.float32(2) * state, err_msg=f"step {t}")
        np.testing.assert_array_equal(out["reward"], state[:, 1])
        np.testing.assert_array_equal(out["terminated"], terminated.astype(np.float32))
        np.testing.assert_array_equal(out["truncated"], truncated.astype(np.float32))
        done = terminated | truncated
        ends += terminated.sum(), truncated.sum()
        fresh = out["obs"][done]
        assert ((fresh >= 0) & (fresh < 2)).all()
        np.testing.assert_array_equal(out["obs"][~done], np.float32(2) * state[~done])
        state[done] = fresh / np.float32(2)
        count[done], resets[done] = 0, resets[done] + 1
    assert ends.min() > 50, ends
    got = env.state_numpy()
    np.testing.assert_array_equal(got["states"], state)
    np.testing.assert_array_equal(got["episode_steps"], count)
    np.testing.assert_array_equal(got["rng_counters"], dim * resets)
    env.close()


# ---------------------------------------------------------------- determinism
def trajectory(env, actions, stream, start=None) -> list:
    """Every output of every step of ``actions`` [T, n], after a reset or from ``start``."""
    if start is None:
        env.reset(stream=stream)
    else:
        env.load_state(**start)
    buffer = DeviceBuffer(env.n_envs, np.int32)
    return [step(env, a, buffer, stream) for a in actions]


def assert_same(a, b) -> None:
    assert len(a) == len(b)
    for t, (x, y) in enumerate(zip(a, b)):
        for k in OUTPUTS:
            assert np.array_equal(x[k], y[k]), f"{k} differs at step {t}"


def test_the_same_seed_gives_the_same_trajectory(device, stream, rng):
    n, steps, half = 1024, 300, 150
    seed = new_seed(rng)
    actions = rng.integers(0, 2, (steps, n))
    first_env = make_env("cartpole", n, seed=seed)
    first = trajectory(first_env, actions, stream)
    assert sum(s["terminated"].sum() for s in first) > n  # many resets drew from the generator
    second_env = make_env("cartpole", n, seed=seed)
    assert_same(first[:half], trajectory(second_env, actions[:half], stream))
    # A checkpoint of the state resumes the same trajectory in another env.
    resumed_env = make_env("cartpole", n, seed=seed)
    assert_same(first[half:], trajectory(resumed_env, actions[half:], stream, start=second_env.state_numpy()))
    resumed, want = resumed_env.state_numpy(), first_env.state_numpy()
    for k in want:
        np.testing.assert_array_equal(resumed[k], want[k], err_msg=k)


def test_different_seeds_give_different_resets(device, stream, rng):
    n = 1024
    seed = new_seed(rng)
    obs = []
    for s in (seed, seed ^ 1, seed ^ (1 << 40)):  # both halves of the 64-bit seed count
        env = make_env("cartpole", n, seed=s)
        env.reset(stream=stream)
        obs.append(env.obs.to_numpy())
    assert np.mean(obs[0] == obs[1]) < 0.01 and np.mean(obs[0] == obs[2]) < 0.01
    assert np.mean(obs[1] == obs[2]) < 0.01


# ---------------------------------------------------------------- the Python side
def test_bad_arguments_are_refused(device, stream, rng):
    with pytest.raises(ValueError, match="unknown environment 'pong'; known: (.*, )?cartpole"):
        make_env("pong", 4, seed=0)
    n = 300
    env = make_env("cartpole", n, seed=new_seed(rng))
    with pytest.raises(TypeError, match="int32"):
        env.step(DeviceBuffer(n, np.float32), stream=stream)
    with pytest.raises(ValueError, match="one per env"):
        env.step(DeviceBuffer(n - 1, np.int32), stream=stream)
    with pytest.raises(TypeError, match="DeviceBuffer"):
        env.step(np.zeros(n, np.int32), stream=stream)
    states = rng.uniform(-0.05, 0.05, (n, 4))
    with pytest.raises(ValueError, match="episode_steps must be in 0..499"):
        env.load_state(states, np.full(n, ref.MAX_STEPS))
    with pytest.raises(ValueError, match="shape"):
        env.load_state(states[:, :3], np.zeros(n, int))
    with pytest.raises(TypeError, match="integers"):
        env.load_state(states, np.zeros(n))
    with pytest.raises(ValueError, match="C identifier"):
        register_env("my-env", CHAIN, obs_dim=8, n_actions=2, state_dim=1, max_steps=50)
    env.close()
    with pytest.raises(RuntimeError, match="closed"):
        env.reset(stream=stream)


@pytest.mark.parametrize("given, member", [
    (dict(state_dim=2), "STATE_DIM = 1"), (dict(obs_dim=4), "OBS_DIM = 8"), (dict(n_actions=3), "N_ACTIONS = 2"),
    (dict(max_steps=0), "MAX_STEPS = 50")])
def test_dimensions_that_differ_from_the_struct_are_refused(device, monkeypatch, given, member):
    """The kernels size their indexing from the struct: a buffer sized otherwise would be overrun."""
    monkeypatch.setattr("drvtrain.rl.env.ENVIRONMENTS", dict(ENVIRONMENTS))
    what = next(iter(given))
    with pytest.raises(ValueError, match=f"{what}={given[what]} was given for 'chain', but the struct in "
                                         f".*chain.cu has {member}; leave {what} out"):
        DeviceEnv(CHAIN, "chain", 8, seed=0, **given)
    register_env("chain", CHAIN, **given)  # registering reads nothing; building does
    with pytest.raises(ValueError, match=member):
        make_env("chain", 8, seed=0)


def test_dimensions_left_out_come_from_the_struct(device, monkeypatch):
    monkeypatch.setattr("drvtrain.rl.env.ENVIRONMENTS", dict(ENVIRONMENTS))
    register_env("chain", CHAIN)
    env = make_env("chain", 3, seed=1)
    assert (env.obs_dim, env.n_actions, env.state_dim, env.max_steps) == (CHAIN_LENGTH, 2, 1, CHAIN_MAX_STEPS)
    assert env.obs.shape == (3, CHAIN_LENGTH) and env.states.shape == (3, 1)
    env.close()
    cart = DeviceEnv("cartpole.cu", "cartpole", 2, seed=0, obs_dim=4)
    assert (cart.obs_dim, cart.n_actions, cart.state_dim, cart.max_steps) == (4, 2, 4, 500)
    cart.close()


@pytest.mark.provokes_driver_errors
def test_a_source_without_the_named_environment_is_refused(device):
    with pytest.raises(ValueError, match=r"DT_DEFINE_ENV\(Env, lattice\)"):
        DeviceEnv(CHAIN, "lattice", 8, seed=0, obs_dim=8, n_actions=2, state_dim=1, max_steps=50)


def test_close_unloads_the_module_and_waits_for_the_graphs_that_step_the_env(device, stream, rng):
    """DeviceEnv.close unloads the module it loaded. While an executable graph replays the env's
    kernels it is refused and changes nothing (the graph and the env still run); then it closes
    everything, once."""
    n = int(rng.integers(100, 400))
    env = make_env("cartpole", n, seed=new_seed(rng))
    actions = DeviceBuffer.from_numpy(rng.integers(0, 2, n).astype(np.int32))
    env.reset(stream=stream)
    with capture(stream) as graph:
        env.step(actions, stream=stream)
    exe = graph.instantiate()
    with pytest.raises(RuntimeError, match="still replayed by 1 executable graph: close it first"):
        env.close()
    assert env.module.handle is not None and not env.states.closed
    np.testing.assert_array_equal(env.state_numpy()["episode_steps"], np.zeros(n, np.int32))
    exe.launch(stream)
    env.step(actions, stream=stream)  # the env refused to close: it still steps, eagerly too
    # Two steps from a reset cannot end a CartPole episode: the state starts within 0.05 of 0,
    # and 0.04 s of motion cannot take the angle past 0.21 rad nor the cart past 2.4.
    np.testing.assert_array_equal(env.state_numpy()["episode_steps"], np.full(n, 2, np.int32))
    exe.close()
    graph.close()
    env.close()
    assert env.module.handle is None and env.states.closed and env.obs.closed
    with pytest.raises(RuntimeError, match="is closed"):
        env.step(actions, stream=stream)
    env.close()  # a second close does nothing
    actions.close()
