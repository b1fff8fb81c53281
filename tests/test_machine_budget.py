"""Defaults that follow the machine: what a GPU machine would choose, checked on a faked device description."""

from __future__ import annotations

import json

import pytest

import furlong.core.config.env as env
from furlong.core.cli import main
from furlong.hooks import Machine
from furlong.kit.machine_budget import MAX_BUDGET, MIN_BUDGET, ModelSize, bytes_per_token, model_size, token_budget

QWEN25_05B = ModelSize(parameters=494_032_768, layers=24, hidden=896, vocab=151_936)
GIB = 2**30


def gpu(free_gib: float, total_gib: float = 139.8, name: str = "NVIDIA H200", count: int = 1) -> Machine:
    return Machine(cuda=True, gpu_name=name, gpu_count=count, gpu_total_bytes=int(total_gib * GIB),
                   gpu_free_bytes=int(free_gib * GIB))


def test_bytes_per_token_is_the_logits_and_the_kept_activations():
    assert bytes_per_token(QWEN25_05B) == 4 * 151_936 + 16 * 24 * 896 == 951_808
    assert bytes_per_token(QWEN25_05B, tensor_parallel=2) == 2 * 151_936 + 16 * 24 * 896


@pytest.mark.parametrize(("free_gib", "tokens", "fits"), [
    # (free - 20 x 494,032,768 bytes) / 2 / 951,808 bytes per token, rounded down to a power of two
    (139.0, 65536, 73213),   # an H200: capped at MAX_BUDGET
    (79.0, 32768, 39369),    # an 80 GB H100
    (23.5, MIN_BUDGET, 8064),  # a 24 GB card: never below the core's default budget
])
def test_token_budget_on_gpus_of_several_sizes(free_gib, tokens, fits):
    budget, why = token_budget(gpu(free_gib), QWEN25_05B)
    assert budget == tokens
    assert f"half of the rest holds {fits} tokens" in why
    assert why.startswith(f"1 x NVIDIA H200, {free_gib:.1f} of 139.8 GiB free; model 0.49B parameters: 9.2 GiB")


def test_sharded_state_leaves_room_for_more_tokens():
    alone, _ = token_budget(gpu(36.0), QWEN25_05B)
    sharded, _ = token_budget(gpu(36.0), QWEN25_05B, state_shards=8)
    assert (alone, sharded) == (8192, 16384)


def test_no_budget_without_cuda():
    assert token_budget(Machine(), QWEN25_05B) is None
    assert (MIN_BUDGET, MAX_BUDGET) == (8192, 65536)


def test_model_size_reads_headers_only(tiny_model_dir):
    size = model_size(str(tiny_model_dir))
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert size == ModelSize(sum(p.numel() for p in model.parameters()), 2, 32, 100)
    assert model_size("/nonexistent") is None


@pytest.fixture
def h200(monkeypatch):
    """This machine seen as one H200 with 139 GiB free (no SGLang, no megatron-core)."""
    monkeypatch.setattr(env, "cuda_available", lambda: True)
    monkeypatch.setattr(env, "cuda_device_count", lambda: 1)
    monkeypatch.setattr(env, "gpu_memory", lambda: ("NVIDIA H200", int(139.8 * GIB), int(139.0 * GIB)))
    monkeypatch.setattr(env, "sglang_available", lambda: False)
    monkeypatch.setattr(env, "megatron_available", lambda: False)


def _print_config(capsys, tiny_model_dir, *flags):
    argv = ["train", "--hf-checkpoint", str(tiny_model_dir), "--prompt-data", "/dev/null", "--rollout-batch-size", "32",
            "--n-samples-per-prompt", "8", "--global-batch-size", "256", "--train-backend", "fsdp", *flags,
            "--print-config"]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_gpu_machine_sets_budget_batch_and_compilation_for_a_long_run(h200, capsys, tiny_model_dir):
    data = _print_config(capsys, tiny_model_dir, "--num-rollout", "100")
    machine, args = data["machine_defaults"], data["args"]
    assert (args["max_tokens_per_gpu"], args["train_torch_compile"]) == (65536, True)
    assert (args["embedded_max_batch_size"], args["embedded_torch_compile"]) == (256, True)
    assert machine["max_tokens_per_gpu"]["plugin"] == "fsdp"
    assert machine["max_tokens_per_gpu"]["probe"].startswith("1 x NVIDIA H200, 139.0 of 139.8 GiB free; model ")
    assert machine["embedded_max_batch_size"] == {
        "value": 256, "plugin": "embedded",
        "probe": "1 x NVIDIA H200, 139.0 of 139.8 GiB free: one rollout (32 prompts x 8 samples, at most 1024) "
                 "decodes at once"}
    assert machine["train_torch_compile"]["probe"].endswith("--num-rollout 100 >= 20: the compilation's warm-up "
                                                            "is repaid")
    assert not {"max_tokens_per_gpu", "train_torch_compile", "embedded_max_batch_size"} & set(data["plugin_defaults"])


