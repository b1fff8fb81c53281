#!/usr/bin/env bash
# train-async without an off-policy correction, against sync and train-async --use-tis, on
# the demo (examples/demo/run_demo.sh's flags), several seeds. From the repository root:
#
#   bash benchmarks/offpolicy_demo.sh                 # 4 rollouts, seeds 1 2 3
#   NUM_ROLLOUT=8 SEEDS="1 2 3 4" bash benchmarks/offpolicy_demo.sh
#
# Each run writes runs/offpolicy/<mode>-s<seed>/metrics.jsonl; the table at the end lists
# the test-split reward before (rollout 0) and after (last rollout) per run and mode.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT_OUT="${ROOT_OUT:-runs/offpolicy}"
SEEDS="${SEEDS:-1 2 3}"
ARGS=(
  --hf-checkpoint examples/demo/model
  --prompt-data examples/demo/data/train.jsonl --input-key prompt --label-key label --rollout-shuffle
  --rm-type math
  --num-rollout "${NUM_ROLLOUT:-4}" --rollout-batch-size 32 --n-samples-per-prompt 8 --global-batch-size 256
  --rollout-max-response-len 12 --rollout-temperature 1.0
  --eval-prompt-data test examples/demo/data/test.jsonl --eval-interval 10 --n-samples-per-eval-prompt 4
  --advantage-estimator grpo --eps-clip 0.2 --eps-clip-high 0.28
  --lr "${LR:-1e-4}" --weight-decay 0.0 --micro-batch-size 64 --save-interval 1000
)
for seed in $SEEDS; do
  for mode in sync async async-tis; do
    out="$ROOT_OUT/$mode-s$seed"
    [ -f "$out/metrics.jsonl" ] && [ -n "${KEEP:-}" ] && continue
    rm -rf "$out"
    case $mode in
      sync) cmd=(furlong train) ;;
      async) cmd=(furlong train-async --no-use-tis) ;;
      async-tis) cmd=(furlong train-async --use-tis) ;;
    esac
    echo "== $mode seed $seed"
    "${cmd[@]}" "${ARGS[@]}" --seed "$seed" --save "$out" > "$ROOT_OUT/$mode-s$seed.log" 2>&1
  done
done

python - "$ROOT_OUT" <<'PY'
import json, pathlib, statistics, sys
root = pathlib.Path(sys.argv[1])
table = {}
for path in sorted(root.glob("*/metrics.jsonl")):
    mode, seed = path.parent.name.rsplit("-s", 1)
    evals = [r for r in map(json.loads, path.open()) if "eval/step" in r]
    table.setdefault(mode, []).append((int(seed), evals[0]["eval/test"], evals[-1]["eval/test"], evals[-1]["eval/step"]))
print("mode        seed  before  after  (rollout)")
for mode in ("sync", "async", "async-tis"):
    for seed, before, after, step in sorted(table.get(mode, [])):
        print(f"{mode:<11} {seed:>4}  {before:.3f}   {after:.3f}  ({step})")
    if table.get(mode):
        afters = [a for _, _, a, _ in table[mode]]
        gains = [a - b for _, b, a, _ in table[mode]]
        spread = statistics.stdev(afters) if len(afters) > 1 else 0.0
        print(f"{mode:<11} mean  after {statistics.mean(afters):.3f} (sd {spread:.3f}), gain {statistics.mean(gains):+.3f}")
PY
