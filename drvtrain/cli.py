"""The ``drvtrain`` command line."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import textwrap
import time
from pathlib import Path

import numpy as np

from . import __version__

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_NO_DEVICE = 2
EXIT_INTERRUPTED = 130

# The environments the trainer knows: the help text's list (building the parser
# imports nothing of drvtrain.rl, so --help and doctor survive a broken install),
# and the answer when drvtrain.rl.env, the registry make_env reads, cannot be
# imported. A CPU test keeps it equal to the registry.
KNOWN_ENVS = ("cartpole",)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _fail(message: str, code: int) -> int:
    print(f"drvtrain: {message}", file=sys.stderr)
    return code


def doctor(args) -> int:
    from .compiler import CompileError, compile_file, default_cache, kernel_files
    from .driver import NoDeviceError, driver_version, get_device, nvrtc_version

    print(f"drvtrain {__version__}")
    print(f"nvrtc        {'.'.join(map(str, nvrtc_version()))}")
    try:
        major, minor = driver_version()
        dev = get_device(args.device)
    except NoDeviceError as exc:
        return _fail(str(exc), EXIT_NO_DEVICE)
    except ValueError as exc:  # an ordinal the machine does not have
        return _fail(f"--device {args.device}: {exc}", EXIT_NO_DEVICE)
    lim = dev.limits
    print(f"driver       CUDA {major}.{minor}")
    print(f"device {dev.ordinal}     {dev.name}, {dev.arch}, {dev.sm_count} SMs, L2 {_mib(dev.l2_bytes)}, "
          f"shared/block {lim.max_shared_per_block // 1024} KiB "
          f"({lim.max_shared_per_block_optin // 1024} KiB opt-in), memory {dev.total_memory / 2**30:.1f} GiB")

    cache = default_cache()
    print(f"kernels      cache {cache.directory}")
    for path in kernel_files():
        try:
            prog = compile_file(path, arch=dev.arch)
        except CompileError as exc:
            first = next((line for line in exc.log.splitlines() if "error" in line), exc.log.strip()[:200])
            return _fail(f"NVRTC could not compile {exc.filename}: {first.strip()}", 1)
        print(f"  {path.name:<20} {'hit ' if prog.cache_hit else 'miss'} {prog.millis:8.1f} ms")
    if not cache.writable:
        print("  (cache not writable: compiled without caching)")

    from .demo import ForkJoinDemo, arena_check, mapped_readback
    failures = 0

    def report(name: str, ok: bool, detail: str) -> None:
        nonlocal failures
        failures += not ok
        print(f"  {name:<18} {'ok  ' if ok else 'FAIL'} {detail}")

    print("self-check")
    a = arena_check()
    report("arena", a.first == a.second and a.aligned,
           f"3 allocations, same addresses after reset, 256-byte aligned, high water {a.high_water} B")
    got = mapped_readback(4096)
    report("mapped readback", bool(np.array_equal(got, np.arange(4096, dtype=np.float32))),
           "4096 floats written by a kernel into mapped memory, read after Event.query()")
    demo = ForkJoinDemo(1 << 16)
    graph = demo.record()
    exe = graph.instantiate()
    replays = 10
    for _ in range(replays):
        exe.launch(demo.main)
    demo.main.synchronize()
    result = demo.out.to_numpy()
    side = demo.scale_nodes(graph)
    concurrent = len(side) == 2 and graph.can_run_concurrently(*side)
    report("fork/join graph", bool(np.array_equal(result, demo.expected())) and concurrent,
           f"{len(graph.nodes())} nodes, branches concurrent: {concurrent}, {replays} replays, result checked")
    exe.close()
    graph.close()
    demo.close()
    print("all checks passed" if not failures else f"{failures} check(s) FAILED")
    return 1 if failures else 0



# ---------------------------------------------------------------------- train
def _known_envs() -> tuple[str, ...]:
    """The registered device environments; KNOWN_ENVS where the registry cannot be imported."""
    try:
        from .rl.env import known_envs
    except ImportError:
        return KNOWN_ENVS
    return tuple(sorted(known_envs()))


def _read_overrides(path: str) -> dict:
    """The --config file: a JSON object of TrainConfig fields."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"--config {path}: cannot be read ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise ValueError(f"--config {path}: not a UTF-8 text file") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--config {path}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"--config {path}: expected a JSON object of training config fields, "
                         f"got {type(value).__name__}")
    return value


