"""The fully async rollout with a scripted engine.

One ``asyncio.run`` per test drives several rollouts through the real rollout manager,
since the producer task lives on the event loop of the first rollout. The engine is
deterministic (tests/scripted_engine.py); prompts ``i+0=`` with ``i >= 2`` answer with a
longer text, so groups 0 and 1 always finish before the ones drawn after them.
"""

import asyncio
import json
import logging

import pytest

from furlong.builtin_plugins.rollout import fully_async
from furlong.core.config import parse_args
from furlong.core.config.launch_args import launch_config
from furlong.core.config.configure import configure_plugins
from furlong.core.plugins.selection import resolve_selection
from furlong.hooks import FilterResult, PluginError, Status, hookimpl

from .scripted_engine import ScriptedEngine, rollout_manager


def _data(tmp_path, n=40):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+0=", "label": str(i)}) + "\n" for i in range(n)))
    return path


def _args(tmp_path, *extra):
    return launch_config("--num-rollout", "4", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
                         "--prompt-data", str(_data(tmp_path)), "--input-key", "prompt", "--label-key", "label",
                         "--rm-type", "math", "--rollout-max-response-len", "16", "--rollout", "fully_async",
                         "--log-dir", str(tmp_path / "logs"), *extra, configure=False)


def _answer(prompt, call):
    """Correct; prompts from 2 on pad the answer so they finish after groups 0 and 1."""
    i = int(prompt.split("+")[0])
    return "\\boxed{" + str(i) + "}" + ("    " if i >= 2 else ""), "stop"


def _groups(batch):
    return [g[0].group_index for g in batch]


def _balanced(metrics):
    """drawn = trained + filtered + surplus + aborted_dropped + buffered + held, at one instant."""
    acc = {k.split("/")[-1]: v for k, v in metrics.items() if k.startswith("rollout/accounting/")}
    return acc["drawn"] == (acc["trained"] + acc["filtered"] + acc["surplus"] + acc["aborted_dropped"]
                            + acc["buffered"] + acc["held"])


