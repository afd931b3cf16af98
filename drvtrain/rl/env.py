"""Environments that run on the device: the Python side of ``kernels/env.cuh``.

A ``.cu`` file defines an environment struct and ends with
``DT_DEFINE_ENV(Env, name)``, which emits ``name_reset`` and ``name_step``.
:class:`DeviceEnv` owns the per-env device state and launches those kernels,
one thread per env; :func:`make_env` builds registered environments by name
(drvtrain's own, and a user's added with :func:`register_env`).
Nothing here reads the device back except ``state_numpy`` (tests, checkpoints).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np

from ..driver import Closable, DriverError
from ..kernel import load_module
from ..memory import DeviceBuffer, MappedBuffer, close_attributes, closes_on_failure

__all__ = ["DeviceEnv", "EnvSpec", "ENVIRONMENTS", "known_envs", "make_env", "register_env"]

# The parameter lists of the kernels DT_DEFINE_ENV emits (kernels/env.cuh).
RESET_SIGNATURE = "ptr ptr ptr ptr i32 u64"
STEP_SIGNATURE = "ptr ptr ptr ptr ptr i32 u64 ptr ptr ptr ptr"


def _count(value, what: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what} must be an integer, got {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"{what} must be in {low}..{high}, got {value}")
    return int(value)


def _host(array, what: str, shape: tuple, dtype) -> np.ndarray:
    a = np.asarray(array)
    if a.shape != shape:
        raise ValueError(f"{what} must have shape {shape}, got {a.shape}")
    if not (np.issubdtype(a.dtype, np.number) and not np.issubdtype(a.dtype, np.complexfloating)):
        raise TypeError(f"{what} must be real numbers, got {a.dtype}")
    if np.issubdtype(np.dtype(dtype), np.integer):
        if not np.issubdtype(a.dtype, np.integer):
            raise TypeError(f"{what} must be integers, got {a.dtype}")
        info = np.iinfo(dtype)
        if a.size and (a.min() < info.min or a.max() > info.max):
            raise ValueError(f"{what} does not fit {np.dtype(dtype)}")
    return np.ascontiguousarray(a, dtype=dtype)


# The dimensions DT_DEFINE_ENV exports (name_dims): argument name, struct member, range.
_DIMS = (("obs_dim", "OBS_DIM", 1, 2**20), ("n_actions", "N_ACTIONS", 1, 2**31 - 1),
         ("state_dim", "STATE_DIM", 1, 2**20), ("max_steps", "MAX_STEPS", 0, 2**31 - 1))


def _dims(*values) -> tuple:
    """The dimensions given (None: take the struct's), each checked for its type and range."""
    return tuple(None if v is None else _count(v, what, low, high)
                 for v, (what, _, low, high) in zip(values, _DIMS))


class DeviceEnv(Closable):
    """``n_envs`` copies of the environment ``name`` defined in ``source``, all stepped in one launch.

    ``source`` is a ``.cu`` path; a bare file name (``"cartpole.cu"``) means
    drvtrain's own ``kernels/``. The dimensions are read from the struct the
    source defines (``DT_DEFINE_ENV`` exports them); one given must equal the
    struct's, or a ``ValueError`` says which differs. Env ``i``
    draws its randomness from Philox keyed by ``seed`` at counters kept on the
    device (``rng_counters``), so a graph replay draws fresh numbers.

    Device buffers, all owned here and at fixed addresses (a captured graph
    may use them):

    - ``states``       float32 [n, state_dim]
    - ``obs``          float32 [n, obs_dim], the observation each env acts on next
    - ``episode_steps`` int32 [n], steps taken in the current episode
    - ``rng_counters`` uint32 [n], each env's draw counter (starts at 0)
    - written by ``step``: ``final_obs`` float32 [n, obs_dim], the observation
      the step reached (the true last one when the episode ended), ``reward``
      float32 [n], ``terminated`` and ``truncated`` float32 [n], 0 or 1.

    Finished episodes reset inside ``step``: ``obs`` then holds the new
    episode's first observation while ``final_obs`` keeps the last one.
    ``truncated`` is 1 only for an episode that reached ``max_steps`` without
    terminating; a step that does both counts as terminated. ``step``
    overwrites ``obs``: copy it first where the observation before the step
    is needed.
    """

    @closes_on_failure
    def __init__(self, source, name: str, n_envs: int, *, seed: int, obs_dim: int | None = None,
                 n_actions: int | None = None, state_dim: int | None = None, max_steps: int | None = None):
        self.name = str(name)
        self.n_envs = _count(n_envs, "n_envs", 1, 2**31 - 1)
        self.seed = _count(seed, "seed", 0, 2**64 - 1)
        given = _dims(obs_dim, n_actions, state_dim, max_steps)
        self.module = module = load_module(source)
        missing = (f"{source} has no kernels {self.name}_reset and {self.name}_step; "
                   f"does it end with DT_DEFINE_ENV(Env, {self.name})?")
        try:
            self._reset = module.kernel(f"{self.name}_reset", RESET_SIGNATURE, fixed_block=True)
            self._step = module.kernel(f"{self.name}_step", STEP_SIGNATURE, fixed_block=True)
        except DriverError as exc:
            if exc.status_name != "CUDA_ERROR_NOT_FOUND":
                raise
            raise ValueError(missing) from exc
        try:
            struct = module.read_global(f"{self.name}_dims", np.int32, 4)
        except KeyError:
            raise ValueError(f"{source} has the kernels of {self.name!r} but not {self.name}_dims, which "
                             f"DT_DEFINE_ENV emits: was it built against another env.cuh than drvtrain's?") from None
        # The kernels index every buffer with the struct's dimensions: one given otherwise
        # would size a buffer they overrun.
        for (what, member, low, high), value, want in zip(_DIMS, given, struct.tolist()):
            if not low <= want <= high:
                raise ValueError(f"{source}: the struct's {member} = {want} is outside {low}..{high}")
            if value is not None and value != want:
                raise ValueError(f"{what}={value} was given for {self.name!r}, but the struct in {source} has "
                                 f"{member} = {want}; leave {what} out to take the struct's")
        self.obs_dim, self.n_actions, self.state_dim, self.max_steps = (int(v) for v in struct)
        self.block = self._reset.block
        self.grid = -(-self.n_envs // self.block)
        n = self.n_envs
        self.states = DeviceBuffer.zeros((n, self.state_dim), np.float32)
        self.obs = DeviceBuffer.zeros((n, self.obs_dim), np.float32)
        self.episode_steps = DeviceBuffer.zeros(n, np.int32)
        self.rng_counters = DeviceBuffer.zeros(n, np.uint32)
        self.final_obs = DeviceBuffer.zeros((n, self.obs_dim), np.float32)
        self.reward = DeviceBuffer.zeros(n, np.float32)
        self.terminated = DeviceBuffer.zeros(n, np.float32)
        self.truncated = DeviceBuffer.zeros(n, np.float32)
        self._closed = False

    # -------------------------------------------------------------- stepping
    def reset(self, *, stream) -> None:
        """Start a new episode in every env (one launch on ``stream``)."""
        self._check_open()
        self._reset.launch(self.grid, self.block, self.states, self.obs, self.episode_steps,
                           self.rng_counters, self.n_envs, self.seed, stream=stream)

    def step(self, actions, *, stream) -> None:
        """Step every env with ``actions`` (int32 [n], on the device or mapped), one launch on
        ``stream``; finished episodes reset. Outputs land in the buffers named in the class doc.

        Actions are not range-checked on the device: each environment decides what an
        action outside ``0 .. n_actions-1`` does (CartPole pushes left for any action but 1).
        """
        self._check_open()
        if not isinstance(actions, (DeviceBuffer, MappedBuffer)):
            raise TypeError(f"actions must be a DeviceBuffer or MappedBuffer, got {type(actions).__name__}")
        if actions.dtype != np.int32:
            raise TypeError(f"actions must hold int32, got {actions.dtype}")
        if math.prod(actions.shape) != self.n_envs:
            raise ValueError(f"actions holds {math.prod(actions.shape)} elements, one per env "
                             f"({self.n_envs}) needed")
        self._step.launch(self.grid, self.block, self.states, self.obs, self.episode_steps,
                          self.rng_counters, actions, self.n_envs, self.seed, self.final_obs,
                          self.reward, self.terminated, self.truncated, stream=stream)

    # -------------------------------------------------------------- state
    def state_numpy(self) -> dict[str, np.ndarray]:
        """Host copies of ``states``, ``obs``, ``episode_steps`` and ``rng_counters``
        (synchronous; tests and checkpoints). ``load_state(**env.state_numpy())`` restores them."""
        self._check_open()
        return {"states": self.states.to_numpy(), "obs": self.obs.to_numpy(),
                "episode_steps": self.episode_steps.to_numpy(), "rng_counters": self.rng_counters.to_numpy()}

    def load_state(self, states, episode_steps, *, obs=None, rng_counters=None) -> None:
        """Overwrite the per-env state (synchronous; tests inject states, checkpoints restore them).

        ``states`` [n, state_dim] (cast to float32) and ``episode_steps`` [n], each in
        ``0 .. max_steps-1`` (any count when ``max_steps`` is 0). ``obs`` [n, obs_dim]: the
        observations of those states; without it ``obs`` is filled with NaN until the next
        ``step`` or ``reset`` writes it (only the environment's kernels can observe a state).
        ``rng_counters`` [n]: left as they are when not given.
        """
        self._check_open()
        n = self.n_envs
        states = _host(states, "states", (n, self.state_dim), np.float32)
        steps = _host(episode_steps, "episode_steps", (n,), np.int32)
        top = self.max_steps - 1 if self.max_steps > 0 else 2**31 - 2
        if steps.min() < 0 or steps.max() > top:
            raise ValueError(f"episode_steps must be in 0..{top}, got {steps.min()}..{steps.max()}")
        obs = (np.full((n, self.obs_dim), np.nan, np.float32) if obs is None
               else _host(obs, "obs", (n, self.obs_dim), np.float32))
        counters = None if rng_counters is None else _host(rng_counters, "rng_counters", (n,), np.uint32)
        self.states.copy_from_numpy(states)
        self.episode_steps.copy_from_numpy(steps)
        self.obs.copy_from_numpy(obs)
        if counters is not None:
            self.rng_counters.copy_from_numpy(counters)

    # -------------------------------------------------------------- lifetime
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"DeviceEnv {self.name!r} is closed")

    def close(self) -> None:
        """Unload the env's module and free its device buffers now; the env cannot be used
        afterwards. Refused (a ``RuntimeError``, nothing changes) while an executable graph that
        replays a kernel of the module (reset, step, or any other of its source) is open: close
        that first. A graph that only reads the buffers does not hold the env: close it first
        too, or its replays read freed memory."""
        if getattr(self, "_closed", False):
            return
        module = getattr(self, "module", None)
        if module is not None:
            module.close()  # raises, before anything is freed, while a graph replays its kernels
        self._closed = True
        close_attributes(self, "states", "obs", "episode_steps", "rng_counters", "final_obs", "reward",
                         "terminated", "truncated")

    def __repr__(self) -> str:
        return (f"<DeviceEnv {self.name} x{self.n_envs}, obs {self.obs_dim}, actions {self.n_actions}, "
                f"max_steps {self.max_steps}{', closed' if self._closed else ''}>")


@dataclass(frozen=True)
class EnvSpec:
    """Where an environment is defined (a ``.cu`` path, or a bare name in drvtrain's kernels/)
    and the dimensions its registration gave: each None (the struct's, read when an env is
    built) or a number the struct's must equal."""
    source: str | os.PathLike
    obs_dim: int | None = None  # None: the struct's (DeviceEnv reads it); a number must equal it
    n_actions: int | None = None
    state_dim: int | None = None
    max_steps: int | None = None


# The environments make_env builds by name: drvtrain's own, and those added by register_env.
ENVIRONMENTS: dict[str, EnvSpec] = {
    "cartpole": EnvSpec("cartpole.cu", obs_dim=4, n_actions=2, state_dim=4, max_steps=500),
}


def register_env(name: str, source, *, obs_dim: int | None = None, n_actions: int | None = None,
                 state_dim: int | None = None, max_steps: int | None = None) -> None:
    """Make ``make_env(name, ...)`` build the environment ``name`` of ``source`` (a ``.cu`` file
    ending with ``DT_DEFINE_ENV(Env, name)``); replaces an earlier registration of ``name``.
    The dimensions come from the struct; one given here must equal the struct's (checked
    when an env is built)."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"environment name must be a C identifier (its kernels are name_reset, name_step), "
                         f"got {name!r}")
    obs_dim, n_actions, state_dim, max_steps = _dims(obs_dim, n_actions, state_dim, max_steps)
    ENVIRONMENTS[name] = EnvSpec(source, obs_dim=obs_dim, n_actions=n_actions, state_dim=state_dim,
                                 max_steps=max_steps)


def known_envs() -> tuple[str, ...]:
    """The names make_env accepts, sorted."""
    return tuple(sorted(ENVIRONMENTS))


def make_env(name: str, n_envs: int, *, seed: int) -> DeviceEnv:
    """``n_envs`` copies of a registered environment (``ENVIRONMENTS``)."""
    spec = ENVIRONMENTS.get(name) if isinstance(name, str) else None
    if spec is None:
        raise ValueError(f"unknown environment {name!r}; known: {', '.join(known_envs())}")
    return DeviceEnv(spec.source, name, n_envs, seed=seed, obs_dim=spec.obs_dim, n_actions=spec.n_actions,
                     state_dim=spec.state_dim, max_steps=spec.max_steps)