def _plain(value):
    """A JSON round trip, so configs compare as they are stored (tuples become lists)."""
    def default(v):
        if isinstance(v, np.generic):
            return v.item()
        raise TypeError(f"{type(v).__name__} is not JSON-serialisable")
    return json.loads(json.dumps(value, default=default))


def _make_config(TrainConfig, overrides: dict):
    """The environment's defaults (``TrainConfig.for_env``) with ``overrides``."""
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} "
                         f"(known: {', '.join(sorted(known))})")
    rest = dict(overrides)
    return TrainConfig.for_env(rest.pop("env"), **rest)


def _differences(saved, wanted, prefix="") -> list[str]:
    out = []
    for key in sorted(set(saved) | set(wanted)):
        a, b = saved.get(key, "<unset>"), wanted.get(key, "<unset>")
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key} {json.dumps(a)} (saved) vs {json.dumps(b)}")
    return out


def _require_device() -> None:
    """Raises NoDeviceError when there is no CUDA driver or GPU."""
    from .driver import get_device
    get_device()


def _number(value, spec: str) -> str:
    if value is None:
        return "-"
    try:
        value = float(value)
    except (TypeError, ValueError):
        return "-"
    return "-" if value != value else format(value, spec)


def format_progress(progress: dict, total_steps: int) -> str:
    """The one-line progress report."""
    line = (f"steps {int(progress.get('env_steps', 0)):,}/{total_steps:,}"
            f"  {_number(progress.get('steps_per_s'), ',.0f')} steps/s"
            f"  episodes {_number(progress.get('episodes'), ',.0f')}"
            f"  return(100) {_number(progress.get('mean_return_100'), '.2f')}"
            f"  loss {_number(progress.get('loss'), '.4g')}"
            f"  eps {_number(progress.get('epsilon'), '.3f')}")
    if progress.get("eval_return") is not None:
        line += f"  eval {_number(progress['eval_return'], '.2f')}"
    return line


class _ProgressLine:
    """Rewrites one line in place on a terminal; prints one line per report otherwise (logs, pipes)."""

    def __init__(self, stream, total_steps: int):
        self.stream, self.total = stream, total_steps
        self.tty = stream.isatty()
        self.width = 0

    def show(self, progress: dict) -> None:
        line = format_progress(progress, self.total)
        if self.tty:
            self.stream.write("\r" + line.ljust(self.width))
            self.width = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def end(self) -> None:
        if self.tty and self.width:
            self.stream.write("\n")
            self.stream.flush()
            self.width = 0


