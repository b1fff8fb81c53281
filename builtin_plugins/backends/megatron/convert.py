"""Weight conversion Hugging Face <-> megatron-core (local spec), one tensor group at a time.

Name mapping and packing (docs/megatron.md, "Weight conversion"; checked bit-exact in tests):

- ``linear_qkv`` = q/k/v packed per KV group: rows ``[q heads of group 0, k0, v0, q heads of
  group 1, k1, v1, ...]`` (weight and, for Qwen2, bias);
- ``linear_fc1`` = ``cat(gate_proj, up_proj)``, or GLM-4's ``gate_up_proj`` as it is (already the gate rows
  first); ``linear_fc2`` = ``down_proj``;
- GLM-4's post-sublayer norms keep their HF names (``post_self_attn_layernorm``, ``post_mlp_layernorm``);
- embedding and untied output layer padded with zero rows to the Megatron vocabulary;
- mixture-of-experts layers (Qwen3-MoE): ``mlp.router.weight`` = ``mlp.gate.weight``; expert ``E``'s
  ``mlp.experts.local_experts.E.linear_fc1`` = ``cat(experts.E.gate_proj, experts.E.up_proj)`` and
  ``linear_fc2`` = ``experts.E.down_proj`` (the per-expert names of the checkpoint files; transformers 5
  fuses them into ``experts.gate_up_proj`` / ``experts.down_proj`` in memory only).

Tensor parallelism (checked against megatron-core's own initialisation in
tests): column-parallel layers (embedding, qkv, fc1, output) split dim 0, row-parallel
layers (proj, fc2) split dim 1, norms, routers and experts (expert TP 1) are replicated. Rank
``r`` holds chunk ``r`` of every one of the ``stride`` parts of the full tensor along that dim
(fc1 has stride 2: rank ``r`` holds ``[gate_r; up_r]``).

Pipeline parallelism (:class:`Stage`): stage ``s`` of ``pp`` holds layers
``s * L/pp ... (s + 1) * L/pp - 1`` under local indices ``0 ... L/pp - 1`` (megatron-core's
layer offset), the embedding on stage 0, the final norm and output layer on the last; a
tied model's last stage holds a copy of the embedding as its output layer.

Expert parallelism (:class:`ExpertShard`): EP rank ``r`` of ``ep`` holds experts
``r * E/ep ... (r + 1) * E/ep - 1`` under local indices ``0 ... E/ep - 1`` (megatron-core's
``local_expert_indices``); every other parameter is on every EP rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import attrs

from furlong.hooks import PluginError

from .config import ModelShape

__all__ = ["ExpertShard", "Stage", "Unit", "export_hf", "gather_full", "load_hf", "local_shard", "pipeline_split", "placed_units",
           "stage_layer_counts", "units"]


@attrs.frozen
class Unit:
    """One Megatron parameter and the Hugging Face tensors it is made of.

    ``kind``: ``copy`` (one tensor as is), ``qkv`` (group packing), ``fc1`` (gate, up)
    or ``vocab`` (rows padded to the Megatron vocabulary). ``split``: ``(dim, stride)`` of
    its tensor-parallel split, None when replicated. ``expert``: the global index of the
    expert it belongs to, None outside the experts.
    """

    mcore: str
    hf: tuple
    kind: str = "copy"
    split: tuple | None = None
    expert: int | None = None


COLUMN, ROW, FC1 = (0, 1), (1, 1), (0, 2)


def pipeline_split(megatron_args: Mapping[str, Any]) -> tuple:
    """``(--decoder-first-pipeline-num-layers, --decoder-last-pipeline-num-layers)``, None where not given.

    :param megatron_args: the Megatron-LM-only flags given, ``{dest: value}`` (``megatron_args`` of the
        run configuration, or of the launch flags in ``configure``).
    """
    return (megatron_args.get("decoder_first_pipeline_num_layers"),
            megatron_args.get("decoder_last_pipeline_num_layers"))


def stage_layer_counts(num_layers: int, pp: int, first: int | None = None, last: int | None = None) -> tuple:
    """Decoder layers of each of ``pp`` pipeline stages, Megatron-LM's split: the first stage gets
    ``first`` (``--decoder-first-pipeline-num-layers``), the last ``last``
    (``--decoder-last-pipeline-num-layers``), the other stages share the rest equally; without
    either, every stage gets ``num_layers / pp``.

    :raises ValueError: a split that leaves a stage without layers or cannot be equal (the
        message names the flags).
    """
    for flag, n in (("--decoder-first-pipeline-num-layers", first), ("--decoder-last-pipeline-num-layers", last)):
        if n is not None and n < 1:
            raise ValueError(f"{flag} {n}: a pipeline stage needs at least 1 layer.")
    fixed = {0: first, pp - 1: last} if pp > 1 else {}
    fixed = {i: n for i, n in fixed.items() if n is not None}
    middle = pp - len(fixed)
    rest = num_layers - sum(fixed.values())
    given = " and ".join(f"--decoder-{'first' if i == 0 else 'last'}-pipeline-num-layers {n}"
                         for i, n in sorted(fixed.items()))
    if not fixed and num_layers % pp:
        raise ValueError(f"--pipeline-model-parallel-size {pp} does not divide the {num_layers} layers "
                         "(--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers give the first "
                         "and last stages other counts).")
    if middle == 0 and rest != 0:
        raise ValueError(f"--pipeline-model-parallel-size {pp} with {given} asks for {num_layers - rest} layers; "
                         f"the model has {num_layers}.")
    if middle > 0 and rest < middle:
        raise ValueError(f"--pipeline-model-parallel-size {pp} with {given} leaves {max(rest, 0)} of the "
                         f"{num_layers} layers for the other {middle} stage(s), fewer than one each.")
    if middle > 0 and rest % middle:
        raise ValueError(f"--pipeline-model-parallel-size {pp} with {given} leaves {rest} of the {num_layers} layers, "
                         f"which the other {middle} stages cannot share equally.")
    return tuple(fixed.get(i, rest // middle if middle else 0) for i in range(pp))


@attrs.frozen
class Stage:
    """This rank's pipeline stage: ``index`` of ``count`` (megatron-core's pipeline rank and size) and the
    decoder layers of every stage (:func:`stage_layer_counts`; empty: equal stages)."""

    index: int = 0
    count: int = 1
    layers: tuple = ()

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    def counts(self, num_layers: int) -> tuple:
        """Layers of every stage of a model of ``num_layers`` layers."""
        return self.layers or stage_layer_counts(num_layers, self.count)

    def offset(self, num_layers: int) -> int:
        """The global index of this stage's first layer."""
        return sum(self.counts(num_layers)[: self.index])


