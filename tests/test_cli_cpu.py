"""The run folder, the learning-curve plot and the `train` and `plot` commands (runs everywhere).

The trainer itself needs a GPU; these tests drive the command with FakeTrainer,
a deterministic stand-in with the trainer's interface, installed as
``drvtrain.rl.trainer`` (in this process, or in a subprocess through FAKE_MAIN).
"""
import io
import json
import math
import os
import struct
import subprocess
import sys
import types
from dataclasses import dataclass

import numpy as np
import pytest

from drvtrain import cli
from drvtrain.checkpoint import load_checkpoint, save_checkpoint
from drvtrain.rl.dqn import TrainingError
from drvtrain.rl.run import METRIC_COLUMNS, RunFolder, RunFolderError
from drvtrain.rl.trainer import TrainConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
NO_GPU_ENV = {**ENV, "CUDA_VISIBLE_DEVICES": ""}
# `python -c FAKE_MAIN ARGS...`: the command line, with FakeTrainer as drvtrain.rl.trainer.
FAKE_MAIN = (f"import sys; sys.path.insert(0, {TESTS_DIR!r}); import test_cli_cpu; "
             "test_cli_cpu.install_fake_trainer(sys.modules); "
             "from drvtrain.cli import main; sys.exit(main(sys.argv[1:]))")
NO_GPU_LINE = "drvtrain: no CUDA driver/GPU found"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------- the stand-in trainer
@dataclass(frozen=True)
class FakeTrainConfig(TrainConfig):
    """The real settings and their JSON form, with a stand-in's checks and defaults."""
    ENV_DEFAULTS = {"cartpole": {"learning_starts": 777, "dqn": {"hidden": [64, 64]}}}

    def __post_init__(self):
        for name in ("n_envs", "total_steps", "eval_every", "eval_episodes", "unroll", "checkpoint_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")

    @classmethod
    def for_env(cls, env, **overrides):
        base = json.loads(json.dumps(cls.ENV_DEFAULTS[env]))
        dqn = {**base.pop("dqn", {}), **overrides.pop("dqn", {})}
        return cls(env=env, **{**base, **overrides}, dqn=dqn)

    @classmethod
    def from_dict(cls, data):
        return cls(**data)


