"""Mixture-of-experts settings of the megatron backend: Megatron's MoE flags checked against the HF config
and turned into megatron-core ``TransformerConfig`` fields (router, load-balancing loss, dispatcher, experts)."""

from __future__ import annotations

from typing import Any

from .config import ModelShape

__all__ = ["BALANCING_TYPES", "moe_flag_problems", "moe_layer_pattern", "moe_transformer_fields", "replays_routing",
           "router_gemm_without_te"]

BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")

# Megatron flags (dest) that only a model with experts can carry
MOE_DESTS = frozenset({
    "num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_router_score_function", "moe_router_pre_softmax",
    "moe_layer_freq", "moe_router_topk_scaling_factor", "moe_router_dtype", "moe_router_load_balancing_type",
    "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_bias_update_rate", "moe_router_enable_expert_bias",
    "moe_shared_expert_intermediate_size", "moe_router_num_groups", "moe_router_group_topk",
    "expert_model_parallel_size", "expert_tensor_parallel_size",
})


def flag(args: Any, dest: str, default: Any = None) -> Any:
    """The value of Megatron flag ``dest`` on launch flags or a run configuration: as given
    (``megatron_args``), else the attribute furlong's parser defines, else ``default``."""
    given = getattr(args, "megatron_args", None) or {}
    if dest in given:
        return given[dest]
    value = getattr(args, dest, None)
    return default if value is None else value


