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

    total = None
    for i, (x, m) in enumerate(zip(values, loss_masks)):
        x = x.reshape(-1)
        x = x.float() if x.dtype != torch.float64 else x
        term = torch.where(m.reshape(-1).to(x.device) > 0, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum()
        term = term * weights[i] if weights is not None else term
        total = term if total is None else total + term
    if total is None:
        return torch.zeros((), dtype=torch.float32)
    return total.to(torch.float32)
