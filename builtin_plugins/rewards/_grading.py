"""Math answer equivalence: a fast normalized-string check, then math-verify in a worker process.

math-verify (Hugging Face, https://github.com/huggingface/Math-Verify) parses both answers
with sympy and compares them (``\\frac{2}{4}`` = ``0.5``, ``1,000`` = ``1000``, ``x=5`` = ``5``).
Its own time-out uses ``signal.alarm``, which only works in a main thread, and sympy can
run for minutes on inputs like ``10^{10^{10}}``. So the comparison runs in one worker
process (a plain ``python`` subprocess: no ``fork`` next to torch's threads, no re-import
of the parent's ``__main__``) under furlong's own time-out: an ``ITIMER_REAL`` alarm inside
the worker, and the parent kills and restarts the worker if even that does not return (a
long C-level computation). A timed-out comparison counts as "not equal" and is counted in
:func:`grading_stats`.

The worker starts in the grading thread at the first asynchronous grading call of a process
(:func:`equivalent_many_async`, which every reward plugin's ``reward`` goes through), whether or
not that call needs it: its start-up (a Python process importing sympy, about a second) then
overlaps the run's first rollouts instead of stalling the rollout whose answers first need
math-verify. It is reused by every later call, recreated after a kill or in a forked child,
and shut down at interpreter exit (or when its parent dies).
Most answers never reach it: equal normalized strings (:func:`normalize_math_answer`) are
accepted at once.
"""

from __future__ import annotations

import asyncio
import atexit
import importlib.util
import logging
import os
import pickle
import re
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from furlong.hooks import PluginError

from ._normalize import normalize_math_answer

__all__ = ["DEFAULT_TIMEOUT_S", "equivalent", "equivalent_many", "equivalent_many_async", "grading_stats",
           "run_in_worker"]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 5.0
"""Seconds one math-verify comparison may take before it scores 0 (counted as a time-out)."""

_KILL_GRACE_S = 2.0  # extra seconds the parent waits for the worker's own alarm before killing it
_STARTUP_TIMEOUT_S = 180.0  # spawning the worker and importing sympy/math-verify, on a slow machine

_lock = threading.Lock()  # guards the worker process
_executor_lock = threading.Lock()
_worker: "_Worker | None" = None
_executor: ThreadPoolExecutor | None = None
_warmed_in: int | None = None  # the process that has queued the worker's start (see _warm_up)
_stats = {"timeouts": 0, "math_verify_calls": 0, "worker_restarts": 0}
# math-verify's answers by (answer, label): it is deterministic, so a pair seen again (a small model repeats
# its wrong answers) gets the same verdict without a round trip; time-outs and errors are not kept
_verdicts: dict[tuple[str, str], bool] = {}
_VERDICTS_MAX = 1 << 16
# per event loop: the pairs waiting for the grading thread, sent as one batch (see _graded_in_thread)
_queued: dict[Any, list] = {}


def grading_stats() -> dict[str, int]:
    """Counters since the process started (cumulative; take differences per rollout).

    ``timeouts``: comparisons that ran out of time and scored 0. ``math_verify_calls``:
    comparisons sent to math-verify (the rest passed the fast checks or had no
    answer). ``worker_restarts``: times the worker process was killed and restarted.
    """
    return dict(_stats)


