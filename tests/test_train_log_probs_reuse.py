"""pi_old from the training forward (``--reuse-train-log-probs``): the same run as with the separate pass."""

import asyncio
import json
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo"
COMPARED = ("train/pg_loss", "train/pg_clipfrac", "train/ppo_kl", "train/entropy_loss", "train/grad_norm",
            "train/loss", "rollout/raw_reward", "rollout/log_probs", "rollout/entropy", "rollout/advantages")


def _demo_run(save: Path, *extra: str) -> list[dict]:
    """Rollouts of the demo task (``extra`` gives their number), one optimizer step each over four micro-batches."""
    from furlong.core.config.launch_args import launch_config
    from furlong.core.run.loop import run
    from furlong.core.plugins.manager import get_plugin_manager
    from furlong.core.plugins.selection import resolve_selection

    argv = ["--hf-checkpoint", str(DEMO / "model"), "--prompt-data", str(DEMO / "data" / "train.jsonl"),
            "--input-key", "prompt", "--label-key", "label", "--rm-type", "math",
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "16",
            "--rollout-max-response-len", "12", "--lr", "1e-4", "--entropy-coef", "0.01", "--micro-batch-size", "4",
            "--save", str(save), "--save-interval", "1000", "--seed", "1", *extra]
    pm = get_plugin_manager()
    config = launch_config(*argv, pm=pm)
    asyncio.run(run(config, pm, resolve_selection(config, pm)))
    return [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_reused_pi_old_gives_the_losses_grad_norms_rewards_and_metrics_of_the_separate_pass(tmp_path, caplog, backend):
    if backend == "megatron":
        pytest.importorskip("megatron.core", reason="the megatron extra (megatron-core) is not installed")
    caplog.set_level("INFO", logger="furlong.train")
    rollouts = "3" if backend == "fsdp" else "2"
    reused = [r for r in _demo_run(tmp_path / "reuse", "--train-backend", backend, "--num-rollout", rollouts)
              if "rollout/step" in r]
    assert "the separate log-prob pass is skipped" in caplog.text
    separate = [r for r in _demo_run(tmp_path / "pass", "--train-backend", backend, "--num-rollout", rollouts,
                                     "--no-reuse-train-log-probs") if "rollout/step" in r]
    assert "a separate forward pass computes pi_old: --no-reuse-train-log-probs." in caplog.text
    assert len(reused) == len(separate) == int(rollouts)
    assert all(r["train/grad_norm"] > 1e-3 for r in reused)  # every step moved the weights
    for a, b in zip(reused, separate):
        for key in COMPARED:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key
        assert a["perf/log_probs_time"] == 0.0 and b["perf/log_probs_time"] > 0.0  # the pass ran only once


@pytest.mark.parametrize("extra, reason", [
    (("--num-steps-per-rollout", "2", "--global-batch-size", "8"), "--num-steps-per-rollout 2"),
    (("--global-batch-size", "16", "--use-kl-loss", "--kl-loss-coef", "0.01"), "a reference model is loaded"),
])
def test_runs_that_need_pi_old_fixed_or_early_keep_the_pass(tmp_path, caplog, extra, reason):
    from furlong.core.config.launch_args import launch_config
    from furlong.core.plugins.manager import get_plugin_manager
    from furlong.core.plugins.selection import resolve_selection
    from furlong.core.train.group import TrainGroup

    argv = ["--hf-checkpoint", str(DEMO / "model"), "--prompt-data", str(DEMO / "data" / "train.jsonl"),
            "--input-key", "prompt", "--label-key", "label", "--num-rollout", "1", "--rollout-batch-size", "4",
            "--n-samples-per-prompt", "4", *extra]

    pm = get_plugin_manager()
    config = launch_config(*argv, pm=pm)
    group = TrainGroup(config, pm, resolve_selection(config, pm), workers=None)
    assert reason in group._keeps_log_prob_pass()


def test_flags_that_need_the_pass_turn_the_reuse_off_in_the_config_and_refuse_it_when_given():
    from furlong.core.config import parse_args
    from furlong.core.config.errors import ConfigError

    argv = ["--hf-checkpoint", str(DEMO / "model"), "--num-rollout", "1", "--rollout-batch-size", "4",
            "--n-samples-per-prompt", "4", "--num-steps-per-rollout", "2", "--global-batch-size", "8"]
    assert parse_args(argv).reuse_train_log_probs is False  # --print-config shows what the run will do
    assert parse_args(argv[:-4]).reuse_train_log_probs is True
    with pytest.raises(ConfigError, match=r"--reuse-train-log-probs: pi_old cannot come from the training forward "
                                          r"here \(--num-steps-per-rollout 2"):
        parse_args(argv + ["--reuse-train-log-probs"])


def test_an_estimator_that_reads_pi_old_turns_the_reuse_off_and_refuses_it_when_given(plugin_manager):
    from furlong.core.config import parse_args
    from furlong.core.config.configure import configure_plugins
    from furlong.core.plugins.selection import resolve_selection
    from furlong.hooks import PluginError

    def configured(*extra):
        args = parse_args(["--num-rollout", "1", "--rollout-batch-size", "4", "--advantage-estimator",
                           "on_policy_distillation", *extra], plugin_manager)
        configure_plugins(args, plugin_manager, resolve_selection(args, plugin_manager))
        return args

    assert configured().reuse_train_log_probs is False
    with pytest.raises(PluginError, match="reads pi_old before training"):
        configured("--reuse-train-log-probs")


@pytest.mark.timeout(240)
def test_two_data_parallel_ranks_reusing_pi_old_reproduce_one_process_with_the_separate_pass(tmp_path):
    """Each rank keeps the log-probs of its own micro-batches; the driver merges them by global index."""
    from .tiny_model import one_process_and_torchrun

    flags = ["train", "--hf-checkpoint", str(DEMO / "model"), "--prompt-data", str(DEMO / "data" / "train.jsonl"),
             "--input-key", "prompt", "--label-key", "label", "--rm-type", "math", "--num-rollout", "2",
             "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "16",
             "--micro-batch-size", "4", "--rollout-max-response-len", "12", "--lr", "1e-4", "--entropy-coef", "0.01",
             "--seed", "1", "--save-interval", "1000"]
    rows, stderr = one_process_and_torchrun(flags, tmp_path, ["--no-reuse-train-log-probs"],
                                            ["--actor-num-gpus-per-node", "2"])
    assert "the separate log-prob pass is skipped" in stderr
    assert len(rows["one"]) == len(rows["two"]) == 2
    for a, b in zip(rows["one"], rows["two"]):
        for key in COMPARED:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key
        assert b["perf/log_probs_time"] == 0.0 < a["perf/log_probs_time"]


def test_the_fsdp_backend_says_when_its_training_forward_differs_from_its_log_prob_pass(tiny_model_dir):
    from furlong.builtin_plugins.backends.fsdp import train_backend

    from .tiny_model import train_config

    def gives(attention_dropout=0.0, **flags):
        backend = train_backend(config=train_config(tiny_model_dir, **flags))
        asyncio.run(backend.init(backend.config))
        backend.model.config.attention_dropout = attention_dropout
        return backend.train_forward_gives_old_log_probs()

    assert gives() and gives(gradient_checkpointing=True)  # the tiny model has no dropout
    assert gives(0.1) and not gives(0.1, gradient_checkpointing=True)  # dropout acts only in train mode
    assert gives(lora_rank=4, lora_alpha=8, lora_dropout=0.0, target_modules=None, exclude_modules=None)
    assert not gives(lora_rank=4, lora_alpha=8, lora_dropout=0.1, target_modules=None, exclude_modules=None)
