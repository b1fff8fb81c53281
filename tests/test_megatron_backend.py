"""The megatron train backend on CPU: config mapping, HF <-> Megatron conversion, TP=2 over gloo,
log-probs against Hugging Face, training against the fsdp backend, torch_dist checkpoints."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import attrs
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core", reason="the megatron extra (megatron-core) is not installed")

from safetensors.torch import load_file  # noqa: E402

from transformers import (AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config,  # noqa: E402
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from furlong.builtin_plugins.backends.fsdp import train_backend as fsdp_backend  # noqa: E402
from furlong.builtin_plugins.backends.megatron import configure  # noqa: E402
from furlong.builtin_plugins.backends.megatron import train_backend as megatron_backend  # noqa: E402
from furlong.builtin_plugins.backends.megatron.config import check_model_args, model_shape  # noqa: E402
from furlong.builtin_plugins.backends.megatron.convert import (Stage, Unit, export_hf, load_hf,  # noqa: E402
                                                               local_shard, owner, safetensors_stream,
                                                               stage_layer_counts, units)
from furlong.builtin_plugins.backends.megatron.logprobs import vocab_parallel_log_probs  # noqa: E402
from furlong.builtin_plugins.backends.megatron.model import build_gpt, cpu_shims, init_parallel  # noqa: E402
from furlong.core.config.launch_args import launch_args, launch_config  # noqa: E402
from furlong.hooks import ConfigReport, PluginError  # noqa: E402

from .tiny_model import make_batch, train_args, train_config  # noqa: E402

CPU = torch.device("cpu")
STEPS = [[[0, 1], [2]], [[3], [0, 2], [1]]]  # two optimizer steps (as tests/megatron_pipeline_ranks.py)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=100, max_position_embeddings=256)
FAMILIES = {
    "qwen2-untied": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=False)),
    "qwen2-tied": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "qwen3-tied": (Qwen3Config, Qwen3ForCausalLM, dict(tie_word_embeddings=True, head_dim=16)),
    "llama3-untied": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=False, rope_parameters=LLAMA3_ROPE,
                                                         max_position_embeddings=16384)),
}


@pytest.fixture(scope="module", autouse=True)
def one_rank_groups():
    init_parallel(1, CPU)


def random_hf(family: str, seed: int = 0):
    """A tiny HF model of ``family`` with every weight random (norms and biases too), float32, eager attention."""
    config_cls, model_cls, extra = FAMILIES[family]
    config = config_cls(**{**SMALL, **extra})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model


def converted(family: str, path: Path, vocab_rows: int = 100):
    """``(hf_model, shape, megatron_model)``: a random HF model written to ``path`` and loaded into megatron-core."""
    hf = random_hf(family)
    hf.save_pretrained(path)
    shape = model_shape(hf.config)
    model = build_gpt(shape, 1, vocab_rows, torch.float32, CPU)
    load_hf(model, safetensors_stream(str(path)), shape, vocab_rows, 1, 0, str(path))
    return hf, shape, model


def hf_state(model, tied: bool) -> dict:
    return {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}


# --- config mapping ------------------------------------------------------------------------------


def test_config_mapping_per_family():
    q2, q3, llama = (model_shape(random_hf(f).config) for f in ("qwen2-untied", "qwen3-tied", "llama3-untied"))
    assert (q2.family, q2.qkv_bias, q2.qk_layernorm, q2.tied, q2.kv_channels) == ("qwen2", True, False, False, 8)
    assert (q2.num_query_groups, q2.num_attention_heads, q2.rope_scaling_factor) == (2, 4, None)
    # Qwen3: per-head q/k norm, head_dim 16 != hidden 32 / 4 heads, tied, no bias
    assert (q3.family, q3.qkv_bias, q3.qk_layernorm, q3.tied, q3.kv_channels) == ("qwen3", False, True, True, 16)
    assert (llama.rotary_base, llama.rope_scaling_factor, llama.tied) == (500000.0, 8.0, False)


@pytest.mark.parametrize("change, message", [
    (dict(model_type="mistral"), "model_type 'mistral' is not supported"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), "RoPE scaling 'yarn'"),
    (dict(rope_parameters={**LLAMA3_ROPE, "high_freq_factor": 2.0}), "high_freq_factor=2.0"),
    (dict(attention_bias=True), "attention_bias=true"),
])
def test_unsupported_models_are_refused_by_name(change, message):
    config = random_hf("llama3-untied").config
    for key, value in change.items():
        setattr(config, key, value)
    with pytest.raises(PluginError, match=message):
        model_shape(config, "--hf-checkpoint /m")


def test_model_args_that_disagree_with_the_config_name_both_values():
    shape = model_shape(random_hf("qwen2-untied").config)
    args = launch_args(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=4,
                       group_query_attention=True, swiglu=True, disable_bias_linear=True, add_qkv_bias=True,
                       qk_layernorm=False, untie_embeddings_and_output_weights=False, normalization="RMSNorm")
    problems = check_model_args(args, shape, "m/config.json")
    assert problems == [
        "--hidden-size 64 disagrees with m/config.json (hidden_size = 32).",
        "--num-query-groups 4 disagrees with m/config.json (num_key_value_heads = 2).",
        "--untie-embeddings-and-output-weights is absent but m/config.json says tie_word_embeddings = False "
        "(untie-embeddings-and-output-weights in the model).",
    ]
    args.hidden_size, args.num_query_groups, args.untie_embeddings_and_output_weights = 32, 2, True
    assert check_model_args(args, shape, "m/config.json") == []


def test_a_switch_for_a_feature_the_model_lacks_is_refused_without_num_layers_too():
    shape = model_shape(random_hf("llama3-untied").config)
    args = launch_args(num_layers=None, qk_layernorm=True, add_qkv_bias=True, swiglu=False)
    assert check_model_args(args, shape, "m/config.json") == [
        "--add-qkv-bias is given but m/config.json says model_type = llama (no add-qkv-bias in the model).",
        "--qk-layernorm is given but m/config.json says model_type = llama (no qk-layernorm in the model).",
    ]  # --swiglu absent is a disagreement only when the flags describe the whole model (--num-layers)


def test_configure_reports_architecture_and_unsupported_parallelism(tiny_model_dir):
    args = train_args(tiny_model_dir, num_layers=3, pipeline_model_parallel_size=3, sequence_parallel=True,
                      virtual_pipeline_model_parallel_size=2, tensor_model_parallel_size=1,
                      megatron_flags_given=["--num-layers", "--use-distributed-optimizer"])
    report = ConfigReport(plugin="megatron")
    configure(args=args, report=report)
    assert f"--num-layers 3 disagrees with --hf-checkpoint {tiny_model_dir}/config.json (num_hidden_layers = 2)." \
        in report.errors
    assert (f"--hf-checkpoint {tiny_model_dir}: --pipeline-model-parallel-size 3 does not divide the 2 layers "
            "(--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers give the first and last "
            "stages other counts).") in report.errors
    assert "--virtual-pipeline-model-parallel-size 2 is not supported yet by --train-backend megatron." in report.errors
    assert ("--sequence-parallel changes nothing without --tensor-model-parallel-size > 1 (as in Megatron, it is off "
            "there).") in report.warnings
    alone = ConfigReport(plugin="megatron")
    configure(args=train_args(tiny_model_dir, sequence_parallel=True, tensor_model_parallel_size=1), report=alone)
    assert alone.warnings == ["--sequence-parallel changes nothing without --tensor-model-parallel-size > 1 (as in "
                              "Megatron, it is off there)."] and not alone.errors


def test_configure_accepts_sequence_parallelism_with_tensor_pipeline_and_context_parallelism(tiny_model_dir):
    report = ConfigReport(plugin="megatron")
    configure(args=train_args(tiny_model_dir, tensor_model_parallel_size=2, sequence_parallel=True), report=report)
    configure(args=train_args(tiny_model_dir, tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                              sequence_parallel=True), report=report)
    assert not report.errors and not report.warnings
    configure(args=train_args(tiny_model_dir, tensor_model_parallel_size=2, context_parallel_size=2,
                              sequence_parallel=True), report=report)
    assert not report.errors and not report.warnings


def test_configure_accepts_parallel_sizes_of_one_which_change_nothing(tiny_model_dir):
    args = train_args(tiny_model_dir, expert_tensor_parallel_size=1, expert_model_parallel_size=1,
                      pipeline_model_parallel_size=1, context_parallel_size=1, tensor_model_parallel_size=1)
    report = ConfigReport(plugin="megatron")
    configure(args=args, report=report)
    assert report.errors == []
    args.expert_tensor_parallel_size = 2
    configure(args=args, report=report)
    assert report.errors == [f"these Megatron flags describe features the model of --hf-checkpoint {tiny_model_dir}/"
                             "config.json does not have: --expert-tensor-parallel-size (the model has no experts); "
                             "remove them."]


def test_miles_dense_scripts_expert_parallel_sizes_of_one_pass_the_command_line(capsys):
    """Miles' Qwen3 dense scripts give ``--expert-model-parallel-size 1 --expert-tensor-parallel-size 1``:
    given on the command line they are in ``megatron_args``, and one rank changes nothing on a dense model."""
    from furlong.core.cli.commands import main

    argv = ["train", "--hf-checkpoint", "examples/demo/model", "--prompt-data", "p.jsonl", "--num-rollout", "1",
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--global-batch-size", "8",
            "--train-backend", "megatron", "--expert-model-parallel-size", "1"]
    assert main([*argv, "--expert-tensor-parallel-size", "1", "--print-config"]) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["args"]["megatron_args"]["expert_tensor_parallel_size"] == 1
    assert main([*argv, "--expert-tensor-parallel-size", "2", "--print-config"]) == 2
    assert ("config.json does not have: --expert-tensor-parallel-size (the model has no experts); remove them."
            in capsys.readouterr().err)


def test_configure_accepts_context_parallelism(tiny_model_dir):
    report = ConfigReport(plugin="megatron")
    configure(args=train_args(tiny_model_dir, context_parallel_size=2, tensor_model_parallel_size=2), report=report)
    assert report.errors == []


def test_recompute_without_cuda_is_refused_at_launch_as_at_the_start_of_the_backend(tiny_model_dir):
    """--print-config reports what the backend would refuse when it starts: megatron-core's recompute on a machine
    with no GPU (a Ray run's training ranks check for themselves)."""
    from furlong.builtin_plugins.backends.megatron.config import RECOMPUTE_NEEDS_CUDA
    from furlong.hooks.config_report import Machine

    flags = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    for machine, executor, errors in ((Machine(), "local", [RECOMPUTE_NEEDS_CUDA]), (Machine(), "ray", []),
                                      (Machine(cuda=True, gpu_count=1), "local", [])):
        report = ConfigReport(plugin="megatron", machine=machine)
        configure(args=train_args(tiny_model_dir, executor=executor, **flags), report=report)
        assert report.errors == errors, (machine, executor)
    report = ConfigReport(plugin="megatron", machine=Machine())
    configure(args=train_args(tiny_model_dir, recompute_method="uniform", recompute_num_layers=1), report=report)
    assert (report.errors, report.warnings) == ([], [
        "--recompute-method, --recompute-num-layers change nothing without --recompute-granularity full."])
    with pytest.raises(PluginError, match="^--recompute-granularity needs CUDA"):
        backend = megatron_backend(config=train_config(tiny_model_dir, **flags))
        asyncio.run(backend.init(backend.config))


@pytest.mark.parametrize("print_config", [True, False])
def test_a_model_path_absent_here_is_one_warning_under_print_config_else_one_error(tmp_path, tiny_model_dir,
                                                                                  print_config):
    args = train_args(tiny_model_dir, print_config=print_config)
    args.hf_checkpoint = str(tmp_path / "Qwen2.5-0.5B-Instruct")
    report = ConfigReport(plugin="megatron")
    configure(args=args, report=report)
    where = f"--hf-checkpoint {args.hf_checkpoint}"
    if print_config:
        assert (report.warnings, report.errors) == ([
            f"{where}: no config.json here, so the architecture flags and parallel sizes are not checked against it "
            "(the run checks them)."], [])
    else:
        assert (report.warnings, report.errors) == ([], [
            f"{where}: no config.json there; --hf-checkpoint must be a Hugging Face model directory on this machine."])


def test_the_core_reports_only_the_megatron_flags_this_backend_does_not_read(tiny_model_dir):
    import furlong.builtin_plugins.backends.megatron as plugin
    from furlong.core.config.megatron_support import report_megatron_flags

    given = ["--num-layers", "--tensor-model-parallel-size", "--sequence-parallel", "--use-distributed-optimizer",
             "--overlap-grad-reduce", "--moe-router-topk"]
    args = train_args(tiny_model_dir, megatron_flags_given=given, megatron_args={"moe_router_topk": 2})
    report = ConfigReport(plugin="megatron")
    report_megatron_flags(args, "megatron", plugin, report)
    assert report.warnings == ["--train-backend megatron ignores these Megatron flags, which do not change results "
                               "with it: --overlap-grad-reduce."]
    assert report.errors == []  # the MoE flags are the backend's configure's to check (tests/test_megatron_moe.py)


# --- conversion and log-probs at TP=1 ----------------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_round_trip_is_bit_exact_and_logits_equal_hugging_face(family, tmp_path):
    hf, shape, model = converted(family, tmp_path)
    back = dict(export_hf(model, shape, 1, None))
    expected = hf_state(hf, shape.tied)
    assert sorted(back) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(back[name], tensor), name
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), cpu_shims(CPU):
        logits = model(input_ids=ids, position_ids=None, attention_mask=None)
        reference = hf(ids).logits
    torch.testing.assert_close(logits, reference, rtol=0, atol=2e-5)
    lp, ent = vocab_parallel_log_probs(logits[:, :-1].reshape(-1, 100), ids[:, 1:].reshape(-1), 0.7, 100)
    ref_log_p = torch.log_softmax(reference[:, :-1].reshape(-1, 100) / 0.7, dim=-1)
    torch.testing.assert_close(lp, ref_log_p.gather(-1, ids[:, 1:].reshape(-1, 1)).squeeze(-1), rtol=0, atol=2e-5)
    torch.testing.assert_close(ent, -(ref_log_p.exp() * ref_log_p).sum(-1), rtol=0, atol=2e-5)