def equivalent(answer: str, label: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Whether ``answer`` equals the ground truth ``label`` as mathematics.

    An empty answer or label is never equal. Equal strings or equal
    :func:`normalize_math_answer` forms are equal, and two integers (``[+-]digits``) are
    compared as integers, as math-verify does, without calling math-verify; otherwise
    math-verify decides (``verify(gold=label, target=answer)``, both wrapped in ``\\boxed{}``
    so they parse as math) within ``timeout_s`` seconds.

    Thread-safe; blocks the calling thread (use :func:`equivalent_many_async` in a loop).

    :param answer: extracted answer, e.g. the content of the response's last ``\\boxed{}``.
    :param label: ground-truth answer, already stringified and un-boxed.
    :param timeout_s: seconds the math-verify comparison may take; past it the answer
        scores False and ``grading_stats()["timeouts"]`` grows by one.
    :raises PluginError: math-verify is not installed.
    """
    fast = _fast_check(answer, label)
    if fast is not None:
        return fast
    key = (answer.strip(), label.strip())
    known = _verdicts.get(key)
    if known is not None:
        return known
    status, value = run_in_worker(_check_pair, key, timeout_s)
    if status == "ok":
        if len(_verdicts) >= _VERDICTS_MAX:
            _verdicts.clear()
        _verdicts[key] = value is True
    return status == "ok" and value is True


def equivalent_many(pairs: list[tuple[str, str]], timeout_s: float = DEFAULT_TIMEOUT_S) -> list[bool]:
    """:func:`equivalent` of each ``(answer, label)`` pair, in order."""
    return [equivalent(answer, label, timeout_s) for answer, label in pairs]


async def equivalent_many_async(pairs: list[tuple[str, str]], timeout_s: float = DEFAULT_TIMEOUT_S) -> list[bool]:
    """:func:`equivalent_many` without blocking the event loop.

    Fast checks run inline; the pairs that need math-verify go, in one batch, to a
    dedicated grading thread (one thread, so batches queue and each comparison's time-out
    starts when it really starts).
    """
    _warm_up()
    results: list[bool | None] = [_fast_check(answer, label) for answer, label in pairs]
    todo = [i for i, r in enumerate(results) if r is None]
    if todo:
        slow = await _graded_in_thread([pairs[i] for i in todo], timeout_s)
        for i, value in zip(todo, slow):
            results[i] = value
    return [bool(r) for r in results]


async def _graded_in_thread(pairs: list[tuple[str, str]], timeout_s: float) -> list[bool]:
    """:func:`equivalent_many` in the grading thread, batched with the other calls of this loop iteration.

    The samples of a group finish together and each is scored by its own ``reward`` call:
    one thread hop for all of them instead of one each.
    """
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    if loop not in _queued:
        _queued[loop] = []
        loop.call_soon(_send_queued, loop)
    _queued[loop].append((pairs, timeout_s, done))
    return await done


def _warm_up() -> None:
    """Queue the worker's start in the grading thread, once per process; batches queued later wait behind it."""
    global _warmed_in
    if _warmed_in != os.getpid():
        _warmed_in = os.getpid()
        _grading_thread().submit(_start_worker)


def _start_worker() -> None:
    with _lock:
        try:
            _get_worker()
        except PluginError:
            pass  # math-verify missing or not starting: the first comparison that needs it raises the error


def _send_queued(loop) -> None:
    batch = _queued.pop(loop)
    items = [(answer, label, timeout_s) for pairs, timeout_s, _ in batch for answer, label in pairs]
    graded = loop.run_in_executor(_grading_thread(), _equivalent_each, items)

    def hand_out(future) -> None:
        start = 0
        for pairs, _, done in batch:
            if done.cancelled():
                pass
            elif future.exception() is not None:
                done.set_exception(future.exception())
            else:
                done.set_result(future.result()[start:start + len(pairs)])
            start += len(pairs)

    graded.add_done_callback(hand_out)


def _equivalent_each(items: list[tuple[str, str, float]]) -> list[bool]:
    return [equivalent(answer, label, timeout_s) for answer, label, timeout_s in items]


def _fast_check(answer: str, label: str) -> bool | None:
    answer, label = answer.strip(), label.strip()
    if not answer or not label:
        return False
    if answer == label or normalize_math_answer(answer) == normalize_math_answer(label):
        return True
    if _INTEGER.fullmatch(answer) and _INTEGER.fullmatch(label):
        return int(answer) == int(label)  # math-verify compares integers exactly too ("05" = "5", "-0" = "0")
    return None


_INTEGER = re.compile(r"[+-]?[0-9]+")


# --- the worker process ---------------------------------------------------------------------


def run_in_worker(fn: Callable, args: tuple, timeout_s: float, grace_s: float = _KILL_GRACE_S) -> tuple[str, Any]:
    """Run ``fn(*args)`` in the grading worker process with a time-out.

    :param fn: a picklable (module-level) function.
    :param timeout_s: the worker interrupts ``fn`` after this many seconds (SIGALRM);
        the parent kills and later restarts the worker if it has not answered ``grace_s``
        seconds after that.
    :returns: ``("ok", value)``, ``("timeout", None)`` (counted in ``grading_stats``), or
        ``("error", "ExcType: message")`` when ``fn`` raised or the worker died.
    :raises PluginError: the worker cannot start (math-verify missing or failing to import).
    """
    with _lock:
        worker = _get_worker()
        _stats["math_verify_calls"] += fn is _check_pair
        try:
            worker.send((fn, args, timeout_s))
            status, value = worker.receive(timeout_s + grace_s)
        except TimeoutError:
            log.warning("math grading worker did not answer within %.1f s; restarting it", timeout_s + grace_s)
            _drop_worker()
            status, value = "timeout", None
        except (EOFError, OSError) as exc:
            log.warning("math grading worker died (%s: %s); restarting it", type(exc).__name__, exc)
            _drop_worker()
            status, value = "error", f"worker died: {exc}"
        if status == "timeout":
            _stats["timeouts"] += 1
        elif status == "error":
            log.debug("math grading error: %s", value)
        return status, value


class _Worker:
    """One ``python`` child process speaking length-prefixed pickles over its stdin/stdout.

    A plain subprocess rather than ``multiprocessing``: it never re-imports the parent's
    ``__main__`` and exits by itself when the parent goes away (its stdin closes).
    """

    def __init__(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if isinstance(p, str) and p)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"from {__name__} import _serve; _serve()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0, env=env,
        )
        self.owner = os.getpid()
        try:
            self.receive(_STARTUP_TIMEOUT_S)
        except (TimeoutError, EOFError, OSError) as exc:
            self.kill()
            raise PluginError(
                f"the math answer grading worker ({sys.executable}) failed to start "
                f"({type(exc).__name__}: {exc}; its error output is above). "
                "Check that 'math-verify' imports in this environment: python -c 'import math_verify'"
            ) from exc

    def send(self, obj: Any) -> None:
        _write_frame(self.proc.stdin, obj)

    def receive(self, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        (size,) = struct.unpack("<Q", self._read(8, deadline))
        return pickle.loads(self._read(size, deadline))

    def _read(self, n: int, deadline: float) -> bytes:
        fd = self.proc.stdout.fileno()
        chunks, left = [], n
        while left:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                raise TimeoutError("no answer from the grading worker within the time-out")
            chunk = os.read(fd, left)
            if not chunk:
                raise EOFError(f"grading worker exited with code {self.proc.poll()}")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            pipe.close()


def _get_worker() -> _Worker:
    global _worker
    if _worker is not None and _worker.owner == os.getpid():  # one inherited through fork is the parent's
        if _worker.proc.poll() is None:
            return _worker
        _drop_worker()
    if importlib.util.find_spec("math_verify") is None:
        raise PluginError(
            "math answer grading needs the 'math-verify' package, which is not installed. "
            "Install it with: pip install 'math-verify>=0.7'"
        )
    _worker = _Worker()
    return _worker


def _drop_worker() -> None:
    global _worker
    if _worker is not None and _worker.owner == os.getpid():
        _worker.kill()
        _stats["worker_restarts"] += 1
    _worker = None


def _grading_thread() -> ThreadPoolExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="furlong-grading")
        return _executor


