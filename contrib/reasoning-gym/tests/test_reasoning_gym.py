"""The reasoning_gym plugin through furlong's plugin manager and the ``furlong`` command."""

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from furlong.core.config.launch_args import launch_args, launch_config
from furlong.core.plugins.manager import get_plugin_manager
from furlong.hooks import ConfigReport, DatasetSpec, PluginError, Sample

DEMO_MODEL = Path(__file__).resolve().parents[3] / "examples" / "demo" / "model"


@pytest.fixture(scope="module")
def pm():
    return get_plugin_manager()


ARGV = ("--data-source", "reasoning_gym", "--reasoning-gym-tasks", "chain_sum", "basic_arithmetic",
        "--reasoning-gym-size", "5", "--reasoning-gym-seed", "3", "--reasoning-gym-eval-size", "4", "--rollout-seed", "42")


def flags(**overrides):
    """The launch flags of a run on two tasks (what ``configure`` gets); ``overrides`` by attribute name."""
    return launch_args(*ARGV, **overrides)


def run_config(**overrides):
    """The frozen configuration of that run (what every other hook gets)."""
    return launch_config(*ARGV, configure=False, **overrides)


def source(pm, dataset=None, **overrides):
    """The data source of the training data (or of ``dataset``)."""
    config = run_config(**overrides)
    dataset = dataset or DatasetSpec(path=config.prompt_data, flag="--prompt-data", shuffle=config.rollout_shuffle,
                                     seed=config.rollout_seed)
    return asyncio.run(pm.call_chosen("data_source", "reasoning_gym", "--data-source", config=config,
                                      dataset=dataset))


def score(pm, rows, responses):
    samples = [Sample(response=r, label=row["label"], metadata=row["metadata"], index=i)
               for i, (row, r) in enumerate(zip(rows, responses))]
    return asyncio.run(pm.call_chosen("reward", "reasoning_gym", "--rm-type", config=run_config(), samples=samples))


def test_rows_are_seeded_interleaved_and_roll_over(pm):
    data = source(pm)
    assert len(data) == 10
    rows = data.next_rows(10)
    assert [r["metadata"]["reasoning_gym"]["task"] for r in rows[:4]] == ["chain_sum", "basic_arithmetic"] * 2
    assert rows[0]["prompt"].startswith("Given a problem, your task is to answer")  # reasoning-gym's system prompt
    expression = rows[0]["prompt"].rsplit("arithmetic problem: ", 1)[1].rstrip("=\n ")  # e.g. "4 - 1 - 7"
    assert rows[0]["label"] == str(eval(expression))  # the task's reference answer
    assert [r["prompt"] for r in source(pm).next_rows(10)] == [r["prompt"] for r in rows]  # same seed, same tasks
    assert [r["prompt"] for r in source(pm, reasoning_gym_seed=4).next_rows(10)] != [r["prompt"] for r in rows]
    assert data.next_rows(3) == rows[:3]  # the next epoch
    assert data.state() == {"epoch": 1, "offset": 3, "seed": 42, "shuffle": False}
    shuffled = source(pm, rollout_shuffle=True)
    assert sorted(r["prompt"] for r in shuffled.next_rows(10)) == sorted(r["prompt"] for r in rows)


def test_eval_sets_name_their_tasks_and_use_their_own_seed(pm):
    data = source(pm, DatasetSpec(path="basic_arithmetic", flag="--eval-prompt-data rg", name="rg"))
    rows = data.next_rows(len(data))
    assert len(rows) == 4 and {r["metadata"]["reasoning_gym"]["seed"] for r in rows} == {4}
    training = [r["prompt"] for r in source(pm, reasoning_gym_tasks=["basic_arithmetic"]).next_rows(4)]
    assert [r["prompt"] for r in rows] != training


def test_reward_uses_the_task_verifier(pm):
    rows = source(pm).next_rows(4)
    right = [f"Adding up... <answer>{r['label']}</answer>" for r in rows]
    assert score(pm, rows, right) == [1.0] * 4
    wrong = [f"<answer>{int(r['label']) + 1}</answer>" for r in rows]
    assert score(pm, rows, wrong) == [0.0] * 4
    other_forms = [f"\\boxed{{{rows[0]['label']}}}", f"So the answer is {rows[1]['label']}.", "no idea", ""]
    assert score(pm, rows, other_forms) == [1.0, 1.0, 0.0, 0.0]


def test_reward_refuses_prompts_from_another_source(pm):
    with pytest.raises(PluginError, match="sample 7 has no metadata\\['reasoning_gym'\\]"):
        asyncio.run(pm.call_chosen("reward", "reasoning_gym", "--rm-type", config=run_config(),
                                   samples=[Sample(response="<answer>3</answer>", label="3", index=7)]))


def test_unknown_task_is_one_error_naming_close_names(pm):
    with pytest.raises(PluginError, match="unknown reasoning-gym task 'chain_summ' \\(did you mean chain_sum"):
        source(pm, reasoning_gym_tasks=["chain_summ"])


def run_furlong(*argv):
    return subprocess.run([sys.executable, "-m", "furlong.core", *argv], capture_output=True, text=True, timeout=120)


def test_furlong_train_selects_both_hooks():
    common = ["train", "--print-config", "--hf-checkpoint", str(DEMO_MODEL), "--data-source", "reasoning_gym",
              "--rm-type", "reasoning_gym", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
              "--global-batch-size", "8", "--num-rollout", "1"]
    done = run_furlong(*common, "--reasoning-gym-tasks", "chain_sum", "--reasoning-gym-size", "20")
    assert done.returncode == 0, done.stderr
    config = json.loads(done.stdout)
    assert (config["plugins"]["data_source"], config["plugins"]["reward"]) == ("reasoning_gym", "reasoning_gym")
    assert (config["args"]["reasoning_gym_tasks"], config["args"]["reasoning_gym_size"]) == (["chain_sum"], 20)


def test_configure_names_each_problem(pm):
    configure = pm.get_plugin("reasoning_gym").configure
    report = ConfigReport(plugin="reasoning_gym", flags=("--data-source", "--rm-type"))
    configure(args=flags(reasoning_gym_tasks=None, prompt_data="train.jsonl", reasoning_gym_system_prompt="terse"),
              report=report)
    assert report.errors == [
        "--data-source reasoning_gym needs --reasoning-gym-tasks TASK [TASK ...] (e.g. chain_sum).",
        "--data-source reasoning_gym generates its prompts; --prompt-data train.jsonl would not be read. "
        "Drop it, or use --data-source jsonl.",
        "--reasoning-gym-system-prompt 'terse' is not one of DeepSeekZero, chain_of_draft, default, direct, simple "
        "or 'none'.",
    ]
    report = ConfigReport(plugin="reasoning_gym", flags=("--data-source",))
    configure(args=flags(reasoning_gym_tasks=["chain_summ"], reasoning_gym_size=0), report=report)
    assert report.errors == ["--reasoning-gym-tasks: unknown reasoning-gym task 'chain_summ' (did you mean "
                             "chain_sum, decimal_chain_sum?)",
                             "--reasoning-gym-size must be at least 1, got 0."]
    as_reward_only = ConfigReport(plugin="reasoning_gym", flags=("--rm-type",))
    configure(args=flags(reasoning_gym_tasks=None, prompt_data="train.jsonl"), report=as_reward_only)
    assert as_reward_only.errors == []
