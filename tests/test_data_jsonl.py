"""The jsonl data source: rows, slices, epochs, shuffle, and errors naming file and line."""

import json

import pytest

from furlong.core.config.launch_args import launch_config
from furlong.hooks import PluginError

from .configs import training_dataset


def _config(path, *extra):
    return launch_config("--rollout-batch-size", "2", "--prompt-data", str(path), "--input-key", "prompt",
                         "--label-key", "label", "--rm-type", "math", *extra, configure=False)


def _write(tmp_path, lines, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _source(plugin_manager, config):
    return plugin_manager.get_plugin("jsonl").data_source(config=config, dataset=training_dataset(config))


def test_hook_data_source_reads_rows_in_order(tmp_path, plugin_manager):
    rows = [json.dumps({"prompt": f"q{i}", "label": str(i), "metadata": {"k": i}}) for i in range(3)]
    source = _source(plugin_manager, _config(_write(tmp_path, rows)))
    got = source.next_rows(2)
    assert got == [{"prompt": "q0", "label": "0", "metadata": {"k": 0}}, {"prompt": "q1", "label": "1", "metadata": {"k": 1}}]
    # Rolls over into epoch 1 and keeps going.
    assert [r["prompt"] for r in source.next_rows(3)] == ["q2", "q0", "q1"]
    assert source.state()["epoch"] == 1 and source.state()["offset"] == 2


def test_shuffle_is_seeded_per_epoch_and_state_round_trips(tmp_path, plugin_manager):
    path = _write(tmp_path, [json.dumps({"prompt": f"q{i}", "label": "1"}) for i in range(10)])
    a = _source(plugin_manager, _config(path, "--rollout-shuffle"))
    first = [r["prompt"] for r in a.next_rows(13)]
    assert sorted(first[:10]) == sorted(f"q{i}" for i in range(10)) and first[:10] != [f"q{i}" for i in range(10)]
    b = _source(plugin_manager, _config(path, "--rollout-shuffle"))
    b.load_state(a.state())
    assert [r["prompt"] for r in a.next_rows(5)] == [r["prompt"] for r in b.next_rows(5)]


def test_slice_keeps_python_slice_rows(tmp_path, plugin_manager):
    path = _write(tmp_path, [json.dumps({"prompt": f"q{i}", "label": "1"}) for i in range(5)])
    source = _source(plugin_manager, _config(f"{path}@[1:3]"))
    assert [r["prompt"] for r in source.next_rows(2)] == ["q1", "q2"]


@pytest.mark.parametrize("lines, message", [
    ([], "the file has no rows."),
    (['{"prompt": "a", "label": "1"}', "{not json"], ":2: not valid JSON (Expecting property name enclosed in double quotes at column 2)."),
    (['{"prompt": "a", "label": "1"}', '{"question": "b", "label": "2"}'], ":2: row has no key 'prompt' (--input-key); keys: label, question."),
    (['{"prompt": "a"}'], ":1: row has no key 'label' (--label-key); keys: prompt."),
    (['{"prompt": "a", "reward_model": {"label": "1"}}'], ":1: row has no key 'label' (--label-key); "
     "keys: prompt, reward_model (did you mean --label-key reward_model.label?)."),
    (['[1, 2]'], ":1: expected a JSON object, got list."),
    (['{"prompt": "a", "label": "1", "metadata": 3}'], ":1: 'metadata' (--metadata-key) must be a JSON object."),
])
def test_bad_files_name_file_and_line(tmp_path, plugin_manager, lines, message):
    path = _write(tmp_path, lines)
    with pytest.raises(PluginError) as excinfo:
        _source(plugin_manager, _config(path))
    expected = f"--prompt-data '{path}': {message}" if message.startswith("the file") else f"{path}{message}"
    assert str(excinfo.value) == expected


def test_missing_file_is_named(tmp_path, plugin_manager):
    with pytest.raises(PluginError) as excinfo:
        _source(plugin_manager, _config(tmp_path / "nope.jsonl"))
    assert str(excinfo.value) == f"--prompt-data '{tmp_path / 'nope.jsonl'}': no such file."
