"""What a run tells about its outputs: where they go, zero-spread rollouts, and metrics.jsonl after a resume."""

from __future__ import annotations

import json
import logging

import pytest

BASE = ["--input-key", "prompt", "--label-key", "label", "--rm-type", "math", "--rollout-batch-size", "2",
        "--n-samples-per-prompt", "2", "--global-batch-size", "4", "--rollout-max-response-len", "4", "--lr", "1e-4"]


def _flags(model, data, *extra):
    return ["train", *BASE, "--hf-checkpoint", str(model), "--prompt-data", str(data), *extra]


def _steps(path, key):
    return [row[key] for row in map(json.loads, path.read_text().splitlines()) if key in row]


def test_a_run_without_an_output_folder_says_so_and_warns_once_about_zero_spread(
        tmp_path, tiny_model_dir, arithmetic_jsonl, capsys, caplog, monkeypatch, one_torch_thread):
    """The tiny random model never boxes an answer: every group scores 0 on every sample."""
    from furlong.core.cli.commands import main

    monkeypatch.chdir(tmp_path)
    caplog.set_level(logging.INFO)
    assert main(_flags(tiny_model_dir, arithmetic_jsonl, "--num-rollout", "2")) == 0
    out = capsys.readouterr().out
    assert [line.split(" | ")[3] for line in out.splitlines() if line.startswith("rollout ")] == [
        "zero-spread 1.00", "zero-spread 1.00"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert ("neither --save nor --log-dir: this run keeps no metrics.jsonl and no checkpoint, only the console lines; "
            "pass --log-dir DIR to keep its metrics, --save DIR for checkpoints too.") in warnings
    zero = [w for w in warnings if "scored the same reward on every sample" in w]
    assert len(zero) == 1 and zero[0].startswith("rollout 0: 2 of 2 groups (100%) scored the same reward")
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_a_run_names_its_output_folder(tmp_path, tiny_model_dir, arithmetic_jsonl, caplog, one_torch_thread):
    from furlong.core.cli.commands import main

    caplog.set_level(logging.INFO, logger="furlong")
    assert main(_flags(tiny_model_dir, arithmetic_jsonl, "--num-rollout", "1", "--log-dir", str(tmp_path / "logs"))) == 0
    assert (f"metrics go to {tmp_path / 'logs' / 'metrics.jsonl'}; no checkpoints (no --save)." in caplog.messages)
    assert _steps(tmp_path / "logs" / "metrics.jsonl", "rollout/step") == [0]


@pytest.mark.parametrize("log_dir", [False, True])
def test_output_note_with_save(tmp_path, log_dir):
    from furlong.core.config.launch_args import launch_args
    from furlong.core.run.loop import output_note

    args = launch_args(save=str(tmp_path / "s"), save_interval=100, log_dir=str(tmp_path / "l") if log_dir else None)
    level, text = output_note(args)
    where = f"outputs go to {tmp_path / 's'}: metrics.jsonl, and checkpoints after every 100 rollouts and the last rollout."
    if log_dir:
        assert (level, text) == (logging.WARNING, f"{where} --log-dir {tmp_path / 'l'} is not used: with --save the "
                                                   "metrics go there.")
    else:
        assert (level, text) == (logging.INFO, where)
    args.debug_rollout_only = True
    assert output_note(args)[1].startswith(f"outputs go to {tmp_path / 's'}: metrics.jsonl, and no checkpoint "
                                           "(--debug-rollout-only trains nothing).")


def test_a_resumed_run_logs_each_rollout_once(tmp_path, tiny_model_dir, arithmetic_jsonl, caplog, one_torch_thread):
    """A run stopped after it logged rollout 1 but before its checkpoint: the resumed run starts at rollout 1, and
    metrics.jsonl ends with each rollout once (the first rows of rollout 1 set aside)."""
    from furlong.core.cli.commands import main

    save = tmp_path / "run"
    flags = _flags(tiny_model_dir, arithmetic_jsonl, "--num-rollout", "2", "--save", str(save), "--load", str(save),
                   "--save-interval", "1")
    assert main(flags) == 0
    assert _steps(save / "metrics.jsonl", "rollout/step") == [0, 1]
    (save / "latest_checkpointed_iteration.txt").write_text("0")  # as if stopped before rollout 1's checkpoint
    first = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    caplog.set_level(logging.INFO, logger="furlong")
    assert main(flags) == 0
    metrics = save / "metrics.jsonl"
    assert _steps(metrics, "rollout/step") == [0, 1] and _steps(metrics, "train/step") == [0, 1]
    superseded = [json.loads(line) for line in (save / "metrics.superseded.jsonl").read_text().splitlines()]
    assert superseded == [row for row in first if row.get("rollout/step") == 1 or row.get("train/step") == 1]
    assert (f"{metrics}: 2 rows of rollout 1 and later (logged after the checkpoint this run starts from) moved to "
            "metrics.superseded.jsonl") in caplog.messages
    assert not (save / "furlong.lock").exists()
