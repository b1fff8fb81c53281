"""The Python tool: code runs in a child ``python -I`` with time, memory and file-size limits,
no network, no processes and no writes outside its own temporary folder.

Layers, from the outside in:

- a network namespace of its own (``unshare --net``, or ``unshare --user --map-root-user
  --net`` without root) when this machine allows one: no interface but loopback;
- resource limits set before the code runs: address space (``--tool-use-memory-mb``), CPU
  seconds, file size (1 MiB) and open files;
- a Python audit hook (PEP 578; it cannot be removed once added) refusing sockets,
  subprocesses, ``fork``/``exec``, calling C functions through ``ctypes`` (loading a library,
  as numpy's import does, is allowed), signals to other processes, raising the
  limits again, and any write, delete or rename outside the working folder;
- a wall-clock time-out in the parent, which kills the child's whole process group.

This is a guard against a policy model's mistakes and reward hacking, not against a
determined attacker with a kernel exploit: run untrusted workloads in a container too.
"""

from __future__ import annotations

import asyncio
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile

__all__ = ["PRELUDE", "network_isolation", "run_python"]

FILE_SIZE_LIMIT = 1 << 20

PRELUDE = r'''
import os, resource, sys
_mem, _cpu, _fsize = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_AS, (_mem, _mem))
resource.setrlimit(resource.RLIMIT_CPU, (_cpu, _cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (_fsize, _fsize))
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
_home = os.path.realpath(os.getcwd()) + os.sep
_refused = ("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
            "os.forkpty", "pty.", "ctypes.dlsym", "ctypes.call_function", "ctypes.cdata", "resource.setrlimit", "resource.prlimit", "os.kill", "os.killpg",
            "signal.pthread_kill", "_posixsubprocess.", "sys.remote_exec", "webbrowser.")
_path_events = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.symlink", "os.link",
                "os.truncate", "shutil.rmtree", "os.utime", "os.removexattr", "os.setxattr", "shutil.move",
                "shutil.copyfile", "shutil.copytree"}
_write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

def _outside(path):
    if isinstance(path, int) or path is None:
        return False
    path = os.fsdecode(path)
    return not os.path.realpath(path).startswith(_home)

def _guard(event, args):
    if event.startswith(_refused):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open":
        path, mode, flags = args
        writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (flags or 0) & _write_flags
        if writes and _outside(path):
            raise PermissionError(f"sandbox: writing {path} is not allowed (only the working folder)")
    elif event in _path_events and any(_outside(a) for a in args[:2] if isinstance(a, (str, bytes, os.PathLike))):
        raise PermissionError(f"sandbox: {event} outside the working folder is not allowed")

sys.addaudithook(_guard)
del _mem, _cpu, _fsize
_code = sys.stdin.read()
sys.argv = ["tool"]
try:
    exec(compile(_code, "<tool>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
except SystemExit:
    raise
except BaseException as _exc:  # the traceback from the tool's own code on, not this prelude's frames
    import traceback
    _tb = _exc.__traceback__
    while _tb is not None and _tb.tb_frame.f_code.co_filename != "<tool>":
        _tb = _tb.tb_next
    sys.stdout.flush()
    sys.stderr.write("".join(traceback.format_exception(type(_exc), _exc, _tb)))
    sys.exit(1)
'''


@functools.lru_cache(maxsize=1)
def network_isolation() -> tuple[str, ...]:
    """The command prefix that gives the child its own network namespace, or ``()`` when
    this machine allows none (the audit hook still refuses sockets)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    for prefix in ((unshare, "--net"), (unshare, "--user", "--map-root-user", "--net")):
        try:
            done = subprocess.run([*prefix, "true"], capture_output=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            continue
        if done.returncode == 0:
            return prefix
    return ()


async def run_python(code: str, timeout_s: float, memory_mb: int, max_chars: int, on_start=None) -> str:
    """Run ``code`` in the sandbox and return what it printed (stdout and stderr, in order).

    :param code: Python source; it reads nothing from stdin.
    :param timeout_s: wall-clock seconds before the child's process group is killed; the
        CPU limit is the same number of seconds, rounded up.
    :param memory_mb: address-space limit of the child in MiB (``MemoryError`` beyond it).
    :param max_chars: the output is cut to its last this many characters (``[cut]...``
        marks it: a traceback's end says what went wrong).
    :param on_start: called with the ``asyncio.subprocess.Process`` once it runs (the
        plugin's ``abort`` hook kills it through this).
    :returns: the output; ``error: timed out after N s`` on a time-out, and the exit code
        appended when the child failed without printing why.
    """
    with tempfile.TemporaryDirectory(prefix="furlong-tool-") as home:
        command = [*network_isolation(), sys.executable, "-I", "-c", PRELUDE,
                   str(memory_mb << 20), str(max(1, int(-(-timeout_s // 1)))), str(FILE_SIZE_LIMIT)]
        proc = await asyncio.create_subprocess_exec(
            *command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, cwd=home, start_new_session=True,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": home, "LANG": "C.UTF-8"})
        if on_start is not None:
            on_start(proc)
        try:
            out, _ = await asyncio.wait_for(proc.communicate(code.encode()), timeout_s)
        except asyncio.TimeoutError:
            kill(proc)
            await proc.wait()
            return f"error: timed out after {timeout_s:g} s"
        finally:
            if proc.returncode is None:  # cancelled: never leave the child behind
                kill(proc)
        text = out.decode("utf-8", errors="replace")
        if proc.returncode == -signal.SIGXCPU:  # its CPU-time limit (the time-out) ended it before our clock did
            return f"error: timed out after {timeout_s:g} s"
        if proc.returncode and not text.strip():
            text = f"error: exit code {proc.returncode}"
        return text if len(text) <= max_chars else "[cut]..." + text[-max_chars:]


def kill(proc) -> None:
    """Kill the child's whole process group (it is its own session leader)."""
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
