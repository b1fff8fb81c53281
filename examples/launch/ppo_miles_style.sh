#!/bin/bash
# PPO with a critic on the CPU demo, written the way a Miles PPO launch script is: *_ARGS arrays
# handed to one command. The fsdp backend trains the actor and, beside it, the critic (the
# policy's decoder with a value head); GAE turns the critic's values and the rewards into
# advantages. Runs on a laptop: one CPU process, embedded engine. With --train-backend megatron
# (appended) megatron-core trains both, the critic being the policy's GPTModel with a value head.
#
#   bash examples/launch/ppo_miles_style.sh [EXTRA FLAGS...]
#
# The model and data it trains on (examples/demo/{model,data}) are in the repository.
# Checkpoints: the actor under $SAVE_DIR, the critic under ${SAVE_DIR}_critic; rerun the same
# command to resume both. Extra flags are appended, so they override the arrays.
set -euo pipefail

REPO="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/../.." &>/dev/null && pwd)"
cd "${REPO}"
SAVE_DIR="${SAVE_DIR:-${TMPDIR:-/tmp}/furlong-demo-ppo}"

# Architecture comes from the HF config: the fsdp backend needs no Megatron constants.
MODEL_ARGS=()

CKPT_ARGS=(
   --hf-checkpoint examples/demo/model     # tokenizer, config, initial weights (actor and critic)
   --save "${SAVE_DIR}"                    # actor iter_*; the critic's go to ${SAVE_DIR}_critic
   --load "${SAVE_DIR}"                    # rerun the same command to resume both
   --save-interval 10
)

ROLLOUT_ARGS=(
   --prompt-data examples/demo/data/train.jsonl
   --input-key prompt
   --label-key label
   --rollout-shuffle
   --rm-type math                          # grades the last \boxed{} against the label

   # the four knobs: 32 prompts x 8 samples = 256 samples = 1 step of 256
   --num-rollout 30
   --rollout-batch-size 32
   --n-samples-per-prompt 8
   --global-batch-size 256
   --num-steps-per-rollout 1

   --rollout-max-response-len 12
   --rollout-temperature 1.0
)

EVAL_ARGS=(
   --eval-interval 10
   --eval-prompt-data test examples/demo/data/test.jsonl
   --n-samples-per-eval-prompt 4
)

PERF_ARGS=(
   --micro-batch-size 64
)

PPO_ARGS=(
   --advantage-estimator ppo
   --gamma 1.0
   --lambd 1.0
   --kl-coef 0.0                           # > 0 folds the KL to the reference into the per-token rewards
   --eps-clip 0.2
   --eps-clip-high 0.28
   --value-clip 0.2
   --num-critic-only-steps 0               # rollouts that train only the critic before the actor joins
)

OPTIMIZER_ARGS=(
   --optimizer adam
   --lr 1e-4                               # the actor's
   --lr-decay-style constant
   --weight-decay 0.0
   --adam-beta1 0.9
   --adam-beta2 0.98
)

CRITIC_ARGS=(
   --critic-lr 1e-3                        # the critic's own schedule; the other optimizer flags are shared
   --critic-lr-warmup-iters 0
)

# No SGLang on a CPU: the embedded engine generates, the fsdp backend trains actor and critic.
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
   "${PPO_ARGS[@]}"
   "${OPTIMIZER_ARGS[@]}"
   "${CRITIC_ARGS[@]}"
   "${SGLANG_ARGS[@]}"
)

furlong train "${ARGS[@]}" "$@"
