"""Where the sglang engine writes weight buckets for ``/update_weights_from_disk``, and their removal.

Each engine gets ``<tmp>/furlong-sglang-weights-<uid>/<pid>-<engine index>-<random>/``. It
is removed when the engine shuts down and at interpreter exit (a normal end, an error,
SIGTERM); a run killed with SIGKILL leaves it, and the next run that writes weights there
removes every directory whose process is gone.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

__all__ = ["new_weights_dir", "remove_weights_dir", "weights_root"]

_OWNED: set[str] = set()


def weights_root() -> str:
    """The directory holding every engine's weight directory (one per user)."""
    return os.path.join(tempfile.gettempdir(), f"furlong-sglang-weights-{os.getuid()}")


def new_weights_dir(index: int) -> str:
    """A fresh directory for engine ``index``'s buckets; leftovers of dead processes are removed first."""
    root = weights_root()
    os.makedirs(root, mode=0o700, exist_ok=True)
    _remove_stale(root)
    path = tempfile.mkdtemp(prefix=f"{os.getpid()}-{index}-", dir=root)
    _OWNED.add(path)
    return path


def remove_weights_dir(path: str) -> None:
    """Remove one engine's directory, and the per-user root with it once no engine uses it."""
    shutil.rmtree(path, ignore_errors=True)
    _OWNED.discard(path)
    try:
        os.rmdir(os.path.dirname(path))
    except OSError:  # another engine's directory is still there
        pass


def _remove_stale(root: str) -> None:
    for name in os.listdir(root):
        pid = name.split("-", 1)[0]
        path = os.path.join(root, name)
        if pid.isdigit() and not _alive_since(int(pid), path):
            shutil.rmtree(path, ignore_errors=True)


def _alive_since(pid: int, path: str) -> bool:
    """Process ``pid`` runs and is older than ``path`` (a newer one only reuses the number)."""
    import psutil

    try:
        return psutil.Process(pid).create_time() <= os.stat(path).st_mtime + 1.0
    except (psutil.NoSuchProcess, psutil.AccessDenied, FileNotFoundError):
        return False


@atexit.register
def _remove_owned() -> None:
    for path in list(_OWNED):
        remove_weights_dir(path)
