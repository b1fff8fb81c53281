"""Zero reward: every sample scores 0.0, for runs whose learning signal is not a reward.

Pure on-policy distillation (``--use-opd``) learns from the teacher's log-probs alone: the
advantage is the OPD term. Miles' ``--custom-rm-path miles.rollout.on_policy_distillation.reward_func``
selects this plugin (furlong asks the teacher itself, before the reward; docs/miles.md).
"""

from __future__ import annotations

from furlong.hooks import hookimpl

__all__ = ["reward"]


@hookimpl
def reward(config, samples):
    """Score each sample 0.0. Flags: none.

    :param samples: finished samples (nothing is read).
    :returns: ``[0.0] * len(samples)``.
    """
    return [0.0] * len(samples)
