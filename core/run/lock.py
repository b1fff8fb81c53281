"""One run per output folder: the lock a run holds on its ``--save`` (else ``--log-dir``) folder.

Two runs writing the same folder would interleave their ``metrics.jsonl`` and overwrite each
other's checkpoints. A run takes ``DIR/furlong.lock`` before anything loads: the file is created
exclusively (``O_CREAT | O_EXCL``, so two runs started at once cannot both get it) and names the
holder (pid, host, start time). A second run finds it and stops with one error naming the holder;
a lock whose process is gone (same host, pid not running, or running but started after the lock
was written: a reused pid) is taken over with a warning. The run removes its lock when it ends,
however it ends (a SIGKILL leaves it, and the next run takes it over).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time

from furlong.hooks import PluginError, RunConfig

__all__ = ["LOCK_NAME", "RunLock", "lock_output_folders", "output_folders"]

log = logging.getLogger("furlong")

LOCK_NAME = "furlong.lock"


def output_folders(config: RunConfig) -> list[tuple[str, str]]:
    """``(flag, folder)`` of the folder this run writes its outputs to: ``--save``, else ``--log-dir``
    (``metrics.jsonl``, loggers' files and checkpoints go there), or none. A path that exists and is not
    a folder is left out (the path checks of :func:`furlong.core.run.preflight.check_paths` report it)."""
    for flag, folder in (("--save", config.save), ("--log-dir", config.log_dir)):
        if folder:
            return [(flag, folder)] if os.path.isdir(folder) or not os.path.exists(folder) else []
    return []


def lock_output_folders(config: RunConfig) -> list["RunLock"]:
    """Take the lock of every output folder of the run (:func:`output_folders`).

    :returns: the locks taken; release each with :meth:`RunLock.release`.
    :raises PluginError: a folder is held by a live run (the message names flag, folder and holder);
        the locks already taken are released first.
    """
    taken: list[RunLock] = []
    try:
        for flag, folder in output_folders(config):
            lock = RunLock(folder, flag)
            lock.acquire()
            taken.append(lock)
    except BaseException:
        for lock in taken:
            lock.release()
        raise
    return taken


def _process_start(pid: int) -> float | None:
    """Seconds since the epoch at which process ``pid`` started (Linux ``/proc``), or None when unknown."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/stat", encoding="ascii") as f:
            boot = next(float(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _running(pid: int) -> bool:
    """Is a process with id ``pid`` running on this host (one of another user's counts)?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


class RunLock:
    """The lock file ``<folder>/furlong.lock`` of one output folder (``flag`` names it in messages)."""

    def __init__(self, folder: str, flag: str = "--save"):
        self.folder = folder
        self.flag = flag
        self.path = os.path.join(folder, LOCK_NAME)
        self.held = False
        self.created_folder = False

    def acquire(self) -> None:
        """Create the lock, taking over a stale one (with a warning).

        :raises PluginError: a live run holds it, or it names another host (whose processes
            cannot be checked from here).
        """
        if not os.path.isdir(self.folder):
            os.makedirs(self.folder, exist_ok=True)
            self.created_folder = True
        for _ in range(3):  # a stale lock removed here may be taken by another run first: try again
            if self._create():
                self.held = True
                return
            holder = self._read()
            if holder is None:  # written by a run that is starting right now, or unreadable
                time.sleep(0.2)
                holder = self._read()
            problem = self._held_by(holder)
            if problem:
                raise PluginError(problem)
            log.warning("%s %s: taking over the lock of a run that is gone (%s); its outputs stay in the folder.",
                        self.flag, self.folder, _describe(holder))
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass
        raise PluginError(f"{self.flag} '{self.folder}': another run keeps taking its lock {self.path}; "
                          "choose another folder.")

    def busy(self) -> str | None:
        """Why a run cannot use the folder now (a live run holds its lock, or the lock names no run), else None.

        For scripts that move or clear an output folder before a run: they must not pull it
        from under a run that is writing it.
        """
        if not os.path.exists(self.path):
            return None
        return self._held_by(self._read()) or None

    def release(self) -> None:
        """Remove the lock if this process still holds it, and the folder when the lock created it and the
        run wrote nothing there (a run stopped by an error before it wrote anything leaves no empty folder)."""
        if not self.held:
            return
        self.held = False
        holder = self._read()
        if holder is not None and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass
        if self.created_folder:
            try:
                os.rmdir(self.folder)
            except OSError:  # it holds the run's outputs
                pass

    def _create(self) -> bool:
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                  "process_start": _process_start(os.getpid())}
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(record, f)
            f.write("\n")
        return True

    def _read(self) -> dict | None:
        try:
            with open(self.path, encoding="utf-8") as f:
                record = json.load(f)
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) else None

    def _held_by(self, holder: dict | None) -> str:
        """Why the lock cannot be taken over ("" when its holder is gone)."""
        if holder is None or not isinstance(holder.get("pid"), int) or isinstance(holder.get("pid"), bool):
            return (f"{self.flag} '{self.folder}': {self.path} exists but does not say which run holds it; if no run "
                    "writes this folder, delete that file.")
        if holder.get("host") != socket.gethostname():
            return (f"{self.flag} '{self.folder}': another run writes this folder ({_describe(holder)}); wait for it to "
                    f"end or choose another {self.flag}. If that run is gone, delete {self.path}.")
        if not _alive(holder):
            return ""
        return (f"{self.flag} '{self.folder}': another run writes this folder ({_describe(holder)}); wait for it to end "
                f"or choose another {self.flag}.")


def _alive(holder: dict) -> bool:
    """The lock's process still runs on this host (not a later process that reuses its pid)."""
    pid = holder["pid"]
    if pid == os.getpid() or not _running(pid):
        return False
    recorded, now = holder.get("process_start"), _process_start(pid)
    return recorded is None or now is None or abs(now - recorded) < 2.0


def _describe(holder: dict) -> str:
    started = holder.get("started")
    when = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else ""
    return f"pid {holder.get('pid')} on host {holder.get('host')}{when}"
