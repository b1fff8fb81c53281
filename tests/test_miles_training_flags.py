"""Miles' training flags furlong implements (issue 41): each run end to end on the demo task, values checked."""

import asyncio
import json
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo"


def demo_run(save: Path, *extra: str, command: str = "train") -> list[dict]:
    """The demo task (``extra`` gives the rollouts); the metrics of each rollout, in order."""
    from furlong.core.config.launch_args import launch_config
    from furlong.core.plugins.manager import get_plugin_manager
    from furlong.core.plugins.selection import resolve_selection
    from furlong.core.run.loop import run

    argv = ["--hf-checkpoint", str(DEMO / "model"), "--prompt-data", str(DEMO / "data" / "train.jsonl"),
            "--input-key", "prompt", "--label-key", "label", "--rm-type", "deterministic_random",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--global-batch-size", "8",
            "--rollout-max-response-len", "8", "--lr", "1e-3", "--entropy-coef", "0.01", "--micro-batch-size", "4",
            "--save", str(save), "--save-interval", "1000", "--seed", "1", *extra]
    pm = get_plugin_manager()
    config = launch_config(*argv, pm=pm, command=command)
    asyncio.run(run(config, pm, resolve_selection(config, pm)))
    return [r for r in (json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines())
            if "rollout/step" in r]


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_ref_update_interval_gives_the_reference_the_actors_weights(tmp_path, caplog, backend):
    if backend == "megatron":
        pytest.importorskip("megatron.core", reason="the megatron extra (megatron-core) is not installed")
    caplog.set_level("INFO", logger="furlong.train")
    rows = demo_run(tmp_path, "--train-backend", backend, "--num-rollout", "3", "--use-kl-loss",
                    "--kl-loss-coef", "0", "--ref-update-interval", "2")
    ref = [r["rollout/ref_log_probs"] for r in rows]
    actor = [r["rollout/log_probs"] for r in rows]
    # rollout 0: both are the initial weights; rollout 1: the actor trained once, the reference did not;
    # after rollout 1 ((1 + 1) % 2 == 0) the reference takes the actor's weights, which rollout 2 starts from
    assert ref[0] == pytest.approx(actor[0], rel=1e-6)
    assert abs(ref[1] - actor[1]) > 1e-4
    assert ref[2] == pytest.approx(actor[2], rel=1e-6)
    assert rows[2]["train/kl_loss"] == pytest.approx(0.0, abs=1e-6)
    assert abs(rows[1]["train/kl_loss"]) > 1e-6
    assert "rollout 1: the reference model takes the actor's weights (--ref-update-interval 2)." in caplog.text
    assert "rollout 0: the reference model" not in caplog.text


