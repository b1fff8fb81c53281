"""``furlong plot RUN_DIR``: a run's ``metrics.jsonl`` drawn into one PNG with matplotlib."""

from __future__ import annotations

import argparse
import json
import os

from furlong.hooks import PluginError

__all__ = ["PANELS", "load_metrics", "main", "plot_run"]

# (title, metric keys drawn against rollout/step). Eval keys are found by prefix.
PANELS = (
    ("reward", ("rollout/raw_reward",)),
    ("eval reward", ()),
    ("KL", ("train/kl_loss", "train/ppo_kl")),
    ("entropy", ("rollout/entropy", "train/entropy_loss")),
    ("response length (tokens)", ("rollout/response_lengths",)),
    ("time split (s)", ("perf/rollout_time", "perf/train_time", "perf/update_weights_time")),
)


def load_metrics(run_dir: str) -> list[dict]:
    """Rows of ``RUN_DIR/metrics.jsonl`` (or the file itself when given).

    :raises PluginError: the file is missing or a line is not JSON (names file and line).
    """
    path = run_dir if run_dir.endswith(".jsonl") else os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise PluginError(f"furlong plot: no metrics file at {path} (runs write it with --save or --log-dir).")
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise PluginError(f"{path}:{lineno}: not valid JSON ({exc.msg}).") from None
    return rows


def _series(rows: list[dict], step_key: str, key: str) -> tuple[list, list]:
    points = [(r[step_key], r[key]) for r in rows if step_key in r and r.get(key) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def plot_run(run_dir: str, out: str | None = None) -> str:
    """Draw reward, eval reward, KL, entropy, response length and the time split; return the PNG path.

    One 2 x 3 grid of panels, 1350 x 720 pixels (15 x 8 inches at 90 dpi), written to ``out``
    (default ``RUN_DIR/metrics.png``, or beside the given ``metrics.jsonl``). Rollout-side
    panels use the ``rollout/step`` rows, the eval panel every ``eval/<name>`` key of the
    ``eval/step`` rows; a panel without data says "no data".

    :raises PluginError: the metrics file is missing or holds a line that is not JSON.
    """
    rows = load_metrics(run_dir)  # before matplotlib loads: a wrong path fails at once
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    out = out or os.path.join(run_dir if os.path.isdir(run_dir) else os.path.dirname(run_dir), "metrics.png")
    rollout_rows = [r for r in rows if "rollout/step" in r]
    eval_rows = [r for r in rows if "eval/step" in r]
    eval_keys = sorted({k for r in eval_rows for k in r if k.startswith("eval/") and k.count("/") == 1
                        and "-" not in k and k != "eval/step"})
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (title, keys) in zip(axes.flat, PANELS):
        source, step_key = (eval_rows, "eval/step") if title == "eval reward" else (rollout_rows, "rollout/step")
        for key in keys or eval_keys:
            xs, ys = _series(source, step_key, key)
            if xs:
                ax.plot(xs, ys, marker="o", markersize=3, label=key)
        ax.set_title(title)
        ax.set_xlabel("rollout")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rollout ids are whole numbers
        ax.ticklabel_format(axis="y", useOffset=False)  # 4.5987 rather than "1e-5 + 4.598" offsets
        if ax.lines:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(os.path.abspath(run_dir), fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="furlong plot", allow_abbrev=False,
                                     description="Draw a run's metrics.jsonl into one PNG.")
    parser.add_argument("run_dir", help="the run's --save or --log-dir folder, or a metrics.jsonl file")
    parser.add_argument("--out", help="PNG path (default RUN_DIR/metrics.png)")
    opts = parser.parse_args(argv)
    print(plot_run(opts.run_dir, opts.out))
    return 0
