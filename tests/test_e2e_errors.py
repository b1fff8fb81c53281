"""A catalogue of bad inputs: each ends in one clear error, exit code 2, and no traceback."""

import json

import pytest

BASE = ["--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
        "--global-batch-size", "4", "--input-key", "prompt", "--label-key", "label", "--rm-type", "math",
        "--rollout-max-response-len", "4"]


@pytest.fixture
def good_data(tmp_path):
    path = tmp_path / "good.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n")
    return path


def _cases(tmp_path, model, good):
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"prompt": "1+1=", "label": "2"}\n{"prompt": "2+2=", "label": 4\n')
    no_label = tmp_path / "nolabel.jsonl"
    no_label.write_text('{"prompt": "1+1="}\n')
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    return [
        (["--hf-checkpoint", model, "--prompt-data", str(tmp_path / "missing.jsonl")],
         f"error: --prompt-data '{tmp_path / 'missing.jsonl'}': no such file."),
        (["--hf-checkpoint", model, "--prompt-data", str(bad_json)],
         f"error: {bad_json}:2: not valid JSON (Expecting ',' delimiter at column 30)."),
        (["--hf-checkpoint", model, "--prompt-data", str(no_label)],
         f"error: {no_label}:1: row has no key 'label' (--label-key); keys: prompt."),
        (["--hf-checkpoint", model, "--prompt-data", str(empty)],
         f"error: --prompt-data '{empty}': the file has no rows."),
        (["--hf-checkpoint", str(tmp_path / "nomodel"), "--prompt-data", good],
         f"error: --hf-checkpoint '{tmp_path / 'nomodel'}': no such directory."),
        (["--hf-checkpoint", str(tmp_path), "--prompt-data", good],
         f"error: --hf-checkpoint '{tmp_path}': the directory has no config.json; point it at a Hugging Face "
         "model directory."),
        (["--hf-checkpoint", model, "--prompt-data", good, "--eval-prompt-data", "t", str(tmp_path / "nope.jsonl"),
          "--eval-interval", "1"],
         f"error: --prompt-data '{tmp_path / 'nope.jsonl'}': no such file."),
    ]


def test_bad_inputs_end_in_one_clear_error(tmp_path, tiny_model_dir, good_data, capsys):
    """In-process through the CLI's main (tests/test_plugins_cli.py runs the real subprocess)."""
    from furlong.core.cli import main

    for extra, expected in _cases(tmp_path, str(tiny_model_dir), str(good_data)):
        code = main(["train", *BASE, *extra])
        err = capsys.readouterr().err
        assert code == 2, (extra, err)
        assert "Traceback" not in err, err
        assert expected in err.splitlines(), (expected, err)
