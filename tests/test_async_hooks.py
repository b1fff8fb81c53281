"""Hooks implemented as ``async def`` are awaited in the running loop wherever they are called.

The train path always awaited ``data_source``; eval data sources (``--eval-prompt-data``)
used to be created with ``asyncio.run`` inside the running loop and failed with
"asyncio.run() cannot be called from a running event loop". The last test chooses an
``async def`` implementation for every hook a run calls and checks each one ran.
"""

import asyncio
import json

import pytest

from furlong.hooks import PluginError, hookimpl

ASYNC_ROWS = '''
import asyncio

from furlong.builtin_plugins.data.jsonl import JsonlDataSource
from furlong.hooks import hookimpl

CALLS = []


@hookimpl
async def data_source(config, dataset):
    await asyncio.sleep(0)
    CALLS.append((dataset.path, id(asyncio.get_running_loop())))
    return JsonlDataSource(config, dataset)
'''


def _selection(name):
    from furlong.core.plugins.selection import Selection

    return Selection(chosen={"data_source": (name, "--data-source")})


def _eval_config(path):
    from furlong.core.config.launch_args import launch_config

    return launch_config("--eval-prompt-data", "arith", str(path), "--input-key", "prompt", "--label-key", "label",
                         "--rollout-seed", "1", "--rollout-max-response-len", "4", configure=False)


def test_async_eval_data_source_is_awaited_inside_the_running_loop(plugin_manager, register_plugin, tmp_path):
    from furlong.core.rollout.evaluation import Evaluator

    seen = []

    class AsyncRows:
        @hookimpl
        async def data_source(self, args):
            await asyncio.sleep(0)
            seen.append(asyncio.get_running_loop())
            return _Rows([{"prompt": "1+1=", "label": "2"}] * 3)

    register_plugin(AsyncRows(), "async_rows")

    async def main():
        evaluator = Evaluator(_eval_config(tmp_path / "eval.jsonl"), plugin_manager, _selection("async_rows"))
        assert evaluator and not evaluator.datasets and not seen  # nothing awaited yet
        await evaluator.load()
        await evaluator.load()  # idempotent
        return evaluator, asyncio.get_running_loop()

    evaluator, loop = asyncio.run(main())
    assert seen == [loop]
    [(ds, rows)] = evaluator.datasets
    assert ds.name == "arith" and len(rows) == 3


def test_plain_eval_data_source_is_read_when_loaded_inside_the_running_loop(plugin_manager, register_plugin,
                                                                           tmp_path):
    """A plain data source is called through the async path too: nothing is read at construction, and
    load() (which the rollout side calls right after it, before any model loads) names the bad set."""
    from furlong.core.rollout.evaluation import Evaluator

    calls = []

    class NoLen:
        @hookimpl
        def data_source(self, args):
            calls.append(asyncio.get_running_loop())
            return object()

    register_plugin(NoLen(), "no_len")

    async def main():
        evaluator = Evaluator(_eval_config(tmp_path / "x.jsonl"), plugin_manager, _selection("no_len"))
        assert calls == []
        await evaluator.load()

    with pytest.raises(PluginError) as excinfo:
        asyncio.run(main())
    assert len(calls) == 1
    assert str(excinfo.value) == "--data-source 'no_len': an eval data source must define __len__ (eval set 'arith')."


def test_async_eval_data_source_error_names_the_set_when_loaded(plugin_manager, register_plugin, tmp_path):
    from furlong.core.rollout.evaluation import Evaluator

    class AsyncNoLen:
        @hookimpl
        async def data_source(self, args):
            return object()

    register_plugin(AsyncNoLen(), "async_no_len")

    async def main():
        evaluator = Evaluator(_eval_config(tmp_path / "x.jsonl"), plugin_manager, _selection("async_no_len"))
        await evaluator.load()

    with pytest.raises(PluginError) as excinfo:
        asyncio.run(main())
    assert str(excinfo.value) == ("--data-source 'async_no_len': an eval data source must define __len__ "
                                  "(eval set 'arith').")


class _Rows:
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def next_rows(self, k):
        return [dict(r) for r in self.rows[:k]]


@pytest.mark.usefixtures("one_torch_thread")
def test_async_data_source_plugin_runs_with_eval_prompt_data(plugin_dist, tmp_path, tiny_model_dir, arithmetic_jsonl):
    """An installed plugin with ``async def data_source`` serves training and eval data in one short run."""
    import importlib

    plugin_dist("furlong-async-rows", "furlong_async_rows", ASYNC_ROWS, {"async_rows": "furlong_async_rows"})
    save = tmp_path / "save"
    argv = ["--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(arithmetic_jsonl), "--input-key", "prompt",
            "--label-key", "label", "--rm-type", "math", "--num-rollout", "1", "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4", "--data-source", "async_rows",
            "--eval-prompt-data", "arith", str(arithmetic_jsonl) + "@[0:4]", "--eval-interval", "1",
            "--save", str(save)]
    loops = _run_recording_the_loop(argv)
    calls = importlib.import_module("furlong_async_rows").CALLS
    assert [path for path, _ in calls] == [str(arithmetic_jsonl), str(arithmetic_jsonl) + "@[0:4]"]
    assert {loop for _, loop in calls} == set(loops)
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/step" in r]
    assert [r["eval/step"] for r in evals] == [0, 0]  # before training, and after the last rollout
    assert all("eval/arith" in r for r in evals)


