"""LoRA on the megatron backend: targets by Miles' names, only adapters train, merged weights, adapter checkpoints."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core", reason="the megatron extra (megatron-core) is not installed")

from safetensors.torch import load_file  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from furlong.builtin_plugins.backends.megatron import configure  # noqa: E402
from furlong.builtin_plugins.backends.megatron import train_backend as megatron_backend  # noqa: E402
from furlong.builtin_plugins.backends.megatron.lora import target_linears  # noqa: E402
from furlong.hooks import ConfigReport, PluginError  # noqa: E402

from .tiny_model import build_tiny_glm4_model, make_batch, train_args, train_config  # noqa: E402

LORA = dict(lora_rank=4, lora_alpha=8, lr=5e-2)


def _flags(target=None, exclude=None):
    return SimpleNamespace(target_modules=target, exclude_modules=exclude)


@pytest.mark.parametrize("target, exclude, expected", [
    (None, None, {"linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"}),
    ("all-linear", "o_proj,down_proj", {"linear_qkv", "linear_fc1"}),
    ("q_proj,k_proj,v_proj", None, {"linear_qkv"}),
    ("linear_qkv,linear_fc2", None, {"linear_qkv", "linear_fc2"}),
    ("gate_up_proj", None, {"linear_fc1"}),
])
def test_target_modules_map_to_megatron_linears(target, exclude, expected):
    assert target_linears(_flags(target, exclude)) == expected


@pytest.mark.parametrize("target, exclude, message", [
    ("q_proj,v_proj", None, "fuses q_proj, k_proj, v_proj into linear_qkv and puts one adapter on it"),
    ("lm_head", None, "lm_head is not a linear layer"),
    ("linear_qkv", "linear_qkv", "leaves no linear layer"),
])
def test_targets_megatron_cannot_adapt_are_refused(target, exclude, message):
    with pytest.raises(PluginError, match=message):
        target_linears(_flags(target, exclude))


def test_configure_accepts_lora_and_refuses_dropout_with_tensor_parallelism(tiny_model_dir):
    report = ConfigReport(plugin="megatron")
    configure(args=train_args(tiny_model_dir, lora_rank=4, target_modules="q_proj,k_proj,v_proj",
                              tensor_model_parallel_size=2), report=report)
    assert report.errors == []
    report = ConfigReport(plugin="megatron")
    configure(args=train_args(tiny_model_dir, lora_rank=4, lora_dropout=0.1, tensor_model_parallel_size=2),
              report=report)
    assert any(m.startswith("--lora-dropout 0.1 with --tensor-model-parallel-size 2 is not supported yet") for m in
               report.errors)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A GLM-4 megatron backend with LoRA on every linear, after one AdamW step, and its base weights."""
    hf_dir = build_tiny_glm4_model(tmp_path_factory.mktemp("glm4"), std=0.3)
    backend = megatron_backend(config=train_config(hf_dir, **LORA))
    asyncio.run(backend.init(backend.config))
    base = {k: v.clone() for k, v in asyncio.run(backend.named_weights())}
    batch = make_batch(AutoTokenizer.from_pretrained(hf_dir), [[[0, 1], [2, 3]]])
    asyncio.run(backend.train(0, batch))
    return backend, base, hf_dir


def test_only_the_adapters_are_in_the_optimizer(trained):
    backend, _, _ = trained
    names = {id(p): n for n, p in backend.model.named_parameters()}
    optimized = [names[id(p)] for group in backend.optimizer.param_groups for p in group["params"]]
    adapters = [n for n, p in backend.model.named_parameters() if ".lora_" in n]
    assert sorted(optimized) == sorted(adapters)
    assert len(adapters) == 2 * 4 * 2  # A and B on 4 linears of 2 layers
    assert all(not p.requires_grad for n, p in backend.model.named_parameters() if ".lora_" not in n)


def test_merged_weights_are_base_plus_scaled_b_a_under_hugging_face_names(trained):
    backend, base, _ = trained
    merged = dict(asyncio.run(backend.named_weights()))
    assert sorted(merged) == sorted(base)
    layer = backend.model.decoder.layers[1]
    scale = LORA["lora_alpha"] / LORA["lora_rank"]
    qkv, fc1 = layer.self_attention.linear_qkv, layer.mlp.linear_fc1
    assert qkv.lora_B.weight.abs().max() > 1e-3  # the step moved B away from zero: the deltas are not zero
    # q/k/v: the rows of B A of each projection (linear_qkv packs them per KV group: 4 heads, 2 groups of 16)
    delta = (qkv.lora_B.weight @ qkv.lora_A.weight * scale).detach().view(2, 4, 16, 32)
    for part, rows in (("q_proj", delta[:, :2]), ("k_proj", delta[:, 2:3]), ("v_proj", delta[:, 3:])):
        name = f"model.layers.1.self_attn.{part}.weight"
        torch.testing.assert_close(merged[name], base[name] + rows.reshape(-1, 32), rtol=0, atol=1e-6)
    name = "model.layers.1.mlp.gate_up_proj.weight"
    delta = (fc1.lora_B.weight @ fc1.lora_A.weight * scale).detach()
    torch.testing.assert_close(merged[name], base[name] + delta, rtol=0, atol=1e-6)
    for name in ("model.embed_tokens.weight", "model.layers.0.post_mlp_layernorm.weight", "lm_head.weight",
                 "model.layers.0.self_attn.q_proj.bias"):
        assert torch.equal(merged[name], base[name]), name  # not adapted: unchanged


