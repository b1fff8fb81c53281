"""``--num-epoch``: the number of rollouts from the dataset size, once the data is loaded.

Miles' rule: an epoch is ``dataset_size // rollout_batch_size`` rollouts (prompts per
rollout; the remainder rolls over into the next epoch) and ``num_rollout = epochs x that``;
``--num-rollout``, when given too, wins. The LR schedule's length (``--lr-decay-iters``),
derived from ``--num-rollout`` when not given, follows, and checkpoints and evaluations
also happen at each epoch's end (``config.num_rollout_per_epoch``, read by
:func:`furlong.core.run.checkpoints.periodic`'s callers).
"""

from __future__ import annotations

import logging

from furlong.hooks import PluginError, RunConfig

from ..config.train_rules import steps_per_rollout

__all__ = ["derive_num_rollout"]

log = logging.getLogger("furlong.config")


def derive_num_rollout(config: RunConfig, dataset_size: int | None, source: str) -> RunConfig:
    """``config`` with ``num_rollout``, ``num_rollout_per_epoch`` (and ``lr_decay_iters`` when not
    given) derived from ``--num-epoch``.

    ``config`` itself when ``--num-epoch`` is not given or ``--num-rollout`` is.

    :param dataset_size: prompts in the train data (after the data source's own
        filtering), or None when the data source cannot tell (no ``__len__``).
    :param source: the data source plugin's name, for the error.
    :raises PluginError: the size is unknown, or too small for one rollout.
    """
    if config.num_epoch is None or config.num_rollout is not None:
        return config
    if dataset_size is None:
        raise PluginError(f"--num-epoch needs the dataset size, but data source '{source}' has no len(); "
                          f"give --num-rollout instead.")
    per_epoch = dataset_size // config.rollout_batch_size
    if per_epoch < 1:
        raise PluginError(f"--num-epoch: {dataset_size} prompts are less than one rollout of "
                          f"--rollout-batch-size {config.rollout_batch_size}.")
    num_rollout = per_epoch * config.num_epoch
    derived = config.replace(num_rollout_per_epoch=per_epoch, num_rollout=num_rollout)
    if not config.given("lr_decay_iters"):
        derived = derived.replace(lr_decay_iters=num_rollout * steps_per_rollout(derived))
    log.info("--num-epoch %d x (%d prompts // --rollout-batch-size %d): --num-rollout %d.", config.num_epoch,
             dataset_size, config.rollout_batch_size, num_rollout)
    return derived
