"""The metrics Miles' logging flags add: ``--log-passrate``, ``--log-reward-category``,
``--log-correct-samples``, ``--log-multi-turn`` (names without their ``rollout/``/``eval/`` prefix).

A sample is correct when its scalar reward is exactly 1, as in Miles.
"""

from __future__ import annotations

import logging
import math
import statistics
from typing import Iterable

from furlong.hooks import PluginError, RunConfig, Sample
from furlong.kit.rewards import reward_key_of

from .metrics_log import eval_metrics, scalar_reward

__all__ = ["correct_sample_metrics", "eval_set_metrics", "multi_turn_metrics", "pass_at_k", "passrate_metrics",
           "reward_category_metrics"]

log = logging.getLogger("furlong")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``c`` correct samples out of ``n``: ``1 - C(n-c, k) / C(n, k)``.

    Reference: Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1.
    """
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def passrate_metrics(groups: Iterable[list[Sample]], group_size: int, reward_key: str | None,
                     flag: str = "--reward-key") -> dict[str, float]:
    """``pass@k`` for ``k = 1, 2, 4, ...`` up to ``group_size``: the mean of :func:`pass_at_k` over the groups
    of exactly ``group_size`` samples (others are left out, with a warning). ``{}`` when ``group_size`` is 1 or no
    group is complete.

    :raises PluginError: a dict reward without ``reward_key`` (named by ``flag``).
    """
    groups = list(groups)
    complete = [g for g in groups if len(g) == group_size]
    if len(complete) < len(groups):
        log.warning("pass@k: %d of %d groups do not have %d samples and are left out.", len(groups) - len(complete),
                    len(groups), group_size)
    if group_size <= 1 or not complete:
        return {}
    correct = [sum(1 for s in g if scalar_reward(s, reward_key, flag) == 1) for g in complete]
    ks = [2 ** i for i in range(int(math.log2(group_size)) + 1)]
    return {f"pass@{k}": statistics.fmean(pass_at_k(group_size, c, k) for c in correct) for k in ks}


def reward_category_metrics(samples: list[Sample], key: str) -> dict[str, float]:
    """``error_cat/<value>``: the share of ``samples`` whose reward dict holds ``value`` under ``key``
    (``--log-reward-category KEY``).

    :raises PluginError: a sample's reward is not a dict holding ``key`` (the sample is named).
    """
    counts: dict[str, int] = {}
    for sample in samples:
        reward = sample.reward
        if not isinstance(reward, dict) or key not in reward:
            raise PluginError(f"--log-reward-category {key}: sample {sample.index}'s reward {reward!r} is not a dict "
                              f"with the key '{key}'; the reward function must return one.")
        counts[str(reward[key])] = counts.get(str(reward[key]), 0) + 1
    return {f"error_cat/{value}": count / len(samples) for value, count in counts.items()} if samples else {}


def correct_sample_metrics(samples: list[Sample], reward_key: str | None, max_response_len: int) -> dict[str, float]:
    """Of the correct samples: ``correct_length/p25|p50|p75|p100``, the share whose response length falls in each
    quarter of ``max_response_len`` (tokens; lengths above it are not counted), and ``correct_entropy``, the
    mean over them of each sample's mean negative rollout log-prob over its loss mask (nats per token; only
    when every correct sample has rollout log-probs). No correct sample: the shares are 0, the entropy 0.
    """
    correct = [s for s in samples if scalar_reward(s, reward_key, "--reward-key") == 1]
    cuts = [max_response_len * q / 4 for q in (1, 2, 3)] + [max_response_len]
    counts = [0] * 4
    for sample in correct:
        quarter = next((i for i, cut in enumerate(cuts) if sample.response_length <= cut), None)
        if quarter is not None:
            counts[quarter] += 1
    total = sum(counts)
    out = {f"correct_length/p{25 * (i + 1)}": (c / total if total else 0.0) for i, c in enumerate(counts)}
    if all(s.rollout_log_probs is not None for s in correct):
        out["correct_entropy"] = statistics.fmean(_mean_nll(s) for s in correct) if correct else 0.0
    return out


def _mean_nll(sample: Sample) -> float:
    mask = sample.loss_mask if sample.loss_mask is not None else [1] * sample.response_length
    kept = [-lp for lp, m in zip(sample.rollout_log_probs, mask) if m]
    return statistics.fmean(kept) if kept else 0.0


def multi_turn_metrics(samples: list[Sample], max_response_len: int) -> dict[str, float]:
    """Response lengths of multi-turn samples, with and without the tool/observation tokens, and their turns.

    ``raw_response_length/response_length_{mean,max,min}``: ``response_length`` (tokens, observations
    included); ``.../response_length_clip_ratio``: the share at ``max_response_len`` or longer;
    ``wo_obs_response_length/response_length_{mean,max,min}``: tokens trained on (``sum(loss_mask)``);
    ``multi_turn_metric/round_number_{mean,max,min}``: ``metadata["round_number"]`` of the samples that have it.
    """
    if not samples:
        return {}
    raw = [s.response_length for s in samples]
    trained = [s.effective_response_length for s in samples]
    out = {
        "raw_response_length/response_length_mean": statistics.fmean(raw),
        "raw_response_length/response_length_max": float(max(raw)),
        "raw_response_length/response_length_min": float(min(raw)),
        "raw_response_length/response_length_clip_ratio": sum(r >= max_response_len for r in raw) / len(raw),
        "wo_obs_response_length/response_length_mean": statistics.fmean(trained),
        "wo_obs_response_length/response_length_max": float(max(trained)),
        "wo_obs_response_length/response_length_min": float(min(trained)),
    }
    rounds = [s.metadata["round_number"] for s in samples if "round_number" in (s.metadata or {})]
    if rounds:
        out.update({"multi_turn_metric/round_number_mean": statistics.fmean(rounds),
                    "multi_turn_metric/round_number_max": float(max(rounds)),
                    "multi_turn_metric/round_number_min": float(min(rounds))})
    return out


def eval_set_metrics(config: RunConfig, name: str, samples: list[Sample], group_size: int) -> dict:
    """:func:`~.metrics_log.eval_metrics` of eval set ``name`` plus ``eval/<name>-pass@k`` (``--log-passrate``,
    over groups of ``group_size`` = the set's samples per prompt) and ``eval/<name>/error_cat/<value>``
    (``--log-reward-category``).

    :raises PluginError: a reward the flags cannot read.
    """
    key, flag = reward_key_of(config, evaluation=True)
    out = eval_metrics(name, samples, key)
    if config.log_passrate:
        groups: dict = {}
        for sample in samples:
            groups.setdefault(sample.group_index, []).append(sample)
        rates = passrate_metrics(groups.values(), group_size, key, flag)
        out.update({f"eval/{name}-{k}": v for k, v in rates.items()})
    if config.log_reward_category:
        shares = reward_category_metrics(samples, config.log_reward_category)
        out.update({f"eval/{name}/{k}": v for k, v in shares.items()})
    return out
