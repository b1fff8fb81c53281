"""Miles' dotted-path functions around a rollout and a save:
``--rollout-sample-filter-path``, ``--rollout-all-samples-process-path`` and
``--custom-megatron-post-save-hook-path``."""

import asyncio
import itertools
import json
import os
import textwrap

import pytest

from furlong.core.run import checkpoints as ck
from furlong.core.config.launch_args import launch_config
from furlong.core.plugins.selection import resolve_selection
from furlong.hooks import PluginError

from .scripted_engine import ScriptedEngine, boxed_first_operand, rollout_manager

FUNCTIONS = '''
import os

CALLS = []


def mark_odd(args, groups):
    CALLS.append(("mark_odd", [[s.index for s in g] for g in groups]))
    for group in groups:
        for sample in group:
            sample.remove_sample = sample.index % 2 == 1


async def async_mark_all(args, groups):
    for group in groups:
        for sample in group:
            sample.remove_sample = True


def see_all(args, all_groups, data_source):
    CALLS.append(("see_all", [[s.index for s in g] for g in all_groups], data_source))


def boom(args, groups):
    raise ValueError("boom")


def after_save(args, rollout_id, ckpt_dir, hf_dir):
    marker = open(os.path.join(args.save, "latest_checkpointed_iteration.txt")).read()
    CALLS.append(("after_save", rollout_id, ckpt_dir, hf_dir, marker, os.path.isdir(ckpt_dir)))


def failing_save(args, rollout_id, ckpt_dir, hf_dir):
    raise OSError("disk full")


async def async_save(args, rollout_id, ckpt_dir, hf_dir):
    CALLS.append("never")
'''

_names = itertools.count()


@pytest.fixture
def functions(tmp_path, monkeypatch):
    """A fresh module of user functions; returns its name."""
    import importlib
    import sys

    name = f"rollout_fns_{next(_names)}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(FUNCTIONS))
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield name
    sys.modules.pop(name, None)


def _calls(module):
    import importlib

    return importlib.import_module(module).CALLS


def _config(tmp_path, *extra):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+0=", "label": str(i)}) + "\n" for i in range(40)))
    return launch_config("--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
                         "--prompt-data", str(path), "--input-key", "prompt", "--label-key", "label",
                         "--rm-type", "math", "--rollout-max-response-len", "16", *extra, configure=False)


def test_sample_filter_sees_the_sorted_batch_and_may_remove_samples(tmp_path, plugin_manager, functions):
    config = _config(tmp_path, "--rollout-sample-filter-path", f"{functions}.mark_odd")
    manager = rollout_manager(config, plugin_manager, ScriptedEngine(boxed_first_operand))
    groups = asyncio.run(manager.generate(0))
    assert _calls(functions) == [("mark_odd", [[0, 1], [2, 3]])]
    assert [[s.remove_sample for s in g] for g in groups] == [[False, True], [False, True]]


def test_sample_filter_may_be_async(tmp_path, plugin_manager, functions):
    config = _config(tmp_path, "--rollout-sample-filter-path", f"{functions}.async_mark_all")
    groups = asyncio.run(rollout_manager(config, plugin_manager, ScriptedEngine(boxed_first_operand)).generate(0))
    assert all(s.remove_sample for g in groups for s in g)


def test_all_samples_process_sees_kept_and_dropped_groups(tmp_path, plugin_manager, functions):
    config = _config(tmp_path, "--rollout-all-samples-process-path", f"{functions}.see_all",
                 "--dynamic-sampling-filter", "check_reward_nonzero_std", "--over-sampling-batch-size", "4")

    def answer(prompt, call):  # even prompts: both samples right (zero std, dropped); odd: right or wrong
        i = int(prompt.split("+")[0])
        return "\\boxed{" + (str(i) if i % 2 == 0 or call % 2 else "x") + "}", "stop"

    manager = rollout_manager(config, plugin_manager, ScriptedEngine(answer))
    groups = asyncio.run(manager.generate(0))
    [(_, seen, cursor)] = _calls(functions)
    counters = manager.cursor.counters
    assert cursor is manager.cursor
    assert len(seen) == counters["trained"] + counters["filtered"] + counters["surplus"]
    assert counters["filtered"] >= 1
    assert seen == sorted(seen) and all(len(g) == 2 for g in seen)
    assert all([s.index for s in g] in seen for g in groups)


