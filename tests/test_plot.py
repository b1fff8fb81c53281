"""``furlong plot RUN_DIR [RUN_DIR ...]``: the PNG it draws from runs' metrics.jsonl, and its errors."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from furlong.core.cli.plot import _metrics_before_dashes, curves, ema, line_style, metric_patterns

C0 = (31, 119, 180)  # matplotlib's first line colour, #1f77b4: every panel with data has a C0 line
C1 = (255, 127, 14)  # the second, #ff7f0e: the second run's colour


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
                     "rollout/truncated": 0.0, "train/ppo_kl": 0.001 * (r + 1), "train/pg_clipfrac": 0.02,
                     "train/grad_norm": 0.8, "perf/rollout_time": 4.0,
                     "perf/train_time": 1.5, "perf/update_weights_time": 0.1, "perf/save_model_time": None,
                     "rollout/step": r})
        if r % 2 == 1 or r == 4:
            rows.append({"eval/test": 0.32 + 0.04 * r, "eval/test-truncated_ratio": 0.0, "perf/eval_time": 3.0,
                         "eval/step": r})
    return rows


def _write(folder, rows):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _panels_with(path, colour, rows=3, cols=3, top=0):
    """For each panel of the grid (row-major), whether its part of the image has pixels of ``colour``."""
    image = Image.open(path).convert("RGB")
    width, height = image.size
    pixels = image.load()
    out = []
    for row in range(rows):
        for col in range(cols):
            xs = range(col * width // cols, (col + 1) * width // cols)
            ys = range(top + row * (height - top) // rows, top + (row + 1) * (height - top) // rows)
            out.append(any(pixels[x, y] == colour for x in xs for y in ys))
    return out


def test_plot_writes_the_nine_default_panels(tmp_path, run_furlong):
    _write(tmp_path / "run", _rows())
    done = run_furlong("plot", "run")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "run/metrics.png\n"
    with Image.open(tmp_path / "run" / "metrics.png") as image:
        assert (image.format, image.size) == ("PNG", (1350, 972))  # 3 x 3 panels of 5 x 3.6 inches at 90 dpi
    # reward, eval, length, truncated; grad norm, clip fraction, trainer vs rollout (no data);
    # zero-spread groups (no data), time split
    assert _panels_with(tmp_path / "run" / "metrics.png", C0) == [True] * 6 + [False, False, True]


def test_plot_takes_a_metrics_file_and_an_out_path(tmp_path, run_furlong):
    _write(tmp_path / "run", _rows())
    done = run_furlong("plot", "run/metrics.jsonl", "--out", "figure.png")
    assert (done.returncode, done.stdout) == (0, "figure.png\n"), done.stderr
    assert Image.open(tmp_path / "figure.png").size == (1350, 972)


def _second_run():
    """Like _rows() but a better reward from rollout 2 on, a trainer-rollout gap and zero-spread
    groups; every other curve equals the first run's."""
    rows = _rows()
    for row in rows:
        if "rollout/step" in row:
            row["train/train_rollout_kl"] = 0.01 * row["rollout/step"]
            row["rollout/zero_std/share"] = 0.25
            if row["rollout/step"] >= 2:
                row["rollout/raw_reward"] += 0.1
    return rows


def test_plot_overlays_runs_and_draws_identical_curves_once(tmp_path, run_furlong):
    _write(tmp_path / "runs" / "a", _rows())
    _write(tmp_path / "runs" / "b", _second_run())
    done = run_furlong("plot", "runs/a", "runs/b")
    assert (done.returncode, done.stdout) == (0, "runs/compare.png\n"), done.stderr
    png = tmp_path / "runs" / "compare.png"
    # a figure legend of run colours sits above the grid (40 pixels); below it, run b's colour
    # shows only where its curve differs: reward, the gap and zero-spread panels (a has none there)
    assert _panels_with(png, C1, top=40) == [True, False, False, False, False, False, True, True, False]
    assert _panels_with(png, C0, top=40) == [True] * 6 + [False, False, True]


def test_curves_merges_identical_series():
    runs = {"a": _rows(), "b": _second_run()}
    merged = {tuple(members): (xs, ys) for members, xs, ys in curves(runs, ("rollout/raw_reward",))}
    assert set(merged) == {(("a", "rollout/raw_reward"),), (("b", "rollout/raw_reward"),)}
    clip = curves(runs, ("train/pg_clipfrac",))
    assert [members for members, _, _ in clip] == [[("a", "train/pg_clipfrac"), ("b", "train/pg_clipfrac")]]
    assert clip[0][1:] == ([0, 1, 2, 3, 4], [0.02] * 5)
    evals = curves({"a": _rows()}, ("eval/*",))  # mean rewards only, against eval/step
    assert [(m, xs) for m, xs, _ in evals] == [([("a", "eval/test")], [0, 1, 3, 4])]


def test_ema_is_tensorboards_debiased_smoothing():
    assert ema([1.0, 2.0, 3.0], 0.0) == [1.0, 2.0, 3.0]
    # s1 = 0.5, s2 = 0.25 + 1 = 1.25, s3 = 0.625 + 1.5 = 2.125; debiased by 1 - 0.5**t
    assert ema([1.0, 2.0, 3.0], 0.5) == pytest.approx([1.0, 1.25 / 0.75, 2.125 / 0.875])
    assert ema([4.0, float("nan"), 4.0], 0.9)[1] != ema([4.0, float("nan"), 4.0], 0.9)[1]  # NaN passes through
    assert ema([4.0, float("nan"), 4.0], 0.9)[2] == pytest.approx(4.0)


