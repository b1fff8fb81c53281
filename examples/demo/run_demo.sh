#!/usr/bin/env bash
# GRPO on the demo model and task, on CPU: evaluate, train, evaluate again, print both.
#
#   bash examples/demo/run_demo.sh            # from the repository root, venv active
#   OUT=runs/mine NUM_ROLLOUT=40 bash examples/demo/run_demo.sh
#   COMMAND=train-async bash examples/demo/run_demo.sh --seed 2   # extra flags go to furlong, after (and over) these
#
# $OUT (default runs/demo) starts empty; the run before it is moved to $OUT.previous, so one mistyped flag
# loses no results (only one earlier run is kept: the next run replaces $OUT.previous). Each rollout prints one summary line; the run's metrics land in $OUT/metrics.jsonl and
# `furlong plot $OUT` draws them. A `--save DIR` among the extra flags takes the place of $OUT and is
# kept as it is, so a later run with `--save DIR --load DIR` resumes from it; a `--load DIR` alone
# resumes in DIR and keeps saving there (the demo saves every 1000 rollouts: add --save-interval 1 to a
# run you may want to resume).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-runs/demo}"
SAVE=""
LOAD=""
CHECK_ONLY=""
prev=""
for arg in "$@"; do
  case "$arg" in --save=*) SAVE="${arg#--save=}" ;; --load=*) LOAD="${arg#--load=}" ;;
    --print-config|--help|-h) CHECK_ONLY=1 ;; esac
  if [ "$prev" = "--save" ]; then SAVE="$arg"; fi
  if [ "$prev" = "--load" ]; then LOAD="$arg"; fi
  prev="$arg"
done
if [ -n "$CHECK_ONLY" ]; then
  :  # --print-config / --help train nothing: $OUT stays as it is
elif [ -n "$SAVE" ]; then
  OUT="$SAVE"
elif [ -n "$LOAD" ]; then
  OUT="$LOAD"  # resuming: the run goes on in the folder it resumes from (kept as it is)
else
  if [ -e "$OUT" ]; then
    # a run still writing $OUT keeps it (the lock furlong takes on its --save folder)
    python - "$OUT" <<'PY' || exit 2
import sys
from furlong.core.run.lock import RunLock
problem = RunLock(sys.argv[1]).busy()
sys.exit(f"error: {problem}" if problem else 0)
PY
    rm -rf "$OUT.previous" && mv "$OUT" "$OUT.previous"
  fi
  # a ppo run's critic lives beside it (--save + _critic) and goes with it, also one whose $OUT was deleted
  # (a leftover critic would make the next ppo run refuse to start)
  if [ -e "${OUT}_critic" ]; then rm -rf "${OUT}_critic.previous" && mv "${OUT}_critic" "${OUT}_critic.previous"; fi
fi

ARGS=(
  # model and data
  --hf-checkpoint examples/demo/model
  --prompt-data examples/demo/data/train.jsonl --input-key prompt --label-key label --rollout-shuffle
  --rm-type math
  # four knobs: 32 prompts x 8 samples = 256 samples = 1 optimizer step of 256
  --num-rollout "${NUM_ROLLOUT:-30}" --rollout-batch-size 32 --n-samples-per-prompt 8 --global-batch-size 256
  --rollout-max-response-len 12 --rollout-temperature 1.0
  # eval on the test split before training, every 10 rollouts and at the end
  --eval-prompt-data test examples/demo/data/test.jsonl --eval-interval 10 --n-samples-per-eval-prompt 4
  # algorithm and optimizer
  --advantage-estimator grpo --eps-clip 0.2 --eps-clip-high 0.28
  # this 0.5M-parameter model learns at lr 5e-5..2e-4; 1e-3 drives the reward to 0
  --lr "${LR:-1e-4}" --weight-decay 0.0 --micro-batch-size 64
  --save "$OUT" --save-interval 1000
)
# The run goes in the background so that a SIGTERM sent to this script reaches it too (bash runs a trap only
# once its foreground command has ended); Ctrl-C at a terminal reaches both already, and the script waits
# for the run's clean-up either way.
furlong "${COMMAND:-train}" "${ARGS[@]}" "$@" &
run=$!
trap 'kill -TERM "$run" 2>/dev/null' TERM
trap : INT
status=0
until wait "$run"; do
  status=$?
  kill -0 "$run" 2>/dev/null || break
done
trap - TERM INT
if [ "$status" -ne 0 ]; then exit "$status"; fi
if [ -n "$CHECK_ONLY" ]; then exit 0; fi

python - "$OUT/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
evals = [r for r in rows if "eval/step" in r]
if not evals:
    print("\nno test-split evaluation in this run (it evaluates with a rollout engine and --eval-interval)")
elif len(evals) == 1:
    print(f"\ntest-split reward (4 samples per prompt, temperature 1.0): "
          f"{evals[0]['eval/test']:.4f} (rollout {evals[0]['eval/step']})")
else:
    first, last = evals[0]["eval/step"], evals[-1]["eval/step"]
    where = ("before rollout", "after rollout") if first == last else ("rollout", "rollout")  # a one-rollout run
    print(f"\ntest-split reward (4 samples per prompt, temperature 1.0): "
          f"before {evals[0]['eval/test']:.4f} ({where[0]} {first}), "
          f"after {evals[-1]['eval/test']:.4f} ({where[1]} {last})")
PY
furlong plot "$OUT"
