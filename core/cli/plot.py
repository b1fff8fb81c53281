"""``furlong plot RUN_DIR [RUN_DIR ...]``: runs' ``metrics.jsonl`` drawn into one PNG with matplotlib.

By default the panels are the GRPO diagnostics (:data:`PANELS`); ``--metrics`` picks others,
``--smooth`` smooths. Several runs are overlaid, one colour per run (:func:`line_style`); curves that are point
for point identical (two runs that did not diverge, or two keys holding the same numbers)
are drawn once, their legend entry naming all of them.
"""

from __future__ import annotations

import argparse
import difflib
import fnmatch
import json
import math
import os

from furlong.hooks import PluginError

from ..run.metrics_log import one_row_per_step

__all__ = ["PANELS", "curves", "ema", "line_style", "load_metrics", "main", "metric_patterns", "plot_runs"]

EVAL_KEYS = "eval/*"
"""The pattern standing for every evaluation data set's mean reward (``eval/<name>``)."""

# (title, metric keys or patterns). Rollout-side keys are drawn against ``rollout/step``, eval
# keys against ``eval/step``.
PANELS = (
    ("reward", ("rollout/raw_reward",)),
    ("eval reward", (EVAL_KEYS,)),
    ("response length (tokens)", ("rollout/response_len/mean", "rollout/response_lengths")),
    ("truncated (share of samples)", ("rollout/truncated_ratio", "rollout/truncated")),
    ("grad norm", ("train/grad_norm",)),
    ("clip fraction", ("train/pg_clipfrac",)),
    ("trainer vs rollout log-probs", ("train/train_rollout_logprob_abs_diff", "train/train_rollout_kl")),
    ("zero-spread groups (share)", ("rollout/zero_std/share",)),
    ("time split (s)", ("perf/rollout_time", "perf/train_time", "perf/update_weights_time",
                        "perf/train_wait_time")),
)
_STYLES = ("-", "--", ":", "-.")
COLOURS = 10
"""matplotlib's default colour cycle, C0 to C9."""


def dash(index: int):
    """The ``index``-th line style: matplotlib's four named ones (solid, dashed, dotted, dash-dot), then a
    dash followed by ``index - 2`` dots, so every index has its own style."""
    if index < len(_STYLES):
        return _STYLES[index]
    return (0, (6, 2) + (1, 2) * (index - 2))


