"""A catalogue of bad inputs: each ends in one clear error, exit code 2, and no traceback."""

import json
import re
import shutil
import sys

import pytest

BASE = ["--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
        "--global-batch-size", "4", "--input-key", "prompt", "--label-key", "label", "--rm-type", "math",
        "--rollout-max-response-len", "4"]


@pytest.fixture
def good_data(tmp_path):
    path = tmp_path / "good.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n")
    return path


def _write(path, content):
    """Write ``content`` (text or bytes) to ``path``; return the path."""
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


def _model_copy(model, dest, edit_json=None):
    """A copy of the tiny model at ``dest``; ``edit_json``: {file name: function of its JSON}."""
    shutil.copytree(model, dest)
    for name, edit in (edit_json or {}).items():
        _write(dest / name, json.dumps(edit(json.loads((dest / name).read_text()))))
    return dest


def _cases(tmp_path, model, good):
    bad_json = _write(tmp_path / "bad.jsonl", '{"prompt": "1+1=", "label": "2"}\n{"prompt": "2+2=", "label": 4\n')
    no_label = _write(tmp_path / "nolabel.jsonl", '{"prompt": "1+1="}\n')
    empty = _write(tmp_path / "empty.jsonl", "\n")
    (tmp_path / "folder").mkdir()
    parquet = _write(tmp_path / "data.parquet", b"PAR1\x15\x04")
    latin1 = _write(tmp_path / "latin1.jsonl",
                    b'{"prompt": "1+1=", "label": "2"}\n{"prompt": "caf\xe9", "label": "2"}\n')
    blank_prompt = _write(tmp_path / "blank.jsonl",
                          '{"prompt": "1+1=", "label": "2"}\n{"prompt": "  ", "label": "2"}\n')
    twice = _write(tmp_path / "twice.jsonl", '{"prompt": "1+1=", "prompt": "2+2=", "label": "4"}\n')
    no_role = _write(tmp_path / "norole.jsonl", '{"prompt": [{"content": "1+1="}], "label": "2"}\n')
    save_file = _write(tmp_path / "save.txt", "x")
    old_run = tmp_path / "old_run"
    old_run.mkdir()
    _write(old_run / "latest_checkpointed_iteration.txt", "2")
    corrupt = _model_copy(model, tmp_path / "corrupt_model")
    _write(corrupt / "model.safetensors", b"garbage")
    no_tokenizer = tmp_path / "no_tokenizer"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(f"{model}/{name}", no_tokenizer / name)
    no_template = _model_copy(model, tmp_path / "no_template", {
        "tokenizer_config.json": lambda c: {k: v for k, v in c.items() if k != "chat_template"}})
    for extra in no_template.glob("chat_template.*"):
        extra.unlink()
    unknown_type = _model_copy(model, tmp_path / "unknown_type",
                               {"config.json": lambda c: {**c, "model_type": "frobnicator"}})
    broken_template = _write(tmp_path / "broken.jinja", "{% for m in messages %}{{ m.content }\n")
    damaged = tmp_path / "damaged_run"
    (damaged / "iter_0000000").mkdir(parents=True)
    (damaged / "rollout").mkdir()
    _write(damaged / "rollout" / "state_0.json", '{"data_source": {"epo')
    _write(damaged / "latest_checkpointed_iteration.txt", "0")
    return [
        (["--hf-checkpoint", model, "--prompt-data", good, "--load", str(damaged / "iter_0000000")],
         f"error: --load '{damaged / 'iter_0000000'}' is one checkpoint iteration; pass the directory that holds "
         f"it: --load {damaged} (add --ckpt-step 0 to resume from this iteration)."),
        (["--hf-checkpoint", model, "--prompt-data", good, "--load", str(damaged)],
         f"error: {damaged / 'rollout' / 'state_0.json'}: not valid JSON (Unterminated string starting at: line 1, "
         "column 18); the data state of checkpoint 0 is damaged. Restore it, delete it to start the data source "
         "fresh, or resume from an earlier checkpoint with --ckpt-step."),
        (["--hf-checkpoint", str(unknown_type), "--prompt-data", good],
         f"error: --hf-checkpoint {unknown_type}: cannot load the model (The checkpoint you are trying to load has "
         "model type `frobnicator` but Transformers does not recognize this architecture. This could be because of "
         "an issue with the checkpoint, or because your version of Transformers is out of date.)."),
        (["--hf-checkpoint", model, "--prompt-data", good, "--apply-chat-template", "--chat-template-path",
          str(broken_template)],
         f"error: --apply-chat-template: the chat template of --chat-template-path {broken_template} fails "
         "(template line 1): TemplateSyntaxError: unexpected '}'"),
        (["--hf-checkpoint", model, "--prompt-data", good, "--chat-template-path", str(tmp_path / "nope.jinja")],
         f"error: --chat-template-path '{tmp_path / 'nope.jinja'}': no such file or directory."),
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
         f"error: --eval-prompt-data t '{tmp_path / 'nope.jsonl'}': no such file."),
        (["--hf-checkpoint", model, "--prompt-data", str(tmp_path / "folder")],
         f"error: --prompt-data '{tmp_path / 'folder'}': is a directory; pass a JSONL file (one JSON object per line)."),
        (["--hf-checkpoint", model, "--prompt-data", str(parquet)],  # the file chooses the parquet data source
         f"error: --prompt-data '{parquet}': cannot read it as Parquet (ArrowInvalid: Could not open Parquet input "
         f"source '{parquet}': Parquet file size is 6 bytes, smaller than the minimum file footer (8 bytes))."),
        (["--hf-checkpoint", model, "--prompt-data", str(parquet), "--data-source", "jsonl"],
         f"error: --prompt-data '{parquet}': Parquet files are not read by the jsonl data source; choose --data-source "
         "parquet, or convert it to JSONL (pandas: df.to_json('data.jsonl', orient='records', lines=True))."),
        (["--hf-checkpoint", model, "--prompt-data", str(latin1)],
         f"error: {latin1}:2: not valid UTF-8 (byte 0xe9 at column 16); save the file as UTF-8."),
        (["--hf-checkpoint", model, "--prompt-data", str(blank_prompt)],
         f"error: {blank_prompt}:2: 'prompt' (--input-key) is empty."),
        (["--hf-checkpoint", model, "--prompt-data", str(twice)],
         f"error: {twice}:1: key 'prompt' appears twice in one object; keep one."),
        (["--hf-checkpoint", model, "--prompt-data", str(no_role)],
         f"error: {no_role}:1: 'prompt' message 0 must be an object with a string 'role' and a 'content' (chat "
         'format), got {"content": "1+1="}.'),
        (["--hf-checkpoint", model, "--prompt-data", f"{good}@[1:x]"],
         f"error: --prompt-data '{good}@[1:x]': bad slice '@[1:x]'; write PATH@[START:END] with whole numbers "
         "(either may be left out)."),
        (["--hf-checkpoint", f"{model}/config.json", "--prompt-data", good],
         f"error: --hf-checkpoint '{model}/config.json': is a file; pass the model directory ('{model}' holds it)."),
        (["--hf-checkpoint", model, "--prompt-data", good, "--save", str(save_file)],
         f"error: --save '{save_file}': is an existing file; --save needs a directory (it is created if missing)."),
        (["--hf-checkpoint", model, "--prompt-data", good, "--save", str(old_run)],
         f"error: --save '{old_run}': already holds a run (latest checkpoint 2); pass --load {old_run} to resume "
         "it, or choose an empty --save directory."),
        (["--hf-checkpoint", model, "--prompt-data", good, "--lr=-0.1"], "error: --lr must be at least 0, got -0.1."),
        (["--hf-checkpoint", str(corrupt), "--prompt-data", good],
         f"error: --hf-checkpoint {corrupt}: cannot read the weights in model.safetensors (SafetensorError: Error "
         "while deserializing header: header too small); the file is corrupt or truncated: download or export it "
         "again."),
        (["--hf-checkpoint", str(no_tokenizer), "--prompt-data", good],
         f"error: --hf-checkpoint {no_tokenizer}: no tokenizer files. The directory needs the model's tokenizer "
         "files (tokenizer.json and tokenizer_config.json, or its vocabulary files); copy them from where the model "
         "came from."),
        (["--hf-checkpoint", str(no_template), "--prompt-data", good, "--apply-chat-template"],
         f"error: --apply-chat-template: the tokenizer in {no_template} has no chat template; pass "
         "--chat-template-path FILE (a Jinja template) or drop --apply-chat-template."),
    ]


