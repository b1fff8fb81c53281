"""The committed demo (examples/demo) and the GSM8K converter (examples/gsm8k/prepare.py)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
DEMO = REPO_ROOT / "examples" / "demo"
MODEL = DEMO / "model"
# a few rows in GSM8K's format ({"question", "answer"}, the answer ending "#### N"), written for these tests
GSM8K_SRC = Path(__file__).resolve().parent / "data" / "gsm8k"


def _rows(split: str) -> list[dict]:
    with open(DEMO / "data" / f"{split}.jsonl", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL, local_files_only=True)


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(MODEL, local_files_only=True).eval()


# --- demo data ---------------------------------------------------------------------------


def test_jsonl_rows_have_prompt_and_integer_label():
    for split, count in (("train", 4000), ("test", 200)):
        rows = _rows(split)
        assert len(rows) == count
        for row in rows:
            assert set(row) == {"prompt", "label"}
            assert isinstance(row["prompt"], str) and row["prompt"].endswith(" = ")
            assert re.fullmatch(r"-?\d+", row["label"]), row


def test_labels_are_the_values_of_the_prompts():
    for row in _rows("train") + _rows("test"):
        tokens = row["prompt"].split()[:-1]  # drop "="
        value = int(tokens[0])
        for op, operand in zip(tokens[1::2], tokens[2::2]):
            value += int(operand) if op == "+" else -int(operand)
        assert str(value) == row["label"], row


def test_train_and_test_are_disjoint():
    train = {row["prompt"] for row in _rows("train")}
    test = {row["prompt"] for row in _rows("test")}
    assert len(train) == 4000 and len(test) == 200  # no duplicate inside a split either
    assert not train & test


# --- demo model --------------------------------------------------------------------------


def test_model_directory_is_small_and_complete():
    names = {path.name for path in MODEL.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors",
            "tokenizer.json", "tokenizer_config.json"} <= names
    assert sum(path.stat().st_size for path in MODEL.iterdir()) < 10 * 1024 * 1024
    config = json.loads((MODEL / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"


def test_model_loads_offline_and_scores_tokens(model, tokenizer):
    from transformers import LlamaForCausalLM
    import torch

    assert isinstance(model, LlamaForCausalLM)
    ids = tokenizer("7 - 2 + 9 = ", add_special_tokens=False, return_tensors="pt")["input_ids"]
    assert ids.shape == (1, 12)  # one token per character, nothing added
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, 12, model.config.vocab_size)
    assert model.config.vocab_size == len(tokenizer) == 26
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id


def test_tokenizer_round_trips_every_prompt_and_label(tokenizer):
    for row in _rows("train") + _rows("test"):
        for text in (row["prompt"] + row["label"], row["prompt"] + "\\boxed{" + row["label"] + "}"):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            assert len(ids) == len(text)
            assert tokenizer.unk_token_id not in ids
            assert tokenizer.decode(ids) == text


def test_chat_template_renders_the_bare_prompt(tokenizer):
    messages = [{"role": "user", "content": "7 - 2 + 9 = "}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == "7 - 2 + 9 = "


def test_greedy_reward_starts_between_floor_and_ceiling(model, tokenizer):
    # The demo's premise: the warm-up boxes only some answers, so a boxed-answer reward starts
    # clearly above 0 and clearly below 1 (make_demo.py measured 0.625 greedy, boxed 0.660).
    import torch

    rows = _rows("test")
    encoded = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
    width = max(map(len, encoded))
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row_ids in enumerate(encoded):
        ids[i, width - len(row_ids):] = torch.tensor(row_ids)
        mask[i, width - len(row_ids):] = 1
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                             max_new_tokens=16, pad_token_id=tokenizer.pad_token_id)
    texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    boxed = [re.findall(r"\\boxed\{(-?\d+)\}", text) for text in texts]
    reward = sum(bool(b) and b[-1] == r["label"] for b, r in zip(boxed, rows)) / len(rows)
    boxed_share = sum(bool(b) for b in boxed) / len(rows)
    assert 0.3 < reward < 0.9
    assert 0.3 < boxed_share < 0.9


# --- GSM8K converter ---------------------------------------------------------------------


def _prepare():
    spec = importlib.util.spec_from_file_location("gsm8k_prepare", REPO_ROOT / "examples" / "gsm8k" / "prepare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gsm8k_prepare_first_five_test_rows(tmp_path):
    prepare = _prepare()
    assert prepare.main(["--src", str(GSM8K_SRC), "--out", str(tmp_path), "--limit", "5"]) == 0
    with open(tmp_path / "test.jsonl", encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle]
    with open(GSM8K_SRC / "test.jsonl", encoding="utf-8") as handle:
        raw = [json.loads(next(handle)) for _ in range(5)]
    # the last line of each GSM8K answer is "#### <number>"
    assert [r["label"] for r in rows] == ["12", "90", "2250", "47", "200"]
    assert [r["label"] for r in rows] == [
        a["answer"].splitlines()[-1].removeprefix("#### ").replace(",", "") for a in raw
    ]
    for row, source in zip(rows, raw):
        assert set(row) == {"prompt", "label"}
        assert row["prompt"] == (source["question"].strip() + "\n\nSolve the problem step by step, "
                                 "then write the final answer as \\boxed{answer}.")
    assert len((tmp_path / "train.jsonl").read_text().splitlines()) == 5


@pytest.mark.parametrize(
    ("answer", "label"),
    [
        ("48 / 2 = <<48/2=24>>24\n#### 24", "24"),
        ("so $1,234,500 total\n#### 1,234,500", "1234500"),
        ("a loss\n#### -3", "-3"),
    ],
)
def test_gsm8k_label_drops_commas(answer, label):
    assert _prepare().label_of(answer) == label


def test_gsm8k_prepare_names_the_bad_line(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "train.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n{"question": "q", "answer": "7"}\n')
    (src / "test.jsonl").write_text("")
    with pytest.raises(SystemExit) as excinfo:
        _prepare().main(["--src", str(src), "--out", str(tmp_path / "out")])
    assert str(excinfo.value) == (
        f"{src / 'train.jsonl'}, line 2: not a GSM8K row (ValueError: the answer has no '####' marker)"
    )


def test_gsm8k_prepare_needs_src():
    with pytest.raises(SystemExit) as excinfo:
        _prepare().main(["--out", "unused"])
    assert excinfo.value.code == 2


def test_no_file_reads_data_outside_the_repository():
    """Tests and examples use only what the repository holds: no path into a sibling folder."""
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    outside = re.compile(r"(\.\.|/work)/shared\b")
    offenders = []
    for name in tracked.stdout.splitlines():
        path = REPO_ROOT / name
        if path.suffix in {".py", ".sh", ".md", ".toml", ".args", ".txt", ".cfg", ".yaml"} and path.is_file():
            if outside.search(path.read_text(encoding="utf-8", errors="replace")):
                offenders.append(name)
    assert offenders == []


def test_gsm8k_prepare_missing_source(tmp_path):
    with pytest.raises(SystemExit) as excinfo:
        _prepare().main(["--src", str(tmp_path), "--out", str(tmp_path / "out")])
    assert str(excinfo.value) == (
        f"{tmp_path / 'train.jsonl'}: no such file; point --src at the folder holding "
        "train.jsonl and test.jsonl of GSM8K"
    )


def test_gsm8k_output_folder_is_git_ignored():
    assert (REPO_ROOT / "examples" / "gsm8k" / ".gitignore").read_text().splitlines() == ["data/"]


@pytest.mark.parametrize("path", ["models/smollm2-135m-instruct/model.safetensors", "examples/smollm2/data/train.jsonl",
                                  "examples/gsm8k/data/train.jsonl", "runs/demo/metrics.jsonl",
                                  "failed_rollout_0.jsonl"])
def test_what_the_docs_commands_write_is_git_ignored(path):
    """docs/smollm2.md, examples/gsm8k and the quick start write these; none may show up in `git status`."""
    done = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=REPO_ROOT)
    assert done.returncode == 0, path
