"""The ``DatasetSpec`` a run hands ``data_source`` for its training data, for tests that call a data source directly."""

from __future__ import annotations

from furlong.hooks import DatasetSpec, RunConfig


def training_dataset(config: RunConfig, path: str | None = None) -> DatasetSpec:
    """``--prompt-data`` (or ``path`` in its place) with the run's keys, shuffling and prompt-length limit."""
    return DatasetSpec(path=str(path) if path is not None else config.prompt_data, flag="--prompt-data",
                       input_key=config.input_key, label_key=config.label_key, metadata_key=config.metadata_key,
                       tool_key=config.tool_key, shuffle=config.rollout_shuffle, seed=config.rollout_seed,
                       max_prompt_len=config.rollout_max_prompt_len)
