"""Miles' logging flags: pass@k, reward categories, correct samples, multi-turn lengths, the log interval and the
custom log functions, by hand counts and end to end on the tiny model."""

import asyncio
import json
import sys
import textwrap

import pytest
import torch

from furlong.core.config.launch_args import launch_config
from furlong.core.run.extra_metrics import (correct_sample_metrics, multi_turn_metrics, pass_at_k, passrate_metrics,
                                            reward_category_metrics)
from furlong.hooks import PluginError, Sample, Status


def _group(rewards, group_index=0, **fields):
    return [Sample(index=group_index * 10 + i, group_index=group_index, reward=r, status=Status.COMPLETED, **fields)
            for i, r in enumerate(rewards)]


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(4, 1, 1) == 0.25
    assert pass_at_k(4, 1, 2) == 0.5       # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(4, 2, 2) == 1 - 1 / 6  # 1 - C(2,2)/C(4,2)
    assert pass_at_k(4, 2, 3) == 1.0        # fewer than 3 wrong: every 3 drawn hold a right one
    assert pass_at_k(4, 0, 4) == 0.0


def test_passrate_equals_a_hand_count():
    groups = [_group([1, 0, 0, 0], 0), _group([1, 1, 0, 0], 1), _group([0, 0, 0, 0], 2)]
    # pass@1: mean c/n = (1/4 + 2/4 + 0) / 3; pass@2: (1/2 + 5/6 + 0) / 3; pass@4: (1 + 1 + 0) / 3
    assert passrate_metrics(groups, 4, None) == pytest.approx(
        {"pass@1": 0.25, "pass@2": (0.5 + 5 / 6) / 3, "pass@4": 2 / 3}, abs=1e-15)


def test_passrate_leaves_out_incomplete_groups_and_reads_the_reward_key(caplog):
    groups = [_group([{"acc": 1}, {"acc": 0}], 0), _group([{"acc": 1}], 1)]
    assert passrate_metrics(groups, 2, "acc") == {"pass@1": 0.5, "pass@2": 1.0}
    assert "1 of 2 groups do not have 2 samples and are left out" in caplog.text
    assert passrate_metrics(groups, 1, "acc") == {}


def test_reward_category_is_the_share_of_each_value():
    samples = _group([{"score": 1, "kind": "ok"}, {"score": 0, "kind": "format"}, {"score": 0, "kind": "format"},
                      {"score": 0, "kind": "wrong"}])
    assert reward_category_metrics(samples, "kind") == {"error_cat/ok": 0.25, "error_cat/format": 0.5,
                                                        "error_cat/wrong": 0.25}
    with pytest.raises(PluginError, match=r"--log-reward-category kind: sample 0's reward 1.0 is not a dict"):
        reward_category_metrics(_group([1.0]), "kind")


def test_correct_samples_length_quarters_and_negative_log_prob():
    samples = [Sample(index=i, reward=r, response_length=n, loss_mask=[1] * n, rollout_log_probs=[-0.5] * n)
               for i, (r, n) in enumerate([(1, 2), (1, 5), (1, 8), (0, 3), (1, 12)])]
    samples[1].loss_mask = [1, 1, 1, 0, 0]
    samples[1].rollout_log_probs = [-1.0, -2.0, -3.0, -9.0, -9.0]
    # max 8: quarters up to 2, 4, 6, 8; correct lengths 2, 5, 8 (12 is over the budget and not counted)
    found = correct_sample_metrics(samples, None, 8)
    assert {k: v for k, v in found.items() if k.startswith("correct_length")} == {
        "correct_length/p25": 1 / 3, "correct_length/p50": 0.0, "correct_length/p75": 1 / 3,
        "correct_length/p100": 1 / 3}
    assert found["correct_entropy"] == pytest.approx((0.5 + 2.0 + 0.5 + 0.5) / 4)
    assert correct_sample_metrics(samples[3:4], None, 8) == {
        "correct_length/p25": 0.0, "correct_length/p50": 0.0, "correct_length/p75": 0.0, "correct_length/p100": 0.0,
        "correct_entropy": 0.0}


