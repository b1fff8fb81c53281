"""Micro-batch planning: which samples each data-parallel rank trains on, step by step.

Step ``s`` uses samples ``[s*gbs, (s+1)*gbs)`` of the rollout order; each step's samples
are shared out over the ``D`` data-parallel ranks, either in fixed micro-batches of
``--micro-batch-size`` or, under ``--use-dynamic-batch-size``, packed first-fit-decreasing
into micro-batches of at most ``C`` tokens. Every rank runs the same number of
micro-batches per step (FSDP and Megatron collectives need it). The gradient never
depends on the plan: the core's objective reduces with whole-step denominators.

Pure Python; no torch.
"""

from __future__ import annotations

import heapq
from typing import Any, Sequence


__all__ = ["dynamic_global_batch", "karmarkar_karp", "plan_steps", "split_steps"]


def dynamic_global_batch(group_sizes: Sequence[int], dp_size: int) -> int:
    """``--use-dynamic-global-batch-size``: how many of a rollout's groups to train on, as one step.

    Miles' rule: the step holds every sample, rounded down to a multiple of the
    data-parallel size; here whole groups are dropped from the end (a group is never
    split: its rewards are normalized together) until the sample count divides by
    ``dp_size``.

    :param group_sizes: samples per group, in rollout order.
    :returns: the number of leading groups kept (the step's global batch is their samples).
    :raises ValueError: no leading run of groups has a sample count divisible by ``dp_size``.
    """
    total = sum(group_sizes)
    for kept in range(len(group_sizes), 0, -1):
        if total % dp_size == 0:
            return kept
        total -= group_sizes[kept - 1]
    raise ValueError(f"--use-dynamic-global-batch-size: no leading groups of sizes {list(group_sizes)} hold a "
                     f"multiple of the data-parallel size {dp_size} samples.")


