"""Per-sample tensors that are the consecutive pieces of one tensor.

A micro-batch's per-token values (log-probs, masks, advantages, a loss plugin's per-token
loss) travel between the backend, the core and the loss plugin as lists of ``N`` tensors
``[T_i]``, one per sample. Most are made by splitting one ``[sum T_i]`` tensor, and most
consumers concatenate them again. :class:`SplitRows` is such a list that keeps the tensor it
was split from, so :func:`concat_rows` returns it as is: no copy, and no Python loop over the
samples (about 170 per micro-batch at 65,536 tokens; the loops cost more host time than the
GPU spends on the arithmetic).
"""

from __future__ import annotations

import operator
from typing import Any, Sequence

__all__ = ["SplitRows", "concat_rows", "detached_rows", "row_lengths"]


class SplitRows(list):
    """A list of ``N`` tensors ``[T_i]`` that are the consecutive pieces of ``flat`` (``[sum T_i]``).

    It is a plain list to whoever reads it (index it, iterate it, replace items). Made by
    :meth:`of`; :func:`concat_rows` and :func:`row_lengths` read ``flat`` and ``lengths``
    while the list still holds the pieces it was made with, and fall back to the items otherwise.
    """

    __slots__ = ("flat", "lengths", "_pieces")

    @classmethod
    def of(cls, flat, lengths: Sequence[int]) -> "SplitRows":
        """``flat`` (1-D, ``sum(lengths)`` elements) split into views of ``lengths`` elements.

        :raises ValueError: ``flat`` is not 1-D or ``lengths`` do not add up to its size.
        """
        lengths = [int(n) for n in lengths]
        if flat.dim() != 1 or sum(lengths) != flat.numel():
            raise ValueError(f"SplitRows.of: {len(lengths)} lengths adding up to {sum(lengths)} for a tensor of shape "
                             f"{list(flat.shape)}; give a 1-D tensor and one length per sample, summing to its size.")
        pieces = flat.split(lengths)
        rows = cls(pieces)
        rows.flat, rows.lengths, rows._pieces = flat, lengths, pieces
        return rows

    def intact(self) -> bool:
        """Whether the list still holds exactly the pieces of ``flat`` (no item replaced, added or removed)."""
        return len(self) == len(self._pieces) and all(map(operator.is_, self, self._pieces))


def _split(rows: Any) -> SplitRows | None:
    return rows if isinstance(rows, SplitRows) and rows.intact() else None


def concat_rows(rows: Sequence[Any]):
    """The rows flattened and concatenated into one 1-D tensor: a :class:`SplitRows`'s ``flat``
    itself (not a copy: do not modify it in place), else ``torch.cat`` of the flattened rows.

    :raises RuntimeError: no rows (``torch.cat`` of nothing).
    """
    split = _split(rows)
    if split is not None:
        return split.flat
    import torch

    return torch.cat([r.reshape(-1) for r in rows])


def row_lengths(rows: Sequence[Any]) -> list[int]:
    """The number of elements of each row."""
    split = _split(rows)
    return list(split.lengths) if split is not None else [int(r.numel()) for r in rows]


def detached_rows(rows: Sequence[Any]) -> list:
    """The rows detached from the autograd graph (a :class:`SplitRows` of the detached ``flat``
    when ``rows`` is one)."""
    split = _split(rows)
    if split is not None:
        return SplitRows.of(split.flat.detach(), split.lengths)
    return [r.detach() for r in rows]