async def _until(predicate, timeout=10.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


def _settled(manager):
    """The producer is blocked: queue full (4 = floor(2.0 x 2)) and no sample in flight."""
    producer = manager.rollout_state["producer"]
    return lambda: len(producer.queue) == 4 and producer.samples_in_flight == 0


def test_miles_rollout_function_path_selects_fully_async(tmp_path, plugin_manager):
    args = parse_args(["--num-rollout", "2", "--rollout-batch-size", "2", "--prompt-data", str(_data(tmp_path)),
                       "--rollout-function-path", "miles.rollout.fully_async_rollout.generate_rollout_fully_async"],
                      plugin_manager, command="train-async")
    selection = resolve_selection(args, plugin_manager)
    assert selection.chosen["rollout"][0] == "fully_async"
    configure_plugins(args, plugin_manager, selection)  # the plugin derives its per-sample default
    assert args.rollout_submission_granularity == "sample"


def test_hook_rollout_fully_async_carries_queue_leftovers_to_the_next_rollout(tmp_path, plugin_manager):
    args = _args(tmp_path)
    engine = ScriptedEngine(_answer, delay=0.001)
    manager = rollout_manager(args, plugin_manager, engine)

    async def main():
        first = await manager.generate(0)
        snapshot = manager.data_states[0]
        await _until(_settled(manager))
        settled = manager.data_state()
        second = await manager.generate(1)
        third = await manager.generate(2)
        task = manager.rollout_state["producer_task"]
        await manager.dispose()
        return first, second, third, task, snapshot, settled

    first, second, third, task, snapshot, settled = asyncio.run(main())
    assert _groups(first) == [0, 1] and [s.index for s in first[1]] == [2, 3]
    assert all(s.reward == 1 and s.status == Status.COMPLETED for g in first for s in g)
    # FIFO: groups 2..5 waited in the queue; rollout 1 takes 2, 3 and leaves 4, 5 (2 leftovers).
    assert _groups(second) == [2, 3] and _groups(third) == [4, 5]
    assert manager.rollout_metrics[1]["rollout/fully_async/queue_size"] == 2
    for rollout_id in (0, 1, 2):
        assert _balanced(manager.rollout_metrics[rollout_id])
    assert manager.rollout_metrics[2]["rollout/accounting/trained"] == 6
    assert task.cancelled()
    # Held groups are checkpointed in the buffer: when rollout 0 returned, groups 2 and 3 had
    # just been launched (saved reset, to start over); once settled, 2..7 are finished.
    assert snapshot["data_source"]["offset"] == 4
    assert [[d["index"] for d in g] for g in snapshot["buffer"]] == [[4, 5], [6, 7]]
    assert all(d["status"] == "aborted" and d["response"] == "" for g in snapshot["buffer"] for d in g)
    assert [g[0]["group_index"] for g in settled["buffer"]] == [2, 3, 4, 5, 6, 7]
    assert all(d["status"] == "completed" and d["reward"] == 1 for g in settled["buffer"] for d in g)


def test_stopping_at_any_moment_leaves_no_task_behind(tmp_path, plugin_manager):
    """Cancelled at any point after a rollout (the engine answers at once, so each step of the event
    loop finds the producer somewhere else), the producer cancels and awaits every task it started,
    its wait for a finished sample included."""
    args = _args(tmp_path)

    async def stop_after(manager, steps):
        await manager.generate(0)
        for _ in range(steps):
            await asyncio.sleep(0)
        await manager.dispose()
        return [t.get_coro().__qualname__ for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    left = {steps: asyncio.run(stop_after(rollout_manager(args, plugin_manager, ScriptedEngine(_answer)), steps))
            for steps in range(30)}
    assert {steps: names for steps, names in left.items() if names} == {}


@pytest.mark.parametrize("handler", ["drop", "retry"])
def test_stale_groups_go_to_the_unused_handler(tmp_path, plugin_manager, handler):
    args = _args(tmp_path, "--max-weight-staleness", "0", "--async-unused-samples-handler", handler)
    engine = ScriptedEngine(_answer, delay=0.001)
    manager = rollout_manager(args, plugin_manager, engine)

    async def main():
        await engine.update_weights([], 1)
        manager.set_weight_version(1)
        first = await manager.generate(0)
        await _until(_settled(manager))  # groups 2..5 queued and 6, 7 finished, all at version 1
        await engine.update_weights([], 2)
        manager.set_weight_version(2)
        second = await manager.generate(1)
        await manager.dispose()
        return first, second

    first, second = asyncio.run(main())
    metrics = manager.rollout_metrics[1]
    assert manager.rollout_metrics[0]["rollout/fully_async/max_staleness"] == 0
    # staleness = 2 - 1 = 1 > 0 for the six groups generated at version 1
    assert metrics["rollout/fully_async/stale_groups_filtered"] == 6
    assert metrics["rollout/fully_async/max_staleness"] == 0
    assert all(s.weight_versions == ["2"] for g in second for s in g)
    if handler == "drop":
        assert _groups(second) == [8, 9]
        assert metrics["rollout/accounting/surplus"] == 6
    else:
        # reset and buffered in order 2, 3, 4, 5, 6, 7: the producer regenerates 2 and 3 first
        assert _groups(second) == [2, 3] and [s.index for s in second[0]] == [4, 5]
        assert all(s.status == Status.COMPLETED and s.reward == 1 for g in second for s in g)
        assert metrics["rollout/accounting/surplus"] == 0
    assert _balanced(metrics)


@pytest.mark.parametrize("handler", ["drop", "retry"])
def test_aborted_groups_go_to_the_unused_handler(tmp_path, plugin_manager, handler):
    args = _args(tmp_path, "--async-unused-samples-handler", handler)
    seen: dict[str, int] = {}

    def answer(prompt, call):
        seen[prompt] = seen.get(prompt, 0) + 1
        if prompt == "1+0=" and seen[prompt] <= 2:  # both samples of group 1's first attempt
            return "\\boxed{1}", "abort"
        return _answer(prompt, call)

    engine = ScriptedEngine(answer, delay=0.001)
    manager = rollout_manager(args, plugin_manager, engine)

    async def main():
        batch = await manager.generate(0)
        await manager.dispose()
        return batch

    batch = asyncio.run(main())
    metrics = manager.rollout_metrics[0]
    assert metrics["rollout/fully_async/aborted_groups_filtered"] == 1
    if handler == "drop":
        assert _groups(batch) == [0, 2]
        assert metrics["rollout/accounting/aborted_dropped"] == 1
    else:
        assert _groups(batch) == [0, 1] and seen["1+0="] == 4
        assert [s.response for s in batch[1]] == ["\\boxed{1}", "\\boxed{1}"]
        assert metrics["rollout/accounting/aborted_dropped"] == 0
    assert all(s.status == Status.COMPLETED for g in batch for s in g)
    assert _balanced(metrics)


def test_filter_drops_are_counted(tmp_path, plugin_manager, register_plugin):
    class RejectFirst:
        @hookimpl
        def filter(self, samples):
            return FilterResult(keep=samples[0].group_index != 0, reason="first")

    register_plugin(RejectFirst(), "reject_first")
    args = _args(tmp_path, "--dynamic-sampling-filter", "reject_first")
    manager = rollout_manager(args, plugin_manager, ScriptedEngine(_answer, delay=0.001))

    async def main():
        batch = await manager.generate(0)
        await manager.dispose()
        return batch

    batch = asyncio.run(main())
    metrics = manager.rollout_metrics[0]
    assert _groups(batch) == [1, 2]
    assert metrics["rollout/dynamic_filter/drop_first"] == 1
    assert metrics["rollout/accounting/filtered"] == 1
    assert _balanced(metrics)


def test_producer_failure_is_raised_by_every_later_rollout(tmp_path, plugin_manager, register_plugin):
    class Broken:
        @hookimpl
        def reward(self, samples):
            if samples[0].index == 0:
                raise ValueError("grader exploded")
            return [1.0 for _ in samples]

    register_plugin(Broken(), "broken_rm")
    args = _args(tmp_path, "--rm-type", "broken_rm")
    manager = rollout_manager(args, plugin_manager, ScriptedEngine(_answer))

    async def main():
        errors = []
        for rollout_id in (0, 1):
            with pytest.raises(PluginError) as excinfo:
                await manager.generate(rollout_id)
            errors.append(str(excinfo.value))
        await manager.dispose()
        return errors

    errors = asyncio.run(main())
    for rollout_id, message in enumerate(errors):
        assert message.startswith(
            f"rollout {rollout_id} failed: --rollout fully_async: the producer stopped with an error, so rollout "
            f"{rollout_id} cannot be filled: reward plugin 'broken_rm' (registered in-process) failed on sample 0")
        assert "ValueError: grader exploded" in message
        assert message.endswith(f"The rollout's samples are in {tmp_path / 'logs' / f'failed_rollout_{rollout_id}.jsonl'}.")


def test_warns_while_no_group_finishes(tmp_path, plugin_manager, monkeypatch, caplog):
    monkeypatch.setattr(fully_async, "WARN_AFTER", 0.05)
    args = _args(tmp_path)
    manager = rollout_manager(args, plugin_manager, ScriptedEngine(_answer, delay=0.03))  # >= 0.27 s per group

    async def main():
        with caplog.at_level(logging.WARNING, logger="furlong.rollout"):
            await manager.generate(0)
        await manager.dispose()

    asyncio.run(main())
    warnings = [r.getMessage() for r in caplog.records if "no group finished" in r.getMessage()]
    assert len(warnings) >= 2
    assert warnings[0].startswith("fully async rollout 0: no group finished in the last ")
    assert warnings[0].endswith(" s (0 of 2 groups taken, 4 samples in flight, queue empty)")


def test_sample_granularity_starts_a_group_when_enough_samples_finished(tmp_path, plugin_manager):
    """Budget 4 samples = 2 groups: the third group starts once two samples finished, before group 0 is done."""
    args = _args(tmp_path, "--async-max-concurrent-samples", "4")
    log: list[tuple[str, str]] = []
    active = {"now": 0, "peak": 0}

    class Tracking(ScriptedEngine):
        async def generate(self, input_ids, sampling_params):
            prompt = self.tokenizer.decode(input_ids)
            active["now"] += 1
            active["peak"] = max(active["peak"], active["now"])
            log.append(("start", prompt))
            try:
                return await super().generate(input_ids, sampling_params)
            finally:
                active["now"] -= 1
                log.append(("end", prompt))

    # the first request of each group is short, the second long
    engine = Tracking(lambda p, call: ("\\boxed{" + p[0] + "}" + ("" if call % 2 else "      "), "stop"), delay=0.002)
    manager = rollout_manager(args, plugin_manager, engine)

    async def main():
        await manager.generate(0)
        await manager.dispose()

    asyncio.run(main())
    assert active["peak"] == 4
    third_group_start = log.index(("start", "2+0="))
    last_end_of_group_0 = max(i for i, entry in enumerate(log) if entry == ("end", "0+0="))
    assert third_group_start < last_end_of_group_0


@pytest.mark.parametrize("rbs, n, limit, expected", [
    (4, 2, None, 4),  # no limit: rollout_batch_size groups
    (4, 2, 6, 3),     # 6 // 2
    (4, 4, 7, 1),     # 7 // 4
    (4, 4, 3, 1),     # at least one group
])
def test_groups_in_flight(rbs, n, limit, expected):
    assert fully_async._groups_in_flight(rbs, n, limit) == expected


@pytest.mark.parametrize("factor, rbs, expected", [(2.0, 2, 4), (1.5, 3, 4), (0.1, 4, 1), (1.0, 8, 8)])
def test_queue_capacity(factor, rbs, expected):
    # floor(factor * rbs), at least 1: floor(4.5) = 4, floor(0.4) = 0 -> 1
    assert fully_async._queue_capacity(factor, rbs) == expected


def test_staleness_uses_the_oldest_version_of_the_group():
    from furlong.hooks import Sample

    group = [Sample(weight_versions=["3", "5"]), Sample(weight_versions=["4"])]
    assert fully_async._staleness(group, 6) == 3  # 6 - min(3, 5, 4)
    assert fully_async._staleness(group, None) == 0
    assert fully_async._staleness([Sample()], 6) == 0


def test_weight_version_never_goes_backwards(tmp_path, plugin_manager):
    manager = rollout_manager(_args(tmp_path), plugin_manager, ScriptedEngine(_answer))
    manager.set_weight_version(2)
    manager.set_weight_version(2)
    with pytest.raises(PluginError) as excinfo:
        manager.set_weight_version(1)
    assert str(excinfo.value) == "weight version went backwards: 1 after 2; each weight sync must increase it."
    assert manager.weight_version == 2