ASYNC_ALL = '''
import asyncio

from furlong.builtin_plugins.advantage import grpo
from furlong.builtin_plugins.buffer import pop_first
from furlong.builtin_plugins.data.jsonl import JsonlDataSource
from furlong.builtin_plugins.generate import single_turn
from furlong.builtin_plugins.losses import policy_loss
from furlong.hooks import hookimpl

CALLS = []


async def _seen(hook):
    await asyncio.sleep(0)
    CALLS.append((hook, id(asyncio.get_running_loop())))


@hookimpl
async def data_source(config, dataset):
    await _seen("data_source")
    return JsonlDataSource(config, dataset)


@hookimpl
async def generate(config, sample, sampling_params, engine, evaluation):
    await _seen("generate")
    if not evaluation and sample.group_index % 4 >= 2:
        await asyncio.sleep(0.3)  # still in flight when the batch is full: aborted, buffered, popped next time
    return await single_turn.generate(config, sample, sampling_params, engine, evaluation)


@hookimpl
async def filter(samples, rollout_id):
    await _seen("filter")
    return True


@hookimpl
async def buffer_pop(rollout_id, buffer, num_samples):
    await _seen("buffer_pop")
    return pop_first.buffer_pop(buffer, num_samples)


@hookimpl
async def abort(rollout_id):
    await _seen("abort")


@hookimpl
async def advantage(config, batch):
    await _seen("advantage")
    return grpo.advantage(config, batch)


@hookimpl
async def loss(config, batch):
    await _seen("loss")
    return policy_loss.loss(config, batch)


@hookimpl
async def on_rollout_end(rollout_id):
    await _seen("on_rollout_end")


@hookimpl
async def on_train_step_end(step):
    await _seen("on_train_step_end")


@hookimpl
async def on_eval_end(rollout_id):
    await _seen("on_eval_end")


@hookimpl
async def on_checkpoint_saved(path):
    await _seen("on_checkpoint_saved")
'''


@pytest.mark.usefixtures("one_torch_thread")
def test_every_hook_of_a_run_may_be_async(plugin_dist, tmp_path, tiny_model_dir, arithmetic_jsonl):
    import importlib

    plugin_dist("furlong-async-all", "furlong_async_all", ASYNC_ALL, {"async_all": "furlong_async_all"})
    argv = ["--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(arithmetic_jsonl), "--input-key", "prompt",
            "--label-key", "label", "--rm-type", "math", "--num-rollout", "2", "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "2", "--over-sampling-batch-size", "4", "--partial-rollout",
            "--rollout-max-response-len", "4", "--data-source", "async_all", "--generate", "async_all",
            "--dynamic-sampling-filter", "async_all", "--buffer-filter", "async_all",
            "--advantage-estimator", "async_all", "--loss-type", "async_all",
            "--eval-prompt-data", "arith", str(arithmetic_jsonl) + "@[0:2]", "--eval-interval", "1",
            "--save", str(tmp_path / "save")]
    loops = _run_recording_the_loop(argv)
    calls = importlib.import_module("furlong_async_all").CALLS
    hooks = {hook for hook, _ in calls}
    assert hooks == {"data_source", "generate", "filter", "buffer_pop", "abort", "advantage", "loss",
                     "on_rollout_end", "on_train_step_end", "on_eval_end", "on_checkpoint_saved"}
    driver = {loop for hook, loop in calls if hook != "loss"}  # the loss runs where the trainer runs
    assert driver == set(loops)


def _run_recording_the_loop(argv: list[str]) -> list[int]:
    """Run ``furlong train`` in-process with the installed plugins; ``[id of the run's event loop]``."""
    from furlong.core.config.launch_args import launch_config
    from furlong.core.run.loop import run
    from furlong.core.plugins.manager import get_plugin_manager
    from furlong.core.plugins.selection import resolve_selection

    pm = get_plugin_manager()
    config = launch_config(*argv, pm=pm)
    loops = []

    async def main():
        loops.append(id(asyncio.get_running_loop()))
        await run(config, pm, resolve_selection(config, pm))

    asyncio.run(main())
    return loops


def test_a_lone_eval_path_says_miles_rule_names_it_aime(plugin_manager, tmp_path, caplog):
    """``--eval-prompt-data test`` (the path forgotten) said "--eval-prompt-data aime 'test': no such file", naming a
    set the user never typed; the lone value's rule is now told, and a real lone path is logged once as 'aime'."""
    from furlong.core.config.launch_args import launch_config
    from furlong.core.rollout.evaluation import Evaluator

    def evaluator(value):
        config = launch_config("--eval-prompt-data", value, "--input-key", "prompt", "--label-key", "label",
                               configure=False)
        assert config.eval_prompt_data_lone and config.eval_prompt_data == ("aime", value)
        return Evaluator(config, plugin_manager, _selection("jsonl"))

    with pytest.raises(PluginError) as excinfo:
        asyncio.run(evaluator("test").load())
    assert str(excinfo.value) == ("--eval-prompt-data 'test': no such file. One --eval-prompt-data value is read as the "
                                  "path of an eval set named 'aime' (Miles' rule); give NAME PATH pairs.")
    path = tmp_path / "eval.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n")
    loaded = evaluator(str(path))
    with caplog.at_level("INFO", logger="furlong.eval"):
        asyncio.run(loaded.load())
    assert [ds.name for ds, _ in loaded.datasets] == ["aime"]
    assert caplog.messages == [f"--eval-prompt-data {path}: one value, read as the path of an eval set named 'aime' "
                               "(Miles' rule); give NAME PATH to name it."]
    pair = launch_config("--eval-prompt-data", "test", str(path), configure=False)
    assert not pair.eval_prompt_data_lone
