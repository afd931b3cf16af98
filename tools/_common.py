"""The preamble every script in ``tools/`` shares: its parser, the checkout on
``sys.path``, and how a missing GPU or a failed compilation ends the program.

A tool is written like this (``import _common`` comes before any drvtrain import,
since importing it is what puts this checkout's drvtrain on ``sys.path``)::

    \"\"\"One line that becomes the --help description.

    The rest of the docstring is for the reader.
    \"\"\"
    import sys

    import _common
    from drvtrain import get_device

    def main(argv=None) -> int:
        parser = _common.tool_parser(__doc__)   # has --device already
        parser.add_argument("--replays", type=int, default=200, help="... (default 200)")
        args = parser.parse_args(argv)          # also selects the --device GPU
        dev = get_device()                      # NoDeviceError may escape: run() reports it
        ...
        return 0

    if __name__ == "__main__":
        sys.exit(_common.run(main))

The API:

``tool_parser(doc, *, device=True) -> ToolParser``
    An ``argparse.ArgumentParser`` whose description is the first line of ``doc``
    and which, unless ``device=False``, has ``--device N`` (default 0).

``ToolParser.parse_args(argv=None)``
    Parses as argparse does, then makes the ``--device`` GPU the only visible one
    (``select_device``). drvtrain's objects all use device 0 of the process, so a
    GPU is chosen by narrowing ``CUDA_VISIBLE_DEVICES`` before the driver starts.

``select_device(ordinal)``
    Narrows ``CUDA_VISIBLE_DEVICES`` to the ``ordinal``-th visible GPU; 0 leaves it
    as it is. Raises ValueError when fewer GPUs are listed. It takes effect only
    before the process's first GPU call.

``run(main, argv=None, *, name=None) -> int``
    Calls ``main(argv)`` and returns its exit code. ``NoDeviceError`` becomes one
    line ``<name>: no CUDA driver/GPU found (...)`` on stderr and exit code 2;
    ``CompileError`` becomes one line naming the file and NVRTC's first error, and
    exit code 1. No traceback for either. ``name`` defaults to the stem of the
    file that defines ``main``.

``EXIT_NO_DEVICE`` (2) and ``EXIT_COMPILE_ERROR`` (1): those exit codes.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# A checkout's drvtrain comes first, so a tool measures the code beside it even
# when another copy is installed.
if (ROOT / "drvtrain" / "__init__.py").is_file() and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from drvtrain import CompileError, NoDeviceError  # noqa: E402  (needs the path above)

__all__ = ["EXIT_COMPILE_ERROR", "EXIT_NO_DEVICE", "ROOT", "ToolParser", "run", "select_device",
           "tool_parser"]

EXIT_NO_DEVICE = 2
EXIT_COMPILE_ERROR = 1


def select_device(ordinal: int) -> None:
    """Make the ``ordinal``-th visible GPU the process's only one (device 0)."""
    if ordinal < 0:
        raise ValueError(f"--device {ordinal}: a device ordinal is >= 0")
    if ordinal == 0:
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(ordinal)
        return
    listed = [v.strip() for v in visible.split(",") if v.strip()]
    if ordinal >= len(listed):
        raise ValueError(f"--device {ordinal}: CUDA_VISIBLE_DEVICES={visible!r} lists {len(listed)} GPU(s)")
    os.environ["CUDA_VISIBLE_DEVICES"] = listed[ordinal]


class ToolParser(argparse.ArgumentParser):
    """An ArgumentParser whose ``parse_args`` also applies ``--device``, and whose usage
    errors are one line on stderr (exit 2), as every other error of a tool."""

    def error(self, message):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):
        parsed = super().parse_args(args, namespace)
        ordinal = getattr(parsed, "device", None)
        if ordinal is not None:
            try:
                select_device(ordinal)
            except ValueError as exc:
                self.error(str(exc))
        return parsed


def tool_parser(doc: str, *, device: bool = True) -> ToolParser:
    """A parser described by the first line of ``doc``, with ``--device`` unless ``device=False``."""
    parser = ToolParser(description=doc.strip().splitlines()[0] if doc and doc.strip() else None)
    if device:
        parser.add_argument("--device", type=int, default=0, metavar="N",
                            help="GPU to run on, an index into the visible GPUs (default 0)")
    return parser


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _first_error(log: str) -> str:
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for line in lines:
        if "error" in line.lower():
            return line
    return lines[0] if lines else "no log"


def run(main, argv=None, *, name: str | None = None) -> int:
    """``main(argv)``'s exit code; a missing GPU or a failed compilation as one line on stderr."""
    if name is None:
        module = sys.modules.get(main.__module__)
        file = getattr(module, "__file__", None)
        name = Path(file).stem if file else main.__module__
    try:
        return main(argv)
    except NoDeviceError as exc:
        print(f"{name}: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_NO_DEVICE
    except CompileError as exc:
        print(f"{name}: NVRTC failed to compile {exc.filename}: {_one_line(_first_error(exc.log))}",
              file=sys.stderr)
        return EXIT_COMPILE_ERROR