def test_log_probs_max_tokens_per_gpu_packs_the_passes_and_changes_no_value(tmp_path):
    from furlong.core.config import parse_args
    from furlong.core.train.group import TrainGroup, _share
    from furlong.hooks import TrainBatch

    packed = ["--num-rollout", "2", "--use-kl-loss", "--kl-loss-coef", "0.01", "--no-reuse-train-log-probs",
              "--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096"]
    base = ["--hf-checkpoint", str(DEMO / "model"), "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
            "--global-batch-size", "8"]
    group = TrainGroup(parse_args(base + packed[:-4] + ["--log-probs-max-tokens-per-gpu", "1"] + packed[-4:]),
                       None, None, workers=None)
    batch = TrainBatch(tokens=[[1] * 20] * 8, response_lengths=[8] * 8, loss_masks=[None] * 8)
    train_shares = [_share(batch, plan) for plan in group._plans(batch, 8, 1, list(range(8)))]
    passes = group._log_prob_shares(batch, 8, 1, list(range(8)), train_shares)
    assert [len(step) for step in train_shares[0].batch.steps] == [1]  # one micro-batch of 160 tokens
    assert [len(step) for step in passes[0].batch.steps] == [8]  # one sample per pass micro-batch

    small = demo_run(tmp_path / "small", *packed, "--log-probs-max-tokens-per-gpu", "1")
    large = demo_run(tmp_path / "large", *packed)
    assert len(small) == len(large) == 2
    for a, b in zip(small, large):
        for key in ("rollout/log_probs", "rollout/ref_log_probs", "train/kl_loss", "train/loss", "train/grad_norm",
                    "train/ppo_kl", "train/pg_clipfrac"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key  # float32 rounding of another packing
    assert abs(small[1]["rollout/ref_log_probs"] - small[1]["rollout/log_probs"]) > 1e-5  # rollout 1 trained


@pytest.fixture
def user_functions(monkeypatch):
    import importlib

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    module = importlib.import_module("miles_user_functions")
    module.CALLS.clear()
    return module


TIS_COMPARED = ("train/pg_loss", "train/loss", "train/grad_norm", "train/tis", "train/tis_clipfrac", "train/tis_abs",
                "train/ois", "train/train_rollout_kl", "train/train_rollout_logprob_abs_diff")


def test_custom_tis_function_written_like_the_builtin_trains_as_use_tis_does(tmp_path, user_functions):
    common = ("--num-rollout", "2", "--use-tis", "--tis-clip", "1.0001", "--tis-clip-low", "0.9999")
    builtin = demo_run(tmp_path / "builtin", *common)
    custom = demo_run(tmp_path / "custom", *common, "--custom-tis-function-path", "miles_user_functions.vanilla_tis")
    for a, b in zip(custom, builtin):
        for key in TIS_COMPARED:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
    assert all(r["train/tis_abs"] > 0 and r["train/pg_loss"] != 0 for r in builtin)  # weights not all 1
    name, lengths, total, response, extra = user_functions.CALLS[0]
    assert name == "vanilla_tis" and lengths == response and all(t > r for t, r in zip(total, response))
    assert extra == ["max_seq_lens", "parallel_state"]


def test_get_mismatch_metrics_computes_the_trainers_log_probs_under_use_rollout_logprobs(tmp_path, user_functions):
    # pi_old from the engine; the trainer's pass runs anyway and is compared with the engine's log-probs
    engine_old = demo_run(tmp_path / "engine", "--num-rollout", "1", "--use-rollout-logprobs", "--get-mismatch-metrics",
                          "--custom-tis-function-path", "miles_user_functions.reject_first_token")[0]
    # the same rollout with the trainer's pi_old: the loss plugin compares the same two log-probs itself
    trainer_old = demo_run(tmp_path / "trainer", "--num-rollout", "1", "--no-reuse-train-log-probs",
                           "--get-mismatch-metrics", "--custom-tis-function-path",
                           "miles_user_functions.reject_first_token")[0]
    for key in ("train/train_rollout_kl", "train/train_rollout_logprob_abs_diff", "train/seen_ratio"):
        assert engine_old[key] == pytest.approx(trainer_old[key], rel=1e-5, abs=1e-9), key
    assert engine_old["train/train_rollout_logprob_abs_diff"] > 0
    assert engine_old["train/seen_ratio"] == pytest.approx(1.0, abs=1e-3)
    assert engine_old["perf/log_probs_time"] > 0


CONVERT_COMPARED = ("train/pg_loss", "train/loss", "train/grad_norm", "rollout/rewards", "rollout/raw_reward",
                    "rollout/advantages", "rollout/log_probs")


def test_custom_convert_samples_to_train_data_replaces_the_conversion(tmp_path, user_functions):
    default = demo_run(tmp_path / "default", "--num-rollout", "2")
    by_hand = demo_run(tmp_path / "hand", "--num-rollout", "2", "--custom-convert-samples-to-train-data-path",
                       "miles_user_functions.convert_by_hand")
    for a, b in zip(by_hand, default):
        for key in CONVERT_COMPARED:
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), key
    assert [c[0] for c in user_functions.CALLS] == ["convert_by_hand"] * 2
    assert user_functions.CALLS[0][1] == list(range(8))  # the rollout's samples, in index order
    unit = demo_run(tmp_path / "unit", "--num-rollout", "1", "--custom-convert-samples-to-train-data-path",
                    "miles_user_functions.convert_with_unit_rewards")[0]
    assert unit["rollout/rewards"] == 1.0 and unit["rollout/raw_reward"] == default[0]["rollout/raw_reward"]
    assert unit["rollout/advantages"] == 0.0 and unit["train/pg_loss"] == 0.0  # every group has one reward


def test_rollout_data_postprocess_runs_after_log_probs_and_may_change_the_loss_masks(tmp_path, user_functions):
    miles_form = demo_run(tmp_path / "miles", "--num-rollout", "2", "--rollout-data-postprocess-path",
                          "miles_user_functions.postprocess_miles_form")
    assert user_functions.CALLS == [("postprocess_miles_form", 2)] * 2
    assert miles_form[0]["train/grad_norm"] > 0
    masked = demo_run(tmp_path / "masked", "--num-rollout", "1", "--rollout-data-postprocess-path",
                      "miles_user_functions.mask_everything")[0]
    assert user_functions.CALLS[2:] == [("mask_everything", 8, 8)]
    assert masked["train/loss"] == 0.0 and masked["train/pg_loss"] == 0.0 and masked["train/grad_norm"] == 0.0
    assert "rollout/log_probs" not in masked  # a mean over the trained tokens: there are none


