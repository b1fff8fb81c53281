"""The fine-grained FP8 weight format of Hugging Face checkpoints, and its arithmetic.

The format is the one transformers reads as ``FineGrainedFP8Config`` (``quant_method: "fp8"`` in
``config.json``'s ``quantization_config``) and SGLang serves as ``fp8`` with block quantisation
(Qwen3-4B-FP8, DeepSeek-V3 and the like): each quantised ``nn.Linear`` stores

* ``<module>.weight``: ``float8_e4m3fn`` ``[N, K]``, and
* ``<module>.weight_scale_inv``: ``float32`` ``[N / 128, K / 128]``, one scale per 128 x 128 block;
  the real weight is ``weight.float() * weight_scale_inv`` over each block.

Embeddings, ``lm_head``, norms and anything that is not a plain linear layer stay in the
checkpoint's own dtype. Activations are quantised at run time ("dynamic"), per token and per
group of 128 input features, each group with its own scale.

The rounding is transformers' ``Fp8Quantize`` (``integrations/finegrained_fp8.py``): per block
``scale = 448 / amax`` (1 for an all-zero block), ``weight_scale_inv = 1 / scale`` in float32,
``q = clamp(w * scale, -448, 448)`` cast to e4m3 (round to nearest even). The quantiser, the
engine's load of a BF16 weight sync and the tests share :func:`quantize_blocks`, so they agree to
the bit.
"""

from __future__ import annotations

import json
import os
from typing import Any

from furlong.hooks.errors import PluginError

__all__ = ["BLOCK", "FP8_MAX", "GROUP", "SCALE_SUFFIX", "dequantize_blocks", "fp8_linear_reference",
           "fp8_quantization_config", "quantization_config_for", "quantize_activation_groups", "quantize_blocks",
           "supported_config_problem"]

FP8_MAX = 448.0
"""Largest finite ``float8_e4m3fn`` value (``torch.finfo(torch.float8_e4m3fn).max``)."""

BLOCK = (128, 128)
"""Weight block ``(rows, columns)`` of one ``weight_scale_inv`` entry (``weight_block_size``)."""

GROUP = 128
"""Input features per activation scale (per-token groups of 1 x 128)."""

SCALE_SUFFIX = "weight_scale_inv"

ACTIVATION_EPS = 1e-10
"""Smallest activation group amax used for its scale, so an all-zero group divides by no zero."""


