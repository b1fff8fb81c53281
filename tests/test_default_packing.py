"""A run that names no micro-batch rule packs micro-batches by tokens, with the losses of one sample per pass."""

import asyncio
import json
import logging

import pytest

from furlong.core.config import parse_args
from furlong.core.config.launch_args import launch_config
from furlong.core.config.rules import DEFAULT_TOKENS_PER_MICRO_BATCH

BASE = ["--num-rollout", "3", "--rollout-batch-size", "4"]

pytestmark = pytest.mark.usefixtures("cpu_machine")


def test_no_micro_batch_rule_packs_by_the_default_budget():
    args = parse_args(BASE)
    assert args.use_dynamic_batch_size is True
    assert args.max_tokens_per_gpu == DEFAULT_TOKENS_PER_MICRO_BATCH
    assert args.packed_by_default == "the default budget"


def test_max_tokens_per_gpu_sets_the_budget():
    args = parse_args(BASE + ["--max-tokens-per-gpu", "512"])
    assert (args.use_dynamic_batch_size, args.max_tokens_per_gpu, args.packed_by_default) == \
        (True, 512, "--max-tokens-per-gpu")


@pytest.mark.parametrize("extra", [["--micro-batch-size", "2"], ["--micro-batch-size", "1"]])
def test_a_micro_batch_size_keeps_fixed_micro_batches(extra):
    args = parse_args(BASE + extra)
    assert (args.use_dynamic_batch_size, args.max_tokens_per_gpu) == (False, None)


def _losses(tmp_path, tiny_model_dir, arithmetic_jsonl, extra: list[str]) -> list[dict]:
    from furlong.core.run.loop import run
    from furlong.core.plugins.manager import get_plugin_manager
    from furlong.core.plugins.selection import resolve_selection

    argv = ["--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(arithmetic_jsonl), "--input-key", "prompt",
            "--label-key", "label", "--rm-type", "deterministic_random", "--num-rollout", "2", "--rollout-batch-size", "3",
            "--n-samples-per-prompt", "4", "--num-steps-per-rollout", "2", "--rollout-max-response-len", "6",
            "--lr", "1e-2", "--log-dir", str(tmp_path), *extra]
    pm = get_plugin_manager()
    config = launch_config(*argv, pm=pm)
    asyncio.run(run(config, pm, resolve_selection(config, pm)))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "train/step" in r]


@pytest.mark.usefixtures("one_torch_thread")
def test_default_packing_gives_the_losses_of_one_sample_per_pass(tmp_path, tiny_model_dir, arithmetic_jsonl, caplog):
    one = _losses(tmp_path / "one", tiny_model_dir, arithmetic_jsonl, ["--micro-batch-size", "1"])
    assert "packed by tokens" not in caplog.text
    with caplog.at_level(logging.INFO, logger="furlong.train"):
        packed = _losses(tmp_path / "packed", tiny_model_dir, arithmetic_jsonl, [])
    assert f"packed by tokens, at most {DEFAULT_TOKENS_PER_MICRO_BATCH} tokens each (the default budget)" in caplog.text
    assert len(one) == len(packed) == 4  # 2 rollouts x 2 optimizer steps
    assert any(abs(r["train/pg_loss"]) > 1e-4 for r in one)  # advantages are not all zero
    for a, b in zip(one, packed):
        for key in ("train/loss", "train/pg_loss", "train/pg_clipfrac", "train/ppo_kl", "train/grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
