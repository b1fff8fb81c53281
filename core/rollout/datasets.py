"""What the ``data_source`` hook reads: the :class:`~furlong.hooks.DatasetSpec` of the training data and of each
evaluation set."""

from __future__ import annotations

from argparse import Namespace

from furlong.hooks import DatasetSpec, RunConfig

from ..config.eval_config import EvalDataset

__all__ = ["data_source_kwargs", "eval_dataset", "train_dataset"]


def train_dataset(config: RunConfig) -> DatasetSpec:
    """The training data: ``--prompt-data`` with the run's row keys, shuffled with ``--rollout-seed`` under
    ``--rollout-shuffle``, prompts longer than ``--rollout-max-prompt-len`` dropped."""
    flag = f"--data-source-path {config.data_source_path}" if config.data_source_path else "--prompt-data"
    return DatasetSpec(path=config.prompt_data, flag=flag, input_key=config.input_key, label_key=config.label_key,
                       metadata_key=config.metadata_key, tool_key=config.tool_key, shuffle=config.rollout_shuffle,
                       seed=config.rollout_seed, max_prompt_len=config.rollout_max_prompt_len)


def eval_dataset(config: RunConfig, ds: EvalDataset) -> DatasetSpec:
    """Evaluation set ``ds``: its own path and row keys, never shuffled, prompts longer than
    ``--eval-max-prompt-len`` dropped."""
    flag = f"--eval-config dataset '{ds.name}'" if config.eval_config else f"--eval-prompt-data {ds.name}"
    return DatasetSpec(path=ds.path, flag=flag, name=ds.name, input_key=ds.input_key, label_key=ds.label_key,
                       metadata_key=ds.metadata_key, tool_key=ds.tool_key, shuffle=False, seed=config.rollout_seed,
                       max_prompt_len=config.eval_max_prompt_len)


def data_source_kwargs(config: RunConfig, dataset: DatasetSpec) -> dict:
    """The ``data_source`` hook's arguments for reading ``dataset``."""
    # transitional, until the data source plugins read `dataset`: `args` is a view pointed at it
    return {"config": config, "dataset": dataset, "args": _source_view(config, dataset)}


def _source_view(config: RunConfig, dataset: DatasetSpec) -> Namespace:
    view = config.namespace()
    view.prompt_data, view.prompt_data_flag = dataset.path, dataset.flag
    view.input_key, view.label_key = dataset.input_key, dataset.label_key
    view.metadata_key, view.tool_key = dataset.metadata_key, dataset.tool_key
    view.rollout_shuffle, view.rollout_max_prompt_len = dataset.shuffle, dataset.max_prompt_len
    return view
