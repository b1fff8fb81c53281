"""Megatron-LM flags given to a train backend that does not honour them: one warning line, one error line.

Every flag of Megatron-LM's parser is accepted (``core/config/data/megatron_args.json``)
and handed to the train backend (``args.megatron_args``, ``args.megatron_argv``). The
backend declares what it honours with ``MEGATRON_FLAGS`` (:class:`furlong.hooks.MegatronFlags`)
on its plugin object. The rest is sorted here by what ignoring it would do:

- no effect on results (fusions, kernels, overlap, parallel layout, memory, logging,
  checkpoint I/O, Megatron's own data and inference paths): listed in one warning;
- changes the math (fp8/fp4, MoE load balancing and router numerics, dropout, the
  optimizer's numerics...) or the model (architecture flags a backend does not build
  from): listed in one error. A math flag given at Megatron's default changes nothing
  and goes to the warning;
- architecture flags under ``architecture_from_hf``: the model comes from the
  ``--hf-checkpoint`` config; MLA or MoE flags on a config without them are errors, and
  so is a valued flag (``--num-layers``, ``--vocab-size``...) that disagrees with it
  (:func:`furlong.hooks.megatron_flags.architecture_disagreements`, the check the megatron
  backend runs on the flags it reads).
"""

from __future__ import annotations

import json
import os
from argparse import Namespace
from typing import Any

from furlong.hooks import ConfigReport, MegatronFlags
from furlong.hooks.megatron_flags import architecture_disagreements, hf_architecture_values, hf_missing_switch

from .tables import megatron_table, miles_table
from .flag_access import flag_value, has_flag

__all__ = ["ARCHITECTURE", "MATH", "effect", "report_megatron_flags", "report_routing_replay"]

# groups of Megatron's table whose every flag describes the model
ARCHITECTURE_GROUPS = frozenset({"network size", "mla", "moe", "heterogeneous architecture",
                                 "experimental_attention_variant"})
ARCHITECTURE = frozenset({
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "layernorm_epsilon", "normalization", "layernorm_zero_centered_gamma", "add_bias_linear", "add_qkv_bias",
    "glu_linear_offset",
    "activation_func_clamp_value", "rotary_interleaved", "qk_layernorm", "qk_l2_norm", "attention_output_gate",
    "post_self_attn_layernorm", "post_mlp_layernorm", "multi_latent_attention", "experimental_attention_variant",
    "softmax_type", "fp32_residual_connection", "apply_residual_connection_post_layernorm",
    "apply_query_key_layer_scaling", "mtp_num_layers", "mtp_use_repeated_layer", "mtp_hybrid_override_pattern",
    "moe_ffn_hidden_size", "moe_router_topk", "moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
    "moe_router_score_function", "moe_router_enable_expert_bias", "moe_router_num_groups", "moe_router_group_topk",
    "moe_router_pre_softmax", "moe_router_topk_scaling_factor", "moe_latent_size", "mrope_section",
    "is_hybrid_model", "hybrid_attention_ratio", "hybrid_mlp_ratio", "hybrid_override_pattern", "spec", "rope_type",
    "vocab_size", "padded_vocab_size", "use_rotary_position_embeddings", "position_embedding_type",
    "max_position_embeddings", "group_query_attention", "swiglu", "untie_embeddings_and_output_weights",
    "num_experts",
})
ARCHITECTURE_PREFIXES = ("dsa_indexer_", "dsv4_", "linear_", "mamba_")
MATH = frozenset({
    "fp8", "first_last_layers_bf16", "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16",
    "calculate_per_token_loss", "moe_aux_loss_coeff", "moe_z_loss_coeff",
    "moe_input_jitter_eps", "moe_expert_capacity_factor", "moe_token_drop_policy", "moe_pad_expert_input_to_capacity",
    "moe_router_bias_update_rate", "moe_router_force_load_balancing", "moe_router_force_biased",
    "moe_router_freeze_gate", "freeze_e_score_correction_bias",
    "moe_enable_routing_replay", "qk_clip", "qk_clip_alpha", "qk_clip_threshold", "true_on_policy_contract",
    "true_on_policy_vocab_size", "hidden_dropout", "attention_dropout", "mtp_loss_scaling_factor", "sgd_momentum",
    "decoupled_lr", "decoupled_min_lr", "start_weight_decay", "end_weight_decay", "weight_decay_incr_style",
    "apply_wd_to_qk_layernorm", "no_weight_decay_cond_type", "loss_scale", "initial_loss_scale", "min_loss_scale",
    "loss_scale_window", "hysteresis", "grad_reduce_in_bf16", "main_grads_dtype", "main_params_dtype",
    "exp_avg_dtype", "exp_avg_sq_dtype", "fp16_lm_cross_entropy",
    # Miles' backend flags that change the model or its numerics
    "lora_rank", "lora_alpha", "lora_dropout", "target_modules", "exclude_modules", "custom_megatron_init_path",
    "custom_model_provider_path", "extra_high_precision_layers_megatron", "freeze_indexer",
})
MATH_PREFIXES = ("fp8_", "fp4", "muon_")
MLA_CONFIG_KEYS = ("kv_lora_rank", "q_lora_rank")  # DeepSeek-V4 has a low-rank query and no kv_lora_rank
MOE_CONFIG_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")
ZERO_CENTERED_NORM_MODEL_TYPES = frozenset({"gemma", "gemma2", "gemma3", "gemma3_text", "qwen3_next", "qwen3_5",
                                            "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"})
