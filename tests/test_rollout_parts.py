"""The parts of the rollout manager: group ledger, sample runner, tracked data view, data state."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from furlong.core.config.launch_args import launch_config
from furlong.core.rollout.data_state import data_state
from furlong.core.rollout.generation_progress import GenerationProgress
from furlong.core.rollout.group_ledger import GroupLedger, group_id
from furlong.core.rollout.rollout_metrics import accounting_metrics
from furlong.core.rollout.sample_runner import sample_seed, train_sampling_params
from furlong.core.rollout.tracked_data import TrackedData
from furlong.hooks import PluginError, Status
from furlong.hooks.testing.inputs import sample_group

from .scripted_engine import ScriptedEngine, boxed_first_operand, rollout_manager


def _config(tmp_path, *extra):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+0=", "label": str(i)}) + "\n" for i in range(40)))
    return launch_config("--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
                         "--prompt-data", str(path), "--input-key", "prompt", "--label-key", "label",
                         "--rm-type", "math", "--rollout-max-response-len", "16", "--log-dir", str(tmp_path / "logs"),
                         *extra)


def _slow_after_two(prompt, call):
    """Prompts from 2 on answer 3 tokens longer, so they finish after prompts 0 and 1."""
    i = int(prompt.split("+")[0])
    return "\\boxed{" + str(i) + "}" + ("..." if i >= 2 else ""), "stop"


def _counters() -> dict:
    return {"drawn": 0, "trained": 0, "filtered": 0, "surplus": 0, "aborted_dropped": 0}


def _aborted(group):
    group[-1].status = Status.ABORTED
    return group


# --- group ledger ----------------------------------------------------------------------------


def test_a_group_is_known_by_the_group_index_its_samples_carry():
    assert group_id(sample_group(2, group_index=7, first_index=14)) == 7


@pytest.mark.parametrize("group, what", [([], "an empty group"),
                                         (sample_group(2, group_index=None), "sample 0 has no group_index")])
def test_a_group_without_an_id_is_refused(group, what):
    with pytest.raises(PluginError, match=what):
        group_id(group)


def test_settling_counts_each_handed_out_group_once_by_where_it_went():
    ledger = GroupLedger()
    trained, surplus, dropped, rejected, buffered, held = (sample_group(2, group_index=g, first_index=2 * g)
                                                           for g in range(6))
    _aborted(dropped)
    ledger.handed_out([trained, surplus, dropped, rejected, buffered, held])
    ledger.handed_out([[*surplus]])  # the same group in another list: one group
    ledger.hold([held])
    ledger.reject(rejected, None)
    counters = _counters()
    window = ledger.settle([trained], {group_id(buffered)}, counters)
    assert counters == {"drawn": 0, "trained": 1, "filtered": 1, "surplus": 1, "aborted_dropped": 1}
    assert window == {"drops": {"unspecified": 1}, "drawn": 7, "kept": 1, "filtered": 1, "held": 1}
    assert ledger.held() == [held] and ledger.handed_out_groups() == [] and ledger.drop_counts() == {}


def test_a_released_group_is_counted_in_the_window_it_was_released_in():
    ledger = GroupLedger()
    group = _aborted(sample_group(2, group_index=3, first_index=6))
    ledger.handed_out([group])
    ledger.hold([group])
    counters = _counters()
    ledger.settle([], set(), counters)
    assert counters["aborted_dropped"] == 0 and ledger.held() == [group]
    ledger.release([group])
    ledger.settle([], set(), counters)
    assert counters["aborted_dropped"] == 1 and ledger.held() == []


def test_accounting_metrics_keep_their_names_and_order():
    window = {"drops": {"zero_std": 2}, "drawn": 6, "kept": 2, "filtered": 2, "held": 1}
    counters = {"drawn": 6, "trained": 2, "filtered": 2, "surplus": 1, "aborted_dropped": 0}
    assert list(accounting_metrics(window, counters, buffered=1).items()) == [
        ("rollout/dynamic_filter/drop_zero_std", 2.0), ("rollout/dynamic_filter/groups_drawn", 6.0),
        ("rollout/dynamic_filter/groups_kept", 2.0), ("rollout/dynamic_filter/groups_dropped", 2.0),
        ("rollout/accounting/drawn", 6.0), ("rollout/accounting/trained", 2.0),
        ("rollout/accounting/filtered", 2.0), ("rollout/accounting/surplus", 1.0),
        ("rollout/accounting/aborted_dropped", 0.0), ("rollout/accounting/buffered", 1.0),
        ("rollout/accounting/held", 1.0)]


def test_buffered_groups_keep_their_ids_across_abort_and_a_resumed_run(tmp_path, plugin_manager):
    config = _config(tmp_path, "--over-sampling-batch-size", "4", "--partial-rollout",
                     "--rollout-max-response-len", "12")
    manager = rollout_manager(config, plugin_manager, ScriptedEngine(_slow_after_two, delay=0.002))
    asyncio.run(manager.generate(0))
    assert [group_id(g) for g in manager.cursor.buffer] == [2, 3]
    state = json.loads(json.dumps(manager.data_state()))
    assert sorted(state) == ["buffer", "counters", "data_source", "group_index", "sample_index"]

    resumed = rollout_manager(config, plugin_manager, ScriptedEngine(_slow_after_two, delay=0.002))
    resumed.cursor.load_state(state)
    groups = asyncio.run(resumed.generate(1))
    assert [group_id(g) for g in groups] == [2, 3]
    assert [[s.index for s in g] for g in groups] == [[4, 5], [6, 7]]
    metrics = resumed.rollout_metrics[1]
    assert {k: metrics[f"rollout/accounting/{k}"] for k in ("drawn", "trained", "surplus", "aborted_dropped",
                                                            "buffered")} == {
        "drawn": 6.0, "trained": 4.0, "surplus": 0.0, "aborted_dropped": 0.0, "buffered": 2.0}
    assert [group_id(g) for g in resumed.cursor.buffer] == [4, 5]


# --- sample runner -------------------------------------------------------------------------


def test_each_request_is_seeded_from_seed_sample_index_and_phase(tmp_path, plugin_manager):
    config = _config(tmp_path, "--seed", "7")
    engine = ScriptedEngine(boxed_first_operand)
    manager = rollout_manager(config, plugin_manager, engine)
    first, second = manager.cursor.new_groups([{"prompt": "3+0=", "label": "3"}, {"prompt": "5+0=", "label": "5"}])

    async def both_in_reverse_order():
        await asyncio.gather(manager.runner.generate_group(second), manager.runner.generate_group(first))

    asyncio.run(both_in_reverse_order())
    seeds = sorted(r["sampling_seed"] for r in engine.requests)
    assert seeds == sorted(sample_seed(7, i, evaluation=False) for i in range(4))
    assert sample_seed(7, 0, evaluation=False) == 445282911550748068
    assert sample_seed(7, 0, evaluation=True) == 1786643095451209326
    assert all(s.reward == 1 for s in first + second)


def test_a_seed_in_the_sampling_params_is_kept_and_evaluation_is_not_progress(tmp_path, plugin_manager):
    engine = ScriptedEngine(boxed_first_operand)
    manager = rollout_manager(_config(tmp_path), plugin_manager, engine)
    [group] = manager.cursor.new_groups([{"prompt": "3+0="}])
    params = {**train_sampling_params(manager.config), "sampling_seed": 11}
    asyncio.run(manager.generate_group(group, evaluation=True, sampling_params=params))
    assert [r["sampling_seed"] for r in engine.requests] == [11, 11]
    assert manager.progress == {"samples_done": 0, "tokens": 0, "samples_total": 0}


def test_after_an_abort_no_request_is_sent_until_it_is_cleared(tmp_path, plugin_manager):
    engine = ScriptedEngine(boxed_first_operand)
    manager = rollout_manager(_config(tmp_path), plugin_manager, engine)
    first, second = manager.cursor.new_groups([{"prompt": "3+0=", "label": "3"}, {"prompt": "5+0=", "label": "5"}])
    asyncio.run(manager.runner.abort(0))
    asyncio.run(manager.runner.generate_group(first))
    assert engine.requests == [] and engine.abort_calls == 1
    assert [(s.status, s.reward) for s in first] == [(Status.ABORTED, None)] * 2
    engine.reset_abort()
    manager.runner.clear_abort()
    asyncio.run(manager.runner.generate_group(second))
    assert [(s.status, s.reward) for s in second] == [(Status.COMPLETED, 1)] * 2
    assert manager.progress == {"samples_done": 2, "tokens": 18, "samples_total": 0}


def test_training_sampling_params_hand_stop_lists_as_lists(tmp_path):
    config = _config(tmp_path, "--rollout-stop", "</s>", "--rollout-stop-token-ids", "2", "3")
    params = train_sampling_params(config)
    assert params["stop"] == ["</s>"] and params["stop_token_ids"] == [2, 3]
    assert params["max_new_tokens"] == 16 and params["no_stop_trim"] is True


# --- the data the rollout plugin sees, and the data state --------------------------------------


def test_the_tracked_data_records_hand_outs_and_holds_through_the_ledger(tmp_path, plugin_manager):
    manager = rollout_manager(_config(tmp_path), plugin_manager, ScriptedEngine(boxed_first_operand))
    ledger, progress = GroupLedger(), GenerationProgress()
    data = TrackedData(manager.cursor, ledger, progress)
    groups = asyncio.run(data.get_samples(3))
    assert ledger.handed_out_groups() == groups and progress.samples_total == 6
    data.hold(groups[:2])
    data.add_samples(groups[:1])
    assert ledger.held() == [groups[1]] and data.buffer_len() == 1
    data.release([groups[1]])
    assert ledger.held() == [] and ledger.handed_out_groups() == [*groups, groups[1]]


def test_held_groups_are_saved_in_the_buffer_unfinished_ones_reset(tmp_path, plugin_manager):
    manager = rollout_manager(_config(tmp_path), plugin_manager, ScriptedEngine(boxed_first_operand))
    finished = sample_group(2, group_index=0, scored=True)
    unfinished = _aborted(sample_group(2, group_index=1, first_index=2))
    state = data_state(manager.cursor, [finished, unfinished])
    assert state["buffer"][0] == [s.to_dict() for s in finished]
    assert [(d["status"], d["response_length"], d["response"], d["index"]) for d in state["buffer"][1]] == [
        ("aborted", 0, "", 2), ("aborted", 0, "", 3)]


def test_a_data_state_saved_before_the_split_resumes_with_its_group_ids(tmp_path, plugin_manager):
    """``tests/data/partial_rollout_state.json``: the state after rollout 0 of the partial-rollout run above,
    written by the rollout manager before it was split into parts (groups 2 and 3 buffered half-generated)."""
    state = json.loads((Path(__file__).parent / "data" / "partial_rollout_state.json").read_text())
    config = _config(tmp_path, "--over-sampling-batch-size", "4", "--partial-rollout",
                     "--rollout-max-response-len", "12")
    manager = rollout_manager(config, plugin_manager, ScriptedEngine(_slow_after_two, delay=0.002))
    manager.cursor.load_state(state)
    groups = asyncio.run(manager.generate(1))
    assert [group_id(g) for g in groups] == [2, 3]
    assert [(s.index, s.status, s.response_length) for g in groups for s in g] == [
        (i, Status.TRUNCATED, 12) for i in (4, 5, 6, 7)]
    assert manager.cursor.counters == {"drawn": 6, "trained": 4, "filtered": 0, "surplus": 0, "aborted_dropped": 0}
    assert [group_id(g) for g in manager.cursor.buffer] == [4, 5]


def test_sample_routed_experts_cover_every_fed_token_and_round_trip_as_lists():
    import numpy as np

    from furlong.hooks import Sample

    routed = np.arange(4 * 2 * 2, dtype=np.int32).reshape(4, 2, 2)
    sample = Sample(tokens=[5, 6, 7, 8, 9], response_length=2, rollout_routed_experts=routed)
    sample.validate()
    back = Sample.from_dict(sample.to_dict())
    assert back.rollout_routed_experts == routed.tolist()
    short = Sample(index=3, tokens=[5, 6, 7, 8, 9], response_length=2, rollout_routed_experts=routed[:3])
    with pytest.raises(ValueError, match=r"sample 3: len\(rollout_routed_experts\)=3 != len\(tokens\) - 1=4"):
        short.validate()
    sample.reset_for_retry()
    assert sample.rollout_routed_experts is None
