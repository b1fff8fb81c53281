"""Fully async rollout: a producer generates across rollouts into a FIFO queue (docs/modes.md)."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter, deque

from furlong.hooks import PluginError, Status, hookimpl

log = logging.getLogger("furlong.rollout")

WARN_AFTER = 30.0  # seconds without a finished group before (and between) warnings

# (attribute, flag, why it cannot be combined with the fully async rollout)
_EXCLUSIVE = (
    ("colocate", "--colocate", "the producer generates while the trainer trains"),
    ("partial_rollout", "--partial-rollout", "unfinished groups simply stay in flight"),
    ("rollout_all_samples_process_path", "--rollout-all-samples-process-path",
     "there is no end of a rollout to see all samples at"),
)


@hookimpl
def configure(args, report):
    """Per-sample submission by default; flags that cannot work with a run-long producer.

    Flags derived: ``rollout_submission_granularity`` = ``sample`` unless given.
    Errors: ``--colocate``, ``--partial-rollout``, ``--rollout-all-samples-process-path``,
    ``--pause-generation-mode abort``, and ``furlong train`` (it needs train-async).
    """
    report.default(args, "rollout_submission_granularity", "sample")
    for dest, flag, why in _EXCLUSIVE:
        if getattr(args, dest):
            report.error(f"--fully-async cannot be combined with {flag} ({why}).")
    if args.pause_generation_mode == "abort":
        report.error("--fully-async cannot use --pause-generation-mode abort: generation is always in flight, so "
                     "every weight update would throw it away; use retract or in_place.")
    if args.train_mode == "sync":
        report.error("fully async rollout (--rollout fully_async, --fully-async) needs furlong train-async.")


@hookimpl
async def rollout(config, rollout_id, context):
    """Take ``--rollout-batch-size`` groups from the queue a run-long producer fills.

    The first call starts the producer task (kept in ``context.state``; the core cancels
    it when the run ends). It keeps at most ``rollout_batch_size`` groups in flight
    (``--async-max-concurrent-samples // n`` when given, at least 1), drawing one group at
    a time from ``context.data``. With ``--rollout-submission-granularity sample`` (the
    default here, unless ``--group-rm``) every finished sample frees its slot, so a new
    group starts once ``samples_in_flight + n <= groups_budget * n``; with ``group`` a
    slot frees when the whole group finished. A finished group with an aborted sample
    goes to ``--async-unused-samples-handler``; one a filter rejects is discarded
    (counted by the core in ``rollout/dynamic_filter/*``); the rest are queued FIFO.
    The producer waits while the queue holds ``floor(--async-data-buffer-capacity-factor
    * rollout_batch_size)`` groups.

    This call drains the queue FIFO. A group's staleness is ``context.weight_version``
    minus the oldest weight version of its samples; above ``--max-weight-staleness`` the
    group goes to the unused handler instead of the batch: ``drop``, or ``retry``
    (``Sample.reset_for_retry`` on each sample, then back to the data buffer, so the
    producer generates it again). Groups left in the queue wait for the next rollout.
    Adds ``rollout/fully_async/{queue_size, aborted_groups_filtered,
    stale_groups_filtered, avg_staleness, max_staleness, buffer_avg_staleness,
    buffer_max_staleness}`` to ``context.metrics`` (counts since the previous rollout;
    staleness in weight versions). Logs a warning every 30 s without a finished group.

    :returns: exactly ``rollout_batch_size`` groups, sorted by first sample index.
    :raises PluginError: the producer stopped with an error (the message carries it), or
        the rollout was called from another event loop than the first one.
    """
    producer = context.state.get("producer")
    if producer is None:
        producer = _Producer(config, context)
        context.state["producer"] = producer
        context.state["producer_task"] = producer.start()
    return await producer.take(rollout_id, context)


class _Producer:
    """The run-long generation task and its queue of finished groups."""

    def __init__(self, config, context):
        self.config = config
        self.context = context  # its callables and data stay valid for the whole run
        self.rbs = int(config.rollout_batch_size)
        self.n = int(config.n_samples_per_prompt)
        self.groups_budget = _groups_in_flight(self.rbs, self.n, config.async_max_concurrent_samples)
        self.capacity = _queue_capacity(config.async_data_buffer_capacity_factor, self.rbs)
        granularity = config.rollout_submission_granularity or "sample"
        self.per_sample = granularity == "sample" and not config.group_rm
        self.queue: deque = deque()
        self.counts: Counter = Counter()
        self.samples_in_flight = 0
        self.rollout_id = 0  # the rollout the producer is generating for (passed to filters)
        self.last_finished = time.monotonic()
        self.last_warned = 0.0
        self.ready = asyncio.Event()  # a group was queued, or the producer stopped
        self.space = asyncio.Event()  # the queue has room
        self.slot = asyncio.Event()  # a sample (or group) finished
        self.loop = asyncio.get_running_loop()
        self.task: asyncio.Task | None = None

    def start(self) -> asyncio.Task:
        self.task = self.loop.create_task(self._run(), name="fully-async-producer")
        self.task.add_done_callback(lambda _: self.ready.set())
        return self.task

    # --- producer side ---------------------------------------------------------------------

    async def _run(self) -> None:
        tasks: set[asyncio.Task] = set()
        slot: asyncio.Future | None = None  # waits for self.slot; cancelled with the groups when the producer stops
        try:
            while True:
                while self.samples_in_flight + self.n <= self.groups_budget * self.n:
                    [group] = await self.context.data.get_samples(1)
                    self.context.data.hold([group])
                    self.samples_in_flight += len(group)
                    tasks.add(asyncio.ensure_future(self._generate(group)))
                self.slot.clear()
                slot = asyncio.ensure_future(self.slot.wait())
                done, _ = await asyncio.wait(tasks | {slot}, return_when=asyncio.FIRST_COMPLETED)
                slot.cancel()
                finished = [t for t in done if t in tasks]
                tasks.difference_update(finished)
                for task in sorted(finished, key=_first_index):
                    await self._put(task.result())  # a generate/reward error stops the producer here
        finally:
            pending = tasks | ({slot} if slot is not None else set())
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    async def _generate(self, group: list) -> list:
        if not self.per_sample:
            try:
                return await self.context.generate_group(group)
            finally:
                self._free(len(group))
        tasks = [asyncio.ensure_future(self._generate_sample(s)) for s in group]
        try:
            parts = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            raise
        group[:] = [s for part in parts for s in part]
        return group

    async def _generate_sample(self, sample) -> list:
        try:
            return await self.context.generate_group([sample])
        finally:
            self._free(1)

    def _free(self, samples: int) -> None:
        self.samples_in_flight -= samples
        self.slot.set()

    async def _put(self, group: list) -> None:
        self.last_finished = time.monotonic()
        if any(s.status == Status.ABORTED for s in group):
            self.counts["aborted"] += 1
            self._unused(group)
            return
        verdict = await self.context.filter_group(group, self.rollout_id)
        if not verdict.keep:
            return
        while len(self.queue) >= self.capacity:
            self.space.clear()
            await self.space.wait()
        self.queue.append(group)
        self.ready.set()

    def _unused(self, group: list) -> None:
        """``--async-unused-samples-handler``: drop the group, or reset it and buffer it for a retry."""
        if self.config.async_unused_samples_handler == "retry":
            for sample in group:
                sample.reset_for_retry()
            self.context.data.add_samples([group])
        else:
            self.context.data.release([group])

    # --- consumer side ---------------------------------------------------------------------

    async def take(self, rollout_id: int, context) -> list[list]:
        if asyncio.get_running_loop() is not self.loop:
            raise PluginError("--rollout fully_async: the producer runs on the event loop of the first rollout; "
                              "call every rollout of a run from one event loop.")
        self.rollout_id = rollout_id
        version = context.weight_version
        limit = self.config.max_weight_staleness
        batch, staleness, stale = [], [], 0
        while len(batch) < self.rbs:
            self._raise_if_stopped(rollout_id)
            if not self.queue:
                await self._wait_for_group(rollout_id, len(batch))
                continue
            group = self.queue.popleft()
            self.space.set()
            age = _staleness(group, version)
            if limit is not None and age > limit:
                stale += 1
                self._unused(group)
                continue
            batch.append(group)
            staleness.append(age)
        self.rollout_id = rollout_id + 1
        leftover = [_staleness(g, version) for g in self.queue]
        prefix = "rollout/fully_async/"
        context.metrics.update({
            prefix + "queue_size": float(len(self.queue)),
            prefix + "aborted_groups_filtered": float(self.counts.pop("aborted", 0)),
            prefix + "stale_groups_filtered": float(stale),
            prefix + "avg_staleness": sum(staleness) / len(staleness),
            prefix + "max_staleness": float(max(staleness)),
            prefix + "buffer_avg_staleness": sum(leftover) / len(leftover) if leftover else 0.0,
            prefix + "buffer_max_staleness": float(max(leftover, default=0)),
        })
        return sorted(batch, key=lambda g: g[0].index)

    async def _wait_for_group(self, rollout_id: int, taken: int) -> None:
        self.ready.clear()
        quiet = time.monotonic() - max(self.last_finished, self.last_warned)
        try:
            await asyncio.wait_for(self.ready.wait(), timeout=max(WARN_AFTER - quiet, 0.0))
        except asyncio.TimeoutError:
            self.last_warned = time.monotonic()
            log.warning("fully async rollout %d: no group finished in the last %.0f s (%d of %d groups taken, "
                        "%d samples in flight, queue empty)", rollout_id, self.last_warned - self.last_finished,
                        taken, self.rbs, self.samples_in_flight)

    def _raise_if_stopped(self, rollout_id: int) -> None:
        if self.task is None or not self.task.done():
            return
        if self.task.cancelled():
            raise PluginError(f"--rollout fully_async: rollout {rollout_id} cannot run, the producer task was "
                              "cancelled (the run is shutting down).")
        exc = self.task.exception()
        message = str(exc) if isinstance(exc, PluginError) else f"{type(exc).__name__}: {exc}"
        raise PluginError(f"--rollout fully_async: the producer stopped with an error, so rollout {rollout_id} "
                          f"cannot be filled: {message}") from exc


def _groups_in_flight(rollout_batch_size: int, n: int, max_concurrent_samples: int | None) -> int:
    """Groups the producer keeps in flight: ``max(1, max_concurrent_samples // n)``, else ``rollout_batch_size``."""
    if max_concurrent_samples is None:
        return max(1, rollout_batch_size)
    return max(1, int(max_concurrent_samples) // n)


def _queue_capacity(factor: float, rollout_batch_size: int) -> int:
    """Groups the queue holds before the producer waits: ``max(1, floor(factor * rollout_batch_size))``."""
    return max(1, math.floor(float(factor) * rollout_batch_size))


def _staleness(group: list, version: int | None) -> int:
    """``version`` minus the oldest numeric weight version in ``group``; 0 when either is unknown."""
    versions = [s.oldest_weight_version for s in group if s.oldest_weight_version is not None]
    if version is None or not versions:
        return 0
    return int(version) - min(versions)


def _first_index(task: asyncio.Task) -> int:
    if task.cancelled() or task.exception() is not None:
        return -1  # failures first: they stop the producer
    group = task.result()
    return group[0].index if group and group[0].index is not None else -1