def _as_list(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def balancing(args: Any) -> tuple[list[str], list[float]]:
    """``(--moe-router-load-balancing-type, --moe-aux-loss-coeff)`` as equal-length lists (Megatron's defaults:
    ``aux_loss``, 0); a type whose coefficient is 0 adds nothing."""
    types = [str(t) for t in _as_list(flag(args, "moe_router_load_balancing_type", "aux_loss"))]
    coeffs = [float(c) for c in _as_list(flag(args, "moe_aux_loss_coeff", 0.0))]
    if len(coeffs) == 1 and len(types) > 1:
        coeffs = coeffs * len(types)
    return types, coeffs


def moe_layer_pattern(value: Any, num_layers: int) -> list[int] | None:
    """Megatron's ``--moe-layer-freq`` as one 0/1 per layer (1: experts): an int ``N`` puts experts on every
    ``N``-th layer from the first; a list, or a Python list expression such as ``"([1]*47+[0])"`` (Megatron
    evaluates it), gives them layer by layer. None when it cannot be read."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip().strip("'\"")
        try:
            value = int(text) if text.isdigit() else eval(text, {"__builtins__": {}}, {})  # noqa: S307 (Megatron's syntax)
        except Exception:  # noqa: BLE001 (any malformed expression)
            return None
    if isinstance(value, int):
        return [1 if i % value == 0 else 0 for i in range(num_layers)] if value > 0 else None
    if isinstance(value, (list, tuple)) and all(v in (0, 1) for v in value):
        return [int(v) for v in value]
    return None


def moe_flag_problems(args: Any, shape: ModelShape, where: str) -> tuple[list[str], list[str]]:
    """``(errors, warnings)`` of Megatron's MoE and expert-parallel flags given for the model of ``shape``.

    On a dense model any of them (an expert-parallel size above 1) is an error. On a Qwen3-MoE model the
    valued flags must equal config.json (``--num-experts`` = ``num_experts``, ``--moe-router-topk`` =
    ``num_experts_per_tok``, ``--moe-ffn-hidden-size`` = ``moe_intermediate_size``, ``--moe-layer-freq`` =
    the layers ``mlp_only_layers``/``decoder_sparse_step`` give experts), the router must be the model's
    (softmax scores; ``--moe-router-pre-softmax`` exactly when ``norm_topk_prob`` is false; no top-k
    scaling, group-limited routing, expert bias or shared experts), and the load-balancing types must be
    among :data:`BALANCING_TYPES`.
    """
    given = set(getattr(args, "megatron_args", None) or {}) | {
        d for d in ("num_experts", "moe_router_topk", "moe_ffn_hidden_size") if getattr(args, d, None) is not None}
    ep, etp = int(flag(args, "expert_model_parallel_size", 1)), flag(args, "expert_tensor_parallel_size")
    if ep > 1:
        given.add("expert_model_parallel_size")
    if etp is not None and int(etp) > 1:
        given.add("expert_tensor_parallel_size")
    elif etp is not None:  # one rank changes nothing: Miles' dense scripts give --expert-tensor-parallel-size 1
        given.discard("expert_tensor_parallel_size")
    errors: list[str] = []
    if etp is not None and int(etp) != 1 and shape.is_moe:
        errors.append(f"--expert-tensor-parallel-size {etp} is not supported yet by --train-backend megatron "
                      "(experts are whole on their expert-parallel rank); give 1.")
    if not shape.is_moe and replays_routing(args):
        errors.append(f"{replays_routing(args)} replays mixture-of-experts routing, but the model of {where} has no "
                      "experts; remove it.")
    if not shape.is_moe:
        moe_flags = sorted("--" + d.replace("_", "-") for d in given & MOE_DESTS - {"expert_model_parallel_size"})
        if moe_flags:
            errors.append(f"these Megatron flags describe features the model of {where} does not have: "
                          f"{' '.join(f'{f} (the model has no experts)' for f in moe_flags)}; remove them.")
        return errors, []
    warnings: list[str] = []
    for dest, hf_key, value in (("num_experts", "num_experts", shape.num_experts),
                                ("moe_router_topk", "num_experts_per_tok", shape.moe_topk),
                                ("moe_ffn_hidden_size", "moe_intermediate_size", shape.moe_ffn_hidden_size)):
        got = flag(args, dest)
        if got is not None and int(got) != value:
            errors.append(f"--{dest.replace('_', '-')} {got} disagrees with {where} ({hf_key} = {value}).")
    if "moe_layer_freq" in given:
        pattern = moe_layer_pattern(flag(args, "moe_layer_freq"), shape.num_layers)
        expected = [1 if i in shape.moe_layers else 0 for i in range(shape.num_layers)]
        if pattern != expected:
            errors.append(f"--moe-layer-freq {flag(args, 'moe_layer_freq')} disagrees with {where} (experts on "
                          f"layers {list(shape.moe_layers)}, from mlp_only_layers and decoder_sparse_step).")
    score = flag(args, "moe_router_score_function", "softmax")
    if score != "softmax":
        errors.append(f"--moe-router-score-function {score} disagrees with {where} ({shape.family} routes by softmax).")
    if "moe_router_pre_softmax" in given and bool(flag(args, "moe_router_pre_softmax")) == shape.norm_topk_prob:
        errors.append(f"--moe-router-pre-softmax is given but {where} says norm_topk_prob = true (the top-k "
                      "probabilities are renormalised, which is Megatron's softmax after top-k).")
    for dest, ok in (("moe_router_topk_scaling_factor", (None, 1, 1.0)), ("moe_router_num_groups", (None,)),
                     ("moe_router_group_topk", (None,)), ("moe_router_enable_expert_bias", (None, False)),
                     ("moe_shared_expert_intermediate_size", (None,))):
        if dest in given and flag(args, dest) not in ok:
            errors.append(f"--{dest.replace('_', '-')} {flag(args, dest)} disagrees with {where} ({shape.family} has "
                          "no such router feature).")
    dtype = flag(args, "moe_router_dtype")
    if dtype not in (None, "fp32", "fp64"):
        errors.append(f"--moe-router-dtype {dtype}: choose fp32 or fp64 (or leave it out: the hidden dtype).")
    types, coeffs = balancing(args)
    unknown = [t for t in types if t not in BALANCING_TYPES]
    if unknown:
        errors.append(f"--moe-router-load-balancing-type {' '.join(unknown)} is not supported yet by --train-backend "
                      f"megatron (supported: {', '.join(BALANCING_TYPES)}).")
    if len(coeffs) != len(types):
        errors.append(f"--moe-aux-loss-coeff gives {len(coeffs)} values for {len(types)} "
                      "--moe-router-load-balancing-type values; give one, or one per type.")
    if replays_routing(args) and flag(args, "recompute_granularity"):
        errors.append("--use-routing-replay with --recompute-granularity is not supported yet by --train-backend "
                      "megatron (the recomputed routers would route by their own scores); leave one of them out.")
    tp = int(getattr(args, "tensor_model_parallel_size", None) or 1)
    if tp > 1 and etp is None and getattr(args, "sequence_parallel", False):  # (without it TP is refused)
        warnings.append(f"--expert-tensor-parallel-size is not given: Megatron-LM would split every expert over the "
                        f"{tp} TP ranks; here each TP rank holds whole experts (expert TP 1: the same updates, more "
                        "memory per rank). Give --expert-tensor-parallel-size 1 to say so.")
    if flag(args, "moe_token_dispatcher_type", "alltoall") == "flex":
        warnings.append("--moe-token-dispatcher-type flex is run as alltoall (the flex dispatcher needs DeepEP, which "
                        "this backend does not use; both send the same tokens to the same experts).")
    if "moe_router_bias_update_rate" in given:
        warnings.append("--moe-router-bias-update-rate changes nothing here: the model of "
                        f"{where} has no expert bias.")
    return errors, warnings


def moe_transformer_fields(shape: ModelShape, args: Any) -> dict:
    """megatron-core ``TransformerConfig`` fields of the experts of ``shape`` (none for a dense model).

    Routing equals transformers' ``Qwen3MoeTopKRouter``: softmax scores, top-k; with ``norm_topk_prob``
    the top-k probabilities sum to 1, which is Megatron's softmax over the top-k logits
    (``moe_router_pre_softmax=False``), without it the probabilities of the softmax over all experts
    (``moe_router_pre_softmax=True``). Experts are megatron-core's ``SequentialMLP`` (per-expert GEMMs);
    the token dispatcher is megatron-core's all-to-all (``--moe-token-dispatcher-type allgather`` is run as it by
    the core, ``flex`` with a warning; on a CPU through :func:`~.model.cpu_shims`): every dispatcher gives the same
    tokens to the same experts.
    """
    if not shape.is_moe:
        return {}
    types, coeffs = balancing(args)
    active = [(t, c) for t, c in zip(types, coeffs) if t != "none" and c]
    etp = flag(args, "expert_tensor_parallel_size")
    return dict(
        num_moe_experts=shape.num_experts, moe_ffn_hidden_size=shape.moe_ffn_hidden_size,
        moe_router_topk=shape.moe_topk, moe_router_pre_softmax=not shape.norm_topk_prob,
        moe_router_score_function="softmax",
        moe_layer_freq=[1 if i in shape.moe_layers else 0 for i in range(shape.num_layers)],
        moe_router_load_balancing_type=(active[0][0] if len(active) == 1 else [t for t, _ in active]) if active
        else "none",
        moe_aux_loss_coeff=(active[0][1] if len(active) == 1 else [c for _, c in active]) if active else 0.0,
        moe_z_loss_coeff=flag(args, "moe_z_loss_coeff"),
        moe_router_dtype=flag(args, "moe_router_dtype"),
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        expert_model_parallel_size=int(flag(args, "expert_model_parallel_size", 1)),
        expert_tensor_parallel_size=int(etp) if etp is not None else 1,
        moe_enable_routing_replay=bool(replays_routing(args)),
    )


def replays_routing(args: Any) -> str | None:
    """The routing-replay flag given (``--use-rollout-routing-replay``, ``--use-routing-replay``, or Megatron's
    ``--moe-enable-routing-replay``), or None."""
    if getattr(args, "use_rollout_routing_replay", False):
        return "--use-rollout-routing-replay"
    if getattr(args, "use_routing_replay", False):
        return "--use-routing-replay"
    return "--moe-enable-routing-replay" if flag(args, "moe_enable_routing_replay", False) else None


def router_gemm_without_te() -> None:
    """Let megatron-core 0.16's router gating run without TransformerEngine: its ``RouterGatingLinearFunction``
    tests ``te_general_gemm is not None`` before its torch ``mm`` path, but ``moe_utils`` defines that name only
    when TransformerEngine imports (a ``NameError`` otherwise). Defines it as None there when it is missing."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
