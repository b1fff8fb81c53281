"""`furlong train` end to end on a real (tiny) Hugging Face model: metrics, eval, observers."""

import gc
import json

import pytest

from furlong.hooks import hookimpl

REQUIRED_KEYS = {
    "rollout/step": ["rollout/raw_reward", "rollout/response_lengths", "rollout/truncated", "train/pg_loss",
                     "train/pg_clipfrac", "train/kl_loss", "train/entropy_loss", "train/grad_norm",
                     "perf/rollout_time", "perf/train_time", "perf/update_weights_time"],
    "train/step": ["train/pg_loss", "train/pg_clipfrac", "train/ppo_kl", "train/kl_loss", "train/entropy_loss",
                   "train/grad_norm", "train/lr"],
    "eval/step": ["eval/arith", "eval/arith-truncated_ratio", "eval/arith/response_len/mean"],
}


def is_frozen(obj) -> bool:
    """Whether ``gc.freeze`` moved ``obj`` out of the collector's generations."""
    return gc.is_tracked(obj) and not any(o is obj for generation in range(3) for o in gc.get_objects(generation))


class Recorder:
    """An observer plugin registered in-process: records what the loop tells observers."""

    def __init__(self):
        self.calls = []
        self.kept = []  # one object made and kept at each rollout's end

    @hookimpl
    def on_rollout_end(self, rollout_id, metrics):
        self.calls.append(("rollout", rollout_id, dict(metrics)))
        self.calls.append(("frozen", rollout_id, [is_frozen(kept) for kept in self.kept]))
        self.kept.append([rollout_id])  # a list stays tracked by the garbage collector

    @hookimpl
    def on_train_step_end(self, rollout_id, step, metrics):
        self.calls.append(("step", step, dict(metrics)))

    @hookimpl
    def on_eval_end(self, rollout_id, metrics):
        self.calls.append(("eval", rollout_id, dict(metrics)))

    @hookimpl
    def on_checkpoint_saved(self, rollout_id, path):
        self.calls.append(("checkpoint", rollout_id, path))


@pytest.fixture(scope="module")
def short_run(tmp_path_factory, tiny_model_dir, arithmetic_jsonl):
    """Three rollouts, two optimizer steps each, KL loss on, eval every 2 rollouts, saves; objects are frozen
    after the first rollout only (``WARMUP_FREEZES`` 1)."""
    import asyncio

    from furlong.core.config.launch_args import launch_config
    from furlong.core.run.loop import run
    from furlong.core.plugins.manager import get_plugin_manager
    from furlong.core.plugins.selection import resolve_selection

    save = tmp_path_factory.mktemp("run") / "save"
    argv = ["--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(arithmetic_jsonl), "--input-key", "prompt",
            "--label-key", "label", "--rm-type", "math", "--num-rollout", "3", "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "4", "--num-steps-per-rollout", "2", "--rollout-max-response-len", "6",
            "--use-kl-loss", "--kl-loss-coef", "0.01", "--kl-loss-type", "low_var_kl", "--lr", "1e-3",
            "--eval-prompt-data", "arith", str(arithmetic_jsonl) + "@[0:6]", "--eval-interval", "2",
            "--save", str(save), "--save-interval", "2", "--save-hf", str(save.parent / "hf" / "r{rollout_id}")]
    pm = get_plugin_manager()
    recorder = Recorder()
    pm.register(recorder, name="recorder")
    config = launch_config(*argv, pm=pm)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("furlong.core.run.loop.WARMUP_FREEZES", 1)
        asyncio.run(run(config, pm, resolve_selection(config, pm)))
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    return save, rows, recorder.calls


def test_metrics_jsonl_has_every_documented_key(short_run):
    _, rows, _ = short_run
    for step_key, keys in REQUIRED_KEYS.items():
        mine = [r for r in rows if step_key in r]
        assert mine, step_key
        for row in mine:
            missing = [k for k in keys if k not in row]
            assert not missing, (step_key, missing)
    assert [r["rollout/step"] for r in rows if "rollout/step" in r] == [0, 1, 2]
    assert [r["train/step"] for r in rows if "train/step" in r] == [0, 1, 2, 3, 4, 5]
    # eval before training (rollout 0), then at rollout 1 ((1+1) % 2 == 0) and the last one (2).
    assert [r["eval/step"] for r in rows if "eval/step" in r] == [0, 1, 2]


def test_values_are_in_range(short_run):
    _, rows, _ = short_run
    for row in (r for r in rows if "rollout/step" in r):
        assert 0.0 <= row["rollout/raw_reward"] <= 1.0
        assert 0.0 < row["rollout/response_lengths"] <= 6
        assert 0.0 <= row["rollout/truncated"] <= 1.0
        assert row["train/kl_loss"] >= 0.0 and row["train/grad_norm"] >= 0.0
    first_step = next(r for r in rows if r.get("train/step") == 0)
    # The policy equals the reference before the first update: KL exactly 0, ratio 1.
    assert first_step["train/kl_loss"] == pytest.approx(0.0, abs=1e-7)
    assert first_step["train/pg_clipfrac"] == 0.0


