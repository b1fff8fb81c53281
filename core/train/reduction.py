"""The core's loss reducer: masks and denominators over a whole optimizer step.

A loss plugin returns per-token values; this module turns them into the step objective.
With ``m`` the loss mask, ``D_i`` the trained-token count of sample ``i``'s trajectory,
``n_s`` the number of trajectories in step ``s`` and ``N_s`` its trained-token count (both
over every micro-batch and data-parallel rank of the step):

- per-sample mode (default): ``L_s = (1/n_s) * sum_i sum_t x_it m_it / max(D_i, 1)``;
- per-token mode (``--calculate-per-token-loss``): ``L_s = sum_i sum_t x_it m_it / N_s``.

Each micro-batch contributes its samples' share, so the sum over micro-batches is ``L_s``
whatever the packing. A step with no trained token gives 0 (denominators are clamped to
1). Samples whose mask is all 0 (``remove_sample``) still count in ``n_s``; under
``--mask-truncated-samples`` truncated samples get mask 0 and leave ``n_s`` and ``N_s``
(masked tokens never dilute the denominator).
"""

from __future__ import annotations

from typing import Sequence

import attrs

__all__ = [
    "StepDenominators",
    "effective_loss_masks",
    "sample_denominators",
    "sample_weights",
    "step_denominators",
]


@attrs.frozen
class StepDenominators:
    """Denominators of one optimizer step, over all its micro-batches and ranks.

    ``samples``: trajectories in the step (a trajectory of several Samples counts once;
    samples left out by ``--mask-truncated-samples`` do not count). ``tokens``: trained
    tokens (``sum m``) in the step, after masking.
    """

    samples: int
    tokens: float


def effective_loss_masks(loss_masks: Sequence, truncated: Sequence[bool] | None, mask_truncated: bool) -> list:
    """Loss masks with truncated samples zeroed when ``--mask-truncated-samples`` is on.

    :param loss_masks: N tensors [T_i] (0/1, any dtype).
    :param truncated: N bools (finish reason ``length``), or None (none truncated).
    :param mask_truncated: ``config.mask_truncated_samples``.
    :returns: N float32 tensors [T_i]; the input tensors are not modified.
    """
    import torch

    masks = [torch.as_tensor(m).reshape(-1).to(torch.float32) for m in loss_masks]
    if not mask_truncated or truncated is None:
        return masks
    _check_len("truncated", truncated, len(masks))
    return [torch.zeros_like(m) if cut else m for m, cut in zip(masks, truncated)]


def excluded_samples(truncated: Sequence[bool] | None, mask_truncated: bool, n: int) -> list[bool]:
    """Which of ``n`` samples leave the step denominators (truncated, under masking)."""
    if not mask_truncated or truncated is None:
        return [False] * n
    _check_len("truncated", truncated, n)
    return [bool(t) for t in truncated]


def sample_denominators(loss_masks: Sequence, trajectory_ids: Sequence[int] | None = None) -> list[float]:
    """``D_i``: the trained-token count of sample ``i``'s trajectory (its own ``|m_i|``
    when ``trajectory_ids`` is None). Pass the masks of every sibling (all ranks) so
    siblings share one denominator.

    :returns: N floats (may be 0; the reducer clamps to 1).
    """
    counts = [float(m.sum()) for m in loss_masks]
    if trajectory_ids is None:
        return counts
    _check_len("trajectory_ids", trajectory_ids, len(counts))
    totals: dict[int, float] = {}
    for tid, count in zip(trajectory_ids, counts):
        totals[int(tid)] = totals.get(int(tid), 0.0) + count
    return [totals[int(tid)] for tid in trajectory_ids]


def step_denominators(
    loss_masks: Sequence,
    steps: Sequence[Sequence],
    trajectory_ids: Sequence[int] | None = None,
    excluded: Sequence[bool] | None = None,
) -> list[StepDenominators]:
    """Denominators of each step, from masks indexed by the sample ids the steps list.

    Run it on the whole rollout batch before the data-parallel split (``steps[s]`` = every
    sample of step ``s`` on every rank) and hand the result to each rank's objective.

    :param loss_masks: effective masks (see :func:`effective_loss_masks`), N x [T_i].
    :param steps: per step, either a flat list of sample ids or a list of micro-batches
        (lists of sample ids), as ``TrainBatch.steps``.
    :param trajectory_ids: N trajectory ids, or None (each sample its own trajectory).
    :param excluded: N bools: samples that leave the denominators (truncated, masked).
    :returns: one :class:`StepDenominators` per step.
    """
    n = len(loss_masks)
    excluded = list(excluded) if excluded is not None else [False] * n
    _check_len("excluded", excluded, n)
    out = []
    for step in steps:
        ids = _flatten(step)
        units = {int(trajectory_ids[i]) if trajectory_ids is not None else ("s", i) for i in ids if not excluded[i]}
        tokens = sum(float(loss_masks[i].sum()) for i in ids if not excluded[i])
        out.append(StepDenominators(samples=len(units), tokens=tokens))
    return out


def sample_weights(
    sample_ids: Sequence[int], denominators: Sequence[float], step: StepDenominators, per_token: bool
) -> list[float]:
    """Per-sample factor ``w_i`` of the reduction ``sum_i w_i sum_t x_it m_it``.

    per-sample mode: ``w_i = 1 / (max(D_i, 1) * max(n_s, 1))``; per-token mode:
    ``w_i = 1 / max(N_s, 1)``.
    """
    if per_token:
        return [1.0 / max(step.tokens, 1.0)] * len(sample_ids)
    scale = 1.0 / max(step.samples, 1)
    return [scale / max(float(denominators[i]), 1.0) for i in sample_ids]


def step_scale(step: StepDenominators, per_token: bool) -> float:
    """The step factor alone: ``1/max(N_s, 1)`` per-token, ``1/max(n_s, 1)`` per-sample."""
    return 1.0 / max(step.tokens, 1.0) if per_token else 1.0 / max(step.samples, 1)


def _flatten(step: Sequence) -> list[int]:
    ids: list[int] = []
    for item in step:
        if isinstance(item, (list, tuple)):
            ids.extend(int(i) for i in item)
        else:
            ids.append(int(item))
    return ids


def _check_len(name: str, values: Sequence, n: int) -> None:
    if len(values) != n:
        raise ValueError(f"{name} has {len(values)} entries for {n} samples")
