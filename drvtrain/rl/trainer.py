"""Training end to end on the device: acting, environment steps, replay, learning, all in graphs.

One iteration of the loop, for ``n_envs`` environments at once:
the online network's forward over the current observations (TF32), one
fused kernel that picks epsilon-greedy actions, steps the environments
(auto-reset, truncation kept apart from termination), writes the transitions
into the replay at the largest priority seen and counts finished episodes
into a ring in mapped memory; then the whole Double-DQN step, gated by a word
that the acting kernel writes from the device's own counters
(``learning_starts``, env steps per gradient step). ``unroll`` iterations are
captured into one graph; the host launches it, reads mapped memory, and
synchronises only to evaluate or to checkpoint.
"""
from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import asdict, dataclass, field, fields, replace

import numpy as np

from ..driver import Closable
from ..graph import capture
from ..kernel import dependent_launches
from ..memory import Arena, DeviceBuffer, MappedBuffer, close_attributes, closes_on_failure
from ..stream import Event, Stream
from .dqn import DQNConfig, DQNStep, TrainingError, check_learner_state
from .env import make_env

__all__ = ["TrainConfig", "Trainer", "ENV_DEFAULTS", "check_trainer_state"]

# Hyperparameters per environment: the defaults `drvtrain train ENV` uses.
ENV_DEFAULTS = {
    "cartpole": dict(
        n_envs=10, total_steps=500_000, learning_starts=10_000, train_every=10, eps_start=1.0, eps_end=0.05,
        eps_fraction=0.2, eval_every=50_000, eval_episodes=100,
        dqn=dict(hidden=(128, 128), batch=128, capacity=50_000, lr=2.5e-4, gamma=0.99, weight_decay=0.0,
                 max_norm=10.0, tau=None, target_period=100, alpha=0.6, beta=(0.4, 1.0, 50_000),
                 spectral_c=None, tf32=True)),
}

_EPISODE_FIELDS = 5  # return, length, env step at its end, env index, sequence
_EVAL_LIMIT = 100_000  # env steps an evaluation gives an env without max_steps to end its episode


def _check_int(name, value, low=1):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def _check_real(name, value, low, high):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (low <= value <= high):
        raise ValueError(f"{name} must be a number in [{low}, {high}], got {value!r}")


@dataclass(frozen=True)
class TrainConfig:
    """A whole training run: the environment, the acting schedule and the learner (``dqn``:
    DQNConfig fields except obs_dim, n_actions and seed, which come from the env and ``seed``).
    Every field is checked at construction; ``to_dict``/``from_dict`` round-trip through JSON."""
    env: str = "cartpole"
    n_envs: int = 10
    total_steps: int = 500_000
    seed: int = 0
    learning_starts: int = 10_000
    train_every: int = 10
    eps_start: float = 1.0
    eps_end: float = 0.05
    eps_fraction: float = 0.5
    eval_every: int = 50_000
    eval_episodes: int = 100
    unroll: int = 50
    checkpoint_every: int = 100_000
    dqn: dict = field(default_factory=dict)

    def __post_init__(self):
        from .env import known_envs
        if self.env not in known_envs():
            raise ValueError(f"unknown environment {self.env!r}; known: {', '.join(known_envs())}")
        for name in ("n_envs", "total_steps", "train_every", "eval_every", "eval_episodes", "unroll",
                     "checkpoint_every"):
            _check_int(name, getattr(self, name))
        _check_int("seed", self.seed, 0)
        _check_int("learning_starts", self.learning_starts, 0)
        if self.train_every < self.n_envs:
            raise ValueError(f"train_every ({self.train_every} env steps per gradient step) must be at least "
                             f"n_envs ({self.n_envs}): one iteration steps every env once and learns at most once")
        _check_real("eps_start", self.eps_start, 0.0, 1.0)
        _check_real("eps_end", self.eps_end, 0.0, 1.0)
        _check_real("eps_fraction", self.eps_fraction, 0.0, 1.0)
        if not isinstance(self.dqn, dict):
            raise ValueError(f"dqn must be a dict of DQNConfig fields, got {type(self.dqn).__name__}")
        bad = sorted(set(self.dqn) - {f.name for f in fields(DQNConfig)} | set(self.dqn) & {"obs_dim", "n_actions",
                                                                                          "seed"})
        if bad:
            raise ValueError(f"dqn has fields that are not DQNConfig's or are set by the trainer: {bad}")
        self.dqn_config(obs_dim=1, n_actions=1)  # validates every learner field now

    @classmethod
    def for_env(cls, env: str = "cartpole", **overrides) -> "TrainConfig":
        """The defaults of ``env`` (ENV_DEFAULTS) with ``overrides``; ``dqn`` overrides merge."""
        base = dict(ENV_DEFAULTS.get(env, {}))
        dqn = {**base.pop("dqn", {}), **overrides.pop("dqn", {})}
        return cls(env=env, **{**base, **overrides}, dqn=dqn)

    def dqn_config(self, *, obs_dim: int, n_actions: int) -> DQNConfig:
        return DQNConfig(obs_dim=obs_dim, n_actions=n_actions, seed=self.seed, **self.dqn)

    @property
    def epsilon_schedule(self) -> tuple[float, float, int]:
        """(start, end, span): epsilon goes linearly from start to end over the first
        ``span`` env steps (``eps_fraction`` of ``total_steps``, at least 1), then stays."""
        return self.eps_start, self.eps_end, max(1, int(self.eps_fraction * self.total_steps))

    def to_dict(self) -> dict:
        return json.loads(json.dumps(asdict(self)))

    @classmethod
    def from_dict(cls, data: dict) -> "TrainConfig":
        data = dict(data)
        dqn = dict(data.pop("dqn", {}))
        for key in ("hidden", "beta", "betas", "spectral_layers"):
            if isinstance(dqn.get(key), list):
                dqn[key] = tuple(dqn[key])
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown training settings: {unknown}")
        return cls(**data, dqn=dqn)

    def with_overrides(self, **changes) -> "TrainConfig":
        return replace(self, **changes)