def _write_frame(pipe, obj: Any) -> None:
    """Write one length-prefixed pickle to an unbuffered pipe (a raw write may be partial)."""
    payload = pickle.dumps(obj)
    data = memoryview(struct.pack("<Q", len(payload)) + payload)
    while data:
        data = data[pipe.write(data):]


@atexit.register
def _shutdown() -> None:
    global _worker, _executor
    if _worker is not None and _worker.owner == os.getpid():
        _worker.kill()
    _worker = None
    if _executor is not None:
        _executor.shutdown(wait=False, cancel_futures=True)
        _executor = None


# Everything below runs inside the worker process.


class _Timeout(BaseException):
    """Raised by the worker's alarm; a BaseException so math-verify's ``except Exception`` cannot eat it."""


def _on_alarm(signum, frame):
    raise _Timeout()


def _serve() -> None:
    """Worker main loop: answer ``(fn, args, timeout_s)`` requests until stdin closes."""
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # stray prints from sympy or math-verify must not corrupt the protocol
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    signal.signal(signal.SIGALRM, _on_alarm)
    # math-verify warns that its own (signal-based) time-out is off: ours replaces it.
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    _check_pair("1", "1")  # import sympy and math-verify now, not inside the first time-out

    _write_frame(out, ("ready", os.getpid()))
    inp = sys.stdin.buffer
    while True:
        header = inp.read(8)
        if len(header) < 8:
            return
        fn, args, timeout_s = pickle.loads(inp.read(struct.unpack("<Q", header)[0]))
        _write_frame(out, _worker_call(fn, args, timeout_s))


def _worker_call(fn: Callable, args: tuple, timeout_s: float) -> tuple[str, Any]:
    try:
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            value = fn(*args)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _Timeout:
        return "timeout", None
    except Exception as exc:  # noqa: BLE001 - reported to the parent, scored as not equal
        return "error", f"{type(exc).__name__}: {exc}"
    return "ok", value


def _check_pair(answer: str, label: str) -> bool:
    from math_verify import parse, verify

    gold = parse("\\boxed{" + label + "}", parsing_timeout=None)
    target = parse("\\boxed{" + answer + "}", parsing_timeout=None)
    if not gold or not target:
        return False
    return bool(verify(gold, target, timeout_seconds=None))


async def score_pairs(pairs: list) -> list[int]:
    """1/0 per ``(answer, label)`` pair by :func:`equivalent_many_async`; a None pair scores 0."""
    todo = [i for i, pair in enumerate(pairs) if pair is not None]
    equal = await equivalent_many_async([pairs[i] for i in todo])
    scores = [0] * len(pairs)
    for i, ok in zip(todo, equal):
        scores[i] = int(ok)
    return scores
