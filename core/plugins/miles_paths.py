"""Miles' own dotted paths that name a function furlong has as a built-in plugin.

A Miles launch script names Miles' functions by dotted path
(``--dynamic-sampling-filter-path miles.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std``,
``--custom-rm-path miles.rollout.rm_hub.remote_rm``, ``--rollout-function-path
miles.rollout.fully_async_rollout.FullyAsyncRolloutFn``...); those modules are not installed
beside furlong, so each path resolves to the built-in plugin that does the same thing,
with one info line naming it. The table is data: the path as Miles spells it
(radixark/miles at 31f1ca961a94cb860cec3b2dea34ec332bfa8f76: ``miles/rollout/filter_hub/``,
``rm_hub/``, ``on_policy_distillation.py``, ``data_source.py``, ``sglang_rollout.py``, ``generate_hub/``,
``fully_async_rollout.py``, ``sft_rollout.py``), the hook, the plugin's name. :data:`RM_TYPE` stands for the
reward plugin ``--rm-type`` names (Miles' ``async_rm`` dispatches on it).
"""

from __future__ import annotations

__all__ = ["CORE_DOES_IT", "MILES_BUILTINS", "MILES_EVAL_FUNCTIONS", "MILES_FLAG_CHOICES", "MILES_FUNCTION_FLAGS",
           "MILES_PACKAGES", "RM_TYPE", "miles_builtin", "unmapped_miles_path"]

RM_TYPE = "<--rm-type>"
CORE_DOES_IT = "<core>"
"""Stands for a Miles function whose work furlong's core does by itself: the path is dropped with an info line."""

# Miles' switch flag -> (hook, the built-in plugin it chooses): ``--fully-async`` is ``--rollout fully_async``
MILES_FLAG_CHOICES: dict[str, tuple[str, str]] = {
    "fully_async": ("rollout", "fully_async"),
}

# dotted path -> (hook, built-in plugin name)
MILES_BUILTINS: dict[str, tuple[str, str]] = {
    # filter hub
    "miles.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std":
        ("filter", "check_reward_nonzero_std"),
    "miles.rollout.filter_hub.common_filters.apply_reward_nonzero_std_filter": ("filter", "check_reward_nonzero_std"),
    "miles.rollout.filter_hub.dynamic_sampling_filters.check_no_aborted": ("filter", "no_aborted"),
    "miles.rollout.filter_hub.common_filters.apply_aborted_filter": ("filter", "no_aborted"),
    # reward hub
    "miles.rollout.rm_hub.remote_rm": ("reward", "remote_rm"),
    "miles.rollout.rm_hub.async_rm": ("reward", RM_TYPE),
    # on-policy distillation with a served teacher: the core asks the teacher (--use-opd --opd-type sglang)
    "miles.rollout.on_policy_distillation.reward_func": ("reward", "zero"),
    "miles.rollout.on_policy_distillation.post_process_rewards": ("reward_post_process", CORE_DOES_IT),
    # buffer and data source
    "miles.rollout.data_source.pop_first": ("buffer_pop", "pop_first"),
    "miles.rollout.data_source.RolloutDataSourceWithBuffer": ("data_source", "jsonl"),
    "miles.rollout.data_source.RolloutDataSource": ("data_source", "jsonl"),
    # rollout functions
    "miles.rollout.sglang_rollout.generate_rollout": ("rollout", "sync"),
    "miles.rollout.inference_rollout.inference_rollout_common.InferenceRolloutFn": ("rollout", "sync"),
    "miles.rollout.fully_async_rollout.FullyAsyncRolloutFn": ("rollout", "fully_async"),
    "miles.rollout.sft_rollout.generate_rollout": ("rollout", "sft"),
    # generate functions
    "miles.rollout.sglang_rollout.generate": ("generate", "single_turn"),
    "miles.rollout.generate_hub.single_turn.generate": ("generate", "single_turn"),
    "miles.rollout.generate_hub.multi_turn.generate": ("generate", "multi_turn"),
}

# flags Miles' own functions add to its parser (``generate.add_arguments``) -> (hook, the built-in that reads them):
# in Miles they exist only when that function is chosen, so given with another plugin they would do nothing
MILES_FUNCTION_FLAGS: dict[str, tuple[str, str]] = {
    "--generate-max-turns": ("generate", "multi_turn"),
    "--generate-tool-specs-path": ("generate", "multi_turn"),
    "--generate-tool-call-parser": ("generate", "multi_turn"),
    "--generate-execute-tool-function-path": ("generate", "multi_turn"),
}


# Miles' rollout functions given as --eval-function-path: each evaluates the eval sets the way furlong's
# built-in evaluation does (FullyAsyncRolloutFn serves eval on the rollout engines), so the core does it
MILES_EVAL_FUNCTIONS: frozenset[str] = frozenset({
    "miles.rollout.sglang_rollout.generate_rollout",
    "miles.rollout.inference_rollout.inference_rollout_common.InferenceRolloutFn",
    "miles.rollout.fully_async_rollout.FullyAsyncRolloutFn",
})


def miles_builtin(path: str, hook: str, rm_type: str | None = None) -> str | None:
    """The built-in plugin standing for Miles' ``path`` on ``hook``, or None (a path of the user's own).

    :param rm_type: ``--rm-type``, for the paths that dispatch on it (None: no plugin).
    """
    if hook == "eval_function":
        return CORE_DOES_IT if path in MILES_EVAL_FUNCTIONS else None
    entry = MILES_BUILTINS.get(path)
    if entry is None or entry[0] != hook:
        return None
    return rm_type if entry[1] == RM_TYPE else entry[1]


MILES_PACKAGES = ("miles", "miles_plugins")
"""Top-level packages of Miles itself; furlong never imports them."""


def unmapped_miles_path(path: str, hook: str, flag: str) -> str | None:
    """The error for a dotted path into Miles itself that no built-in stands for, or None.

    Miles' functions take Miles' own arguments and reach Miles' SGLang client, so furlong
    never imports them (installed or not): the message names the built-ins of the same hook
    that Miles' mapped paths resolve to, which is what to use instead.
    """
    if path.split(".", 1)[0] not in MILES_PACKAGES:
        return None
    names = {name for mapped, name in MILES_BUILTINS.values() if mapped == hook}
    same_hook = sorted(names - {CORE_DOES_IT, RM_TYPE}) + (["the --rm-type reward"] if RM_TYPE in names else [])
    if hook == "eval_function":
        instead = ("leave --eval-function-path out for furlong's built-in evaluation of the eval sets, or write the "
                   "function yourself (docs/miles.md, \"Evaluation\")")
    elif same_hook:
        instead = f"choose one of furlong's built-in {hook} plugins instead ({', '.join(same_hook)})"
    else:
        instead = "furlong has no built-in that does the same: write it as a furlong plugin (PLUGINS.md)"
    return (f"{flag} '{path}' names a function of Miles itself, which furlong does not import: {instead}. "
            f"docs/miles.md (\"Miles' own dotted paths\") lists the Miles paths furlong maps to its built-ins.")
