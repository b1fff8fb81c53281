"""What the driver logs of each rollout's samples, and how often it prints the console line.

The sample metrics are :func:`~.metrics_log.rollout_metrics` plus what Miles' logging flags add
(:mod:`.extra_metrics`): ``passrate/pass@k`` (``--log-passrate``), ``rollout/error_cat/<value>``
(``--log-reward-category KEY``), ``rollout/correct_length/p25..p100`` and
``rollout/correct_entropy`` (``--log-correct-samples``), ``multi_turn/...`` (``--log-multi-turn``).
``--custom-rollout-log-function-path`` runs first; when it returns True these are not logged
(the training, timing and rollout-plugin metrics still are). ``--log-interval N`` prints the
console line after every N-th rollout and the last; ``metrics.jsonl`` and the loggers get every rollout.
"""

from __future__ import annotations

from furlong.hooks import RunConfig, Sample

from ..plugins.manager import FurlongPluginManager
from ..plugins.selection import Selection
from .extra_metrics import correct_sample_metrics, multi_turn_metrics, passrate_metrics, reward_category_metrics
from .metrics_log import rollout_metrics

__all__ = ["RolloutLog", "sample_metrics"]


class RolloutLog:
    """The sample-side part of a rollout's metrics, and the console cadence."""

    def __init__(self, config: RunConfig, pm: FurlongPluginManager, selection: Selection) -> None:
        self.config, self.pm = config, pm
        self.custom = selection.paths.get("rollout_log")

    async def metrics(self, rollout_id: int, groups: list[list[Sample]], extra: dict) -> dict:
        """The sample metrics of ``groups`` (:func:`sample_metrics`), or ``{}`` when the custom log function
        returned True.

        :param extra: the rollout side's metrics of this rollout (handed to the custom function).
        :raises PluginError: the custom function failed (named), or see :func:`sample_metrics`.
        """
        if self.custom is not None:
            samples = [s for g in groups for s in g]
            suppress = await self.pm.call_chosen("rollout_log", *self.custom, config=self.config, rollout_id=rollout_id,
                                                 samples=samples, extra=dict(extra),
                                                 rollout_time=extra.get("perf/rollout_time"))
            if suppress:
                return {}
        return sample_metrics(self.config, groups)

    def prints(self, rollout_id: int) -> bool:
        """Whether the console line of ``rollout_id`` is printed (``--log-interval``)."""
        return (rollout_id + 1) % self.config.log_interval == 0 or rollout_id >= self.config.num_rollout - 1


def sample_metrics(config: RunConfig, groups: list[list[Sample]]) -> dict:
    """:func:`~.metrics_log.rollout_metrics` of ``groups`` and the metrics the ``--log-*`` flags ask for.

    :raises PluginError: a reward the flags cannot read (a dict without ``--reward-key``, or without the
        ``--log-reward-category`` key).
    """
    samples = [s for g in groups for s in g]
    out = rollout_metrics(groups, config.reward_key)
    if config.log_passrate:
        rates = passrate_metrics(groups, config.n_samples_per_prompt, config.reward_key)
        out.update({f"passrate/{k}": v for k, v in rates.items()})
    if config.log_reward_category:
        out.update({f"rollout/{k}": v for k, v in reward_category_metrics(samples, config.log_reward_category).items()})
    if config.log_correct_samples:
        found = correct_sample_metrics(samples, config.reward_key, config.rollout_max_response_len)
        out.update({f"rollout/{k}": v for k, v in found.items()})
    if config.log_multi_turn:
        lengths = multi_turn_metrics(samples, config.rollout_max_response_len)
        out.update({f"multi_turn/{k}": v for k, v in lengths.items()})
    return out
