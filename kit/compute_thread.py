"""One thread for a process's heavy torch work, where the run allows it.

Torch's OpenMP runtime on Linux (libgomp) keeps a team of threads for each thread that runs a
parallel region. When a process holds more OpenMP threads than there are cores, libgomp stops
letting idle threads spin between parallel regions, and every region waits for threads to wake.
With torch's default (as many intra-op threads as cores) a furlong run had up to three teams: the
embedded engine's decode loop and the train backend's passes in two worker threads, and the event
loop's thread (loading models, bookkeeping). On a 2-core machine with 2 threads the demo's train
step took 0.34-0.37 s and its rollout 0.19-0.21 s. Running the engine and the trainer in one thread
did not help while the event loop's thread kept two intra-op threads, nor did the reverse; with
both (one team in the process) they took 0.18-0.21 s and 0.10-0.13 s (docs/benchmarks.md,
"Re-measured on 2026-12-03").

In a synchronous run (``furlong train``) generation, training and weight sync never overlap, so
the core opens :func:`shared_compute_thread` around the run and both built-in plugins send their
work through :func:`run_compute`; the event loop's thread then computes with one intra-op thread,
so a plugin doing heavy torch work on it (a reward model, say) should use :func:`run_compute` too.
Elsewhere (``train-async``, tests calling a plugin directly) :func:`run_compute` is
``asyncio.to_thread``: an asynchronous run's engine decodes while the trainer trains.

There the engine's decode steps and the trainer's calls run in two threads of one process, and
:func:`compute_turn` keeps their host sides apart, one at a time (the GPU still runs what each has
launched): ``torch.compile`` traces a model with ``torch.fx``, which patches
``torch.nn.Module.__call__`` for the whole process, so a module called by another thread while a
first call compiles fails ("Detected that you are using FX to symbolically trace a
dynamo-optimized function"), and a CUDA graph captured while the other thread launches its own
passes would be at risk too. (Torch work outside the turn, such as a loss computed on the event
loop's thread, may still meet a capture: the engine captures in thread-local mode for that.)
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

__all__ = ["compute_turn", "run_compute", "shared_compute_thread"]

_shared: ThreadPoolExecutor | None = None
_turn = threading.RLock()


def compute_turn() -> threading.RLock:
    """The process's turn for one pass of torch module work: ``with compute_turn(): ...``.

    Held by the built-in plugins around their torch work in-process: the ``embedded`` engine per
    decode step or prefill, the trainer loop of :mod:`furlong.kit.trainer` per call it runs in its
    compute thread (a forward, a backward, clipping and the optimizer step, a weight gather, checkpoint
    I/O). Any other plugin calling torch modules in the run's process (a reward model) takes it around
    those calls too; :func:`run_compute` does not take it. Never wait while holding it for work that
    takes it too. Re-entrant. In a sync run generation and training never overlap and the turn is
    never contended; in ``train-async`` with the engine and the trainer in one process it keeps a
    first call that compiles (``torch.compile``) or captures (CUDA graphs) from meeting the other
    thread's module calls, which failed in torch's compiler. Taking it costs about a microsecond.
    """
    return _turn


async def run_compute(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in the process's compute thread inside :func:`shared_compute_thread`,
    else in a worker thread (``asyncio.to_thread``); its result, or its exception raised here.

    For calls that do torch work (forward and backward passes, decode steps, weight copies). Never for
    a call that may run while another ``run_compute`` call is blocked waiting for it, directly or
    through something held outside (the embedded engine, paused mid-generation, has its decode loop
    waiting on a lock inside the compute thread, so it copies weights with ``asyncio.to_thread``
    while its decode loop runs):
    queued behind the blocked call, it would wait forever.
    """
    if _shared is None:
        return await asyncio.to_thread(fn, *args, **kwargs)
    call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(_shared, call)


@contextlib.contextmanager
def shared_compute_thread(enabled: bool = True):
    """Within the block, :func:`run_compute` runs everything in one thread that computes with torch's
    intra-op thread count on entry, and the calling thread (the event loop's) computes with one thread;
    on exit the thread is shut down and the calling thread's count restored. Nothing changes when
    ``enabled`` is False or torch has one thread.

    :raises RuntimeError: the block is already open (one compute thread per process).
    """
    global _shared
    import torch

    if enabled and _shared is not None:
        raise RuntimeError("shared_compute_thread is already open in this process")
    threads = torch.get_num_threads()
    if not enabled or threads <= 1:
        yield
        return
    _shared = ThreadPoolExecutor(1, thread_name_prefix="furlong-compute", initializer=torch.set_num_threads,
                                 initargs=(threads,))
    torch.set_num_threads(1)
    try:
        yield
    except BaseException:
        executor, _shared = _shared, None
        executor.shutdown(wait=False, cancel_futures=True)  # a failed or interrupted run waits for no queued work
        raise
    else:
        executor, _shared = _shared, None
        executor.shutdown(wait=True)
    finally:
        torch.set_num_threads(threads)
