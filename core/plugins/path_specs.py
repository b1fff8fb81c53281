"""Hooks behind Miles' dotted-path flags that no public hook covers.

``--rollout-sample-filter-path``, ``--rollout-all-samples-process-path``,
``--custom-reward-post-process-path`` and ``--custom-megatron-post-save-hook-path`` name a
user function that runs at one point of the loop. Each is wrapped in an adapter plugin
(:mod:`furlong.core.plugins.adapters`) registered under the path, and the core calls it
through the plugin manager like any chosen hook (timed, reported to ``on_hook_call``).
These hooks are reached only through their flag; they are not part of the plugin
contract (``furlong.hooks``). The core passes ``config``; the adapter hands the user's
function ``args``, the Namespace view Miles-style functions take.
"""

from __future__ import annotations

from argparse import Namespace

from furlong.hooks import RunConfig, Sample
from furlong.hooks.markers import hookspec

__all__ = ["PATH_HOOKS", "post_save", "reward_post_process", "rollout_all_samples_process", "rollout_sample_filter"]

# hook -> attribute of the dotted-path flag that chooses it (the flag: "--" + the attribute with dashes)
PATH_HOOKS: dict[str, str] = {
    "rollout_sample_filter": "rollout_sample_filter_path",
    "rollout_all_samples_process": "rollout_all_samples_process_path",
    "reward_post_process": "custom_reward_post_process_path",
    "post_save": "custom_megatron_post_save_hook_path",
}


@hookspec
def rollout_sample_filter(config: RunConfig, args: Namespace, samples: list[list[Sample]]) -> None:
    """Look at the rollout's groups to train on, sorted by first index; may set ``remove_sample``.

    Call: chosen by ``--rollout-sample-filter-path``, once per rollout. May be ``async def``.
    """


@hookspec
def rollout_all_samples_process(config: RunConfig, args: Namespace, all_samples: list[list[Sample]], data_source) -> None:
    """See every group that finished generating this rollout, kept or not, sorted by first index.

    Call: chosen by ``--rollout-all-samples-process-path``, once per rollout, with the data
    cursor as ``data_source``. May be ``async def``.
    """


@hookspec
def reward_post_process(config: RunConfig, args: Namespace, samples: list[Sample]) -> tuple[list[float], list[float]]:
    """``(raw, rewards)``: one raw and one trained-on reward per sample, in sample order.

    Call: chosen by ``--custom-reward-post-process-path``, once per train step's rollout.
    """


@hookspec
def post_save(config: RunConfig, args: Namespace, rollout_id: int, ckpt_dir: str, hf_dir: str | None) -> None:
    """Run after checkpoint ``ckpt_dir`` is complete and marked latest (and the ``--save-hf`` export
    ``hf_dir``, or None, is written).

    Call: chosen by ``--custom-megatron-post-save-hook-path``, once per save, in the process that
    wrote the marker; a plain function.
    """