class FakeTrainer:
    """Deterministic in its config and state, so a resumed run reproduces an uninterrupted one bit for bit.
    Like the Trainer, it steps all n_envs envs an iteration, unroll iterations a report, and ends at the
    first multiple of n_envs at or past total_steps."""
    stop_at = None  # an env step at which run() is interrupted, as by Ctrl-C
    raise_in_init = None  # an exception Trainer(config) raises
    raise_in_run = None  # an exception run() raises after its first report

    def __init__(self, config):  # Trainer's signature: the command owns the run folder
        if FakeTrainer.raise_in_init is not None:
            raise FakeTrainer.raise_in_init
        self.config = config
        self.steps = 0
        self.params = np.random.default_rng(config.seed).standard_normal(37).astype(np.float32)

    def run(self, callback=None):
        cfg = self.config
        end = final_steps(cfg.total_steps, cfg.n_envs)
        while self.steps < end:
            before = self.steps
            self.steps = min(end, self.steps + cfg.n_envs * cfg.unroll)
            self.params = np.sin(self.params * np.float32(1.5) + np.float32(self.steps % 7)).astype(np.float32)
            if FakeTrainer.stop_at is not None and self.steps >= FakeTrainer.stop_at:
                raise KeyboardInterrupt
            evaluated = self.steps // cfg.eval_every > before // cfg.eval_every
            if callback is not None:
                callback({"env_steps": self.steps, "steps_per_s": 1e6, "episodes": self.steps // 20,
                          "mean_return_100": float(self.params.mean()) if self.steps > 20 else float("nan"),
                          "loss": float(self.params[0]) ** 2, "epsilon": float(self.params[1]) ** 2,
                          "eval_return": float(self.params[2]) if evaluated else None})
            if FakeTrainer.raise_in_run is not None:
                raise FakeTrainer.raise_in_run
        return {"env_steps": self.steps, "episodes": self.steps // 20}

    def state_arrays(self):
        return {"params": self.params.copy(), "steps": np.array(self.steps, np.int64)}

    def load_state_arrays(self, arrays):
        if set(arrays) != {"params", "steps"} or arrays["params"].shape != self.params.shape:
            raise ValueError("checkpoint of another trainer")
        self.params = arrays["params"].copy()
        self.steps = int(arrays["steps"])


def final_steps(total_steps, n_envs):
    """Where a run of total_steps env steps ends: the first multiple of n_envs at or past it."""
    return -(-total_steps // n_envs) * n_envs


def install_fake_trainer(modules) -> None:
    fake = types.ModuleType("drvtrain.rl.trainer")
    fake.Trainer, fake.TrainConfig = FakeTrainer, FakeTrainConfig
    modules["drvtrain.rl.trainer"] = fake


@pytest.fixture
def fake_trainer(monkeypatch):
    """FakeTrainer as drvtrain.rl.trainer in this process, and a GPU that is always there."""
    fake = types.ModuleType("drvtrain.rl.trainer")
    fake.Trainer, fake.TrainConfig = FakeTrainer, FakeTrainConfig
    monkeypatch.setitem(sys.modules, "drvtrain.rl.trainer", fake)
    monkeypatch.setattr(cli, "_require_device", lambda: None)
    monkeypatch.setattr(FakeTrainer, "stop_at", None)
    monkeypatch.setattr(FakeTrainer, "raise_in_init", None)
    monkeypatch.setattr(FakeTrainer, "raise_in_run", None)


def drvtrain(*args, cwd, env=NO_GPU_ENV, fake=False):
    command = [sys.executable, "-c", FAKE_MAIN] if fake else [sys.executable, "-m", "drvtrain"]
    return subprocess.run([*command, *map(str, args)], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=120)


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def random_rows(rng, n, *, start=0):
    steps = start + np.cumsum(rng.integers(1, 1000, n))
    return [{"env_steps": int(s), "wall_s": float(rng.random() * 100), "episodes": int(rng.integers(0, 10**6)),
             "mean_return_100": float(rng.normal(100, 50)) if rng.random() < 0.9 else None,
             "loss": float(rng.random()), "epsilon": float(rng.random()),
             "eval_return": float(rng.normal(100, 50)) if rng.random() < 0.3 else None} for s in steps]


def as_table(rows):
    return {name: np.array([math.nan if r.get(name) is None else float(r[name]) for r in rows])
            for name in METRIC_COLUMNS}


def assert_tables_equal(got, want, columns=METRIC_COLUMNS):
    for name in columns:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


# ---------------------------------------------------------------------- the run folder
def test_config_and_summary_round_trip_atomically(tmp_path, rng):
    run = RunFolder(tmp_path / "runs" / "a")
    config = FakeTrainConfig(seed=int(rng.integers(2**31)), dqn={"hidden": (64, 32)}).to_dict()
    summary = {"env_steps": np.int64(rng.integers(10**9)), "final_eval_return": np.float32(rng.random()),
               "best": None}
    assert run.write_config(config) == run.path / "config.json"
    run.write_summary(summary)
    assert run.read_config() == config
    assert run.read_summary() == {"env_steps": int(summary["env_steps"]),
                                  "final_eval_return": float(summary["final_eval_return"]), "best": None}
    assert sorted(p.name for p in run.path.iterdir()) == ["config.json", "summary.json"]  # no temp files


def test_read_config_refuses_missing_or_invalid_files(tmp_path):
    run = RunFolder(tmp_path)
    with pytest.raises(RunFolderError, match="no such file"):
        run.read_config()
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(RunFolderError, match="not valid JSON"):
        run.read_config()
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(RunFolderError, match="expected a JSON object"):
        run.read_config()


def test_metrics_rows_are_flushed_as_they_are_written(tmp_path, rng):
    run = RunFolder(tmp_path / "r")
    rows = random_rows(rng, int(rng.integers(1, 40)))
    with run.metrics_writer() as writer:
        for k, row in enumerate(rows):
            writer.write({**row, "not_a_column": 1})
            assert_tables_equal(run.read_metrics(), as_table(rows[:k + 1]))  # on disk before close()
    lines = run.metrics_path().read_text().splitlines()
    assert lines[0] == ",".join(METRIC_COLUMNS) and len(lines) == len(rows) + 1


def test_resuming_appends_and_drops_rows_past_the_checkpoint(tmp_path, rng):
    run = RunFolder(tmp_path)
    first = random_rows(rng, int(rng.integers(2, 30)))
    with run.metrics_writer() as writer:
        for row in first:
            writer.write(row)
    keep = int(rng.integers(1, len(first)))
    checkpoint_step = first[keep - 1]["env_steps"]
    then = random_rows(rng, int(rng.integers(1, 30)), start=checkpoint_step)
    with run.metrics_writer(keep_up_to=checkpoint_step) as writer:
        assert writer.last_row["env_steps"] == str(checkpoint_step)  # where wall time carries on from
        for row in then:
            writer.write(row)
    assert_tables_equal(run.read_metrics(), as_table(first[:keep] + then))
    assert run.metrics_path().read_text().count("env_steps") == 1  # one header
    run.append_metrics(then[-1])
    assert run.read_metrics()["env_steps"].size == keep + len(then) + 1


def test_a_torn_last_row_is_dropped_before_appending(tmp_path, rng):
    run = RunFolder(tmp_path)
    rows = random_rows(rng, 5)
    with run.metrics_writer() as writer:
        for row in rows[:4]:
            writer.write(row)
    with open(run.metrics_path(), "a") as f:
        f.write("123,4.5,6")  # a crash in the middle of a row
    assert run.read_metrics()["env_steps"].size == 4
    with run.metrics_writer() as writer:
        writer.write(rows[4])
    assert_tables_equal(run.read_metrics(), as_table(rows))


def test_a_foreign_metrics_file_is_refused(tmp_path):
    (tmp_path / "metrics.csv").write_text("step,reward\n1,2\n")
    with pytest.raises(RunFolderError, match="not a drvtrain metrics file"):
        RunFolder(tmp_path).metrics_writer()
    with pytest.raises(RunFolderError, match="not a drvtrain metrics file"):
        RunFolder(tmp_path).read_metrics()


def test_latest_checkpoint(tmp_path, rng):
    run = RunFolder(tmp_path / "new")
    assert run.latest_checkpoint() is None and not run.path.exists()
    arrays = {"w": rng.standard_normal(8)}
    save_checkpoint(run.checkpoint_path(), arrays, {"env_steps": 5})
    assert run.latest_checkpoint() == run.checkpoint_path()
    np.testing.assert_array_equal(load_checkpoint(run.latest_checkpoint())[0]["w"], arrays["w"])


# ---------------------------------------------------------------------- plot
def write_synthetic_run(path, rng):
    run = RunFolder(path)
    run.write_config(FakeTrainConfig(seed=int(rng.integers(100))).to_dict())
    with run.metrics_writer() as writer:
        for row in random_rows(rng, int(rng.integers(2, 200))):
            writer.write(row)
    return run


def need_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"matplotlib is not installed ({exc}): pip install \"drvtrain[plot]\"")


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_plot_run_draws_the_learning_curve(tmp_path, rng):
    need_matplotlib()
    from drvtrain.plot import plot_run
    run = write_synthetic_run(tmp_path / "run", rng)
    out = plot_run(run.path)
    assert out == run.path / "learning_curve.png"
    assert png_size(out) == (800, 450)
    other = plot_run(str(run.path), tmp_path / "elsewhere" / "curve.png")
    assert png_size(other) == (800, 450)
    (run.path / "metrics.csv").write_text(",".join(METRIC_COLUMNS) + "\n")
    with pytest.raises(RunFolderError, match="no rows yet"):
        plot_run(run.path)


def test_plot_run_without_matplotlib_says_how_to_install_it(tmp_path, rng, monkeypatch):
    from drvtrain.plot import MatplotlibMissing, plot_run
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)  # import of any of them raises ImportError
    run = write_synthetic_run(tmp_path, rng)
    with pytest.raises(MatplotlibMissing, match=r'pip install "drvtrain\[plot\]"'):
        plot_run(run.path)
    assert not (run.path / "learning_curve.png").exists()


