"""Math answer equivalence: a fast normalized-string check, then math-verify in a worker process.

math-verify (Hugging Face, https://github.com/huggingface/Math-Verify) parses both answers
with sympy and compares them (``\\frac{2}{4}`` = ``0.5``, ``1,000`` = ``1000``, ``x=5`` = ``5``).
Its own time-out uses ``signal.alarm``, which only works in a main thread, and sympy can
run for minutes on inputs like ``10^{10^{10}}``. So the comparison runs in one worker
process started with the ``spawn`` method (safe next to torch's threads; the parent's
``__main__`` must be import-safe, as for any ``spawn`` use), under furlong's own
time-out: an ``ITIMER_REAL`` alarm inside the worker, and the parent kills and restarts
the worker if even that does not return (a long C-level computation). A timed-out
comparison counts as "not equal" and is counted in :func:`grading_stats`.

The worker is created lazily on first use, reused by every later call, recreated after a
kill or a ``fork`` of the parent, and shut down at interpreter exit. Most answers never
reach it: equal normalized strings (:func:`normalize_math_answer`) are accepted at once.
"""

from __future__ import annotations

import asyncio
import atexit
import importlib.util
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from furlong.hooks import PluginError

from ._normalize import normalize_math_answer

__all__ = ["DEFAULT_TIMEOUT_S", "equivalent", "equivalent_many", "equivalent_many_async", "grading_stats"]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 5.0
"""Seconds one math-verify comparison may take before it scores 0 (counted as a time-out)."""

_KILL_GRACE_S = 2.0  # extra seconds the parent waits for the worker's own alarm before killing it
_STARTUP_TIMEOUT_S = 180.0  # spawning the worker and importing sympy/math-verify, on a slow machine

_lock = threading.Lock()  # guards the worker pool
_executor_lock = threading.Lock()
_pool: Any = None
_pool_pid: int | None = None
_executor: ThreadPoolExecutor | None = None
_stats = {"timeouts": 0, "math_verify_calls": 0, "worker_restarts": 0}


def grading_stats() -> dict[str, int]:
    """Counters since the process started (cumulative; take differences per rollout).

    ``timeouts``: comparisons that ran out of time and scored 0. ``math_verify_calls``:
    comparisons sent to math-verify (the rest passed the fast exact check or had no
    answer). ``worker_restarts``: times the worker process was killed and restarted.
    """
    return dict(_stats)


def equivalent(answer: str, label: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Whether ``answer`` equals the ground truth ``label`` as mathematics.

    An empty answer or label is never equal. Equal strings or equal
    :func:`normalize_math_answer` forms are equal without calling math-verify; otherwise
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
    status, value = run_in_worker(_check_pair, (answer.strip(), label.strip()), timeout_s)
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
    results: list[bool | None] = [_fast_check(answer, label) for answer, label in pairs]
    todo = [i for i, r in enumerate(results) if r is None]
    if todo:
        loop = asyncio.get_running_loop()
        slow = await loop.run_in_executor(_grading_thread(), equivalent_many, [pairs[i] for i in todo], timeout_s)
        for i, value in zip(todo, slow):
            results[i] = value
    return [bool(r) for r in results]


def _fast_check(answer: str, label: str) -> bool | None:
    answer, label = answer.strip(), label.strip()
    if not answer or not label:
        return False
    if answer == label or normalize_math_answer(answer) == normalize_math_answer(label):
        return True
    return None


# --- the worker process ---------------------------------------------------------------------


def run_in_worker(fn: Callable, args: tuple, timeout_s: float, grace_s: float = _KILL_GRACE_S) -> tuple[str, Any]:
    """Run ``fn(*args)`` in the grading worker with a time-out.

    :param fn: a picklable (module-level) function.
    :param timeout_s: the worker interrupts ``fn`` after this many seconds (SIGALRM);
        the parent kills the worker ``grace_s`` seconds later if it has not answered.
    :returns: ``("ok", value)``, ``("timeout", None)`` (counted in ``grading_stats``), or
        ``("error", "ExcType: message")`` when ``fn`` raised.
    """
    import multiprocessing

    with _lock:
        pool = _get_pool()
        _stats["math_verify_calls"] += fn is _check_pair
        pending = pool.apply_async(_worker_call, (fn, args, timeout_s))
        try:
            status, value = pending.get(timeout_s + grace_s)
        except multiprocessing.TimeoutError:
            log.warning("grading worker did not answer within %.1f s; restarting it", timeout_s + grace_s)
            _kill_pool()
            status, value = "timeout", None
        if status == "timeout":
            _stats["timeouts"] += 1
        elif status == "error":
            log.debug("grading worker error: %s", value)
        return status, value


def _get_pool():
    global _pool, _pool_pid
    if _pool is not None and _pool_pid == os.getpid():
        return _pool
    if importlib.util.find_spec("math_verify") is None:
        raise PluginError(
            "math answer grading needs the 'math-verify' package, which is not installed. "
            "Install it with: pip install 'math-verify>=0.7'"
        )
    import multiprocessing

    # A pool inherited through fork belongs to the parent: leave it alone, make our own.
    _pool = multiprocessing.get_context("spawn").Pool(processes=1, initializer=_init_worker)
    _pool_pid = os.getpid()
    _pool.apply_async(_ping).get(_STARTUP_TIMEOUT_S)
    return _pool


def _kill_pool() -> None:
    global _pool
    if _pool is not None and _pool_pid == os.getpid():
        _pool.terminate()
        _pool.join()
        _stats["worker_restarts"] += 1
    _pool = None


def _grading_thread() -> ThreadPoolExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="furlong-grading")
        return _executor


@atexit.register
def _shutdown() -> None:
    global _pool, _executor
    if _pool is not None and _pool_pid == os.getpid():
        _pool.terminate()
        _pool.join()
    _pool = None
    if _executor is not None:
        _executor.shutdown(wait=False, cancel_futures=True)
        _executor = None


# Everything below runs inside the worker process.


class _Timeout(BaseException):
    """Raised by the worker's alarm; a BaseException so math-verify's ``except Exception`` cannot eat it."""


def _on_alarm(signum, frame):
    raise _Timeout()


def _init_worker() -> None:
    import signal

    # math-verify warns that its own (signal-based) time-out is off: ours replaces it.
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    signal.signal(signal.SIGALRM, _on_alarm)
    _check_pair("1", "1")  # import sympy and math-verify now, not inside the first time-out


def _ping() -> int:
    return os.getpid()


def _worker_call(fn: Callable, args: tuple, timeout_s: float) -> tuple[str, Any]:
    import signal

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