def line_style(run: int, key: int, runs: int) -> tuple[str, object]:
    """``(colour, line style)`` of the curve of key number ``key`` of run number ``run`` in a panel of a
    figure of ``runs`` runs; no two (run, key) pairs share both.

    One run: a colour per key (C0..C9), then the next line style for the next ten keys. Several: the run's
    colour (run modulo 10) and a line style per key; the runs that share a colour (run 0 and run 10 of
    eleven or more) differ by line style too: style ``key * cycles + run // 10``, with ``cycles`` =
    ceil(runs / 10). Up to ten runs that is the key's style (solid for the first).
    """
    if runs <= 1:
        return f"C{key % COLOURS}", dash(key // COLOURS)
    cycles = math.ceil(runs / COLOURS)
    return f"C{run % COLOURS}", dash(key * cycles + run // COLOURS)


def load_metrics(run_dir: str) -> list[dict]:
    """Rows of ``RUN_DIR/metrics.jsonl`` (or the file itself when given), one per step: a step logged
    twice (a run resumed before resumed runs set their later rows aside) is drawn once, with its last row.

    :raises PluginError: the file is missing or a line is not JSON (names file and line).
    """
    path = _metrics_path(run_dir)
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
    return one_row_per_step(rows)


def ema(values: list[float], weight: float) -> list[float]:
    """Exponential moving average with TensorBoard's start-up correction.

    ``s_t = weight * s_{t-1} + (1 - weight) * v_t`` from ``s_{-1} = 0``, divided by
    ``1 - weight**(t+1)`` so the first points are not pulled towards 0 (the smoothing of
    TensorBoard's scalar dashboard). ``weight`` 0 returns the values unchanged. Non-finite
    values are passed through and do not enter the average.

    :param values: the series, in step order.
    :param weight: in [0, 1); larger is smoother.
    """
    out, acc, n = [], 0.0, 0
    for v in values:
        if not math.isfinite(v):
            out.append(v)
            continue
        acc, n = weight * acc + (1 - weight) * v, n + 1
        out.append(acc / (1 - weight ** n) if weight else v)
    return out


def curves(runs: dict[str, list[dict]], patterns: tuple[str, ...]) -> list[tuple[list[tuple[str, str]], list, list]]:
    """The distinct curves of one panel: ``[([(run, key), ...], steps, values), ...]``.

    Each pattern (a metric key or an ``fnmatch`` pattern such as ``eval/*``) is matched
    against each run's keys; ``eval/*`` means the ``eval/<name>`` mean rewards only. A key
    is drawn against ``eval/step`` when it starts with ``eval/``, else against
    ``rollout/step``. Curves with the same points are merged into one that lists every
    ``(run, key)`` that produced it, in run order.
    """
    distinct: dict[tuple, list[tuple[str, str]]] = {}
    for run, rows in runs.items():
        for key in _matching_keys(rows, patterns):
            step_key = "eval/step" if key.startswith("eval/") else "rollout/step"
            points = tuple((r[step_key], r[key]) for r in rows
                           if step_key in r and isinstance(r.get(key), (int, float)) and not isinstance(r[key], bool))
            if points:
                distinct.setdefault(points, []).append((run, key))
    return [(members, [p[0] for p in points], [p[1] for p in points]) for points, members in distinct.items()]


def plot_runs(run_dirs: list[str], out: str | None = None, metrics: list[str] | None = None,
              smooth: float = 0.0) -> str:
    """Draw the runs' metrics into one PNG and return its path.

    A grid of panels, three per row, 5 x 3.6 inches each at 90 dpi (the default nine panels:
    1350 x 972 pixels). Each run gets one colour; within a panel the keys differ by line
    style, and so do runs that share a colour (more than ten: :func:`line_style`). A panel without data says "no data". With ``smooth`` > 0 each curve is drawn
    faint as measured and solid smoothed (:func:`ema`), except the evaluation curves (few
    points, each already the mean over a data set).

    :param run_dirs: run folders (``--save`` or ``--log-dir``) or ``metrics.jsonl`` files.
    :param out: the PNG path; default ``RUN_DIR/metrics.png`` for one run, and
        ``compare.png`` in the runs' common parent folder for several.
    :param metrics: one panel per key or ``fnmatch`` pattern (default :data:`PANELS`).
    :param smooth: EMA weight in [0, 1).
    :raises PluginError: a metrics file is missing or holds a line that is not JSON; a
        ``--metrics`` entry matches no key of any run (the message lists close keys);
        ``smooth`` is outside [0, 1).
    """
    if not 0.0 <= smooth < 1.0:
        raise PluginError(f"furlong plot: --smooth {smooth} is outside [0, 1) (0 draws the raw values; 0.6 is "
                          "TensorBoard's default).")
    runs = _load_runs(run_dirs)  # before matplotlib loads: a wrong path fails at once
    panels = PANELS if not metrics else tuple((m, (m,)) for m in metrics)
    if metrics:
        _check_patterns(runs, metrics)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    out = out or _default_out(run_dirs)
    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5 * ncols, 3.6 * nrows), squeeze=False)
    for ax, (title, patterns) in zip(axes.flat, panels):
        # evaluations come every few rollouts and each already averages a whole data set
        _draw_panel(ax, curves(runs, patterns), list(runs), 0.0 if patterns == (EVAL_KEYS,) else smooth)
        ax.set_title(title, fontsize=11)
        ax.set_xlabel("rollout")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rollout ids are whole numbers
        ax.ticklabel_format(axis="y", useOffset=False)  # 4.5987 rather than "1e-5 + 4.598" offsets
        if not ax.lines:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    top = 1.0
    if len(runs) > 1:  # one colour per run, named once for the whole figure
        handles = [plt.Line2D([], [], color=colour, linestyle=style, linewidth=2.5)  # as the run's first key
                   for colour, style in (line_style(i, 0, len(runs)) for i in range(len(runs)))]
        fig.legend(handles, list(runs), loc="upper center", ncol=min(len(runs), 6), fontsize=9, frameon=False,
                   title=f"smoothed: EMA {smooth}" if smooth else None, title_fontsize=9)
        top = 1 - (0.75 if smooth else 0.45) / fig.get_figheight()
    else:
        fig.suptitle(os.path.abspath(run_dirs[0]) + (f"   (smoothed: EMA {smooth})" if smooth else ""), fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, top))
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="furlong plot", allow_abbrev=False,
        description="Draw runs' metrics.jsonl into one PNG: by default the GRPO diagnostics (reward, eval, "
                    "response length, truncation, grad norm, clip fraction, trainer vs rollout log-probs, "
                    "zero-spread groups, time split); several runs are overlaid.")
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                        help="a run's --save or --log-dir folder, or a metrics.jsonl file; several are overlaid")
    parser.add_argument("--out", help="PNG path (default RUN_DIR/metrics.png; several runs: compare.png in "
                                      "their common parent folder)")
    parser.add_argument("--metrics", action="append", metavar="KEY[,KEY...]",
                        help="one panel per metric key or pattern instead of the default panels; comma-separated, "
                             "and the flag may be repeated (e.g. --metrics train/grad_norm,'eval/*' --metrics "
                             "'perf/*_time'); the older form, several keys up to '--', works too "
                             "(--metrics KEY KEY -- RUN_DIR)")
    parser.add_argument("--smooth", type=float, default=0.0, metavar="W",
                        help="exponential moving average weight in [0, 1) (TensorBoard's smoothing); the raw "
                             "curve stays, faint (default 0: no smoothing)")
    opts = parser.parse_args(_metrics_before_dashes(argv))
    print(plot_runs(opts.run_dirs, opts.out, metric_patterns(opts.metrics), opts.smooth))
    return 0


