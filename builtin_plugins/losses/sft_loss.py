"""Supervised fine-tuning loss: negative log-likelihood of the response tokens."""

from __future__ import annotations

from furlong.hooks import LossOutput, hookimpl


@hookimpl
def loss(config, batch):
    """Per-token negative log-likelihood ``-logp_t``; the core's reducer averages it.

    Shapes: lists of ``N`` tensors [T_i]. Reads no flag (``config`` is unused). ``old_log_probs`` and
    ``advantages`` may be None (``--disable-compute-advantages-and-returns``).

    :param batch: ``LossInput`` with ``log_probs`` (current policy, carries grad).
    :returns: ``LossOutput(token_loss=[-logp_i], token_metrics={})``: float32 tensors
        [T_i]; the core reports the reduced value as ``loss``.

    Reference: maximum-likelihood training; Miles ``sft_loss_function``.
    """
    return LossOutput(token_loss=[-lp.float() for lp in batch.log_probs], token_metrics={})