def test_a_failing_rollout_function_names_its_flag(tmp_path, plugin_manager, functions):
    config = _config(tmp_path, "--rollout-sample-filter-path", f"{functions}.boom")
    manager = rollout_manager(config, plugin_manager, ScriptedEngine(boxed_first_operand))
    with pytest.raises(PluginError) as excinfo:
        asyncio.run(manager.generate(0))
    assert str(excinfo.value) == f"--rollout-sample-filter-path '{functions}.boom' failed: ValueError: boom"


def test_a_bad_rollout_function_path_fails_when_plugins_are_selected(tmp_path, plugin_manager, functions):
    config = _config(tmp_path, "--rollout-all-samples-process-path", f"{functions}.missing")
    with pytest.raises(PluginError) as excinfo:
        rollout_manager(config, plugin_manager, ScriptedEngine(boxed_first_operand))
    assert str(excinfo.value) == (f"--rollout-all-samples-process-path '{functions}.missing': module '{functions}' "
                                  f"has no attribute 'missing'")


def _write(path):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "weights.txt"), "w") as f:
        f.write("w")


async def _save_model(path):
    _write(path)


def _save_config(tmp_path, hook, **overrides):
    return launch_config(save=str(tmp_path / "save"), save_trigger_sentinel=None,
                         custom_megatron_post_save_hook_path=hook, **overrides)


def _save(config, rollout_id, pm, save_hf=None):
    """``save_checkpoint`` with the run's post-save hook, called through ``pm`` as the loop calls it."""
    post_save = ck.post_save_hook(config, pm, resolve_selection(config, pm), rollout_id)
    return asyncio.run(ck.save_checkpoint(config, rollout_id, _save_model, {"r": rollout_id}, save_hf, post_save))


def test_post_save_hook_runs_after_the_marker_names_the_checkpoint(tmp_path, functions, plugin_manager):
    config = _save_config(tmp_path, f"{functions}.after_save")
    final = _save(config, 3, plugin_manager)
    assert _calls(functions) == [("after_save", 3, final, None, "3", True)]


def test_post_save_hook_gets_the_save_hf_directory_written_before_it(tmp_path, functions, plugin_manager):
    config = _save_config(tmp_path, f"{functions}.after_save", save_hf=str(tmp_path / "hf" / "r{rollout_id}"))
    written = []

    async def save_hf(path):
        written.append(path)

    final = _save(config, 3, plugin_manager, save_hf)
    assert written == [str(tmp_path / "hf" / "r3")]
    assert _calls(functions) == [("after_save", 3, final, str(tmp_path / "hf" / "r3"), "3", True)]


def test_post_save_hook_failure_names_the_flag(tmp_path, functions, plugin_manager):
    config = _save_config(tmp_path, f"{functions}.failing_save")
    with pytest.raises(PluginError) as excinfo:
        _save(config, 0, plugin_manager)
    final = ck.iter_dir(config.save, 0)
    assert str(excinfo.value) == (f"--custom-megatron-post-save-hook-path '{functions}.failing_save' failed after "
                                  f"saving {final}: OSError: disk full")
    assert ck.read_marker(config.save) == 0  # the checkpoint itself is complete


def test_post_save_hook_may_not_be_async(tmp_path, functions, plugin_manager):
    config = _save_config(tmp_path, f"{functions}.async_save")
    with pytest.raises(PluginError) as excinfo:
        _save(config, 0, plugin_manager)
    assert str(excinfo.value) == (f"--custom-megatron-post-save-hook-path '{functions}.async_save' returned an "
                                  f"awaitable: the hook is called synchronously after each save; make it a plain "
                                  f"function.")
    assert _calls(functions) == []