def train(args) -> int:
    from .checkpoint import CheckpointError, load_checkpoint
    from .rl.run import RunFolder, RunFolderError

    envs = _known_envs()
    if args.env not in envs:
        return _fail(f"unknown environment {args.env!r} (known: {', '.join(envs)})", EXIT_BAD_INPUT)
    for flag, value, low in (("--envs", args.envs, 1), ("--steps", args.steps, 1),
                             ("--eval-episodes", args.eval_episodes, 1), ("--seed", args.seed, 0)):
        if value is not None and value < low:
            return _fail(f"{flag} must be >= {low}, got {value}", EXIT_BAD_INPUT)
    overrides = {}
    if args.config is not None:
        try:
            overrides = _read_overrides(args.config)
        except ValueError as exc:
            return _fail(str(exc), EXIT_BAD_INPUT)
    overrides["env"] = args.env
    for field, value in (("n_envs", args.envs), ("total_steps", args.steps), ("seed", args.seed),
                         ("eval_episodes", args.eval_episodes)):
        if value is not None:
            overrides[field] = value
    saved = None
    if args.resume is not None:
        run = RunFolder(args.resume)
        if not run.path.is_dir():
            return _fail(f"--resume {args.resume}: no such folder", EXIT_BAD_INPUT)
        try:
            saved = run.read_config()
        except RunFolderError as exc:
            return _fail(f"--resume {args.resume}: not a run folder ({exc})", EXIT_BAD_INPUT)

    try:
        from .rl.trainer import TrainConfig, Trainer
    except ImportError as exc:
        return _fail(f"train needs drvtrain.rl.trainer, which cannot be imported ({exc})", EXIT_FAILED)
    try:
        config = _make_config(TrainConfig, overrides)
    except (TypeError, ValueError) as exc:
        where = f"--config {args.config}: " if args.config is not None else ""
        return _fail(f"{where}invalid training config: {str(exc).splitlines()[0]}", EXIT_BAD_INPUT)
    config_dict = _plain(config.to_dict())

    arrays = meta = None
    if saved is not None:
        try:
            saved_dict = _plain(TrainConfig.from_dict(saved).to_dict())
        except (TypeError, ValueError, KeyError) as exc:
            return _fail(f"--resume {args.resume}: its config.json is not a valid training config "
                         f"({str(exc).splitlines()[0]})", EXIT_BAD_INPUT)
        diff = _differences(saved_dict, config_dict)
        if diff:
            more = f" and {len(diff) - 3} more" if len(diff) > 3 else ""
            return _fail(f"--resume {args.resume}: the run there has another config ({'; '.join(diff[:3])}{more}); "
                         "pass the flags and --config it was started with", EXIT_BAD_INPUT)
        checkpoint = run.latest_checkpoint()
        if checkpoint is not None:
            try:
                arrays, meta = load_checkpoint(checkpoint)
            except CheckpointError as exc:
                return _fail(f"--resume {args.resume}: {exc}", EXIT_BAD_INPUT)
            if _plain(meta.get("config")) != config_dict or not isinstance(meta.get("env_steps"), int):
                return _fail(f"--resume {args.resume}: checkpoint {checkpoint} was not written by this run",
                             EXIT_BAD_INPUT)
            if meta["env_steps"] >= config.total_steps:  # the run's last checkpoint: its summary stays
                print(f"{run.path} is complete ({meta['env_steps']:,} env steps of {config.total_steps:,}); "
                      "nothing to resume")
                return 0
    else:
        out = args.out if args.out is not None else \
            Path("runs") / f"{config.env}-seed{config.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
        run = RunFolder(out)
        if run.path.exists() and not run.path.is_dir():
            return _fail(f"--out {out}: exists and is not a folder", EXIT_BAD_INPUT)
        if run.holds_run():
            return _fail(f"--out {out}: already holds a run; continue it with --resume {out}", EXIT_BAD_INPUT)

    from .driver import NoDeviceError
    try:
        _require_device()
    except NoDeviceError as exc:
        return _fail(str(exc), EXIT_NO_DEVICE)
    return _run_training(Trainer, config, config_dict, run, arrays, meta, resuming=saved is not None)