def test_plot_command_writes_a_png(tmp_path, rng):
    need_matplotlib()
    run = write_synthetic_run(tmp_path / "run", rng)
    out = drvtrain("plot", run.path, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(run.path / "learning_curve.png")
    assert png_size(run.path / "learning_curve.png") == (800, 450)
    out = drvtrain("plot", run.path, "--out", "c.png", cwd=tmp_path)
    assert out.returncode == 0 and png_size(tmp_path / "c.png") == (800, 450), out.stderr


def test_plot_command_without_matplotlib_exits_1_with_the_install_hint(tmp_path, rng):
    shadow = tmp_path / "shadow" / "matplotlib"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('matplotlib is not installed here')\n")
    env = {**NO_GPU_ENV, "PYTHONPATH": os.pathsep.join([str(shadow.parent), ENV["PYTHONPATH"]])}
    run = write_synthetic_run(tmp_path / "run", rng)
    out = drvtrain("plot", run.path, cwd=tmp_path, env=env)
    assert out.returncode == 1
    assert 'pip install "drvtrain[plot]"' in one_line(out.stderr)
    assert not (run.path / "learning_curve.png").exists()


@pytest.mark.parametrize("case", ["missing folder", "no metrics", "foreign metrics"])
def test_plot_command_on_a_bad_run_folder_exits_2(tmp_path, case):
    run = tmp_path / "run"
    if case != "missing folder":
        run.mkdir()
    if case == "foreign metrics":
        (run / "metrics.csv").write_text("a,b\n1,2\n")
    out = drvtrain("plot", run, cwd=tmp_path)
    assert out.returncode == 2
    assert one_line(out.stderr).startswith("drvtrain: ")


# ---------------------------------------------------------------------- train: bad input
def write(path, text):
    path.write_text(text)
    return path


def a_run_folder(tmp_path, **config):
    run = RunFolder(tmp_path / "old-run")
    run.write_config(FakeTrainConfig.for_env("cartpole", **config).to_dict())
    return run.path


def damaged_checkpoint(tmp_path):
    folder = a_run_folder(tmp_path)
    path = RunFolder(folder).checkpoint_path()
    save_checkpoint(path, {"params": np.zeros(37, np.float32), "steps": np.array(10, np.int64)},
                    {"env_steps": 10, "config": FakeTrainConfig.for_env("cartpole").to_dict()})
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    return folder


# (arguments after `train`, a part of the one stderr line, whether the trainer is imported by then)
BAD_TRAIN_INPUT = {
    "unknown env": lambda t, rng: (["pong"], "unknown environment 'pong' (known: cartpole)", False),
    "steps < 1": lambda t, rng: (["cartpole", "--steps", -int(rng.integers(0, 10**6))], "--steps must be >= 1",
                                 False),
    "envs < 1": lambda t, rng: (["cartpole", "--envs", -int(rng.integers(0, 100))], "--envs must be >= 1", False),
    "eval episodes < 1": lambda t, rng: (["cartpole", "--eval-episodes", -int(rng.integers(0, 100))],
                                         "--eval-episodes must be >= 1", False),
    "steps not a number": lambda t, rng: (["cartpole", "--steps", "1e5x"], "invalid int value", False),
    "out and resume": lambda t, rng: (["cartpole", "--out", "a", "--resume", "b"], "not allowed with", False),
    "config missing": lambda t, rng: (["cartpole", "--config", t / "nope.json"], "cannot be read", False),
    "config not json": lambda t, rng: (["cartpole", "--config", write(t / "c.json", "{'steps': 1}")],
                                       "not valid JSON", False),
    "config not an object": lambda t, rng: (["cartpole", "--config", write(t / "c.json", "[1, 2]")],
                                            "expected a JSON object", False),
    "config unknown field": lambda t, rng: (["cartpole", "--config", write(t / "c.json", '{"n_env": 4}')],
                                            "unknown field n_env", True),
    "config invalid value": lambda t, rng: (["cartpole", "--config",
                                             write(t / "c.json", json.dumps({"unroll": -int(rng.integers(100))}))],
                                            "invalid training config: unroll must be", True),
    "resume missing": lambda t, rng: (["cartpole", "--resume", t / "gone"], "no such folder", False),
    "resume not a run": lambda t, rng: (["cartpole", "--resume", t], "not a run folder", False),
    "resume other config": lambda t, rng: (["cartpole", "--resume", a_run_folder(t, seed=3), "--seed", "4"],
                                           "another config (seed 3 (saved) vs 4)", True),
    "resume damaged checkpoint": lambda t, rng: (["cartpole", "--resume", damaged_checkpoint(t)],
                                                 "checksum mismatch", True),
    "out holds a run": lambda t, rng: (["cartpole", "--out", a_run_folder(t)], "already holds a run", True),
}


@pytest.mark.parametrize("case", sorted(BAD_TRAIN_INPUT))
def test_bad_train_input_exits_2_with_one_line(tmp_path, rng, case):
    args, message, needs_trainer = BAD_TRAIN_INPUT[case](tmp_path, rng)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    out = drvtrain("train", *args, cwd=tmp_path, fake=needs_trainer)
    assert out.returncode == 2, out.stderr
    line = one_line(out.stderr)
    assert line.startswith("drvtrain") and message in line, line
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing written


def test_train_without_a_gpu_exits_2_after_validating(tmp_path):
    out = drvtrain("train", "cartpole", "--steps", "1000", cwd=tmp_path, fake=True)
    assert out.returncode == 2
    assert one_line(out.stderr).startswith(NO_GPU_LINE)
    assert list(tmp_path.iterdir()) == []
    out = drvtrain("train", "pong", cwd=tmp_path, fake=True)  # bad input is named first, GPU or not
    assert out.returncode == 2 and "unknown environment" in one_line(out.stderr)


def test_train_with_the_real_trainer_without_a_gpu(tmp_path):
    import importlib.util
    out = drvtrain("train", "cartpole", cwd=tmp_path)
    if importlib.util.find_spec("drvtrain.rl.trainer") is None:
        assert out.returncode == 1
        assert "drvtrain.rl.trainer, which cannot be imported" in one_line(out.stderr)
    else:
        assert out.returncode == 2
        assert one_line(out.stderr).startswith(NO_GPU_LINE)
    assert list(tmp_path.iterdir()) == []


def test_train_without_the_trainer_module_exits_1(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "drvtrain.rl.trainer", None)
    assert cli.main(["train", "cartpole", "--out", str(tmp_path / "r")]) == 1
    assert "drvtrain.rl.trainer, which cannot be imported" in one_line(capsys.readouterr().err)
    assert list(tmp_path.iterdir()) == []


def test_known_envs_come_from_the_env_registry(monkeypatch):
    from drvtrain.rl.env import known_envs
    assert cli.KNOWN_ENVS == known_envs()  # the help text's list is the registry's
    monkeypatch.setitem(sys.modules, "drvtrain.rl.env", None)  # the module cannot be imported
    monkeypatch.delattr(sys.modules["drvtrain.rl"], "env", raising=False)
    assert cli._known_envs() == cli.KNOWN_ENVS
    registry = types.ModuleType("drvtrain.rl.env")
    registry.known_envs = lambda: ["pendulum", "cartpole"]
    monkeypatch.setitem(sys.modules, "drvtrain.rl.env", registry)
    monkeypatch.setattr(sys.modules["drvtrain.rl"], "env", registry, raising=False)
    assert cli._known_envs() == ("cartpole", "pendulum")


# ---------------------------------------------------------------------- train: help
def test_help_texts_document_options_and_exit_codes(tmp_path):
    out = drvtrain("--help", cwd=tmp_path, env=ENV)
    assert out.returncode == 0 and all(c in out.stdout for c in ("doctor", "train", "plot"))
    out = drvtrain("train", "--help", cwd=tmp_path, env=ENV)
    text = " ".join(out.stdout.split())
    assert out.returncode == 0
    for option in ("ENV", "--envs N", "--steps N", "--seed S", "--config FILE", "--out DIR", "--resume DIR",
                   "--eval-episodes N", "runs/ENV-seedS-YYYYmmdd-HHMMSS", "exit codes:", "0 the run finished",
                   "1 training failed", "2 bad input", "no CUDA driver/GPU found", "130 interrupted"):
        assert option in text, option
    out = drvtrain("plot", "--help", cwd=tmp_path, env=ENV)
    text = " ".join(out.stdout.split())
    assert out.returncode == 0
    for option in ("RUN", "--out PNG", "learning_curve.png", "exit codes:", 'pip install "drvtrain[plot]"',
                   "2 RUN is not a run folder"):
        assert option in text, option


# ---------------------------------------------------------------------- train: runs with the stand-in
def small_run_config(tmp_path, rng):
    """A --config file and the flags of a short run with several checkpoints and evaluations."""
    n_envs, unroll = int(rng.integers(1, 6)), int(rng.integers(1, 5))
    per_iteration = n_envs * unroll
    iterations_per_checkpoint = int(rng.integers(2, 6))
    config = {"unroll": unroll, "checkpoint_every": per_iteration * iterations_per_checkpoint,
              "eval_every": per_iteration * int(rng.integers(1, 8)), "dqn": {"lr": 1e-3}}
    path = write(tmp_path / "train.json", json.dumps(config))
    config["iterations_per_checkpoint"] = iterations_per_checkpoint
    steps = per_iteration * int(rng.integers(20, 60)) + int(rng.integers(0, per_iteration))
    flags = ["--envs", str(n_envs), "--steps", str(steps), "--seed", str(int(rng.integers(1000))),
             "--config", str(path)]
    return flags, config, steps


def test_train_writes_a_run_folder(tmp_path, rng, fake_trainer, capsys):
    flags, config, steps = small_run_config(tmp_path, rng)
    folder = tmp_path / "run"
    assert cli.main(["train", "cartpole", *flags, "--out", str(folder)]) == 0
    stdout = capsys.readouterr().out
    run = RunFolder(folder)
    saved = run.read_config()
    assert saved["total_steps"] == steps and saved["unroll"] == config["unroll"]
    assert saved["learning_starts"] == 777 and saved["dqn"] == {"hidden": [64, 64], "lr": 1e-3}  # env defaults
    metrics = run.read_metrics()
    per_launch, end = saved["n_envs"] * saved["unroll"], final_steps(steps, saved["n_envs"])
    expected_steps = np.minimum(np.arange(1, -(-end // per_launch) + 1) * per_launch, end)
    np.testing.assert_array_equal(metrics["env_steps"], expected_steps)
    assert np.all(np.diff(metrics["wall_s"]) >= 0)
    previous = np.concatenate([[0], expected_steps[:-1]])
    np.testing.assert_array_equal(np.isfinite(metrics["eval_return"]),  # empty cells where nothing was evaluated
                                  expected_steps // config["eval_every"] > previous // config["eval_every"])
    progress_lines = [line for line in stdout.splitlines() if line.startswith("steps ")]
    assert len(progress_lines) == expected_steps.size  # not a terminal: one line per report
    assert f"steps {end:,}/{steps:,}" in progress_lines[-1]
    arrays, meta = load_checkpoint(run.latest_checkpoint())
    assert meta["env_steps"] == end and meta["config"] == saved
    reference = FakeTrainer(FakeTrainConfig.from_dict(saved))
    reference.run()
    assert arrays["params"].tobytes() == reference.params.tobytes()
    assert run.read_summary()["env_steps"] == end
    assert f"run folder {folder}" in stdout
    assert stdout.startswith("setting up: compiling kernels")  # something to read before the first report


def test_the_default_run_folder_is_named_after_env_seed_and_time(tmp_path, rng, fake_trainer, monkeypatch):
    monkeypatch.chdir(tmp_path)
    seed = int(rng.integers(1000))
    assert cli.main(["train", "cartpole", "--steps", "100", "--seed", str(seed)]) == 0
    (folder,) = (tmp_path / "runs").iterdir()
    assert folder.name.startswith(f"cartpole-seed{seed}-") and len(folder.name.split("-")[-1]) == 6
    assert RunFolder(folder).read_config()["seed"] == seed


@pytest.mark.parametrize("interrupt", ["before the first checkpoint", "after some checkpoints"])
def test_an_interrupted_run_resumes_to_the_same_result(tmp_path, rng, fake_trainer, capsys, interrupt):
    flags, config, steps = small_run_config(tmp_path, rng)
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert cli.main(["train", "cartpole", *flags, "--out", str(whole)]) == 0

    # Stopped j iterations past a checkpoint (or the start), j >= 2: rows were
    # written after the checkpoint, which the resumed run must replace, not repeat.
    every = config["checkpoint_every"]
    per_iteration = every // config["iterations_per_checkpoint"]
    last = 0 if interrupt.startswith("before") else every * int(rng.integers(1, steps // every))
    FakeTrainer.stop_at = last + per_iteration * int(rng.integers(2, config["iterations_per_checkpoint"] + 1))
    capsys.readouterr()
    assert cli.main(["train", "cartpole", *flags, "--out", str(parts)]) == cli.EXIT_INTERRUPTED
    line = one_line(capsys.readouterr().err)
    assert f"--resume {parts} continues from" in line
    checkpoint = RunFolder(parts).latest_checkpoint()
    assert (checkpoint is None) == interrupt.startswith("before")
    resumed_from = load_checkpoint(checkpoint)[1]["env_steps"] if checkpoint is not None else None
    FakeTrainer.stop_at = None
    assert cli.main(["train", "cartpole", *flags, "--resume", str(parts)]) == 0

    a, b = RunFolder(whole), RunFolder(parts)
    arrays_a, meta_a = load_checkpoint(a.latest_checkpoint())
    arrays_b, meta_b = load_checkpoint(b.latest_checkpoint())
    end = final_steps(steps, meta_a["config"]["n_envs"])
    assert meta_a["env_steps"] == meta_b["env_steps"] == end and meta_a["config"] == meta_b["config"]
    for name in arrays_a:
        assert arrays_a[name].tobytes() == arrays_b[name].tobytes(), name
    # Same rows as the uninterrupted run: none lost, none repeated (wall time aside).
    assert_tables_equal(b.read_metrics(), a.read_metrics(), [c for c in METRIC_COLUMNS if c != "wall_s"])
    assert np.all(np.diff(b.read_metrics()["wall_s"]) >= 0)
    assert b.read_summary()["resumed_from"] == resumed_from


def test_resume_refuses_a_checkpoint_of_another_run(tmp_path, rng, fake_trainer, capsys):
    folder = a_run_folder(tmp_path)
    other = FakeTrainConfig.for_env("cartpole", seed=int(rng.integers(1, 100))).to_dict()
    save_checkpoint(RunFolder(folder).checkpoint_path(), {"params": np.zeros(37, np.float32)},
                    {"env_steps": 10, "config": other})
    assert cli.main(["train", "cartpole", "--resume", str(folder)]) == 2
    assert "was not written by this run" in one_line(capsys.readouterr().err)


def test_resume_refuses_a_state_the_trainer_cannot_load(tmp_path, fake_trainer, capsys):
    """A checkpoint of this run whose arrays the trainer refuses (here one value short):
    exit 2, and the line says why."""
    folder = a_run_folder(tmp_path)
    save_checkpoint(RunFolder(folder).checkpoint_path(),
                    {"params": np.zeros(36, np.float32), "steps": np.array(10, np.int64)},
                    {"env_steps": 10, "config": FakeTrainConfig.for_env("cartpole").to_dict()})
    assert cli.main(["train", "cartpole", "--resume", str(folder)]) == 2
    line = one_line(capsys.readouterr().err)
    assert f"--resume {folder}: its checkpoint cannot be loaded: checkpoint of another trainer" in line, line


def test_resuming_a_complete_run_leaves_it_as_it_is(tmp_path, rng, fake_trainer, capsys):
    """The run's last checkpoint is at its end: --resume says so, exits 0 and rewrites
    nothing (a run() that had nothing to do would leave no final evaluation in its summary)."""
    flags, _, steps = small_run_config(tmp_path, rng)
    folder = tmp_path / "run"
    assert cli.main(["train", "cartpole", *flags, "--out", str(folder)]) == 0
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    capsys.readouterr()
    assert cli.main(["train", "cartpole", *flags, "--resume", str(folder)]) == 0
    out = capsys.readouterr().out
    end = final_steps(steps, RunFolder(folder).read_config()["n_envs"])
    assert f"{folder} is complete ({end:,} env steps of {steps:,}); nothing to resume" in out, out
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


@pytest.mark.parametrize("where, error, code, message", [
    ("init", ValueError("cluster_forward=True cannot run this net"), 2,
     "invalid training config: cluster_forward=True cannot run this net"),
    ("run", TrainingError("evaluation: only 3 of 8 episodes ended within 550 steps"), 1,
     "training failed: evaluation: only 3 of 8 episodes ended within 550 steps"),
    ("run", OSError(28, "No space left on device"), 1, "No space left on device"),
    ("run", RunFolderError("metrics.csv: not written by drvtrain"), 2, "metrics.csv: not written by drvtrain")])
def test_errors_while_training_exit_with_one_line(tmp_path, rng, fake_trainer, capsys, where, error, code, message):
    """Settings the Trainer refuses together, an evaluation that does not end, a disk that is full, a
    run folder that cannot be written: one line on stderr and the documented exit code, no traceback."""
    flags, _, _ = small_run_config(tmp_path, rng)
    setattr(FakeTrainer, f"raise_in_{where}", error)
    assert cli.main(["train", "cartpole", *flags, "--out", str(tmp_path / "run")]) == code
    line = one_line(capsys.readouterr().err)
    assert message in line, line


def test_a_summary_that_cannot_be_written_leaves_a_run_to_resume(tmp_path, rng, fake_trainer, capsys,
                                                                 monkeypatch):
    """A full disk when the summary is written: one line, exit 1, and the run's final
    checkpoint is not written either, so --resume runs its end again and writes both."""
    flags, _, steps = small_run_config(tmp_path, rng)
    folder = tmp_path / "run"
    write_summary = RunFolder.write_summary

    def full_disk(self, summary):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(RunFolder, "write_summary", full_disk)
    assert cli.main(["train", "cartpole", *flags, "--out", str(folder)]) == cli.EXIT_FAILED
    assert "No space left on device" in one_line(capsys.readouterr().err)
    end = final_steps(steps, RunFolder(folder).read_config()["n_envs"])
    checkpoint = RunFolder(folder).latest_checkpoint()
    assert checkpoint is None or load_checkpoint(checkpoint)[1]["env_steps"] < end
    monkeypatch.setattr(RunFolder, "write_summary", write_summary)
    assert cli.main(["train", "cartpole", *flags, "--resume", str(folder)]) == 0
    assert RunFolder(folder).read_summary()["env_steps"] == end
    assert load_checkpoint(RunFolder(folder).latest_checkpoint())[1]["env_steps"] == end


def test_an_interrupt_before_the_run_starts_says_nothing_was_written(tmp_path, rng, fake_trainer, capsys):
    """Ctrl-C while the trainer is being built (compiling, capturing): no run folder exists yet,
    so the line does not point --resume at it."""
    flags, _, _ = small_run_config(tmp_path, rng)
    FakeTrainer.raise_in_init = KeyboardInterrupt()
    folder = tmp_path / "run"
    assert cli.main(["train", "cartpole", *flags, "--out", str(folder)]) == cli.EXIT_INTERRUPTED
    line = one_line(capsys.readouterr().err)
    assert f"interrupted before the run started; nothing was written to {folder}" in line, line
    assert not RunFolder(folder).holds_run()


# ---------------------------------------------------------------------- the progress line
class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_rewrites_one_line_on_a_terminal(rng):
    stream = Terminal()
    line = cli._ProgressLine(stream, 1000)
    reports = [{"env_steps": int(s), "steps_per_s": 1234.5, "episodes": 7, "mean_return_100": float("nan"),
                "loss": 0.5, "epsilon": 0.25, "eval_return": None} for s in sorted(rng.integers(0, 1000, 5))]
    for report in reports:
        line.show(report)
    assert stream.getvalue().count("\r") == len(reports) and "\n" not in stream.getvalue()
    line.end()
    assert stream.getvalue().endswith("\n")
    piped = io.StringIO()
    line = cli._ProgressLine(piped, 1000)
    for report in reports:
        line.show(report)
    line.end()
    assert "\r" not in piped.getvalue() and piped.getvalue().count("\n") == len(reports)


def test_progress_line_names_every_quantity(rng):
    report = {"env_steps": int(rng.integers(10**6)), "steps_per_s": float(rng.random() * 1e6),
              "episodes": int(rng.integers(10**5)), "mean_return_100": float(rng.normal(100, 10)),
              "loss": float(rng.random()), "epsilon": float(rng.random()), "eval_return": None}
    text = cli.format_progress(report, 10**6)
    assert text.startswith(f"steps {report['env_steps']:,}/1,000,000")
    for part in (f"{report['steps_per_s']:,.0f} steps/s", f"episodes {report['episodes']:,}",
                 f"return(100) {report['mean_return_100']:.2f}", f"loss {report['loss']:.4g}",
                 f"eps {report['epsilon']:.3f}"):
        assert part in text, part
    assert "eval" not in text
    report["eval_return"] = float(rng.normal(100, 10))
    assert cli.format_progress(report, 10**6).endswith(f"eval {report['eval_return']:.2f}")
    report["mean_return_100"] = float("nan")
    assert "return(100) -" in cli.format_progress(report, 10**6)
