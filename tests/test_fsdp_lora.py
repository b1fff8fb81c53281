"""LoRA on the fsdp backend (peft): only adapters train, the engine gets merged weights,
checkpoints hold the adapters."""

from __future__ import annotations

import asyncio
import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from tiny_model import make_batch, train_config  # noqa: E402

from furlong.builtin_plugins.backends.fsdp import train_backend  # noqa: E402

pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

LORA = dict(lora_rank=4, lora_alpha=8, lora_dropout=0.0, target_modules="q_proj,v_proj,down_proj",
            exclude_modules=None)
ALL_IN_ONE = [[[0, 1, 2, 3]]]


def _backend(tiny_dir, **overrides):
    backend = train_backend(config=train_config(tiny_dir, **{**LORA, **overrides}))
    assert asyncio.run(backend.init(backend.config)) == 0
    return backend


def _trained(tiny_dir):
    backend = _backend(tiny_dir)
    asyncio.run(backend.train(0, make_batch(backend.tokenizer, ALL_IN_ONE)))
    return backend


def test_only_the_adapters_train_and_the_engine_gets_merged_weights(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from furlong.builtin_plugins.engines.embedded.engine import EmbeddedEngine

    backend = _backend(tiny_model_dir)
    trainable = sorted(n for n, p in backend.model.named_parameters() if p.requires_grad)
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {n.split(".")[-4] for n in trainable} == {"q_proj", "v_proj", "down_proj"}
    base_before = {n: p.detach().clone() for n, p in backend.model.named_parameters() if not p.requires_grad}
    asyncio.run(backend.train(0, make_batch(backend.tokenizer, ALL_IN_ONE)))
    assert all(torch.equal(p, base_before[n]) for n, p in backend.model.named_parameters() if not p.requires_grad)

    merged = dict(asyncio.run(backend.named_weights()))
    reference = copy.deepcopy(backend.model).merge_and_unload().state_dict()  # peft's own merge
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    names = [n for n in base.state_dict() if n != "lm_head.weight" or not base.config.tie_word_embeddings]
    assert sorted(merged) == sorted(names)  # Hugging Face names only, every one of them
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=1e-6)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged[q], base.state_dict()[q])  # the trained adapter is in the synced weight

    engine = EmbeddedEngine(base, AutoTokenizer.from_pretrained(tiny_model_dir))
    asyncio.run(engine.update_weights(list(merged.items()), version=1))
    state = engine.model.state_dict()
    assert all(torch.equal(state[name], tensor) for name, tensor in merged.items())


def test_lora_dropout_is_on_for_training_passes_only(tiny_model_dir):
    backend = _backend(tiny_model_dir, lora_dropout=0.5)
    batch = make_batch(backend.tokenizer, ALL_IN_ONE)
    first = asyncio.run(backend.log_probs(batch))["log_probs"]
    second = asyncio.run(backend.log_probs(batch))["log_probs"]
    assert all(torch.equal(a, b) for a, b in zip(first, second))  # log-prob passes: no dropout
    dropouts = [m for n, m in backend.model.named_modules() if n.endswith("lora_dropout.default")]
    backend._forward(backend.model, batch, [0], grad=True)
    assert dropouts and all(m.training for m in dropouts)
    backend._forward(backend.model, batch, [0], grad=False)
    assert not any(m.training for m in dropouts)


def test_checkpoints_hold_the_adapters_and_resume_them(tiny_model_dir, tmp_path):
    trained = _trained(tiny_model_dir)
    asyncio.run(trained.save(str(tmp_path / "iter")))
    files = sorted(p.name for p in (tmp_path / "iter" / "model").iterdir())
    assert "adapter_model.safetensors" in files and "adapter_config.json" in files
    assert "model.safetensors" not in files  # the base is --hf-checkpoint
    config = json.loads((tmp_path / "iter" / "model" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 8)

    resumed = _backend(tiny_model_dir)
    asyncio.run(resumed.load(str(tmp_path / "iter")))
    assert resumed.global_step == trained.global_step == 1
    want, got = dict(asyncio.run(trained.named_weights())), dict(asyncio.run(resumed.named_weights()))
    assert all(torch.equal(got[name], want[name]) for name in want)


def test_a_lora_run_trains_checkpoints_and_resumes(tmp_path, tiny_model_dir, arithmetic_jsonl):
    """``furlong train --lora-rank``: two rollouts with a save each, then one more after a restart."""
    save = tmp_path / "run"

    def run(num_rollout):
        command = [sys.executable, "-m", "furlong.core", "train", "--hf-checkpoint", str(tiny_model_dir),
                   "--prompt-data", str(arithmetic_jsonl), "--input-key", "prompt", "--label-key", "label",
                   "--rm-type", "math", "--num-rollout", str(num_rollout), "--rollout-batch-size", "2",
                   "--n-samples-per-prompt", "2", "--global-batch-size", "4", "--rollout-max-response-len", "4",
                   "--lr", "1e-2", "--lora-rank", "4", "--lora-alpha", "8", "--target-modules", "all-linear",
                   "--save", str(save), "--load", str(save), "--save-interval", "1"]
        return subprocess.run(command, capture_output=True, text=True, timeout=120)

    first = run(2)
    assert first.returncode == 0, first.stderr
    assert (save / "iter_0000001" / "model" / "adapter_model.safetensors").exists()
    second = run(3)
    assert second.returncode == 0, second.stderr
    assert f"resuming from {save / 'iter_0000001'}" in second.stderr
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
