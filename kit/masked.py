"""The masked per-token sum the core's reducer and ``loss_reducer`` plugins share."""

from __future__ import annotations

from typing import Sequence

from furlong.hooks.rows import concat_rows, row_lengths
from .trainer import to_device

__all__ = ["MaskedSum", "masked_sum"]


def masked_sum(values: Sequence, loss_masks: Sequence, weights: Sequence[float] | None = None):
    """``sum_i w_i sum_t x_it m_it`` as a 0-dim float32 tensor that keeps the graph.

    Masked positions are selected away (``torch.where``), never multiplied, so a NaN or
    inf there changes neither the value nor the gradient.

    :param values: N tensors [T_i] (any float or bool dtype); :param loss_masks: N [T_i]
        (a token counts where the mask is > 0); :param weights: N floats (default all 1).
    :returns: float32 0-dim tensor (0 for N = 0).
    """
    return MaskedSum(loss_masks, weights)(values)


class MaskedSum:
    """:func:`masked_sum` over fixed masks and weights, for several value lists of one micro-batch:
    the masks are concatenated and the per-token weights built once, not once per list.

    :param loss_masks: N tensors [T_i]; :param weights: N floats, or None (all 1).
    """

    def __init__(self, loss_masks: Sequence, weights: Sequence[float] | None = None) -> None:
        self.loss_masks, self.weights = loss_masks, weights
        self._keep: dict = {}
        self._token_weights: dict = {}

    def __call__(self, values: Sequence):
        """``sum_i w_i sum_t x_it m_it`` of ``values`` (N tensors [T_i]), float32 0-dim, keeping the graph."""
        import torch

        if not len(values):
            return torch.zeros((), dtype=torch.float32)
        x = concat_rows(values)
        if x.dtype not in (torch.float32, torch.float64):
            x = x.float()
        keep = self._keep.get(x.device)
        if keep is None:
            keep = self._keep[x.device] = concat_rows(self.loss_masks).to(x.device) > 0
        kept = torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))
        if self.weights is not None:  # one weight per token: the sample's
            key = (x.dtype, x.device)
            per_token = self._token_weights.get(key)
            if per_token is None:
                # built on the host and copied without blocking: repeat_interleave on a GPU would wait for it
                per_token = self._token_weights[key] = to_device(torch.repeat_interleave(
                    torch.tensor([float(w) for w in self.weights], dtype=x.dtype),
                    torch.tensor(row_lengths(values))), x.device)
            kept = kept * per_token
        return kept.sum().to(torch.float32)
