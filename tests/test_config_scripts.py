"""Miles launch scripts parse: the walkthrough seed's arrays verbatim, and the scripts in
examples/launch (run by bash with ``furlong`` replaced by a function printing its argv)."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
from pathlib import Path

import pytest

from furlong.core.config import ConfigError, parse_args
from furlong.core.config.configure import configure_plugins
from furlong.core.plugins.manager import get_plugin_manager
from furlong.core.plugins.selection import resolve_selection

REPO = Path(__file__).resolve().parent.parent

# The arrays of seeds/training-script-walkthrough.md, verbatim; MODEL_ARGS is what the
# sourced models/glm4-9B.sh provides (GLM-4-9B's architecture) plus the page's override.
WALKTHROUGH = r"""
MODEL_ARGS=(
   --num-layers 40
   --hidden-size 4096
   --ffn-hidden-size 13696
   --num-attention-heads 32
   --group-query-attention
   --num-query-groups 2
   --kv-channels 128
   --normalization RMSNorm
   --norm-epsilon 1e-5
   --swiglu
   --disable-bias-linear
   --add-qkv-bias
   --untie-embeddings-and-output-weights
   --vocab-size 151552
   --use-rotary-position-embeddings
)
MODEL_ARGS+=(--rotary-base 10000)

CKPT_ARGS=(
   --hf-checkpoint /root/GLM-Z1-9B-0414          # tokenizer, config, SGLang init
   --ref-load      /root/GLM-Z1-9B-0414_torch_dist   # frozen ref (KL anchor)
   --load          /root/GLM-Z1-9B-0414_miles/   # actor resume point
   --save          /root/GLM-Z1-9B-0414_miles/   # where checkpoints are written
   --save-interval 20                            # rollouts between writes
)

ROLLOUT_ARGS=(
   --prompt-data /root/dapo-math-17k/dapo-math-17k.jsonl
   --input-key prompt
   --label-key label
   --apply-chat-template
   --rollout-shuffle

   --rm-type deepscaler

   # the four-knob relationship
   --num-rollout 3000
   --rollout-batch-size 16
   --n-samples-per-prompt 8
   --num-steps-per-rollout 1
   --global-batch-size 128

   --rollout-max-response-len 8192
   --rollout-temperature 1

   --balance-data                  # equalize tokens across DP ranks
)

EVAL_ARGS=(
   --eval-interval 5                                # rollouts between eval runs
   --eval-prompt-data aime /root/aime-2024/aime-2024.jsonl
   --n-samples-per-eval-prompt 16                   # eval group size
   --eval-max-response-len 16384                    # longer than train rollout
   --eval-top-p 1                                   # disable nucleus
)

PERF_ARGS=(
   --tensor-model-parallel-size 2
   --sequence-parallel
   --pipeline-model-parallel-size 1
   --context-parallel-size 2
   --expert-model-parallel-size 1
   --expert-tensor-parallel-size 1

   --recompute-granularity full
   --recompute-method uniform
   --recompute-num-layers 1

   --use-dynamic-batch-size
   --max-tokens-per-gpu 4608
)

GRPO_ARGS=(
   --advantage-estimator grpo
   --use-kl-loss
   --kl-loss-coef 0.00
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
   --rollout-num-gpus-per-engine 2
)

ROLLOUT_ARGS+=(
   --over-sampling-batch-size 64
   --dynamic-sampling-filter-path \
     miles.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std
)

printf '%s\n' --actor-num-nodes 1 --actor-num-gpus-per-node 4 --rollout-num-gpus 4 \
   "${MODEL_ARGS[@]}" "${CKPT_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${OPTIMIZER_ARGS[@]}" "${GRPO_ARGS[@]}" \
   "${PERF_ARGS[@]}" "${EVAL_ARGS[@]}" "${SGLANG_ARGS[@]}" \
   --sglang-mem-fraction-static 0.7 --sglang-enable-dp-attention --sglang-log-level INFO \
   --train-backend megatron --rollout-backend sglang
