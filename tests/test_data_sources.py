"""Data as TRL and verl users have it: verl's Parquet files (``parquet``), Hugging Face data sets saved to disk
and Arrow/CSV/TSV files (``hf_datasets``), nested keys, several metadata keys, and the reader chosen by the file."""

from __future__ import annotations

import asyncio
import json

import pytest

from furlong.core.config import parse_args
from furlong.core.config.launch_args import launch_config
from furlong.hooks import PluginError

from .configs import training_dataset

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")

VERL_KEYS = ["--input-key", "prompt", "--label-key", "reward_model.ground_truth", "--metadata-key",
             "data_source,extra_info"]


def verl_rows(n=4):
    """Rows shaped as verl's GSM8K preparation writes them (chat-list prompt, nested ground truth)."""
    return [{"data_source": "openai/gsm8k",
             "prompt": [{"role": "user", "content": f"What is {i} + {i}? Let's think step by step and output the "
                                                   "final answer after \"####\"."}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
             "extra_info": {"split": "train", "index": i, "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}",
                            "question": f"What is {i} + {i}?"}} for i in range(n)]


def _args(path, *keys, extra=()):
    return parse_args(["--num-rollout", "1", "--rollout-batch-size", "2", "--prompt-data", str(path),
                       "--rm-type", "math", *keys, *extra])


def _reading(path, *keys) -> dict:
    """The ``data_source`` arguments of a run reading ``path`` as its training data: ``config`` and ``dataset``."""
    config = launch_config("--rollout-batch-size", "2", "--prompt-data", str(path), "--rm-type", "math", *keys,
                           configure=False)
    return {"config": config, "dataset": training_dataset(config)}


def _parquet(tmp_path, rows, name="train.parquet"):
    path = tmp_path / name
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_a_verl_parquet_file_reads_with_nested_keys(tmp_path, plugin_manager):
    path = _parquet(tmp_path, verl_rows())
    source = plugin_manager.get_plugin("parquet").data_source(**_reading(path, *VERL_KEYS))
    assert len(source) == 4
    assert source.next_rows(1) == [{
        "prompt": [{"role": "user", "content": "What is 0 + 0? Let's think step by step and output the final answer "
                                               "after \"####\"."}],
        "label": "0",
        "metadata": {"data_source": "openai/gsm8k", "extra_info": {"split": "train", "index": 0,
                                                                  "answer": "0 + 0 = 0\n#### 0",
                                                                  "question": "What is 0 + 0?"}}}]


def test_one_metadata_key_is_the_metadata_and_a_nested_one_reaches_inside(tmp_path, plugin_manager):
    path = _parquet(tmp_path, verl_rows(2))
    source = plugin_manager.get_plugin("parquet").data_source(
        **_reading(path, "--input-key", "extra_info.question", "--label-key", "reward_model.ground_truth",
                   "--metadata-key", "extra_info"))
    row = source.next_rows(2)[1]
    assert row["prompt"] == "What is 1 + 1?" and row["label"] == "2"
    assert row["metadata"] == {"split": "train", "index": 1, "answer": "1 + 1 = 2\n#### 2", "question": "What is 1 + 1?"}


def test_a_parquet_slice_and_the_reader_s_errors(tmp_path, plugin_manager):
    path = _parquet(tmp_path, verl_rows())
    parquet = plugin_manager.get_plugin("parquet")
    assert [r["label"] for r in parquet.data_source(**_reading(f"{path}@[1:3]", *VERL_KEYS)).next_rows(2)] == ["2", "4"]
    bad = verl_rows(3)
    for row in bad:  # a column a struct lacks in every row (a missing value in some rows is a null)
        row["reward_model"] = {"style": "rule"}
    with pytest.raises(PluginError) as excinfo:
        parquet.data_source(**_reading(_parquet(tmp_path, bad, "bad.parquet"), *VERL_KEYS))
    assert str(excinfo.value) == (f"{tmp_path / 'bad.parquet'}, row 1: row has no key 'reward_model.ground_truth' "
                                  "(--label-key); keys: ability, data_source, extra_info, prompt, reward_model.")
    (tmp_path / "junk.parquet").write_bytes(b"PAR1\x15\x04")
    with pytest.raises(PluginError, match=r"^--prompt-data '.*junk\.parquet': cannot read it as Parquet \(Arrow"):
        parquet.data_source(**_reading(tmp_path / "junk.parquet", *VERL_KEYS))


def test_a_data_set_saved_to_disk_reads_and_a_dataset_dict_asks_for_a_split(tmp_path, plugin_manager):
    rows = [{"prompt": [{"role": "user", "content": f"{i} + 1 = ?"}], "solution": str(i + 1), "level": i}
            for i in range(5)]
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(rows[:2])})
    dd.save_to_disk(str(tmp_path / "dd"))
    source_of = plugin_manager.get_plugin("hf_datasets").data_source
    keys = ["--input-key", "prompt", "--label-key", "solution", "--metadata-key", "level"]
    with pytest.raises(PluginError) as excinfo:
        source_of(**_reading(tmp_path / "dd", *keys))
    assert str(excinfo.value) == (f"--prompt-data '{tmp_path / 'dd'}': a DatasetDict with the splits train, test; name "
                                  f"one of them: --prompt-data {tmp_path / 'dd' / 'train'}.")
    with pytest.raises(PluginError, match=r"row 1: '(level)' \(--metadata-key\) must be a JSON object\.$"):
        source_of(**_reading(tmp_path / "dd" / "train", *keys))
    source = source_of(**_reading(tmp_path / "dd" / "train", "--input-key", "prompt", "--label-key", "solution",
                                  "--metadata-key", "level,solution"))
    assert len(source) == 5
    assert source.next_rows(1) == [{"prompt": [{"role": "user", "content": "0 + 1 = ?"}], "label": "1",
                                     "metadata": {"level": 0, "solution": "1"}}]