def test_padded_vocabulary_rows_are_zero_and_left_out_of_the_softmax(tmp_path):
    hf, shape, model = converted("qwen2-untied", tmp_path, vocab_rows=128)
    assert model.output_layer.weight.shape[0] == 128 and not model.output_layer.weight[100:].any()
    ids = torch.randint(0, 100, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), cpu_shims(CPU):
        logits = model(input_ids=ids, position_ids=None, attention_mask=None)[0, :-1]
        reference = torch.log_softmax(hf(ids).logits[0, :-1], dim=-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    lp, _ = vocab_parallel_log_probs(logits, ids[0, 1:], 1.0, 100)
    torch.testing.assert_close(lp, reference, rtol=0, atol=2e-5)
    assert dict(export_hf(model, shape, 1, None))["lm_head.weight"].shape[0] == 100


def test_packed_sequences_attend_only_to_themselves(tmp_path):
    """The SDPA core attention's thd path: two packed sequences give each one's own logits."""
    from megatron.core.packed_seq_params import PackedSeqParams

    _, _, model = converted("qwen3-tied", tmp_path)
    a, b = torch.randint(0, 100, (1, 9)), torch.randint(0, 100, (1, 5))
    bounds = torch.tensor([0, 9, 14], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds, max_seqlen_q=9,
                             max_seqlen_kv=9)
    with torch.no_grad(), cpu_shims(CPU):
        together = model(input_ids=torch.cat([a, b], dim=1), position_ids=None, attention_mask=None,
                         packed_seq_params=packed)
        alone = [model(input_ids=x, position_ids=None, attention_mask=None) for x in (a, b)]
    torch.testing.assert_close(together, torch.cat(alone, dim=1), rtol=0, atol=2e-5)


@pytest.mark.parametrize("packed", [False, True])
def test_only_the_positions_predicting_responses_reach_the_output_layer(packed, tmp_path):
    """forward_log_probs projects sum(T_i) rows (not every position), and each sample's log-probs and entropy
    are Hugging Face's at its response tokens; the hook is gone afterwards."""
    from furlong.builtin_plugins.backends.megatron.logprobs import forward_log_probs
    from furlong.hooks.rows import SplitRows

    hf, _, model = converted("llama3-untied", tmp_path)
    gen = torch.Generator().manual_seed(3)
    tokens = [torch.randint(0, 100, (n,), generator=gen) for n in (9, 14, 5)]
    responses = [4, 6, 1]
    seen = []
    handle = model.output_layer.register_forward_hook(lambda _m, args, _out: seen.append(tuple(args[0].shape)))
    with torch.no_grad(), cpu_shims(CPU):
        log_probs, entropy = forward_log_probs(model, tokens, responses, 0.8, CPU, vocab_size=100, grad=False,
                                               entropy_grad=False, packed=packed)
        model(input_ids=tokens[0][None], position_ids=None, attention_mask=None)
    handle.remove()
    assert seen == [(sum(responses), 1, 32), (9, 1, 32)]
    # the projected rows are the responses one after another: handed on whole (SplitRows)
    assert all(isinstance(x, SplitRows) and x.intact() and x.lengths == responses for x in (log_probs, entropy))
    for seq, t, lp, ent in zip(tokens, responses, log_probs, entropy):
        with torch.no_grad():
            ref = torch.log_softmax(hf(seq[None]).logits[0, -t - 1:-1] / 0.8, dim=-1)
        torch.testing.assert_close(lp, ref.gather(-1, seq[-t:, None]).squeeze(-1), rtol=0, atol=2e-5)
        torch.testing.assert_close(ent, -(ref.exp() * ref).sum(-1), rtol=0, atol=2e-5)


def test_shared_prompts_in_a_packed_micro_batch_give_the_unshared_values_and_gradients(tmp_path, monkeypatch):
    """Samples that share a prompt run it once (each prompt, then its samples' suffixes, which attend to its keys at
    their own positions): log-probs, entropy and every gradient are those of the unshared packed row, and the
    log-probs Hugging Face's."""
    from furlong.builtin_plugins.backends.megatron import logprobs

    hf, _, model = converted("qwen3-tied", tmp_path)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 100, (n,), generator=gen) for n in (6, 3)]
    plan = [(0, 4), (1, 2), (0, 7), (0, 1), (1, 5)]
    tokens = [torch.cat([prompts[p], torch.randint(0, 100, (t,), generator=gen)]) for p, t in plan]
    responses = [t for _, t in plan]
    rows = []
    real = logprobs.shared_prompt_inputs
    monkeypatch.setattr(logprobs, "shared_prompt_inputs", lambda *a: rows.append(real(*a)) or rows[-1])

    def run(share):
        model.zero_grad()
        with cpu_shims(CPU):
            lp, ent = logprobs.forward_log_probs(model, tokens, responses, 0.8, CPU, vocab_size=100, grad=True,
                                                 entropy_grad=True, packed=True, share_prompts=share)
            weights = [torch.linspace(-1, 1, len(x)) for x in lp]
            sum((w * x).sum() + 0.3 * (w * e).sum() for w, x, e in zip(weights, lp, ent)).backward()
        grads = {n: p.main_grad.clone() if getattr(p, "main_grad", None) is not None else p.grad.clone()
                 for n, p in model.named_parameters() if p.requires_grad}
        return [x.detach() for x in lp], [e.detach() for e in ent], grads

    unshared = run(False)
    assert not rows
    shared = run(True)
    assert rows and rows[0].ids.shape == (1, 5 + 2 + sum(t + 1 for t in responses))  # each prompt once
    for a, b in zip(unshared[0] + unshared[1], shared[0] + shared[1]):
        torch.testing.assert_close(b, a, rtol=0, atol=2e-5)
    assert max(g.abs().max().item() for g in unshared[2].values()) > 1e-3
    for name, grad in unshared[2].items():
        torch.testing.assert_close(shared[2][name], grad, rtol=0, atol=2e-5, msg=name)
    for seq, t, lp in zip(tokens, responses, shared[0]):
        with torch.no_grad():
            ref = torch.log_softmax(hf(seq[None]).logits[0, -t - 1:-1] / 0.8, dim=-1)
        torch.testing.assert_close(lp, ref.gather(-1, seq[-t:, None]).squeeze(-1), rtol=0, atol=2e-5)


