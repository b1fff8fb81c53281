"""The megatron backend's model families beyond Qwen2/Qwen3/Llama (GLM-4) and Miles' ``--spec`` values."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core", reason="the megatron extra (megatron-core) is not installed")

from transformers import AutoConfig, Glm4ForCausalLM  # noqa: E402

from furlong.builtin_plugins.backends.megatron import configure  # noqa: E402
from furlong.builtin_plugins.backends.megatron.attention import rotate  # noqa: E402
from furlong.builtin_plugins.backends.megatron.config import check_model_args, model_shape  # noqa: E402
from furlong.builtin_plugins.backends.megatron.convert import export_hf, load_hf, safetensors_stream  # noqa: E402
from furlong.builtin_plugins.backends.megatron.model import build_gpt, cpu_shims, init_parallel  # noqa: E402
from furlong.core.config.launch_args import launch_args  # noqa: E402
from furlong.hooks import ConfigReport, PluginError  # noqa: E402

from .tiny_model import build_tiny_glm4_model, train_args  # noqa: E402

CPU = torch.device("cpu")
DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo"


@pytest.fixture(scope="module", autouse=True)
def one_rank_groups():
    init_parallel(1, CPU)


@pytest.fixture(scope="module")
def glm4_dir(tmp_path_factory):
    return build_tiny_glm4_model(tmp_path_factory.mktemp("glm4"))


def _loaded(path: Path):
    """``(hf model, shape, megatron model)`` of the HF directory ``path``, float32, HF with eager attention."""
    hf = Glm4ForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    shape = model_shape(hf.config)
    vocab = shape.vocab_size
    model = build_gpt(shape, 1, vocab, torch.float32, CPU)
    load_hf(model, safetensors_stream(str(path)), shape, vocab, 1, 0, str(path))
    return hf, shape, model


def test_glm4_config_maps_to_partial_interleaved_rope_post_norms_and_qkv_bias(glm4_dir):
    shape = model_shape(AutoConfig.from_pretrained(glm4_dir))
    assert (shape.family, shape.qkv_bias, shape.qk_layernorm, shape.tied, shape.kv_channels) == (
        "glm4", True, False, False, 16)
    assert (shape.rotary_percent, shape.rotary_interleaved, shape.post_norms) == (0.5, True, True)
    assert (shape.num_attention_heads, shape.num_query_groups, shape.rotary_base) == (4, 2, 10000.0)


@pytest.mark.parametrize("attention_bias, tied", [(True, False), (False, True)], ids=["bias-untied", "nobias-tied"])
def test_glm4_round_trip_is_bit_exact_and_logits_equal_transformers(tmp_path, attention_bias, tied):
    path = build_tiny_glm4_model(tmp_path / "glm4", seed=3, attention_bias=attention_bias, tied=tied,
                                 std=0.3)
    hf, shape, model = _loaded(path)
    names = {n for n, _ in model.named_parameters()}
    assert "decoder.layers.0.post_self_attn_layernorm.weight" in names
    assert "decoder.layers.1.post_mlp_layernorm.weight" in names
    assert ("decoder.layers.0.self_attention.linear_qkv.bias" in names) == attention_bias
    back = dict(export_hf(model, shape, 1, None))
    expected = {k: v for k, v in hf.state_dict().items() if not (tied and k == "lm_head.weight")}
    assert sorted(back) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(back[name], tensor), name
    ids = torch.randint(0, shape.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), cpu_shims(CPU):
        logits = model(input_ids=ids, position_ids=None, attention_mask=None)
        reference = hf(ids).logits
    assert reference.abs().max() > 1.0  # the comparison is not between near-zero logits
    torch.testing.assert_close(logits, reference, rtol=0, atol=2e-5)


def test_glm4_packed_sequences_equal_each_sequence_alone(tmp_path):
    """Packed (thd) input takes furlong's RoPE path with per-sequence positions: the same logits as each
    sequence run alone through transformers."""
    from megatron.core.packed_seq_params import PackedSeqParams

    hf, shape, model = _loaded(build_tiny_glm4_model(tmp_path / "glm4", seed=4, std=0.3))
    lengths = [7, 12, 5]
    seqs = [torch.randint(4, shape.vocab_size, (n,), generator=torch.Generator().manual_seed(n)) for n in lengths]
    bounds = torch.tensor([0, 7, 19, 24], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds, max_seqlen_q=12,
                             max_seqlen_kv=12)
    with torch.no_grad(), cpu_shims(CPU):
        logits = model(input_ids=torch.cat(seqs)[None], position_ids=None, attention_mask=None,
                       packed_seq_params=params)[0]
        reference = torch.cat([hf(s[None]).logits[0] for s in seqs])
    torch.testing.assert_close(logits, reference, rtol=0, atol=2e-5)


def test_partial_interleaved_rotation_is_transformers_glm4_rope():
    from transformers.models.glm4.modeling_glm4 import apply_rotary_pos_emb

    x = torch.randn(5, 1, 3, 8, generator=torch.Generator().manual_seed(0))  # [s, b, heads, d]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 4, 2).float() / 4))  # RoPE on 4 of the 8 channels
    freqs = torch.arange(5).float()[:, None] * inv_freq  # [s, 2]
    table = freqs.repeat_interleave(2, dim=-1)[:, None, None, :]  # megatron-core's interleaved table [s,1,1,4]
    ours = rotate(x, table.cos(), table.sin(), interleaved=True)
    emb = torch.cat((freqs, freqs), dim=-1)[None]  # transformers' [1, s, 4]
    theirs, _ = apply_rotary_pos_emb(x.permute(1, 2, 0, 3), x.permute(1, 2, 0, 3), emb.cos(), emb.sin())
    torch.testing.assert_close(ours, theirs.permute(2, 0, 1, 3), rtol=0, atol=1e-6)
    assert torch.equal(ours[..., 4:], x[..., 4:])


def test_glm4_model_args_of_miles_script_agree_with_the_config(glm4_dir):
    """Miles' GLM-4 MODEL_ARGS switches (scripts/models/glm4-*.py) are checked against the config."""
    shape = model_shape(AutoConfig.from_pretrained(glm4_dir))
    good = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, group_query_attention=True,
                swiglu=True, disable_bias_linear=True, add_qkv_bias=True, untie_embeddings_and_output_weights=True,
                rotary_percent=0.5, rotary_interleaved=True, post_self_attn_layernorm=True, post_mlp_layernorm=True,
                normalization="RMSNorm")
    assert check_model_args(launch_args(**good), shape, "m/config.json") == []
    bad = launch_args(**{**good, "rotary_percent": 1.0, "post_mlp_layernorm": False})
    assert check_model_args(bad, shape, "m/config.json") == [
        "--rotary-percent 1.0 disagrees with m/config.json (glm4 uses 0.5).",
        "--post-mlp-layernorm is absent but m/config.json says model_type = glm4 (post-mlp-layernorm in the model).",
    ]


