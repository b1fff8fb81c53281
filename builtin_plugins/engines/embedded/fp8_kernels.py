"""GPU kernels of the embedded engine's FP8 linear layers (Hopper and later, compute capability 8.9+).

One FP8 linear layer is two steps:

1. quantise the activations per token and group of 128 features (:func:`quantize_activations`:
   a Triton kernel on CUDA, :func:`furlong.kit.fp8.quantize_activation_groups` elsewhere; the two
   compute the same values), then
2. the block-scaled matrix product ``sum_g (xq_g @ wq_g.T) * x_scale[:, g] * w_scale_inv[n // 128, g]``
   (:func:`furlong.kit.fp8.fp8_linear_reference`) with float32 accumulation, by one of two kernels:

   * ``scaled_mm``: ``torch.nn.functional.scaled_mm`` (``torch._scaled_mm`` before it existed) with
     ``BlockWise1x128`` activation scales and ``BlockWise128x128`` weight scales (torch's CUTLASS kernel
     for SM90; rows padded with zeros to a multiple of 16); its scale layouts
     (activation scales column-major, weight scales ``[round_up(K/128, 4), N/128]`` column-major)
     are torch's meta checks of ``_scaled_mm_v2``;
   * ``triton``: :func:`_block_fp8_matmul` below, one program per ``BLOCK_M x BLOCK_N`` output tile,
     one ``tl.dot`` per 128-feature group scaled by its two scales.

``auto`` takes ``scaled_mm`` when this torch has it and it agrees with the reference on a probe,
else ``triton``. ``benchmarks/bench_fp8.py`` times both.
"""

from __future__ import annotations

import logging
from typing import Any

from furlong.kit.fp8 import BLOCK, FP8_MAX, GROUP, fp8_linear_reference, quantize_activation_groups

__all__ = ["GEMMS", "choose_gemm", "fp8_matmul", "quantize_activations", "weight_scales_for_scaled_mm"]

log = logging.getLogger("furlong.engines.embedded")

GEMMS = ("auto", "scaled_mm", "triton")
_SCALED_MM_ROWS = 16  # scaled_mm's rows are padded to a multiple of this

try:  # Triton ships with CUDA builds of torch; the kernels are only defined where it imports
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs without triton
    triton = None

if triton is not None:
    @triton.jit
    def _act_quant(x_ptr, q_ptr, s_ptr, n_groups, GROUP_SIZE: tl.constexpr, FMAX: tl.constexpr,
                   EPS: tl.constexpr):
        # one program per (row, group): amax, scale = amax / 448, q = x / scale; divisions rounded to
        # nearest (div_rn, as torch divides), not the approximate division "/" compiles to
        pid = tl.program_id(0)
        offs = tl.arange(0, GROUP_SIZE)
        x = tl.load(x_ptr + pid * GROUP_SIZE + offs).to(tl.float32)
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=0), EPS), FMAX)
        q = tl.clamp(tl.math.div_rn(x, scale), -FMAX, FMAX)
        tl.store(q_ptr + pid * GROUP_SIZE + offs, q.to(q_ptr.dtype.element_ty))
        tl.store(s_ptr + pid, scale)

    @triton.jit
    def _block_fp8_matmul(a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, M, N, K,
                          stride_am, stride_bn, stride_cm, stride_asm, stride_bsn,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          WEIGHT_ROWS: tl.constexpr):
        # C[M, N] = sum over K groups of (A_g @ B_g^T) * a_scale[m, g] * b_scale[n // WEIGHT_ROWS, g]
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        in_m = offs_m < M
        in_n = offs_n < N
        a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
        b_ptrs = b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None]
        scale_rows = offs_n // WEIGHT_ROWS
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for g in range(0, tl.cdiv(K, BLOCK_K)):
            left = K - g * BLOCK_K
            a = tl.load(a_ptrs, mask=in_m[:, None] & (offs_k[None, :] < left), other=0.0)
            b = tl.load(b_ptrs, mask=in_n[None, :] & (offs_k[:, None] < left), other=0.0)
            a_s = tl.load(as_ptr + offs_m * stride_asm + g, mask=in_m, other=0.0)
            b_s = tl.load(bs_ptr + scale_rows * stride_bsn + g, mask=in_n, other=0.0)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=in_m[:, None] & in_n[None, :])


