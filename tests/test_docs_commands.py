"""docs/from-trl.md and docs/from-verl.md: every command in their ``bash`` blocks runs, from a copy of the
repository root, and the figures the pages quote are what the runs print. A verl GSM8K file and the page's
reward work as the page says."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
PAGES = ("from-trl.md", "from-verl.md")

pytest.importorskip("pyarrow")
pytest.importorskip("datasets")


def bash_blocks(page: str) -> list[str]:
    """The ``bash`` blocks of ``docs/<page>``, in order."""
    text = (REPO_ROOT / "docs" / page).read_text(encoding="utf-8")
    return re.findall(r"^```bash\n(.*?)^```", text, re.M | re.S)


def quoted_rewards(page: str) -> tuple[str, str]:
    """The "before → after" test-split rewards the page quotes."""
    text = (REPO_ROOT / "docs" / page).read_text(encoding="utf-8")
    before, after = re.search(r"\*\*(\d\.\d+) → (\d\.\d+)\*\*", text).groups()
    return before, after


def _extras() -> set[str]:
    with open(REPO_ROOT / "pyproject.toml", "rb") as f:
        return set(tomllib.load(f)["project"]["optional-dependencies"])


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FURLONG_DISABLE_PLUGINS")}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.mark.timeout(600)
@pytest.mark.parametrize("page", PAGES)
def test_the_page_s_commands_run_and_print_its_figures(page, tmp_path):
    (tmp_path / "examples").symlink_to(REPO_ROOT / "examples")  # the page's paths are relative to the root
    logs = []
    for block in bash_blocks(page):
        if block.startswith("pip install"):  # installing is the environment's job; the extra must exist
            assert set(re.findall(r'"\.\[([\w,-]+)\]"', block)[0].split(",")) <= _extras(), block
            continue
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, env=_env(),
                              capture_output=True, text=True, timeout=560)
        assert done.returncode == 0, (block, done.stderr[-3000:])
        assert "Traceback" not in done.stderr
        logs.append(done.stdout + done.stderr)
    before, after = quoted_rewards(page)
    train_log = logs[-1]
    assert f"eval at rollout 0: eval/test {before}," in train_log, train_log[-2000:]
    assert f"eval at rollout 9: eval/test {after}," in train_log, train_log[-2000:]


def _verl_gsm8k_rows() -> list[dict]:
    """tests/data/gsm8k's rows as verl's GSM8K preparation lays them out."""
    instruction = "Let's think step by step and output the final answer after \"####\"."
    rows = []
    with open(REPO_ROOT / "tests" / "data" / "gsm8k" / "train.jsonl", encoding="utf-8") as f:
        for i, line in enumerate(f):
            raw = json.loads(line)
            truth = re.search(r"#### (-?[0-9.,]+)", raw["answer"]).group(1).replace(",", "")
            rows.append({"data_source": "openai/gsm8k",
                         "prompt": [{"role": "user", "content": f"{raw['question']} {instruction}"}],
                         "ability": "math", "reward_model": {"style": "rule", "ground_truth": truth},
                         "extra_info": {"split": "train", "index": i, "answer": raw["answer"],
                                        "question": raw["question"]}})
    return rows


def test_the_page_s_verl_score_grades_gsm8k_answers():
    sys.path.insert(0, str(REPO_ROOT / "examples" / "verl"))
    try:
        from verl_score import compute_score
    finally:
        sys.path.pop(0)
    for row in _verl_gsm8k_rows():
        truth = row["reward_model"]["ground_truth"]
        assert compute_score("openai/gsm8k", row["extra_info"]["answer"], truth, row["extra_info"]) == 1.0
        assert compute_score("openai/gsm8k", f"so \\boxed{{{truth}}}", truth) == 1.0
        assert compute_score("openai/gsm8k", "#### 999999", truth) == 0.0
        assert compute_score("openai/gsm8k", "no final answer", truth) == 0.0


@pytest.mark.timeout(300)
def test_a_verl_gsm8k_file_trains_with_the_page_s_flags(tmp_path, tiny_model_dir):
    """The flags of the page's "A verl GSM8K file" section on GSM8K-format rows in verl's columns, on a tiny model."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(_verl_gsm8k_rows()), tmp_path / "train.parquet")
    (tmp_path / "chat.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")  # the tiny model has none
    text = (REPO_ROOT / "docs" / "from-verl.md").read_text(encoding="utf-8")
    section = text[text.index("## A verl GSM8K file"):]
    command = re.search(r"```text\n(.*?)```", section, re.S).group(1)
    flags = command.replace("\\\n", " ").split()
    assert flags[:3] == ["PYTHONPATH=examples/verl", "furlong", "train"]
    page = dict(zip(flags[3::1], flags[4::1]))
    for key in ("--input-key", "--label-key", "--metadata-key", "--custom-rm-path"):
        assert key in page, key
    env = dict(_env(), PYTHONPATH=str(REPO_ROOT / "examples" / "verl"))
    done = subprocess.run(
        [sys.executable, "-m", "furlong.core", "train", "--hf-checkpoint", str(tiny_model_dir),
         "--prompt-data", "train.parquet", "--input-key", page["--input-key"], "--label-key", page["--label-key"],
         "--metadata-key", page["--metadata-key"], "--apply-chat-template", "--chat-template-path", "chat.jinja",
         "--custom-rm-path",
         page["--custom-rm-path"], "--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
         "--global-batch-size", "4", "--rollout-max-response-len", "8", "--calculate-per-token-loss",
         "--log-dir", "run"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout/raw_reward"] for r in rows if "rollout/step" in r] == [0.0]  # a random tiny model
    assert "is a verl reward: responses are decoded without special tokens" in done.stderr
