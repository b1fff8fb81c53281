"""Megatron-LM's checkpoint and exit flags on real runs of the demo (examples/demo) on CPU:
``--finetune``, ``--save-retain-interval``, ``--exit-interval`` and ``--exit-duration-in-mins``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo"


def _demo(save: Path, num_rollout: int, *extra: str, command: str = "train") -> subprocess.CompletedProcess:
    """The demo's model, data and algorithm (examples/demo/run_demo.sh) on smaller rollouts (8 prompts x 4
    samples, one optimizer step each), without evaluations; ``extra`` after them."""
    argv = [sys.executable, "-m", "furlong.core", command,
            "--hf-checkpoint", str(DEMO / "model"), "--prompt-data", str(DEMO / "data" / "train.jsonl"),
            "--input-key", "prompt", "--label-key", "label", "--rollout-shuffle", "--rm-type", "math",
            "--num-rollout", str(num_rollout), "--rollout-batch-size", "8", "--n-samples-per-prompt", "4",
            "--global-batch-size", "32", "--rollout-max-response-len", "12", "--rollout-temperature", "1.0",
            "--advantage-estimator", "grpo", "--eps-clip", "0.2", "--eps-clip-high", "0.28", "--lr", "1e-4",
            "--weight-decay", "0.0", "--micro-batch-size", "32", "--save", str(save), *extra]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _rollouts(save: Path) -> list[int]:
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    return [r["rollout/step"] for r in rows if "rollout/step" in r]


def _checkpoints(save: Path) -> list[str]:
    return sorted(p.name for p in save.iterdir() if p.name.startswith("iter_"))


def _meta(ckpt: Path) -> dict:
    return json.loads((ckpt / "meta.json").read_text())


def test_finetune_starts_at_rollout_0_from_the_loaded_weights_with_a_fresh_optimizer(tmp_path):
    first, tuned = tmp_path / "first", tmp_path / "tuned"
    _demo(first, 2, "--save-interval", "1")
    # lr 0: the one training step leaves the weights as loaded, so the checkpoint it writes holds them
    done = _demo(tuned, 1, "--load", str(first), "--finetune", "--lr", "0", "--save-interval", "1")
    assert (f"--finetune: loading the weights of {first / 'iter_0000001'} only (fresh optimizer, learning-rate "
            "schedule and RNG); the run starts at rollout 0 with the data from its start") in done.stderr
    assert _rollouts(tuned) == [0] and _checkpoints(tuned) == ["iter_0000000"]
    loaded = load_file(str(first / "iter_0000001" / "model" / "model.safetensors"))
    kept = load_file(str(tuned / "iter_0000000" / "model" / "model.safetensors"))
    initial = load_file(str(DEMO / "model" / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(kept[name], loaded[name]) and not torch.equal(kept[name], initial[name])
    assert all(torch.equal(kept[k], loaded[k]) for k in loaded)
    # a fresh optimizer: one step taken, where the loaded checkpoint had two
    assert _meta(first / "iter_0000001")["global_step"] == 2 and _meta(tuned / "iter_0000000")["global_step"] == 1
    optimizer = torch.load(tuned / "iter_0000000" / "optimizer.pt", weights_only=True)
    steps = {float(s["step"]) for s in optimizer["optimizer"]["state"].values()}
    assert steps == {1.0}
    # the data from its start: the same position after rollout 0 as the first run's
    assert (json.loads((tuned / "rollout" / "state_0.json").read_text())["data_source"]
            == json.loads((first / "rollout" / "state_0.json").read_text())["data_source"])


def test_save_retain_interval_keeps_rollout_0_the_multiples_and_the_newest(tmp_path):
    save = tmp_path / "retain"
    done = _demo(save, 5, "--save-interval", "1", "--save-retain-interval", "2")
    assert _checkpoints(save) == ["iter_0000000", "iter_0000002", "iter_0000004"]
    assert sorted(os.listdir(save / "rollout")) == ["state_0.json", "state_2.json", "state_4.json"]
    assert f"--save-retain-interval 2: deleted {save / 'iter_0000003'} (rollout 3 is not a multiple of 2)" in done.stderr


def test_exit_interval_stops_after_the_rollout_and_saves_it(tmp_path):
    save = tmp_path / "exit"
    done = _demo(save, 5, "--exit-interval", "2", "--save-interval", "1000")
    assert _rollouts(save) == [0, 1] and _checkpoints(save) == ["iter_0000001"]
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert "--exit-interval 2: stopping after rollout 1, checkpoint 1 saved." in done.stderr


def test_exit_duration_stops_train_async_after_its_first_rollout_with_a_checkpoint(tmp_path):
    save = tmp_path / "exit_async"
    # 0.0001 minutes (6 ms) have passed when the first rollout ends (the model alone takes longer to load)
    done = _demo(save, 4, "--exit-duration-in-mins", "0.0001", command="train-async")
    assert _rollouts(save) == [0] and _checkpoints(save) == ["iter_0000000"]
    assert (save / "rollout" / "state_0.json").is_file()
    assert "--exit-duration-in-mins 0.0001 (" in done.stderr and "stopping after rollout 0, checkpoint 0 saved." in done.stderr


def test_the_three_on_the_megatron_backend(tmp_path):
    """The core carries them out whatever the backend: megatron's torch_dist checkpoints are retained, loaded
    weights-only and written on exit the same way."""
    pytest.importorskip("megatron.core", reason="the megatron extra (megatron-core) is not installed")
    first, tuned = tmp_path / "first", tmp_path / "tuned"
    _demo(first, 3, "--train-backend", "megatron", "--save-interval", "1", "--save-retain-interval", "2")
    assert _checkpoints(first) == ["iter_0000000", "iter_0000002"] and _meta(first / "iter_0000002")["global_step"] == 3
    done = _demo(tuned, 4, "--train-backend", "megatron", "--load", str(first), "--finetune", "--exit-interval", "1")
    assert f"--finetune: loading the weights of {first / 'iter_0000002'} only" in done.stderr
    assert "--exit-interval 1: stopping after rollout 0, checkpoint 0 saved." in done.stderr
    assert _rollouts(tuned) == [0] and _checkpoints(tuned) == ["iter_0000000"]
    assert _meta(tuned / "iter_0000000")["global_step"] == 1  # a fresh step count: one step since the load
