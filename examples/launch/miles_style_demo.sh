#!/bin/bash
# The CPU demo written the way a Miles launch script is: eight *_ARGS arrays handed to
# one command. Runs on a laptop: fsdp trainer on one CPU process, embedded engine.
#
#   bash examples/launch/miles_style_demo.sh [EXTRA FLAGS...]
#
# The model and data it trains on (examples/demo/{model,data}) are in the repository
# (examples/demo/make_demo.py is how they were built; nothing to run first).
#
# Extra flags are appended, so they override the arrays (e.g. --num-rollout 2).
set -euo pipefail

REPO="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/../.." &>/dev/null && pwd)"
cd "${REPO}"
SAVE_DIR="${SAVE_DIR:-${TMPDIR:-/tmp}/furlong-demo-miles-style}"

# Architecture comes from the HF config: the fsdp backend needs no Megatron constants.
MODEL_ARGS=()

CKPT_ARGS=(
   --hf-checkpoint examples/demo/model     # tokenizer, config, initial weights
   --save "${SAVE_DIR}"                    # iter_* checkpoints land here
   --load "${SAVE_DIR}"                    # rerun the same command to resume
   --save-interval 10
)

ROLLOUT_ARGS=(
   --prompt-data examples/demo/data/train.jsonl
   --input-key prompt
   --label-key label
   --rollout-shuffle
   --rm-type math                          # grades the last \boxed{} against the label

   # the four knobs: 8 prompts x 4 samples = 32 samples = 1 step of 32
   --num-rollout 20
   --rollout-batch-size 8
   --n-samples-per-prompt 4
   --global-batch-size 32
   --num-steps-per-rollout 1

   --rollout-max-response-len 16
   --rollout-temperature 1.0
)

EVAL_ARGS=(
   --eval-interval 10
   --eval-prompt-data demo examples/demo/data/test.jsonl
   --n-samples-per-eval-prompt 1
   --eval-temperature 0                    # greedy
)

PERF_ARGS=(
   --micro-batch-size 8
)

GRPO_ARGS=(
   --advantage-estimator grpo
   --eps-clip 0.2
   --eps-clip-high 0.28
   --entropy-coef 0.0
)

OPTIMIZER_ARGS=(
   --optimizer adam
   --lr 1e-4                               # a tiny model needs a larger step than 1e-6
   --lr-decay-style constant
   --weight-decay 0.0
   --adam-beta1 0.9
   --adam-beta2 0.98
)

# No SGLang on a CPU: the embedded engine generates, the fsdp backend trains.
SGLANG_ARGS=(
   --rollout-backend embedded
   --train-backend fsdp
)

ARGS=(
   --actor-num-nodes 1
   --actor-num-gpus-per-node 1
   "${MODEL_ARGS[@]}"
   "${CKPT_ARGS[@]}"
   "${ROLLOUT_ARGS[@]}"
   "${EVAL_ARGS[@]}"
   "${PERF_ARGS[@]}"
   "${GRPO_ARGS[@]}"
   "${OPTIMIZER_ARGS[@]}"
   "${SGLANG_ARGS[@]}"
)

furlong train "${ARGS[@]}" "$@"
