"""Kill a real run after a checkpoint, restart the same command, and compare with a run never killed.

The resumed run starts after the last complete checkpoint with identical
prompts, data position, learning rate and weights for every later rollout.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

from furlong.hooks.testing.processes import signal_state


def _command(model, data, save, num_rollout=4):
    return [sys.executable, "-m", "furlong.core", "train",
            "--hf-checkpoint", str(model), "--prompt-data", str(data), "--input-key", "prompt",
            "--label-key", "label", "--rm-type", "math", "--rollout-shuffle",
            "--num-rollout", str(num_rollout), "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
            "--global-batch-size", "4", "--rollout-max-response-len", "6", "--lr", "1e-3",
            "--lr-decay-style", "linear", "--save", str(save), "--load", str(save), "--save-interval", "1"]


def _rollout_rows(save):
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    return {r["rollout/step"]: r for r in rows if "rollout/step" in r}


def _train_rows(save):
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    return {r["train/step"]: r for r in rows if "train/step" in r}


@pytest.mark.signals
@pytest.mark.timeout(240)
def test_killed_run_resumes_where_the_uninterrupted_run_would_be(tmp_path, tiny_model_dir, arithmetic_jsonl):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    subprocess.run(_command(tiny_model_dir, arithmetic_jsonl, whole), check=True, capture_output=True, timeout=120)

    proc = subprocess.Popen(_command(tiny_model_dir, arithmetic_jsonl, killed), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, preexec_fn=signal_state())
    marker = killed / "latest_checkpointed_iteration.txt"
    deadline = time.time() + 120
    while time.time() < deadline and not (marker.exists() and marker.read_text().strip() == "1"):
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert marker.read_text().strip() in ("1", "2")
    killed_at = int(marker.read_text().strip())

    resumed = subprocess.run(_command(tiny_model_dir, arithmetic_jsonl, killed), capture_output=True, text=True,
                             timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert marker.read_text().strip() == "3"
    # The resumed process ran only the rollouts after the last complete checkpoint.
    assert f"resuming from {killed / f'iter_{killed_at:07d}'}" in resumed.stderr

    for rid in (2, 3):
        state_whole = json.loads((whole / "rollout" / f"state_{rid}.json").read_text())
        state_killed = json.loads((killed / "rollout" / f"state_{rid}.json").read_text())
        assert state_killed == state_whole
    a, b = _rollout_rows(whole), _rollout_rows(killed)
    for rid in (2, 3):
        for key in ("rollout/raw_reward", "rollout/response_lengths", "train/lr"):
            assert b[rid][key] == a[rid][key], (rid, key)
    assert [_train_rows(killed)[s]["train/lr"] for s in (2, 3)] == [_train_rows(whole)[s]["train/lr"] for s in (2, 3)]
    final_a = load_file(str(whole / "iter_0000003" / "model" / "model.safetensors"))
    final_b = load_file(str(killed / "iter_0000003" / "model" / "model.safetensors"))
    assert final_a.keys() == final_b.keys()
    for name in final_a:
        assert (final_a[name] == final_b[name]).all(), name


def test_resume_with_nothing_left_to_run_does_nothing(tmp_path, tiny_model_dir, arithmetic_jsonl):
    """A finished run's directory resumes at num_rollout, with no rollout left."""
    save = tmp_path / "run"
    subprocess.run(_command(tiny_model_dir, arithmetic_jsonl, save, num_rollout=2), check=True,
                   capture_output=True, timeout=120)
    again = subprocess.run(_command(tiny_model_dir, arithmetic_jsonl, save, num_rollout=2), capture_output=True,
                           text=True, timeout=120)
    assert again.returncode == 0
    assert "rollout    " not in again.stdout
    assert sorted(p.name for p in save.iterdir() if p.name.startswith("iter_")) == ["iter_0000000", "iter_0000001"]
