"""How a train backend says which Megatron-LM flags it honours.

``furlong train`` accepts every flag of Megatron-LM's parser (the table in
``core/config/data/megatron_args.json``) and hands the given ones to the train backend:
as attributes of ``args`` (Megatron's own names and defaults) and as the dict
``args.megatron_args`` (``{dest: value}`` of the given ones only). Before any model loads,
the core compares the given flags with what the chosen backend declares and reports, in
the backend's name, one warning line listing the flags it ignores that do not change
results (fusions, kernels, overlap, logging...) and one error line listing those that
would change the model or the math (fp8, MoE or MLA on a model without them...).

A train backend plugin declares its support with a module-level (plugin object)
attribute ``MEGATRON_FLAGS`` holding a :class:`MegatronFlags`; a backend without it
honours none::

    # furlong_megatron/__init__.py (the plugin object registered under "megatron")
    from furlong.hooks import MegatronFlags

    MEGATRON_FLAGS = MegatronFlags(honours="all", except_=frozenset({"fp4"}))
"""

from __future__ import annotations

from typing import Literal

import attrs

__all__ = ["ARCHITECTURE_VALUES", "MegatronFlags", "architecture_disagreements", "hf_architecture_values",
           "hf_missing_switch"]


@attrs.frozen
class MegatronFlags:
    """The Megatron-LM flags a train backend honours.

    ``honours``: the flag attributes (``dest``, e.g. ``"moe_router_topk"``) the backend
    reads and acts on, or ``"all"``. ``except_``: attributes taken out of ``"all"``.
    ``at_values``: ``{dest: values}`` of flags the backend honours at those values only
    (fsdp trains without dropout: ``{"attention_dropout": (0.0,)}``).
    ``architecture_from_hf``: the backend builds the model from the ``--hf-checkpoint``
    config, so flags that describe the architecture (layer counts, MoE, MLA, rotary...)
    are not read but are checked against that config where it can be read: a feature the
    config lacks (``--num-experts`` on a dense model, ``--multi-latent-attention`` on a
    model without MLA, a switch :func:`hf_missing_switch` rules out) is an error, and so is
    a valued flag that disagrees with it (:func:`architecture_disagreements`); others are
    listed in the warning.
    """

    honours: frozenset[str] | Literal["all"] = frozenset()
    except_: frozenset[str] = frozenset()
    at_values: dict[str, tuple] = attrs.field(factory=dict)
    architecture_from_hf: bool = False

    def honoured(self, dest: str, value=None) -> bool:
        """Does the backend act on the Megatron flag attribute ``dest`` (given as ``value``)?"""
        if dest in self.except_:
            return False
        if dest in self.at_values:
            return value in self.at_values[dest]
        return self.honours == "all" or dest in self.honours


# Miles' valued architecture flags (MODEL_ARGS): (flag, args attribute, key of the HF config.json)
ARCHITECTURE_VALUES: tuple[tuple[str, str, str], ...] = (
    ("--num-layers", "num_layers", "num_hidden_layers"),
    ("--hidden-size", "hidden_size", "hidden_size"),
    ("--ffn-hidden-size", "ffn_hidden_size", "intermediate_size"),
    ("--num-attention-heads", "num_attention_heads", "num_attention_heads"),
    ("--num-query-groups", "num_query_groups", "num_key_value_heads"),
    ("--kv-channels", "kv_channels", "head_dim"),
    ("--rotary-base", "rotary_base", "rope_theta"),
    ("--norm-epsilon", "norm_epsilon", "rms_norm_eps"),
    ("--vocab-size", "vocab_size", "vocab_size"),
)


def hf_architecture_values(config: dict) -> dict:
    """``{config.json key: value}`` for the keys of :data:`ARCHITECTURE_VALUES` that ``config``
    (a parsed config.json, ``text_config`` merged) states or implies: ``num_key_value_heads``
    defaults to the head count, ``head_dim`` to hidden_size / heads, ``rope_theta`` may sit in
    ``rope_parameters`` (transformers 5) or ``rope_scaling``."""
    out = {key: config[key] for _, _, key in ARCHITECTURE_VALUES if config.get(key) is not None}
    heads = config.get("num_attention_heads")
    if heads and "num_key_value_heads" not in out:
        out["num_key_value_heads"] = heads
    if heads and config.get("hidden_size") and "head_dim" not in out:
        out["head_dim"] = config["hidden_size"] // heads
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if "rope_theta" not in out and isinstance(rope, dict) and rope.get("rope_theta") is not None:
        out["rope_theta"] = rope["rope_theta"]
    return out


def architecture_disagreements(args, hf_values: dict, where: str) -> list[tuple[str, str]]:
    """``(flag, message)`` for each valued architecture flag given (not None on ``args``) that
    differs from ``hf_values`` (:func:`hf_architecture_values`); the message names both values
    and ``where`` (the config file). Keys ``hf_values`` lacks are not checked."""
    out = []
    for flag, attr, key in ARCHITECTURE_VALUES:
        given = getattr(args, attr, None)
        if given is None or hf_values.get(key) is None:
            continue
        if float(given) != float(hf_values[key]):
            out.append((flag, f"{flag} {given} disagrees with {where} ({key} = {hf_values[key]})."))
    return out


# model_type of transformers families known to have no per-head query/key norm
_NO_QK_NORM_MODEL_TYPES = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "gemma", "gemma2"})


def hf_missing_switch(attr: str, config: dict) -> str | None:
    """Why ``config`` (a parsed config.json, ``text_config`` merged) says the model lacks the feature
    of Miles' architecture switch ``attr`` (``qk_layernorm``, ``add_qkv_bias``,
    ``untie_embeddings_and_output_weights``, ``group_query_attention``), or None when it has it, the
    config does not say, or ``attr`` is another flag. Only explicit statements count: a key that
    is absent, or a ``model_type`` not known here, never makes a switch wrong."""
    if attr == "qk_layernorm" and config.get("model_type") in _NO_QK_NORM_MODEL_TYPES and not any(
            config.get(key) for key in ("use_qk_norm", "qk_layernorm", "qk_norm")):
        return f"model_type {config['model_type']} has no query/key norms"
    if attr == "add_qkv_bias" and config.get("attention_bias") is False:
        return "attention_bias is false"
    if attr == "untie_embeddings_and_output_weights" and config.get("tie_word_embeddings") is True:
        return "tie_word_embeddings is true"
    heads, groups = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if attr == "group_query_attention" and heads and groups == heads:
        return f"num_key_value_heads = num_attention_heads = {heads}"
    return None