def test_plot_picks_metrics_and_smooths(tmp_path, run_furlong):
    _write(tmp_path / "run", _rows())
    for picks in (["--metrics", "train/grad_norm,perf/*_time"], ["--metrics", "train/grad_norm", "--metrics", "perf/*_time"],
                  ["--metrics", "train/grad_norm", "perf/*_time", "--"]):  # the last: the older form, ended by --
        (tmp_path / "picked.png").unlink(missing_ok=True)
        done = run_furlong("plot", "--smooth", "0.6", "--out", "picked.png", *picks, "run")
        assert (done.returncode, done.stdout) == (0, "picked.png\n"), done.stderr
        assert Image.open(tmp_path / "picked.png").size == (900, 324)  # two panels side by side
        assert _panels_with(tmp_path / "picked.png", C0, rows=1, cols=2) == [True, True]


def test_metrics_before_the_run_folders_takes_one_value(tmp_path, run_furlong):
    """``furlong plot --metrics KEY RUN1 RUN2``: the folders are runs, not more metrics."""
    _write(tmp_path / "runs" / "a", _rows())
    _write(tmp_path / "runs" / "b", _second_run())
    done = run_furlong("plot", "--metrics", "rollout/raw_reward", "runs/a", "runs/b")
    assert (done.returncode, done.stdout) == (0, "runs/compare.png\n"), done.stderr
    png = tmp_path / "runs" / "compare.png"
    assert Image.open(png).size == (450, 324)  # one panel
    assert _panels_with(png, C0, rows=1, cols=1, top=40) == [True]
    assert _panels_with(png, C1, rows=1, cols=1, top=40) == [True]


def test_metrics_values_are_split_on_commas_and_the_older_form_is_read_up_to_dashes():
    assert metric_patterns(None) is None and metric_patterns([" , "]) is None
    assert metric_patterns(["a,b", "c", " a "]) == ["a", "b", "c"]
    assert _metrics_before_dashes(["--metrics", "a", "b", "--", "r1", "r2"]) == \
        ["--metrics", "a", "--metrics", "b", "--", "r1", "r2"]
    assert _metrics_before_dashes(["r0", "--metrics", "a", "b", "--smooth", "0.5", "--", "r1"]) == \
        ["r0", "--metrics", "a", "--metrics", "b", "--smooth", "0.5", "--", "r1"]
    assert _metrics_before_dashes(["--metrics", "a", "r1", "r2"]) == ["--metrics", "a", "r1", "r2"]  # no --: runs


def test_no_two_curves_of_a_panel_share_colour_and_line_style():
    """Up to ten runs: a colour per run, a line style per key (solid first); beyond, the runs that share a
    colour differ by line style too. One run: a colour per key, then the next line style."""
    assert [line_style(r, 0, 4) for r in range(4)] == [("C0", "-"), ("C1", "-"), ("C2", "-"), ("C3", "-")]
    assert [line_style(0, k, 4) for k in range(5)] == [
        ("C0", "-"), ("C0", "--"), ("C0", ":"), ("C0", "-."), ("C0", (0, (6, 2, 1, 2, 1, 2)))]
    assert [line_style(r, 0, 12) for r in (0, 10, 11)] == [("C0", "-"), ("C0", "--"), ("C1", "--")]
    assert line_style(0, 1, 12) == ("C0", ":")  # key 1 of the first ten runs: style 1 x 2 cycles + 0
    assert [line_style(0, k, 1) for k in (0, 9, 10)] == [("C0", "-"), ("C9", "-"), ("C0", "--")]
    for runs, keys in ((1, 25), (5, 6), (12, 3), (25, 4)):
        styles = [line_style(r, k, runs) for r in range(runs) for k in range(keys)]
        assert len(set(map(str, styles))) == runs * keys


@pytest.mark.parametrize("argv, message", [
    (["--metrics", "rollout/raw_rewrd"],
     "error: furlong plot: --metrics 'rollout/raw_rewrd' matches no key of run (close keys: rollout/raw_reward"),
    (["--smooth", "1"], "error: furlong plot: --smooth 1.0 is outside [0, 1)"),
])
def test_plot_bad_options_are_one_error(tmp_path, run_furlong, argv, message):
    _write(tmp_path / "run", _rows())
    done = run_furlong("plot", "run", *argv)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.startswith(message) and done.stderr.count("\n") == 1
    assert not (tmp_path / "run" / "metrics.png").exists()


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


def test_a_rollout_logged_twice_is_drawn_once_with_its_last_values(tmp_path):
    """A run resumed before resumed runs set their later rows aside: rollouts 3 and 4 appear twice."""
    from furlong.core.cli.plot import load_metrics

    rows = _rows()
    again = [{**r, "rollout/raw_reward": 0.9} for r in rows if r.get("rollout/step") in (3, 4)]
    _write(tmp_path / "run", rows + again)
    loaded = load_metrics(str(tmp_path / "run"))
    [(members, steps, values)] = curves({"run": loaded}, ("rollout/raw_reward",))
    assert steps == [0, 1, 2, 3, 4]
    assert values == pytest.approx([0.3, 0.35, 0.4, 0.9, 0.9])
