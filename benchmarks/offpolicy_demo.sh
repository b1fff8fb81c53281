#!/usr/bin/env bash
# train-async without an off-policy correction, against sync and train-async --use-tis, on
# the demo (examples/demo/run_demo.sh with 4 rollouts), several seeds. From the repository root:
#
#   bash benchmarks/offpolicy_demo.sh                 # seeds 1 2 3
#   NUM_ROLLOUT=8 SEEDS="1 2 3 4 5" bash benchmarks/offpolicy_demo.sh
#
# Each run writes runs/offpolicy/<mode>-s<seed>/metrics.jsonl (its log beside it); the table
# at the end lists the test-split reward before (rollout 0) and after (last rollout).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT_OUT="${ROOT_OUT:-runs/offpolicy}"
mkdir -p "$ROOT_OUT"
export NUM_ROLLOUT="${NUM_ROLLOUT:-4}"
for seed in ${SEEDS:-1 2 3}; do
  for mode in sync async async-tis; do
    case $mode in
      sync) command=train; flags=() ;;
      async) command=train-async; flags=(--no-use-tis) ;;
      async-tis) command=train-async; flags=(--use-tis) ;;
    esac
    echo "== $mode seed $seed"
    OUT="$ROOT_OUT/$mode-s$seed" COMMAND=$command bash examples/demo/run_demo.sh --seed "$seed" "${flags[@]}" \
      > "$ROOT_OUT/$mode-s$seed.log" 2>&1
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
