"""``--dump-details DIR``: what each data-parallel rank trained on, one file per rollout and rank.

``DIR/train_data/<rollout_id>_<rank>.pt`` (``torch.save``; read with ``torch.load(path,
weights_only=True)``): ``rollout_id``, ``rank`` (data-parallel), ``sample_ids`` (each local
sample's index in the rollout batch, which is the order of ``DIR/rollout_data/<rollout_id>.pt``),
``steps`` (local sample indices per optimizer step and micro-batch) and the per-sample lists
``tokens`` (int64 ``[L_i]``), ``response_lengths``, ``loss_masks``, ``advantages``, ``returns``,
``old_log_probs``, ``ref_log_probs``, ``rollout_log_probs`` (float32 ``[T_i]``, or None when
the run has none) and ``rewards``.
"""

from __future__ import annotations

import os

__all__ = ["FIELDS", "dump_train_data"]

FIELDS = ("tokens", "response_lengths", "loss_masks", "advantages", "returns", "old_log_probs", "ref_log_probs",
          "rollout_log_probs", "rewards")


def dump_train_data(folder: str, rollout_id: int, shares: list) -> list[str]:
    """Write each rank's :class:`~furlong.core.train.worker.WorkerShare` (``shares[rank]``); return the paths."""
    import torch

    out = os.path.join(folder, "train_data")
    os.makedirs(out, exist_ok=True)
    paths = []
    for rank, share in enumerate(shares):
        batch = share.batch
        payload = {"rollout_id": int(rollout_id), "rank": rank, "sample_ids": list(share.sample_ids),
                   "steps": batch.steps, **{name: _plain(getattr(batch, name)) for name in FIELDS}}
        path = os.path.join(out, f"{rollout_id}_{rank}.pt")
        torch.save(payload, f"{path}.tmp")
        os.replace(f"{path}.tmp", path)
        paths.append(path)
    return paths


def _plain(rows):
    import torch

    if rows is None:
        return None
    return [row.detach().cpu() if isinstance(row, torch.Tensor) else row for row in rows]
