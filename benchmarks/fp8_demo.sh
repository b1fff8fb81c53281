#!/usr/bin/env bash
# The demo's GRPO run (examples/demo/run_demo.sh) with an FP8 rollout engine against the BF16 one, both with
# --use-tis: the demo model quantised by `furlong quantize-fp8` as --hf-checkpoint, the BF16 model as --ref-load.
# Writes runs/fp8-demo/{bf16,fp8}/metrics.jsonl and runs/fp8-demo/rewards.png (furlong plot).
#   bash benchmarks/fp8_demo.sh               # NUM_ROLLOUT (30), OUT (runs/fp8-demo); extra flags go to both runs
# On a CPU the FP8 engine runs the dequantised weights (the weights' FP8 rounding, activations unquantised); on a
# Hopper GPU it runs FP8 products with 1 x 128 activation scales (docs/fp8.md).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-runs/fp8-demo}"
rm -rf "$OUT" && mkdir -p "$OUT"
furlong quantize-fp8 examples/demo/model "$OUT/model-fp8"
OUT="$OUT/bf16" bash examples/demo/run_demo.sh --use-tis "$@"
OUT="$OUT/fp8" bash examples/demo/run_demo.sh --use-tis --hf-checkpoint "$OUT/model-fp8" \
  --ref-load examples/demo/model "$@"
furlong plot "$OUT/bf16" "$OUT/fp8" --out "$OUT/rewards.png"
