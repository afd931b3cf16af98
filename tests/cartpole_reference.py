"""CartPole-v1 in float64 numpy: Gymnasium's dynamics, vectorised over envs.

The constants are built and every expression is evaluated as Gymnasium does
(the same float64 operations in the same order), so a step agrees with
Gymnasium's bit for bit; tests/test_cartpole_reference.py checks that.
"""
import math

import numpy as np

GRAVITY = 9.8
MASSCART = 1.0
MASSPOLE = 0.1
TOTAL_MASS = MASSPOLE + MASSCART
LENGTH = 0.5  # half the pole's length
POLEMASS_LENGTH = MASSPOLE * LENGTH
FORCE_MAG = 10.0
TAU = 0.02
X_THRESHOLD = 2.4
THETA_THRESHOLD = 12 * 2 * math.pi / 360
MAX_STEPS = 500
RESET_LOW, RESET_HIGH = -0.05, 0.05


def terminated(states):
    """Gymnasium's strict bounds test on float64 states [N, 4]."""
    s = np.asarray(states, np.float64)
    x, theta = s[:, 0], s[:, 2]
    return (x < -X_THRESHOLD) | (x > X_THRESHOLD) | (theta < -THETA_THRESHOLD) | (theta > THETA_THRESHOLD)


def step(states, actions):
    """One Euler step of every env: ``(next_states [N, 4] float64, terminated [N] bool)``."""
    s = np.asarray(states, np.float64)
    x, x_dot, theta, theta_dot = (np.ascontiguousarray(s[:, k]) for k in range(4))
    force = np.where(np.asarray(actions) == 1, FORCE_MAG, -FORCE_MAG)
    costheta = np.cos(theta)
    sintheta = np.sin(theta)
    temp = (force + POLEMASS_LENGTH * np.square(theta_dot) * sintheta) / TOTAL_MASS
    thetaacc = (GRAVITY * sintheta - costheta * temp) / (
        LENGTH * (4.0 / 3.0 - MASSPOLE * np.square(costheta) / TOTAL_MASS))
    xacc = temp - POLEMASS_LENGTH * thetaacc * costheta / TOTAL_MASS
    x = x + TAU * x_dot
    x_dot = x_dot + TAU * xacc
    theta = theta + TAU * theta_dot
    theta_dot = theta_dot + TAU * thetaacc
    next_states = np.stack([x, x_dot, theta, theta_dot], axis=1)
    return next_states, terminated(next_states)


def threshold_distance(states):
    """How far each state [N, 4] is from the nearest termination boundary."""
    s = np.asarray(states, np.float64)
    return np.minimum(np.abs(np.abs(s[:, 0]) - X_THRESHOLD), np.abs(np.abs(s[:, 2]) - THETA_THRESHOLD))


def random_states(rng, n):
    """States [n, 4] over the whole range an episode visits and beyond, a third of them placed
    so that the next position or angle lands within 1e-9 .. 1e-3 of a threshold (either side),
    and a few exactly on one after the step (the strict comparison)."""
    s = np.stack([rng.uniform(-2.6, 2.6, n), rng.uniform(-3.0, 3.0, n),
                  rng.uniform(-0.23, 0.23, n), rng.uniform(-4.0, 4.0, n)], axis=1)
    near = rng.random(n) < 1 / 3
    on_x = rng.random(n) < 0.5
    side = rng.choice([-1.0, 1.0], n)
    offset = rng.choice([-1.0, 1.0], n) * 10.0 ** rng.uniform(-9, -3, n)
    nx, nt = near & on_x, near & ~on_x
    s[nx, 0] = side[nx] * X_THRESHOLD - TAU * s[nx, 1] + offset[nx]
    s[nt, 2] = side[nt] * THETA_THRESHOLD - TAU * s[nt, 3] + offset[nt]
    exact = rng.random(n) < 0.01  # zero velocity on a threshold: the next state is on it exactly
    ex, et = exact & on_x, exact & ~on_x
    s[ex, 0], s[ex, 1] = side[ex] * X_THRESHOLD, 0.0
    s[et, 2], s[et, 3] = side[et] * THETA_THRESHOLD, 0.0
    return s
