"""Miles' own dotted paths that name a function furlong has as a built-in plugin.

A Miles launch script names Miles' filter hub by dotted path
(``--dynamic-sampling-filter-path miles.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std``);
that module is not installed beside furlong, so the path resolves to the built-in plugin
that does the same thing, with one info line. The table is data: the path as Miles spells
it (radixark/miles, ``miles/rollout/filter_hub/``), the hook, the plugin's name.
"""

from __future__ import annotations

__all__ = ["MILES_BUILTINS", "miles_builtin"]

# dotted path -> (hook, built-in plugin name)
MILES_BUILTINS: dict[str, tuple[str, str]] = {
    "miles.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std": ("filter", "check_reward_nonzero_std"),
    "miles.rollout.filter_hub.common_filters.apply_reward_nonzero_std_filter": ("filter", "check_reward_nonzero_std"),
    "miles.rollout.filter_hub.dynamic_sampling_filters.check_no_aborted": ("filter", "no_aborted"),
    "miles.rollout.filter_hub.common_filters.apply_aborted_filter": ("filter", "no_aborted"),
}


def miles_builtin(path: str, hook: str) -> str | None:
    """The built-in plugin standing for Miles' ``path`` on ``hook``, or None (a path of the user's own)."""
    entry = MILES_BUILTINS.get(path)
    return entry[1] if entry is not None and entry[0] == hook else None
