"""Per-sample reward resolution and the ``boxed_<name>`` rule (PLUGINS.md, hook ``reward``)."""

from __future__ import annotations

import copy
import logging

import attrs

from furlong.hooks import PluginError, RunConfig, Sample
from furlong.kit.answers import last_boxed_content
from furlong.kit.rewards import reward_key_of, reward_scalar
from furlong.hooks.contract import check_reward_list, check_reward_value

from ..plugins.manager import FurlongPluginManager
from ..plugins.selection import Selection, boxed_base, check_reward_name

__all__ = ["RewardScorer", "check_first_rows_name_a_reward"]

log = logging.getLogger("furlong.rewards")


class RewardScorer:
    """Scores samples with the reward plugin each one resolves to.

    Per sample: ``--custom-rm-path`` wins, then ``sample.metadata["rm_type"]``, then
    ``--rm-type``. ``boxed_<name>`` (with no plugin of that exact name) grades the content
    of the response's last ``\\boxed{}`` with plugin ``<name>``, handed over in the form
    that plugin reads (its module-level ``boxed_response(content)``, default
    ``\\boxed{content}``); a response without a box is graded as an empty response.
    """

    def __init__(self, config: RunConfig, pm: FurlongPluginManager, selection: Selection):
        self.config = config
        self.pm = pm
        self.default = selection.reward
        self._checked: set[str] = set()
        self._warned_none: set[str] = set()

    def resolve(self, sample: Sample) -> tuple[str, str]:
        """``(plugin name, flag or source)`` that scores ``sample``."""
        if self.default and self.default[1] == "--custom-rm-path":
            return self.default
        rm_type = sample.metadata.get("rm_type") if isinstance(sample.metadata, dict) else None
        if rm_type:
            if rm_type not in self._checked:
                check_reward_name(self.pm, rm_type, "metadata['rm_type']")
                self._checked.add(rm_type)
            return rm_type, "metadata['rm_type']"
        if self.default:
            return self.default
        raise PluginError(
            f"sample {sample.index}: reward type not specified. Pass --rm-type NAME or --custom-rm-path "
            "module.function, or give the sample metadata['rm_type']."
        )

    async def score(self, samples: list[Sample], evaluation: bool = False) -> None:
        """Set ``sample.reward`` for each sample (one call per resolved plugin, order kept).

        :param evaluation: the samples are evaluation samples: a dict reward is read with
            ``--eval-reward-key`` (default ``--reward-key``), else with ``--reward-key``.
        :raises PluginError: a reward plugin raised, returned the wrong number of rewards, or a
            reward the run cannot read (a dict without the key's entry: :func:`~furlong.kit.rewards.reward_scalar`);
            the message names the plugin and the sample index.
        """
        by_name: dict[tuple[str, str], list[Sample]] = {}
        for sample in samples:
            by_name.setdefault(self.resolve(sample), []).append(sample)
        for (name, flag), batch in by_name.items():
            rewards = await self._call(name, flag, batch, evaluation)
            for sample, value in zip(batch, rewards):
                sample.reward = value

    async def _call(self, name: str, flag: str, samples: list[Sample], evaluation: bool) -> list:
        base = boxed_base(self.pm, name)
        graded = [self._boxed(base, s) for s in samples] if base else samples
        plugin = base or name
        try:
            rewards = await self.pm.call_chosen("reward", plugin, flag, config=self.config, samples=graded)
        except PluginError:
            raise
        except Exception as exc:
            raise PluginError(
                f"reward plugin '{plugin}' ({self.pm.origin(plugin)}) failed on sample {samples[0].index}"
                f"{'' if len(samples) == 1 else f' (one of {len(samples)}: indices {[s.index for s in samples]})'}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        where = f"reward plugin '{plugin}' ({self.pm.origin(plugin)})"
        rewards = check_reward_list(rewards, len(samples), where, samples[0].index)
        for sample, value in zip(samples, rewards):
            self._check_value(plugin, sample, value, evaluation)
        return rewards

    def _check_value(self, plugin: str, sample: Sample, value, evaluation: bool) -> None:
        where = f"reward plugin '{plugin}' ({self.pm.origin(plugin)})"
        check_reward_value(value, where, sample.index)
        if isinstance(value, dict):  # told now, naming the plugin, not when a metric first reads it
            key, key_flag = reward_key_of(self.config, evaluation)
            reward_scalar(value, key, f"{where}, sample {sample.index}", key_flag)
        if value is None and plugin not in self._warned_none:
            self._warned_none.add(plugin)
            log.warning("%s returned None for sample %s; scored 0.0 (return a number to silence this)",
                        where, sample.index)

    def _boxed(self, base: str, sample: Sample) -> Sample:
        content = last_boxed_content(sample.response)
        if content is None:
            response = ""
        else:
            make = getattr(self.pm.get_plugin(base), "boxed_response", None)
            response = make(content) if callable(make) else f"\\boxed{{{content}}}"
        return attrs.evolve(sample, response=response)


def check_first_rows_name_a_reward(config: RunConfig, pm: FurlongPluginManager, source) -> None:
    """Without a run-wide reward (no ``--rm-type``, no ``--custom-rm-path``) every sample needs
    ``metadata["rm_type"]``: check the rows the first rollout draws now, before any model loads,
    rather than after a whole rollout was generated.

    The rows are read with the data source's ``next_rows`` and its position is put back with
    ``load_state(state())``, so the run draws them again.

    :param source: the train data source (``furlong.hooks.DataSource``).
    :raises PluginError: one of those rows names no reward; the message says how many and what to pass.
    """
    k = int(config.over_sampling_batch_size or config.rollout_batch_size or 1)
    state = copy.deepcopy(source.state())
    rows = source.next_rows(k)
    source.load_state(state)
    missing = [row for row in rows if not (isinstance(row.get("metadata"), dict) and row["metadata"].get("rm_type"))]
    if not missing:
        return
    prompt = str(missing[0].get("prompt"))
    prompt = prompt if len(prompt) <= 60 else prompt[:57] + "..."
    where = config.prompt_data or "the data"
    raise PluginError(
        f"no reward chosen: the run has neither --rm-type nor --custom-rm-path, and {len(missing)} of the {len(rows)} "
        f"prompts the first rollout draws from {where} name none in metadata['rm_type'] (the first: {prompt!r}). "
        f"Pass --rm-type NAME (installed: {', '.join(pm.names_for('reward'))}) or --custom-rm-path module.function, "
        "or give every row metadata['rm_type']."
    )
