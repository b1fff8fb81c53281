"""FP8 linear layers of the embedded engine, for fine-grained FP8 checkpoints (:mod:`furlong.kit.fp8`).

:func:`install_fp8_layers` replaces each linear layer that the checkpoint quantised with an
:class:`Fp8Linear` holding the checkpoint's e4m3 blocks and ``weight_scale_inv`` under the same
``state_dict`` names. On CUDA it runs the block-scaled FP8 product (:mod:`.fp8_kernels`) with
activation scales computed per token and group of 128 features at each call; on a CPU it runs
the dequantised weight in the compute dtype (dequantised once at load and at each weight sync).
A weight sync sends the trainer's BF16 (or float32) weights: :meth:`Fp8Linear.load_dense`
quantises them into the same blocks with the same rounding as ``furlong quantize-fp8``.
"""

from __future__ import annotations

from typing import Any

import torch

from furlong.kit.fp8 import BLOCK, SCALE_SUFFIX, dequantize_blocks, quantize_blocks

from .fp8_kernels import choose_gemm, fp8_matmul, quantize_activations, weight_scales_for_scaled_mm

__all__ = ["Fp8Linear", "fp8_layers", "install_fp8_layers"]


class Fp8Linear(torch.nn.Module):
    """A linear layer with e4m3 weight blocks (see the module docstring).

    :param q: ``float8_e4m3fn`` ``[N, K]``; ``scale_inv``: ``float32`` ``[N/128, K/128]``.
    :param bias: ``[N]`` in the compute dtype, or None.
    :param dtype: the compute dtype (activations in and out).
    :param dense: True: keep the dequantised weight and run it (CPU); False: FP8 kernels (CUDA).
    :param gemm: the GPU kernel, "scaled_mm" or "triton" (:func:`.fp8_kernels.choose_gemm`).
    """

    def __init__(self, q, scale_inv, bias, dtype, dense: bool, gemm: str = "triton") -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.weight = torch.nn.Parameter(q, requires_grad=False)
        self.weight_scale_inv = torch.nn.Parameter(scale_inv.to(torch.float32), requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias.to(dtype), requires_grad=False)
        self.compute_dtype = dtype
        self.gemm = gemm
        self.register_buffer("dense", dequantize_blocks(q, scale_inv, dtype) if dense else None, persistent=False)
        self.register_buffer("scaled_mm_scales", weight_scales_for_scaled_mm(self.weight_scale_inv)
                             if not dense and gemm == "scaled_mm" else None, persistent=False)

    def forward(self, x):
        if self.dense is not None:
            return torch.nn.functional.linear(x, self.dense, self.bias)
        flat = x.reshape(-1, self.in_features)
        xq, x_scale = quantize_activations(flat)
        out = fp8_matmul(xq, x_scale, self.weight, self.weight_scale_inv, self.gemm, x.dtype,
                         self.scaled_mm_scales)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    @torch.no_grad()
    def load_dense(self, weight) -> None:
        """Quantise ``weight`` ``[N, K]`` (a BF16 weight sync) into this layer's blocks in place
        (:func:`furlong.kit.fp8.quantize_blocks`: the quantiser's rounding), and refresh what runs."""
        q, scale_inv = quantize_blocks(weight.to(self.weight.device))
        self.weight.copy_(q)
        self.weight_scale_inv.copy_(scale_inv)
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        """Recompute what the forward reads from ``weight`` and ``weight_scale_inv`` (after either was
        written: a sync that sends them already quantised, as SGLang's clients do)."""
        if self.dense is not None:
            self.dense.copy_(dequantize_blocks(self.weight, self.weight_scale_inv, self.dense.dtype))
        if self.scaled_mm_scales is not None:
            self.scaled_mm_scales[:, : self.weight_scale_inv.shape[1]].copy_(self.weight_scale_inv)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, e4m3 128x128 blocks, "
                f"{'dequantised' if self.dense is not None else self.gemm}")


def install_fp8_layers(model, path: str, device: Any, gemm: str = "auto") -> int:
    """Replace each linear layer of ``model`` that the FP8 checkpoint ``path`` quantised with an
    FP8 layer holding the checkpoint's blocks (read again from the files: the model loaded them
    dequantised, :func:`furlong.kit.hf.load_causal_lm_weights`), placed on ``device``.

    :param gemm: the CUDA kernel ("auto", "scaled_mm", "triton"; :func:`.fp8_kernels.choose_gemm`);
        on a CPU the layers run their dequantised weight.
    :returns: the number of layers replaced.
    :raises PluginError: a quantised module of the files is not a linear layer of the model, or its
        shape is not a multiple of the 128 x 128 block.
    """
    from furlong.hooks import PluginError
    from furlong.kit.fp8_io import fp8_linear_blocks

    cuda = torch.device(device).type == "cuda"
    kernel = choose_gemm(gemm, device) if cuda else "dense"
    count = 0
    for name, old, q, scale_inv in fp8_linear_blocks(model, path, "--hf-checkpoint"):
        if q.shape[0] % BLOCK[0] or q.shape[1] % BLOCK[1]:
            raise PluginError(f"--hf-checkpoint {path}: {name} is a {tuple(q.shape)} FP8 weight, not a multiple of "
                              "the 128 x 128 block; partial blocks are not supported yet (furlong quantize-fp8 "
                              "leaves such layers in BF16).")
        bias = old.bias.detach() if old.bias is not None else None
        layer = Fp8Linear(q.to(device), scale_inv.to(device), None if bias is None else bias.to(device),
                          old.weight.dtype, dense=not cuda, gemm=kernel)
        model.set_submodule(name, layer)
        count += 1
    return count


def fp8_layers(model) -> dict[str, Any]:
    """``{"<module>.weight": layer, "<module>.weight_scale_inv": layer}`` of every FP8 layer of ``model``
    (the names a weight sync sends)."""
    layers = {}
    for name, module in model.named_modules():
        if isinstance(module, Fp8Linear):
            layers[f"{name}.weight"] = layers[f"{name}.{SCALE_SUFFIX}"] = module
    return layers