class _Actor(Closable):
    """One set of environments with its acting state: the fused act kernel's arguments."""

    @closes_on_failure
    def __init__(self, config: TrainConfig, learner: DQNStep, n: int, seed: int, *, episode_slots: int):
        self.env = make_env(config.env, n, seed=seed)
        self.n, self.seed = n, seed
        self.loop = DeviceBuffer.zeros(3, np.int64)
        self.ep_return = DeviceBuffer.zeros(n, np.float32)
        self.counter = DeviceBuffer.zeros(1, np.uint32)
        self.episode_slots = episode_slots
        self.episodes = MappedBuffer((episode_slots, _EPISODE_FIELDS), np.float64)
        self.episodes.view()[:] = 0.0
        # The acting forward: the fused narrow kernel when the learner has one (one node).
        narrow, mlp = learner.narrow, learner.online_mlp
        self.net = narrow if narrow is not None else mlp
        scratch = narrow.forward_bytes(n) if narrow is not None else mlp.scratch_bytes(n)
        self.arena = Arena(scratch + 256, zeroed_bytes=mlp.zeroed_bytes(n) + 256)
        self.kernel = self.env.module.kernel(
            f"{self.env.name}_act", "ptr ptr ptr ptr ptr i32 u64 ptr ptr f32 f32 i64 i32 i64 i64 ptr "
                                    "ptr ptr ptr ptr ptr i32 ptr ptr ptr ptr i32 i32 ptr ptr i32", fixed_block=True)
        self.polled = 0  # episodes read from the ring

    def enqueue(self, learner: DQNStep, *, stream, greedy: bool, eps=(1.0, 0.05, 1), schedule=(0, 1),
                gate=None, replay=None) -> None:
        with dependent_launches(learner.config.dependent_launch):
            self._enqueue(learner, stream, greedy, eps, schedule, gate, replay)

    def _enqueue(self, learner, stream, greedy, eps, schedule, gate, replay) -> None:
        self.arena.reset()
        q = self.net.forward(learner.params, self.env.obs, arena=self.arena, stream=stream).output
        r = replay
        tree = r.tree if r is not None else None
        rows = ((r.obs, r.next_obs, r.action, r.reward, r.done, r.capacity, r.state, tree.nodes, tree.leaves,
                 tree.max_priority(), tree.height, tree.internal) if r is not None
                else (0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 1))
        env = self.env
        self.kernel.launch(-(-self.n // self.kernel.block), self.kernel.block, q, env.states, env.obs,
                           env.episode_steps, env.rng_counters, self.n, self.seed, self.ep_return, self.loop,
                           float(eps[0]), float(eps[1]), int(eps[2]), int(greedy), int(schedule[0]),
                           int(schedule[1]), gate if gate is not None else 0, *rows, self.counter,
                           self.episodes.ptr, self.episode_slots, stream=stream)

    def poll(self) -> list[tuple[float, int, int, int]]:
        """Finished episodes since the last poll, in order: (return, length, env step, env index).
        The ring holds more episodes than can end between two polls (Trainer sizes it), so a
        row written a lap later than the one expected is a broken bound, not a row to skip."""
        rows = self.episodes.view()
        out = []
        while True:
            k = self.polled
            row = rows[k % self.episode_slots]
            if row[4] > k + 1:
                raise TrainingError(f"the episode ring ({self.episode_slots} slots) was overwritten before "
                                   f"episode {k + 1} was read")
            if row[4] != k + 1:
                break
            out.append((float(row[0]), int(row[1]), int(row[2]), int(row[3])))
            self.polled += 1
        return out

    def close(self) -> None:
        close_attributes(self, "env", "arena", "episodes", "loop", "ep_return", "counter")


class Trainer(Closable):
    """Runs a TrainConfig: ``run()`` trains and evaluates; ``drvtrain train`` (cli.py)
    writes the run folder from its reports."""

    @closes_on_failure
    def __init__(self, config: TrainConfig):
        if not isinstance(config, TrainConfig):
            raise TypeError(f"Trainer takes a TrainConfig, got {type(config).__name__}")
        self.config = cfg = config
        self.stream = Stream()
        with make_env(cfg.env, 1, seed=0) as probe:
            obs_dim, n_actions, self.max_steps = probe.obs_dim, probe.n_actions, probe.max_steps
        self.learner = DQNStep(cfg.dqn_config(obs_dim=obs_dim, n_actions=n_actions), metrics_slots=4096)
        self.gate = DeviceBuffer.from_numpy(np.ones(1, np.int32))
        self._eval_unroll = 50
        # An env ends at most one episode an iteration. run() reads the ring after each
        # launch with at most two launches unread, and evaluate() after each of its
        # launches: so the rings hold two launches' episodes, and one (40 bytes of mapped
        # host memory an episode: 80 n_envs unroll bytes for training, 4096 rows at least).
        self.actor = _Actor(cfg, self.learner, cfg.n_envs, _derive_seed(cfg.seed, 1),
                            episode_slots=max(4096, 2 * cfg.n_envs * cfg.unroll))
        self.eval_actor = _Actor(cfg, self.learner, cfg.eval_episodes, _derive_seed(cfg.seed, 2),
                                 episode_slots=cfg.eval_episodes * self._eval_unroll)
        self.actor.env.reset(stream=self.stream)
        self.iterations = 0          # host mirror of loop[1]
        self.evaluations = 0
        self.recent = deque(maxlen=100)
        self.episodes = 0
        self.last_loss = float("nan")
        self.graph = None  # the captured graph of `unroll` iterations (run() captures it)
        self._exe = None
        self._partial_exe = {}  # iterations -> a graph of fewer than `unroll` (see run())
        self._eval_exe = None
        self.stream.synchronize()

    # ------------------------------------------------------------------ schedule (host mirror)
    @property
    def env_steps(self) -> int:
        return self.iterations * self.config.n_envs

    def epsilon(self, env_steps: int | None = None) -> float:
        cfg = self.config
        steps = self.env_steps if env_steps is None else env_steps
        start, end, span = cfg.epsilon_schedule
        return start + (end - start) * min(1.0, steps / span)

    def _learns(self, iteration: int) -> bool:
        """Whether the device's schedule runs the learning step in this iteration (0-based)."""
        n, cfg = self.config.n_envs, self.config
        before, after = iteration * n, (iteration + 1) * n
        return after >= cfg.learning_starts and after // cfg.train_every > before // cfg.train_every

    # ------------------------------------------------------------------ graphs
    def _capture(self, iterations: int | None = None):
        cfg = self.config
        eps = cfg.epsilon_schedule
        with capture(self.stream) as graph:
            for _ in range(cfg.unroll if iterations is None else iterations):
                self.actor.enqueue(self.learner, stream=self.stream, greedy=False, eps=eps,
                                   schedule=(cfg.learning_starts, cfg.train_every), gate=self.gate,
                                   replay=self.learner.replay)
                self.learner.enqueue(stream=self.stream, gate=self.gate)
        if iterations is None:
            self.graph = graph
        return graph.instantiate()

    def _launch(self, iterations: int) -> None:
        """``iterations`` (at most ``unroll``) iterations: the captured graph, or for a shorter
        launch (run()'s first after a resume, or its last) a graph of that many, captured once."""
        if iterations == self.config.unroll:
            self._exe.launch(self.stream)
            return
        exe = self._partial_exe.get(iterations)
        if exe is None:
            exe = self._partial_exe[iterations] = self._capture(iterations)
        exe.launch(self.stream)

    def _capture_eval(self):
        with capture(self.stream) as graph:
            for _ in range(self._eval_unroll):
                self.eval_actor.enqueue(self.learner, stream=self.stream, greedy=True)
        return graph.instantiate()

    # ------------------------------------------------------------------ evaluation
    def evaluate(self) -> float:
        """Mean return of one greedy episode in each of ``eval_episodes`` fresh evaluation envs.
        An env with ``max_steps`` ends every episode within that many steps; one without
        (``max_steps`` 0) is given up to ``_EVAL_LIMIT`` steps, and TrainingError says when
        some episode has not ended by then."""
        actor = self.eval_actor
        if self._eval_exe is None:
            self._eval_exe = self._capture_eval()
        self.evaluations += 1
        self.stream.synchronize()
        # Fresh episodes: the envs' random counters carry on, so every evaluation
        # starts from new states, and the same run evaluates the same way.
        actor.ep_return.copy_from_numpy(np.zeros(actor.n, np.float32))
        actor.env.reset(stream=self.stream)
        first: dict[int, float] = {}
        limit = self.max_steps if self.max_steps > 0 else _EVAL_LIMIT
        launches = -(-limit // self._eval_unroll) + (1 if self.max_steps > 0 else 0)
        for _ in range(launches):
            self._eval_exe.launch(self.stream)
            self.stream.synchronize()
            for ret, _, _, env in actor.poll():
                first.setdefault(env, ret)
            if len(first) == actor.n:
                break
        if len(first) < actor.n:
            raise TrainingError(f"evaluation: only {len(first)} of {actor.n} episodes ended within "
                               f"{launches * self._eval_unroll} steps")
        return float(np.mean([first[i] for i in range(actor.n)]))

    # ------------------------------------------------------------------ running
    def run(self, callback=None, *, until: int | None = None, report_every_s: float = 1.0) -> dict:
        """Train to ``total_steps`` env steps (or stop at ``until`` env steps, to
        checkpoint and resume later); ``callback(progress)`` on every report.
        Every iteration steps all ``n_envs`` envs, so a run ends at the first multiple
        of ``n_envs`` at or past its target. Launches end at multiples of ``unroll``
        iterations counted from the run's start, and where it stops: one that starts or
        ends inside such a span is shorter. So a run stopped and resumed anywhere
        launches, reports and evaluates after the same iterations as one that was not.

        Returns the summary: wall time, env steps, episodes, learning steps,
        the final greedy evaluation (None when stopped before the end).
        """
        cfg = self.config
        if self._exe is None:
            self._exe = self._capture()
        total_iterations = -(-cfg.total_steps // cfg.n_envs)
        stop_iterations = total_iterations if until is None else min(total_iterations, -(-until // cfg.n_envs))
        metrics = self.learner.metrics
        started, first_steps = time.perf_counter(), self.env_steps
        last_report = started
        next_eval = (self.env_steps // cfg.eval_every + 1) * cfg.eval_every
        eval_return = None
        in_flight = deque()
        events = [Event() for _ in range(3)]
        launch_index = 0
        while self.iterations < stop_iterations:
            count = min(cfg.unroll - self.iterations % cfg.unroll, stop_iterations - self.iterations)
            self._launch(count)
            for it in range(self.iterations, self.iterations + count):
                if self._learns(it):
                    metrics.record(self.stream)
            self.iterations += count
            event = events[launch_index % len(events)]
            event.record(self.stream)
            in_flight.append(event)
            launch_index += 1
            while len(in_flight) >= len(events) - 1:  # bounded queue: wait by polling, never a sync
                if in_flight[0].query():
                    in_flight.popleft()
                else:
                    time.sleep(0)
            self._drain(metrics)
            self.learner.check_errors()
            due_eval = self.env_steps >= next_eval or self.iterations >= total_iterations
            now = time.perf_counter()
            if due_eval or now - last_report >= report_every_s:
                if due_eval:
                    eval_return = self.evaluate()
                    next_eval += cfg.eval_every
                    self._drain(metrics)
                progress = self._progress(started, first_steps, eval_return if due_eval else None)
                last_report = now
                if callback is not None:
                    callback(progress)
        self.stream.synchronize()
        self._drain(metrics)
        summary = {"wall_s": time.perf_counter() - started, "env_steps": self.env_steps,
                   "episodes": self.episodes, "learning_steps": self.learner.steps_done(),
                   "final_eval_return": eval_return, "mean_return_100": _mean(self.recent),
                   "eval_episodes": cfg.eval_episodes}
        return summary

    def _drain(self, metrics) -> None:
        for m in metrics.poll():
            self.last_loss = m.loss
        for ret, _, _, _ in self.actor.poll():
            self.recent.append(ret)
            self.episodes += 1

    def _progress(self, started: float, first_steps: int, eval_return) -> dict:
        """The report: ``wall_s`` since this ``run()`` began (at ``first_steps`` env steps,
        more than 0 after a resume), and the rate of the steps taken since then."""
        wall = time.perf_counter() - started
        rate = (self.env_steps - first_steps) / max(wall, 1e-9)
        return {"env_steps": self.env_steps, "wall_s": wall, "steps_per_s": rate,
                "episodes": self.episodes, "mean_return_100": _mean(self.recent), "loss": self.last_loss,
                "epsilon": self.epsilon(), "eval_return": eval_return}

    # ------------------------------------------------------------------ checkpoints
    def state_arrays(self) -> dict[str, np.ndarray]:
        """Everything a resume needs, as host arrays (synchronous)."""
        self.stream.synchronize()
        # Read every finished episode now: a resumed run's ring starts empty, so
        # the host's count must already match the device's.
        self._drain(self.learner.metrics)
        learner, replay, tree, actor = self.learner, self.learner.replay, self.learner.replay.tree, self.actor
        out = {f"learner.{k}": v for k, v in learner.state_numpy().items()}
        out.update({
            "tree.nodes": tree.nodes.to_numpy(), "tree.leaves": tree.leaves.to_numpy(),
            "tree.state": tree._state.to_numpy(),
            "replay.obs": replay.obs.to_numpy(), "replay.next_obs": replay.next_obs.to_numpy(),
            "replay.action": replay.action.to_numpy(), "replay.reward": replay.reward.to_numpy(),
            "replay.done": replay.done.to_numpy(), "replay.state": replay.state.to_numpy(),
            "env.states": actor.env.states.to_numpy(), "env.obs": actor.env.obs.to_numpy(),
            "env.episode_steps": actor.env.episode_steps.to_numpy(),
            "env.rng_counters": actor.env.rng_counters.to_numpy(),
            "env.ep_return": actor.ep_return.to_numpy(), "loop": actor.loop.to_numpy(),
            "gate": self.gate.to_numpy(),
            # Each evaluation resets its envs from where they stopped: an env's reset draws from
            # its random counter and is handed its state.
            "eval.rng_counters": self.eval_actor.env.rng_counters.to_numpy(),
            "eval.states": self.eval_actor.env.states.to_numpy(),
            "host": np.array([self.iterations, self.evaluations, self.episodes, actor.polled,
                              learner.metrics.recorded], np.int64),
            "host.recent": np.array(self.recent, np.float64),
        })
        return out

    def load_state_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        """Restore ``state_arrays()``; every array is checked (its shape and dtype, then its
        values: :func:`check_trainer_state`) before anything is written."""
        current = self.state_arrays()
        optional = {"host.recent", "eval.rng_counters", "eval.states"}  # older checkpoints: see below
        missing = sorted(set(current) - set(arrays) - optional)
        if missing:
            raise ValueError(f"checkpoint lacks {missing}")
        for key, now in current.items():
            if key == "host.recent" or key not in arrays:
                continue
            got = np.asarray(arrays[key])
            if got.shape != now.shape or got.dtype != now.dtype:
                raise ValueError(f"checkpoint array {key} is {got.dtype}{got.shape}, this run needs "
                                 f"{now.dtype}{now.shape}: it belongs to another configuration")
        learner, replay, tree, actor = self.learner, self.learner.replay, self.learner.replay.tree, self.actor
        check_trainer_state(arrays, capacity=replay.capacity, levels=tree.levels, n_actions=learner.config.n_actions,
                            n_envs=self.config.n_envs, max_steps=self.max_steps, n_params=learner.layout.size,
                            n_u=learner.u.size)
        learner.load_state({k.removeprefix("learner."): v for k, v in arrays.items() if k.startswith("learner.")})
        for buf, key in ((tree.nodes, "tree.nodes"), (tree.leaves, "tree.leaves"), (tree._state, "tree.state"),
                         (replay.obs, "replay.obs"), (replay.next_obs, "replay.next_obs"),
                         (replay.action, "replay.action"), (replay.reward, "replay.reward"),
                         (replay.done, "replay.done"), (replay.state, "replay.state"),
                         (actor.env.states, "env.states"), (actor.env.obs, "env.obs"),
                         (actor.env.episode_steps, "env.episode_steps"),
                         (actor.env.rng_counters, "env.rng_counters"), (actor.ep_return, "env.ep_return"),
                         (actor.loop, "loop"), (self.gate, "gate")):
            buf.copy_from_numpy(np.ascontiguousarray(arrays[key]))
        # The sums from the leaves, in the fixed order every refresh uses: the bits a
        # checkpoint of this version holds, and exact sums for one written by an earlier
        # version, whose sums were added up by atomics.
        tree.rebuild(stream=self.stream)
        self.stream.synchronize()
        # A checkpoint written before the evaluation envs were saved: they start as a new run's.
        evaluation = self.eval_actor.env
        for buf, key in ((evaluation.rng_counters, "eval.rng_counters"), (evaluation.states, "eval.states")):
            buf.copy_from_numpy(np.ascontiguousarray(arrays[key]) if key in arrays else np.zeros(buf.shape, buf.dtype))
        iterations, evaluations, episodes, polled, recorded = (int(v) for v in arrays["host"])
        self.iterations, self.evaluations, self.episodes = iterations, evaluations, episodes
        actor.polled = polled
        learner.metrics.recorded = learner.metrics.polled = recorded
        self.recent = deque((float(v) for v in arrays.get("host.recent", [])), maxlen=100)

    def save_checkpoint(self, path) -> None:
        from ..checkpoint import save_checkpoint
        save_checkpoint(path, self.state_arrays(), {"config": self.config.to_dict(), "env_steps": self.env_steps})

    def load_checkpoint(self, path) -> None:
        from ..checkpoint import load_checkpoint
        arrays, meta = load_checkpoint(path)
        if meta.get("config") != self.config.to_dict():
            raise ValueError(f"{path}: the checkpoint belongs to another configuration")
        self.load_state_arrays(arrays)

    def close(self) -> None:
        """Give back every graph, buffer and stream now (also what a failed ``__init__`` had made)."""
        for exe in (getattr(self, "_exe", None), getattr(self, "_eval_exe", None),
                    *getattr(self, "_partial_exe", {}).values()):
            if exe is not None:
                exe.close()
        self._exe, self._eval_exe, self._partial_exe = None, None, {}
        close_attributes(self, "graph", "actor", "eval_actor", "learner", "gate", "stream")


def check_trainer_state(arrays: dict, *, capacity: int, levels, n_actions: int, n_envs: int, max_steps: int,
                        n_params: int, n_u: int) -> None:
    """``Trainer.state_arrays()``'s arrays, of the shapes and dtypes a trainer of this
    configuration holds, checked for values it can go on from; ValueError says what is
    wrong. The learner's arrays as ``check_learner_state``; the replay's transitions
    (actions in [0, n_actions), done 0 or 1, everything else finite) and its counters
    (stored = min(inserted, capacity), one transition inserted per env step); the sum
    tree's leaves (finite, at least 0, 0 past the stored count), its draw's and rebuild's
    last-block counters (0), its largest leaf seen (at least every leaf), and its internal
    sums (finite, 0 in the padding, each within 1e-9 capacity times the largest leaf of the
    sum of its children: far looser than the rounding of a float64 sum, far tighter than a
    tree of other leaves; the load then rebuilds them from the leaves); the
    environments' observations (finite: the network reads them) and episode steps (in
    [0, max_steps - 1] where there is a limit, as ``DeviceEnv.load_state`` takes them);
    the episodes' returns (finite); the loop's counters (env steps = iterations x n_envs, as the host counts
    them) and the gate (0 or 1). ``levels`` is ``SumTree.levels``."""
    learner = {k.removeprefix("learner."): v for k, v in arrays.items() if k.startswith("learner.")}
    try:
        check_learner_state(learner, n_params, n_u)
    except ValueError as exc:
        raise ValueError(f"learner: {exc}") from None

    def values(key):
        return np.asarray(arrays[key]).reshape(-1)

    def finite(key):
        a = values(key)
        bad = int((~np.isfinite(a)).sum())
        if bad:
            raise ValueError(f"{key} holds {bad} values that are not finite")
        return a

    env_steps, iterations, finished = (int(v) for v in values("loop"))
    if min(env_steps, iterations, finished) < 0 or env_steps != iterations * n_envs:
        raise ValueError(f"loop counters [{env_steps}, {iterations}, {finished}] are not env steps = iterations "
                         f"x {n_envs} envs, all at least 0")
    host = [int(v) for v in values("host")]
    if min(host) < 0 or host[0] != iterations:
        raise ValueError(f"host counters {host} must be at least 0, the first the loop's {iterations} iterations")
    if values("gate")[0] not in (0, 1):
        raise ValueError(f"gate must be 0 or 1, got {values('gate')[0]}")
    inserted, stored = (int(v) for v in values("replay.state"))
    if inserted != env_steps or stored != min(inserted, capacity):
        raise ValueError(f"replay counters [{inserted}, {stored}] do not follow from {env_steps} env steps "
                         f"into {capacity} slots")
    actions = values("replay.action")
    if ((actions < 0) | (actions >= n_actions)).any():
        raise ValueError(f"replay.action holds actions outside [0, {n_actions})")
    if not np.isin(values("replay.done"), (0.0, 1.0)).all():
        raise ValueError("replay.done holds values other than 0 and 1")
    for key in ("replay.obs", "replay.next_obs", "replay.reward", "env.obs", "env.ep_return"):
        finite(key)
    steps = values("env.episode_steps")
    if (steps < 0).any() or (max_steps > 0 and (steps >= max_steps).any()):
        raise ValueError(f"env.episode_steps holds counts outside [0, {max_steps - 1 if max_steps > 0 else 'inf'}]")
    leaves = finite("tree.leaves").astype(np.float64)
    if (leaves < 0).any():
        raise ValueError("tree.leaves holds negative priorities")
    if leaves[stored:].any():
        raise ValueError(f"tree.leaves holds priorities past the {stored} stored transitions")
    tree_state = values("tree.state").astype(np.uint32)
    if tree_state[2:4].any():  # the draw's and the rebuild's last-block counters, 0 between launches
        raise ValueError(f"tree.state's last-block counters {tree_state[2:4].tolist()} must be 0: a launch "
                         f"was cut short when they were saved")
    max_leaf = float(tree_state[4:5].view(np.float32)[0])
    if not (np.isfinite(max_leaf) and max_leaf >= leaves.max(initial=0.0)):
        raise ValueError(f"tree.state's largest leaf seen ({max_leaf}) is below a leaf, or not finite")
    nodes = finite("tree.nodes")
    tolerance = 1e-9 * capacity * max_leaf
    children = leaves
    for offset, real, size in reversed(levels):
        sums = np.zeros(real * 32)
        sums[: min(len(children), real * 32)] = children[: real * 32]
        sums = sums.reshape(real, 32).sum(axis=1)
        stored_sums = nodes[offset: offset + real]
        if nodes[offset + real: offset + size].any():
            raise ValueError("tree.nodes holds sums in its padding")
        gap = float(np.max(np.abs(stored_sums - sums)))
        if gap > tolerance:
            raise ValueError(f"tree.nodes is not the sum of its leaves (a gap of {gap:.3g}, at most {tolerance:.3g} "
                             f"allowed)")
        children = stored_sums


def _derive_seed(seed: int, stream: int) -> int:
    """Independent 64-bit seeds for the parts of a run, from the run's seed."""
    return int(np.random.SeedSequence([seed, stream]).generate_state(1, np.uint64)[0])


def _mean(values) -> float:
    return float(np.mean(values)) if len(values) else float("nan")
