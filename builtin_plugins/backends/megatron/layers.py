"""SwiGLU and RMSNorm modules for megatron-core's local layer spec, with Triton kernels on GPU.

megatron-core's compiled SwiGLU writes its backward as one concatenation of the two halves'
gradients, a kernel that reads the input about twice; torch's RMSNorm sums the scale's
gradient in a separate kernel over ``grad * x_hat``. Here each direction is one kernel that
reads its inputs once (:mod:`._triton`; the RMSNorm backward then adds its per-program partial
sums of the scale's gradient with one small torch sum). Where Triton or a GPU is missing (CPU, tests) the
modules compute exactly what megatron-core's local spec computes: ``F.silu(a) * b`` and
``torch.nn.RMSNorm``.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["FusedRMSNorm", "FusedSwiGLU", "post_norm_layer", "triton_ready"]


@functools.cache
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_ready(tensor: torch.Tensor) -> bool:
    """Whether :mod:`._triton`'s kernels run on ``tensor``: a CUDA tensor and Triton installed."""
    return tensor.is_cuda and _triton_importable()


class _SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        from . import _triton

        shape = x.shape
        x = x.reshape(-1, shape[-1]).contiguous()
        ctx.save_for_backward(x)
        ctx.shape = shape
        return _triton.swiglu_forward(x).view(*shape[:-1], shape[-1] // 2)

    @staticmethod
    def backward(ctx, grad):
        from . import _triton

        (x,) = ctx.saved_tensors
        grad = grad.reshape(x.shape[0], x.shape[1] // 2).contiguous()
        return _triton.swiglu_backward(x, grad).view(ctx.shape)


class FusedSwiGLU(torch.nn.Module):
    """The gated activation of megatron-core's MLP (``config.use_te_activation_func`` with this
    module as ``MLPSubmodules.activation_func``): ``silu(a) * b`` of fc1's output ``[..., 2 f]``
    (``a`` its first half, the gate; ``b`` the second) into ``[..., f]``, in the input's dtype.

    Reference: Shazeer 2020, GLU Variants Improve Transformer (SwiGLU).
    """

    def __init__(self, config: Any = None, **_: Any):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if triton_ready(x):
            return _SwiGLUFunction.apply(x)
        gate, up = torch.chunk(x, 2, dim=-1)
        return F.silu(gate) * up

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """Nothing to checkpoint (megatron-core 0.16's MLP asks every child for its sharded state)."""
        return {}


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        from . import _triton

        shape = x.shape
        x = x.reshape(-1, shape[-1]).contiguous()
        out, rstd = _triton.rms_norm_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return out.view(shape)

    @staticmethod
    def backward(ctx, grad):
        from . import _triton

        x, weight, rstd = ctx.saved_tensors
        dx, dweight = _triton.rms_norm_backward(x, weight, rstd, grad.reshape(x.shape).contiguous())
        return dx.view(grad.shape), dweight, None


class FusedRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` over the last dimension (same ``weight`` parameter, same state dict):
    ``y = x / sqrt(mean(x^2) + eps) * weight`` in x's dtype. On GPU (Triton) the forward is one kernel
    and the backward one kernel that also sums the scale's gradient in float32 partial sums, which one
    torch sum adds up; both compute in float32 and round once. Elsewhere it is ``torch.nn.RMSNorm``.
    The scale's gradient is summed over all rows of this rank's input (under sequence parallelism the
    backend sums it over the TP group).

    Built from megatron-core's norm arguments ``(config, hidden_size, eps)``.

    :raises ValueError: a ``config.normalization`` other than RMSNorm (every supported family uses it).

    Reference: Zhang & Sennrich 2019, Root Mean Square Layer Normalization.
    """

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any):
        if config.normalization != "RMSNorm":
            raise ValueError(f"FusedRMSNorm: normalization {config.normalization!r}; only RMSNorm is built here.")
        super().__init__(hidden_size, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if triton_ready(x):
            return _RMSNormFunction.apply(x, self.weight, self.eps)
        return super().forward(x)


@functools.cache
def post_norm_layer():
    """The ``PostNormTransformerLayer`` class below (defined on first use, when megatron-core is imported)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    class PostNormTransformerLayer(TransformerLayer):
        """megatron-core's ``TransformerLayer`` with an RMSNorm on each sublayer's output before its
        residual add (GLM-4's ``post_self_attn_layernorm`` and ``post_mlp_layernorm``):
        ``h = x + N_a(attn(N_1(x)))``, ``out = h + N_m(mlp(N_2(h)))``, transformers' ``Glm4DecoderLayer``.

        The two norms are this layer's children ``post_self_attn_layernorm`` and ``post_mlp_layernorm``
        (:class:`FusedRMSNorm` of ``hidden_size``); they act through the layer's bias-dropout-add steps
        (``self_attn_bda`` / ``mlp_bda``, whose input is the sublayer's ``(output, bias)``), so megatron-core's
        forward, recompute and pipeline paths stay its own. The sublayers must have no output bias
        (``add_bias_linear`` False, as every family here).
        """

        def __init__(self, config, submodules, *args, **kwargs):
            super().__init__(config, submodules, *args, **kwargs)
            if config.add_bias_linear:
                raise ValueError("PostNormTransformerLayer: the sublayers must have no output bias "
                                 "(add_bias_linear=False).")
            eps = config.layernorm_epsilon
            self.post_self_attn_layernorm = FusedRMSNorm(config, config.hidden_size, eps=eps)
            self.post_mlp_layernorm = FusedRMSNorm(config, config.hidden_size, eps=eps)
            self.self_attn_bda = _normed_add(self, self.self_attn_bda, "post_self_attn_layernorm")
            self.mlp_bda = _normed_add(self, self.mlp_bda, "post_mlp_layernorm")

    return PostNormTransformerLayer


def _normed_add(layer, bda, norm: str):
    """A bias-dropout-add builder like ``bda`` whose sublayer output first goes through ``layer``'s child
    ``norm`` (looked up at each call, so moves and dtype casts of the layer apply)."""
    def build(training, fused):
        add = bda(training, fused)

        def apply(output_with_bias, residual, prob):
            output, bias = output_with_bias
            return add((getattr(layer, norm)(output), bias), residual, prob)

        return apply

    return build

