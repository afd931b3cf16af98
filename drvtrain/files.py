"""Writing a file so that readers see the old contents or the new, never a part.

The one mechanism behind the kernel cache, checkpoints and the run folder: a
temporary file in the same folder, then ``os.replace``. It imports nothing
else of drvtrain.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

__all__ = ["atomic_file"]


@contextlib.contextmanager
def atomic_file(path, mode: str = "wb", *, durable: bool = True, **open_args):
    """Yield a file object whose contents replace ``path`` when the block ends without error.

    On an error (also one raised by the replace itself) the temporary file is
    removed and ``path`` keeps what it held. ``durable``: flush to the disk
    before the rename, and make the rename itself durable where the platform
    lets a folder be opened.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode, **open_args) as f:
            yield f
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if durable:
        _fsync_directory(path.parent)


def _fsync_directory(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
