"""Reward functions as TRL and verl users wrote them, named by --custom-rm-path (core/plugins/reward_forms.py)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from furlong.core.config.launch_args import launch_args, launch_config
from furlong.core.plugins.reward_forms import TrlRewardAdapter, VerlRewardAdapter, reward_form
from furlong.hooks import ConfigReport, PluginError, Sample

REWARDS = '''
import re

def accuracy_reward(completions, solution, **kwargs):
    """TRL's form: a batch of completions, a data set column as a list."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 if re.findall(r"\\\\boxed\\{(-?\\d+)\\}", t)[-1:] == [s] else 0.0 for t, s in zip(texts, solution)]

def strict_trl(completions, solution):
    return [0.5 for _ in completions]

def needs_column(completions, difficulty):
    return [0.0 for _ in completions]

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's custom reward form."""
    calls.append((data_source, solution_str, ground_truth, extra_info))
    return {"score": 1.0 if solution_str.endswith(ground_truth) else -1.0, "acc": True}

def gsm8k_style(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0):
    """verl's per-data-set scorer form: no data_source."""
    return score if ground_truth in solution_str else format_score

calls = []
'''


@pytest.fixture
def forms(tmp_path, monkeypatch):
    (tmp_path / "forms_mod.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    import forms_mod

    yield forms_mod
    sys.modules.pop("forms_mod", None)


def _samples():
    return [Sample(prompt="p0", label="3", metadata={"data_source": "toy", "extra_info": {"i": 0}}, tokens=[1, 2, 3, 4],
                   response="so \\boxed{3}", response_length=2, index=0),
            Sample(prompt="p1", label="5", metadata={"data_source": "toy", "extra_info": {"i": 1}}, tokens=[1, 2, 5],
                   response="\\boxed{4}", response_length=1, index=1)]


FLAGS = dict(apply_chat_template=False, label_key="solution", metadata_key="metadata", custom_rm_path="forms_mod.f",
             reward_key=None, rollout_skip_special_tokens=False, explicit_args=[], group_rm=False)


def _args(**kw):
    """The set-up step's flags (what ``configure`` and the selection see)."""
    return launch_args(**{**FLAGS, **kw})


def _config(**kw):
    """The run's configuration (what the ``reward`` hook sees)."""
    return launch_config(**{**FLAGS, **kw}, configure=False)


def test_the_form_comes_from_the_parameter_names(forms):
    assert [reward_form(f) for f in (forms.accuracy_reward, forms.strict_trl, forms.compute_score, forms.gsm8k_style,
                                     lambda args, sample: 1.0)] == ["trl", "trl", "verl", "verl", "miles"]


def test_a_trl_function_gets_the_batch_as_trl_gives_it(forms):
    adapter = TrlRewardAdapter(forms.accuracy_reward, "forms_mod.accuracy_reward")
    assert asyncio.run(adapter.reward(config=_config(), samples=_samples())) == [1.0, 0.0]
    assert asyncio.run(adapter.reward(config=_config(apply_chat_template=True), samples=_samples())) == [1.0, 0.0]
    seen = {}

    def spy(prompts, completions, **kwargs):
        seen.update(prompts=prompts, completions=completions, **kwargs)
        return [0.0, 0.0]

    asyncio.run(TrlRewardAdapter(spy, "m.spy").reward(config=_config(apply_chat_template=True,
                                                                     label_key="reward_model.ground_truth"),
                                                      samples=_samples()))
    assert seen == {"prompts": ["p0", "p1"],
                    "completions": [[{"role": "assistant", "content": "so \\boxed{3}"}],
                                    [{"role": "assistant", "content": "\\boxed{4}"}]],
                    "completion_ids": [[3, 4], [5]], "ground_truth": ["3", "5"], "data_source": ["toy", "toy"],
                    "extra_info": [{"i": 0}, {"i": 1}]}


def test_a_trl_function_without_kwargs_gets_only_its_arguments_and_a_missing_one_is_named(forms):
    adapter = TrlRewardAdapter(forms.strict_trl, "x")
    assert asyncio.run(adapter.reward(config=_config(), samples=_samples())) == [0.5, 0.5]
    with pytest.raises(PluginError) as excinfo:
        asyncio.run(TrlRewardAdapter(forms.needs_column, "forms_mod.needs_column").reward(config=_config(),
                                                                                           samples=_samples()))
    assert str(excinfo.value) == (
        "--custom-rm-path forms_mod.needs_column: the function needs difficulty, which the samples do not give; they "
        "give completion_ids, completions, data_source, extra_info, prompts, solution (the label under the last part "
        "of --label-key, and each metadata key).")


def test_a_verl_function_is_called_per_sample_by_keyword(forms):
    adapter = VerlRewardAdapter(forms.compute_score, "forms_mod.compute_score")
    samples = _samples()
    samples[1].response = "answer 5"
    assert asyncio.run(adapter.reward(config=_config(), samples=samples)) == [
        {"score": -1.0, "acc": True}, {"score": 1.0, "acc": True}]
    assert forms.calls == [("toy", "so \\boxed{3}", "3", {"i": 0}), ("toy", "answer 5", "5", {"i": 1})]
    gsm = VerlRewardAdapter(forms.gsm8k_style, "forms_mod.gsm8k_style")
    assert asyncio.run(gsm.reward(config=_config(), samples=_samples())) == [1.0, 0.0]


def test_configure_takes_the_decoding_and_the_dict_key_of_trl_and_verl(forms):
    args = _args(metadata_key="extra_info")
    report = ConfigReport(plugin="forms_mod.compute_score")
    VerlRewardAdapter(forms.compute_score, "forms_mod.compute_score").configure(args=args, report=report)
    assert (args.rollout_skip_special_tokens, args.reward_key) == (True, "score")
    assert report.infos == [
        "--custom-rm-path forms_mod.compute_score is a verl reward: responses are decoded without special tokens, as "
        "verl does (--rollout-skip-special-tokens).",
        "--custom-rm-path forms_mod.compute_score is a verl compute_score: a dict it returns trains on its 'score' "
        "(--reward-key score)."]
    assert report.warnings == [
        "--custom-rm-path forms_mod.compute_score is a verl compute_score, which gets data_source from each sample's "
        "metadata, but --metadata-key extra_info does not bring it: pass --metadata-key data_source,extra_info "
        "(verl's Parquet columns), or every call gets data_source=None."]
    given = _args(explicit_args=["rollout_skip_special_tokens"], metadata_key="data_source,extra_info")
    report = ConfigReport(plugin="x")
    TrlRewardAdapter(forms.accuracy_reward, "x").configure(args=given, report=report)
    assert given.rollout_skip_special_tokens is False and report.infos == [] and report.warnings == []


def test_the_dotted_path_picks_the_adapter(forms, plugin_manager):
    from furlong.core.plugins.selection import resolve_selection

    for path, kind in (("forms_mod.accuracy_reward", TrlRewardAdapter), ("forms_mod.compute_score", VerlRewardAdapter)):
        args = _args(custom_rm_path=path, rm_type=None)
        assert resolve_selection(args, plugin_manager, ("reward",)).reward == (path, "--custom-rm-path")
        assert isinstance(plugin_manager.get_plugin(path), kind)


# --- end to end: the demo model, its data as verl's Parquet and as a saved data set -----------------------------

pa = pytest.importorskip("pyarrow")


DEMO = Path(__file__).resolve().parent.parent / "examples" / "demo"
DEMO_MODEL = str(DEMO / "model")


def _demo_rows(n):
    return [json.loads(line) for line in (DEMO / "data" / "train.jsonl").read_text().splitlines()[:n]]


BASE = ["--num-rollout", "2", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "16",
        "--rollout-max-response-len", "12", "--lr", "1e-4", "--apply-chat-template"]


def test_a_verl_parquet_file_and_a_verl_score_train_end_to_end(tmp_path, forms, one_torch_thread, monkeypatch):
    import pyarrow.parquet as pq

    from furlong.core.cli.commands import main

    rows = [{"data_source": "demo", "prompt": [{"role": "user", "content": r["prompt"]}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": r["label"]}, "extra_info": {"index": i}}
            for i, r in enumerate(_demo_rows(16))]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    (tmp_path / "verl_score.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    assert data_source == 'demo' and isinstance(extra_info['index'], int)\n"
        "    return {'score': float(solution_str.strip().endswith('\\\\boxed{' + ground_truth + '}')), 'len': 1}\n")
    monkeypatch.chdir(tmp_path)
    code = main(["train", *BASE, "--hf-checkpoint", DEMO_MODEL, "--prompt-data", "train.parquet", "--input-key", "prompt",
                 "--label-key", "reward_model.ground_truth", "--metadata-key", "data_source,extra_info",
                 "--custom-rm-path", "verl_score.compute_score", "--log-dir", "run"])
    assert code == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["rollout/raw_reward"] for r in rows if "rollout/step" in r]
    assert len(rewards) == 2 and 0.0 < sum(rewards) / 2 < 1.0  # the demo model boxes some answers right
    sys.modules.pop("verl_score", None)


def test_a_saved_data_set_and_a_trl_reward_train_end_to_end(tmp_path, forms, one_torch_thread, monkeypatch):
    datasets = pytest.importorskip("datasets")
    from furlong.core.cli.commands import main

    rows = [{"prompt": [{"role": "user", "content": r["prompt"]}], "solution": r["label"]} for r in _demo_rows(16)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "data"))
    monkeypatch.chdir(tmp_path)
    code = main(["train", *BASE, "--hf-checkpoint", DEMO_MODEL, "--prompt-data", "data/train", "--input-key",
                 "prompt", "--label-key", "solution", "--custom-rm-path", "forms_mod.accuracy_reward",
                 "--log-dir", "run"])
    assert code == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["rollout/raw_reward"] for r in rows if "rollout/step" in r]
    assert len(rewards) == 2 and 0.0 < sum(rewards) / 2 < 1.0


@pytest.mark.parametrize("body, complaint", [
    ("return [1.0]", "returned 1 rewards for 2 samples (first sample index 0); return one per sample."),
    ("return 1.0", "returned float 1.0 for 2 sample(s) (first sample index 0); `reward` returns a list with one "
                   "reward per sample, e.g. [1.0]."),
    ("return [float('nan'), 1.0]", "returned nan for sample 0; a reward must be a finite number."),
])
def test_what_a_trl_function_returns_is_checked_like_every_reward(tmp_path, monkeypatch, plugin_manager, body,
                                                                  complaint):
    from furlong.core.rollout.rewards import RewardScorer
    from furlong.core.plugins.selection import resolve_selection

    (tmp_path / "bad_trl.py").write_text(f"def rm(completions, **kwargs):\n    {body}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("bad_trl", None)
    config = _config(custom_rm_path="bad_trl.rm", rm_type=None, group_rm=True)
    scorer = RewardScorer(config, plugin_manager, resolve_selection(config, plugin_manager, ("reward",)))
    with pytest.raises(PluginError) as excinfo:
        asyncio.run(scorer.score(_samples()))
    assert str(excinfo.value) == f"reward plugin 'bad_trl.rm' (from --custom-rm-path) {complaint}"
    sys.modules.pop("bad_trl", None)


def test_the_help_of_custom_rm_path_names_the_three_forms():
    """--help named only Miles' form, while TRL's and verl's functions work there too (README, docs/from-trl.md)."""
    from furlong.core.config import build_parser

    [action] = [a for a in build_parser()._actions if "--custom-rm-path" in a.option_strings]
    assert action.help == (
        "module.function, sync or async, in one of three forms read from its parameter names: Miles' f(args, sample) "
        "-> float | dict (with --group-rm: f(args, samples) -> list); TRL's f(prompts, completions, **kwargs) -> list; "
        "verl's compute_score(data_source, solution_str, ground_truth, extra_info) -> float | dict "
        "(docs/from-trl.md, docs/from-verl.md).")