def quantize_blocks(weight: Any, block: tuple[int, int] = BLOCK) -> tuple[Any, Any]:
    """Quantise a weight matrix into e4m3 blocks with one float32 inverse scale per block.

    :param weight: ``[N, K]`` floating tensor (any float dtype, any device); ``N`` and ``K``
        multiples of ``block``.
    :returns: ``(q, scale_inv)``: ``q`` ``float8_e4m3fn`` ``[N, K]`` on the same device,
        ``scale_inv`` ``float32`` ``[N / block[0], K / block[1]]``; ``weight ~= q * scale_inv``
        blockwise (:func:`dequantize_blocks`).
    :raises ValueError: ``weight`` is not 2-D or its shape is not a multiple of ``block``.

    Formula: transformers' ``Fp8Quantize._quantize_one`` (see the module docstring).
    """
    import torch

    if weight.dim() != 2:
        raise ValueError(f"FP8 block quantisation takes a 2-D weight, got shape {tuple(weight.shape)}.")
    rows, cols = weight.shape
    bm, bn = block
    if rows % bm or cols % bn:
        raise ValueError(f"weight shape {tuple(weight.shape)} is not a multiple of the {bm} x {bn} FP8 block.")
    tiles = weight.to(torch.float32).reshape(rows // bm, bm, cols // bn, bn)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = FP8_MAX / torch.where(amax > 0, amax, torch.ones_like(amax))
    scale = torch.where(amax > 0, scale, torch.ones_like(scale))
    scale_inv = (1.0 / scale).to(torch.float32)
    q = torch.clamp(tiles * scale[:, None, :, None], min=-FP8_MAX, max=FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(rows, cols), scale_inv


def dequantize_blocks(q: Any, scale_inv: Any, dtype: Any = None) -> Any:
    """The real weight of e4m3 blocks: ``q.float() * scale_inv`` over each block, cast to ``dtype``.

    :param q: ``float8_e4m3fn`` ``[N, K]``.
    :param scale_inv: ``float32`` ``[ceil(N / bm), ceil(K / bn)]``; the block shape is
        ``N / rows`` x ``K / cols`` of it (ceil division: a last partial block uses its scale).
    :param dtype: result dtype (default float32).
    :returns: ``[N, K]`` tensor of ``dtype`` on ``q``'s device. The product is taken in float32
        and rounded once, as transformers' ``Fp8Dequantize`` does.
    :raises ValueError: the scale grid does not fit the weight.
    """
    import torch

    rows, cols = q.shape
    srows, scols = scale_inv.shape
    bm, bn = -(-rows // srows), -(-cols // scols)
    if -(-rows // bm) != srows or -(-cols // bn) != scols:
        raise ValueError(f"FP8 scale grid {tuple(scale_inv.shape)} does not fit weight shape {tuple(q.shape)}.")
    scale = scale_inv.to(torch.float32).repeat_interleave(bm, 0)[:rows].repeat_interleave(bn, 1)[:, :cols]
    return (q.to(torch.float32) * scale).to(dtype or torch.float32)


def quantize_activation_groups(x: Any, group: int = GROUP) -> tuple[Any, Any]:
    """Dynamic activation quantisation: e4m3 values and one float32 scale per token and group of
    ``group`` features (the "1 x 128" scaling of DeepSeek-V3's recipe, as SGLang's
    ``per_token_group_quant_fp8`` and transformers' Triton ``act_quant`` do it).

    :param x: ``[M, K]`` floating tensor, ``K`` a multiple of ``group``.
    :returns: ``(q, scale)``: ``q`` ``float8_e4m3fn`` ``[M, K]``, ``scale`` ``float32``
        ``[M, K / group]`` with ``x ~= q * scale`` per group; ``scale = max(amax, 1e-10) / 448``.
    :raises ValueError: ``K`` is not a multiple of ``group``.
    """
    import torch

    rows, cols = x.shape
    if cols % group:
        raise ValueError(f"activation width {cols} is not a multiple of the FP8 group of {group}.")
    groups = x.to(torch.float32).reshape(rows, cols // group, group)
    scale = groups.abs().amax(dim=-1).clamp(min=ACTIVATION_EPS) / FP8_MAX
    q = torch.clamp(groups / scale[..., None], min=-FP8_MAX, max=FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(rows, cols), scale


def fp8_linear_reference(xq: Any, x_scale: Any, wq: Any, w_scale_inv: Any, block: tuple[int, int] = BLOCK) -> Any:
    """What a block-scaled FP8 matrix product computes, in float32 on any device: for each group
    ``g`` of ``block[1]`` input features, ``(xq_g @ wq_g.T) * x_scale[:, g] * w_scale_inv[n // bm, g]``,
    summed over ``g``. The GPU kernels (:mod:`furlong.builtin_plugins.engines.embedded.fp8_kernels`)
    are checked against it.

    :param xq: ``float8_e4m3fn`` ``[M, K]``; ``x_scale`` ``float32`` ``[M, K / bn]``.
    :param wq: ``float8_e4m3fn`` ``[N, K]``; ``w_scale_inv`` ``float32`` ``[N / bm, K / bn]``.
    :returns: ``float32`` ``[M, N]``.
    """
    import torch

    bm, bn = block
    m, k = xq.shape
    n = wq.shape[0]
    x = xq.to(torch.float32).reshape(m, k // bn, bn)
    w = wq.to(torch.float32).reshape(n, k // bn, bn)
    partial = torch.einsum("mgk,ngk->gmn", x, w)  # one product per group of features
    ws = w_scale_inv.to(torch.float32).repeat_interleave(bm, 0)[:n]  # [N, K / bn]
    return (partial * x_scale.t()[:, :, None] * ws.t()[:, None, :]).sum(0)


def fp8_quantization_config(path: str | None) -> dict | None:
    """The ``quantization_config`` of the Hugging Face directory ``path`` when it is a fine-grained
    FP8 checkpoint (``quant_method`` "fp8"), else None (no such directory, no config.json, another
    or no quantisation). An unreadable config.json is None too: the loaders report it."""
    if not path:
        return None
    try:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    if isinstance(quant, dict) and str(quant.get("quant_method", "")).lower() == "fp8":
        return quant
    return None


def supported_config_problem(quant: dict, where: str) -> str | None:
    """Why furlong cannot run the FP8 checkpoint described by ``quant``, or None when it can:
    128 x 128 weight blocks, dynamic activation scales, float32 scales."""
    block = quant.get("weight_block_size")
    if block is None or [int(b) for b in block] != list(BLOCK):
        return (f"{where}: FP8 weight_block_size {block} is not supported yet (furlong runs 128 x 128 blocks, "
                "the format of Qwen3-*-FP8 and DeepSeek-V3; per-tensor FP8 needs another kernel).")
    if str(quant.get("activation_scheme", "dynamic")).lower() != "dynamic":
        return f"{where}: FP8 activation_scheme {quant.get('activation_scheme')!r} is not supported yet (only dynamic)."
    if str(quant.get("scale_fmt", "float")) != "float":
        return f"{where}: FP8 scale_fmt {quant.get('scale_fmt')!r} is not supported yet (only float32 scales)."
    return None


def quantization_config_for(not_converted: list[str]) -> dict:
    """The ``quantization_config`` the quantiser writes into config.json (the keys transformers'
    ``FineGrainedFP8Config`` and SGLang's ``Fp8Config`` read; ``fmt`` as Qwen's FP8 releases write it)."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": list(BLOCK), "modules_to_not_convert": list(not_converted)}


def require_supported(path: str, flag: str) -> dict:
    """The FP8 ``quantization_config`` of ``path``, checked.

    :raises PluginError: ``path`` is not an FP8 checkpoint, or one furlong cannot run
        (:func:`supported_config_problem`).
    """
    quant = fp8_quantization_config(path)
    if quant is None:
        raise PluginError(f"{flag} {path}: not a fine-grained FP8 checkpoint (no quantization_config with "
                          "quant_method fp8 in config.json).")
    problem = supported_config_problem(quant, f"{flag} {path}")
    if problem:
        raise PluginError(problem)
    return quant
