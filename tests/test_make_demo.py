"""examples/demo/make_demo.py: the task data is seeded, complete and reproduces the committed files."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "examples" / "demo" / "make_demo.py"
COMMITTED = REPO_ROOT / "examples" / "demo" / "data"


def _load():
    spec = importlib.util.spec_from_file_location("make_demo", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _data_only(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--data-only", "--out", str(out), *extra],
        capture_output=True, text=True, timeout=60,
    )


def _files(out: Path) -> dict[str, bytes]:
    return {name: (out / "data" / name).read_bytes() for name in ("train.jsonl", "test.jsonl")}


def test_data_only_is_byte_identical_for_a_seed(tmp_path):
    first = _data_only(tmp_path / "a", "--n-train", "50", "--n-test", "10")
    second = _data_only(tmp_path / "b", "--n-train", "50", "--n-test", "10")
    assert first.returncode == 0, first.stderr
    assert second.returncode == 0, second.stderr
    assert first.stdout.startswith("wrote 50 train and 10 test rows to ")
    assert _files(tmp_path / "a") == _files(tmp_path / "b")
    assert not (tmp_path / "a" / "model").exists()  # --data-only never trains


def test_another_seed_gives_other_rows(tmp_path):
    _data_only(tmp_path / "a", "--n-train", "50", "--n-test", "10", "--seed", "0")
    _data_only(tmp_path / "b", "--n-train", "50", "--n-test", "10", "--seed", "1")
    assert _files(tmp_path / "a")["train.jsonl"] != _files(tmp_path / "b")["train.jsonl"]


def test_defaults_reproduce_the_committed_jsonl(tmp_path):
    result = _data_only(tmp_path)
    assert result.returncode == 0, result.stderr
    assert _files(tmp_path) == {
        name: (COMMITTED / name).read_bytes() for name in ("train.jsonl", "test.jsonl")
    }


def test_small_counts_are_prefixes_of_one_shuffle(tmp_path):
    # test = first n_test of the shuffled problems, train = the next n_train
    _data_only(tmp_path, "--n-train", "50", "--n-test", "10")
    small = _files(tmp_path)
    committed_test = (COMMITTED / "test.jsonl").read_bytes().splitlines(keepends=True)
    assert small["test.jsonl"] == b"".join(committed_test[:10])
    assert len(small["train.jsonl"].splitlines()) == 50


def test_too_many_rows_is_an_error(tmp_path):
    result = _data_only(tmp_path, "--n-train", "4100", "--n-test", "101")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == "--n-train + --n-test must be at most 4200"


def test_all_problems_are_distinct_and_answered_right():
    make_demo = _load()
    problems = make_demo.all_problems()
    assert len(problems) == 4200  # 10*2*10 two-operand + 10*2*10*2*10 three-operand
    assert len({prompt for prompt, _ in problems}) == 4200
    for prompt, answer in problems:
        tokens = prompt.split()
        assert tokens[-1] == "="
        value = int(tokens[0])
        for op, operand in zip(tokens[1:-1:2], tokens[2:-1:2]):
            value += int(operand) if op == "+" else -int(operand)
        assert value == answer, prompt
    assert min(a for _, a in problems) == -18  # 0 - 9 - 9
    assert max(a for _, a in problems) == 27  # 9 + 9 + 9


@pytest.mark.parametrize(
    ("step", "expected"),
    [
        (0, 0.1),  # warm-up: (0 + 1) / 10
        (9, 1.0),  # warm-up ends: (9 + 1) / 10
        (10, 1.0),  # cosine at progress 0: 0.1 + 0.9 * 0.5 * (1 + cos 0)
        (55, 0.55),  # progress (55 - 10) / 90 = 0.5: 0.1 + 0.9 * 0.5 * (1 + cos(pi / 2))
        (100, 0.1),  # progress 1: 0.1 + 0.9 * 0.5 * (1 + cos(pi))
    ],
)
def test_lr_factor(step, expected):
    assert math.isclose(_load().lr_factor(step, 100, 10), expected, abs_tol=1e-12)


def test_warm_up_examples_mix_bare_and_boxed_answers():
    make_demo = _load()
    tokenizer = make_demo.build_tokenizer()
    rows = [{"prompt": "1 + 2 = ", "label": "3"}] * 400
    examples = make_demo.warm_up_examples(tokenizer, rows, 0.5, 0)
    assert {tokenizer.decode(prompt) for prompt, _ in examples} == {"1 + 2 = "}
    responses = [tokenizer.decode(response[:-1]) for _, response in examples]
    assert set(responses) == {"3", "\\boxed{3}"}
    assert all(response[-1] == tokenizer.eos_token_id for _, response in examples)
    bare = responses.count("3")
    assert 160 < bare < 240  # Binomial(400, 0.5): mean 200, sd 10
    assert make_demo.warm_up_examples(tokenizer, rows, 0.5, 0) == examples
    assert make_demo.warm_up_examples(tokenizer, rows[:5], 0.0, 0)[0][1] == tokenizer(
        "\\boxed{3}", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def test_boxed_answer():
    make_demo = _load()
    assert make_demo.boxed_answer("\\boxed{-12}") == "-12"
    assert make_demo.boxed_answer("\\boxed{1}\\boxed{14}") == "14"
    assert make_demo.boxed_answer("14") is None
    assert make_demo.boxed_answer("\\boxed{1b}") is None


def test_the_moe_architecture_builds_a_qwen3_moe_of_the_demo_size():
    make_demo = _load()
    args = make_demo.parse_args(["--architecture", "qwen3_moe", "--experts", "4", "--topk", "2"])
    model = make_demo.build_model(make_demo.build_tokenizer(), args)
    config = model.config
    assert config.architectures == ["Qwen3MoeForCausalLM"]
    assert (config.num_experts, config.num_experts_per_tok, config.norm_topk_prob) == (4, 2, True)
    assert (config.hidden_size, config.num_hidden_layers, config.moe_intermediate_size, config.head_dim) == (128, 3, 256, 32)
    # per layer: attention 4 x 128^2, q/k norms 2 x 32, router 4 x 128, experts 4 x 3 x 128 x 256, two norms 2 x 128;
    # embeddings and output 2 x 26 x 128, final norm 128
    assert sum(p.numel() for p in model.parameters()) == 3 * (65536 + 64 + 512 + 393216 + 256) + 6656 + 128 == 1_385_536