@attrs.frozen
class ExpertShard:
    """This rank's share of the experts: EP rank ``rank`` of ``size`` (megatron-core's expert-model-parallel
    rank and size) holds ``num_experts / size`` consecutive experts."""

    rank: int = 0
    size: int = 1

    def owner(self, expert: int, num_experts: int) -> int:
        """The EP rank holding global expert ``expert``."""
        return expert // (num_experts // self.size)

    def local(self, expert: int, num_experts: int) -> int:
        """``expert``'s index among its EP rank's experts."""
        return expert % (num_experts // self.size)


def owner(unit: Unit, shape: ModelShape, stage: Stage) -> int:
    """The pipeline stage (of ``stage``'s split) that holds ``unit``'s parameter (the first stage for the embedding)."""
    if unit.mcore.startswith("decoder.layers."):
        layer, start = int(unit.mcore.split(".")[2]), 0
        for index, n in enumerate(stage.counts(shape.num_layers)):
            start += n
            if layer < start:
                return index
    return 0 if unit.mcore.startswith("embedding.") else stage.count - 1


def placed_units(shape: ModelShape, stage: Stage, experts: ExpertShard = ExpertShard()) -> list[tuple[Unit, str]]:
    """``(unit, local parameter name)`` of every parameter ``stage`` (and this EP rank, ``experts``) holds, in
    state-dict order.

    Layers are renamed to the stage's local indices, experts to the EP rank's; a tied model's last stage
    (when it is not also the first) adds the embedding unit under ``output_layer.weight``, its copy.
    """
    offset = stage.offset(shape.num_layers)
    out = []
    for unit in units(shape):
        if owner(unit, shape, stage) != stage.index:
            continue
        if unit.expert is not None and experts.owner(unit.expert, shape.num_experts) != experts.rank:
            continue
        name = unit.mcore
        if name.startswith("decoder.layers."):
            parts = name.split(".")
            parts[2] = str(int(parts[2]) - offset)
            if unit.expert is not None:
                parts[6] = str(experts.local(unit.expert, shape.num_experts))
            name = ".".join(parts)
        out.append((unit, name))
    if shape.tied and stage.last and not stage.first:
        out.append((units(shape)[0], "output_layer.weight"))
    return out


def units(shape: ModelShape) -> list[Unit]:
    """Every Megatron parameter of ``shape`` in state-dict order, with its HF source names."""
    out = [Unit("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", COLUMN)]
    for i in range(shape.num_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        attn = f"{h}self_attn."
        out.append(Unit(m + "input_layernorm.weight", (h + "input_layernorm.weight",)))
        out.append(Unit(m + "self_attention.linear_qkv.weight",
                        tuple(f"{attn}{p}_proj.weight" for p in "qkv"), "qkv", COLUMN))
        if shape.qkv_bias:
            out.append(Unit(m + "self_attention.linear_qkv.bias", tuple(f"{attn}{p}_proj.bias" for p in "qkv"), "qkv",
                            COLUMN))
        if shape.qk_layernorm:
            out.append(Unit(m + "self_attention.q_layernorm.weight", (attn + "q_norm.weight",)))
            out.append(Unit(m + "self_attention.k_layernorm.weight", (attn + "k_norm.weight",)))
        out.append(Unit(m + "self_attention.linear_proj.weight", (attn + "o_proj.weight",), split=ROW))
        if shape.post_norms:
            out.append(Unit(m + "post_self_attn_layernorm.weight", (h + "post_self_attn_layernorm.weight",)))
        out.append(Unit(m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",)))
        if i in shape.moe_layers:
            out.extend(_expert_units(m, h, shape.num_experts))
            continue
        if shape.family == "glm4":
            out.append(Unit(m + "mlp.linear_fc1.weight", (h + "mlp.gate_up_proj.weight",), split=FC1))
        else:
            out.append(Unit(m + "mlp.linear_fc1.weight", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"),
                            "fc1", FC1))
        out.append(Unit(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), split=ROW))
        if shape.post_norms:
            out.append(Unit(m + "post_mlp_layernorm.weight", (h + "post_mlp_layernorm.weight",)))
    out.append(Unit("decoder.final_layernorm.weight", ("model.norm.weight",)))
    if not shape.tied:
        out.append(Unit("output_layer.weight", ("lm_head.weight",), "vocab", COLUMN))
    return out


def _expert_units(m: str, h: str, num_experts: int) -> list[Unit]:
    """The router and every expert's fc1/fc2 of MoE layer prefixes ``m`` (Megatron) and ``h`` (HF)."""
    out = [Unit(m + "mlp.router.weight", (h + "mlp.gate.weight",))]
    for e in range(num_experts):
        mine, theirs = f"{m}mlp.experts.local_experts.{e}.", f"{h}mlp.experts.{e}."
        out.append(Unit(mine + "linear_fc1.weight", (theirs + "gate_proj.weight", theirs + "up_proj.weight"), "fc1",
                        expert=e))
        out.append(Unit(mine + "linear_fc2.weight", (theirs + "down_proj.weight",), expert=e))
    return out


def pack(unit: Unit, tensors: list, shape: ModelShape, vocab_rows: int):
    """The full (unsharded) Megatron tensor of ``unit`` from its HF tensors, in ``unit.hf`` order."""
    import torch

    if unit.kind == "qkv":
        q, k, v = tensors
        g, d = shape.num_query_groups, shape.kv_channels
        rest = tuple(q.shape[1:])
        parts = (q.reshape(g, -1, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest))
        return torch.cat(parts, dim=1).reshape(-1, *rest)
    if unit.kind == "fc1":
        return torch.cat(tensors, dim=0)
    if unit.kind == "vocab":
        (table,) = tensors
        if table.shape[0] == vocab_rows:
            return table
        return torch.cat([table, table.new_zeros(vocab_rows - table.shape[0], *table.shape[1:])])
    (tensor,) = tensors
    return tensor


def unpack(unit: Unit, full, shape: ModelShape) -> list:
    """Inverse of :func:`pack`: the HF tensors of ``unit`` (vocabulary trimmed to the HF size)."""
    if unit.kind == "qkv":
        n, g, d = shape.num_attention_heads, shape.num_query_groups, shape.kv_channels
        rest = tuple(full.shape[1:])
        grouped = full.reshape(g, n // g + 2, d, *rest)
        return [grouped[:, : n // g].reshape(n * d, *rest), grouped[:, n // g].reshape(g * d, *rest),
                grouped[:, n // g + 1].reshape(g * d, *rest)]
    if unit.kind == "fc1":
        return list(full.chunk(2, dim=0))
    if unit.kind == "vocab":
        return [full[: shape.vocab_size]]
    return [full]


def local_shard(full, split: tuple | None, tp: int, rank: int):
    """This TP rank's piece of ``full`` (``full`` itself when replicated or TP=1).

    :param split: ``(dim, stride)`` (:attr:`Unit.split`), or None.
    """
    import torch

    if split is None or tp == 1:
        return full
    dim, stride = split
    return torch.cat([part.chunk(tp, dim=dim)[rank] for part in full.chunk(stride, dim=dim)], dim=dim)


def gather_full(local, split: tuple | None, tp: int, group):
    """Inverse of :func:`local_shard`: the full tensor from every TP rank's piece (a collective over ``group``)."""
    import torch
    import torch.distributed as dist

    local = local.detach()
    if split is None or tp == 1:
        return local
    dim, stride = split
    pieces = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(pieces, local.contiguous(), group=group)
    parts = [p.chunk(stride, dim=dim) for p in pieces]
    return torch.cat([torch.cat([parts[r][j] for r in range(tp)], dim=dim) for j in range(stride)], dim=dim)


def load_hf(model, named_tensors: Iterable[tuple[str, Any]], shape: ModelShape, vocab_rows: int, tp: int,
            rank: int, where: str, stage: Stage = Stage(), experts: ExpertShard = ExpertShard()) -> None:
    """Copy HF-named tensors into ``model``'s parameters as they stream in.

    HF tensors are held only until every tensor of their Megatron parameter has arrived
    (q/k/v of a layer, gate/up), then packed, cut to this rank's shard and copied in.
    Tensors of parameters another pipeline stage holds are passed over (HF layer
    ``i`` is this stage's local layer ``i - offset``).

    :param named_tensors: ``(hf_name, tensor)`` pairs in any order (a safetensors stream).
    :param where: the checkpoint named in errors.
    :param stage: this rank's pipeline stage (:func:`placed_units`).
    :param experts: this rank's share of the experts (:func:`placed_units`); others' experts are passed over.
    :raises PluginError: a tensor of unknown name or wrong shape, a parameter left without its
        tensors, or a model parameter the conversion table does not cover.
    """
    import torch

    params = dict(model.named_parameters())
    known = {name for unit in units(shape) for name in unit.hf}
    placed = placed_units(shape, stage, experts)
    table = {name: (unit, local) for unit, local in placed for name in unit.hf}
    unfilled = sorted(set(params) - {local for _, local in placed})
    if unfilled:  # a parameter the built model has and the conversion table lacks would keep its initial values
        raise PluginError(f"{where}: the {shape.family} Megatron model has parameters no Hugging Face tensor fills: "
                          f"{', '.join(unfilled[:4])}{' ...' if len(unfilled) > 4 else ''}.")
    pending: dict[str, dict] = {}
    done: set[str] = set()
    for name, tensor in named_tensors:
        if name not in table:
            if name in known or (name == "lm_head.weight" and shape.tied) or name.endswith("rotary_emb.inv_freq"):
                continue
            raise PluginError(f"{where}: tensor {name!r} has no place in the {shape.family} Megatron model.")
        unit, local = table[name]
        got = pending.setdefault(local, {})
        got[name] = tensor
        if len(got) < len(unit.hf):
            continue
        full = pack(unit, [got[n] for n in unit.hf], shape, vocab_rows)
        del pending[local]
        param = params[local]
        piece = local_shard(full, unit.split, tp, rank)
        if tuple(piece.shape) != tuple(param.shape):
            raise PluginError(f"{where}: {', '.join(unit.hf)} give {unit.mcore} of shape {tuple(piece.shape)} on "
                              f"TP rank {rank}, the model has {tuple(param.shape)}; config.json and weights disagree.")
        with torch.no_grad():
            param.copy_(piece)
        done.add(local)
    missing = [u.hf[0] for u, local in placed if local not in done]
    if missing:
        raise PluginError(f"{where}: no tensor for {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}.")


def export_hf(model, shape: ModelShape, tp: int, group, stage: Stage = Stage(), pp_group=None,
              experts: ExpertShard = ExpertShard(), ep_group=None, weight_of=None) -> Iterator[tuple[str, Any]]:
    """Yield ``(hf_name, full tensor)`` for every HF weight, one Megatron parameter at a time, on every rank.

    A collective over the TP ``group`` (each sharded parameter is all-gathered) and, with
    pipeline stages, over ``pp_group`` (the stage holding a parameter broadcasts it to the
    others; a tied model's output-layer copy is not sent): every rank iterates and gets
    every tensor once, in the same order at any TP or PP size. Tied models yield no
    ``lm_head.weight``. With expert parallelism (``experts.size > 1``) each expert's tensors are
    broadcast over ``ep_group`` from the EP rank holding it, on its stage, before the stages' broadcast.
    ``weight_of(local name, parameter)``, when given, is the tensor exported for a parameter (LoRA: the merged
    weight, :func:`~.lora.merged_weight`).
    """
    import torch
    import torch.distributed as dist

    params = dict(model.named_parameters())
    placed = placed_units(shape, stage, experts)
    mine = {unit.mcore: local for unit, local in placed if owner(unit, shape, stage) == stage.index}
    like = {_expert_role(unit): params[local] for unit, local in placed if unit.expert is not None}
    def key(unit: Unit):  # one expert's shape stands for every expert of its layer
        return _expert_role(unit) if unit.expert is not None else unit.mcore

    specs: dict = {}
    if stage.count > 1:  # full shape and dtype of every parameter, from the stage that holds it
        held = {}
        for unit in units(shape):
            if unit.mcore in mine:
                size = list(params[mine[unit.mcore]].shape)
                if unit.split is not None:
                    size[unit.split[0]] *= tp
                held[key(unit)] = (size, params[mine[unit.mcore]].dtype)
        every: list = [None] * stage.count
        dist.all_gather_object(every, held, group=pp_group)
        specs = {k: v for part in every for k, v in part.items()}
    for unit in units(shape):
        on_stage = owner(unit, shape, stage) == stage.index
        if unit.mcore in mine:
            local = mine[unit.mcore]
            held = params[local] if weight_of is None else weight_of(local, params[local])
            full = gather_full(held, unit.split, tp, group)
        elif unit.expert is not None and on_stage:  # another EP rank's expert: shaped as this rank's of the same layer
            full = torch.empty_like(like[_expert_role(unit)])
        else:
            size, dtype = specs[key(unit)]
            full = torch.empty(size, dtype=dtype, device=next(model.parameters()).device)
        if unit.expert is not None and experts.size > 1 and on_stage:
            full = full.contiguous()
            source = experts.owner(unit.expert, shape.num_experts)
            dist.broadcast(full, src=dist.get_global_rank(ep_group, source), group=ep_group)
        if stage.count > 1:  # (an expert: every EP rank of its stage holds it now)
            full = full.contiguous()
            dist.broadcast(full, src=dist.get_global_rank(pp_group, owner(unit, shape, stage)), group=pp_group)
        yield from zip(unit.hf, unpack(unit, full, shape))


def _expert_role(unit: Unit) -> tuple:
    """``(layer, parameter)`` of an expert unit, the same for every expert of the layer."""
    parts = unit.mcore.split(".")
    return parts[2], ".".join(parts[7:])


def safetensors_stream(hf_dir: str) -> Iterator[tuple[str, Any]]:
    """Every tensor of the ``*.safetensors`` files of a HF directory, one at a time; an FP8 checkpoint's
    linear weights dequantised to float32 (:func:`furlong.kit.fp8_io.dequantized_tensors`), its scales
    left out.

    :raises PluginError: the directory has no safetensors file.
    """
    import glob
    import os

    from safetensors import safe_open

    from furlong.kit.fp8 import fp8_quantization_config
    from furlong.kit.fp8_io import dequantized_tensors

    files = sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))
    if not files:
        raise PluginError(f"{hf_dir}: no *.safetensors weights; the megatron backend reads safetensors.")
    if fp8_quantization_config(hf_dir) is not None:
        yield from dequantized_tensors(hf_dir)
        return
    for file in files:
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)
