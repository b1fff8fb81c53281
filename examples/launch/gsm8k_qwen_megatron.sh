#!/bin/bash
# GRPO on GSM8K with Qwen2.5-1.5B-Instruct on one node of 8 GPUs: Megatron trains on 4
# (TP 2 x DP 2), four 1-GPU SGLang engines generate on the other 4.
#
#   bash examples/launch/gsm8k_qwen_megatron.sh [EXTRA FLAGS...]
#
# Needs furlong[megatron,ray] and SGLang in the same environment. Paths can be set with
# MODEL_DIR, DATA_DIR and RUN_DIR.
set -euo pipefail

REPO="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/../.." &>/dev/null && pwd)"
cd "${REPO}"
MODEL_DIR="${MODEL_DIR:-/root/Qwen2.5-1.5B-Instruct}"
DATA_DIR="${DATA_DIR:-examples/gsm8k/data}"
RUN_DIR="${RUN_DIR:-/root/furlong-runs/qwen2.5-1.5b-gsm8k}"

# Qwen2.5-1.5B; the megatron backend checks these against ${MODEL_DIR}/config.json.
MODEL_ARGS=(
   --num-layers 28
   --hidden-size 1536
   --ffn-hidden-size 8960
   --num-attention-heads 12
   --group-query-attention
   --num-query-groups 2
   --kv-channels 128
   --position-embedding-type rope
   --rotary-base 1000000
   --normalization RMSNorm
   --norm-epsilon 1e-6
   --swiglu
   --disable-bias-linear
   --add-qkv-bias
   --vocab-size 151936
)

CKPT_ARGS=(
   --hf-checkpoint "${MODEL_DIR}"          # tokenizer, config, SGLang boot weights
   --ref-load "${MODEL_DIR}"               # frozen reference (an HF dir works too)
   --load "${RUN_DIR}"                     # resume point; empty -> warm start from --ref-load
   --save "${RUN_DIR}"
   --save-interval 50
)

ROLLOUT_ARGS=(
   --prompt-data "${DATA_DIR}/train.jsonl"
   --input-key prompt
   --label-key label
   --apply-chat-template                   # never implied: Qwen-Instruct wants its template
   --rollout-shuffle
   --rm-type math

   # 32 prompts x 8 samples = 256 samples per rollout = 1 optimizer step of 256
   --num-rollout 200
   --rollout-batch-size 32
   --n-samples-per-prompt 8
   --global-batch-size 256
   --num-steps-per-rollout 1

   --rollout-max-response-len 1024
   --rollout-temperature 1.0
   --balance-data
)

EVAL_ARGS=(
   --eval-interval 20
   --eval-prompt-data gsm8k "${DATA_DIR}/test.jsonl"
   --n-samples-per-eval-prompt 1
   --eval-temperature 0
   --eval-max-response-len 1024
)

PERF_ARGS=(
   # TP 2 without --sequence-parallel: the megatron backend builds megatron-core's local
   # spec (no TransformerEngine), whose norms have no sequence parallelism
   --tensor-model-parallel-size 2
   --pipeline-model-parallel-size 1
   --context-parallel-size 1
   --expert-model-parallel-size 1
   --expert-tensor-parallel-size 1

   --recompute-granularity full
   --recompute-method uniform
   --recompute-num-layers 1

   --use-dynamic-batch-size
   --max-tokens-per-gpu 4096               # >= prompt + --rollout-max-response-len
)

GRPO_ARGS=(
   --advantage-estimator grpo
   --use-kl-loss
   --kl-loss-coef 0.00                     # KL logged, not optimized
   --kl-loss-type low_var_kl
   --entropy-coef 0.00
   --eps-clip 0.2
   --eps-clip-high 0.28
)

OPTIMIZER_ARGS=(
   --optimizer adam
   --lr 1e-6
   --lr-decay-style constant
   --weight-decay 0.1
   --adam-beta1 0.9
   --adam-beta2 0.98
)

SGLANG_ARGS=(
   --rollout-backend sglang
   --rollout-num-gpus-per-engine 1
   --sglang-mem-fraction-static 0.8
)

MISC_ARGS=(
   --train-backend megatron
   --attention-dropout 0.0
   --hidden-dropout 0.0
   --accumulate-allreduce-grads-in-fp32
   --attention-softmax-in-fp32
   --attention-backend flash
)

ARGS=(
   --actor-num-nodes 1
   --actor-num-gpus-per-node 4
   --rollout-num-gpus 4
   "${MODEL_ARGS[@]}"
   "${CKPT_ARGS[@]}"
   "${ROLLOUT_ARGS[@]}"
   "${EVAL_ARGS[@]}"
   "${PERF_ARGS[@]}"
   "${GRPO_ARGS[@]}"
   "${OPTIMIZER_ARGS[@]}"
   "${SGLANG_ARGS[@]}"
   "${MISC_ARGS[@]}"
)

furlong train "${ARGS[@]}" "$@"