def test_bad_inputs_end_in_one_clear_error(tmp_path, tiny_model_dir, good_data, capsys):
    """In-process through the CLI's main (tests/test_plugins_cli.py runs the real subprocess)."""
    from furlong.core.cli.commands import main

    for extra, expected in _cases(tmp_path, str(tiny_model_dir), str(good_data)):
        code = main(["train", *BASE, *extra])
        err = capsys.readouterr().err
        assert code == 2, (extra, err)
        assert "Traceback" not in err, err
        assert expected in err.splitlines(), (expected, err)


@pytest.mark.parametrize("value, complaint", [
    ("'yes'", "returned 'yes' for sample \\d; a reward must be a number, None, or a dict whose --reward-key entry is "
              "the training scalar\\."),
    ("float('nan')", "returned nan for sample \\d; a reward must be a finite number\\."),
])
def test_a_reward_that_is_not_a_number_names_the_plugin_and_keeps_the_samples(tmp_path, tiny_model_dir, good_data,
                                                                             capsys, monkeypatch, value, complaint):
    from furlong.core.cli.commands import main

    (tmp_path / "word_reward.py").write_text(f"def reward(args, sample):\n    return {value}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    sys.modules.pop("word_reward", None)
    code = main(["train", *BASE, "--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(good_data),
                 "--custom-rm-path", "word_reward.reward"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert re.search(r"^error: rollout 0 failed: reward plugin 'word_reward\.reward' \(from --custom-rm-path\) "
                     + complaint, err, re.M), err
    dumped = [json.loads(line) for line in (tmp_path / "failed_rollout_0.jsonl").read_text().splitlines()]
    assert len(dumped) == 4 and dumped[0]["prompt"] == "1+1="
    sys.modules.pop("word_reward", None)


@pytest.mark.parametrize("body, flags, expected", [
    ("raise ValueError('no answer')", [],
     "error: evaluation of eval set 'test' before rollout 0 failed: reward plugin 'eval_reward.reward' (from "
     "--custom-rm-path) failed on sample 0: ValueError: no answer"),
    ("return {'acc': 1.0}", [],
     "error: evaluation of eval set 'test' before rollout 0 failed: reward plugin 'eval_reward.reward' (from "
     "--custom-rm-path), sample 0: the reward is a dict with keys ['acc']; pass --reward-key naming the scalar to "
     "train on (the evaluation reads it too, unless --eval-reward-key names another)."),
    ("return {'acc': 1.0}", ["--eval-reward-key", "acc"],  # the evaluation passes; training needs --reward-key
     "error: rollout 0 failed: reward plugin 'eval_reward.reward' (from --custom-rm-path), sample 0: the reward is a "
     "dict with keys ['acc']; pass --reward-key naming the scalar to train on (the evaluation reads it too, unless "
     "--eval-reward-key names another)."),
    ("return {'acc': 1.0}", ["--eval-reward-key", "score", "--reward-key", "acc"],
     "error: evaluation of eval set 'test' before rollout 0 failed: reward plugin 'eval_reward.reward' (from "
     "--custom-rm-path), sample 0: --eval-reward-key 'score' is not in the reward dict (keys: ['acc'])."),
])
def test_a_reward_failing_in_the_evaluation_before_rollout_0_says_so_and_keeps_the_samples(
        tmp_path, tiny_model_dir, good_data, capsys, monkeypatch, body, flags, expected):
    from furlong.core.cli.commands import main

    (tmp_path / "eval_reward.py").write_text(f"def reward(args, sample):\n    {body}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    sys.modules.pop("eval_reward", None)
    run = tmp_path / "runs" / "evalfail"
    code = main(["train", *[f for f in BASE if f not in ("--rm-type", "math")], "--hf-checkpoint", str(tiny_model_dir),
                 "--prompt-data", str(good_data), "--custom-rm-path", "eval_reward.reward", "--eval-prompt-data",
                 "test", str(good_data), "--n-samples-per-eval-prompt", "2", "--eval-interval", "1", "--save", str(run),
                 *flags])
    err = capsys.readouterr().err
    sys.modules.pop("eval_reward", None)
    assert code == 2 and "Traceback" not in err, err
    lines = err.splitlines()
    # every sample's reward fails alike and they are scored concurrently: whichever is reported first is named
    assert re.sub(r"sample \d+", "sample N", lines[0]) == re.sub(r"sample \d+", "sample N", expected), err
    what = "rollout" if expected.startswith("error: rollout") else "evaluation"
    dumped_to = run / f"failed_{'eval' if what == 'evaluation' else 'rollout'}_0.jsonl"
    assert lines[1:] == [f"error:   The {what}'s samples are in {dumped_to}."]  # the --save folder: outputs go there
    dumped = [json.loads(line) for line in dumped_to.read_text().splitlines()]
    assert len(dumped) == (2 if what == "evaluation" else 4) and dumped[0]["prompt"] == "1+1="


def test_a_run_rejected_after_its_flags_parse_prints_its_error_without_the_core_s_notes(tmp_path, tiny_model_dir,
                                                                                         good_data, capsys, caplog):
    """The --save-interval note is written once the whole configuration is accepted, not before the error of a
    run that selection or a plugin's configure rejects."""
    from furlong.core.cli.commands import main

    flags = [*BASE, "--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(good_data),
             "--save", str(tmp_path / "run")]
    note = "--save-interval defaults to 100 rollouts (it was 10 before 0.0.8)."
    caplog.set_level("INFO", logger="furlong.config")
    assert main(["train", *[f if f != "math" else "maht" for f in flags]]) == 2
    assert capsys.readouterr().err.startswith(
        "error: --rm-type 'maht': no installed plugin of that name implements `reward`.")
    assert caplog.messages == []
    assert main(["train", *flags, "--print-config"]) == 0
    assert note in caplog.messages


def test_a_relative_model_path_that_is_not_there_is_one_error_and_no_hub_download(tmp_path, good_data, capsys,
                                                                                 monkeypatch):
    """`models/SmolLM2-135M` looks like a Hub id: furlong never downloads, so it is one error at once."""
    import time

    from furlong.core.cli.commands import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    start = time.monotonic()
    code = main(["train", *BASE, "--hf-checkpoint", "models/SmolLM2-135M", "--prompt-data", str(good_data),
                 "--apply-chat-template"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.splitlines() == [
        f"error: --hf-checkpoint 'models/SmolLM2-135M': no such directory (in {tmp_path}). furlong reads local model "
        "directories only, never the Hugging Face Hub; if this is a Hub id, download it first (hf download "
        "models/SmolLM2-135M --local-dir models/SmolLM2-135M) and pass that folder."]
    assert time.monotonic() - start < 30  # the Hub was not tried (that took 52 s on a machine without network)


def test_the_tokenizer_helper_names_a_missing_directory():
    from furlong.hooks import PluginError
    from furlong.kit.hf import load_tokenizer

    with pytest.raises(PluginError) as excinfo:
        load_tokenizer("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert str(excinfo.value) == ("--hf-checkpoint HuggingFaceTB/SmolLM2-135M-Instruct: no such directory (furlong "
                                  "reads local model directories only).")


def test_every_line_of_a_multi_line_error_starts_with_error(tmp_path, tiny_model_dir, good_data, capsys):
    from furlong.core.cli.commands import main

    flags = [*BASE, "--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(good_data)]
    assert main(["train", *[f if f != "math" else "maht" for f in flags]]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "error: --rm-type 'maht': no installed plugin of that name implements `reward`."
    assert lines[1].startswith("error:   Available: ") and "math (furlong " in lines[1]
    assert lines[2] == "error:   Did you mean 'math'? List them with: furlong plugins --hook reward"
    assert all(line.startswith("error: ") for line in lines)


def test_error_lines_prefix_each_line_of_each_problem():
    from furlong.core.cli.commands import error_lines
    from furlong.core.config import ConfigError
    from furlong.hooks import PluginError

    assert error_lines(PluginError("rollout 0 failed: boom\n  The rollout's samples are in x.jsonl.")) == [
        "error: rollout 0 failed: boom", "error:   The rollout's samples are in x.jsonl."]
    assert error_lines(ConfigError(["one.", "two:\n  detail."])) == ["error: one.", "error: two:", "error:   detail."]


def test_no_reward_for_the_first_rows_is_told_before_any_model_loads(tmp_path, good_data, capsys, monkeypatch):
    """Without --rm-type the rows must name a reward: told before the model loads, no failed_rollout file."""
    from furlong.core.cli.commands import main

    monkeypatch.chdir(tmp_path)
    flags = [f for f in BASE if f not in ("--rm-type", "math")]
    # a model path with a config.json but no weights: the run must stop before anything reads them
    (tmp_path / "unloadable").mkdir()
    (tmp_path / "unloadable" / "config.json").write_text("{}")
    code = main(["train", *flags, "--hf-checkpoint", str(tmp_path / "unloadable"), "--prompt-data", str(good_data)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert err.splitlines()[-1].startswith(
        "error: no reward chosen: the run has neither --rm-type nor --custom-rm-path, and 2 of the 2 prompts the first "
        f"rollout draws from {good_data} name none in metadata['rm_type'] (the first: '1+1='). Pass --rm-type NAME "
        "(installed: ")
    assert "math" in err.splitlines()[-1]
    assert list(tmp_path.glob("failed_rollout_*")) == []


def test_rows_that_name_their_reward_pass_and_are_drawn_again(plugin_manager):
    from furlong.core.config.launch_args import launch_args
    from furlong.core.rollout.rewards import check_first_rows_name_a_reward
    from furlong.hooks import PluginError
    from furlong.kit.epochs import EpochOrder

    class Rows:
        def __init__(self, rows):
            self.rows, self.order = rows, EpochOrder(len(rows), shuffle=True, seed=3)

        def next_rows(self, k):
            return [self.rows[i] for i in self.order.take(k)]

        def state(self):
            return self.order.state()

        def load_state(self, state):
            self.order.load_state(state)

    named = Rows([{"prompt": str(i), "label": "1", "metadata": {"rm_type": "math"}} for i in range(5)])
    args = launch_args(rollout_batch_size=3, over_sampling_batch_size=4, prompt_data="d.jsonl")
    first = Rows(named.rows).next_rows(4)
    check_first_rows_name_a_reward(args, plugin_manager, named)
    assert named.next_rows(4) == first  # the rows checked are drawn again
    mixed = Rows([{"prompt": "p" * 80 if i == 4 else str(i), "label": "1",
                   "metadata": {"rm_type": "math"} if i != 4 else {}} for i in range(5)])
    with pytest.raises(PluginError, match=r"and 1 of the 4 prompts the first rollout draws from d\.jsonl name none in "
                                          r"metadata\['rm_type'\] \(the first: 'p{57}\.\.\.'\)"):
        check_first_rows_name_a_reward(args, plugin_manager, mixed)