def _run_training(Trainer, config, config_dict, run, arrays, meta, *, resuming: bool) -> int:
    from .checkpoint import save_checkpoint
    from .compiler import CompileError
    from .driver import DriverError, NoDeviceError
    from .rl.dqn import TrainingError
    from .rl.run import RunFolderError
    from .rl.sumtree import ReplayError

    start_steps = meta["env_steps"] if meta else 0
    wall_offset = float(meta.get("wall_s", 0.0)) if meta else 0.0
    every = int(getattr(config, "checkpoint_every", 0) or 0)
    state = {"saved_at": start_steps if meta else None, "env_steps": start_steps, "wall_s": wall_offset}
    printer = _ProgressLine(sys.stdout, config.total_steps)
    started = time.perf_counter()
    writer = None

    def checkpoint(env_steps: int, wall_s: float) -> None:
        save_checkpoint(run.checkpoint_path(), trainer.state_arrays(),
                        {"env_steps": int(env_steps), "wall_s": wall_s, "config": config_dict,
                         "drvtrain": __version__})
        state["saved_at"] = int(env_steps)

    def on_progress(progress: dict) -> None:
        steps = int(progress["env_steps"])
        wall = wall_offset + time.perf_counter() - started
        state.update(env_steps=steps, wall_s=wall)
        writer.write({**progress, "wall_s": round(wall, 3)})
        printer.show(progress)
        # At the end the checkpoint waits for the summary (below), so that a run whose last
        # checkpoint is at its end always has its summary.
        if every and steps < config.total_steps and steps // every > (state["saved_at"] or 0) // every:
            checkpoint(steps, wall)

    trainer = None
    try:
        # The trainer writes nothing itself: this command owns the run folder.
        print("setting up: compiling kernels (a minute on a cold cache) and capturing the graphs", flush=True)
        try:
            trainer = Trainer(config)
        except ValueError as exc:  # settings that each pass their own check but not together
            return _fail(f"invalid training config: {str(exc).splitlines()[0]}", EXIT_BAD_INPUT)
        if arrays is not None:
            try:
                trainer.load_state_arrays(arrays)
            except (KeyError, ValueError) as exc:
                return _fail(f"--resume {run.path}: its checkpoint cannot be loaded: {str(exc).splitlines()[0]}",
                             EXIT_BAD_INPUT)
            print(f"resuming {run.path} from {start_steps:,} env steps")
        elif resuming:
            print(f"{run.path} has no checkpoint yet: starting it again from step 0")
        run.write_config(config_dict)
        writer = run.metrics_writer(keep_up_to=start_steps if resuming else None)
        summary = trainer.run(on_progress)
        wall = wall_offset + time.perf_counter() - started
        final_steps = int(summary.get("env_steps", state["env_steps"])) if isinstance(summary, dict) \
            else state["env_steps"]
        # The summary first, the final checkpoint last: --resume finds a run complete only
        # once both are written, and otherwise runs its end again and rewrites the summary.
        printer.end()
        run.write_summary({**(summary if isinstance(summary, dict) else {}), "wall_s": round(wall, 3),
                           "env_steps": final_steps, "run_dir": str(run.path),
                           "resumed_from": start_steps if meta else None})
        if state["saved_at"] != final_steps:
            checkpoint(final_steps, wall)
    except KeyboardInterrupt:
        printer.end()
        if not run.holds_run():  # stopped while the trainer was being built, before the config was written
            return _fail(f"interrupted before the run started; nothing was written to {run.path}", EXIT_INTERRUPTED)
        saved = state["saved_at"]
        where = f"the checkpoint at {saved:,} env steps" if saved is not None else "step 0 (no checkpoint yet)"
        return _fail(f"interrupted at {state['env_steps']:,} env steps; --resume {run.path} continues from "
                     f"{where}", EXIT_INTERRUPTED)
    except NoDeviceError as exc:
        printer.end()
        return _fail(str(exc), EXIT_NO_DEVICE)
    except (TrainingError, ReplayError, DriverError) as exc:
        printer.end()
        return _fail(f"training failed: {str(exc).splitlines()[0]}", EXIT_FAILED)
    except CompileError as exc:
        printer.end()
        return _fail(f"NVRTC could not compile {exc.filename}", EXIT_FAILED)
    except RunFolderError as exc:  # e.g. a metrics.csv that another program rewrote
        printer.end()
        return _fail(f"{run.path}: {str(exc).splitlines()[0]}", EXIT_BAD_INPUT)
    except OSError as exc:  # a checkpoint, metrics row or summary that could not be written: a full disk, say
        printer.end()
        return _fail(f"{run.path}: {exc}", EXIT_FAILED)
    finally:
        if writer is not None:
            writer.close()
        if trainer is not None and callable(getattr(trainer, "close", None)):
            trainer.close()
    print(f"done: {final_steps:,} env steps in {wall:,.1f} s; run folder {run.path}")
    return 0


# ---------------------------------------------------------------------- plot
def plot(args) -> int:
    from .plot import MatplotlibMissing, plot_run
    from .rl.run import RunFolderError

    if not Path(args.run).is_dir():
        return _fail(f"{args.run}: no such run folder", EXIT_BAD_INPUT)
    try:
        out = plot_run(args.run, args.out)
    except MatplotlibMissing as exc:
        return _fail(str(exc).splitlines()[0], EXIT_FAILED)
    except RunFolderError as exc:
        return _fail(str(exc).splitlines()[0], EXIT_BAD_INPUT)
    except OSError as exc:
        return _fail(f"cannot write {args.out or 'the plot'}: {exc.strerror or exc}", EXIT_FAILED)
    print(out)
    return 0


