"""The scalar a sample's reward stands for: the one reading of dict rewards that the reward scorer, the
metrics, the evaluation and the filters share (PLUGINS.md, hook ``reward``)."""

from __future__ import annotations

from typing import Any

from furlong.hooks import PluginError, RunConfig

__all__ = ["DICT_WITHOUT_KEY", "reward_key_of", "reward_scalar"]

DICT_WITHOUT_KEY = ("pass --reward-key naming the scalar to train on (the evaluation reads it too, unless "
                    "--eval-reward-key names another).")
"""What to do about a dict reward without a key: ``--eval-reward-key`` defaults to ``--reward-key``
(core/config/rules.py, ``EVAL_INHERITS``), so one flag serves training and evaluation."""


def reward_key_of(config: RunConfig, evaluation: bool) -> tuple[str | None, str]:
    """``(key, flag)``: the dict key that holds the scalar of a training (``--reward-key``) or evaluation
    (``--eval-reward-key``, which defaults to ``--reward-key``) reward, and the flag to name in an error: the
    one the user gave."""
    if not evaluation:
        return config.reward_key, "--reward-key"
    key = config.eval_reward_key or config.reward_key
    return key, "--eval-reward-key" if config.given("eval_reward_key") else "--reward-key"


def reward_scalar(reward: Any, key: str | None, where: str, flag: str = "--reward-key") -> float | None:
    """The scalar of one reward: a number as a float, ``reward[key]`` of a dict, None for None (unscored).

    :param where: what the error names first: the reward plugin and the sample (``reward plugin 'x'
        (dist 1.0), sample 3``), or the sample alone.
    :param flag: the flag that chose ``key`` (``--reward-key`` or ``--eval-reward-key``).
    :raises PluginError: a dict without ``key`` (``key`` None: which flag to pass; else the keys it has),
        or whose ``key`` entry is not a number.
    """
    if isinstance(reward, dict):
        keys = sorted(reward, key=str)
        if not key:
            raise PluginError(f"{where}: the reward is a dict with keys {keys}; {DICT_WITHOUT_KEY}")
        if key not in reward:
            raise PluginError(f"{where}: {flag} {key!r} is not in the reward dict (keys: {keys}).")
        reward = reward[key]
        try:
            return float(reward)
        except (TypeError, ValueError):
            raise PluginError(f"{where}: {flag} {key!r}: the reward dict holds {reward!r} there, not a "
                              "number.") from None
    return None if reward is None else float(reward)
