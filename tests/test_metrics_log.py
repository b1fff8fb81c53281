"""metrics.jsonl writing, the console summary line, rollout and eval metrics."""

import json
import math

import numpy as np
import pytest
import torch

from furlong.core.run.metrics_log import (MetricsLog, eval_metrics, one_row_per_step, rollout_metrics, set_aside_rows_from,
                                      summary_line, to_json_value, zero_spread_warning)
from furlong.hooks import PluginError, Sample, Status


def _sample(reward, length, mask=None, status=Status.COMPLETED, index=0):
    return Sample(
        index=index,
        tokens=[1] * (length + 2),
        response_length=length,
        loss_mask=mask,
        reward=reward,
        status=status,
    )


def _read(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_jsonl_lines_with_step_keys_and_conversions(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    log = MetricsLog(str(path))
    log.log({"rollout/raw_reward": torch.tensor(0.5), "rollout/x": np.float32(0.25)}, "rollout/step", 3)
    log.log({"train/loss": float("nan"), "train/grad_norm": float("inf"), "train/n": np.int64(4)}, "train/step", 7)
    log.log({"eval/gsm": torch.tensor([0.5, 1.0]), "eval/ok": True}, "eval/step", 3)
    # Flushed per line: readable while the log is still open.
    rows = _read(path)
    assert len(rows) == 3
    for row in rows:
        assert isinstance(row.pop("time"), float)
    assert rows == [
        {"rollout/raw_reward": 0.5, "rollout/x": 0.25, "rollout/step": 3},
        {"train/loss": None, "train/grad_norm": None, "train/n": 4, "train/step": 7},
        {"eval/gsm": [0.5, 1.0], "eval/ok": True, "eval/step": 3},
    ]
    log.close()
    # Append mode: a resumed run continues the same file.
    with MetricsLog(str(path)) as again:
        again.log({"rollout/raw_reward": 1}, "rollout/step", 4)
    assert [r["rollout/step"] for r in _read(path) if "rollout/step" in r] == [3, 4]


def test_directory_path_gets_metrics_jsonl(tmp_path):
    log = MetricsLog(str(tmp_path))
    log.log({"a": 1}, "rollout/step", 0)
    log.close()
    assert [{k: v for k, v in r.items() if k != "time"} for r in _read(tmp_path / "metrics.jsonl")] == [
        {"a": 1, "rollout/step": 0}
    ]


def test_none_path_writes_nothing_but_returns_record(tmp_path):
    record = MetricsLog(None).log({"x": float("-inf")}, "rollout/step", 2)
    assert (record["x"], record["rollout/step"]) == (None, 2)


def test_bad_step_key():
    with pytest.raises(ValueError) as excinfo:
        MetricsLog(None).log({}, "step", 0)
    assert str(excinfo.value) == "step key 'step' is not one of rollout/step, train/step, eval/step"


def test_to_json_value_nested():
    assert to_json_value({"a": [np.float64(1.5), float("nan")], "b": (torch.tensor(2),)}) == {
        "a": [1.5, None],
        "b": [2],
    }
    assert math.isclose(to_json_value(torch.tensor(0.1, dtype=torch.float64)), 0.1)


def test_summary_line_full_and_missing():
    metrics = {
        "rollout/raw_reward": 0.4123,
        "rollout/response_len/mean": 11.24,
        "rollout/zero_std/share": 0.25,
        "train/ppo_kl": 0.00123,
        "train/pg_clipfrac": 0.0311,
        "perf/rollout_time": 4.12,
        "perf/train_time": 1.18,
        "perf/update_weights_time": 0.06,
    }
    assert summary_line(3, metrics) == (
        "rollout    3 | reward  0.412 | len    11.2 | zero-spread 0.25 | kl  0.0012 | clip 0.031 | rollout   4.1s train   "
        "1.2s sync   0.1s"
    )
    sparse = {"rollout/raw_reward": -1.0, "rollout/response_lengths": 120.0, "train/ppo_kl": float("nan")}
    assert summary_line(1234, sparse) == (
        "rollout 1234 | reward -1.000 | len   120.0 | zero-spread    - | kl       - | clip     - | rollout     -  train     -  "
        "sync     -"
    )
    # Fixed width: the separators line up whatever the values.
    def bars(line):
        return [i for i in range(len(line)) if line.startswith(" | ", i)]

    assert bars(summary_line(3, metrics)) == bars(summary_line(1234, sparse))


def test_summary_line_shows_the_trainer_rollout_kl_when_not_zero():
    metrics = {"rollout/raw_reward": 0.25, "rollout/response_len/mean": 7.5, "rollout/zero_std/share": 1.0,
               "train/ppo_kl": 0.0,
               "train/pg_clipfrac": 0.0, "perf/rollout_time": 0.9, "perf/train_time": 0.7,
               "perf/update_weights_time": 0.0}
    # train-async: the batch was generated one weight version back
    assert summary_line(2, {**metrics, "train/train_rollout_kl": 0.0623}) == (
        "rollout    2 | reward  0.250 | len     7.5 | zero-spread 1.00 | kl  0.0000 | clip 0.000 | rollout-kl 6.2e-02 | "
        "rollout   0.9s train   0.7s sync   0.0s"
    )
    # sync: only float rounding separates the engine's log-probs from the trainer's
    assert "rollout-kl" not in summary_line(2, {**metrics, "train/train_rollout_kl": 2.3e-09})
    assert "rollout-kl" not in summary_line(2, {**metrics, "train/train_rollout_kl": float("nan")})
    assert "rollout-kl" in summary_line(2, {**metrics, "train/train_rollout_kl": 1e-6})


def test_rollout_metrics_hand_computed():
    groups = [
        # group 0: all 1.0 -> zero-std, count_1.0
        [_sample(1.0, 4), _sample(1.0, 6, mask=[1, 1, 1, 0, 0, 0], status=Status.TRUNCATED)],
        # group 1: all 0 -> zero-std, count_0.0
        [_sample(0, 2), _sample(0.0, 8, status=Status.TRUNCATED)],
        # group 2: mixed
        [_sample(0.5, 10), _sample(1.0, 2)],
    ]
    out = rollout_metrics(groups, reward_key=None)
    assert out == pytest.approx(
        {
            "rollout/raw_reward": 3.5 / 6,  # (1+1+0+0+0.5+1)/6
            "rollout/response_lengths": 32 / 6,  # (4+6+2+8+10+2)/6
            "rollout/response_len/mean": 29 / 6,  # effective: 4,3,2,8,10,2
            "rollout/response_len/median": 3.5,  # sorted 2,2,3,4,8,10 -> (3+4)/2
            "rollout/response_len/max": 10,
            "rollout/response_len/min": 2,
            "rollout/truncated": 2 / 6,
            "rollout/truncated_ratio": 2 / 6,
            "rollout/zero_std/count_1.0": 1,
            "rollout/zero_std/count_0.0": 1,
            "rollout/zero_std/all_zero_percentage": 1 / 3,
            "rollout/zero_std/all_one_percentage": 1 / 3,
            "rollout/zero_std/share": 2 / 3,
        }
    )


def test_rollout_metrics_dict_rewards_and_no_zero_std():
    groups = [
        [_sample({"score": 1.0, "acc": True}, 3), _sample({"score": -1.0, "acc": False}, 5)],
        [_sample({"score": 0.5, "acc": True}, 1), _sample({"score": 0.5, "acc": True}, 1)],
    ]
    out = rollout_metrics(groups, reward_key="score")
    assert out["rollout/raw_reward"] == pytest.approx(0.25)  # (1 - 1 + 0.5 + 0.5) / 4
    assert out["rollout/zero_std/count_0.5"] == 1
    assert (out["rollout/zero_std/all_zero_percentage"], out["rollout/zero_std/all_one_percentage"]) == (0.0, 0.0)
    assert out["rollout/zero_std/share"] == 0.5  # the all-0.5 group has no spread either
    assert not any("zero_std" in k for k in rollout_metrics(groups, reward_key="score", zero_std=False))
    assert rollout_metrics([], reward_key=None) == {}


def test_dict_reward_without_key_is_an_error():
    with pytest.raises(PluginError) as excinfo:
        rollout_metrics([[_sample({"score": 1.0, "acc": True}, 3, index=12)]], reward_key=None)
    assert str(excinfo.value) == (
        "sample 12: the reward is a dict with keys ['acc', 'score']; pass --reward-key naming the scalar to train on "
        "(the evaluation reads it too, unless --eval-reward-key names another)."
    )
    with pytest.raises(PluginError) as excinfo:
        eval_metrics("gsm", [_sample({"acc": True}, 3, index=4)], reward_key="score")
    assert str(excinfo.value) == "sample 4: --eval-reward-key 'score' is not in the reward dict (keys: ['acc'])."


def test_eval_metrics_hand_computed():
    samples = [
        _sample(1.0, 10),
        _sample(None, 0, status=Status.ABORTED),
        _sample(0.0, 20, status=Status.TRUNCATED),
        _sample(1.0, 6, mask=[1, 1, 0, 0, 0, 0]),
    ]
    assert eval_metrics("aime", samples, reward_key=None) == pytest.approx(
        {
            "eval/aime": 0.5,  # (1 + 0[None] + 0 + 1) / 4
            "eval/aime-truncated_ratio": 0.25,
            "eval/aime-none_reward_ratio": 0.25,
            "eval/aime/response_len/mean": 8.0,  # effective 10, 0, 20, 2
            "eval/aime/response_len/median": 6.0,  # (2 + 10) / 2
            "eval/aime/response_len/max": 20,
            "eval/aime/response_len/min": 0,
        }
    )
    assert eval_metrics("aime", [], reward_key=None) == {}


def test_metrics_round_trip_through_jsonl(tmp_path):
    groups = [[_sample(1.0, 4), _sample(0.0, 2)]]
    with MetricsLog(str(tmp_path / "metrics.jsonl")) as log:
        log.log(rollout_metrics(groups, reward_key=None), "rollout/step", 0)
    (row,) = _read(tmp_path / "metrics.jsonl")
    assert row["rollout/raw_reward"] == 0.5
    assert row["rollout/response_len/median"] == 3.0
    assert row["rollout/step"] == 0


def test_a_rollout_of_nearly_only_zero_spread_groups_gets_a_warning():
    assert zero_spread_warning(4, {"rollout/zero_std/share": 0.875}, 8) is None
    assert zero_spread_warning(4, {}, 8) is None
    assert zero_spread_warning(4, {"rollout/zero_std/share": 0.9375}, 16) == (
        "rollout 4: 15 of 16 groups (94%) scored the same reward on every sample (all wrong or all right), so a "
        "group-relative advantage is 0 for them and they train nothing. More samples per prompt "
        "(--n-samples-per-prompt), a higher --rollout-temperature, prompts nearer the model's level, or dynamic "
        "sampling (--dynamic-sampling-filter check_reward_nonzero_std with --over-sampling-batch-size) give groups "
        "with a spread. The rollout line's zero-spread field shows the share; this warning is not repeated.")


def _lines(rows):
    return "".join(json.dumps(r) + "\n" for r in rows)


def test_a_resumed_run_sets_aside_the_rows_logged_after_its_checkpoint(tmp_path):
    """Resumed at rollout 2 (two optimizer steps per rollout): rollout rows 2, 3, train steps 4-7 and the eval
    of rollout 3 were logged after the checkpoint of rollout 1; they move aside, in file order."""
    path = tmp_path / "metrics.jsonl"
    rows = ([{"train/step": step} for step in range(8)] + [{"rollout/step": r} for r in range(4)]
            + [{"eval/step": r} for r in (1, 3)])
    path.write_text(_lines(rows) + "not json\n")
    assert set_aside_rows_from(str(path), 2, 2) == 7
    assert path.read_text() == _lines([{"train/step": step} for step in range(4)] + [{"rollout/step": 0},
                                       {"rollout/step": 1}, {"eval/step": 1}]) + "not json\n"
    assert (tmp_path / "metrics.superseded.jsonl").read_text() == _lines(
        [{"train/step": step} for step in range(4, 8)] + [{"rollout/step": 2}, {"rollout/step": 3}, {"eval/step": 3}])
    assert set_aside_rows_from(str(path), 2, 2) == 0  # nothing left to move
    assert set_aside_rows_from(str(tmp_path / "none.jsonl"), 0, 1) == 0


def test_one_row_per_step_keeps_the_last_row_in_the_first_place():
    rows = [{"rollout/step": 0, "v": 0}, {"rollout/step": 1, "v": 1}, {"eval/step": 1, "v": 9},
            {"rollout/step": 1, "v": 11}, {"rollout/step": 2, "v": 2}, {"note": "no step"}]
    assert one_row_per_step(rows) == [{"rollout/step": 0, "v": 0}, {"rollout/step": 1, "v": 11},
                                      {"eval/step": 1, "v": 9}, {"rollout/step": 2, "v": 2}, {"note": "no step"}]
