"""Prompt sharing in a packed row: the samples of a micro-batch grouped by prompt, each prompt laid out once.

GRPO draws several responses per prompt, so the samples of a micro-batch come in groups with
identical prompt tokens. Each sample splits into a *prefix* (its tokens before its last prompt
token) and a *suffix* (its last prompt token, then its response); samples with the same prefix
share it. The shared row holds each prefix once, followed by the suffixes of its samples. A
suffix sits at the positions it has in its whole sequence and attends to its prefix's keys and
then its own (:func:`furlong.kit.packed_attention.packed_causal_attention` with key bounds), so
every output is that of the unshared packed row up to float rounding, and the prefix's
gradients are the sum over its samples. The suffix starts at the last prompt token so that every
position that predicts a response token is a suffix position.

Both train backends lay out packed micro-batches this way (the fsdp backend's packed rows, the
megatron backend's ``thd`` micro-batches).
"""

from __future__ import annotations

from typing import Any, Sequence

import attrs

__all__ = ["PrefixGroups", "SharedRow", "length_bound", "prefix_groups", "shared_row"]


@attrs.frozen
class PrefixGroups:
    """Samples grouped by prefix.

    :ivar prefixes: the ``U`` distinct prefixes, int64 tensors ``[P_u]`` (``P_u >= 1``), in order of first appearance.
    :ivar owner: per sample, the index of its prefix in ``prefixes``.
    :ivar suffixes: per sample, int64 ``[T_i + 1]``: its last prompt token, then its response.
    """

    prefixes: list
    owner: list[int]
    suffixes: list


def prefix_groups(seqs: Sequence[Any], response_lengths: Sequence[int]) -> PrefixGroups | None:
    """The samples grouped by prefix; None when no two samples share one or a sample's prompt is a single token
    (its prefix would be empty).

    :param seqs: B int64 tensors ``[L_i]`` (prompt + response).
    :param response_lengths: B response lengths ``T_i`` (the last ``T_i`` tokens).
    """
    index: dict[tuple[int, ...], int] = {}
    owner, prefixes, suffixes = [], [], []
    for seq, t in zip(seqs, response_lengths):
        cut = len(seq) - int(t) - 1
        if cut < 1:
            return None
        key = tuple(seq[:cut].tolist())
        if key not in index:
            index[key] = len(prefixes)
            prefixes.append(seq[:cut])
        owner.append(index[key])
        suffixes.append(seq[cut:])
    if len(prefixes) == len(seqs):
        return None
    return PrefixGroups(prefixes=prefixes, owner=owner, suffixes=suffixes)


@attrs.frozen
class SharedRow:
    """The packed row of :func:`shared_row`, on the host.

    :ivar ids: int64 ``[T]``: each prefix, then the suffixes of its samples.
    :ivar positions: int64 ``[T]``: each token's position in its whole sequence.
    :ivar bounds: the ``n + 1`` segment bounds in ``ids`` (0, then each prefix's and each suffix's end).
    :ivar key_index: int64 ``[K]``: per segment, the row positions of its keys (a prefix: itself; a suffix: its
        prefix, then itself), one segment after another.
    :ivar key_bounds: the ``n + 1`` segment bounds in ``key_index``.
    :ivar starts: per sample, where its suffix begins in ``ids``.
    """

    ids: Any
    positions: Any
    bounds: list[int]
    key_index: Any
    key_bounds: list[int]
    starts: list[int]


def shared_row(groups: PrefixGroups) -> SharedRow:
    """Lay out ``groups`` as one packed row (the module docstring)."""
    import torch

    members: list[list[int]] = [[] for _ in groups.prefixes]
    for i, u in enumerate(groups.owner):
        members[u].append(i)
    pieces, positions, bounds, key_ranges = [], [], [0], []
    starts = [0] * len(groups.owner)
    for prefix, samples in zip(groups.prefixes, members):
        head = bounds[-1]
        pieces.append(prefix)
        positions.append(torch.arange(len(prefix)))
        bounds.append(head + len(prefix))
        key_ranges.append([(head, bounds[-1])])
        for i in samples:
            suffix = groups.suffixes[i]
            starts[i] = bounds[-1]
            pieces.append(suffix)
            positions.append(torch.arange(len(prefix), len(prefix) + len(suffix)))
            bounds.append(bounds[-1] + len(suffix))
            key_ranges.append([(head, head + len(prefix)), (starts[i], bounds[-1])])
    key_bounds = [0]
    for ranges in key_ranges:
        key_bounds.append(key_bounds[-1] + sum(b - a for a, b in ranges))
    return SharedRow(ids=torch.cat(list(pieces)), positions=torch.cat(positions), bounds=bounds,
                     key_index=torch.cat([torch.arange(a, b) for ranges in key_ranges for a, b in ranges]),
                     key_bounds=key_bounds, starts=starts)


def length_bound(bounds: list[int]) -> int:
    """The longest segment of ``bounds`` rounded up to a power of two: flash kernels take any bound at least the
    longest, and compiled layers then see few distinct values rather than one per micro-batch."""
    longest = max((b - a for a, b in zip(bounds[:-1], bounds[1:])), default=0)
    return 1 << max(longest - 1, 0).bit_length()