"""``model_type`` of the transformers families whose RMSNorm scales by ``1 + weight`` (Megatron's
``--apply-layernorm-1p``; ``Qwen3_5RMSNorm``, ``Gemma3RMSNorm``...). Gemma 3n's and Gemma 4's scale by
``weight``."""


def effect(dest: str) -> str:
    """``"architecture"``, ``"math"`` or ``"none"``: what ignoring Megatron flag ``dest`` does."""
    row = megatron_table().by_dest().get(dest)
    if dest in MATH or dest.startswith(MATH_PREFIXES):
        return "math"
    if dest in ARCHITECTURE or dest.startswith(ARCHITECTURE_PREFIXES) or (row and row.group in ARCHITECTURE_GROUPS):
        return "architecture"
    return "none"


def report_megatron_flags(args: Namespace, backend: str, plugin: Any, report: ConfigReport) -> None:
    """Report the Megatron flags given that train backend ``backend`` does not honour.

    :param plugin: the backend's plugin object; its ``MEGATRON_FLAGS`` (a
        :class:`MegatronFlags`) says what it honours (none when absent).
    :param report: the backend's report: at most one warning and one error line, each
        listing the flags as typed.
    """
    given = list(args.megatron_flags_given)
    if not given:
        return
    support = getattr(plugin, "MEGATRON_FLAGS", None)
    if not isinstance(support, MegatronFlags):
        support = MegatronFlags()
    options = {**miles_table().by_option(), **megatron_table().by_option()}
    hf_config = _hf_config(args) if support.architecture_from_hf else None
    where = f"--hf-checkpoint {args.hf_checkpoint}/config.json"
    disagree = dict(architecture_disagreements(args, hf_architecture_values(hf_config), where)) if hf_config else {}
    ignored, wrong, absent, unchecked = [], [], [], []
    for flag in given:
        row = options.get(flag)
        dest = row.dest if row else flag.lstrip("-").replace("-", "_")
        attr = flag.lstrip("-").replace("-", "_")  # Megatron's dest may differ (--norm-epsilon: layernorm_epsilon)
        if support.honoured(dest, _value(args, dest)) or (
                attr != dest and support.honours != "all" and support.honoured(attr, _value(args, attr))):
            continue
        kind = effect(dest)
        if flag in disagree:
            report.error(disagree[flag])
        elif kind == "architecture" and support.architecture_from_hf:
            missing = _missing_feature(dest, hf_config)
            if missing:
                absent.append(f"{flag} ({missing})")
            elif hf_config is None:
                unchecked.append(flag)
            else:
                ignored.append(flag)
        elif kind == "none" or (kind == "math" and row is not None and _at_default(args, dest, row.default)):
            ignored.append(flag)
        else:
            wrong.append(flag)
    name = f"--train-backend {backend}"
    if ignored:
        report.warn(f"{name} ignores these Megatron flags, which do not change results with it: {' '.join(ignored)}.")
    if unchecked:
        report.warn(f"{name} takes the model from the --hf-checkpoint config, which cannot be read here "
                    f"({args.hf_checkpoint}); these Megatron architecture flags are not checked against it: "
                    f"{' '.join(unchecked)}.")
    if absent:
        report.error(f"these Megatron flags describe features the model of {where} does not have: "
                     f"{' '.join(absent)}; remove them.")
    if wrong:
        report.error(f"{name} does not support these Megatron flags yet, which would change the model or the math: "
                     f"{' '.join(wrong)}; remove them.")


