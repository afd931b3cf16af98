"""The learning curve of a run folder, drawn with matplotlib (an optional dependency)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .rl.run import RunFolder, RunFolderError

__all__ = ["INSTALL_HINT", "MatplotlibMissing", "plot_run"]

INSTALL_HINT = 'pip install "drvtrain[plot]"'


class MatplotlibMissing(ImportError):
    """Plotting needs matplotlib, which is not installed."""


def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise MatplotlibMissing(f"plotting needs matplotlib ({exc}): {INSTALL_HINT}") from None
    return Figure, FigureCanvasAgg


def plot_run(run_dir, out_png=None) -> Path:
    """Draw the mean return of the last 100 episodes and the greedy evaluation
    return against env steps; write ``out_png`` (default
    ``run_dir/learning_curve.png``) and return its path.

    Raises ``MatplotlibMissing`` without matplotlib and ``RunFolderError`` when
    the folder has no readable metrics.csv or no row in it yet.
    """
    run = RunFolder(run_dir)
    metrics = run.read_metrics()
    steps = metrics["env_steps"]
    if steps.size == 0:
        raise RunFolderError(f"{run.metrics_path()}: no rows yet, nothing to plot")
    Figure, FigureCanvasAgg = _matplotlib()
    out = Path(out_png) if out_png is not None else run.path / "learning_curve.png"
    try:
        config = run.read_config()
        title = f"{config.get('env', '?')}, seed {config.get('seed', '?')}"
    except RunFolderError:
        title = run.path.name

    # The Figure and its Agg canvas directly: no pyplot, so the caller's backend is left alone.
    fig = Figure(figsize=(8, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    train = np.isfinite(metrics["mean_return_100"])
    ax.plot(steps[train], metrics["mean_return_100"][train], label="mean return, last 100 episodes")
    evaluated = np.isfinite(metrics["eval_return"])
    if evaluated.any():
        ax.plot(steps[evaluated], metrics["eval_return"][evaluated], "o-", markersize=3,
                label="greedy evaluation return")
    ax.set_xlabel("env steps")
    ax.set_ylabel("return")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out