def test_shared_prompts_need_a_packed_micro_batch_without_sequence_parallelism(monkeypatch):
    from furlong.builtin_plugins.backends.megatron import logprobs

    calls = []
    monkeypatch.setattr(logprobs, "shared_prompt_inputs", lambda *a: calls.append(a))
    prompt = torch.tensor([5, 6, 7, 8])
    tokens, responses = [torch.cat([prompt, torch.tensor([9, 10])]), torch.cat([prompt, torch.tensor([11])])], [2, 1]
    for packed, sequence_parallel in ((False, 1), (True, 2)):
        inputs = logprobs.micro_batch_inputs(tokens, responses, CPU, packed=packed, sequence_parallel=sequence_parallel,
                                             share_prompts=True)
        assert inputs.ids.numel() >= 12 and not calls  # every sample whole
    logprobs.micro_batch_inputs(tokens, responses, CPU, packed=True, share_prompts=False)
    assert not calls
    logprobs.micro_batch_inputs(tokens, responses, CPU, packed=True, share_prompts=True)
    assert len(calls) == 1


def test_save_hf_writes_a_hugging_face_model_of_the_trained_weights(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    backend = megatron_backend(config=train_config(tiny_model_dir))
    asyncio.run(backend.init(backend.config))
    asyncio.run(backend.train(0, make_batch(AutoTokenizer.from_pretrained(tiny_model_dir), [[[0, 1, 2, 3]]])))
    asyncio.run(backend.save_hf(str(tmp_path / "hf")))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    trained = _weights(backend)
    assert sorted(trained) == sorted(reloaded)
    for name, tensor in trained.items():
        assert torch.equal(reloaded[name], tensor), name
    assert AutoTokenizer.from_pretrained(tmp_path / "hf").encode("ab") == [69, 70]


@pytest.mark.parametrize("width, temperature, chunk", [(100, 1.0, -1), (128, 0.7, 3)])
def test_log_prob_and_entropy_gradients_are_those_of_log_softmax(width, temperature, chunk):
    """The chunked autograd Function against autograd through ``log_softmax`` (100 real columns)."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(7, width, generator=g, dtype=torch.float64).float().requires_grad_(True)
    targets = torch.randint(0, 100, (7,), generator=g)
    a, b = torch.randn(7, generator=g), torch.randn(7, generator=g)
    lp, ent = vocab_parallel_log_probs(logits, targets, temperature, 100, chunk_rows=chunk)
    ((a * lp).sum() + (b * ent).sum()).backward()
    reference = logits.detach()[:, :100].clone().requires_grad_(True)
    log_p = torch.log_softmax(reference / temperature, dim=-1)
    ref_lp, ref_ent = log_p.gather(-1, targets[:, None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)
    ((a * ref_lp).sum() + (b * ref_ent).sum()).backward()
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-5)
    torch.testing.assert_close(logits.grad[:, :100], reference.grad, rtol=0, atol=1e-5)
    assert not logits.grad[:, 100:].any()


def test_a_foreign_tensor_or_a_missing_one_is_an_error(tmp_path):
    hf = random_hf("llama3-untied")
    shape = model_shape(hf.config)
    model = build_gpt(shape, 1, 100, torch.float32, CPU)
    state = hf_state(hf, False)
    with pytest.raises(PluginError, match="'model.layers.9.mlp.gate_proj.weight' has no place"):
        load_hf(model, [*state.items(), ("model.layers.9.mlp.gate_proj.weight", torch.zeros(1))], shape, 100, 1, 0,
                "ckpt")
    state.pop("model.layers.1.mlp.up_proj.weight")
    with pytest.raises(PluginError, match="no tensor for model.layers.1.mlp.gate_proj.weight"):
        load_hf(model, state.items(), shape, 100, 1, 0, "ckpt")
    # a Llama built with query/key norms (as a spec that wrongly adds them would): no HF tensor fills them
    with_norms = build_gpt(attrs.evolve(shape, qk_layernorm=True), 1, 100, torch.float32, CPU)
    with pytest.raises(PluginError, match="the llama Megatron model has parameters no Hugging Face tensor fills: "
                                          "decoder.layers.0.self_attention.k_layernorm.weight, "):
        load_hf(with_norms, hf_state(hf, False).items(), shape, 100, 1, 0, "ckpt")


# --- the backend against fsdp ------------------------------------------------------------------------


def _weights(backend) -> dict:
    return {k: v.clone() for k, v in asyncio.run(backend.named_weights())}


def test_backend_trains_like_fsdp(tiny_model_dir):
    """Same tiny model and batch: log-probs, entropy, losses, grad norms and weights after two AdamW steps."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    steps = [[[0, 1], [2, 3]], [[0, 1, 2, 3]]]
    results = {}
    for name, make in (("fsdp", fsdp_backend), ("megatron", megatron_backend)):
        backend = make(config=train_config(tiny_model_dir, entropy_coef=0.01))
        asyncio.run(backend.init(backend.config))
        batch = make_batch(tokenizer, steps, temperature=0.8)
        old = asyncio.run(backend.log_probs(batch))
        results[name] = old, asyncio.run(backend.train(0, batch)), _weights(backend)
    (f_old, f_metrics, f_weights), (m_old, m_metrics, m_weights) = results["fsdp"], results["megatron"]
    for key in ("log_probs", "entropy"):
        for a, b in zip(f_old[key], m_old[key]):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    for a, b in zip(f_metrics, m_metrics):
        assert b.keys() == a.keys()
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key
    assert sorted(m_weights) == sorted(f_weights)
    for name, tensor in f_weights.items():
        torch.testing.assert_close(m_weights[name], tensor, rtol=0, atol=5e-5)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_pad_token_row_trains_as_in_fsdp(tiny_model_dir, tmp_path, tied):
    """A prompt holding the pad token (id 0): its lookups pass no gradient to the embedding row (HF's
    padding_idx), so an untied model keeps the row; a tied model's output layer still moves it, as in fsdp."""
    hf_dir = (qwen2_tied_dir if tied else gqa_llama_dir)(tiny_model_dir, tmp_path / "hf")
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    weights = {}
    for name, build in (("fsdp", fsdp_backend), ("megatron", megatron_backend)):
        backend = build(config=train_config(hf_dir, adam_eps=1e-3))
        asyncio.run(backend.init(backend.config))
        batch = make_batch(tokenizer, [[[0, 1], [2, 3]]])
        batch.tokens[0] = [batch.tokens[0][0], 0, *batch.tokens[0][2:]]
        asyncio.run(backend.train(0, batch))
        weights[name] = _weights(backend)["model.embed_tokens.weight"]
    start = load_file(hf_dir / "model.safetensors")["model.embed_tokens.weight"]
    moved = float((weights["megatron"][0] - start[0]).abs().max())
    assert (moved > 1e-4) if tied else (moved == 0.0)
    torch.testing.assert_close(weights["megatron"], weights["fsdp"], rtol=0, atol=1e-6)


def test_bf16_trains_bfloat16_parameters_over_float32_master_weights(tiny_model_dir, tmp_path):
    """--bf16: bfloat16 model, float32 masters updated by AdamW; the model is the masters rounded; an update
    below bfloat16 resolution stays in the masters; results are the float32 run's within bfloat16 precision;
    a checkpoint holds the masters and resumes them bit for bit."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    steps = [[[0, 1], [2, 3]], [[0, 1, 2, 3]]]
    runs = {}
    for bf16 in (False, True):
        backend = megatron_backend(config=train_config(tiny_model_dir, bf16=bf16, lr=1e-3))
        asyncio.run(backend.init(backend.config))
        runs[bf16] = backend, asyncio.run(backend.train(0, make_batch(tokenizer, steps, temperature=0.8)))
    (fp32, m32), (bf, m16) = runs[False], runs[True]
    assert all(p.dtype == torch.bfloat16 and p.grad is None for p in bf.model.parameters())
    masters = dict(bf.masters.named_parameters())
    assert {p.dtype for group in bf.optimizer.param_groups for p in group["params"]} == {torch.float32}
    assert all(any(p is m for m in masters.values()) for g in bf.optimizer.param_groups for p in g["params"])
    for name, param in bf.model.named_parameters():
        assert torch.equal(param, masters[name].to(torch.bfloat16)), name
    for a, b in zip(m32, m16):
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=3e-2)
        assert b.keys() == a.keys()
        for key in ("loss", "entropy"):
            assert b[key] == pytest.approx(a[key], rel=3e-2), key
    f32 = dict(fp32.model.named_parameters())
    for name, master in masters.items():
        torch.testing.assert_close(master, f32[name], rtol=0, atol=2e-2)

    tiny = megatron_backend(config=train_config(tiny_model_dir, bf16=True, lr=1e-7))
    asyncio.run(tiny.init(tiny.config))
    before = {n: m.detach().clone() for n, m in tiny.masters.named_parameters()}
    model_before = {n: p.detach().clone() for n, p in tiny.model.named_parameters()}
    asyncio.run(tiny.train(0, make_batch(tokenizer, [[[0, 1, 2, 3]]])))
    moved = [n for n, m in tiny.masters.named_parameters() if not torch.equal(m, before[n])]
    assert moved, "the masters took the small update"
    assert any(torch.equal(p, model_before[n]) for n, p in tiny.model.named_parameters() if n in moved), \
        "some update is below bfloat16 resolution: the model does not show it, the master keeps it"

    asyncio.run(bf.save(str(tmp_path / "iter_0000001")))
    again = megatron_backend(config=train_config(tiny_model_dir, bf16=True, lr=1e-3))
    asyncio.run(again.init(again.config))
    asyncio.run(again.load(str(tmp_path / "iter_0000001")))
    loaded = dict(again.masters.named_parameters())
    for name, master in masters.items():
        assert torch.equal(loaded[name], master), name
    for name, param in again.model.named_parameters():
        assert torch.equal(param, dict(bf.model.named_parameters())[name]), name
    warm = megatron_backend(config=train_config(tiny_model_dir, bf16=True, ref_load=str(tmp_path / "iter_0000001")))
    asyncio.run(warm.init(warm.config))  # --ref-load of a bf16 run: the actor's masters are the saved float32 ones
    for name, master in warm.masters.named_parameters():
        assert torch.equal(master, masters[name]), name
    as_fp32 = megatron_backend(config=train_config(tiny_model_dir, lr=1e-3))  # the files hold float32 weights
    asyncio.run(as_fp32.init(as_fp32.config))
    asyncio.run(as_fp32.load(str(tmp_path / "iter_0000001")))
    for name, param in as_fp32.model.named_parameters():
        assert torch.equal(param, masters[name]), name


def test_token_planned_micro_batches_are_packed_only_when_padding_wastes_much():
    from furlong.builtin_plugins.backends.megatron.backend import pack_micro_batch

    assert not pack_micro_batch([384] * 21)  # a GRPO micro-batch: same lengths, padding costs nothing
    assert not pack_micro_batch([300, 320, 384])  # 1152 padded tokens for 1004: within 25 %
    assert pack_micro_batch([10, 16, 6, 20])  # 80 padded tokens for 52
    assert pack_micro_batch([2048, 64, 64, 64])


def test_micro_batches_are_packed_where_attention_is_one_varlen_call(monkeypatch):
    """Always packed on CUDA in 16-bit with a torch that has varlen_attn and no CP; elsewhere by the padding rule."""
    import furlong.kit.packed_attention as pa
    from furlong.builtin_plugins.backends.megatron.backend import MegatronBackend

    def packed(device, dtype, tokens, cp=1, dynamic=False):
        backend = SimpleNamespace(device=torch.device(device), cp=cp, _dtype=lambda: dtype,
                                  config=launch_config(use_dynamic_batch_size=dynamic, configure=False))
        return MegatronBackend._packed(backend, tokens)

    same, mixed = [[1] * 8] * 4, [[1] * 20, [1] * 2, [1] * 2]
    monkeypatch.setattr(pa, "_VARLEN_PARAMETERS", {"window_size": None})
    assert packed("cuda", torch.bfloat16, same) and packed("cuda", torch.float16, same)
    assert not packed("cuda", torch.bfloat16, same, cp=2) and packed("cuda", torch.bfloat16, mixed, cp=2, dynamic=True)
    assert not packed("cuda", torch.float32, same, dynamic=True) and packed("cuda", torch.float32, mixed, dynamic=True)
    assert not packed("cpu", torch.bfloat16, same) and not packed("cpu", torch.float32, mixed)
    monkeypatch.setattr(pa, "_VARLEN_PARAMETERS", None)  # a torch without varlen_attn
    assert not packed("cuda", torch.bfloat16, same) and packed("cuda", torch.bfloat16, mixed, dynamic=True)


def test_packed_micro_batches_give_the_padded_results(tiny_model_dir):
    """--use-dynamic-batch-size packs micro-batches (thd): same log-probs, entropy and step as padding."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    out = []
    for dynamic in (False, True):
        backend = megatron_backend(config=train_config(tiny_model_dir, use_dynamic_batch_size=dynamic, entropy_coef=0.01))
        asyncio.run(backend.init(backend.config))
        batch = make_batch(tokenizer, [[[0, 1, 2, 3]]], temperature=0.9)
        out.append((asyncio.run(backend.log_probs(batch)), asyncio.run(backend.train(0, batch))[0]))
    (padded, m_padded), (packed, m_packed) = out
    for key in ("log_probs", "entropy"):
        for a, b in zip(padded[key], packed[key]):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    assert m_packed["grad_norm"] == pytest.approx(m_padded["grad_norm"], rel=1e-5)


def test_lr_schedule_is_megatrons(tiny_model_dir):
    backend = megatron_backend(config=train_config(tiny_model_dir, lr=1e-2, min_lr=1e-3, lr_decay_style="cosine",
                                               lr_warmup_iters=1, lr_decay_iters=5))
    asyncio.run(backend.init(backend.config))
    lrs = []
    for _ in range(6):
        lrs.append(backend.optimizer.param_groups[0]["lr"])
        backend.scheduler.step(1)
    import math

    cosine = [1e-3 + 0.5 * (1 + math.cos(math.pi * (k - 1) / 4)) * 9e-3 for k in range(2, 6)]
    assert lrs == pytest.approx([0.0, 1e-2, *cosine], abs=1e-12)
    assert backend.optimizer.param_groups[1]["weight_decay"] == 0.0  # norms and biases: wd_mult 0


def test_checkpoint_resumes_weights_optimizer_and_schedule(tiny_model_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    flags = dict(lr_decay_style="linear", lr_decay_iters=10, min_lr=1e-3)
    first = megatron_backend(config=train_config(tiny_model_dir, **flags))
    asyncio.run(first.init(first.config))
    asyncio.run(first.train(0, make_batch(tokenizer, [[[0, 1]], [[2, 3]]])))
    asyncio.run(first.save(str(tmp_path / "iter_0000000")))
    at_save = _weights(first)
    assert {"metadata.json", "common.pt", ".metadata", "meta.json"} <= {p.name for p in (tmp_path / "iter_0000000").iterdir()}
    second = megatron_backend(config=train_config(tiny_model_dir, **flags))
    asyncio.run(second.init(second.config))
    asyncio.run(second.load(str(tmp_path / "iter_0000000")))
    assert second.global_step == 2 and second.scheduler.num_steps == 2
    for backend in (first, second):
        asyncio.run(backend.train(1, make_batch(tokenizer, [[[0, 1, 2, 3]]])))
    a, b = _weights(first), _weights(second)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    with pytest.raises(PluginError, match="not written by the megatron backend"):
        asyncio.run(second.load(str(tmp_path)))
    # --ref-load may name a save root with its marker: actor and reference start from its weights
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("0")
    warm = megatron_backend(config=train_config(tiny_model_dir, ref_load=str(tmp_path), use_kl_loss=True, **flags))
    asyncio.run(warm.init(warm.config))
    assert warm.global_step == 0
    for name, tensor in _weights(warm).items():
        assert torch.equal(tensor, at_save[name]), name
    batch = make_batch(tokenizer, [[[0, 1, 2, 3]]])
    actor, ref = asyncio.run(warm.log_probs(batch)), asyncio.run(warm.log_probs(batch, "ref"))
    for a, b in zip(actor["log_probs"], ref["log_probs"]):
        assert torch.equal(a, b)


def test_a_changed_lr_schedule_on_resume_is_one_error_naming_the_choice(tiny_model_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for style in ("cosine", "constant"):
        first = megatron_backend(config=train_config(tiny_model_dir, lr_decay_style=style))
        asyncio.run(first.init(first.config))
        asyncio.run(first.train(0, make_batch(tokenizer, [[[0, 1, 2, 3]]])))
        asyncio.run(first.save(str(tmp_path / style / "iter_0000000")))
    longer = megatron_backend(config=train_config(tiny_model_dir, num_rollout=5, lr_decay_style="cosine"))
    asyncio.run(longer.init(longer.config))
    with pytest.raises(PluginError, match="learning-rate schedule saved there differs.*--override-opt_param-scheduler"):
        asyncio.run(longer.load(str(tmp_path / "cosine" / "iter_0000000")))
    for flag in ("override_opt_param_scheduler", "use_checkpoint_opt_param_scheduler"):
        resumed = megatron_backend(config=train_config(tiny_model_dir, num_rollout=5, lr_decay_style="cosine",
                                                   **{flag: True}))
        asyncio.run(resumed.init(resumed.config))
        asyncio.run(resumed.load(str(tmp_path / "cosine" / "iter_0000000")))
        assert resumed.global_step == 1
    # a constant learning rate: a longer run resumes as it is (the decay length changes no learning rate)
    constant = megatron_backend(config=train_config(tiny_model_dir, num_rollout=5))
    asyncio.run(constant.init(constant.config))
    asyncio.run(constant.load(str(tmp_path / "constant" / "iter_0000000")))
    assert constant.global_step == 1 and constant.scheduler.get_lr(constant.optimizer.param_groups[0]) == 1e-2


# --- tensor parallelism over two gloo ranks ------------------------------------------------------


def gqa_llama_dir(tiny_model_dir, path: Path) -> Path:
    """The tiny tokenizer with a GQA Llama (4 heads, 2 KV groups), random weights."""
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100, max_position_embeddings=256, tie_word_embeddings=False,
                         bos_token_id=2, eos_token_id=3, pad_token_id=0)
    torch.manual_seed(3)
    return with_tiny_tokenizer(LlamaForCausalLM(config), tiny_model_dir, path)


def qwen3_gqa_dir(tiny_model_dir, path: Path) -> Path:
    """The tiny tokenizer with an untied Qwen3 (query/key norms; 4 heads, 2 KV groups), random weights."""
    config = Qwen3Config(**SMALL, head_dim=16, tie_word_embeddings=False, bos_token_id=2, eos_token_id=3,
                         pad_token_id=0)
    torch.manual_seed(5)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # not all ones: every scale's gradient must reach every rank
                param.uniform_(0.5, 1.5)
    return with_tiny_tokenizer(model, tiny_model_dir, path)


def qwen2_tied_dir(tiny_model_dir, path: Path) -> Path:
    """The tiny tokenizer with a tied Qwen2 of 4 layers (q/k/v biases, 2 KV groups), random weights."""
    config = Qwen2Config(**{**SMALL, "num_hidden_layers": 4}, tie_word_embeddings=True, bos_token_id=2, eos_token_id=3,
                         pad_token_id=0)
    torch.manual_seed(4)
    return with_tiny_tokenizer(Qwen2ForCausalLM(config), tiny_model_dir, path)


def with_tiny_tokenizer(model, tiny_model_dir, path: Path) -> Path:
    """Save ``model`` to ``path`` with the tokenizer files of the tiny model."""
    model.save_pretrained(path)
    for file in tiny_model_dir.iterdir():
        if "token" in file.name:
            shutil.copy(file, path / file.name)
    return path


def _assert_loads_on_one_rank(path: Path, hf_dir: Path, global_step: int, weights: dict, single) -> None:
    """The checkpoint at ``path`` loads into a one-rank backend: its step, the exported ``weights`` exactly,
    and the Adam moments of ``single`` (the one-rank backend that took the same steps)."""
    reloaded = megatron_backend(config=train_config(hf_dir, adam_eps=1e-3))
    asyncio.run(reloaded.init(reloaded.config))
    asyncio.run(reloaded.load(str(path)))
    assert reloaded.global_step == global_step
    for name, tensor in _weights(reloaded).items():
        assert torch.equal(tensor, weights[name]), name
    moments = {n: reloaded.optimizer.state[p]["exp_avg"] for n, p in reloaded.model.named_parameters()}
    reference = {n: single.optimizer.state[p]["exp_avg"] for n, p in single.model.named_parameters()}
    for name, tensor in reference.items():
        torch.testing.assert_close(moments[name], tensor, rtol=0, atol=1e-6)


@pytest.mark.timeout(240)
def test_tensor_parallel_two_ranks(tiny_model_dir, tmp_path):
    """Two gloo ranks (a Qwen3: GQA, query/key norms): megatron-core's own TP=2 shards; at TP=2 log-probs, one
    step (the query/key norm gradients summed over the TP ranks, whose heads differ) and a checkpoint that
    loads at TP=1; the same log-probs and step at TP=2 with --sequence-parallel (padded and packed); at
    TP=1 x DP=2 the one-process step (gradients summed over data-parallel ranks), also with the AdamW state
    sharded over them (--use-distributed-optimizer), whose checkpoints load either way."""
    hf_dir = qwen3_gqa_dir(tiny_model_dir, tmp_path / "hf")
    out = tmp_path / "out"
    out.mkdir()
    worker = Path(__file__).with_name("megatron_two_ranks.py")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(worker.parent))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(worker),
           str(hf_dir), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stderr[-4000:]

    # 1. each rank's piece of megatron-core's own TP=2 init is our split of its TP=1 init (same seed)
    torch.manual_seed(7)
    shape = model_shape(Qwen3Config.from_pretrained(hf_dir))
    whole = build_gpt(shape, 1, 100, torch.float32, CPU, perform_initialization=True)
    params = dict(whole.named_parameters())
    for rank in (0, 1):
        shards = torch.load(out / f"init{rank}.pt", weights_only=True)
        assert sorted(shards) == sorted(u.mcore for u in units(shape)) == sorted(params)
        for unit in units(shape):
            assert torch.equal(shards[unit.mcore], local_shard(params[unit.mcore].detach(), unit.split, 2, rank)), (
                unit.mcore, rank)

    # 2. log-probs and one AdamW step at TP=2 equal the TP=1 backend's. Adam's eps is 1e-3 here (in the
    # worker too): with the default 1e-8 the first update is lr * sign(g), which flips on fp32 noise
    # wherever g is about 0.
    single = megatron_backend(config=train_config(hf_dir, adam_eps=1e-3))
    asyncio.run(single.init(single.config))
    batch = make_batch(AutoTokenizer.from_pretrained(hf_dir), [[[0, 1], [2, 3]]], pad_in_prompt=True)
    old = asyncio.run(single.log_probs(batch))
    metrics = asyncio.run(single.train(0, batch))[0]
    got_old = torch.load(out / "logprobs.pt", weights_only=True)
    for key in ("log_probs", "entropy"):
        for a, b in zip(old[key], got_old[key]):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    step = torch.load(out / "step.pt", weights_only=True)
    assert step["metrics"]["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-5)
    assert step["metrics"]["loss"] == pytest.approx(metrics["loss"], rel=1e-5)
    expected = _weights(single)
    dp = torch.load(out / "dp.pt", weights_only=True)
    for got in (step, dp):
        assert got["metrics"]["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-5)
        for name, tensor in expected.items():
            torch.testing.assert_close(got["weights"][name], tensor, rtol=0, atol=1e-5)

    # 3. the same at TP=2 with sequence parallelism (norm gradients summed over the TP ranks), padded and packed
    for layout, got in torch.load(out / "sp.pt", weights_only=True).items():
        for key in ("log_probs", "entropy"):
            for a, b in zip(old[key], got["log_probs"][key]):
                torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
        assert got["metrics"]["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-5), layout
        for name, tensor in expected.items():
            torch.testing.assert_close(got["weights"][name], tensor, rtol=0, atol=1e-5, msg=lambda m: f"{layout} {name}: {m}")

    # 4. the TP=2 checkpoint loads at TP=1: weights, Adam moments (fc1 resharded), step
    _assert_loads_on_one_rank(out / "ckpt", hf_dir, 1, step["weights"], single)

    # 5. DP=2 with --use-distributed-optimizer: the one-process step; the two ranks' shares of the AdamW state are
    # disjoint and cover every parameter; its checkpoint loads at DP=1 with every moment (the worker checked
    # that the unsharded DP=2 checkpoint loads into the sharded optimizer)
    zero = [torch.load(out / f"zero{rank}.pt", weights_only=True) for rank in (0, 1)]
    shares = [set(z["owned"]) for z in zero]
    assert shares[0] and shares[1] and not shares[0] & shares[1]
    assert shares[0] | shares[1] == set(dict(single.model.named_parameters()))
    for got in zero:
        assert got["metrics"]["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-5)
        for name, tensor in expected.items():
            torch.testing.assert_close(got["weights"][name], tensor, rtol=0, atol=1e-5)
    _assert_loads_on_one_rank(out / "zero_ckpt", hf_dir, 1, zero[0]["weights"], single)


@pytest.mark.timeout(240)
def test_pipeline_two_stages(tiny_model_dir, tmp_path):
    """Two gloo ranks at PP=2 (untied Llama, tied Qwen2): log-probs, two AdamW steps (grad norms, losses,
    weights) and the weight export equal PP=1's; checkpoints load from PP=2 at PP=1 and the other way."""
    from .tiny_model import run_two_ranks, train_config

    models = {"llama-untied": gqa_llama_dir, "qwen2-tied": qwen2_tied_dir}
    single = {}
    for name, make in models.items():
        hf_dir = make(tiny_model_dir, tmp_path / name / "hf")
        backend = megatron_backend(config=train_config(hf_dir, adam_eps=1e-3))
        asyncio.run(backend.init(backend.config))
        batch = make_batch(AutoTokenizer.from_pretrained(hf_dir), STEPS)
        single[name] = {"log_probs": asyncio.run(backend.log_probs(batch)),
                        "metrics": asyncio.run(backend.train(0, batch)), "weights": _weights(backend)}
        asyncio.run(backend.save(str(tmp_path / name / "pp1ckpt")))
    run_two_ranks("megatron_pipeline_ranks.py", str(tmp_path), *models)

    for name in models:
        expected = single[name]
        ranks = [torch.load(tmp_path / name / f"pp2_rank{r}.pt", weights_only=True) for r in (0, 1)]
        last = ranks[1]  # the last stage returns the outputs
        assert all(row is None for row in ranks[0]["log_probs"]["log_probs"])
        for key in ("log_probs", "entropy"):
            for a, b, packed in zip(expected["log_probs"][key], last["log_probs"][key],
                                    last["packed_log_probs"][key]):
                torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
                torch.testing.assert_close(packed, a, rtol=0, atol=1e-5)
        for got in ranks:
            assert len(got["metrics"]) == 2
            for want, step in zip(expected["metrics"], got["metrics"]):
                for key in ("grad_norm", "loss", "entropy"):
                    assert step[key] == pytest.approx(want[key], rel=1e-5), (name, key)
            assert sorted(got["weights"]) == sorted(expected["weights"])
            for hf_name, tensor in expected["weights"].items():
                torch.testing.assert_close(got["weights"][hf_name], tensor, rtol=0, atol=1e-5)
            # the PP=1 checkpoint loaded at PP=2
            assert got["global_step"] == 2
            for hf_name, tensor in expected["weights"].items():
                assert torch.equal(got["loaded"][hf_name], tensor), (name, hf_name)
        # the PP=2 checkpoint loads at PP=1
        reloaded = megatron_backend(config=train_config(tmp_path / name / "hf", adam_eps=1e-3))
        asyncio.run(reloaded.init(reloaded.config))
        asyncio.run(reloaded.load(str(tmp_path / name / "pp2ckpt")))
        assert reloaded.global_step == 2
        for hf_name, tensor in _weights(reloaded).items():
            assert torch.equal(tensor, last["weights"][hf_name]), (name, hf_name)

    # a --bf16 checkpoint at PP=2 holds the float32 masters of both stages (the tied copy once): PP=1 loads them
    masters = {}
    for r in (0, 1):
        masters.update(torch.load(tmp_path / "qwen2-tied" / f"bf16_rank{r}.pt", weights_only=True))
    bf16 = megatron_backend(config=train_config(tmp_path / "qwen2-tied" / "hf", adam_eps=1e-3, bf16=True))
    asyncio.run(bf16.init(bf16.config))
    asyncio.run(bf16.load(str(tmp_path / "qwen2-tied" / "bf16ckpt")))
    loaded = dict(bf16.masters.named_parameters())
    assert sorted(loaded) == sorted(masters)
    for mcore_name, master in masters.items():
        assert master.dtype == torch.float32 and torch.equal(loaded[mcore_name], master), mcore_name


@pytest.mark.parametrize("layers, pp, first, last, counts", [
    (4, 2, None, None, (2, 2)), (3, 2, 2, None, (2, 1)), (3, 2, None, 2, (1, 2)), (8, 4, 1, 1, (1, 3, 3, 1)),
    (4, 2, 1, 3, (1, 3)), (5, 3, 1, None, (1, 2, 2))])
def test_pipeline_stages_split_the_layers_as_megatron_does(layers, pp, first, last, counts):
    assert stage_layer_counts(layers, pp, first, last) == counts
    stages = [Stage(i, pp, counts) for i in range(pp)]
    shape = SimpleNamespace(num_layers=layers)
    held = [owner(Unit(f"decoder.layers.{n}.mlp.linear_fc2.weight", ()), shape, stages[0]) for n in range(layers)]
    assert held == [i for i, c in enumerate(counts) for _ in range(c)]
    assert [st.offset(layers) for st in stages] == [sum(counts[:i]) for i in range(pp)]


@pytest.mark.parametrize("layers, pp, first, last, message", [
    (3, 2, None, None, "--pipeline-model-parallel-size 2 does not divide the 3 layers (--decoder-first-pipeline-num-layers"),
    (3, 2, 2, 2, "--pipeline-model-parallel-size 2 with --decoder-first-pipeline-num-layers 2 and "
                 "--decoder-last-pipeline-num-layers 2 asks for 4 layers; the model has 3."),
    (3, 2, 3, None, "--pipeline-model-parallel-size 2 with --decoder-first-pipeline-num-layers 3 leaves 0 of the 3 "
                    "layers for the other 1 stage(s), fewer than one each."),
    (8, 4, 1, None, "with --decoder-first-pipeline-num-layers 1 leaves 7 of the 8 layers, which the other 3 stages "
                    "cannot share equally."),
    (4, 2, 0, None, "--decoder-first-pipeline-num-layers 0: a pipeline stage needs at least 1 layer."),
    (4, 1, None, -1, "--decoder-last-pipeline-num-layers -1: a pipeline stage needs at least 1 layer.")])
def test_a_pipeline_split_that_cannot_be_made_names_the_flags(layers, pp, first, last, message):
    with pytest.raises(ValueError) as err:
        stage_layer_counts(layers, pp, first, last)
    assert message in str(err.value)


def _first_stage_layers(hf_dir, layers):
    """The launch flags of a run given ``--decoder-first-pipeline-num-layers layers`` (a Megatron-LM flag: the
    parse also lists it in ``megatron_args``)."""
    return train_args(hf_dir, decoder_first_pipeline_num_layers=layers,
                      megatron_args={"decoder_first_pipeline_num_layers": layers})


def test_split_flags_are_checked_at_one_stage_and_warned_about_there(tiny_model_dir):
    report = ConfigReport(plugin="megatron")
    configure(args=_first_stage_layers(tiny_model_dir, -1), report=report)
    assert "--decoder-first-pipeline-num-layers -1: a pipeline stage needs at least 1 layer." in report.errors
    report = ConfigReport(plugin="megatron")
    configure(args=_first_stage_layers(tiny_model_dir, 1), report=report)
    assert not report.errors
    assert ("--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers change nothing without "
            "--pipeline-model-parallel-size > 1.") in report.warnings


def test_context_parallel_chunks_are_those_megatron_s_rope_assumes():
    """Each CP rank's chunks of packed sequences hold the positions megatron-core's RoPE gives that rank, and
    gathered in rank order they are the sequences again (CP=2 and CP=3)."""
    from megatron.core.models.common.embeddings.rope_utils import _get_thd_freqs_on_this_cp_rank

    from furlong.builtin_plugins.backends.megatron.context import _in_sequence_order, local_chunks

    for cp in (2, 3):
        lengths = [4 * cp, 2 * cp, 6 * cp]
        positions = torch.cat([torch.arange(n) for n in lengths])
        parts = [local_chunks(positions, cp, rank, 0, lengths) for rank in range(cp)]
        for rank, part in enumerate(parts):
            rope = [_get_thd_freqs_on_this_cp_rank(rank, cp, torch.empty(n // cp), torch.arange(n)) for n in lengths]
            assert torch.equal(part, torch.cat(rope)), (cp, rank)
        assert torch.equal(_in_sequence_order(parts, 0, lengths), positions)
        whole = torch.arange(4 * cp).view(1, -1)  # one right-padded row: chunks r and 2 CP - 1 - r
        assert local_chunks(whole, cp, cp - 1).tolist() == [[2 * cp - 2, 2 * cp - 1, 2 * cp, 2 * cp + 1]]


def test_packed_positions_are_those_of_megatron_s_thd_rope():
    """RopeSelfAttention's per-token positions (computed on the device from cu_seqlens) equal the
    positions megatron-core's per-sequence thd RoPE gives each rank's tokens, at CP=1, 2 and 3."""
    from megatron.core.models.common.embeddings.rope_utils import _get_thd_freqs_on_this_cp_rank

    from furlong.builtin_plugins.backends.megatron.attention import packed_positions

    for cp in (1, 2, 3):
        lengths = [4 * cp, 2 * cp, 6 * cp, 2 * cp]
        bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        for rank in range(cp):
            rope = [_get_thd_freqs_on_this_cp_rank(rank, cp, torch.empty(n // cp), torch.arange(n)) for n in lengths]
            assert torch.equal(packed_positions(bounds, sum(lengths) // cp, cp, rank), torch.cat(rope)), (cp, rank)


def test_rotate_is_megatron_s_rope():
    """The core attention's RoPE gives megatron-core's unfused values bit for bit (float32 and bfloat16)."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from furlong.builtin_plugins.backends.megatron.attention import angles_cos_sin, rotate

    freqs = torch.randn(7, 1, 1, 16) * 3
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(7, 2, 3, 16).to(dtype)
        assert torch.equal(rotate(x, *angles_cos_sin(freqs, dtype)), _apply_rotary_pos_emb_bshd(x, freqs)), dtype


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("cp, tp", [(2, 2), (2, 4), (3, 2), (3, 4), (1, 4)])
def test_micro_batches_are_padded_for_context_and_sequence_parallelism_together(monkeypatch, cp, tp, packed):
    """Every CP rank's share of a micro-batch's positions is a multiple of TP (sequence parallelism
    scatters it over the TP ranks) and, packed, every sequence's segment a multiple of 2 CP."""
    from furlong.builtin_plugins.backends.megatron import logprobs

    tokens = [torch.arange(3, 3 + n) for n in (5, 9, 13)]
    for rank in range(cp):
        monkeypatch.setattr(logprobs, "context_parallel", lambda rank=rank: (cp, rank, None))
        inputs = logprobs.micro_batch_inputs(tokens, [2, 4, 3], "cpu", packed=packed, sequence_parallel=tp)
        assert inputs.ids.shape[1] % tp == 0
        if packed and cp > 1:  # the last segment alone is lengthened beyond CP's padding
            assert all(n % (2 * cp) == 0 for n in inputs.segments)
            assert inputs.segments[:2] == [-(-n // (2 * cp)) * 2 * cp for n in (5, 9)]
            assert sum(inputs.segments) == cp * inputs.ids.shape[1]
        elif packed:
            assert inputs.ids.shape[1] == 27 + -27 % tp
        else:  # the [B, L] grid: L (13 at most) padded to a multiple of 2 CP whose share per CP rank divides by TP
            assert (inputs.ids.shape[1] * cp) % (2 * cp) == 0 and inputs.ids.shape[1] * cp >= 13


@pytest.mark.timeout(240)
def test_context_parallel_four_ranks(tiny_model_dir, tmp_path):
    """Four gloo ranks (GQA Llama; sequence lengths that are not multiples of 2 x CP; a temperature; an entropy
    bonus in the loss). At TP=2 x CP=2 (packed and padded micro-batches): log-probs, entropy, two AdamW steps
    (losses, grad norms, weights) equal CP=1's, a CP=1 checkpoint loads and the CP=2 one loads at CP=1. At
    CP=2 x DP=2 (padded), PP=2 x CP=2, and TP=2 x PP=2 and TP=2 x CP=2 with sequence parallelism (packed and
    padded) the same two steps (and the same log-probs from the ranks that hold them)."""
    from .tiny_model import run_two_ranks, train_config

    hf_dir = gqa_llama_dir(tiny_model_dir, tmp_path / "hf")
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    assert {len(t) % 4 for t in make_batch(tokenizer, []).tokens} - {0}
    single = megatron_backend(config=train_config(hf_dir, adam_eps=1e-3, entropy_coef=0.01))
    asyncio.run(single.init(single.config))
    batch = make_batch(tokenizer, STEPS, temperature=0.8, entropy_coef=0.01)
    old = asyncio.run(single.log_probs(batch))
    metrics = asyncio.run(single.train(0, batch))
    expected = _weights(single)
    asyncio.run(single.save(str(tmp_path / "cp1ckpt")))
    run_two_ranks("megatron_context_ranks.py", str(tmp_path), nproc=4)

    for rank in range(4):
        got = torch.load(tmp_path / f"tp2cp2_rank{rank}.pt", weights_only=True)
        sequence_parallel = torch.load(tmp_path / f"tp2cp2sp_rank{rank}.pt", weights_only=True)
        for run in (got, sequence_parallel):
            for key in ("log_probs", "entropy"):  # every rank holds whole sequences (rank 0 returns them)
                for a, b in zip(old[key], run["log_probs"][key]):
                    torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
        for name, tensor in expected.items():
            assert torch.equal(got["loaded"][name], tensor), name
        assert got["global_step"] == 2
        pipelined = [torch.load(tmp_path / f"{run}_rank{rank}.pt", weights_only=True) for run in ("pp2cp2", "tp2pp2sp")]
        for run in pipelined:
            for key in ("log_probs", "entropy"):
                for a, b in zip(old[key], run["log_probs"][key]):
                    assert (b is None) == (rank < 2), rank  # ranks 0 and 1 are the first stage
                    if b is not None:
                        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
        for got in (got, torch.load(tmp_path / f"cp2dp2_rank{rank}.pt", weights_only=True), *pipelined,
                    sequence_parallel):
            assert len(got["metrics"]) == 2
            for want, step in zip(metrics, got["metrics"]):
                for key in ("grad_norm", "loss", "entropy"):
                    assert step[key] == pytest.approx(want[key], rel=1e-5), key
            for name, tensor in expected.items():
                torch.testing.assert_close(got["weights"][name], tensor, rtol=0, atol=1e-5)
    saved = torch.load(tmp_path / "tp2cp2_rank0.pt", weights_only=True)["weights"]
    _assert_loads_on_one_rank(tmp_path / "cp2ckpt", hf_dir, 2, saved, single)


# --- the whole loop ------------------------------------------------------------------------------


DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo"


def _grpo_run(save: Path, backend: str) -> list[dict]:
    """Two rollouts of the demo task (examples/demo: its model scores about 0.3 before training)."""
    import json

    from furlong.core.config.launch_args import launch_config
    from furlong.core.run.loop import run
    from furlong.core.plugins.manager import get_plugin_manager
    from furlong.core.plugins.selection import resolve_selection

    argv = ["--hf-checkpoint", str(DEMO / "model"), "--prompt-data", str(DEMO / "data" / "train.jsonl"),
            "--input-key", "prompt", "--label-key", "label", "--rm-type", "math", "--num-rollout", "2",
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--num-steps-per-rollout", "2",
            "--rollout-max-response-len", "12", "--lr", "1e-4", "--entropy-coef", "0.01", "--micro-batch-size", "4",
            "--train-backend", backend, "--save", str(save), "--save-interval", "1",
            "--seed", "1"]  # a seed whose groups have reward spread, so the policy gradient is not zero
    pm = get_plugin_manager()
    config = launch_config(*argv, pm=pm)
    asyncio.run(run(config, pm, resolve_selection(config, pm)))
    return [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]


def test_grpo_under_the_local_executor_matches_fsdp(tmp_path):
    """GRPO with weight sync to the embedded engine: the same rewards, losses and grad norms as fsdp."""
    rows = {b: _grpo_run(tmp_path / b, b) for b in ("fsdp", "megatron")}
    steps = {b: [r for r in rows[b] if "train/step" in r] for b in rows}
    assert len(steps["megatron"]) == len(steps["fsdp"]) == 4
    assert any(abs(r["train/pg_loss"]) > 1e-4 for r in steps["fsdp"])  # the policy gradient is not zero
    for a, b in zip(steps["fsdp"], steps["megatron"]):
        for key in ("train/pg_loss", "train/entropy_loss", "train/grad_norm", "train/lr"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    rewards = {b: [r["rollout/raw_reward"] for r in rows[b] if "rollout/step" in r] for b in rows}
    assert rewards["megatron"] == rewards["fsdp"]
    ckpt = tmp_path / "megatron" / "iter_0000001"
    assert (ckpt / "metadata.json").is_file() and (ckpt / "meta.json").is_file()
    assert (tmp_path / "megatron" / "latest_checkpointed_iteration.txt").read_text().strip() == "1"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("pp, cp, split", [(2, 1, ["--decoder-first-pipeline-num-layers", "2"]),
                                           (1, 2, ["--use-distributed-optimizer"])],
                         ids=["pp2-uneven", "cp2-distributed-optimizer"])
def test_two_ranks_under_torchrun_reproduce_one_process(tiny_model_dir, tmp_path, pp, cp, split):
    """The whole loop at PP=2 or CP=2 (torchrun, the local executor): pi_old from the (last stage's) training
    forward, its metrics and the weights it syncs to the engine give the one-process run's rollouts and metrics
    (PP=2 with uneven stages: the demo model's 3 layers as 2 + 1, even stages being test_pipeline_two_stages';
    at CP=2 each sequence is split over both ranks, and the AdamW state is sharded over the two CP peers)."""
    from .tiny_model import one_process_and_torchrun

    model = DEMO / "model" if pp > 1 else tiny_model_dir
    flags = ["train", "--hf-checkpoint", str(model), "--prompt-data", str(DEMO / "data" / "train.jsonl"),
             "--input-key", "prompt", "--label-key", "label", "--rm-type", "math", "--num-rollout", "2",
             "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "16",
             "--micro-batch-size", "4", "--rollout-max-response-len", "12", "--lr", "1e-4", "--entropy-coef", "0.01",
             "--seed", "1", "--save-interval", "1000", "--train-backend", "megatron"]
    rows, stderr = one_process_and_torchrun(flags, tmp_path, ["--no-reuse-train-log-probs"],
                                            ["--actor-num-gpus-per-node", "2", "--pipeline-model-parallel-size",
                                             str(pp), "--context-parallel-size", str(cp), *split])
    assert f"PP {pp}{' (layers per stage 2+1)' if pp > 1 else ''}, CP {cp}, DP 1" in stderr
    assert ("AdamW state sharded over 2 ranks (DP x CP, --use-distributed-optimizer)" in stderr) == (cp > 1)
    assert "the separate log-prob pass is skipped" in stderr
    assert len(rows["one"]) == len(rows["two"]) == 2
    assert rows["one"][0]["rollout/log_probs"] != rows["one"][1]["rollout/log_probs"]
    for a, b in zip(rows["one"], rows["two"]):
        for key in ("train/entropy_loss", "train/grad_norm", "train/loss", "train/ppo_kl", "rollout/log_probs",
                    "rollout/entropy", "rollout/response_lengths", "rollout/rollout_log_probs", "rollout/raw_reward"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key
        assert b["perf/log_probs_time"] == 0.0 < a["perf/log_probs_time"]


def test_megatron_core_s_fallback_warnings_are_silenced():
    """The warnings megatron-core gives at import for the local spec (no TransformerEngine, no apex) do not reach users."""
    code = ("import logging, warnings; warnings.simplefilter('default'); logging.basicConfig(level=logging.INFO); "
            "import furlong.builtin_plugins.backends.megatron, furlong.builtin_plugins.backends.megatron.backend; "
            "import megatron.core.optimizer, megatron.core.models.gpt.gpt_layer_specs, megatron.core.distributed")
    out = subprocess.run([sys.executable, "-W", "default", "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Apex is not installed" not in out.stderr and "Transformer Engine and Apex" not in out.stderr
    assert "Megatron-FSDP without Transformer Engine" not in out.stderr


def test_an_fsdp_checkpoint_is_named_as_such_by_the_megatron_backend(tmp_path):
    from furlong.builtin_plugins.backends.megatron.checkpoint import read_meta

    (tmp_path / "model").mkdir()
    (tmp_path / "meta.json").write_text("{}")
    with pytest.raises(PluginError) as err:
        read_meta(str(tmp_path))
    assert str(err.value) == (f"checkpoint {tmp_path} was written by --train-backend fsdp (model/ holds its weights, "
                              "no torch_dist metadata.json); resume with --train-backend fsdp.")


def test_compiled_layers_are_refused_with_the_measured_reason(tiny_model_dir):
    report = ConfigReport(plugin="megatron")
    configure(args=train_args(tiny_model_dir, train_torch_compile=True), report=report)
    assert any(m.startswith("--train-torch-compile is not supported yet by --train-backend megatron: its decoder "
                            "layers compiled measured slower") for m in report.errors)


def test_an_fp8_hf_checkpoint_trains_from_the_bf16_ref_load_on_both_backends(tmp_path):
    """BF16 training, FP8 rollouts: with --hf-checkpoint an FP8 checkpoint and --ref-load the BF16 model, fsdp and
    megatron start from the BF16 weights exactly (not the FP8-rounded ones)."""
    from furlong.kit.fp8_io import quantize_checkpoint

    from .tiny_model import build_tiny_bf16_model_for_fp8

    bf16 = build_tiny_bf16_model_for_fp8(tmp_path / "bf16")
    quantize_checkpoint(str(bf16), str(tmp_path / "fp8"))
    start = load_file(bf16 / "model.safetensors")
    for make in (fsdp_backend, megatron_backend):
        backend = make(config=train_config(tmp_path / "fp8", ref_load=str(bf16)))
        asyncio.run(backend.init(backend.config))
        weights = _weights(backend)
        assert sorted(weights) == sorted(start)
        assert all(torch.equal(weights[k], start[k].to(weights[k].dtype)) for k in start), make