# ---------------------------------------------------------------------- parser
class _Parser(argparse.ArgumentParser):
    """Usage errors as one line on stderr (exit 2), like every other bad input."""

    def error(self, message):
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: {message} (see {self.prog} --help)\n")


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Option help wrapped at spaces only, so a path like runs/ENV-seedS-... stays whole."""

    def _split_lines(self, text, width):
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


_TRAIN_EPILOG = """\
The run folder gets config.json, metrics.csv (one row per progress report),
checkpoint.ckpt (every checkpoint_every env steps and at the end) and
summary.json. Every iteration steps all --envs envs, so a run ends at the
first multiple of --envs at or past --steps. --resume continues a run from
its checkpoint: ENV, the flags and --config must give the config the run was
started with; a run that is complete is left as it is.

exit codes:
  0    the run finished (or --resume found it complete)
  1    training failed (a skipped step, a driver or compile error, an
       evaluation whose episodes did not end, a run folder that cannot be
       written), or drvtrain.rl.trainer cannot be imported
  2    bad input (an unknown ENV, --envs/--steps/--eval-episodes < 1, an
       unreadable or invalid --config, settings that do not go together, an
       --out folder that holds a run, a --resume folder that does not exist,
       holds another config, a damaged checkpoint or metrics.csv), or no CUDA
       driver/GPU found
  130  interrupted; --resume continues from the last checkpoint
"""

_PLOT_EPILOG = """\
exit codes:
  0    the plot was written (its path is printed)
  1    matplotlib is not installed (pip install "drvtrain[plot]"), or the
       PNG cannot be written
  2    RUN is not a run folder or its metrics.csv has no rows
"""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="drvtrain",
        description="GPU-resident training over the raw CUDA driver API.")
    parser.add_argument("--version", action="version", version=f"drvtrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("doctor", help="check the driver, NVRTC, kernel compilation and the device",
                       description="Print the driver, NVRTC and device; compile every kernel "
                                   "(cache hit or miss, milliseconds); run a short self-check. "
                                   "Exits 2 when no CUDA driver or GPU is found, 1 when a check fails.")
    p.add_argument("--device", type=int, default=0, help="device ordinal (default 0)")
    p.set_defaults(func=doctor)

    p = sub.add_parser("train", help="train a DQN agent on a device environment",
                       formatter_class=_HelpFormatter, epilog=_TRAIN_EPILOG,
                       description="Train a dueling Double-DQN agent entirely on the GPU, printing "
                                   "progress and writing a run folder.")
    p.add_argument("env", metavar="ENV", help=f"environment name (known: {', '.join(KNOWN_ENVS)})")
    p.add_argument("--envs", type=int, metavar="N",
                   help="environments stepped in parallel (default: the config's n_envs, 10)")
    p.add_argument("--steps", type=int, metavar="N",
                   help="total env steps (default: the config's total_steps, 500000)")
    p.add_argument("--seed", type=int, metavar="S", help="random seed, >= 0 (default: the config's seed, 0)")
    p.add_argument("--config", metavar="FILE",
                   help="JSON object of training config fields to override (the flags above override it)")
    p.add_argument("--eval-episodes", type=int, metavar="N",
                   help="greedy episodes per evaluation (default: the config's eval_episodes, 100)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--out", metavar="DIR",
                       help="run folder to create (default: runs/ENV-seedS-YYYYmmdd-HHMMSS)")
    where.add_argument("--resume", metavar="DIR", help="continue the run in this folder from its checkpoint")
    p.set_defaults(func=train)

    p = sub.add_parser("plot", help="draw a run's learning curve to a PNG",
                       formatter_class=_HelpFormatter, epilog=_PLOT_EPILOG,
                       description="Draw the mean return of the last 100 episodes and the greedy "
                                   "evaluation return against env steps, from RUN/metrics.csv. "
                                   "Needs matplotlib.")
    p.add_argument("run", metavar="RUN", help="a run folder written by drvtrain train")
    p.add_argument("--out", metavar="PNG", help="the image to write (default: RUN/learning_curve.png)")
    p.set_defaults(func=plot)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