def test_gpu_machine_leaves_short_runs_uncompiled_and_given_flags_alone(h200, capsys, tiny_model_dir):
    data = _print_config(capsys, tiny_model_dir, "--num-rollout", "5", "--max-tokens-per-gpu", "4096",
                         "--embedded-max-batch-size", "16")
    args, machine = data["args"], data["machine_defaults"]
    assert (args["max_tokens_per_gpu"], args["embedded_max_batch_size"]) == (4096, 16)
    assert (args["train_torch_compile"], args["embedded_torch_compile"]) == (False, False)
    assert not {"max_tokens_per_gpu", "train_torch_compile", "embedded_max_batch_size",
                "embedded_torch_compile"} & set(machine)


def test_compilation_chosen_by_the_machine_is_turned_off_by_its_no_flag(h200, capsys, tiny_model_dir):
    data = _print_config(capsys, tiny_model_dir, "--num-rollout", "100", "--no-train-torch-compile",
                         "--no-embedded-torch-compile")
    args, machine = data["args"], data["machine_defaults"]
    assert (args["train_torch_compile"], args["embedded_torch_compile"]) == (False, False)
    assert not {"train_torch_compile", "embedded_torch_compile"} & set(machine)
    assert args["max_tokens_per_gpu"] == 65536  # the other machine defaults still apply


def test_an_fp8_engine_is_not_compiled_by_default_until_measured(h200, capsys, caplog, tmp_path):
    from .tiny_model import build_tiny_bf16_model_for_fp8

    bf16 = build_tiny_bf16_model_for_fp8(tmp_path / "bf16")
    assert main(["quantize-fp8", str(bf16), str(tmp_path / "fp8")]) == 0
    capsys.readouterr()
    with caplog.at_level("INFO", logger="furlong.config"):
        data = _print_config(capsys, tmp_path / "fp8", "--ref-load", str(bf16), "--num-rollout", "100")
    assert data["args"]["embedded_torch_compile"] is False and "embedded_torch_compile" not in data["machine_defaults"]
    assert any(m.startswith("--embedded-torch-compile stays off by default for an FP8 --hf-checkpoint")
               for m in caplog.messages)
    given = _print_config(capsys, tmp_path / "fp8", "--ref-load", str(bf16), "--num-rollout", "100",
                          "--embedded-torch-compile")
    assert given["args"]["embedded_torch_compile"] is True


def test_a_micro_batch_rule_keeps_the_budget_off(h200, capsys, tiny_model_dir):
    data = _print_config(capsys, tiny_model_dir, "--num-rollout", "5", "--micro-batch-size", "2")
    assert data["args"]["max_tokens_per_gpu"] is None
    assert "max_tokens_per_gpu" not in data["machine_defaults"]


def test_cpu_machine_changes_nothing(cpu_machine, capsys, tiny_model_dir):
    data = _print_config(capsys, tiny_model_dir, "--num-rollout", "100")
    args = data["args"]
    assert (args["max_tokens_per_gpu"], args["train_torch_compile"]) == (8192, False)
    assert (args["embedded_max_batch_size"], args["embedded_torch_compile"]) == (64, False)


def test_a_training_state_larger_than_the_free_memory_is_warned_about(monkeypatch, capsys, caplog, tiny_model_dir):
    from furlong.kit.machine_budget import fixed_bytes, model_size

    size = model_size(str(tiny_model_dir))
    free = fixed_bytes(size) // 2  # half of what the weights, gradients and optimizer state need
    monkeypatch.setattr(env, "cuda_available", lambda: True)
    monkeypatch.setattr(env, "cuda_device_count", lambda: 1)
    monkeypatch.setattr(env, "gpu_memory", lambda: ("Small GPU", 2 * free, free))
    monkeypatch.setattr(env, "sglang_available", lambda: False)
    monkeypatch.setattr(env, "megatron_available", lambda: False)
    with caplog.at_level("WARNING", logger="furlong.config"):
        _print_config(capsys, tiny_model_dir, "--num-rollout", "5", "--micro-batch-size", "2")
    warned = [m for m in caplog.messages if "training state" in m]
    assert warned == [f"the training state of {size.parameters / 1e9:.2f}B parameters needs about "
                      f"{fixed_bytes(size) / 2**30:.1f} GiB per GPU (18 bytes per parameter for training and 2 for "
                      f"the engine's weights, over 1 rank(s)), more than the {free / 2**30:.1f} GiB free: expect "
                      "running out of memory; train on more GPUs, or offload the optimizer state to the host "
                      "(--fsdp-cpu-offload with --train-backend fsdp, --use-distributed-optimizer "
                      "--optimizer-cpu-offload with megatron)."]