def report_routing_replay(args: Namespace, backend: str, plugin: Any, report: ConfigReport) -> None:
    """``--use-routing-replay`` / ``--use-rollout-routing-replay`` need a train backend that replays MoE
    routing: one that honours Megatron's ``moe_enable_routing_replay`` (which Miles' flags set) in its
    ``MEGATRON_FLAGS``; any other is one error naming the flag and the backend. (Whether the model has
    experts is the backend's own check.)"""
    given = [flag for flag, on in (("--use-rollout-routing-replay", args.use_rollout_routing_replay),
                                   ("--use-routing-replay", args.use_routing_replay)) if on]
    support = getattr(plugin, "MEGATRON_FLAGS", None)
    if given and not (isinstance(support, MegatronFlags) and support.honoured("moe_enable_routing_replay", True)):
        report.error(f"{given[0]} needs a train backend that replays mixture-of-experts routing in its forward "
                     f"passes; --train-backend {backend} does not (use --train-backend megatron with an MoE "
                     "model, or remove the flag).")


def _value(args: Namespace, dest: str) -> Any:
    """The value of flag ``dest``: as given, else its parsed default; None for a Megatron-LM-only flag not given
    (the parse sets no attribute for those)."""
    if dest in args.megatron_args:
        return args.megatron_args[dest]
    return flag_value(args, dest) if has_flag(args, dest) else None


def _at_default(args: Namespace, dest: str, default: Any) -> bool:
    value = _value(args, dest)
    if isinstance(value, list) and not isinstance(default, list):  # one value per layer or type
        return all(v == default for v in value)
    return value == default


def _hf_config(args: Namespace) -> dict | None:
    path = os.path.join(args.hf_checkpoint or "", "config.json")
    try:
        with open(path, encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, ValueError):
        return None
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, dict) else config


def _missing_feature(dest: str, config: dict | None) -> str | None:
    """Why the HF ``config`` cannot carry architecture flag ``dest`` (MLA, MoE, zero-centred norm
    scales, the switches of :func:`~furlong.hooks.megatron_flags.hf_missing_switch`), or None."""
    if config is None:
        return None
    row = megatron_table().by_dest().get(dest)
    if (dest == "multi_latent_attention" or (row and row.group == "mla")) and not any(
            config.get(k) for k in MLA_CONFIG_KEYS):
        return "the model has no multi-latent attention"
    if (dest == "num_experts" or dest.startswith("moe_")) and not any(config.get(k) for k in MOE_CONFIG_KEYS):
        return "the model has no experts"
    if dest == "layernorm_zero_centered_gamma" and config.get("model_type") not in ZERO_CENTERED_NORM_MODEL_TYPES:
        return "its norms scale by weight, not 1 + weight"
    return hf_missing_switch(dest, config)
