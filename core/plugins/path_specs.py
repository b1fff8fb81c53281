"""Hooks behind Miles' dotted-path flags that no public hook covers.

``--rollout-sample-filter-path``, ``--rollout-all-samples-process-path``,
``--custom-reward-post-process-path``, ``--custom-megatron-post-save-hook-path``,
``--custom-rollout-log-function-path``, ``--custom-eval-rollout-log-function-path``,
``--eval-function-path``, ``--custom-tis-function-path``, ``--custom-convert-samples-to-train-data-path`` and
``--rollout-data-postprocess-path`` name a user function that runs at one point of the loop. Each is wrapped in an adapter plugin
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

__all__ = ["PATH_HOOKS", "convert_samples_to_train_data", "eval_function", "eval_rollout_log", "post_save",
           "reward_post_process", "rollout_all_samples_process", "rollout_data_postprocess", "rollout_log",
           "rollout_sample_filter", "tis_function"]

# hook -> attribute of the dotted-path flag that chooses it (the flag: "--" + the attribute with dashes)
PATH_HOOKS: dict[str, str] = {
    "rollout_sample_filter": "rollout_sample_filter_path",
    "rollout_all_samples_process": "rollout_all_samples_process_path",
    "reward_post_process": "custom_reward_post_process_path",
    "post_save": "custom_megatron_post_save_hook_path",
    "rollout_log": "custom_rollout_log_function_path",
    "eval_rollout_log": "custom_eval_rollout_log_function_path",
    "eval_function": "eval_function_path",
    "tis_function": "custom_tis_function_path",
    "convert_samples_to_train_data": "custom_convert_samples_to_train_data_path",
    "rollout_data_postprocess": "rollout_data_postprocess_path",
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


@hookspec
def rollout_log(config: RunConfig, args: Namespace, rollout_id: int, samples: list[Sample], extra: dict,
                rollout_time: float | None) -> bool:
    """Log one rollout your own way; True: the default sample metrics of the rollout are not logged.

    Call: chosen by ``--custom-rollout-log-function-path`` (Miles' ``fn(rollout_id, args, samples,
    rollout_extra_metrics, rollout_time)``), once per rollout in the driver, with the samples trained on
    (groups flattened, in order), the rollout's own metrics (``rollout/...`` from the rollout plugin, dynamic
    sampling, ``perf/rollout_time``) and the rollout's seconds. May be ``async def``.
    """


@hookspec
def eval_rollout_log(config: RunConfig, args: Namespace, rollout_id: int, data: dict, extra: dict) -> bool:
    """Log one evaluation your own way; True: the default ``eval/`` metrics are not logged.

    Call: chosen by ``--custom-eval-rollout-log-function-path`` (Miles' ``fn(rollout_id, args, data,
    extra_metrics)``), once per evaluation on the rollout side. ``data[name]`` per eval set:
    ``{"rewards": [float or None], "truncated": [bool], "samples": [Sample]}``; ``extra``: ``perf/eval_time``.
    May be ``async def``.
    """


@hookspec
def tis_function(config: RunConfig, args: Namespace, pg_loss, train_log_probs: list, rollout_log_probs: list,
                 loss_masks: list, total_lengths: list[int], response_lengths: list[int]) -> tuple:
    """Importance weights of one micro-batch's policy-gradient term: ``(pg_loss, loss_masks, metrics)``.

    Call: chosen by ``--custom-tis-function-path`` under ``--use-tis`` or ``--get-mismatch-metrics``, once per
    micro-batch in the train worker, as Miles calls it: ``fn(args=..., pg_loss=..., train_log_probs=...,
    rollout_log_probs=..., loss_masks=..., total_lengths=..., response_lengths=..., parallel_state=None,
    max_seq_lens=None)``. ``pg_loss``: float32 ``[sum T_i]`` (the loss plugin's ``pg_loss``, carrying grad);
    the lists hold N tensors ``[T_i]`` (``train_log_probs``: pi_old as the trainer computed it). Returns the
    weighted ``pg_loss`` ``[sum T_i]``, N masks ``[T_i]`` (tokens it rejects get 0: they leave the loss's
    numerator, not its denominators) and ``{name: float32 [sum T_i]}`` metrics reduced over the given masks.
    """


@hookspec
def convert_samples_to_train_data(config: RunConfig, args: Namespace, samples: list[Sample]) -> dict:
    """The rollout's train data in Miles' dict form, replacing the core's conversion.

    Call: chosen by ``--custom-convert-samples-to-train-data-path`` (Miles' ``fn(args, samples) -> dict``),
    once per rollout in the driver, with the samples trained on (sorted by index). Keys read:
    ``tokens``, ``response_lengths``, ``rewards``, ``loss_masks`` (one per sample) and the optional
    ``raw_reward``, ``truncated``, ``sample_indices``, ``rollout_log_probs``.
    """


@hookspec
def rollout_data_postprocess(config: RunConfig, args: Namespace, rollout_data: dict) -> None:
    """Look at (and change in place) the rollout's train data once log-probs and advantages are known.

    Call: chosen by ``--rollout-data-postprocess-path``, once per rollout in the driver, before the
    loss denominators are computed. Miles calls ``fn(args)``; a function with a second parameter also
    gets ``rollout_data``: ``{"tokens", "response_lengths", "loss_masks", "log_probs", "ref_log_probs",
    "rollout_log_probs", "advantages", "returns", "rewards"}`` (per-token values as lists of float32
    ``[T_i]``; None where the run has none). Changing ``loss_masks[i]`` in place changes what trains.
    """


@hookspec
def eval_function(config: RunConfig, args: Namespace, rollout_id: int, context) -> object:
    """Run one whole evaluation your own way, instead of the built-in one over the eval sets.

    Call: chosen by ``--eval-function-path`` (Miles' ``fn(args, rollout_id, data_source, evaluation=True)``: here
    the third argument is an :class:`~furlong.core.rollout.eval_function.EvalContext`, with the engine to generate
    on, ``generate_group`` and the eval sets), once per evaluation on the rollout side; ``evaluation=True`` is
    passed when the function takes it. May be ``async def``.

    :returns: Miles' eval data ``{set name: {"rewards": [float or None], "truncated": [bool] (optional),
        "samples": [Sample] (optional)}}``, or ``(data, metrics)``, or an object with ``data`` and ``metrics``
        attributes (Miles' ``RolloutFnEvalOutput``); ``metrics`` (a dict of numbers) is logged beside.
    """
