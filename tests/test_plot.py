"""``furlong plot RUN_DIR``: the PNG it draws from a run's metrics.jsonl, and its errors."""

from __future__ import annotations

import json

import pytest
from PIL import Image

C0 = (31, 119, 180)  # matplotlib's first line colour, #1f77b4: every panel with data has a C0 line


def _rows():
    """metrics.jsonl of a 5-rollout GRPO run with S = 2 steps per rollout and an eval every 2 rollouts,
    shaped like the loop writes it (step key per row; rollout rows repeat the last step's train/ values).
    No entropy metric: that panel must say "no data"."""
    rows = [{"eval/test": 0.30, "eval/test-truncated_ratio": 0.1, "eval/test/response_len/mean": 9.5,
             "perf/eval_time": 3.2, "eval/step": 0}]
    for r in range(5):
        for s in range(2):
            rows.append({"train/loss": -0.01 * s, "train/pg_loss": -0.01 * s, "train/ppo_kl": 0.001 * (r + s),
                         "train/pg_clipfrac": 0.02, "train/grad_norm": 0.8, "train/step": 2 * r + s})
        rows.append({"rollout/raw_reward": 0.3 + 0.05 * r, "rollout/response_lengths": 10.0 - r,
                     "rollout/truncated": 0.0, "train/ppo_kl": 0.001 * (r + 1), "perf/rollout_time": 4.0,
                     "perf/train_time": 1.5, "perf/update_weights_time": 0.1, "perf/save_model_time": None,
                     "rollout/step": r})
        if r % 2 == 1 or r == 4:
            rows.append({"eval/test": 0.32 + 0.04 * r, "eval/test-truncated_ratio": 0.0, "perf/eval_time": 3.0,
                         "eval/step": r})
    return rows


def _write(folder, rows):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _panels_with_c0(path):
    """For each of the 2 x 3 panels (row-major), whether its part of the image has C0 pixels."""
    image = Image.open(path).convert("RGB")
    width, height = image.size
    pixels = image.load()
    out = []
    for row in range(2):
        for col in range(3):
            box = range(col * width // 3, (col + 1) * width // 3), range(row * height // 2, (row + 1) * height // 2)
            out.append(any(pixels[x, y] == C0 for x in box[0] for y in box[1]))
    return out


def test_plot_writes_a_png_of_six_panels(tmp_path, run_furlong):
    _write(tmp_path / "run", _rows())
    done = run_furlong("plot", "run")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "run/metrics.png\n"
    with Image.open(tmp_path / "run" / "metrics.png") as image:
        assert (image.format, image.size) == ("PNG", (1350, 720))  # 15 x 8 inches at 90 dpi
    # reward, eval reward, KL / entropy (no data), response length, time split
    assert _panels_with_c0(tmp_path / "run" / "metrics.png") == [True, True, True, False, True, True]


def test_plot_takes_a_metrics_file_and_an_out_path(tmp_path, run_furlong):
    _write(tmp_path / "run", _rows())
    done = run_furlong("plot", "run/metrics.jsonl", "--out", "figure.png")
    assert (done.returncode, done.stdout) == (0, "figure.png\n"), done.stderr
    assert Image.open(tmp_path / "figure.png").size == (1350, 720)


def test_plot_missing_metrics_file_is_an_error(tmp_path, run_furlong):
    (tmp_path / "empty").mkdir()
    done = run_furlong("plot", "empty")
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == "error: furlong plot: no metrics file at empty/metrics.jsonl (runs write it with --save or --log-dir).\n"


@pytest.mark.parametrize("bad_line, reason", [("{oops", "Expecting property name enclosed in double quotes"),
                                              ('{"a": 1', "Expecting ',' delimiter")])
def test_plot_line_that_is_not_json_is_an_error_naming_file_and_line(tmp_path, run_furlong, bad_line, reason):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"rollout/step": 0}\n\n' + bad_line + "\n")
    done = run_furlong("plot", "run")
    assert done.returncode == 2
    assert done.stderr == f"error: run/metrics.jsonl:3: not valid JSON ({reason}).\n"
    assert not (tmp_path / "run" / "metrics.png").exists()
