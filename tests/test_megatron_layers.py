"""The megatron backend's SwiGLU and RMSNorm (``layers.py``): every model is built with them, and
their Triton kernels (``_triton.py``, the GPU path), run here by Triton's interpreter
(``TRITON_INTERPRET=1``, which executes the kernels on CPU tensors), compute what the CPU path
computes in float32: to float rounding on float32 inputs, to one bf16 rounding on bf16 inputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core", reason="the megatron extra (megatron-core) is not installed")

from transformers import Qwen3Config  # noqa: E402

from furlong.builtin_plugins.backends.megatron.config import model_shape  # noqa: E402
from furlong.builtin_plugins.backends.megatron.layers import FusedRMSNorm, FusedSwiGLU  # noqa: E402
from furlong.builtin_plugins.backends.megatron.model import build_gpt, init_parallel  # noqa: E402

CPU = torch.device("cpu")


def test_every_norm_and_the_mlp_activation_are_furlongs():
    init_parallel(1, CPU)
    config = Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=100, max_position_embeddings=256)
    model = build_gpt(model_shape(config), 1, 100, torch.float32, CPU)
    norms = {name for name, m in model.named_modules() if isinstance(m, torch.nn.RMSNorm)}
    assert norms == {name for name, m in model.named_modules() if isinstance(m, FusedRMSNorm)}
    per_layer = {"input_layernorm", "pre_mlp_layernorm", "self_attention.q_layernorm", "self_attention.k_layernorm"}
    assert norms == {f"decoder.layers.{i}.{n}" for i in range(2) for n in per_layer} | {"decoder.final_layernorm"}
    assert all(isinstance(layer.mlp.activation_func, FusedSwiGLU) for layer in model.decoder.layers)


INTERPRETED = r"""
import json, torch
from furlong.builtin_plugins.backends.megatron import layers

def gap(a, b):
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0

class Config:
    normalization = "RMSNorm"

out = {}
torch.manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    # fc1's output [s, b, 2 f]: f spans two 1024-wide blocks; and no rows at all
    for shape in ((3, 5, 1100), (0, 2, 64)):
        x = torch.randn(*shape[:-1], 2 * shape[-1]).to(dtype)
        g = torch.randn(*shape).to(dtype)
        runs = []
        for fused in (True, False):
            leaf = x.clone().requires_grad_(True)
            y = layers._SwiGLUFunction.apply(leaf) if fused else layers.FusedSwiGLU()(leaf.float())
            y.backward(g if fused else g.float())
            runs.append((y.detach(), leaf.grad))
        (y, dx), (y_ref, dx_ref) = runs
        out[f"swiglu_{shape}_{dtype}"] = [list(y.shape), str(y.dtype), gap(y, y_ref), gap(dx, dx_ref)]
    # 37 rows of width 100: five 8-row tiles over four programs (the CPU's program count), a
    # width that is not a power of two; per-head query norms [s, b, heads, d]; a width of 2
    # tiles' rows (4 rows of 2048); no rows at all
    for shape in ((37, 100), (4, 3, 2, 16), (9, 2000), (0, 1, 64)):
        x = (3 * torch.randn(*shape)).to(dtype)
        g = torch.randn(*shape).to(dtype)
        w = (1 + 0.1 * torch.randn(shape[-1])).to(dtype)
        runs = []
        for fused in (True, False):
            norm = layers.FusedRMSNorm(Config(), shape[-1], eps=1e-6).to(dtype if fused else torch.float32)
            norm.weight.data.copy_(w)
            leaf = x.clone().requires_grad_(True)
            y = layers._RMSNormFunction.apply(leaf, norm.weight, norm.eps) if fused else norm(leaf.float())
            y.backward(g if fused else g.float())
            runs.append((y.detach(), leaf.grad, norm.weight.grad))
        (y, dx, dw), (y_ref, dx_ref, dw_ref) = runs
        out[f"norm_{shape}_{dtype}"] = [list(y.shape), str(dw.dtype), gap(y, y_ref), gap(dx, dx_ref), gap(dw, dw_ref)]
print(json.dumps(out))
"""


def test_the_triton_kernels_match_the_cpu_path():
    if sys.platform != "linux":
        pytest.importorskip("triton", reason="Triton publishes wheels for Linux only (the dev extra installs it there)")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    for dtype, tol in (("torch.float32", 1e-5), ("torch.bfloat16", 0.07)):
        for swiglu_shape in ((3, 5, 1100), (0, 2, 64)):
            shape, out_dtype, out_gap, grad_gap = got[f"swiglu_{swiglu_shape}_{dtype}"]
            assert (shape, out_dtype) == (list(swiglu_shape), dtype)
            assert out_gap <= tol and grad_gap <= tol
        for norm_shape in ("(37, 100)", "(4, 3, 2, 16)", "(9, 2000)", "(0, 1, 64)"):
            shape, weight_dtype, out_gap, dx_gap, dw_gap = got[f"norm_{norm_shape}_{dtype}"]
            assert shape == json.loads(norm_shape.replace("(", "[").replace(")", "]")) and weight_dtype == dtype
            # bf16: one rounding of values up to ~10 (the scale's gradient, a sum over rows, up to ~25)
            assert out_gap <= tol and dx_gap <= tol and dw_gap <= (tol if dtype == "torch.float32" else 0.1)


def test_the_norm_kernels_compile_once_for_every_row_count():
    """Triton keys a compiled kernel on whether each integer argument is 1, a multiple of 16 or
    neither; the row count is left out of that key, so a micro-batch of a new row count (65,281
    tokens after 65,280) reuses the kernel instead of compiling another one during a train call."""
    pytest.importorskip("triton", reason="Triton publishes wheels for Linux only (the dev extra installs it there)")
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    from furlong.builtin_plugins.backends.megatron import _triton

    def keys(kernel, name, values):
        param = next(p for p in kernel.params if p.name == name)
        return {native_specialize_impl(BaseBackend, v, False, not param.do_not_specialize, True) for v in values}

    for kernel in (_triton._norm_forward, _triton._norm_backward):
        assert len(keys(kernel, "rows", (1, 16, 65280, 65281))) == 1
        assert len(keys(kernel, "width", (896, 897))) == 2  # the hidden size, fixed per model, stays specialized