def metric_patterns(values: list[str] | None) -> list[str] | None:
    """The keys or patterns of the ``--metrics`` values (each comma-separated), in order, each once; None when none."""
    patterns = [p.strip() for value in values or [] for p in value.split(",") if p.strip()]
    return list(dict.fromkeys(patterns)) or None


def _metrics_before_dashes(argv: list[str]) -> list[str]:
    """``--metrics A B -- RUN_DIR`` (``--metrics`` took several values before it took one): with a ``--``,
    every value between a ``--metrics`` and the next flag or the ``--`` is a metric (``--metrics A
    --metrics B``). Without ``--`` the values after the first are run folders."""
    if "--" not in argv:
        return argv
    end = argv.index("--")
    out: list[str] = []
    taking = False
    for token in argv[:end]:
        if token == "--metrics":
            taking = True
            out.append(token)
        elif token.startswith("-"):
            taking = False
            out.append(token)
        elif taking and out[-1] != "--metrics":
            out += ["--metrics", token]
        else:
            out.append(token)
    return out + argv[end:]


def _draw_panel(ax, panel_curves: list, runs: list[str], smooth: float) -> None:
    """One panel's curves, styled by :func:`line_style`. One run: a colour per key. Several: the run's
    colour, a line style per key (named in the panel's legend when there are several keys; when more
    than ten runs make colours repeat, each curve is named), and a curve shared by several runs is drawn
    once, its legend entry naming them."""
    several_runs = len(runs) > 1
    colours_repeat = len(runs) > COLOURS
    keys: list[str] = []
    for members, _, _ in panel_curves:
        if members[0][1] not in keys:
            keys.append(members[0][1])
    shorten = _shortener(keys)
    legend: dict[str, object] = {}
    for members, xs, ys in panel_curves:
        run, key = members[0]
        colour, linestyle = line_style(runs.index(run), keys.index(key), len(runs))
        style = dict(color=colour, linestyle=linestyle)
        if smooth:
            ax.plot(xs, ys, alpha=0.25, linewidth=1, **style)
            line, = ax.plot(xs, ema(ys, smooth), linewidth=1.6, **style)
        else:
            line, = ax.plot(xs, ys, marker="o", markersize=3, **style)
        same_key = [k for _, k in members[1:] if k != key]
        name = " = ".join([shorten(key)] + [shorten(k) for k in dict.fromkeys(same_key)])
        shared_by = list(dict.fromkeys(r for r, _ in members))
        if several_runs and len(shared_by) > 1:
            legend[f"{' = '.join(shared_by)}" + (f" ({name})" if len(keys) > 1 else "")] = line
        elif colours_repeat and len(keys) > 1:  # a key's line style differs between runs of one colour
            legend[f"{run} ({name})"] = line
        elif not several_runs or len(keys) > 1:
            legend.setdefault(name, line if not several_runs else
                              ax.plot([], [], color="0.35", linestyle=style["linestyle"])[0])
    if legend:
        ax.legend(list(legend.values()), list(legend), fontsize=7)