def test_csv_and_arrow_files_read_without_the_datasets_cache(tmp_path, plugin_manager, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    (tmp_path / "d.csv").write_text('question,answer\n"1 + 1 = ?",2\n"2 + 2 = ?",4\n')
    (tmp_path / "d.tsv").write_text("question\tanswer\n1 + 1 = ?\t2\n")
    datasets.Dataset.from_list([{"question": "3 + 3 = ?", "answer": "6"}]).save_to_disk(str(tmp_path / "ds"))
    arrow = next((tmp_path / "ds").glob("*.arrow"))
    source_of = plugin_manager.get_plugin("hf_datasets").data_source
    keys = ["--input-key", "question", "--label-key", "answer"]
    assert [r["label"] for r in source_of(**_reading(tmp_path / "d.csv", *keys)).next_rows(2)] == [2, 4]
    assert source_of(**_reading(tmp_path / "d.tsv", *keys)).next_rows(1)[0]["prompt"] == "1 + 1 = ?"
    assert source_of(**_reading(arrow, *keys)).next_rows(1)[0] == {"prompt": "3 + 3 = ?", "label": "6", "metadata": {}}
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("name, reader", [("train.parquet", "parquet"), ("train.parquet@[0:2]", "parquet"),
                                          ("d.csv", "hf_datasets"), ("saved", "hf_datasets"),
                                          ("train.jsonl", "jsonl"), ("plain_folder", "jsonl")])
def test_the_file_chooses_the_reader_when_no_flag_does(tmp_path, plugin_manager, monkeypatch, name, reader):
    from furlong.core.plugins.selection import resolve_selection

    monkeypatch.chdir(tmp_path)
    _parquet(tmp_path, verl_rows(2))
    (tmp_path / "d.csv").write_text("prompt,label\na,1\n")
    datasets.Dataset.from_list([{"prompt": "a", "label": "1"}]).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "plain_folder").mkdir()
    args = _args(name, *VERL_KEYS)
    assert resolve_selection(args, plugin_manager).chosen["data_source"] == (
        (reader, "--prompt-data") if reader != "jsonl" else ("jsonl", "--data-source"))
    forced = _args(name, *VERL_KEYS, extra=("--data-source", "jsonl"))
    assert resolve_selection(forced, plugin_manager).chosen["data_source"] == ("jsonl", "--data-source")


def test_an_eval_set_is_read_by_its_own_file_s_reader(tmp_path, plugin_manager):
    from furlong.core.config.launch_args import launch_config
    from furlong.core.rollout.evaluation import Evaluator
    from furlong.core.plugins.selection import resolve_selection

    train = _parquet(tmp_path, verl_rows(4))
    (tmp_path / "test.jsonl").write_text(json.dumps({"prompt": [{"role": "user", "content": "q"}],
                                                     "reward_model": {"ground_truth": "7"}}) + "\n")
    config = launch_config("--num-rollout", "1", "--rollout-batch-size", "2", "--prompt-data", str(train),
                           "--rm-type", "math", *VERL_KEYS, "--eval-prompt-data", "jl", str(tmp_path / "test.jsonl"),
                           "pq", str(train), "--eval-interval", "1", configure=False)
    evaluator = Evaluator(config, plugin_manager, resolve_selection(config, plugin_manager))
    asyncio.run(evaluator.load())
    assert {ds.name: [r["label"] for r in rows] for ds, rows in evaluator.datasets} == {
        "jl": ["7"], "pq": ["0", "2", "4", "6"]}


def test_without_the_package_the_error_says_what_to_install(tmp_path, plugin_manager, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_pyarrow(name, *args, **kwargs):
        if name.startswith("pyarrow"):
            raise ImportError(f"No module named '{name}'")
        return real_import(name, *args, **kwargs)

    path = _parquet(tmp_path, verl_rows(1))
    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    with pytest.raises(PluginError) as excinfo:
        plugin_manager.get_plugin("parquet").data_source(**_reading(path, *VERL_KEYS))
    assert str(excinfo.value) == (f"--prompt-data '{path}': the parquet data source needs pyarrow: pip install "
                                  "\"furlong[parquet]\" (or pip install pyarrow).")