"""


pytestmark = pytest.mark.usefixtures("cpu_machine")  # the same defaults on every machine


def configured(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """``argv`` parsed and configured by every chosen plugin (the train backend reports the
    data-parallel rule there), and the problems the plugins found: what this machine lacks
    and the cluster has (SGLang, the checkpoints, GPUs); the derived values stand regardless."""
    pm = get_plugin_manager()
    args = parse_args(argv, pm, command="train")
    try:
        configure_plugins(args, pm, resolve_selection(args, pm))
    except ConfigError as exc:
        return args, exc.problems
    return args, []


def bash_argv(script: str) -> list[str]:
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True, timeout=60)
    return out.stdout.splitlines()


def test_walkthrough_script_parses(caplog):
    with caplog.at_level(logging.WARNING, logger="furlong.config"):
        args, _lacking_here = configured(bash_argv(WALKTHROUGH))
    # 16 prompts x 8 samples = 128 x 1 step; D = 4 GPUs / (TP 2 x PP 1 x CP 2) = 1
    assert (args.global_batch_size, args.num_steps_per_rollout, args.data_parallel_size) == (128, 1, 1)
    assert (args.rotary_base, args.num_layers, args.kl_loss_type, args.eps_clip_high) == (10000, 40, "low_var_kl", 0.28)
    assert args.eval_prompt_data == ["aime", "/root/aime-2024/aime-2024.jsonl"]
    assert (args.eval_top_p, args.eval_temperature, args.eval_max_response_len) == (1.0, 1.0, 16384)
    assert (args.over_sampling_batch_size, args.save_interval, args.executor) == (64, 20, "ray")
    assert args.sglang_passthrough == {"mem_fraction_static": "0.7", "enable_dp_attention": True,
                                       "log_level": "INFO"}
    assert args.router_passthrough == {"dp_aware": True}
    assert args.megatron_flags_given[:3] == ["--num-layers", "--hidden-size", "--ffn-hidden-size"]
    assert "--tensor-model-parallel-size" in args.megatron_flags_given
    # the page's own example sets a response cap above the token cap: furlong says so
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        "--rollout-max-response-len (8192) is larger than --max-tokens-per-gpu (4608): a longer sample gets a "
        "micro-batch of its own above the cap and may run out of memory."]


def test_walkthrough_colocate_snippet_parses():
    args = parse_args(["--actor-num-nodes", "1", "--actor-num-gpus-per-node", "8", "--colocate",
                       "--num-rollout", "10", "--rollout-batch-size", "8", "--rollout-backend", "sglang"])
    assert (args.rollout_num_gpus, args.offload_train, args.offload_rollout) == (8, True, True)
    assert args.sglang_passthrough == {"cuda_graph_backend_prefill": "disabled"}


def example_argv(name: str) -> list[str]:
    script = f'furlong() {{ printf "%s\\n" "$@"; }}; export -f furlong; bash "{REPO}/examples/launch/{name}"'
    env_vars = {k: v for k, v in os.environ.items() if k not in ("MODEL_DIR", "DATA_DIR", "RUN_DIR", "SAVE_DIR")}
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True, timeout=60,
                         env=env_vars)
    argv = out.stdout.splitlines()
    assert argv[0] == "train"
    return argv[1:]


def test_gsm8k_megatron_script_prints_its_config_with_one_warning_for_the_cluster_model_path(capsys, caplog):
    """Its own backend accepts it (no-op parallel sizes of 1 included); the model path of the cluster
    does not exist here: one warning that it cannot be checked here, no error."""
    from furlong.core.cli.commands import main

    argv = example_argv("gsm8k_qwen_megatron.sh")
    assert not os.path.exists(argv[argv.index("--hf-checkpoint") + 1])
    with caplog.at_level(logging.WARNING, logger="furlong.config"):
        code = main(["train", *argv, "--print-config"])
    err = capsys.readouterr().err.strip().removeprefix("error: ")
    # the one true error on a machine without SGLang (the script's --rollout-backend sglang)
    problems = [line for line in err.splitlines() if line and "needs SGLang" not in line]
    assert code in (0, 2) and problems == [], err
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert [w for w in warnings if "/root/Qwen2.5-1.5B-Instruct" in w] == [
        "--hf-checkpoint /root/Qwen2.5-1.5B-Instruct: no config.json here, so the architecture flags and parallel "
        "sizes are not checked against it (the run checks them)."]


def test_miles_style_demo_script_parses():
    args = parse_args(example_argv("miles_style_demo.sh"))
    assert (args.hf_checkpoint, args.prompt_data) == ("examples/demo/model", "examples/demo/data/train.jsonl")
    assert args.eval_prompt_data == ["demo", "examples/demo/data/test.jsonl"]
    assert (args.input_key, args.label_key, args.rm_type) == ("prompt", "label", "math")
    assert (args.rollout_backend, args.train_backend, args.executor) == ("embedded", "fsdp", "local")
    assert (args.rollout_batch_size, args.n_samples_per_prompt, args.global_batch_size) == (8, 4, 32)


def test_ppo_miles_style_script_configures_a_critic_run():
    args, problems = configured(example_argv("ppo_miles_style.sh"))
    assert problems == []
    assert (args.advantage_estimator, args.train_backend, args.use_critic) == ("ppo", "fsdp", True)
    assert (args.critic_lr, args.critic_lr_warmup_iters, args.value_clip, args.num_critic_only_steps) == \
        (1e-3, 0, 0.2, 0)
    save = args.save
    assert (args.critic_save, args.critic_load) == (save + "_critic", save + "_critic")


def test_gsm8k_megatron_script_parses():
    args, _lacking_here = configured(example_argv("gsm8k_qwen_megatron.sh"))
    assert (args.train_backend, args.rollout_backend, args.executor) == ("megatron", "sglang", "ray")
    assert (args.tensor_model_parallel_size, args.sequence_parallel, args.data_parallel_size) == (2, False, 2)
    assert (args.apply_chat_template, args.rm_type, args.prompt_data) == (True, "math", "examples/gsm8k/data/train.jsonl")
    assert args.ref_load == args.hf_checkpoint == "/root/Qwen2.5-1.5B-Instruct"
    assert (args.rollout_num_gpus, args.sglang_tp_size) == (4, 1)
    assert args.sglang_passthrough == {"mem_fraction_static": "0.8"}


def demo_argv() -> list[str]:
    """The flags examples/demo/run_demo.sh passes to furlong (its ARGS array)."""
    script = f'OUT=runs/demo; eval "$(sed -n "/^ARGS=(/,/^)/p" "{REPO}/examples/demo/run_demo.sh")"; ' \
             'printf "%s\\n" "${ARGS[@]}"'
    return bash_argv(script)


def test_cpu_sglang_demo_command_parses_to_one_engine():
    """README's CPU command for the sglang engine: run_demo.sh --rollout-backend sglang --sglang-server-impl furlong."""
    flags = ["--rollout-backend", "sglang", "--sglang-server-impl", "furlong", "--executor", "local", "--print-config"]
    args, _lacking_here = configured(demo_argv() + flags)  # the sglang engine's configure counts the engines
    assert (args.rollout_backend, args.sglang_server_impl, args.executor) == ("sglang", "furlong", "local")
    assert (args.rollout_num_gpus, args.rollout_num_gpus_per_engine) == (1, 1)  # one engine
    args, _lacking_here = configured(demo_argv() + flags + ["--rollout-num-gpus", "2"])
    assert args.rollout_num_gpus == 2  # two engines, as given
