"""The rollout manager: runs the ``rollout`` hook with the core's generate/reward/filter/abort callers.

It owns what every rollout plugin shares: the concurrency limit, per-sample reward
resolution, the aborted state, group accounting (drawn = trained + filtered + surplus +
aborted-dropped + buffered + held), the dump of a failed rollout's samples, the rollout
plugin's run-long ``state`` (tasks in it are cancelled by :meth:`RolloutManager.dispose`),
the weight version last synced, and the data state snapshotted at the end of each rollout.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import time
from argparse import Namespace
from collections import Counter

from furlong.hooks import FilterResult, PluginError, RolloutContext, RolloutEngine, Sample, Status
from furlong.hooks.contract import check_generate_result

from .data_cursor import DataCursor
from ..plugins.manager import FurlongPluginManager
from .rewards import RewardScorer
from ..plugins.selection import Selection

__all__ = ["RolloutManager", "sample_seed", "train_sampling_params"]

log = logging.getLogger("furlong.rollout")


def train_sampling_params(args: Namespace) -> dict:
    """SGLang-style sampling parameters of training rollouts."""
    params = {
        "temperature": args.rollout_temperature,
        "top_p": args.rollout_top_p,
        "top_k": args.rollout_top_k,
        "max_new_tokens": args.rollout_max_response_len,
        "stop": args.rollout_stop,
        "stop_token_ids": args.rollout_stop_token_ids,
        "skip_special_tokens": args.rollout_skip_special_tokens,
        "no_stop_trim": True,
        "spaces_between_special_tokens": False,
    }
    return params


def sample_seed(seed: int, index: int | None, evaluation: bool) -> int:
    """The ``sampling_seed`` of a sample's requests: a hash of ``--seed``, the sample index and the phase.

    Fixed per sample, so a run samples the same tokens whatever process, engine or
    request order serves it, and a resumed run (whose sample counters come from the
    checkpoint) samples what the uninterrupted run would have. Evaluation samples get
    the same seeds at every evaluation (common random numbers across checkpoints).
    """
    key = f"{int(seed)}:{'eval' if evaluation else 'train'}:{index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 2


class RolloutManager:
    """Generates rollouts (``await manager.generate(rollout_id)``) and evaluations."""

    def __init__(self, args: Namespace, pm: FurlongPluginManager, selection: Selection,
                 engine: RolloutEngine, cursor: DataCursor):
        self.args = args
        self.pm = pm
        self.selection = selection
        self.engine = engine
        self.cursor = cursor
        self.scorer = RewardScorer(args, pm, selection)
        self.aborted = False
        self.semaphore = asyncio.Semaphore(max(1, int(args.sglang_server_concurrency)))
        self._handed_out: list[list[Sample]] = []
        self._drops: Counter = Counter()
        self._rejected: set[int] = set()
        self._held: dict[int, list[Sample]] = {}
        self.rollout_state: dict = {}
        self.weight_version: int | None = None
        self.data_states: dict[int, dict] = {}
        self.rollout_metrics: dict[int, dict] = {}
        self.progress = {"samples_done": 0, "tokens": 0, "samples_total": 0}

    # --- the rollout ---------------------------------------------------------------------

    async def generate(self, rollout_id: int) -> list[list[Sample]]:
        """Run the chosen ``rollout`` plugin for ``rollout_id``; return the groups to train on.

        Right after accounting, the data state (:meth:`data_state`) is kept in
        ``data_states[rollout_id]`` (the last two rollouts): train-async saves it with rollout
        ``rollout_id``'s checkpoint while rollout ``rollout_id + 1`` is already drawing
        (docs/modes.md, "train-async").

        :raises PluginError: the plugin (or a generate/reward it called) failed; the
            rollout's samples were first written to ``failed_rollout_<id>.jsonl``.
        """
        self.aborted = False
        self.progress = {"samples_done": 0, "tokens": 0, "samples_total": 0}
        self.cursor.rollout_id = rollout_id
        buffered_before = {id(g) for g in self.cursor.buffer}
        context = RolloutContext(engine=self.engine, data=_TrackingCursor(self), generate_group=self.generate_group,
                                 filter_group=self.filter_group, abort=self.abort, state=self.rollout_state,
                                 weight_version=self.weight_version)
        name, flag = self.selection.chosen["rollout"]
        start = time.perf_counter()
        try:
            groups = await self.pm.call_chosen("rollout", name, flag, args=self.args, rollout_id=rollout_id,
                                               context=context)
        except Exception as exc:
            path = self.dump_failed(rollout_id)
            self._new_window()
            message = str(exc) if isinstance(exc, PluginError) else f"{type(exc).__name__}: {exc}"
            raise PluginError(f"rollout {rollout_id} failed: {message}\n  The rollout's samples are in {path}.") from exc
        finally:
            self.aborted = False
        self._check_groups(name, groups)
        groups.sort(key=lambda g: g[0].index)
        await self._postprocess(groups)
        context.metrics.update(self._account(groups, buffered_before))
        self.data_states[rollout_id] = self.data_state()
        for old in [r for r in self.data_states if r < rollout_id - 1]:
            del self.data_states[old]
        context.metrics["perf/rollout_time"] = time.perf_counter() - start
        self.rollout_metrics[rollout_id] = context.metrics
        return groups

    async def _postprocess(self, groups: list[list[Sample]]) -> None:
        """``--rollout-sample-filter-path`` on the groups to train on (it may set ``remove_sample``),
        then ``--rollout-all-samples-process-path`` on every group that finished generating this
        rollout, kept or not, sorted by first index, with the data cursor."""
        paths = self.selection.paths
        if "rollout_sample_filter" in paths:
            await self.pm.call_chosen("rollout_sample_filter", *paths["rollout_sample_filter"], args=self.args,
                                      samples=groups)
        if "rollout_all_samples_process" in paths:
            seen = {id(g) for g in self.cursor.buffer}  # partial rollout: resumed next time, not seen yet
            finished = []
            for group in [*groups, *self._handed_out]:
                if id(group) not in seen and _finished(group):
                    seen.add(id(group))
                    finished.append(group)
            finished.sort(key=lambda g: g[0].index)
            await self.pm.call_chosen("rollout_all_samples_process", *paths["rollout_all_samples_process"],
                                      args=self.args, all_samples=finished, data_source=self.cursor)

    def set_weight_version(self, version: int) -> None:
        """Record the weight version the trainer just pushed to the engine.

        :raises PluginError: ``version`` is older than the one recorded (versions never go back).
        """
        if self.weight_version is not None and version < self.weight_version:
            raise PluginError(f"weight version went backwards: {version} after {self.weight_version}; "
                              "each weight sync must increase it.")
        self.weight_version = int(version)

    def data_state(self) -> dict:
        """The cursor's checkpoint state, with the groups the rollout plugin holds added to the buffer.

        Held groups (in flight or queued by a plugin that works across rollouts) were
        drawn already: on resume they come back through the buffer. Finished ones keep
        their responses and rewards; unfinished ones are saved reset for a fresh start.
        """
        state = self.cursor.state()
        for group in self._held.values():
            state["buffer"].append([_resumable(s, finished=_finished(group)) for s in group])
        return state

    async def dispose(self) -> None:
        """End of the run: cancel and await every ``asyncio.Task`` kept in the rollout plugin's ``state``."""
        loop = asyncio.get_running_loop()
        tasks = [t for t in self.rollout_state.values()
                 if isinstance(t, asyncio.Task) and not t.done() and t.get_loop() is loop]
        for task in tasks:
            task.cancel()
        for task in tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
            except Exception as exc:  # noqa: BLE001 - the run is over; report, do not mask the run's outcome
                log.warning("rollout plugin task %s ended with %s: %s", task.get_name(), type(exc).__name__, exc)

    def _check_groups(self, name: str, groups: list[list[Sample]]) -> None:
        if len(groups) != self.args.rollout_batch_size:
            raise PluginError(f"rollout plugin '{name}' returned {len(groups)} groups; "
                              f"--rollout-batch-size is {self.args.rollout_batch_size}.")
        for group in groups:
            for sample in group:
                if sample.status in (Status.ABORTED, Status.PENDING):
                    raise PluginError(f"rollout plugin '{name}' returned sample {sample.index} with status "
                                      f"{sample.status.value}; only generated samples can be trained on.")

    def _account(self, trained: list[list[Sample]], buffered_before: set[int]) -> dict:
        trained_ids = {id(g) for g in trained}
        for gid in trained_ids:
            self._held.pop(gid, None)
        buffered_now = {id(g) for g in self.cursor.buffer} - buffered_before
        filtered = sum(self._drops.values())
        counters = self.cursor.counters
        counters["trained"] += len(trained)
        counters["filtered"] += filtered
        seen: set[int] = set()
        for group in self._handed_out:
            gid = id(group)
            if gid in seen or gid in trained_ids or gid in buffered_now or gid in self._rejected or gid in self._held:
                continue
            seen.add(gid)
            if any(s.status in (Status.ABORTED, Status.PENDING) for s in group):
                counters["aborted_dropped"] += 1
            else:
                counters["surplus"] += 1
        metrics = {f"rollout/dynamic_filter/drop_{reason}": float(count) for reason, count in self._drops.items()}
        metrics["rollout/dynamic_filter/groups_drawn"] = float(len(self._handed_out))
        metrics["rollout/dynamic_filter/groups_kept"] = float(len(trained))
        metrics["rollout/dynamic_filter/groups_dropped"] = float(filtered)
        metrics.update({f"rollout/accounting/{k}": float(v) for k, v in counters.items()})
        metrics["rollout/accounting/buffered"] = float(len(self.cursor.buffer))
        metrics["rollout/accounting/held"] = float(len(self._held))
        self._new_window()
        return metrics

    def _new_window(self) -> None:
        """Start counting the next rollout: what happens between two rollout calls (a
        producer working across rollouts) is counted at the end of the next one."""
        self._handed_out = []
        self._drops = Counter()
        self._rejected = set()

    # --- what the rollout plugin calls -----------------------------------------------------

    async def generate_group(self, group: list[Sample], evaluation: bool = False,
                             sampling_params: dict | None = None) -> list[Sample]:
        """Generate and score every sample of ``group`` (concurrently), in place; return the group.

        Samples already ``completed``/``truncated`` (popped from the buffer) are kept as they
        are. A sample reached after an abort is marked ``aborted`` without a request.
        Rewards: one call per sample, or one per group under ``--group-rm``; aborted
        samples are never scored.
        """
        params = sampling_params or train_sampling_params(self.args)
        results = await asyncio.gather(*(self._generate_one(s, params, evaluation) for s in group))
        flat = [s for r in results for s in (r if isinstance(r, list) else [r])]
        group[:] = flat
        to_score = [s for s in flat if s.status not in (Status.ABORTED, Status.PENDING) and s.reward is None]
        if to_score and self.args.group_rm and not evaluation:
            if not self.aborted_any(flat):
                await self.scorer.score(to_score)
        elif to_score:
            await asyncio.gather(*(self.scorer.score([s]) for s in to_score))
        return group

    @staticmethod
    def aborted_any(samples: list[Sample]) -> bool:
        return any(s.status == Status.ABORTED for s in samples)

    async def _generate_one(self, sample: Sample, params: dict, evaluation: bool):
        if sample.status not in (Status.PENDING, Status.ABORTED):
            return sample
        async with self.semaphore:
            if self.aborted:
                sample.status = Status.ABORTED
                return sample
            name, flag = self.selection.chosen["generate"]
            params = dict(params)
            params.setdefault("sampling_seed", sample_seed(self.args.seed, sample.index, evaluation))
            try:
                result = await self.pm.call_chosen("generate", name, flag, args=self.args, sample=sample,
                                                 sampling_params=params, engine=self.engine,
                                                 evaluation=evaluation)
            except PluginError:
                raise
            except Exception as exc:
                raise PluginError(f"generate plugin '{name}' ({self.pm.origin(name)}) failed on sample "
                                  f"{sample.index}: {type(exc).__name__}: {exc}") from exc
            check_generate_result(result, f"generate plugin '{name}' ({self.pm.origin(name)})", sample.index)
        if not evaluation:
            for done in result if isinstance(result, list) else [result]:
                self.progress["samples_done"] += 1
                self.progress["tokens"] += done.response_length
        return result

    async def filter_group(self, group: list[Sample], rollout_id: int) -> FilterResult:
        """Reject a group with an aborted sample (reason ``aborted``), then run the chosen filters."""
        if self.aborted_any(group):
            result = FilterResult(keep=False, reason="aborted")
        elif self.selection.filters:
            result = FilterResult(keep=True)
            for name, flag in self.selection.filters:
                result = await self.pm.run_filters([name], flag, args=self.args, samples=group, rollout_id=rollout_id)
                if not result.keep:
                    break
        else:
            result = FilterResult(keep=True)
        if not result.keep:
            if result.reason:
                self._drops[result.reason] += 1
            else:
                self._drops["unspecified"] += 1
            self._rejected.add(id(group))
            self._held.pop(id(group), None)
        return result

    def drop_counts(self) -> dict:
        """Groups dropped by the filters this rollout, per reason."""
        return dict(self._drops)

    async def abort(self, rollout_id: int) -> None:
        """Abort leftovers: mark the rollout aborted, abort the engine, broadcast ``abort``."""
        self.aborted = True
        await self.engine.abort()
        await self.pm.broadcast("abort", args=self.args, rollout_id=rollout_id)

    # --- failures --------------------------------------------------------------------------

    def dump_failed(self, rollout_id: int) -> str:
        """Write every sample handed out this rollout to ``failed_rollout_<id>.jsonl``; return the path."""
        folder = self.args.save or self.args.log_dir or os.getcwd()
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"failed_rollout_{rollout_id}.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            for group in self._handed_out:
                for sample in group:
                    f.write(json.dumps(sample.to_dict(), default=str) + "\n")
        return path


