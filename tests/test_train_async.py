"""``furlong train-async`` end to end on the tiny real model.

The loop runs in-process (``run`` from ``furlong.core.run.loop``) with the embedded engine and
the fsdp backend on CPU. A recording filter (keeps everything) sees every group with its
rollout id, so the weight versions the samples were generated with can be checked.
"""

import asyncio
import json

import pytest

from furlong.core.config.launch_args import launch_config
from furlong.core.run.loop import run
from furlong.core.plugins.selection import resolve_selection
from furlong.hooks import hookimpl

from .tiny_model import build_tiny_model, record_module_calls


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "label": str(2 * i)}) + "\n" for i in range(20)))
    return build_tiny_model(root / "model"), data


class Recorder:
    """A filter that keeps every group and records ``(rollout_id, weight versions)``."""

    def __init__(self):
        self.seen: list[tuple[int, list[int]]] = []

    @hookimpl
    def filter(self, samples, rollout_id):
        self.seen.append((rollout_id, [int(v) for s in samples for v in s.weight_versions]))
        return True


def _train_async(tmp_path, tiny, pm, *extra):
    model, data = tiny
    config = launch_config("--num-rollout", "3", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
                           "--global-batch-size", "4", "--hf-checkpoint", str(model), "--prompt-data", str(data),
                           "--input-key", "prompt", "--label-key", "label", "--rm-type", "deterministic_random",
                           "--rollout-max-response-len", "8", "--dynamic-sampling-filter", "recorder",
                           "--save", str(tmp_path / "ckpt"), "--save-interval", "1", *extra, pm=pm,
                           command="train-async")

    async def main():
        await run(config, pm, resolve_selection(config, pm))
        # what is still pending besides the embedded engine's own scheduler and the decode it may
        # still be finishing for cancelled requests (both live as long as the engine; the decode runs
        # through furlong.kit.compute_thread.run_compute)
        names = [t.get_coro().__qualname__ for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        return [name for name in names if name not in ("EmbeddedEngine._work", "run_compute")]

    leftover_tasks = asyncio.run(main())
    lines = (tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()
    rollouts = [r for r in map(json.loads, lines) if "rollout/step" in r]
    return rollouts, leftover_tasks


def _versions_per_rollout(recorder):
    per: dict[int, set[int]] = {}
    for rollout_id, versions in recorder.seen:
        per.setdefault(rollout_id, set()).update(versions)
    return per


def test_train_async_is_one_step_off_policy_and_overlaps(tmp_path, tiny, plugin_manager, register_plugin):
    recorder = register_plugin(Recorder(), "recorder")
    rollouts, leftover = _train_async(tmp_path, tiny, plugin_manager)
    assert [r["rollout/step"] for r in rollouts] == [0, 1, 2]
    # Sync before rollout 0 = version 1; rollout r + 1 is generated while r trains, with the
    # weights of the sync after r - 1: versions 1, 1, 2 (sync train would use 1, 2, 3).
    assert _versions_per_rollout(recorder) == {0: {1}, 1: {1}, 2: {2}}
    seen_order = [v for _, versions in recorder.seen for v in versions]
    assert seen_order == sorted(seen_order)  # never backwards
    for r in (0, 1):
        now, nxt = rollouts[r], rollouts[r + 1]
        # generation of r + 1 starts after generation of r and before training of r ends
        assert now["timeline/generate_end"] <= nxt["timeline/generate_start"] < now["timeline/train_end"]
        assert now["timeline/train_end"] <= nxt["timeline/train_start"]
    assert all("perf/update_weights_time" in r for r in rollouts)
    for r in rollouts:
        assert r["perf/train_wait_time"] >= 0 and 0 <= r["perf/wait_time_ratio"] <= 1
    # rollout 0's checkpoint keeps the data state of when its batch was drawn (2 prompts),
    # although rollout 1 had drawn 2 more before the save
    state = json.loads((tmp_path / "ckpt" / "rollout" / "state_0.json").read_text())
    assert state["data_source"]["offset"] == 2 and state["group_index"] == 2 and state["counters"]["drawn"] == 2
    state = json.loads((tmp_path / "ckpt" / "rollout" / "state_2.json").read_text())
    assert state["data_source"]["offset"] == 6 and state["counters"]["trained"] == 6
    assert leftover == []


def test_every_module_pass_of_the_engine_and_the_trainer_holds_the_process_turn(tmp_path, tiny, plugin_manager,
                                                                                register_plugin, monkeypatch):
    """Engine and trainer share this process and run at once: a module called outside the turn could meet
    the other thread's first compiled call (torch.fx patches ``Module.__call__`` process-wide) or a CUDA
    graph capture."""
    calls, outside = record_module_calls(monkeypatch)
    register_plugin(Recorder(), "recorder")
    rollouts, _ = _train_async(tmp_path, tiny, plugin_manager)
    assert [r["rollout/step"] for r in rollouts] == [0, 1, 2]
    assert outside == []
    kinds = {name for _, name in calls}
    assert {"Embedding", "Linear"} <= kinds and len(calls) > 100  # the engine's passes and the trainer's


def test_update_weights_interval_syncs_every_k_rollouts(tmp_path, tiny, plugin_manager, register_plugin):
    recorder = register_plugin(Recorder(), "recorder")
    rollouts, _ = _train_async(tmp_path, tiny, plugin_manager, "--update-weights-interval", "2")
    # (r + 1) % 2 == 0 only for r = 1, after rollout 2 finished generating: every rollout used version 1
    assert ["perf/update_weights_time" in r for r in rollouts] == [False, True, False]
    assert _versions_per_rollout(recorder) == {0: {1}, 1: {1}, 2: {1}}


def test_fully_async_under_train_async_stops_its_producer(tmp_path, tiny, plugin_manager, register_plugin):
    recorder = register_plugin(Recorder(), "recorder")
    rollouts, leftover = _train_async(tmp_path, tiny, plugin_manager, "--rollout", "fully_async")
    assert [r["rollout/step"] for r in rollouts] == [0, 1, 2]
    assert all(r["rollout/dynamic_filter/groups_kept"] == 2 for r in rollouts)
    versions = [v for _, vs in recorder.seen for v in vs]
    assert min(versions) == 1 and max(versions) <= 3
    for r in rollouts:
        # staleness = version at the rollout's start - oldest version of a taken group
        assert 0 <= r["rollout/fully_async/avg_staleness"] <= r["rollout/fully_async/max_staleness"] <= 2
    assert leftover == []  # the producer was cancelled and awaited when the run ended
