"""Synchronous rollout with dynamic sampling waves, abort and partial rollout."""

from __future__ import annotations

import asyncio
import logging

from furlong.hooks import PluginError, hookimpl

log = logging.getLogger("furlong.rollout")

# flags only the run-long producer of ``--rollout fully_async`` reads
_FULLY_ASYNC_ONLY = ("rollout_submission_granularity", "async_max_concurrent_samples",
                     "async_data_buffer_capacity_factor", "max_weight_staleness", "async_unused_samples_handler")


@hookimpl
def configure(args, report):
    """Warn about the given flags of the fully async rollout, which this rollout does not read.

    They are accepted (Miles' synchronous loop accepts them too) but said, so that none of
    them looks in effect when it is not.
    """
    given = [dest for dest in _FULLY_ASYNC_ONLY if report.given(args, dest)]
    if given:
        flags = ", ".join("--" + dest.replace("_", "-") for dest in given)
        report.warn(f"{flags}: read by the fully async rollout only (--rollout fully_async, with furlong "
                    f"train-async); the sync rollout ignores {'it' if len(given) == 1 else 'them'}.")


@hookimpl
async def rollout(config, rollout_id, context):
    """Generate groups until ``--rollout-batch-size`` of them pass every filter.

    Each wave draws ``--over-sampling-batch-size`` groups; a new wave starts whenever the
    groups in flight cannot fill what is still needed. Finished groups are filtered as they
    arrive; kept groups beyond the target are surplus. Then the leftovers are aborted
    (engine abort + ``abort`` hook); with ``--partial-rollout`` they go to the buffer with
    their partial tokens, else they are dropped.

    :returns: exactly ``rollout_batch_size`` groups, sorted by first sample index.
    :raises PluginError: ``--max-sampling-waves`` waves did not fill the batch (names the
        filters and the drop counts per reason).
    """
    target = config.rollout_batch_size
    kept: list[list] = []
    pending: set[asyncio.Task] = set()
    waves = 0
    try:
        while len(kept) < target:
            while len(pending) < target - len(kept):
                if waves >= config.max_sampling_waves:
                    raise PluginError(_too_many_waves(config, waves, len(kept), context.data.drop_counts))
                waves += 1
                if waves % 10 == 0:
                    log.warning("rollout %d: %d sampling waves so far, %d of %d groups kept; drops: %s",
                                rollout_id, waves, len(kept), target, context.data.drop_counts)
                for group in await context.data.get_samples(config.over_sampling_batch_size):
                    pending.add(asyncio.ensure_future(context.generate_group(group)))
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            failed = [t.exception() for t in done if t.exception() is not None]
            if failed:
                raise failed[0]
            for task in sorted(done, key=lambda t: t.result()[0].index):
                group = task.result()
                verdict = await context.filter_group(group, rollout_id)
                if verdict.keep and len(kept) < target:
                    kept.append(group)
    except BaseException:
        for task in pending:
            task.cancel()
        raise
    context.metrics["rollout/dynamic_filter/waves"] = float(waves)
    if pending:
        await context.abort(rollout_id)
        leftovers = [await task for task in pending]
        if config.partial_rollout:
            context.data.add_samples(sorted(leftovers, key=lambda g: g[0].index))
    kept.sort(key=lambda g: g[0].index)
    return kept


def _too_many_waves(config, waves: int, kept: int, drops: dict) -> str:
    filters = list(config.dynamic_sampling_filter or []) + _as_list(config.dynamic_sampling_filter_path)
    counts = ", ".join(f"{reason}: {n}" for reason, n in sorted(drops.items())) or "none"
    return (
        f"dynamic sampling gave up after {waves} waves (--max-sampling-waves {config.max_sampling_waves}): "
        f"{kept} of {config.rollout_batch_size} groups kept.\n"
        f"  Filters: {', '.join(filters) or 'none'}. Groups dropped per reason: {counts}.\n"
        "  Loosen the filters, raise --over-sampling-batch-size or --max-sampling-waves."
    )


def _as_list(value) -> list:
    if not value:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]