class _TrackingCursor:
    """The cursor as the rollout plugin sees it: records every group handed out."""

    def __init__(self, manager: RolloutManager):
        self._manager = manager
        self._cursor = manager.cursor

    async def get_samples(self, k: int) -> list[list[Sample]]:
        groups = await self._cursor.get_samples(k)
        self._manager._handed_out.extend(groups)
        self._manager.progress["samples_total"] += sum(len(g) for g in groups)
        return groups

    def add_samples(self, groups: list[list[Sample]]) -> None:
        self._cursor.add_samples(groups)
        for group in groups:
            self._manager._held.pop(id(group), None)

    def hold(self, groups: list[list[Sample]]) -> None:
        """The plugin keeps ``groups`` after its call returns: do not count them yet."""
        for group in groups:
            self._manager._held[id(group)] = group

    def release(self, groups: list[list[Sample]]) -> None:
        """The plugin dropped these held groups: count them (surplus or aborted_dropped) at the end of the rollout."""
        for group in groups:
            self._manager._held.pop(id(group), None)
            self._manager._handed_out.append(group)

    def buffer_len(self) -> int:
        return self._cursor.buffer_len()

    @property
    def drop_counts(self) -> dict:
        return self._manager.drop_counts()


def _finished(group: list[Sample]) -> bool:
    return all(s.status in (Status.COMPLETED, Status.TRUNCATED, Status.FAILED) for s in group)


def _resumable(sample: Sample, finished: bool) -> dict:
    """``sample.to_dict()``, or for a group still generating, the sample reset to start over."""
    if finished:
        return sample.to_dict()
    fresh = Sample.from_dict(sample.to_dict())
    fresh.reset_for_retry()
    return fresh.to_dict()