def test_hook_on_rollout_end_and_other_observers_fire_with_the_logged_metrics(short_run):
    save, rows, calls = short_run
    kinds = [c[0] for c in calls]
    assert kinds.count("rollout") == 3 and kinds.count("step") == 6 and kinds.count("eval") == 3
    assert [c[1:] for c in calls if c[0] == "checkpoint"] == [(1, str(save / "iter_0000001")),
                                                             (2, str(save / "iter_0000002"))]
    logged = next(r for r in rows if r.get("rollout/step") == 2)
    observed = next(c[2] for c in calls if c[0] == "rollout" and c[1] == 2)
    assert observed["rollout/raw_reward"] == logged["rollout/raw_reward"]


def test_objects_that_survive_the_warm_up_rollouts_are_frozen_then_no_more(short_run):
    """What the first rollouts made and kept (compiled graphs on a GPU; here the recorder's own records) leaves
    the garbage collector's scans, so later full collections stay short; later rollouts freeze nothing."""
    _, _, calls = short_run
    assert [c[2] for c in calls if c[0] == "frozen"] == [[], [True], [True, False]]
    assert gc.get_freeze_count() == 0  # the run unfroze everything when it returned


def test_a_caller_that_froze_objects_keeps_them_frozen_after_a_run(tiny_model_dir, arithmetic_jsonl):
    import asyncio

    from furlong.core.config.launch_args import launch_config
    from furlong.core.plugins.manager import get_plugin_manager
    from furlong.core.plugins.selection import resolve_selection
    from furlong.core.run.loop import run

    pm = get_plugin_manager()
    config = launch_config("--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(arithmetic_jsonl),
                           "--input-key", "prompt", "--label-key", "label", "--rm-type", "math", "--num-rollout", "1",
                           "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len",
                           "4", pm=pm)
    mine = ["the embedding program's"]
    gc.freeze()
    try:
        asyncio.run(run(config, pm, resolve_selection(config, pm)))
        assert is_frozen(mine)
    finally:
        gc.unfreeze()


def test_checkpoints_follow_the_save_cadence(short_run):
    save, _, _ = short_run
    assert sorted(p.name for p in save.iterdir() if p.name.startswith("iter_")) == ["iter_0000001", "iter_0000002"]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    state = json.loads((save / "rollout" / "state_2.json").read_text())
    assert state["counters"]["trained"] == 6 and state["group_index"] == 6


def test_save_hf_writes_a_hugging_face_model_equal_to_each_checkpoint(short_run, tiny_model_dir):
    """--save-hf: at every save a from_pretrained-loadable directory holding the checkpoint's weights."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    save, _, _ = short_run
    assert sorted(p.name for p in (save.parent / "hf").iterdir()) == ["r1", "r2"]
    exported = AutoModelForCausalLM.from_pretrained(save.parent / "hf" / "r2").state_dict()
    checkpoint = {}
    for f in sorted((save / "iter_0000002").rglob("*.safetensors")):
        checkpoint.update(load_file(f))
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    shared = sorted(set(checkpoint) & set(exported))
    assert shared and all(torch.equal(exported[k], checkpoint[k].to(exported[k].dtype)) for k in shared)
    assert any(not torch.equal(exported[k], initial[k]) for k in shared)  # trained weights, not the start


def _documented_metric_patterns() -> list:
    """Regexes of the keys in PLUGINS.md's metrics reference (first column; ``<x>`` is a placeholder).

    In a cell, ``/median`` continues the previous key's path and ``groups_kept`` replaces
    its last segment.
    """
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "PLUGINS.md").read_text()
    section = text.split("## Metrics reference", 1)[1].split("\n## ", 1)[0]
    patterns = []
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        previous = None
        for item in re.findall(r"`([^`]+)`", line.split(" | ")[0]):
            if item.startswith("/") and previous:
                key = previous.rsplit("/", 1)[0] + item
            elif "/" not in item and previous:
                key = previous.rsplit("/", 1)[0] + "/" + item
            else:
                key = item
            previous = key
            patterns.append(re.compile(re.sub(r"<\w+>", ".+", re.escape(key).replace(r"\<", "<").replace(r"\>", ">"))))
    return patterns


def test_every_logged_key_is_in_the_metrics_reference(short_run):
    _, rows, _ = short_run
    patterns = _documented_metric_patterns()
    logged = {key for row in rows for key in row}
    assert sorted(k for k in logged if not any(p.fullmatch(k) for p in patterns)) == []
    assert any(p.fullmatch("rollout/response_len/median") for p in patterns)  # the shorthand is read
