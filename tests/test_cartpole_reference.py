"""The float64 CartPole reference against Gymnasium's CartPole-v1, bit for bit."""
import numpy as np
import pytest

import cartpole_reference as ref


@pytest.fixture
def gym_cartpole():
    gym = pytest.importorskip("gymnasium", reason="gymnasium is not installed (pip install -e '.[test]')")
    env = gym.make("CartPole-v1")
    env.reset(seed=0)
    yield env
    env.close()


def test_constants_are_cartpole_v1(gym_cartpole):
    g = gym_cartpole.unwrapped
    assert gym_cartpole.spec.max_episode_steps == ref.MAX_STEPS
    assert (g.gravity, g.masscart, g.masspole, g.total_mass, g.length, g.polemass_length, g.force_mag,
            g.tau, g.kinematics_integrator) == (ref.GRAVITY, ref.MASSCART, ref.MASSPOLE, ref.TOTAL_MASS,
                                                ref.LENGTH, ref.POLEMASS_LENGTH, ref.FORCE_MAG, ref.TAU, "euler")
    assert (g.x_threshold, g.theta_threshold_radians) == (ref.X_THRESHOLD, ref.THETA_THRESHOLD)


def test_step_matches_gymnasium_exactly(gym_cartpole, rng):
    n = 20_000
    states = ref.random_states(rng, n)
    actions = rng.integers(0, 2, n)
    want = np.empty((n, 4))
    want_terminated = np.empty(n, bool)
    env = gym_cartpole.unwrapped
    for i in range(n):
        env.state = states[i].copy()
        env.steps_beyond_terminated = None
        _, reward, term, trunc, _ = env.step(int(actions[i]))
        want[i], want_terminated[i] = env.state, term
        assert reward == 1.0 and not trunc
    got, got_terminated = ref.step(states, actions)
    assert got.dtype == np.float64
    assert np.array_equal(got, want), f"{np.count_nonzero(got != want)} values differ"
    assert np.array_equal(got_terminated, want_terminated)
    # The sample has teeth: both outcomes, both actions, and steps that land next to a threshold.
    assert 0.2 < want_terminated.mean() < 0.8
    assert 0.4 < actions.mean() < 0.6
    assert np.count_nonzero(ref.threshold_distance(want) < 1e-6) > 100


def test_a_state_exactly_on_a_threshold_is_not_terminated(rng):
    n = 64
    states = rng.uniform(-0.05, 0.05, (n, 4))
    half = n // 2
    states[:half, 0], states[:half, 1] = rng.choice([-ref.X_THRESHOLD, ref.X_THRESHOLD], half), 0.0
    states[half:, 2], states[half:, 3] = rng.choice([-ref.THETA_THRESHOLD, ref.THETA_THRESHOLD], n - half), 0.0
    nxt, term = ref.step(states, rng.integers(0, 2, n))
    assert np.array_equal(np.abs(nxt[:half, 0]), np.full(half, ref.X_THRESHOLD))
    assert np.array_equal(np.abs(nxt[half:, 2]), np.full(n - half, ref.THETA_THRESHOLD))
    assert not term.any()
    beyond = nxt.copy()
    beyond[:half, 0] = np.nextafter(nxt[:half, 0], 2 * nxt[:half, 0])
    beyond[half:, 2] = np.nextafter(nxt[half:, 2], 2 * nxt[half:, 2])
    assert ref.terminated(beyond).all()