def _shortener(keys: list[str]):
    """Legend names: keys without the first segment they all share (``rollout/``, ``perf/``)."""
    heads = {k.split("/", 1)[0] for k in keys}
    if len(heads) == 1 and all("/" in k for k in keys):
        return lambda k: k.split("/", 1)[1] if "/" in k else k
    return lambda k: k


def _metrics_path(run_dir: str) -> str:
    return run_dir if run_dir.endswith(".jsonl") else os.path.join(run_dir, "metrics.jsonl")


def _load_runs(run_dirs: list[str]) -> dict[str, list[dict]]:
    folders = [os.path.dirname(_metrics_path(d)) or "." for d in run_dirs]
    names = [os.path.basename(os.path.abspath(f)) for f in folders]
    if len(set(names)) < len(names):  # two runs called "demo" in different places
        names = [os.path.relpath(f) for f in folders]
    return {name: load_metrics(d) for name, d in zip(names, run_dirs)}


def _default_out(run_dirs: list[str]) -> str:
    folders = [os.path.dirname(_metrics_path(d)) or "." for d in run_dirs]
    if len(folders) == 1:
        return os.path.join(folders[0], "metrics.png")
    return os.path.join(os.path.relpath(os.path.commonpath([os.path.abspath(f) for f in folders])), "compare.png")


def _matching_keys(rows: list[dict], patterns: tuple[str, ...]) -> list[str]:
    keys = sorted({k for r in rows for k in r})
    found: list[str] = []
    for pattern in patterns:
        if pattern == EVAL_KEYS:  # mean rewards only, not eval/<name>-truncated_ratio or eval/<name>/...
            matched = [k for k in keys if k.count("/") == 1 and "-" not in k and k.startswith("eval/")
                       and k != "eval/step"]
        else:
            matched = [k for k in keys if fnmatch.fnmatchcase(k, pattern)]
        found += [k for k in matched if k not in found]
    return found


def _check_patterns(runs: dict[str, list[dict]], patterns: list[str]) -> None:
    keys = sorted({k for rows in runs.values() for r in rows for k in r})
    for pattern in patterns:
        if not any(_matching_keys(rows, (pattern,)) for rows in runs.values()):
            close = difflib.get_close_matches(pattern, keys, n=5, cutoff=0.5)
            hint = f"close keys: {', '.join(close)}" if close else f"the runs have {len(keys)} keys, e.g. " + \
                ", ".join([k for k in keys if "/" in k][:8])
            raise PluginError(f"furlong plot: --metrics {pattern!r} matches no key of {', '.join(runs)} ({hint}).")