def quantize_activations(x: Any) -> tuple[Any, Any]:
    """Per-token-group (1 x 128) e4m3 quantisation of ``x`` ``[M, K]`` (``K`` a multiple of 128):
    ``(q float8_e4m3fn [M, K], scale float32 [M, K / 128])``, the values of
    :func:`~furlong.kit.fp8.quantize_activation_groups` (a Triton kernel on CUDA)."""
    import torch

    if x.device.type != "cuda" or triton is None:
        return quantize_activation_groups(x)
    x = x.contiguous()
    rows, cols = x.shape
    q = torch.empty_like(x, dtype=torch.float8_e4m3fn)
    scale = torch.empty(rows, cols // GROUP, dtype=torch.float32, device=x.device)
    if x.numel():
        _act_quant[(rows * (cols // GROUP),)](x, q, scale, cols // GROUP, GROUP_SIZE=GROUP, FMAX=FP8_MAX, EPS=1e-10)
    return q, scale


def weight_scales_for_scaled_mm(scale_inv: Any) -> Any:
    """The storage ``scaled_mm`` reads the weight's block scales from: ``[N/128, round_up(K/128, 4)]``
    float32, the scales in its first ``K/128`` columns, zeros after; pass ``storage.t()`` (shape
    ``[L4, N/128]``, strides ``(1, L4)``). A weight sync copies new scales into the same storage, so a
    captured CUDA graph keeps reading it."""
    import torch

    rows, groups = scale_inv.shape
    store = torch.zeros(rows, -(-groups // 4) * 4, dtype=torch.float32, device=scale_inv.device)
    store[:, :groups].copy_(scale_inv)
    return store


def _scaled_mm(xq, x_scale, wq, store, out_dtype):
    import torch

    rows = xq.shape[0]
    if rows % _SCALED_MM_ROWS:  # cuBLASLt has no blockwise algorithm for such M (M = 1 on an H100)
        pad = _SCALED_MM_ROWS - rows % _SCALED_MM_ROWS
        xq = torch.cat([xq, xq.new_zeros(pad, xq.shape[1])])
        x_scale = torch.cat([x_scale, x_scale.new_ones(pad, x_scale.shape[1])])
        return _scaled_mm(xq, x_scale, wq, store, out_dtype)[:rows]
    # [M, K/128] column-major, strides exactly (1, M): torch checks the strides even where M = 1
    column_major = torch.empty_strided(x_scale.shape, (1, max(x_scale.shape[0], 1)), dtype=x_scale.dtype,
                                       device=x_scale.device)
    x_scale = column_major.copy_(x_scale)
    try:
        from torch.nn.functional import ScalingType, scaled_mm
    except ImportError:  # older torch: the same CUTLASS kernel behind _scaled_mm, chosen by the scales' shapes
        groups = -(-xq.shape[1] // BLOCK[1])
        return torch._scaled_mm(xq, wq.t(), scale_a=x_scale, scale_b=store[:, :groups].t(),
                                out_dtype=out_dtype or torch.bfloat16)
    return scaled_mm(xq, wq.t(), x_scale, ScalingType.BlockWise1x128, store.t(), ScalingType.BlockWise128x128,
                     output_dtype=out_dtype or torch.bfloat16)


def _triton_mm(xq, x_scale, wq, scale_inv, out_dtype):
    import torch

    m, k = xq.shape
    n = wq.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0:
        return out
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    block_n = 128
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _block_fp8_matmul[grid](xq, wq, out, x_scale, scale_inv, m, n, k, xq.stride(0), wq.stride(0), out.stride(0),
                            x_scale.stride(0), scale_inv.stride(0), BLOCK_M=block_m, BLOCK_N=block_n,
                            BLOCK_K=BLOCK[1], WEIGHT_ROWS=BLOCK[0], num_warps=4 if block_m <= 64 else 8,
                            num_stages=4)
    return out


def fp8_matmul(xq: Any, x_scale: Any, wq: Any, scale_inv: Any, gemm: str, out_dtype: Any,
               scaled_mm_store: Any = None) -> Any:
    """``[M, N]`` block-scaled product of ``xq`` ``[M, K]`` e4m3 (scales ``[M, K/128]``) and ``wq``
    ``[N, K]`` e4m3 (``scale_inv`` ``[N/128, K/128]``) in ``out_dtype``, by ``gemm`` ("scaled_mm":
    needs ``scaled_mm_store`` from :func:`weight_scales_for_scaled_mm`; "triton"; "reference": the
    float32 :func:`~furlong.kit.fp8.fp8_linear_reference`, any device)."""
    if gemm == "scaled_mm":
        return _scaled_mm(xq, x_scale, wq, scaled_mm_store, out_dtype)
    if gemm == "triton":
        return _triton_mm(xq, x_scale, wq, scale_inv, out_dtype)
    return fp8_linear_reference(xq, x_scale, wq, scale_inv).to(out_dtype)


def choose_gemm(wanted: str, device: Any) -> str:
    """The kernel ``wanted`` ("auto", "scaled_mm", "triton") resolves to on ``device``: "auto" probes
    ``scaled_mm`` against the reference on small shapes (a few milliseconds) and falls back to
    "triton" when it is missing, raises or disagrees.

    :raises ValueError: ``wanted`` is not one of :data:`GEMMS`.
    """
    if wanted not in GEMMS:
        raise ValueError(f"FP8 GEMM {wanted!r}: choose one of {', '.join(GEMMS)}.")
    if wanted != "auto":
        return wanted
    problem = _scaled_mm_problem(device)
    if problem is None:
        return "scaled_mm"
    log.info("embedded engine: FP8 layers use the Triton kernel (torch's blockwise scaled_mm: %s)", problem)
    return "triton"


def _scaled_mm_problem(device: Any) -> str | None:
    import torch

    from furlong.kit.fp8 import quantize_blocks

    if not hasattr(torch, "_scaled_mm"):
        return f"not in torch {torch.__version__}"

    gen = torch.Generator(device="cpu").manual_seed(0)
    try:
        for m in (1, 7, 200):
            x = torch.randn(m, 256, generator=gen).to(device, torch.bfloat16)
            w = torch.randn(384, 256, generator=gen).to(device, torch.bfloat16)
            wq, ws = quantize_blocks(w)
            xq, xs = quantize_activations(x)
            # bfloat16 output, as the engine asks (blockwise scaling need not offer float32 output)
            got = _scaled_mm(xq, xs, wq, weight_scales_for_scaled_mm(ws), torch.bfloat16).float()
            want = fp8_linear_reference(xq, xs, wq, ws)
            error = ((got - want).norm() / want.norm()).item()
            if not error < 1e-2:  # bfloat16 rounding is about 4e-3; a wrong scale layout is off by O(1)
                return f"disagrees with the reference at M={m} (relative error {error:.3g})"
    except (RuntimeError, TypeError, ValueError) as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None