def test_multi_turn_lengths_with_and_without_observations():
    samples = [Sample(index=0, response_length=6, loss_mask=[1, 1, 0, 0, 1, 1], metadata={"round_number": 2}),
               Sample(index=1, response_length=10, loss_mask=[1] * 4 + [0] * 6, metadata={"round_number": 3})]
    assert multi_turn_metrics(samples, 10) == {
        "raw_response_length/response_length_mean": 8.0, "raw_response_length/response_length_max": 10.0,
        "raw_response_length/response_length_min": 6.0, "raw_response_length/response_length_clip_ratio": 0.5,
        "wo_obs_response_length/response_length_mean": 4.0, "wo_obs_response_length/response_length_max": 4.0,
        "wo_obs_response_length/response_length_min": 4.0, "multi_turn_metric/round_number_mean": 2.5,
        "multi_turn_metric/round_number_max": 3.0, "multi_turn_metric/round_number_min": 2.0}


# --- end to end -------------------------------------------------------------------------------------------------


def _run(model, data, out, *extra) -> list[dict]:
    from furlong.core.plugins.manager import get_plugin_manager
    from furlong.core.plugins.selection import resolve_selection
    from furlong.core.run.loop import run

    argv = ["--hf-checkpoint", str(model), "--prompt-data", str(data), "--input-key", "prompt", "--label-key", "label",
            "--rollout-batch-size", "3", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "6",
            "--seed", "3", "--log-dir", str(out), *extra]
    pm = get_plugin_manager()
    config = launch_config(*argv, pm=pm)
    asyncio.run(run(config, pm, resolve_selection(config, pm)))
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _hand_pass_at(samples: list[dict], n: int, k: int) -> float:
    by_group: dict = {}
    for s in samples:
        by_group.setdefault(s["group_index"], []).append(s["reward"] == 1)
    return sum(pass_at_k(n, sum(g), k) for g in by_group.values()) / len(by_group)


@pytest.mark.usefixtures("cpu_machine", "one_torch_thread")
def test_logged_passrate_and_categories_equal_counts_of_the_saved_samples(tmp_path, tiny_model_dir, arithmetic_jsonl,
                                                                          capsys):
    rows = _run(tiny_model_dir, arithmetic_jsonl, tmp_path, "--rm-type", "deterministic_random", "--num-rollout", "3",
                "--log-passrate", "--log-correct-samples", "--log-multi-turn", "--log-interval", "2",
                "--save-debug-rollout-data", str(tmp_path / "d" / "{rollout_id}.pt"))
    rollouts = [r for r in rows if "rollout/step" in r]
    for row in rollouts:
        samples = torch.load(tmp_path / "d" / f"{row['rollout/step']}.pt", weights_only=True)["samples"]
        for k in (1, 2, 4):
            assert row[f"passrate/pass@{k}"] == pytest.approx(_hand_pass_at(samples, 4, k), abs=1e-12)
        correct = [s for s in samples if s["reward"] == 1]
        in_first_quarter = sum(1 for s in correct if s["response_length"] <= 1.5)
        assert row["rollout/correct_length/p25"] == pytest.approx(in_first_quarter / len(correct) if correct else 0.0)
        lengths = [s["response_length"] for s in samples]
        assert row["multi_turn/raw_response_length/response_length_max"] == max(lengths)
    assert 0 < rollouts[0]["passrate/pass@1"] < rollouts[0]["passrate/pass@4"] <= 1
    out = capsys.readouterr().out
    printed = [line.split("|")[0].strip() for line in out.splitlines() if line.startswith("rollout ")]
    assert printed == ["rollout    1", "rollout    2"]  # every 2nd rollout, and the last


