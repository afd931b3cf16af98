"""The run folder: what one training run leaves on disk.

::

    config.json      the TrainConfig, as a dict
    metrics.csv      one row per progress report, header METRIC_COLUMNS, flushed every row
    checkpoint.ckpt  the latest checkpoint (drvtrain.checkpoint), replaced atomically
    summary.json     the trainer's summary, written when the run ends

A resumed run appends to metrics.csv; rows past the checkpoint it resumes from
(written after that checkpoint by the run that stopped) are dropped first, so
the curve never goes back in time.
"""
from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

import numpy as np

from ..files import atomic_file

__all__ = ["METRIC_COLUMNS", "MetricsWriter", "RunFolder", "RunFolderError"]

METRIC_COLUMNS = ("env_steps", "wall_s", "episodes", "mean_return_100", "loss", "epsilon", "eval_return")


class RunFolderError(ValueError):
    """A run folder, or a file in it, that is missing or cannot be read."""


def _write_atomic(path: Path, text: str) -> None:
    with atomic_file(path, "w", encoding="utf-8", newline="") as f:
        f.write(text)


def _cell(value) -> str:
    """One CSV cell: empty for a missing value, integers as integers, floats in full (repr) precision."""
    if value is None:
        return ""
    if isinstance(value, (bool, np.bool_)):
        return str(int(value))
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    return repr(float(value))  # 'nan' and 'inf' read back through float()


class MetricsWriter:
    """Appends rows to metrics.csv; every row is flushed, so a crash loses at most the row being written."""

    def __init__(self, path: Path, *, keep_up_to: int | None = None):
        self.path = path
        self.last_row: dict | None = None
        rows = self._existing_rows(keep_up_to)
        self._file = open(path, "a", encoding="utf-8", newline="")
        self._writer = csv.writer(self._file, lineterminator="\n")
        if rows is None:
            self._writer.writerow(METRIC_COLUMNS)
            self._file.flush()
        elif rows:
            self.last_row = dict(zip(METRIC_COLUMNS, rows[-1]))

    def _existing_rows(self, keep_up_to):
        """The rows already there (None for a new file), after dropping a torn last
        line and, with ``keep_up_to``, every row past that env step."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        if not text:
            return None
        lines = text.split("\n")
        torn = lines[-1] != ""  # the last line never got its newline
        lines = lines[:-1]
        if not lines or tuple(lines[0].split(",")) != METRIC_COLUMNS:
            raise RunFolderError(f"{self.path}: not a drvtrain metrics file (its header is not "
                                 f"{','.join(METRIC_COLUMNS)})")
        rows = [line.split(",") for line in lines[1:]]
        kept = [r for r in rows if len(r) == len(METRIC_COLUMNS)
                and (keep_up_to is None or _number(r[0]) <= keep_up_to)]
        if torn or len(kept) != len(rows):
            _write_atomic(self.path, "\n".join([lines[0], *(",".join(r) for r in kept)]) + "\n")
        return kept

    def write(self, row: dict) -> None:
        """One row from a dict keyed by METRIC_COLUMNS; a missing or None value is an empty cell."""
        cells = [_cell(row.get(name)) for name in METRIC_COLUMNS]
        self._writer.writerow(cells)
        self._file.flush()
        self.last_row = dict(zip(METRIC_COLUMNS, cells))

    def close(self) -> None:
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _number(cell: str) -> float:
    try:
        return float(cell) if cell else math.nan
    except ValueError:
        return math.nan


class RunFolder:
    """One run's folder. Nothing is created until something is written."""

    CONFIG = "config.json"
    METRICS = "metrics.csv"
    CHECKPOINT = "checkpoint.ckpt"
    SUMMARY = "summary.json"

    def __init__(self, path):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunFolder({str(self.path)!r})"

    def _file(self, name: str, *, create: bool = False) -> Path:
        if create:
            self.path.mkdir(parents=True, exist_ok=True)
        return self.path / name

    def holds_run(self) -> bool:
        """Whether a run already wrote here (a config or metrics)."""
        return (self.path / self.CONFIG).exists() or (self.path / self.METRICS).exists()

    # ------------------------------------------------------------------ config and summary
    def write_config(self, config: dict) -> Path:
        return self._write_json(self.CONFIG, config)

    def read_config(self) -> dict:
        return self._read_json(self.CONFIG)

    def write_summary(self, summary: dict) -> Path:
        return self._write_json(self.SUMMARY, summary)

    def read_summary(self) -> dict:
        return self._read_json(self.SUMMARY)

    def _write_json(self, name: str, value: dict) -> Path:
        path = self._file(name, create=True)
        _write_atomic(path, json.dumps(value, indent=2, sort_keys=True, default=_json_default) + "\n")
        return path

    def _read_json(self, name: str) -> dict:
        path = self.path / name
        try:
            value = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise RunFolderError(f"{path}: no such file") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise RunFolderError(f"{path}: cannot be read ({exc})") from None
        except json.JSONDecodeError as exc:
            raise RunFolderError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(value, dict):
            raise RunFolderError(f"{path}: expected a JSON object, got {type(value).__name__}")
        return value

    # ------------------------------------------------------------------ metrics
    def metrics_path(self) -> Path:
        return self.path / self.METRICS

    def metrics_writer(self, *, keep_up_to: int | None = None) -> MetricsWriter:
        """A writer appending to metrics.csv (created with its header when new).

        ``keep_up_to``: when resuming from a checkpoint taken at that env step,
        drop the rows written after it first."""
        return MetricsWriter(self._file(self.METRICS, create=True), keep_up_to=keep_up_to)

    def append_metrics(self, row: dict) -> None:
        """Append one row (opening and closing the file): for writers that report rarely."""
        with self.metrics_writer() as writer:
            writer.write(row)

    def read_metrics(self) -> dict[str, np.ndarray]:
        """metrics.csv as one float64 column per name in METRIC_COLUMNS (NaN for an empty cell)."""
        path = self.metrics_path()
        try:
            with open(path, encoding="utf-8", newline="") as f:
                rows = list(csv.reader(io.StringIO(f.read())))
        except FileNotFoundError:
            raise RunFolderError(f"{path}: no such file") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise RunFolderError(f"{path}: cannot be read ({exc})") from None
        if not rows or tuple(rows[0]) != METRIC_COLUMNS:
            raise RunFolderError(f"{path}: not a drvtrain metrics file (its header is not "
                                 f"{','.join(METRIC_COLUMNS)})")
        body = [r for r in rows[1:] if len(r) == len(METRIC_COLUMNS)]  # a torn last row is skipped
        table = np.array([[_number(c) for c in r] for r in body], np.float64).reshape(len(body),
                                                                                    len(METRIC_COLUMNS))
        return {name: table[:, k].copy() for k, name in enumerate(METRIC_COLUMNS)}

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_path(self) -> Path:
        """Where the next checkpoint goes (the folder is created)."""
        return self._file(self.CHECKPOINT, create=True)

    def latest_checkpoint(self) -> Path | None:
        """The checkpoint to resume from, or None when the run has none yet."""
        path = self.path / self.CHECKPOINT
        return path if path.is_file() else None


def _json_default(value):
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON-serialisable")
