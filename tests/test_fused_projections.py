"""Fused query/key/value and gate/up projections of the embedded engine (:mod:`.fused_projections`, on with
the CUDA kernels): the transformers classes it lists compute the same logits fused, the model keeps its
``state_dict``, weights copied in by name reach the fused products (compiled layers included), nothing is
duplicated in memory, and a model moved with ``.to()`` fuses again."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from furlong.builtin_plugins.engines.embedded.fused_projections import (  # noqa: E402
    ATTENTIONS, MLPS, fuse_projections, unfuse_projections)
from furlong.builtin_plugins.engines.embedded.fusion import compile_model  # noqa: E402

FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]


def _model(model_type: str, seed: int = 0):
    config = AutoConfig.for_model(model_type, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=50,
                                  max_position_embeddings=64)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _storage(t):
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_projections_give_the_class_s_logits_and_keep_the_state_dict(family):
    model = _model(family)
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(1))
    names = sorted(model.state_dict())
    reference = _logits(model, ids)
    assert fuse_projections(model) == 4  # 2 layers x (attention, MLP)
    assert sorted(model.state_dict()) == names
    assert torch.allclose(_logits(model, ids), reference, atol=1e-6, rtol=0)
    layer = model.model.layers[0]
    assert type(layer.self_attn).__name__ in ATTENTIONS and type(layer.mlp).__name__ in MLPS
    fused = layer.self_attn._furlong_fused_weight
    assert all(_storage(getattr(layer.self_attn, n).weight) == _storage(fused) for n in ("q_proj", "k_proj", "v_proj"))
    assert _storage(layer.mlp.up_proj.weight) == _storage(layer.mlp._furlong_fused_weight)
    # a weight update by name (as the engine copies one) reaches the fused products
    twin = _model(family)
    with torch.no_grad():
        for target in (model, twin):
            state = target.state_dict()
            state["model.layers.0.self_attn.v_proj.weight"].add_(0.05)
            state["model.layers.1.mlp.gate_proj.weight"].mul_(1.5)
            if family == "qwen2":
                state["model.layers.1.self_attn.k_proj.bias"].add_(0.3)
    updated = _logits(twin, ids)
    assert not torch.allclose(updated, reference, atol=1e-3)
    assert torch.allclose(_logits(model, ids), updated, atol=1e-6, rtol=0)
    unfuse_projections(model)
    assert "forward" not in layer.self_attn.__dict__ and "_furlong_fused_weight" not in layer.mlp._buffers
    assert torch.allclose(_logits(model, ids), updated, atol=1e-6, rtol=0)


def test_compiled_layers_read_the_fused_weights_as_they_change():
    model, twin = _model("qwen3"), _model("qwen3")
    ids = torch.randint(0, 50, (3, 5), generator=torch.Generator().manual_seed(2))
    fuse_projections(model)
    compile_model(model, "aot_eager")
    assert torch.allclose(_logits(model, ids), _logits(twin, ids), atol=1e-6, rtol=0)
    with torch.no_grad():
        for target in (model, twin):
            target.state_dict()["model.layers.1.self_attn.q_proj.weight"].mul_(-1.0)
    assert torch.allclose(_logits(model, ids), _logits(twin, ids), atol=1e-6, rtol=0)


def test_a_moved_model_fuses_again_and_stays_in_step_with_its_weights():
    """The engine's move: unfuse, ``.to()`` (each weight gets storage of its own), fuse again."""
    model, twin = _model("llama"), _model("llama")
    ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(3))
    fuse_projections(model)
    unfuse_projections(model)
    model.to(torch.float64)
    twin.to(torch.float64)
    k_proj = model.model.layers[1].self_attn.k_proj
    assert _storage(k_proj.weight) != _storage(model.model.layers[1].self_attn.q_proj.weight)
    assert fuse_projections(model) == 4
    assert _storage(k_proj.weight) == _storage(model.model.layers[1].self_attn._furlong_fused_weight)
    with torch.no_grad():
        for target in (model, twin):
            target.state_dict()["model.layers.1.self_attn.k_proj.weight"].add_(0.2)
    assert torch.allclose(_logits(model, ids), _logits(twin, ids), atol=1e-12, rtol=0)


def test_projections_that_are_not_plain_linears_are_left_alone():
    class Wrapped(torch.nn.Linear):  # a LoRA- or FP8-style replacement
        pass

    model = _model("llama")
    attention = model.model.layers[0].self_attn
    attention.k_proj = Wrapped(32, 16, bias=False)
    model.model.layers[1].mlp.up_proj = torch.nn.Linear(32, 48, bias=True)  # gate without bias, up with
    assert fuse_projections(model) == 2  # layer 0's MLP and layer 1's attention
    assert "_furlong_fused_weight" not in attention._buffers
    assert "_furlong_fused_weight" not in model.model.layers[1].mlp._buffers


def test_a_decoder_without_cuda_does_not_fuse(tiny_model_dir):
    import threading

    from transformers import AutoTokenizer

    from furlong.builtin_plugins.engines.embedded.decode import SlotDecoder

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    decoder = SlotDecoder(model, AutoTokenizer.from_pretrained(tiny_model_dir), max_slots=2, lock=threading.Lock())
    assert decoder.fuses_projections is False
    assert not any("_furlong_fused_weight" in m._buffers for m in model.modules())


def test_a_remote_code_class_that_shares_a_listed_name_is_left_alone():
    model = _model("llama")
    mlp = model.model.layers[0].mlp
    LlamaMLP = type("LlamaMLP", (type(mlp),), {"__module__": "transformers_modules.someone.modeling"})
    mlp.__class__ = LlamaMLP
    assert fuse_projections(model) == 3
    assert "_furlong_fused_weight" not in mlp._buffers and "forward" not in mlp.__dict__
