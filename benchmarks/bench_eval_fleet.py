"""The dedicated eval fleet (``--eval-num-gpus``) against evaluation on the rollout engines, one workload.

One command, from the repository root (the demo model and data on CPU by default)::

    python benchmarks/bench_eval_fleet.py --json eval_fleet.json

On a GPU machine (the H200 run: one GPU trains, one serves rollouts, one evaluates)::

    python benchmarks/bench_eval_fleet.py --hf-checkpoint /models/Qwen2.5-0.5B-Instruct \\
        --prompt-data /data/dapo.jsonl --eval-data /data/aime.jsonl --num-rollout 8 --eval-interval 2 \\
        --json eval_fleet_h200.json -- --rollout-backend sglang --rollout-num-gpus 1 --rm-type dapo \\
        --rollout-batch-size 32 --n-samples-per-prompt 8 --rollout-max-response-len 1024 \\
        --eval-max-response-len 1024 --n-samples-per-eval-prompt 4

It runs ``furlong <command>`` (default ``train-async``) twice in processes of their own with the same flags:
evaluation on the rollout engines (inline), then on a fleet of ``--eval-gpus`` engines fed snapshots written
to ``--eval-hf-dir`` (a folder under /dev/shm when it exists). The JSON holds, per run, the wall time, the
mean ``perf/step_time`` and ``perf/train_wait_time``, every eval row (timings apart), and for the fleet
``eval/lag_steps``, ``eval/duration_seconds`` and ``eval/export_time_seconds``; and whether the two runs
logged the same eval metrics (the largest difference over the metrics both logged).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo"
TIMING = ("perf/eval_time", "eval/lag_steps", "eval/duration_seconds", "eval/export_time_seconds", "time")


def _rows(log_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def _run(args, log_dir: Path, extra: list[str]) -> dict:
    argv = [sys.executable, "-m", "furlong.core", args.command, "--hf-checkpoint", args.hf_checkpoint,
            "--prompt-data", args.prompt_data, "--input-key", "prompt", "--label-key", "label",
            "--num-rollout", str(args.num_rollout), "--seed", "1", "--eval-prompt-data", "bench", args.eval_data,
            "--eval-interval", str(args.eval_interval), "--log-dir", str(log_dir), *args.flags, *extra]
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode:
        sys.exit(f"furlong failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    rows = _rows(log_dir)
    rollouts = [r for r in rows if "rollout/step" in r]
    evals = sorted((r for r in rows if "eval/step" in r), key=lambda r: r["eval/step"])

    def mean(key):
        values = [r[key] for r in rollouts if key in r]
        return sum(values) / len(values) if values else None

    return {"wall_seconds": wall, "mean_step_time": mean("perf/step_time"),
            "mean_train_wait_time": mean("perf/train_wait_time"),
            "evals": [{k: v for k, v in r.items() if k not in TIMING} for r in evals],
            "eval_timings": [{k: r[k] for k in TIMING if k in r and k != "time"} | {"eval/step": r["eval/step"]}
                             for r in evals]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hf-checkpoint", default=str(DEMO / "model"))
    parser.add_argument("--prompt-data", default=str(DEMO / "data" / "train.jsonl"))
    parser.add_argument("--eval-data", default=str(DEMO / "data" / "test.jsonl"))
    parser.add_argument("--num-rollout", type=int, default=4)
    parser.add_argument("--eval-interval", type=int, default=2)
    parser.add_argument("--eval-gpus", type=int, default=1, help="--eval-num-gpus of the fleet run")
    parser.add_argument("--command", default="train-async", choices=["train", "train-async"])
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("flags", nargs="*", help="more furlong flags for both runs (after --)")
    args = parser.parse_args()
    if not args.flags and args.hf_checkpoint == str(DEMO / "model"):
        args.flags = ["--rm-type", "math", "--rollout-batch-size", "8", "--n-samples-per-prompt", "4",
                      "--rollout-max-response-len", "12", "--n-samples-per-eval-prompt", "2"]
    work = Path(tempfile.mkdtemp(prefix="bench_eval_fleet_"))
    shm = Path("/dev/shm")
    snapshots = Path(tempfile.mkdtemp(prefix="furlong_eval_hf_", dir=shm if shm.is_dir() else None))
    try:
        inline = _run(args, work / "inline", [])
        fleet = _run(args, work / "fleet", ["--eval-num-gpus", str(args.eval_gpus), "--eval-hf-dir", str(snapshots)])
    finally:
        shutil.rmtree(snapshots, ignore_errors=True)
    diffs = [abs(a[k] - b[k]) for a, b in zip(inline["evals"], fleet["evals"]) for k in a.keys() & b.keys()
             if isinstance(a[k], (int, float)) and isinstance(b[k], (int, float))]
    report = {"command": args.command, "hf_checkpoint": args.hf_checkpoint, "flags": args.flags,
              "inline": inline, "fleet": fleet,
              "same_eval_rows": [r["eval/step"] for r in inline["evals"]] == [r["eval/step"] for r in fleet["evals"]],
              "max_eval_metric_difference": max(diffs) if diffs else None}
    print(f"inline: {inline['wall_seconds']:.1f} s, step {inline['mean_step_time']}; fleet: "
          f"{fleet['wall_seconds']:.1f} s, step {fleet['mean_step_time']}; largest eval difference "
          f"{report['max_eval_metric_difference']}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
