"""The masked per-token sum the core's reducer and ``loss_reducer`` plugins share."""

from __future__ import annotations

from typing import Sequence

__all__ = ["masked_sum"]


def masked_sum(values: Sequence, loss_masks: Sequence, weights: Sequence[float] | None = None):
    """``sum_i w_i sum_t x_it m_it`` as a 0-dim float32 tensor that keeps the graph.

    Masked positions are selected away (``torch.where``), never multiplied, so a NaN or
    inf there changes neither the value nor the gradient.

    :param values: N tensors [T_i] (any float or bool dtype); :param loss_masks: N [T_i]
        (a token counts where the mask is > 0); :param weights: N floats (default all 1).
    :returns: float32 0-dim tensor (0 for N = 0).
    """
    import torch

    if not len(values):
        return torch.zeros((), dtype=torch.float32)
    rows = [x.reshape(-1) for x in values]
    x = torch.cat([r.float() if r.dtype != torch.float64 else r for r in rows])
    kept = torch.where(torch.cat([m.reshape(-1) for m in loss_masks]).to(x.device) > 0, x,
                       torch.zeros((), dtype=x.dtype, device=x.device))
    if weights is not None:  # one weight per token: the sample's
        kept = kept * torch.repeat_interleave(torch.tensor([float(w) for w in weights], dtype=x.dtype, device=x.device),
                                              torch.tensor([r.numel() for r in rows], device=x.device))
    return kept.sum().to(torch.float32)
