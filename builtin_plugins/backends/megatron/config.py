"""Hugging Face config -> megatron-core GPTModel settings, and the check of Miles' ``MODEL_ARGS`` against it.

Families: Qwen2 / Qwen2.5 (``qwen2``: bias on q/k/v), Qwen3 (``qwen3``: per-head q/k
RMSNorm, explicit ``head_dim``), Qwen3-MoE (``qwen3_moe``: Qwen3 attention, top-k softmax-routed
SwiGLU experts without shared experts), Llama 3 (``llama``, with the ``llama3`` RoPE scaling
of Llama 3.1/3.2) and GLM-4 (``glm4``: q/k/v bias when ``attention_bias``, an RMSNorm after the
attention and after the MLP before each residual add, interleaved RoPE on the first
``partial_rotary_factor`` of each head). All are pre-norm RMSNorm decoders with SwiGLU MLPs.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from furlong.hooks import PluginError
from furlong.hooks.megatron_flags import architecture_disagreements

__all__ = ["RECOMPUTE_NEEDS_CUDA", "ModelShape", "check_model_args", "flag_dest", "model_shape", "padded_vocab_size"]

FAMILIES = ("qwen2", "qwen3", "qwen3_moe", "llama", "glm4")

# families a user may expect, and what this backend lacks to build them
_NOT_YET = {
    "deepseek_v3": "multi-latent attention, the sigmoid router with its expert bias (e_score_correction_bias), "
                   "shared experts and multi-token prediction layers are not built yet",
    "qwen2_moe": "its shared expert (shared_expert_intermediate_size) and that expert's sigmoid gate are not built yet",
    "qwen3_next": "its Gated DeltaNet linear-attention layers, the gated attention output, the 1 + weight norm "
                  "scales and the shared expert are not built yet",
    "qwen3_5": "its Gated DeltaNet linear-attention layers (layer_types 'linear_attention'), the gated attention "
               "output (q_proj's second half) and the 1 + weight norm scales are not built yet",
    "glm4_moe": "its shared expert and the sigmoid router with its expert bias (e_score_correction_bias) are not "
                "built yet",
    "glm_moe_dsa": "multi-latent attention with the DeepSeek sparse-attention indexer, the sigmoid router and "
                   "shared experts are not built yet",
    "deepseek_v4": "its compressed sparse attention, hyper-connections and mixture of experts are not built yet",
}
for _name in ("qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"):
    _NOT_YET[_name] = _NOT_YET["qwen3_5"]

# Megatron's llama3 RoPE scaling hard-codes these (rotary_pos_embedding.py); other values differ from HF.
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@attrs.frozen
class ModelShape:
    """What GPTModel needs from the HF config, in Megatron's terms.

    ``rope_scaling_factor`` is None without RoPE scaling. ``qkv_bias``: bias on q/k/v only.
    ``rotary_percent``: the share of each head's channels RoPE rotates (HF ``partial_rotary_factor``),
    ``rotary_interleaved``: RoPE rotates channel pairs ``(2i, 2i + 1)`` (GPT-J style) rather than
    ``(i, i + d/2)``. ``post_norms``: an RMSNorm on the attention output and on the MLP output
    before their residual adds (GLM-4's ``post_self_attn_layernorm`` and ``post_mlp_layernorm``).
    ``padding_idx``: the HF embedding's ``padding_idx`` (``pad_token_id``), whose lookups pass
    no gradient to its row (:func:`~.model.untrained_padding_lookups`), or None.

    Mixture of experts (0 / empty for dense models): ``num_experts`` routed experts of
    ``moe_ffn_hidden_size`` each, ``moe_topk`` per token, ``norm_topk_prob`` (the top-k
    probabilities renormalised to sum to 1), ``moe_layers`` the indices of the layers with
    experts (the others have a dense MLP of ``ffn_hidden_size``).
    """

    family: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    vocab_size: int
    max_position_embeddings: int
    norm_epsilon: float
    rotary_base: float
    rope_scaling_factor: float | None
    tied: bool
    qkv_bias: bool
    qk_layernorm: bool
    padding_idx: int | None = None
    rotary_percent: float = 1.0
    rotary_interleaved: bool = False
    post_norms: bool = False
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    moe_topk: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple = ()

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


RECOMPUTE_NEEDS_CUDA = ("--recompute-granularity needs CUDA with --train-backend megatron (megatron-core's recompute "
                        "restores CUDA RNG states); leave the --recompute-* flags out on this machine.")

def _rotary_percent(hf: Any, where: str) -> float:
    """HF ``partial_rotary_factor`` (in ``rope_parameters`` under transformers 5, else top-level; 1 when absent).

    :raises PluginError: a factor whose rotated channels are not a whole even number of a head's.
    """
    params = dict(getattr(hf, "rope_parameters", None) or {})
    factor = float(params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", None) or 1.0))
    head_dim = int(getattr(hf, "head_dim", None) or int(hf.hidden_size) // int(hf.num_attention_heads))
    rotated = head_dim * factor
    if not 0 < factor <= 1 or rotated != int(rotated) or int(rotated) % 2:
        raise PluginError(f"{where}: partial_rotary_factor {factor:g} of head_dim {head_dim} does not rotate a whole "
                          "even number of channels; --train-backend megatron cannot build it.")
    return factor


def _rope(hf: Any, where: str) -> tuple[float, float | None]:
    """``(theta, llama3 factor or None)``; transformers 5 keeps them in ``rope_parameters``."""
    params = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    theta = params.get("rope_theta", getattr(hf, "rope_theta", None))
    if theta is None:
        raise PluginError(f"{where}: config.json has no rope_theta (neither top-level nor in rope_parameters).")
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        raise PluginError(f"{where}: RoPE scaling {kind!r} is not supported yet by --train-backend megatron "
                          "(supported: none, llama3).")
    for key, value in _LLAMA3_FIXED.items():
        if float(params.get(key, value)) != value:
            raise PluginError(f"{where}: llama3 RoPE scaling with {key}={params.get(key)} is not supported yet: "
                              f"megatron-core fixes it to {value:g}.")
    return float(theta), float(params["factor"])


def model_shape(hf: Any, where: str = "--hf-checkpoint") -> ModelShape:
    """Read a transformers ``PretrainedConfig`` of the Qwen2, Qwen3, Qwen3-MoE, Llama or GLM-4 family.

    :param hf: the config (``AutoConfig.from_pretrained``).
    :param where: the flag or file named in errors.
    :raises PluginError: another family, or a feature these GPTModel settings cannot
        express (biases outside q/k/v, sliding window, RoPE scaling other than llama3,
        a non-SiLU MLP, partial RoPE outside GLM-4).
    """
    family = getattr(hf, "model_type", None)
    if family in _NOT_YET:
        raise PluginError(f"{where}: model_type {family!r} is not supported yet by --train-backend megatron: "
                          f"{_NOT_YET[family]} (supported: {', '.join(FAMILIES)}).")
    if family not in FAMILIES:
        raise PluginError(f"{where}: model_type {family!r} is not supported by --train-backend megatron "
                          f"(supported: {', '.join(FAMILIES)}).")
    heads = int(hf.num_attention_heads)
    hidden = int(hf.hidden_size)
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise PluginError(f"{where}: hidden_act {hf.hidden_act!r}; the megatron backend builds SwiGLU (silu) MLPs.")
    if getattr(hf, "mlp_bias", False):
        raise PluginError(f"{where}: mlp_bias=true is not supported yet by --train-backend megatron.")
    if family not in ("qwen2", "glm4") and getattr(hf, "attention_bias", False):
        raise PluginError(f"{where}: attention_bias=true (bias on o_proj too) is not supported yet by "
                          "--train-backend megatron.")
    if getattr(hf, "use_sliding_window", False):
        raise PluginError(f"{where}: use_sliding_window=true is not supported yet by --train-backend megatron.")
    theta, factor = _rope(hf, where)
    glm = family == "glm4"
    rotary_percent = _rotary_percent(hf, where)
    if rotary_percent != 1.0 and not glm:
        raise PluginError(f"{where}: partial_rotary_factor {rotary_percent:g} is not supported yet by --train-backend "
                          f"megatron for model_type {family!r} (GLM-4 only).")
    moe = _experts(hf, where) if family == "qwen3_moe" else {}
    return ModelShape(
        family=family,
        num_layers=int(hf.num_hidden_layers),
        hidden_size=hidden,
        ffn_hidden_size=int(hf.intermediate_size),
        num_attention_heads=heads,
        num_query_groups=int(getattr(hf, "num_key_value_heads", None) or heads),
        kv_channels=int(getattr(hf, "head_dim", None) or hidden // heads),
        vocab_size=int(hf.vocab_size),
        max_position_embeddings=int(hf.max_position_embeddings),
        norm_epsilon=float(hf.rms_norm_eps),
        rotary_base=theta,
        rope_scaling_factor=factor,
        tied=bool(getattr(hf, "tie_word_embeddings", False)),
        qkv_bias=family == "qwen2" or (glm and bool(getattr(hf, "attention_bias", False))),
        qk_layernorm=family in ("qwen3", "qwen3_moe"),
        padding_idx=getattr(hf, "pad_token_id", None),
        rotary_percent=rotary_percent,
        rotary_interleaved=glm,
        post_norms=glm,
        **moe,
    )


def _experts(hf: Any, where: str) -> dict:
    """The mixture-of-experts fields of :class:`ModelShape` from a Qwen3-MoE config: a layer ``i`` has
    experts unless it is in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0`` (transformers'
    ``Qwen3MoeDecoderLayer``)."""
    experts = int(getattr(hf, "num_experts", 0) or 0)
    if getattr(hf, "shared_expert_intermediate_size", 0):
        raise PluginError(f"{where}: shared_expert_intermediate_size is set; shared experts are not supported yet "
                          "by --train-backend megatron.")
    step = int(getattr(hf, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(hf, "mlp_only_layers", None) or [])
    layers = tuple(i for i in range(int(hf.num_hidden_layers))
                   if experts > 0 and i not in dense and (i + 1) % step == 0)
    if not layers:
        return {}
    return dict(num_experts=experts, moe_ffn_hidden_size=int(hf.moe_intermediate_size),
                moe_topk=int(hf.num_experts_per_tok), norm_topk_prob=bool(getattr(hf, "norm_topk_prob", False)),
                moe_layers=layers)


def padded_vocab_size(vocab: int, tp: int, divisible_by: int | None) -> int:
    """Vocabulary rows of the embedding and output layer.

    megatron-core only needs ``vocab % tp == 0``; Megatron-LM's
    ``--make-vocab-size-divisible-by k`` pads to a multiple of ``k * tp``. Without the flag
    the HF size is kept when TP divides it (no padded rows, no log-prob bias), else padded
    to the next multiple of TP. Padded rows are zero and masked out of every softmax.
    """
    multiple = (divisible_by or 1) * tp
    return int(math.ceil(vocab / multiple) * multiple)


# config.json key -> ModelShape field, for the check of Miles' valued MODEL_ARGS flags
_SHAPE_FIELDS = {"num_hidden_layers": "num_layers", "hidden_size": "hidden_size",
                 "intermediate_size": "ffn_hidden_size", "num_attention_heads": "num_attention_heads", "num_key_value_heads": "num_query_groups",
                 "head_dim": "kv_channels", "rope_theta": "rotary_base", "rms_norm_eps": "norm_epsilon",
                 "vocab_size": "vocab_size"}

# boolean flags: (flag, HF meaning of the flag being given, HF key for the message)
_SWITCHES = (
    ("--group-query-attention", lambda s: s.num_query_groups != s.num_attention_heads, "num_key_value_heads"),
    ("--swiglu", lambda s: True, "hidden_act"),
    ("--disable-bias-linear", lambda s: True, "attention_bias/mlp_bias"),
    ("--add-qkv-bias", lambda s: s.qkv_bias, "model_type"),
    ("--qk-layernorm", lambda s: s.qk_layernorm, "model_type"),
    ("--untie-embeddings-and-output-weights", lambda s: not s.tied, "tie_word_embeddings"),
    ("--rotary-interleaved", lambda s: s.rotary_interleaved, "model_type"),
    ("--post-self-attn-layernorm", lambda s: s.post_norms, "model_type"),
    ("--post-mlp-layernorm", lambda s: s.post_norms, "model_type"),
)


def flag_dest(flag: str) -> str:
    """The ``args`` attribute of a flag: ``--num-layers`` -> ``num_layers``."""
    return flag[2:].replace("-", "_")


def check_model_args(args: Any, shape: ModelShape, where: str) -> list[str]:
    """Problems of Miles' architecture flags (``MODEL_ARGS``) against the HF config.

    A valued flag that was given must equal the config's value, and a switch that was given
    (``--swiglu``, ``--untie-embeddings-and-output-weights``, ``--qk-layernorm``, ...) must name a
    feature the HF model has. When ``--num-layers`` is given the flags describe the whole model,
    as in a Miles script, so each switch must also be present when the model has the feature.
    ``--normalization`` must be RMSNorm, ``--position-embedding-type`` rope and ``--rotary-percent`` the
    config's ``partial_rotary_factor`` (1 when absent).

    :returns: one message per disagreement, naming the flag, both values and ``where``.
    """
    values = {key: getattr(shape, field) for key, field in _SHAPE_FIELDS.items()}
    problems = [message for _, message in architecture_disagreements(args, values, where)]
    fixed = (("--normalization", "RMSNorm"), ("--position-embedding-type", "rope"),
             ("--rotary-percent", shape.rotary_percent))
    for flag, value in fixed:
        given = getattr(args, flag_dest(flag), None)
        if given is not None and given != value:
            problems.append(f"{flag} {given} disagrees with {where} ({shape.family} uses {value}).")
    whole_model = getattr(args, "num_layers", None) is not None
    for flag, has, hf_key in _SWITCHES:
        given = bool(getattr(args, flag_dest(flag), False))
        if given != has(shape) and (given or whole_model):
            state = "given" if given else "absent"
            problems.append(f"{flag} is {state} but {where} says {hf_key} = {_hf_value(shape, hf_key)} "
                            f"({'no ' if given else ''}{flag[2:]} in the model).")
    return problems


def _hf_value(shape: ModelShape, key: str) -> Any:
    return {"num_key_value_heads": shape.num_query_groups, "hidden_act": "silu", "model_type": shape.family,
            "tie_word_embeddings": shape.tied, "attention_bias/mlp_bias": "false"}[key]
