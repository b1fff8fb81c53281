"""``--skip-zero-advantage-samples``: samples whose loss is identically 0 are not trained, and nothing else changes."""

import asyncio
import json
from pathlib import Path

import pytest
import torch

from furlong.core.train.batching import plan_steps
from furlong.core.train.data import zero_advantage

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo"
EXACT = ("train/pg_loss", "train/loss", "train/grad_norm", "rollout/raw_reward", "rollout/advantages",
         "rollout/rollout_log_probs")


def _plan(skip, dp=1, rank=0, mbs=2, dynamic=False, n=8):
    return plan_steps(lengths=[3] * n, global_batch_size=n, num_steps=1, dp_size=dp, rank=rank,
                      micro_batch_size=mbs, max_tokens_per_gpu=6 if dynamic else None, dynamic=dynamic,
                      balance=False, skip=skip)


def test_zero_advantage_looks_only_at_trained_tokens():
    advantages = [torch.zeros(3), torch.tensor([0.0, 0.5, 0.0]), torch.tensor([0.0, 2.0]), torch.tensor([1.0]),
                  torch.tensor([float("nan")])]
    masks = [torch.ones(3), torch.ones(3), torch.tensor([1.0, 0.0]), torch.zeros(1), torch.ones(1)]
    assert zero_advantage(advantages, masks) == [True, False, True, True, False]


def test_the_plan_leaves_out_skipped_samples_and_cuts_the_rest_into_micro_batches():
    skip = [True, True, False, True, False, False, True, True]
    assert _plan(None) == [[[0, 1], [2, 3], [4, 5], [6, 7]]]
    assert _plan(skip) == [[[2, 4], [5]]]
    assert _plan(skip, dynamic=True) == [[[2, 4], [5]]]  # 6-token bins of 3-token samples


def test_a_step_with_every_sample_skipped_keeps_one_so_its_optimizer_step_runs():
    assert _plan([True] * 8) == [[[0]]]


def test_ranks_get_as_many_micro_batches_each_by_adding_back_skipped_samples():
    # one trained sample cannot give two ranks a micro-batch each: the first skipped one joins it
    skip = [True, True, True, False, True, True, True, True]
    plans = [_plan(skip, dp=2, rank=r) for r in range(2)]
    assert plans == [[[[0]]], [[[3]]]]
    skip = [False, False, False, True, True, True, True, True]  # 3 trained: rank 0 two micro-batches, rank 1 one
    plans = [_plan(skip, dp=2, rank=r, mbs=1) for r in range(2)]
    assert [len(p[0]) for p in plans] == [2, 2]
    assert sorted(i for p in plans for mb in p[0] for i in mb) == [0, 1, 2, 3]


def test_the_skip_is_on_by_default_off_where_inexact_and_refused_there_when_given():
    from furlong.core.config import parse_args
    from furlong.core.config.errors import ConfigError

    argv = ["--hf-checkpoint", str(DEMO / "model"), "--num-rollout", "1", "--rollout-batch-size", "4",
            "--n-samples-per-prompt", "4"]
    assert parse_args(argv).skip_zero_advantage_samples is True  # --print-config shows what the run will do
    assert parse_args(argv + ["--no-skip-zero-advantage-samples"]).skip_zero_advantage_samples is False
    for extra in (["--entropy-coef", "0.01"], ["--use-kl-loss"], ["--loss-type", "sft_loss"],
                  ["--custom-loss-function-path", "my_losses.clipped"], ["--loss-reducer", "dr_grpo"]):
        assert parse_args(argv + extra).skip_zero_advantage_samples is False, extra
    from furlong.core.config.train_rules import zero_advantage_skip_blocked

    kl = parse_args(argv + ["--use-kl-loss", "--kl-loss-coef", "0.01"])
    assert zero_advantage_skip_blocked(kl) == "--use-kl-loss: the KL term does not vanish at zero advantage"
    logged_only = parse_args(argv + ["--use-kl-loss", "--kl-loss-coef", "0.00"])
    assert zero_advantage_skip_blocked(logged_only) == (
        "--use-kl-loss with --kl-loss-coef 0: the KL it logs is over every sample")
    with pytest.raises(ConfigError, match=r"--skip-zero-advantage-samples: a sample's loss might not vanish at zero "
                                          r"advantage \(--entropy-coef 0.01: the entropy bonus does not vanish"):
        parse_args(argv + ["--entropy-coef", "0.01", "--skip-zero-advantage-samples"])


def _demo_run(save: Path, *extra: str) -> list[dict]:
    """Three rollouts of the demo task, 4 groups of 4 samples, one optimizer step over micro-batches of 4."""
    from furlong.core.config.launch_args import launch_config
    from furlong.core.run.loop import run
    from furlong.core.plugins.manager import get_plugin_manager
    from furlong.core.plugins.selection import resolve_selection

    argv = ["--hf-checkpoint", str(DEMO / "model"), "--prompt-data", str(DEMO / "data" / "train.jsonl"),
            "--input-key", "prompt", "--label-key", "label", "--rm-type", "math", "--num-rollout", "3",
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "16",
            "--rollout-max-response-len", "12", "--lr", "1e-3", "--micro-batch-size", "4",
            "--save", str(save), "--save-interval", "1000", "--seed", "1", *extra]
    pm = get_plugin_manager()
    config = launch_config(*argv, pm=pm)
    asyncio.run(run(config, pm, resolve_selection(config, pm)))
    return [r for r in map(json.loads, (save / "metrics.jsonl").read_text().splitlines()) if "rollout/step" in r]


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_skipping_gives_the_losses_grad_norms_and_rewards_of_training_every_sample(tmp_path, caplog, backend):
    caplog.set_level("INFO", logger="furlong.train")
    skipped = _demo_run(tmp_path / "skip", "--train-backend", backend)
    assert "samples with zero advantage on every trained token are left out" in caplog.text
    every = _demo_run(tmp_path / "all", "--train-backend", backend, "--no-skip-zero-advantage-samples")
    # rollout 0: one of the four groups got one reward for all samples; rollouts 1 and 2: every group (reward
    # 0), so one sample is kept and the optimizer step still runs (Adam moves the weights with a zero gradient:
    # the engine's log-probs of the next rollout see it)
    assert [r["perf/skipped_samples"] for r in skipped] == [4.0, 15.0, 15.0]
    assert all("perf/skipped_samples" not in r for r in every)
    assert [r["train/grad_norm"] > 1e-3 for r in skipped] == [True, False, False]
    for a, b in zip(skipped, every):
        for key in EXACT:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
        # the other training metrics describe the trained samples: the entropy of the training forward
        # (reduced by the objective) is the mean over the samples that kept their pi_old and entropy
        assert a["train/entropy_loss"] == pytest.approx(a["rollout/entropy"], rel=1e-5)
        assert b["train/entropy_loss"] == pytest.approx(b["rollout/entropy"], rel=1e-5)
        assert a["train/entropy_loss"] != pytest.approx(b["train/entropy_loss"], rel=1e-4)