@pytest.fixture
def log_functions(tmp_path, monkeypatch):
    """A module ``my_logs`` with Miles-style log functions that record their calls in ``my_logs.CALLS``."""
    (tmp_path / "my_logs.py").write_text(textwrap.dedent("""
        CALLS = []

        def rollout_log(rollout_id, args, samples, extra, rollout_time):
            CALLS.append(("rollout", rollout_id, len(samples), sorted(extra), rollout_time, args.n_samples_per_prompt))
            return rollout_id == 0

        async def eval_log(rollout_id, args, data, extra):
            CALLS.append(("eval", rollout_id, {k: (len(v["rewards"]), len(v["truncated"]), len(v["samples"]))
                                               for k, v in data.items()}, sorted(extra)))
            return True
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("my_logs", None)


@pytest.mark.usefixtures("cpu_machine", "one_torch_thread", "log_functions")
def test_custom_log_functions_get_miles_arguments_and_true_suppresses(tmp_path, tiny_model_dir, arithmetic_jsonl):
    rows = _run(tiny_model_dir, arithmetic_jsonl, tmp_path / "out", "--rm-type", "deterministic_random",
                "--num-rollout", "2", "--custom-rollout-log-function-path", "my_logs.rollout_log",
                "--custom-eval-rollout-log-function-path", "my_logs.eval_log",
                "--eval-prompt-data", "arith", str(arithmetic_jsonl), "--eval-interval", "1",
                "--eval-max-response-len", "2", "--skip-eval-before-train")
    import my_logs

    rollout_calls = [c for c in my_logs.CALLS if c[0] == "rollout"]
    assert [c[1:3] for c in rollout_calls] == [(0, 12), (1, 12)]
    assert all("perf/rollout_time" in c[3] and c[4] > 0 and c[5] == 4 for c in rollout_calls)
    assert [c[1:] for c in my_logs.CALLS if c[0] == "eval"] == [(0, {"arith": (60, 60, 60)}, ["perf/eval_time"]),
                                                                (1, {"arith": (60, 60, 60)}, ["perf/eval_time"])]
    rollouts = {r["rollout/step"]: r for r in rows if "rollout/step" in r}
    sample_keys = ("rollout/response_len/mean", "rollout/truncated_ratio", "rollout/zero_std/share")
    assert not any(k in rollouts[0] for k in sample_keys) and all(k in rollouts[1] for k in sample_keys)
    assert "train/loss" in rollouts[0] and "perf/rollout_time" in rollouts[0]
    evals = [r for r in rows if "eval/step" in r]
    assert [sorted(set(r) - {"eval/step", "time"}) for r in evals] == [["perf/eval_time"], ["perf/eval_time"]]


@pytest.mark.usefixtures("cpu_machine", "one_torch_thread")
def test_reward_categories_and_eval_passrate_equal_counts_of_the_saved_samples(tmp_path, tiny_model_dir,
                                                                               arithmetic_jsonl):
    rows = _run(tiny_model_dir, arithmetic_jsonl, tmp_path, "--rm-type", "dapo", "--reward-key", "score",
                "--num-rollout", "1", "--log-passrate", "--log-reward-category", "acc",
                "--eval-prompt-data", "arith", str(arithmetic_jsonl), "--eval-interval", "1",
                "--n-samples-per-eval-prompt", "2", "--eval-max-response-len", "2", "--skip-eval-before-train",
                "--save-debug-rollout-data", str(tmp_path / "d" / "{rollout_id}.pt"))
    [rollout] = [r for r in rows if "rollout/step" in r]
    [evaluation] = [r for r in rows if "eval/step" in r]
    samples = torch.load(tmp_path / "d" / "0.pt", weights_only=True)["samples"]
    shares = {}
    for s in samples:
        shares[str(s["reward"]["acc"])] = shares.get(str(s["reward"]["acc"]), 0) + 1 / len(samples)
    assert {k: v for k, v in rollout.items() if "error_cat" in k} == pytest.approx(
        {f"rollout/error_cat/{k}": v for k, v in shares.items()})
    evaluated = torch.load(tmp_path / "d" / "eval_0.pt", weights_only=True)["samples"]
    for s in evaluated:
        s["reward"] = s["reward"]["score"]
    assert evaluation["eval/arith-pass@1"] == pytest.approx(_hand_pass_at(evaluated, 2, 1), abs=1e-12)
    assert evaluation["eval/arith-pass@2"] == pytest.approx(_hand_pass_at(evaluated, 2, 2), abs=1e-12)
    assert any(k.startswith("eval/arith/error_cat/") for k in evaluation)