def test_partial_rope_outside_glm4_is_refused_by_name(tmp_path):
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=32, num_attention_heads=2, num_hidden_layers=1, intermediate_size=64,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5})
    with pytest.raises(PluginError, match="partial_rotary_factor 0.5 is not supported yet .* 'llama' .GLM-4 only"):
        model_shape(config, "--hf-checkpoint m")


@pytest.mark.parametrize("model_type, words", [
    ("qwen3_5_text", "Gated DeltaNet linear-attention layers"),
    ("qwen3_next", "Gated DeltaNet linear-attention layers"),
    ("deepseek_v4", "compressed sparse attention, hyper-connections"),
    ("glm_moe_dsa", "sparse-attention indexer"),
])
def test_families_not_built_are_refused_naming_what_is_missing(glm4_dir, model_type, words):
    config = AutoConfig.from_pretrained(glm4_dir)
    config.model_type = model_type
    with pytest.raises(PluginError, match=f"model_type '{model_type}' is not supported yet .*{words}"):
        model_shape(config, "--hf-checkpoint m")


def test_glm4_grpo_run_on_cpu_syncs_to_the_embedded_engine(glm4_dir, tmp_path):
    """Two GRPO rollouts of the tiny GLM-4 with --train-backend megatron and the embedded engine (transformers'
    Glm4ForCausalLM): it trains, saves, and the engine generates from the synced weights; fsdp on the same
    model gives the same rewards and losses (both compute transformers' GLM-4)."""
    from furlong.core.config.launch_args import launch_config
    from furlong.core.plugins.manager import get_plugin_manager
    from furlong.core.plugins.selection import resolve_selection
    from furlong.core.run.loop import run

    def grpo(backend: str) -> list[dict]:
        save = tmp_path / backend
        argv = ["--hf-checkpoint", str(glm4_dir), "--prompt-data", str(DEMO / "data" / "train.jsonl"),
                "--input-key", "prompt", "--label-key", "label", "--rm-type", "math", "--num-rollout", "2",
                "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "8",
                "--lr", "1e-3", "--micro-batch-size", "4", "--train-backend", backend, "--save", str(save),
                "--save-interval", "1", "--seed", "1"]
        pm = get_plugin_manager()
        config = launch_config(*argv, pm=pm)
        asyncio.run(run(config, pm, resolve_selection(config, pm)))
        return [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]

    rows = {b: grpo(b) for b in ("megatron", "fsdp")}
    steps = {b: [r for r in rows[b] if "train/step" in r] for b in rows}
    assert len(steps["megatron"]) == len(steps["fsdp"]) == 2
    for a, b in zip(steps["fsdp"], steps["megatron"]):
        for key in ("train/pg_loss", "train/grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    lengths = {b: [r["rollout/response_lengths"] for r in rows[b] if "rollout/step" in r] for b in rows}
    assert lengths["megatron"] == lengths["fsdp"]  # the second rollout samples from the synced weights
    assert (tmp_path / "megatron" / "iter_0000001" / "metadata.json").is_file()


def test_configure_accepts_glm4(glm4_dir):
    report = ConfigReport(plugin="megatron")
    configure(args=train_args(glm4_dir), report=report)
    assert report.errors == []


# --- Miles' --spec values ----------------------------------------------------------------------------


def test_miles_glm4_spec_maps_to_the_glm4_builder_with_one_info_line(glm4_dir):
    report = ConfigReport(plugin="megatron")
    configure(args=train_args(glm4_dir, spec=["miles_plugins.models.glm4", "get_glm_spec"]), report=report)
    assert report.errors == []
    assert [m for m in report.infos if "--spec" in m] == [
        "--spec miles_plugins.models.glm4 get_glm_spec: GLM-4, built by --train-backend megatron from "
        "--hf-checkpoint's config.json (model_type glm4)."]


def test_miles_glm4_spec_on_another_family_names_both(tiny_model_dir):
    report = ConfigReport(plugin="megatron")
    configure(args=train_args(tiny_model_dir, spec=["miles_plugins.models.glm4", "get_glm_spec"]), report=report)
    assert ("--spec miles_plugins.models.glm4 get_glm_spec selects GLM-4, but --hf-checkpoint's config.json has "
            "model_type 'llama' (expected glm4).") in report.errors


@pytest.mark.parametrize("spec, family, missing", [
    (["miles_plugins.models.qwen3_5", "get_qwen3_5_spec"], "Qwen3.5", "Gated DeltaNet linear-attention layers"),
    (["miles_plugins.models.qwen3_next", "get_qwen3_next_spec"], "Qwen3-Next", "Gated DeltaNet linear-attention"),
    (["miles_plugins.models.glm5.glm5", "get_glm5_spec"], "GLM-5", "sparse-attention indexer"),
    (["miles_plugins.models.deepseek_v4.deepseek_v4", "get_dsv4_spec"], "DeepSeek-V4", "hyper-connections"),
])
def test_miles_specs_of_families_not_built_are_refused_naming_what_is_missing(tiny_model_dir, spec, family, missing):
    report = ConfigReport(plugin="megatron")
    configure(args=train_args(tiny_model_dir, spec=spec), report=report)
    refusals = [m for m in report.errors if m.startswith(f"--spec {spec[0]} {spec[1]}")]
    assert len(refusals) == 1
    assert f"selects {family}, which --train-backend megatron does not build yet: " in refusals[0]
    assert missing in refusals[0]


def test_an_unknown_spec_lists_the_known_ones(tiny_model_dir):
    report = ConfigReport(plugin="megatron")
    configure(args=train_args(tiny_model_dir, spec=["my.models", "get_spec"]), report=report)
    (error,) = [m for m in report.errors if m.startswith("--spec my.models get_spec")]
    assert "known: miles_plugins.models.glm4 get_glm_spec; miles_plugins.models.qwen3_5 get_qwen3_5_spec" in error
    assert error.endswith("for Qwen2/2.5, Qwen3, Qwen3-MoE and Llama 3 remove --spec.")


# --- two ranks -------------------------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_glm4_and_lora_on_two_ranks(tmp_path):
    """Two gloo ranks: GLM-4 at TP=2 (q/k/v bias split with its heads, post-sublayer norms and partial RoPE on
    every rank, fc1 from gate_up_proj at stride 2), plain and with --sequence-parallel (packed), gives the
    one-process log-probs, step and weights; so does LoRA at TP=2 (adapters split like their linears), plain
    and with sequence parallelism (the replicated factors' gradients summed over the TP ranks), at DP=2
    (adapter gradients summed over the data-parallel ranks), at PP=2 and at CP=2; the TP=2 and PP=2 adapter checkpoints
    load in one process with the same merged weights and their peft adapters merge to them."""
    from transformers import AutoTokenizer

    from furlong.builtin_plugins.backends.megatron import train_backend as megatron_backend

    from .tiny_model import make_batch, run_two_ranks, train_config

    hf_dir = build_tiny_glm4_model(tmp_path / "glm4", seed=5, std=0.3)
    out = tmp_path / "out"
    out.mkdir()
    run_two_ranks("megatron_families_ranks.py", str(hf_dir), str(out))
    base = {k: v for k, v in Glm4ForCausalLM.from_pretrained(hf_dir).state_dict().items()}
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    lora = dict(lora_rank=4, lora_alpha=8, lr=5e-2, adam_eps=1e-3)
    for name, flags in (("tp", dict(adam_eps=1e-3)), ("sp", dict(adam_eps=1e-3)), ("lora_tp", lora),
                        ("lora_sp", lora), ("lora_dp", lora), ("lora_pp", lora), ("lora_cp", lora)):
        single = megatron_backend(config=train_config(hf_dir, **flags))
        asyncio.run(single.init(single.config))
        batch = make_batch(tokenizer, [[[0, 1], [2, 3]]])
        old = asyncio.run(single.log_probs(batch))
        metrics = asyncio.run(single.train(0, batch))[0]
        got = torch.load(out / f"{name}.pt", weights_only=True)
        if got["log_probs"] is not None:
            for key in ("log_probs", "entropy"):
                for a, b in zip(old[key], got["log_probs"][key]):
                    torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
        assert got["metrics"]["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-5), name
        assert got["metrics"]["loss"] == pytest.approx(metrics["loss"], rel=1e-5), name
        weights = dict(asyncio.run(single.named_weights()))
        for key, tensor in weights.items():
            torch.testing.assert_close(got["weights"][key], tensor, rtol=0, atol=1e-5, msg=f"{name} {key}")
        if name in ("lora_tp", "lora_pp"):
            from peft import PeftModel

            assert max(float((got["weights"][k] - v).abs().max()) for k, v in base.items()) > 1e-3
            ckpt = out / ("lora_ckpt" if name == "lora_tp" else "lora_pp_ckpt")
            resumed = megatron_backend(config=train_config(hf_dir, **lora, seed=9))
            asyncio.run(resumed.init(resumed.config))
            asyncio.run(resumed.load(str(ckpt)))
            for key, tensor in asyncio.run(resumed.named_weights()):
                torch.testing.assert_close(tensor, got["weights"][key], rtol=0, atol=1e-6, msg=f"resumed {key}")
            merged = PeftModel.from_pretrained(Glm4ForCausalLM.from_pretrained(hf_dir),
                                               str(ckpt / "adapter")).merge_and_unload().state_dict()
            for key, tensor in got["weights"].items():
                torch.testing.assert_close(merged[key], tensor, rtol=0, atol=1e-6, msg=f"peft {key}")
