"""What varies per hook call travels as a hook argument: the data set a ``data_source`` reads
(:class:`~furlong.hooks.DatasetSpec`) and the index of the engine a ``rollout_engine`` makes."""

import asyncio

from furlong.core.config.eval_config import load_eval_datasets
from furlong.core.config.launch_args import launch_config
from furlong.hooks.old_form import old_form_args
from furlong.core.rollout.datasets import eval_dataset, train_dataset
from furlong.core.rollout.engines import EngineFactory
from furlong.hooks import DatasetSpec, hookimpl


def test_the_training_data_is_the_prompt_data_with_the_run_s_keys_shuffle_and_length_limit():
    config = launch_config("--prompt-data", "train.jsonl", "--input-key", "question", "--label-key", "answer",
                           "--rollout-shuffle", "--rollout-seed", "7", "--rollout-max-prompt-len", "100",
                           configure=False)
    assert train_dataset(config) == DatasetSpec(
        path="train.jsonl", flag="--prompt-data", name=None, input_key="question", label_key="answer",
        metadata_key=config.metadata_key, tool_key=config.tool_key, shuffle=True, seed=7, max_prompt_len=100)


def test_an_eval_set_keeps_its_own_keys_is_never_shuffled_and_names_its_flag():
    config = launch_config("--prompt-data", "train.jsonl", "--rollout-shuffle", "--eval-prompt-data", "aime",
                           "a.jsonl", "--eval-input-key", "problem", "--eval-max-prompt-len", "50", configure=False)
    [ds] = load_eval_datasets(config)
    spec = eval_dataset(config, ds)
    assert (spec.path, spec.flag, spec.name, spec.input_key, spec.shuffle, spec.max_prompt_len) == (
        "a.jsonl", "--eval-prompt-data aime", "aime", "problem", False, 50)
    assert spec.evaluation and not train_dataset(config).evaluation


def test_a_data_source_plugin_still_reading_args_sees_the_data_set_it_reads():
    config = launch_config("--prompt-data", "train.jsonl", "--eval-prompt-data", "aime", "a.jsonl",
                           "--eval-input-key", "problem", configure=False)
    dataset = eval_dataset(config, load_eval_datasets(config)[0])
    view = old_form_args({"config": config, "dataset": dataset})
    assert (view.prompt_data, view.prompt_data_flag, view.input_key, view.rollout_shuffle) == (
        "a.jsonl", "--eval-prompt-data aime", "problem", False)
    assert config.prompt_data == "train.jsonl"  # the run's configuration is unchanged
    assert old_form_args({"config": config, "engine_index": 2}).rollout_engine_index == 2


class _Engine:
    """An engine with every method the core checks for; none is called here."""

    tokenizer = context_len = None
    weight_update_ranks = 1
    methods = ("generate", "abort", "pause_generation", "continue_generation", "flush_cache", "load_weights",
               "set_weight_version", "release_memory", "resume_memory", "health")

    def __init__(self, index):
        self.index = index
        for name in self.methods:
            setattr(self, name, self._unused)

    async def _unused(self, *args):
        raise AssertionError("not called in these tests")


def test_each_engine_gets_its_index_as_an_argument(plugin_manager, register_plugin):
    seen = []

    class Plugin:
        @hookimpl
        def rollout_engine(self, config, engine_index):
            seen.append((config.seed, engine_index))
            return _Engine(engine_index)

    register_plugin(Plugin(), "indexed")
    config = launch_config("--seed", "3", configure=False)
    make = EngineFactory(config, ("indexed", "--rollout-backend"), plugin_manager)
    engines = [asyncio.run(make(0)), asyncio.run(make(1))]
    assert [e.index for e in engines] == [0, 1] and seen == [(3, 0), (3, 1)]
