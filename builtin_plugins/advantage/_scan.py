"""Reverse discounted sums over response tokens (returns and GAE)."""

from __future__ import annotations


def reverse_discounted_sum(rows: list, decay: float) -> list:
    """``y_t = x_t + decay * y_{t+1}`` with ``y_T = 0``, for each 1-D tensor of ``rows``.

    Rows are padded with zeros on the right into one [N, T_max] float64 tensor and scanned
    from the end (one vector step per position, or a reversed cumulative sum when
    ``decay == 1``), so the cost is ``T_max`` tensor operations, not ``sum T_i`` scalar ones.

    :param rows: ``N`` float tensors [T_i] (any float dtype; T_i may be 0).
    :param decay: discount per position (gamma for returns, gamma*lambda for GAE).
    :returns: ``N`` float64 tensors [T_i].

    Reference: Sutton and Barto 2018, eq. 3.9 (discounted return).
    """
    import torch

    if not rows:
        return []
    lengths = [int(r.numel()) for r in rows]
    width = max(lengths)
    device = rows[0].device
    padded = torch.zeros(len(rows), width, dtype=torch.float64, device=device)
    for i, row in enumerate(rows):
        padded[i, : lengths[i]] = row.to(torch.float64)
    if decay == 1.0:
        out = padded.flip(1).cumsum(1).flip(1)
    else:
        out = torch.empty_like(padded)
        acc = torch.zeros(len(rows), dtype=torch.float64, device=device)
        for t in range(width - 1, -1, -1):
            acc = padded[:, t] + decay * acc
            out[:, t] = acc
    return [out[i, : lengths[i]] for i in range(len(rows))]
