"""Run configurations for tests that call a plugin directly: built through the parser, never by hand."""

from __future__ import annotations

import functools

from furlong.core.config.launch_args import launch_config
from furlong.hooks import DatasetSpec, PluginConfig, RunConfig


@functools.cache
def flag_defaults() -> RunConfig:
    """The configuration of a run given no flag: every flag (installed plugins' included) at its
    default, nothing derived by a plugin's ``configure``. ``.replace(name=value)`` varies one field."""
    return launch_config(configure=False)


def training_dataset(config: RunConfig, path: str | None = None) -> DatasetSpec:
    """What a run hands ``data_source`` for its training data: ``--prompt-data`` (or ``path`` in its
    place) with the run's keys, shuffling and prompt-length limit."""
    return DatasetSpec(path=str(path) if path is not None else config.prompt_data, flag="--prompt-data",
                       input_key=config.input_key, label_key=config.label_key, metadata_key=config.metadata_key,
                       tool_key=config.tool_key, shuffle=config.rollout_shuffle, seed=config.rollout_seed,
                       max_prompt_len=config.rollout_max_prompt_len)


def with_derived(config: RunConfig, plugin: str, **values) -> RunConfig:
    """``config`` with ``values`` in ``plugin``'s section, as its ``configure`` derives them: for a unit
    test that builds a plugin's object without running that ``configure`` (which would start processes)."""
    section = PluginConfig(plugin, {**config.plugin_config(plugin), **values})
    return config.replace(plugins={**config.plugins, plugin: section})
