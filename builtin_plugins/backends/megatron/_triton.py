"""Triton kernels of :mod:`.layers`: SwiGLU and RMSNorm, forward and backward, each reading its
inputs once. Imported only where Triton and a GPU are (``layers.triton_ready``); every kernel
computes in float32 and rounds once, to the output's dtype.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

_SWIGLU_BLOCK = 1024
_NORM_TILE = 8192
"""Elements per RMSNorm tile: ``8192 // width`` rows (at least one; width rounded up to a power of two).
At hidden 896 (8 rows of 1024, 4 warps) this was the fastest of 1-16 rows and 4 or 8 warps both ways
on an H200, by the timings of Triton's autotuner (47 us forward, 74 us backward at 49,152 rows)."""


@triton.jit
def _swiglu_forward(x, out, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = cols < width
    gate = tl.load(x + row * 2 * width + cols, mask=keep).to(tl.float32)
    up = tl.load(x + row * 2 * width + width + cols, mask=keep).to(tl.float32)
    tl.store(out + row * width + cols, (gate * tl.sigmoid(gate) * up).to(out.dtype.element_ty), mask=keep)


@triton.jit
def _swiglu_backward(x, grad, dx, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = cols < width
    gate = tl.load(x + row * 2 * width + cols, mask=keep).to(tl.float32)
    up = tl.load(x + row * 2 * width + width + cols, mask=keep).to(tl.float32)
    g = tl.load(grad + row * width + cols, mask=keep).to(tl.float32)
    sig = tl.sigmoid(gate)
    d_gate = g * up * sig * (1.0 + gate * (1.0 - sig))
    tl.store(dx + row * 2 * width + cols, d_gate.to(dx.dtype.element_ty), mask=keep)
    tl.store(dx + row * 2 * width + width + cols, (g * gate * sig).to(dx.dtype.element_ty), mask=keep)


def swiglu_forward(x: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b`` of a contiguous ``[rows, 2 f]`` (``a`` the first half): ``[rows, f]``, x's dtype."""
    rows, width = x.shape[0], x.shape[1] // 2
    out = x.new_empty(rows, width)
    _swiglu_forward[(rows, triton.cdiv(width, _SWIGLU_BLOCK))](x, out, width, BLOCK=_SWIGLU_BLOCK)
    return out


def swiglu_backward(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``d loss / d x`` ``[rows, 2 f]`` from the forward's input ``x`` and ``grad`` ``[rows, f]`` (both contiguous)."""
    rows, width = grad.shape
    dx = torch.empty_like(x)
    _swiglu_backward[(rows, triton.cdiv(width, _SWIGLU_BLOCK))](x, grad, dx, width, BLOCK=_SWIGLU_BLOCK)
    return dx


# Triton compiles a kernel once per pattern of its integer arguments (divisible by 16, equal to 1, other):
# the row count changes with every micro-batch, so it is left unspecialized. Specialized, a micro-batch
# whose token count first stops being a multiple of 16 (a response ending before the length limit)
# compiled both RMSNorm kernels again in the middle of a train call, 0.5 s on an H200 (docs/benchmarks.md,
# "slow train calls"). Specialized kernels are faster only at multiples of 16 rows, by about 0.3 % of a call.
ROWS_UNSPECIALIZED = ["rows"]


@triton.jit(do_not_specialize=ROWS_UNSPECIALIZED)
def _norm_forward(x, weight, out, rstd, rows, width, eps, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    keep = (r < rows)[:, None] & (cols < width)[None, :]
    offsets = r.to(tl.int64)[:, None] * width + cols[None, :]
    v = tl.load(x + offsets, mask=keep, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(v * v, axis=1) / width + eps)
    scale = tl.load(weight + cols, mask=cols < width, other=0.0).to(tl.float32)
    tl.store(out + offsets, (v * inv[:, None] * scale[None, :]).to(out.dtype.element_ty), mask=keep)
    tl.store(rstd + r, inv, mask=r < rows)


@triton.jit(do_not_specialize=ROWS_UNSPECIALIZED)
def _norm_backward(x, weight, grad, rstd, dx, dw_parts, rows, width, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    scale = tl.load(weight + cols, mask=cols < width, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    for tile in range(tl.program_id(0), tl.cdiv(rows, ROWS), tl.num_programs(0)):
        r = tile * ROWS + tl.arange(0, ROWS)
        keep = (r < rows)[:, None] & (cols < width)[None, :]
        offsets = r.to(tl.int64)[:, None] * width + cols[None, :]
        v = tl.load(x + offsets, mask=keep, other=0.0).to(tl.float32)
        g = tl.load(grad + offsets, mask=keep, other=0.0).to(tl.float32)
        inv = tl.load(rstd + r, mask=r < rows, other=0.0)
        normed = v * inv[:, None]
        scaled_grad = g * scale[None, :]
        mean = tl.sum(scaled_grad * normed, axis=1) / width
        d = (scaled_grad - normed * mean[:, None]) * inv[:, None]
        tl.store(dx + offsets, d.to(dx.dtype.element_ty), mask=keep)
        dw += tl.sum(g * normed, axis=0)
    tl.store(dw_parts + tl.program_id(0) * width + cols, dw, mask=cols < width)


def _norm_tile(width: int) -> dict:
    """Launch parameters of the RMSNorm kernels for rows of ``width``: the padded width, rows per tile
    and warps, so that each thread holds 16-64 float32 values of a tile up to hidden 16,384."""
    block = triton.next_power_of_2(width)
    rows = max(1, _NORM_TILE // block)
    return {"BLOCK": block, "ROWS": rows, "num_warps": 4 if block <= 1024 else 8 if block <= 4096 else 16}


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``x / rms(x) * weight`` of a contiguous ``[rows, h]``: the output (x's dtype) and float32
    ``1 / rms`` ``[rows]``."""
    rows, width = x.shape
    out = torch.empty_like(x)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    tile = _norm_tile(width)
    _norm_forward[(triton.cdiv(rows, tile["ROWS"]),)](x, weight, out, rstd, rows, width, eps, **tile)
    return out, rstd


@functools.cache
def _programs(device: torch.device) -> int:
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def rms_norm_backward(x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, grad: torch.Tensor):
    """``(d x, d weight)``: ``d x`` in x's dtype ``[rows, h]``; ``d weight`` summed over rows in float32 (a
    fixed number of programs each sum their share of the rows, the partial sums are added at the end),
    returned in the weight's dtype."""
    rows, width = x.shape
    tile = _norm_tile(width)
    programs = min(_programs(x.device), triton.cdiv(rows, tile["ROWS"]))
    dx = torch.empty_like(x)
    parts = torch.empty(programs, width, dtype=torch.float32, device=x.device)
    _norm_backward[(programs,)](x, weight, grad, rstd, dx, parts, rows, width, **tile)
    return dx, parts.sum(dim=0).to(weight.dtype)