def split_steps(
    num_samples: int, global_batch_size: int, num_steps: int, trajectory_ids: Sequence[int] | None = None
) -> list[list[int]]:
    """Sample indices of each optimizer step, in rollout order.

    Without trajectories (or when every trajectory is one sample) step ``s`` holds samples
    ``[s*gbs, (s+1)*gbs)`` and ``num_samples`` must equal ``gbs * num_steps``. With
    multi-sample trajectories the unit is the trajectory (each counts once):
    trajectories are numbered by first appearance, step ``s`` holds every sample of
    trajectories ``[s*gbs, (s+1)*gbs)``, so siblings never straddle two steps.

    :raises ValueError: the sample (or trajectory) count is not ``gbs * num_steps``.
    """
    if global_batch_size <= 0 or num_steps <= 0:
        raise ValueError(f"global_batch_size={global_batch_size} and num_steps={num_steps} must be positive")
    expected = global_batch_size * num_steps
    if trajectory_ids is not None:
        if len(trajectory_ids) != num_samples:
            raise ValueError(f"{len(trajectory_ids)} trajectory ids for {num_samples} samples")
        order: dict[Any, int] = {}
        for t in trajectory_ids:
            order.setdefault(t, len(order))
        if len(order) != num_samples:
            if len(order) != expected:
                raise ValueError(
                    f"{len(order)} trajectories ({num_samples} samples) cannot fill {num_steps} steps of "
                    f"global batch size {global_batch_size} ({expected} trajectories)"
                )
            steps: list[list[int]] = [[] for _ in range(num_steps)]
            for i, t in enumerate(trajectory_ids):
                steps[order[t] // global_batch_size].append(i)
            return steps
    if num_samples != expected:
        raise ValueError(
            f"{num_samples} samples cannot fill {num_steps} steps of global batch size {global_batch_size} "
            f"({expected} samples)"
        )
    return [list(range(s * global_batch_size, (s + 1) * global_batch_size)) for s in range(num_steps)]


def plan_steps(
    lengths: list[int],
    global_batch_size: int,
    num_steps: int,
    dp_size: int,
    rank: int,
    micro_batch_size: int,
    max_tokens_per_gpu: int | None,
    dynamic: bool,
    balance: bool,
    trajectory_ids: list[int] | None = None,
    skip: Sequence[bool] | None = None,
    groups: Sequence[Any] | None = None,
) -> list[list[list[int]]]:
    """Plan this rank's micro-batches: ``plan[s][m]`` = sample indices of micro-batch ``m`` of step ``s``.

    :param lengths: total tokens (prompt + response) of each sample of the rollout, in order.
    :param global_batch_size: samples (trajectories) per optimizer step, ``gbs``.
    :param num_steps: optimizer steps in this rollout, ``S``.
    :param dp_size: data-parallel ranks ``D``; :param rank: this rank, ``0 <= rank < D``.
    :param micro_batch_size: samples per micro-batch per rank (fixed mode).
    :param max_tokens_per_gpu: the token cap ``C`` of one micro-batch (dynamic mode; pass
        ``max_tokens_per_gpu * context_parallel_size``).
    :param dynamic: ``--use-dynamic-batch-size``; :param balance: ``--balance-data``.
    :param trajectory_ids: per sample, or None (see :func:`split_steps`).
    :param skip: per sample, True for a sample that need not be trained (zero loss, see
        :func:`~furlong.core.config.train_rules.zero_advantage_skip_blocked`), or None. Each step is planned over its other
        samples; skipped ones are added back, in order, only as far as the plan needs them
        (a step keeps at least one sample, so its optimizer step still runs, and the ranks
        need enough samples for the same number of micro-batches each).
    :param groups: None, or per sample the key of its prompt group (a backend that runs a shared prompt once,
        ``ParallelLayout.shares_prompts``, computes it once per micro-batch it lands in): in dynamic mode each group that fits
        in ``C`` tokens is one item of first-fit-decreasing, and a bin halved to reach a multiple of ``D`` is cut
        between its groups while it holds several. On one rank a group that fits lands whole in one micro-batch;
        across ranks halving can still cut one. Where whole groups leave too few bins to reach a multiple of
        ``D``, the step is planned by sample, as without ``groups``.
    :returns: ``S`` lists of micro-batches, each a non-empty ascending list of indices.
        Over all ranks every sample of step ``s`` (without ``skip``: every one not left out)
        appears in exactly one micro-batch, and every rank gets the same number of
        micro-batches in each step.

    Fixed mode: a step's samples go to ranks round-robin (position ``p`` to rank ``p % D``),
    or by Karmarkar-Karp on lengths under ``balance``; each rank cuts its samples, in
    order, into micro-batches of ``micro_batch_size``. Dynamic mode:
    first-fit-decreasing into bins of at most ``C`` tokens (a sample longer than ``C`` gets
    a bin of its own; with ``groups``, each group is one item while it fits in ``C`` tokens, its samples
    items of their own otherwise), the bin count raised to a multiple of ``D`` by halving the heaviest
    multi-sample bin, bins dealt to ranks round-robin or by Karmarkar-Karp on token sums.

    :raises ValueError: bad sizes, a step with fewer samples than ``D`` ranks can share, or
        ``dynamic`` without ``max_tokens_per_gpu``.
    """
    if dp_size <= 0 or not 0 <= rank < dp_size:
        raise ValueError(f"rank {rank} is outside data-parallel size {dp_size}")
    if dynamic and (not max_tokens_per_gpu or max_tokens_per_gpu <= 0):
        raise ValueError("dynamic batching needs a positive max_tokens_per_gpu (--max-tokens-per-gpu)")
    if not dynamic and micro_batch_size <= 0:
        raise ValueError(f"micro_batch_size={micro_batch_size} must be positive")
    plan = []
    for s, step in enumerate(split_steps(len(lengths), global_batch_size, num_steps, trajectory_ids)):
        if dynamic:
            per_rank = _fewest(step, skip, lambda ids: _grouped_or_not(ids, lengths, max_tokens_per_gpu, dp_size,
                                                                        balance, s, groups))
        else:
            per_rank = _fewest(step, skip, lambda ids: _fixed_step(ids, lengths, micro_batch_size, dp_size,
                                                                    balance, s))
        plan.append(per_rank[rank])
    return plan


def _fewest(step: list[int], skip: Sequence[bool] | None, plan_step):
    """``plan_step`` over the samples of ``step`` not skipped, plus as few skipped ones (in order) as it needs."""
    if skip is None:
        return plan_step(step)
    kept = [i for i in step if not skip[i]]
    spare = [i for i in step if skip[i]]
    if not kept:
        kept.append(spare.pop(0))
    while True:
        try:
            return plan_step(sorted(kept))
        except ValueError:
            if not spare:
                raise
            kept.append(spare.pop(0))


def _fixed_step(step: list[int], lengths, mbs: int, dp: int, balance: bool, s: int) -> list[list[list[int]]]:
    """Per rank, the micro-batches of one step in fixed-size mode."""
    if balance:
        parts = karmarkar_karp([lengths[i] for i in step], dp)
        shares = [[step[p] for p in part] for part in parts]
    else:
        shares = [step[r::dp] for r in range(dp)]
    count = -(-max(len(x) for x in shares) // mbs)
    if min(len(x) for x in shares) < count:
        raise ValueError(
            f"step {s}: {len(step)} samples cannot give each of {dp} ranks {count} micro-batches of up to {mbs}"
        )
    return [_even_chunks(sorted(x), count) for x in shares]


def _even_chunks(items: list[int], count: int) -> list[list[int]]:
    """``items`` cut in order into ``count`` chunks whose sizes differ by at most one."""
    size, extra = divmod(len(items), count)
    out, start = [], 0
    for c in range(count):
        end = start + size + (1 if c < extra else 0)
        out.append(items[start:end])
        start = end
    return out


def _grouped_or_not(step: list[int], lengths, cap: int, dp: int, balance: bool, s: int,
                    groups: Sequence[Any] | None) -> list[list[list[int]]]:
    """:func:`_dynamic_step` with ``groups``, or without them where whole groups leave too few bins to split into a
    multiple of ``dp`` (samples alone may still fill them)."""
    if groups is not None:
        try:
            return _dynamic_step(step, lengths, cap, dp, balance, s, groups)
        except ValueError:
            pass
    return _dynamic_step(step, lengths, cap, dp, balance, s)


def _dynamic_step(step: list[int], lengths, cap: int, dp: int, balance: bool, s: int,
                  groups: Sequence[Any] | None = None) -> list[list[list[int]]]:
    """Per rank, the micro-batches of one step under dynamic batching."""
    bins: list[list[int]] = []  # each bin: sample indices
    sums: list[int] = []
    for item in _items(step, lengths, cap, groups):
        size = sum(lengths[i] for i in item)
        for b, total in enumerate(sums):
            if total + size <= cap:
                bins[b].extend(item)
                sums[b] += size
                break
        else:
            bins.append(list(item))
            sums.append(size)
    while len(bins) % dp:
        splittable = [b for b in range(len(bins)) if len(bins[b]) > 1]
        if not splittable:
            raise ValueError(
                f"step {s}: {len(step)} samples cannot fill a multiple of {dp} micro-batches (data-parallel size); "
                "use a global batch size with at least that many samples per step"
            )
        b = max(splittable, key=lambda k: (sums[k], -k))
        units = _items(bins[b], lengths, cap, groups)
        if len(units) < 2:  # one group: its samples
            units = _items(bins[b], lengths, cap, None)
        halves: list[list[int]] = [[], []]
        half_sums = [0, 0]
        for unit in units:  # largest first, each into the lighter half (the first two one each)
            h = 1 if halves[0] and not halves[1] else int(half_sums[1] < half_sums[0])
            halves[h].extend(unit)
            half_sums[h] += sum(lengths[i] for i in unit)
        bins[b:b + 1] = halves
        sums[b:b + 1] = half_sums
    bins = [sorted(b) for b in bins]
    if balance:
        parts = karmarkar_karp(sums, dp)
        return [[bins[b] for b in sorted(part)] for part in parts]
    return [[bins[b] for b in range(r, len(bins), dp)] for r in range(dp)]


def _items(step: list[int], lengths, cap: int, groups: Sequence[Any] | None) -> list[list[int]]:
    """What first-fit-decreasing places, largest first (ties in order): each sample; with ``groups``, each group of
    at most ``cap`` tokens whole and the samples of a larger one."""
    if groups is None:
        units = [[i] for i in step]
    else:
        members: dict[Any, list[int]] = {}
        for i in step:
            members.setdefault(groups[i], []).append(i)
        units = []
        for unit in members.values():
            units.extend([unit] if sum(lengths[i] for i in unit) <= cap else [[i] for i in unit])
    return sorted(units, key=lambda unit: (-sum(lengths[i] for i in unit), unit[0]))


def karmarkar_karp(weights: Sequence[int], k: int) -> list[list[int]]:
    """Split item indices into ``k`` parts of (near-)equal count with balanced weight sums.

    Largest differencing method for k-way partitioning (Karmarkar & Karp, 1982, "The
    differencing method of set partitioning"), with equal cardinality: items sorted by
    weight are dealt in rows of ``k`` (one item per part), then the two partial solutions
    with the widest spread are merged repeatedly, heaviest part with lightest. When the
    item count is not a multiple of ``k``, zero-weight padding items are added and removed
    afterwards, so part sizes may differ.

    :returns: ``k`` lists of indices into ``weights``, each ascending; parts ordered by
        their first index (empty parts last).
    """
    n = len(weights)
    padded = n + (-n) % k
    order = sorted(range(padded), key=lambda i: (-(weights[i] if i < n else 0), i))
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    for row in range(padded // k):
        parts = [((weights[i] if i < n else 0), [i]) for i in order[row * k:(row + 1) * k]]
        parts.sort(key=lambda p: -p[0])
        heap.append((-(parts[0][0] - parts[-1][0]), row, parts))
    heapq.heapify(heap)
    counter = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b))]
        merged.sort(key=lambda p: -p[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), counter, merged))
        counter += 1
    final = [sorted(i for i in idx if i < n) for _, idx in heap[0][2]] if heap else [[] for _ in range(k)]
    return sorted(final, key=lambda p: (not p, p[0] if p else 0))
