"""The fsdp train backend on a tiny random Llama (CPU): steps, exactness, LR schedule, checkpoints, FSDP2."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from tiny_model import TWO_RANK_FLAGS, make_batch, run_two_ranks, train_args, train_config  # noqa: E402

from furlong.builtin_plugins.backends.fsdp import FSDPBackend, train_backend  # noqa: E402
from furlong.builtin_plugins.backends.fsdp.schedule import LRSchedule, lr_at  # noqa: E402
from furlong.hooks import PluginError, TrainBackend  # noqa: E402

ALL_IN_ONE = [[[0, 1, 2, 3]]]
ONE_BY_ONE = [[[0], [1], [2], [3]]]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_dir):
    return tiny_model_dir


def _backend(tiny_dir, **overrides) -> FSDPBackend:
    backend = train_backend(config=train_config(tiny_dir, **overrides))
    assert asyncio.run(backend.init(backend.config)) == 0
    return backend


def _weights(backend) -> dict:
    return {name: t.clone() for name, t in asyncio.run(backend.named_weights())}


def _objective_value(backend, batch) -> float:
    lp = asyncio.run(backend.log_probs(batch))["log_probs"]
    loss, _ = asyncio.run(batch.objective(list(range(len(lp))), lp, [torch.zeros(1)] * len(lp)))
    return float(loss)


# --- training ---------------------------------------------------------------------------


def test_backend_meets_the_protocol(tiny_dir):
    assert isinstance(_backend(tiny_dir), TrainBackend)


def test_one_step_lowers_the_objective(tiny_dir):
    backend = _backend(tiny_dir)
    batch = make_batch(backend.tokenizer, ALL_IN_ONE)
    before = _objective_value(backend, batch)
    metrics = asyncio.run(backend.train(0, batch))
    after = _objective_value(backend, batch)
    assert after < before - 1e-3
    assert len(metrics) == 1
    assert metrics[0]["loss"] == pytest.approx(before, abs=1e-5)  # objective metric, summed over micro-batches
    assert metrics[0]["lr"] == 1e-2
    assert metrics[0]["grad_norm"] > 0
    assert backend.global_step == 1


def test_gradient_accumulation_is_exact(tiny_dir):
    # SGD without momentum or clipping: the update is -lr * gradient, so equal weights
    # after the step mean equal gradients for 1 micro-batch of 4 and 4 micro-batches of 1
    kw = dict(optimizer="sgd", sgd_momentum=0.0, lr=1.0, clip_grad=0.0)
    one, four = _backend(tiny_dir, **kw), _backend(tiny_dir, **kw)
    start = _weights(one)
    m1 = asyncio.run(one.train(0, make_batch(one.tokenizer, ALL_IN_ONE)))
    m4 = asyncio.run(four.train(0, make_batch(four.tokenizer, ONE_BY_ONE)))
    w1, w4 = _weights(one), _weights(four)
    assert max((w1[k] - start[k]).abs().max().item() for k in start) > 1e-3  # the step moved the weights
    for name in w1:
        torch.testing.assert_close(w4[name], w1[name], rtol=0, atol=1e-6)
    assert m4[0]["grad_norm"] == pytest.approx(m1[0]["grad_norm"], rel=1e-5)
    assert m4[0]["loss"] == pytest.approx(m1[0]["loss"], abs=1e-6)


def test_objective_gets_each_micro_batch_once(tiny_dir):
    backend = _backend(tiny_dir)
    batch = make_batch(backend.tokenizer, [[[0, 2], [1]], [[3]]])
    metrics = asyncio.run(backend.train(0, batch))
    assert batch.objective.calls == [[0, 2], [1], [3]]
    assert len(metrics) == 2 and backend.global_step == 2


def test_nan_loss_is_a_hard_error(tiny_dir):
    backend = _backend(tiny_dir)
    batch = make_batch(backend.tokenizer, ALL_IN_ONE)
    batch.objective.scale = float("nan")
    with pytest.raises(FloatingPointError) as err:
        asyncio.run(backend.train(3, batch))
    assert str(err.value) == (
        "fsdp: rollout 3 step 0: non-finite loss or gradient (grad norm nan); lower --lr, check rewards and data, "
        "or pass --no-check-for-nan-in-loss-and-grad to skip such steps."
    )


def test_nan_step_is_skipped_with_the_flag(tiny_dir):
    from furlong.builtin_plugins.backends.fsdp import MEGATRON_FLAGS

    # --no-check-for-nan-in-loss-and-grad stores False here; not reported as a Megatron flag the backend ignores
    assert MEGATRON_FLAGS.honoured("check_for_nan_in_loss_and_grad", False)
    backend = _backend(tiny_dir, check_for_nan_in_loss_and_grad=False)
    start = _weights(backend)
    batch = make_batch(backend.tokenizer, ALL_IN_ONE)
    batch.objective.scale = float("inf")
    metrics = asyncio.run(backend.train(0, batch))
    assert math.isnan(metrics[0]["grad_norm"])
    assert backend.global_step == 0  # neither the optimizer nor the LR schedule advanced
    after = _weights(backend)
    assert all(torch.equal(after[k], start[k]) for k in start)


def test_reset_optimizer_states_restarts_adam(tiny_dir):
    backend = _backend(tiny_dir, reset_optimizer_states=True)
    for rollout in range(2):
        asyncio.run(backend.train(rollout, make_batch(backend.tokenizer, ALL_IN_ONE)))
    steps = {float(s["step"]) for s in backend.optimizer.state.values()}
    assert steps == {1.0}  # one Adam step since the reset, though two were taken
    assert backend.global_step == 2


def test_reference_model_is_frozen(tiny_dir):
    backend = _backend(tiny_dir, use_kl_loss=True)
    batch = make_batch(backend.tokenizer, ALL_IN_ONE)
    ref_before = asyncio.run(backend.log_probs(batch, model="ref"))["log_probs"]
    actor_before = asyncio.run(backend.log_probs(batch, model="actor"))["log_probs"]
    for a, b in zip(ref_before, actor_before):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    asyncio.run(backend.train(0, batch))
    ref_after = asyncio.run(backend.log_probs(batch, model="ref"))["log_probs"]
    actor_after = asyncio.run(backend.log_probs(batch, model="actor"))["log_probs"]
    assert all(torch.equal(a, b) for a, b in zip(ref_before, ref_after))
    assert not all(torch.equal(a, b) for a, b in zip(actor_before, actor_after))


def test_reference_log_probs_need_a_reference(tiny_dir):
    backend = _backend(tiny_dir)
    with pytest.raises(PluginError) as err:
        asyncio.run(backend.log_probs(make_batch(backend.tokenizer, ALL_IN_ONE), model="ref"))
    assert str(err.value) == (
        "fsdp: log_probs(model='ref') but no such model is loaded (the reference loads only with --use-kl-loss or "
        "--kl-coef != 0)."
    )


# --- learning-rate schedule ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "step, style, expected",
    [
        (0, "constant", 1e-4),  # warmup start: init
        (2, "constant", 5.5e-4),  # 1e-4 + (1e-3 - 1e-4) * 2/4
        (4, "constant", 1e-3),  # after warmup: lr
        (50, "constant", 1e-3),  # constant never decays, even after lr_decay_iters
        (7, "linear", 5.5e-4),  # rho = (7-4)/(10-4) = 0.5: 1e-3 - (1e-3 - 1e-4) * 0.5
        (10, "linear", 1e-4),  # rho = 1: min_lr
        (11, "linear", 1e-4),  # after decay: min_lr
        (7, "cosine", 5.5e-4),  # 1e-4 + 9e-4 * (1 + cos(pi/2))/2
        (5.5, "cosine", 8.681981e-4),  # rho 0.25: 1e-4 + 9e-4 * (1 + cos(pi/4))/2
        (11, "inverse-square-root", 1e-4),  # after decay: min_lr
    ],
)
def test_lr_schedule_values(step, style, expected):
    lr = lr_at(step, lr=1e-3, min_lr=1e-4, warmup=4, decay=10, style=style, init=1e-4)
    assert lr == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize(
    "step, expected",
    [
        (16, 5e-4),  # 1e-3 * sqrt(4)/sqrt(16)
        (40, 3.162278e-4),  # 1e-3 * sqrt(4/40)
        (1600, 1e-4),  # 1e-3 * sqrt(4/1600) = 5e-5, floored at min_lr
    ],
)
def test_inverse_square_root_values(step, expected):
    lr = lr_at(step, lr=1e-3, min_lr=1e-4, warmup=4, decay=10_000, style="inverse-square-root")
    assert lr == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize(
    "step, wsd_style, expected",
    [
        (6, "linear", 1.0),  # anneal starts at decay - wsd = 10 - 4 = 6: still lr
        (8, "linear", 0.55),  # r = 0.5: 0.1 + 0.9 * (1 - 0.5)
        (8, "exponential", 0.472792),  # 0.1 + 0.9 * (2 * 0.5**0.5 - 1)
        (8, "minus_sqrt", 0.363604),  # 0.1 + 0.9 * (1 - sqrt(0.5)) = 0.1 + 0.9 * 0.292893
        (8, "cosine", 0.55),  # 0.1 + 0.9 * (1 + cos(pi/2))/2
    ],
)
def test_wsd_schedule_values(step, wsd_style, expected):
    lr = lr_at(step, lr=1.0, min_lr=0.1, warmup=0, decay=10, style="WSD", wsd_decay=4, wsd_style=wsd_style)
    assert lr == pytest.approx(expected, rel=1e-6)


def test_schedule_defaults_decay_to_total_steps(tiny_dir):
    # T = num_rollout * rbs * n / gbs = 3 * 4 * 4 / 8 = 6 steps; warmup 2
    config = train_config(tiny_dir, num_rollout=3, rollout_batch_size=4, n_samples_per_prompt=4, global_batch_size=8,
                          num_steps_per_rollout=2, lr=1.0, min_lr=0.0, lr_decay_style="linear", lr_warmup_iters=2)
    schedule = LRSchedule.from_config(config)
    assert schedule.decay == 6
    assert [schedule(k) for k in range(7)] == pytest.approx([0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0])


def test_schedule_warmup_fraction_is_of_the_decay_steps(tiny_dir):
    config = train_config(tiny_dir, num_rollout=10, lr_decay_style="cosine", lr_warmup_fraction=0.2)
    assert LRSchedule.from_config(config).warmup == pytest.approx(2.0)  # 0.2 * T, T = 10 rollouts x 1 step


def test_wsd_needs_its_anneal_length(tiny_dir):
    with pytest.raises(PluginError) as err:
        LRSchedule.from_config(train_config(tiny_dir, lr_decay_style="WSD"))
    assert str(err.value) == "--lr-decay-style WSD needs --lr-wsd-decay-iters (steps of the final anneal)."


def test_train_reports_the_scheduled_lr(tiny_dir):
    backend = _backend(tiny_dir, lr=1e-2, lr_warmup_iters=2, num_rollout=2, num_steps_per_rollout=2,
                       global_batch_size=2, rollout_batch_size=4)
    metrics = asyncio.run(backend.train(0, make_batch(backend.tokenizer, [[[0, 1]], [[2, 3]]])))
    assert [m["lr"] for m in metrics] == pytest.approx([0.0, 5e-3])  # warmup: 0, then 1e-2 * 1/2


# --- checkpoints --------------------------------------------------------------------------------


def test_save_then_load_continues_identically(tiny_dir, tmp_path):
    first = _backend(tiny_dir)
    asyncio.run(first.train(0, make_batch(first.tokenizer, ALL_IN_ONE)))
    ckpt = tmp_path / "iter_0000000.tmp"
    asyncio.run(first.save(str(ckpt)))
    draw = torch.rand(3)
    asyncio.run(first.train(1, make_batch(first.tokenizer, ALL_IN_ONE)))
    expected = _weights(first)

    second = _backend(tiny_dir)
    asyncio.run(second.load(str(ckpt)))
    assert torch.equal(torch.rand(3), draw)  # RNG restored
    assert second.global_step == 1
    asyncio.run(second.train(1, make_batch(second.tokenizer, ALL_IN_ONE)))
    got = _weights(second)
    assert all(torch.equal(got[k], expected[k]) for k in expected)  # Adam moments restored exactly

    meta = json.loads((ckpt / "meta.json").read_text())
    assert {k: meta[k] for k in ("global_step", "world_size")} == {"global_step": 1, "world_size": 1}
    assert sorted(p.name for p in ckpt.iterdir()) == ["meta.json", "model", "optimizer.pt", "rng.pt"]


def test_checkpoint_model_dir_is_a_hugging_face_model(tiny_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    backend = _backend(tiny_dir)
    asyncio.run(backend.train(0, make_batch(backend.tokenizer, ALL_IN_ONE)))
    asyncio.run(backend.save(str(tmp_path / "ckpt")))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "model")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "ckpt" / "model")
    trained = _weights(backend)
    assert all(torch.equal(t, trained[k]) for k, t in model.state_dict().items())
    assert tokenizer.decode(tokenizer.encode("Q: 2+3=")) == "Q: 2+3="


def test_no_load_optim_keeps_the_step_but_not_adam(tiny_dir, tmp_path):
    first = _backend(tiny_dir)
    asyncio.run(first.train(0, make_batch(first.tokenizer, ALL_IN_ONE)))
    asyncio.run(first.save(str(tmp_path / "ckpt")))
    second = _backend(tiny_dir, no_load_optim=True)
    asyncio.run(second.load(str(tmp_path / "ckpt")))
    assert second.global_step == 1 and len(second.optimizer.state) == 0
    assert all(torch.equal(a, b) for a, b in zip(_weights(second).values(), _weights(first).values()))


def test_finetune_loads_the_weights_only_and_starts_the_step_at_zero(tiny_dir, tmp_path):
    first = _backend(tiny_dir)
    for rollout in range(2):
        asyncio.run(first.train(rollout, make_batch(first.tokenizer, ALL_IN_ONE)))
    asyncio.run(first.save(str(tmp_path / "ckpt")))
    second = _backend(tiny_dir, finetune=True)  # --no-load-optim / --no-load-rng off: --finetune alone suffices
    rng_before = torch.get_rng_state()
    asyncio.run(second.load(str(tmp_path / "ckpt")))
    assert first.global_step == 2 and second.global_step == 0 and len(second.optimizer.state) == 0
    assert torch.equal(torch.get_rng_state(), rng_before)  # the checkpoint's rng.pt was not read
    assert all(torch.equal(a, b) for a, b in zip(_weights(second).values(), _weights(first).values()))


def test_load_rejects_a_foreign_directory(tiny_dir, tmp_path):
    backend = _backend(tiny_dir)
    with pytest.raises(PluginError) as err:
        asyncio.run(backend.load(str(tmp_path)))
    assert str(err.value) == f"checkpoint {tmp_path}: no meta.json; it was not written by the fsdp backend."


# --- FSDP2 over two ranks -----------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_two_rank_fsdp2_matches_one_process(tiny_dir, tmp_path):
    """Two gloo ranks, two samples each, must give the single-process gradient step exactly.

    The objective divides by the global batch size (4) on each rank, so the ranks'
    gradients must be summed, not averaged (FSDP2 divide factor 1).
    """
    run_two_ranks("fsdp_two_ranks.py", str(tiny_dir), str(tmp_path))
    dist_result = torch.load(tmp_path / "rank0.pt", weights_only=True)

    single = _backend(tiny_dir, **TWO_RANK_FLAGS)
    batch = make_batch(single.tokenizer, ALL_IN_ONE)
    old = asyncio.run(single.log_probs(batch))["log_probs"]
    metrics = asyncio.run(single.train(0, batch))
    expected = _weights(single)
    assert dist_result["grad_norm"] == pytest.approx(metrics[0]["grad_norm"], rel=1e-5)
    assert dist_result["loss"] == pytest.approx(metrics[0]["loss"], abs=1e-6)
    for name, tensor in expected.items():
        torch.testing.assert_close(dist_result["weights"][name], tensor, rtol=0, atol=1e-6)
    for rank in (0, 1):  # each rank computed the log-probs of its own samples
        mine = torch.load(tmp_path / f"logprobs{rank}.pt", weights_only=True)
        assert sorted(mine) == [rank, rank + 2]  # round-robin: rank r gets samples r and r + 2
        for i, lp in mine.items():
            torch.testing.assert_close(lp, old[i], rtol=0, atol=1e-6)
    # the 2-rank checkpoint loads into one process
    reloaded = _backend(tiny_dir, **TWO_RANK_FLAGS)
    asyncio.run(reloaded.load(str(tmp_path / "ckpt")))
    assert reloaded.global_step == 1
    got = _weights(reloaded)
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-6)
    # ...with the SGD momentum buffers: one more identical step stays identical
    for backend in (single, reloaded):
        asyncio.run(backend.train(1, make_batch(backend.tokenizer, ALL_IN_ONE)))
    after_single, after_reloaded = _weights(single), _weights(reloaded)
    for name, tensor in after_single.items():
        torch.testing.assert_close(after_reloaded[name], tensor, rtol=0, atol=1e-6)


def test_flash_attention_that_is_not_installed_falls_back_to_sdpa(tiny_dir, caplog):
    """On CUDA the default is flash_attention_2; without the package the model loads with sdpa, which
    on CUDA then becomes packed attention (sdpa for unpacked calls)."""
    from furlong.builtin_plugins.backends.fsdp.model import load_causal_lm
    from furlong.core.config.launch_args import launch_config

    if __import__("importlib").util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed here, so there is nothing to fall back from")
    config = launch_config(attn_implementation="flash_attention_2", gradient_checkpointing=False, bf16=True,
                           configure=False)
    with caplog.at_level(logging.WARNING, logger="furlong"):
        model = load_causal_lm(str(tiny_dir), config, torch.device("cuda"), "--hf-checkpoint")  # loads on the host
    assert model.config._attn_implementation == "furlong_packed"
    config = config.replace(bf16=False)  # float32 on a GPU: the variable-length flash kernel runs in 16-bit only
    with caplog.at_level(logging.INFO, logger="furlong"):
        model = load_causal_lm(str(tiny_dir), config, torch.device("cuda"), "--hf-checkpoint")
    assert model.config._attn_implementation == "sdpa"
    assert any("right-padded, not packed: float32 training" in m for m in caplog.messages)
    assert any("attention 'flash_attention_2' did not load" in m and "trying 'sdpa'" in m for m in caplog.messages)


# --- chunked log-probs ----------------------------------------------------------------------


@pytest.mark.parametrize("grad", [False, True])
def test_chunked_log_probs_equal_the_whole_logits_path(tiny_dir, grad):
    """The projection run only on response positions, in 3-row checkpointed chunks, gives the
    log-probs, entropy and gradients of full ``[B, L, V]`` logits."""
    from furlong.builtin_plugins.backends.fsdp import logprobs

    backend = _backend(tiny_dir)
    batch = make_batch(backend.tokenizer, ALL_IN_ONE, temperature=0.7)
    model, lengths = backend.model, batch.response_lengths

    def run(split: bool):
        model.zero_grad(set_to_none=True)
        original = logprobs.VOCAB_CHUNK_TOKENS
        logprobs.VOCAB_CHUNK_TOKENS = 3
        try:
            if split:
                lp, ent = logprobs.forward_log_probs(model, batch.tokens, lengths, 0.7, "cpu", grad=grad,
                                                     entropy_grad=grad)
            else:
                with pytest.MonkeyPatch.context() as mp:
                    mp.setattr(logprobs, "_split_head", lambda m: None)
                    lp, ent = logprobs.forward_log_probs(model, batch.tokens, lengths, 0.7, "cpu", grad=grad,
                                                         entropy_grad=grad)
        finally:
            logprobs.VOCAB_CHUNK_TOKENS = original
        grads = None
        if grad:
            (sum(x.sum() for x in lp) + 0.1 * sum(e.sum() for e in ent)).backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        return [x.detach() for x in lp], [e.detach() for e in ent], grads

    lp_a, ent_a, g_a = run(split=True)
    lp_b, ent_b, g_b = run(split=False)
    assert [len(x) for x in lp_a] == list(lengths)
    for a, b in zip(lp_a + ent_a, lp_b + ent_b):  # equal up to float32 rounding (other matmul shapes)
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    if grad:
        for name in g_b:
            torch.testing.assert_close(g_a[name], g_b[name], rtol=1e-5, atol=1e-6)


def test_a_megatron_checkpoint_is_named_as_such_by_the_fsdp_backend(tmp_path):
    from furlong.builtin_plugins.backends.fsdp.checkpoint import load_weights

    (tmp_path / "metadata.json").write_text("{}")
    with pytest.raises(PluginError) as err:
        load_weights(str(tmp_path), None, 1, 0, set())
    assert str(err.value) == (f"checkpoint {tmp_path} was written by --train-backend megatron (torch_dist files, no "
                              "model/*.safetensors); resume with --train-backend megatron.")


# --- --train-torch-compile ------------------------------------------------------------------


def test_compiled_decoder_layers_train_as_the_plain_model(tiny_dir):
    plain, compiled = _backend(tiny_dir), _backend(tiny_dir, train_torch_compile=True)
    layers = [m for m in compiled.model.modules() if getattr(m, "_compiled_call_impl", None) is not None]
    assert len(layers) == compiled.model.config.num_hidden_layers
    ragged = [[[0, 1, 2], [3]]]  # micro-batches of two shapes: the compiled layers are dynamic in length
    a = asyncio.run(plain.train(0, make_batch(plain.tokenizer, ragged)))[0]
    b = asyncio.run(compiled.train(0, make_batch(compiled.tokenizer, ragged)))[0]
    assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    wa, wb = _weights(plain), _weights(compiled)
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-4  # Adam's first step is lr * sign(g): 1e-2


def test_compiled_layers_are_refused_across_ranks(tiny_dir):
    from furlong.builtin_plugins.backends.fsdp import configure
    from furlong.hooks import ConfigReport

    report = ConfigReport(plugin="fsdp")
    configure(args=train_args(tiny_dir, train_torch_compile=True, actor_num_nodes=1, actor_num_gpus_per_node=2,
                                context_parallel_size=1, dp_replicate_size=1), report=report)
    assert [m for m in report.errors if "--train-torch-compile with 2 trainer ranks is not supported yet" in m]


def test_attention_defaults_to_sdpa_which_packs_unless_given(tiny_dir):
    from furlong.builtin_plugins.backends.fsdp import configure
    from furlong.hooks import ConfigReport

    flags = dict(actor_num_nodes=1, actor_num_gpus_per_node=1, context_parallel_size=1, dp_replicate_size=1)
    args = train_args(tiny_dir, attn_implementation="flash_attention_2", explicit_args=[], **flags)  # CUDA default
    report = ConfigReport(plugin="fsdp")
    configure(args=args, report=report)
    assert args.attn_implementation == "sdpa" and not report.errors
    assert [m for m in report.infos if "each micro-batch is concatenated into one row" in m]
    given = train_args(tiny_dir, attn_implementation="flash_attention_2", explicit_args=["attn_implementation"],
                       **flags)
    report = ConfigReport(plugin="fsdp")
    configure(args=given, report=report)
    assert given.attn_implementation == "flash_attention_2" and not report.infos
    errors = {}
    for name in ("bogus", "kernels-community/flash-attn", "eager"):
        report = ConfigReport(plugin="fsdp")
        configure(args=train_args(tiny_dir, attn_implementation=name, explicit_args=["attn_implementation"], **flags),
                  report=report)
        errors[name] = report.errors
    assert errors == {"bogus": [
        "--attn-implementation 'bogus': not an attention implementation of transformers; choose eager, "
        "flash_attention_2, flash_attention_3, flash_attention_4, flex_attention, sdpa, or a kernels hub "
        "repository such as kernels-community/flash-attn."], "kernels-community/flash-attn": [], "eager": []}


# --- --bf16: bfloat16 parameters over float32 master weights ---------------------------------


def test_bf16_trains_a_bfloat16_copy_over_float32_masters(tiny_dir, tmp_path):
    fp32, bf16 = _backend(tiny_dir), _backend(tiny_dir, bf16=True)
    assert {p.dtype for p in bf16.compute_model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in bf16.model.parameters()} == {torch.float32}
    ragged = [[[0, 1, 2], [3]]]
    a = asyncio.run(fp32.train(0, make_batch(fp32.tokenizer, ragged)))[0]
    b = asyncio.run(bf16.train(0, make_batch(bf16.tokenizer, ragged)))[0]
    assert b["loss"] == pytest.approx(a["loss"], abs=2e-2)  # bfloat16 log-probs: ~3 significant digits
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=5e-2)
    masters = dict(bf16.model.named_parameters())
    for name, param in bf16.compute_model.named_parameters():  # the model is its masters, rounded
        assert torch.equal(param, masters[name].to(torch.bfloat16))
    # an update below bfloat16's resolution stays in the masters (lr 1e-2 moves weights ~1e-2 per step; the
    # bfloat16 copy alone would round many of the smaller steps of a tiny learning rate away)
    assert any(not torch.equal(masters[n].to(torch.bfloat16).float(), masters[n]) for n in masters)
    asyncio.run(bf16.save(str(tmp_path / "ckpt")))
    resumed = _backend(tiny_dir, bf16=True)
    asyncio.run(resumed.load(str(tmp_path / "ckpt")))
    for (name, saved), (_, loaded) in zip(bf16.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(saved, loaded), name  # checkpoints hold the float32 masters
    for (name, saved), (_, loaded) in zip(bf16.compute_model.named_parameters(),
                                          resumed.compute_model.named_parameters()):
        assert torch.equal(saved, loaded), name
    c = asyncio.run(bf16.train(1, make_batch(bf16.tokenizer, ragged)))[0]
    d = asyncio.run(resumed.train(1, make_batch(resumed.tokenizer, ragged)))[0]
    assert (c["loss"], c["grad_norm"]) == (d["loss"], d["grad_norm"])  # resume is bit-exact


def test_fp16_is_refused_and_context_parallelism_is_not_reported_as_ignored(tiny_dir):
    from furlong.builtin_plugins.backends.fsdp import MEGATRON_FLAGS, configure
    from furlong.hooks import ConfigReport

    report = ConfigReport(plugin="fsdp")
    configure(args=train_args(tiny_dir, fp16=True, actor_num_nodes=1, actor_num_gpus_per_node=1,
                              context_parallel_size=2, dp_replicate_size=1), report=report)
    assert any(m.startswith("--fp16 is not supported yet by --train-backend fsdp") for m in report.errors)
    assert any(m.startswith("--train-backend fsdp does not support --context-parallel-size 2") for m in report.errors)
    # refused by the backend, so the core's warning about ignored Megatron flags leaves them out
    assert MEGATRON_FLAGS.honoured("context_parallel_size", 2) and MEGATRON_FLAGS.honoured("fp16", True)


def test_sgd_momentum_is_read(tiny_dir):
    from furlong.builtin_plugins.backends.fsdp import MEGATRON_FLAGS

    assert MEGATRON_FLAGS.honoured("sgd_momentum", 0.5)  # not reported as a Megatron flag the backend ignores
    backend = _backend(tiny_dir, optimizer="sgd", sgd_momentum=0.5)
    assert [g["momentum"] for g in backend.optimizer.param_groups] == [0.5] * len(backend.optimizer.param_groups)


def test_the_chosen_precision_is_logged(tiny_dir, caplog):
    with caplog.at_level(logging.INFO, logger="furlong.backends.fsdp"):
        _backend(tiny_dir, bf16=True)
        _backend(tiny_dir)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("fsdp: ") and "weights" in
             r.getMessage() or r.getMessage() == "fsdp: fp32"]
    assert lines == ["fsdp: bf16 parameters, fp32 master weights", "fsdp: fp32"]
