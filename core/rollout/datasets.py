"""What the ``data_source`` hook reads: the :class:`~furlong.hooks.DatasetSpec` of the training data and of each
evaluation set."""

from __future__ import annotations

from furlong.hooks import DatasetSpec, RunConfig

from ..config.eval_config import EvalDataset

__all__ = ["eval_dataset", "train_dataset"]


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
    lone = config.eval_prompt_data_lone and not config.eval_config  # the user typed no name: none to show
    flag = (f"--eval-config dataset '{ds.name}'" if config.eval_config
            else "--eval-prompt-data" if lone else f"--eval-prompt-data {ds.name}")
    return DatasetSpec(path=ds.path, flag=flag, name=ds.name, input_key=ds.input_key, label_key=ds.label_key,
                       metadata_key=ds.metadata_key, tool_key=ds.tool_key, shuffle=False, seed=config.rollout_seed,
                       max_prompt_len=config.eval_max_prompt_len)