def test_async_save_writes_checkpoints_a_resumed_run_continues_from(tmp_path, caplog):
    whole = demo_run(tmp_path / "whole", "--num-rollout", "4", "--async-save", "--save-interval", "2")
    assert (tmp_path / "whole" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    save = tmp_path / "stopped"
    first = demo_run(save, "--num-rollout", "4", "--async-save", "--save-interval", "2",
                     "--debug-exit-after-rollout", "2")
    assert [r["rollout/step"] for r in first] == [0, 1]
    # the run waited at its end for the checkpoint written in the background
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert (save / "iter_0000001" / "model").is_dir()
    resumed = demo_run(save, "--num-rollout", "4", "--async-save", "--save-interval", "2", "--load", str(save))
    by_step = {r["rollout/step"]: r for r in resumed}
    assert sorted(by_step) == [0, 1, 2, 3]
    for r in whole[2:]:
        for key in ("rollout/raw_reward", "rollout/log_probs", "train/loss", "train/grad_norm", "train/lr"):
            assert by_step[r["rollout/step"]][key] == pytest.approx(r[key], rel=1e-5, abs=1e-7), key


def test_no_keep_fp32_master_trains_the_bfloat16_parameters_in_place(tiny_model_dir, tmp_path):
    import sys

    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_model import make_batch, train_config

    from furlong.builtin_plugins.backends.fsdp import train_backend

    def backend(**overrides):
        made = train_backend(config=train_config(tiny_model_dir, bf16=True, **overrides))
        asyncio.run(made.init(made.config))
        return made

    masters, plain = backend(), backend(keep_fp32_master=False)
    assert plain.masters is None and plain.compute_model is plain.model
    assert {p.dtype for p in plain.model.parameters()} == {torch.bfloat16}
    assert plain._precision() == "bf16 parameters, no fp32 master weights (--no-keep-fp32-master)"
    before = {n: p.clone() for n, p in plain.model.named_parameters()}
    ragged = [[[0, 1, 2], [3]]]
    a = asyncio.run(masters.train(0, make_batch(masters.tokenizer, ragged)))[0]
    b = asyncio.run(plain.train(0, make_batch(plain.tokenizer, ragged)))[0]
    # the same bfloat16 forward (the masters' copy is their rounding, which is what --no-keep-fp32-master loads)
    assert a["loss"] == b["loss"]
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-2)  # bfloat16 gradients, not float32 ones
    after = dict(plain.model.named_parameters())
    assert all(p.dtype == torch.bfloat16 for p in after.values())
    assert any(not torch.equal(before[n], after[n]) for n in before)  # the optimizer stepped the bf16 weights
    asyncio.run(plain.save(str(tmp_path / "ckpt")))
    resumed = backend(keep_fp32_master=False)
    asyncio.run(resumed.load(str(tmp_path / "ckpt")))
    for name, param in resumed.model.named_parameters():
        assert torch.equal(param, after[name]), name


def test_no_keep_fp32_master_needs_bf16():
    from furlong.core.config import ConfigError, parse_args

    with pytest.raises(ConfigError, match="--no-keep-fp32-master changes only --bf16 runs"):
        parse_args(["--hf-checkpoint", str(DEMO / "model"), "--num-rollout", "1", "--rollout-batch-size", "4",
                    "--no-keep-fp32-master"])
    assert parse_args(["--hf-checkpoint", str(DEMO / "model"), "--num-rollout", "1", "--rollout-batch-size", "4",
                       "--bf16", "--no-keep-fp32-master"]).keep_fp32_master is False


