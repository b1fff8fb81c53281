"""What a train backend's ``load(path)`` restores from a checkpoint of its own, by the run's flags.

``--load`` resumes everything; ``--no-load-optim`` keeps the fresh optimizer (and, on the
megatron backend, its learning-rate schedule); ``--no-load-rng`` keeps this process's random
state; ``--finetune`` loads the weights only: fresh optimizer, schedule and RNG, and the step
count starts at 0 (Megatron-LM ``megatron/training/checkpointing.py``, ``load_checkpoint``:
under ``args.finetune`` the iteration is 0 and neither the optimizer, the scheduler nor the
RNG states are read). The core starts such a run at rollout 0 with the data from its start
(``furlong.core.run.checkpoints.resolve_start``).
"""

from __future__ import annotations

import attrs

from furlong.hooks import RunConfig

__all__ = ["LoadParts", "load_parts"]


@attrs.frozen
class LoadParts:
    """The parts of a checkpoint to restore besides the weights (always restored).

    ``optimizer``: the optimizer's state (and a saved schedule). ``rng``: the random states.
    ``step``: the global optimizer-step count (the learning-rate schedule's position); False
    starts it at 0.
    """

    optimizer: bool
    rng: bool
    step: bool


def load_parts(config: RunConfig) -> LoadParts:
    """The :class:`LoadParts` ``config`` asks for (``--finetune``, ``--no-load-optim``, ``--no-load-rng``)."""
    finetune = bool(config.finetune)
    return LoadParts(optimizer=not (finetune or config.no_load_optim), rng=not (finetune or config.no_load_rng),
                     step=not finetune)