def test_the_adapted_forward_equals_transformers_on_the_merged_weights(trained):
    from transformers import Glm4ForCausalLM

    from furlong.builtin_plugins.backends.megatron.model import cpu_shims

    backend, _, hf_dir = trained
    hf = Glm4ForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    hf.load_state_dict(dict(asyncio.run(backend.named_weights())), strict=False)
    ids = torch.randint(4, 100, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), cpu_shims(backend.device):
        logits = backend.model(input_ids=ids, position_ids=None, attention_mask=None)
        reference = hf(ids).logits
    assert reference.abs().max() > 2.0
    # W x + s B (A x) against (W + s B A) x: float32 rounding of the two orders
    torch.testing.assert_close(logits, reference, rtol=1e-5, atol=2e-5)


def test_checkpoints_hold_the_adapters_and_peft_loads_them(trained, tmp_path):
    from megatron.core.dist_checkpointing import load_tensors_metadata
    from peft import PeftModel
    from transformers import Glm4ForCausalLM

    backend, _, hf_dir = trained
    path = tmp_path / "iter_0000001"
    asyncio.run(backend.save(str(path)))
    keys = list(load_tensors_metadata(str(path)))
    assert keys and all(".lora_A." in k or ".lora_B." in k for k in keys)  # no base weight: --hf-checkpoint is
    assert any(k.startswith("optimizer.state.exp_avg.") for k in keys)
    saved = load_file(path / "adapter" / "adapter_model.safetensors")
    assert "base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight" in saved
    peft_model = PeftModel.from_pretrained(Glm4ForCausalLM.from_pretrained(hf_dir), str(path / "adapter"))
    merged = peft_model.merge_and_unload().state_dict()
    ours = dict(asyncio.run(backend.named_weights()))
    for name, tensor in ours.items():
        torch.testing.assert_close(merged[name], tensor, rtol=0, atol=1e-6, msg=name)
    resumed = megatron_backend(config=train_config(hf_dir, **LORA, seed=7))  # other initial adapters
    asyncio.run(resumed.init(resumed.config))
    asyncio.run(resumed.load(str(path)))
    after = dict(asyncio.run(resumed.named_weights()))
    for name, tensor in ours.items():
        assert torch.equal(after[name], tensor), name
    moments = {id(p): s for p, s in resumed.optimizer.state.items()}
    assert all(moments[id(p)]["exp_avg"].abs().max() > 0 for n, p in resumed.model.named_parameters()
               if n.endswith("lora_B.weight"))


def test_bf16_keeps_float32_masters_of_the_adapters_only_and_resumes_them(tmp_path):
    hf_dir = build_tiny_glm4_model(tmp_path / "glm4")
    config = train_config(hf_dir, **LORA, bf16=True)
    backend = megatron_backend(config=config)
    asyncio.run(backend.init(config))
    trained = [n for n, _ in backend._trained_parameters()]
    assert len(trained) == 16 and all(".lora_" in n for n in trained)
    assert all(p.dtype == torch.float32 for _, p in backend._trained_parameters())
    asyncio.run(backend.train(0, make_batch(AutoTokenizer.from_pretrained(hf_dir), [[[0, 1], [2, 3]]])))
    asyncio.run(backend.save(str(tmp_path / "ckpt")))
    resumed = megatron_backend(config=config)
    asyncio.run(resumed.init(config))
    asyncio.run(resumed.load(str(tmp_path / "ckpt")))
    ours, theirs = dict(asyncio.run(backend.named_weights())), dict(asyncio.run(resumed.named_weights()))
    assert all(torch.equal(theirs[k], v) for k, v in ours.items())
    for (name, a), (_, b) in zip(backend._trained_parameters(), resumed._trained_parameters()):
        assert torch.equal(a, b), name  # the float32 masters, not their bfloat16 rounding


def test_lora_dropout_drops_adapter_inputs_in_training_passes_only(tmp_path):
    """With --lora-dropout the log-prob pass is deterministic and the training forward is not, so pi_old does not
    come from the training forward."""
    hf_dir = build_tiny_glm4_model(tmp_path / "glm4")
    backend = megatron_backend(config=train_config(hf_dir, **LORA, lora_dropout=0.5))
    asyncio.run(backend.init(backend.config))
    assert backend.train_forward_gives_old_log_probs() is False
    with torch.no_grad():
        for name, param in backend.model.named_parameters():
            if name.endswith("lora_B.weight"):
                param.normal_(0.0, 0.5)  # a non-zero delta, so dropping its input shows
    layer = backend.model.decoder.layers[0].self_attention.linear_qkv
    x = torch.randn(5, 1, 32)
    with torch.no_grad():
        assert torch.equal(layer(x)[0], layer(x)[0])
    with torch.enable_grad():
        assert not torch.equal(layer(x)[0], layer(x)[0])