def test_custom_tis_rejected_tokens_leave_the_numerator_not_the_denominator(user_functions):
    import torch

    from furlong.core.config.launch_args import launch_config
    from furlong.core.plugins.manager import get_plugin_manager
    from furlong.core.train.objective import StepObjective
    from furlong.hooks import TrainBatch

    config = launch_config(use_tis=True, custom_tis_function_path="miles_user_functions.reject_first_token",
                           entropy_coef=0.0, use_kl_loss=False, calculate_per_token_loss=False)
    masks = [torch.ones(3), torch.tensor([1.0, 0.0, 1.0, 1.0])]
    old = [torch.full((3,), -1.0), torch.full((4,), -2.0)]
    batch = TrainBatch(tokens=[[0] * 5, [0] * 6], response_lengths=[3, 4], loss_masks=masks, steps=[[[0, 1]]],
                       old_log_probs=old, rollout_log_probs=[torch.full((3,), -1.5), torch.full((4,), -2.0)],
                       advantages=[torch.full((3,), 1.0), torch.full((4,), -2.0)])
    objective = StepObjective(config, get_plugin_manager(), batch, "policy_loss", "--loss-type")
    logp = [o.clone().requires_grad_(True) for o in old]  # ratio 1: pg = -A on every token
    _, metrics = asyncio.run(objective([0, 1], logp, None))
    # per-sample means over the original masks (3 and 3 tokens), the first token of each rejected:
    # sample 0: (-1 - 1) / 3; sample 1: (2 + 2) / 3 (its second token is masked anyway); mean over 2 samples
    assert float(metrics["pg_loss"]) == pytest.approx(((-2 / 3) + (4 / 3)) / 2, rel=1e-6)
    # the function's metric, reduced over the original masks: exp(old - rollout) = e^0.5 and 1
    assert float(metrics["seen_ratio"]) == pytest.approx((torch.e ** 0.5 + 1.0) / 2, rel=1e-6)
    assert float(metrics["ois"]) == pytest.approx(1.0)


def test_keep_old_actor_gives_train_async_the_weights_the_engines_generated_with(tmp_path, caplog):
    caplog.set_level("INFO", logger="furlong.train")
    kept = demo_run(tmp_path / "kept", "--num-rollout", "4", "--keep-old-actor", "--no-use-tis", command="train-async")
    plain = demo_run(tmp_path / "plain", "--num-rollout", "4", "--no-use-tis", command="train-async")
    diff = "train/train_rollout_logprob_abs_diff"
    # train-async generates rollout r + 1 while r trains: from rollout 1 on, the engines ran weights one sync
    # older than the trainer's. The old actor is that copy: pi_old equals the engine's log-probs to rounding
    assert all(r[diff] < 1e-5 for r in kept), [r[diff] for r in kept]
    assert max(r[diff] for r in plain[1:]) > 1e-3  # without it pi_old is the trainer's newer weights'
    assert kept[0]["rollout/log_probs"] == pytest.approx(plain[0]["rollout/log_probs"], rel=1e-6)  # both initial


def test_custom_tis_function_runs_under_train_async_where_tis_is_on_by_default():
    from furlong.core.config import parse_args

    args = parse_args(["--hf-checkpoint", str(DEMO / "model"), "--num-rollout", "1", "--rollout-batch-size", "4",
                       "--custom-tis-function-path", "miles_user_functions.vanilla_tis"], command="train-async")
    assert args.use_tis is True and args.custom_tis_function_path == "miles_user_functions.vanilla_tis"


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_token_packed_micro_batches_keep_prompt_groups_whole_for_a_backend_that_shares_prompts(
        tmp_path, caplog, monkeypatch, backend):
    """The fsdp backend runs a prompt its samples share once, so the planner keeps each group of 4 samples in one
    micro-batch; the megatron backend says it shares only where its micro-batches are always packed (a GPU), so
    on a CPU they are packed by length alone."""
    if backend == "megatron":
        pytest.importorskip("megatron.core", reason="the megatron extra (megatron-core) is not installed")
    from furlong.core.train import batching, group

    plans = []

    def recording(*args, **kwargs):
        plan = batching.plan_steps(*args, **kwargs)
        plans.append((kwargs["groups"], plan))
        return plan

    monkeypatch.setattr(group, "plan_steps", recording)
    caplog.set_level("INFO", logger="furlong.train")
    rows = demo_run(tmp_path, "--train-backend", backend, "--num-rollout", "2", "--use-dynamic-batch-size",
                    "--max-tokens-per-gpu", "100")
    assert len(rows) == 2 and plans
    shares = backend == "fsdp"
    assert ("micro-batches packed by tokens take each prompt group as one item" in caplog.text) is shares
    for groups, plan in plans:
        assert (groups == [0, 0, 0, 0, 1, 1, 1, 1]) if shares else groups is None
        micro_batches = [mb for step in plan for mb in step]
        assert sorted(i for mb in micro_batches for i in mb) == list(range(8))
        if shares:  # each group (about 80 tokens) fits the budget: both whole, one micro-batch each
            assert sorted(micro_batches) == [[0, 1, 2, 3], [4, 5, 6, 7]]
