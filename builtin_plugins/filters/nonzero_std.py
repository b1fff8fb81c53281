"""DAPO dynamic sampling: keep a group only if its rewards differ (Yu et al. 2025, DAPO, sec. 3.2)."""

from __future__ import annotations

import math

from furlong.hooks import FilterResult, PluginError, hookimpl
from furlong.kit.rewards import reward_scalar

__all__ = ["filter", "reward_std"]

MIN_STD = 1e-8


@hookimpl
def filter(config, samples):
    """Keep the group iff the sample standard deviation of its rewards exceeds 1e-8.

    A group whose samples all scored alike gives every sample a zero GRPO advantage, so it
    carries no gradient; DAPO drops it and samples more. Rewards are read as float64 (dict
    rewards through ``--reward-key``); the standard deviation is Bessel-corrected
    (``sqrt(sum((r - mean)^2) / (N - 1))``, like ``torch.std``), so a one-sample group
    (undefined, NaN) is dropped.

    Flags: ``--reward-key`` when rewards are dicts.

    :param samples: one prompt's group, rewards set.
    :returns: ``FilterResult(True)``, or ``FilterResult(False, "zero_std_<round(r_0, 1)>")``
        when dropped (``zero_std_0.0``, ``zero_std_1.0``...; ``r_0`` is the first reward).
    :raises PluginError: a reward that is None, or a dict reward without ``--reward-key``
        or without that key.

    Reference: Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at
    Scale", sec. 3.2 (dynamic sampling).
    """
    if not samples:
        return FilterResult(False, "empty_group")
    key = config.reward_key
    rewards = [_scalar(s, key) for s in samples]
    if reward_std(rewards) > MIN_STD:
        return FilterResult(True)
    return FilterResult(False, f"zero_std_{round(rewards[0], 1)}")


def reward_std(rewards: list[float]) -> float:
    """Bessel-corrected standard deviation in float64; NaN for fewer than two rewards."""
    n = len(rewards)
    if n < 2:
        return math.nan
    mean = math.fsum(rewards) / n
    return math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / (n - 1))


def _scalar(sample, key: str | None) -> float:
    value = reward_scalar(sample.reward, key, f"filter 'check_reward_nonzero_std': sample {sample.index}")
    if value is None:
        raise PluginError(f"filter 'check_reward_nonzero_std': sample {sample.index} (status "
                          f"{sample.status.value}) has no reward; the filter needs scored groups.")
    return value
