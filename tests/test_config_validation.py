"""Validation rules and derived defaults of the launch flags: every error message compared
whole, warnings read from the ``furlong.config`` logger."""

from __future__ import annotations

import json
import logging

import pytest

import furlong.core.config.env as env
from furlong.core.config import UNSUPPORTED, ConfigError, build_parser, config_to_dict, parse_args
from furlong.core.config.unsupported import NO_EFFECT
from furlong.core.config.validate import validate

BASE = ["--num-rollout", "3", "--rollout-batch-size", "4"]


pytestmark = pytest.mark.usefixtures("cpu_machine")  # the same defaults on every machine


def error_of(argv: list[str], **kwargs) -> str:
    with pytest.raises(ConfigError) as excinfo:
        parse_args(argv, **kwargs)
    return str(excinfo.value)


def configured_error_of(argv: list[str]) -> str:
    """The problems of ``argv`` once every chosen plugin's ``configure`` ran (the data-parallel checks among them)."""
    from furlong.core.config.launch_args import launch_config

    with pytest.raises(ConfigError) as excinfo:
        launch_config(*argv)
    return str(excinfo.value)


def warnings_of(caplog, argv: list[str]) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="furlong.config"):
        parse_args(argv)
    return [r.getMessage() for r in caplog.records if r.name == "furlong.config" and r.levelno == logging.WARNING]


# --- errors: (extra flags after BASE, whole message) ------------------------------------

ERRORS = [
    (["--rollout-temperature", "0"],
     "--rollout-temperature must be > 0, got 0 (greedy decoding is for evaluation only: --eval-temperature 0)."),
    (["--rollout-temperature", "-0.5"],
     "--rollout-temperature must be > 0, got -0.5 (greedy decoding is for evaluation only: --eval-temperature 0)."),
    (["--eval-temperature", "-1"], "--eval-temperature must be >= 0 (0 = greedy), got -1."),
    (["--rollout-top-p", "1.5"], "--rollout-top-p must be in (0, 1], got 1.5."),
    (["--eps-clip-c", "1.0"], "--eps-clip-c must be greater than 1 (the dual-clip bound), got 1."),
    (["--micro-batch-size", "0"], "--micro-batch-size must be at least 1, got 0."),
    (["--rollout-max-response-len", "0"], "--rollout-max-response-len must be at least 1, got 0."),
    (["--lr=-1e-4"], "--lr must be at least 0, got -0.0001."),
    (["--eps-clip", "-0.2"], "--eps-clip must be at least 0, got -0.2."),
    (["--use-kl-loss", "--kl-loss-coef", "-1", "--ref-load", "m"], "--kl-loss-coef must be at least 0, got -1."),
    (["--rollout-top-k", "0"], "--rollout-top-k must be -1 (off) or at least 1, got 0."),
    (["--start-rollout-id", "5"], "--start-rollout-id 5 is not below --num-rollout 3: there is nothing to run."),
    (["--weight-decay=-0.1"], "--weight-decay must be at least 0, got -0.1."),
    (["--train-memory-margin-bytes=-5"], "--train-memory-margin-bytes must be at least 0, got -5."),
    (["--use-dynamic-batch-size"],
     "--use-dynamic-batch-size requires --max-tokens-per-gpu (the token cap per micro-batch per GPU)."),
    (["--use-kl-loss"],
     "--use-kl-loss needs a reference model: give --ref-load (or --hf-checkpoint, used as the reference when "
     "--ref-load is absent)."),
    (["--use-kl-loss", "--kl-coef", "0.1"],
     "--use-kl-loss and --kl-coef 0.1 need a reference model: give --ref-load (or --hf-checkpoint, used as the "
     "reference when --ref-load is absent)."),
    (["--ref-load", "/ref", "--kl-coef", "0.1", "--kl-loss-coef", "0.01"],
     "--kl-coef (0.1) and --kl-loss-coef (0.01) are exclusive: the KL goes into the rewards or into the loss, "
     "not both; set one of them to 0."),
    (["--use-rollout-logprobs", "--use-tis"],
     "--use-rollout-logprobs and --use-tis are exclusive: with the engine's log-probs as the old policy the "
     "importance ratio is always 1."),
    (["--get-mismatch-metrics"],
     "--get-mismatch-metrics needs --custom-tis-function-path."),
    (["--custom-tis-function-path", "my.tis"],
     "--custom-tis-function-path my.tis is called only under --use-tis or --get-mismatch-metrics; add one of them or "
     "drop it."),
    (["--ref-update-interval", "2"],
     "--ref-update-interval updates the reference model, which loads only with --use-kl-loss or --kl-coef != 0; add "
     "one of them or drop --ref-update-interval."),
    (["--hf-checkpoint", "/m", "--use-kl-loss", "--ref-update-interval", "0"],
     "--ref-update-interval must be >= 1 (rollouts between reference updates), got 0."),
    (["--use-opd"], "--use-opd needs --opd-type sglang (a served teacher at --rm-url or --opd-teacher-urls)."),
    (["--use-opd", "--opd-type", "megatron", "--opd-teacher-load", "/t"],
     "--opd-type megatron is not supported yet: the trainer loads no teacher model. Serve the teacher (furlong "
     "serve, or SGLang) and give --opd-type sglang --rm-url http://HOST:PORT/generate."),
    (["--use-opd", "--opd-type", "sglang"],
     "--opd-type sglang needs the teacher's /generate URL: --rm-url, or --opd-teacher-urls NAME=URL."),
    (["--opd-teacher-urls", "http://x"], "--opd-teacher-urls takes NAME=URL items, got 'http://x'."),
    (["--save-interval", "20"],
     "--save-interval 20 has no effect without --save: give --save DIR or drop --save-interval."),
    (["--save-trigger-sentinel", "/tmp/stop"],
     "--save-trigger-sentinel /tmp/stop has no effect without --save: give --save DIR or drop "
     "--save-trigger-sentinel."),
    (["--custom-megatron-post-save-hook-path", "m.hook"],
     "--custom-megatron-post-save-hook-path m.hook has no effect without --save: give --save DIR or drop "
     "--custom-megatron-post-save-hook-path."),
    (["--eval-interval", "5"],
     "--eval-interval 5 needs an eval set: give --eval-prompt-data NAME PATH or --eval-config FILE."),
    (["--eval-prompt-data", "a", "a.jsonl", "b"],
     "--eval-prompt-data takes NAME PATH pairs (or one PATH, read as 'aime PATH'); got 3 values: a a.jsonl b."),
    (["--eval-sglang-mem-fraction-static", "0.5"],
     "--eval-sglang-mem-fraction-static: --eval-sglang-* flags configure the dedicated eval fleet, which needs "
     "--eval-num-gpus > 0."),
    (["--over-sampling-batch-size", "2"],
     "--over-sampling-batch-size (2) must be at least --rollout-batch-size (4): each wave draws at least one "
     "rollout's worth of prompts."),
    (["--fully-async", "--rollout-function-path", "my.rollout"],
     "--fully-async cannot be combined with --rollout-function-path (both choose the rollout)."),
    (["--fully-async", "--rollout", "sync"],
     "--fully-async and --rollout sync both choose the rollout; pass only one."),
    (["--n-samples-per-prompt", "4", "--async-max-concurrent-samples", "3"],
     "--async-max-concurrent-samples (3) must be at least --n-samples-per-prompt (4): a whole group is in "
     "flight at once."),
    (["--tito-model", "qwen"], "--tito-model qwen needs --use-session-server."),
    (["--custom-agent-function-path", "a.run", "--pause-generation-mode", "abort"],
     "--custom-agent-function-path cannot use --pause-generation-mode abort (agents keep their requests open "
     "across weight updates)."),
    (["--debug-rollout-only", "--debug-train-only"],
     "--debug-rollout-only and --debug-train-only are exclusive: the first runs only the engines, the second "
     "only the trainer."),
    (["--debug-rollout-only", "--load-debug-rollout-data", "/d/{rollout_id}.pt"],
     "--debug-rollout-only and --debug-train-only are exclusive: the first runs only the engines, the second "
     "only the trainer."),
    (["--rollout-max-context-len", "100", "--rollout-max-prompt-len", "100"],
     "--rollout-max-prompt-len (100) must be at most --rollout-max-context-len - 1 (99): a prompt needs room for "
     "one response token."),
    (["--lr-warmup-iters", "10", "--lr-warmup-fraction", "0.1"],
     "--lr-warmup-iters and --lr-warmup-fraction are exclusive; pass one."),
    (["--bf16", "--fp16"], "--bf16 and --fp16 are exclusive; pass one."),
    (["--value-clip=-0.1"], "--value-clip must be at least 0, got -0.1."),
    (["--value-clip=-inf"], "argument --value-clip: expected a finite number or inf (no bound), got '-inf'."),
    (["--gamma", "1.5"], "--gamma must be in [0, 1], got 1.5."),
    (["--gamma=-0.01"], "--gamma must be in [0, 1], got -0.01."),
    (["--lambd", "1.01"], "--lambd must be in [0, 1], got 1.01."),
    (["--lambd=-1"], "--lambd must be in [0, 1], got -1."),
    (["--eval-top-p", "0"], "--eval-top-p must be in (0, 1], got 0."),
    (["--adam-beta2", "1"], "--adam-beta2 must be in [0, 1), got 1."),
    (["--adam-beta1=-0.1"], "--adam-beta1 must be in [0, 1), got -0.1."),
    (["--adam-eps=-1e-8"], "--adam-eps must be at least 0, got -1e-08."),
    (["--lr-warmup-fraction", "1.5"], "--lr-warmup-fraction must be in [0, 1], got 1.5."),
    (["--lora-dropout", "1"], "--lora-dropout must be in [0, 1), got 1."),
    (["--hidden-dropout", "1.2"], "--hidden-dropout must be in [0, 1), got 1.2."),
    (["--rotary-percent", "0"], "--rotary-percent must be in (0, 1], got 0."),
    (["--critic-lr=-1e-3"], "--critic-lr must be at least 0, got -0.001."),
    (["--num-critic-only-steps=-1"], "--num-critic-only-steps must be at least 0, got -1."),
    (["--opd-kl-coef=-1"], "--opd-kl-coef must be at least 0, got -1."),
    (["--tis-clip-low=-0.5"], "--tis-clip-low must be at least 0, got -0.5."),
    (["--tis-clip", "0.5", "--tis-clip-low", "0.8"],
     "--tis-clip (0.5) must be at least --tis-clip-low (0.8): the importance weights are clamped to "
     "[--tis-clip-low, --tis-clip]."),
    (["--sglang-dp-size", "2"], "--sglang-dp-size 2 requires --sglang-enable-dp-attention."),
    (["--sglang-dp-size", "two"], "--sglang-dp-size must be a whole number, got 'two'."),
    (["--colocate", "--update-weight-transfer-mode", "p2p"],
     "--update-weight-transfer-mode p2p: weights reach the engines by broadcast over a process group (or in place "
     "when they share the trainer's process); p2p and disk-delta transfers are not implemented. Remove it (broadcast "
     "is the default).\n"
     "--colocate cannot use --update-weight-transfer-mode p2p; colocated engines receive weights in place."),
]


@pytest.mark.parametrize("extra, message", ERRORS, ids=lambda v: " ".join(v)[:50] if isinstance(v, list) else "")
def test_validation_error_message(extra, message):
    assert error_of(BASE + extra) == message


# float flags where inf means "no bound" (their help says so); every other float flag is finite
TAKES_INF = {"--value-clip", "--tis-clip"}


def _float_flags() -> list[str]:
    """Every float flag of ``furlong train``, plugins' and Megatron's table included (their longest spelling)."""
    from furlong.core.config._util import FLOAT_TYPES
    from furlong.core.plugins.manager import get_plugin_manager

    parser = build_parser(get_plugin_manager())
    floats = [a for a in parser._actions if parser._registry_get("type", a.type, a.type) in FLOAT_TYPES]
    return sorted(max(a.option_strings, key=len) for a in floats)


@pytest.mark.parametrize("word", ["nan", "inf", "-inf", "NaN", "Infinity"])
def test_every_float_flag_refuses_nan_and_infinity_naming_itself(word):
    """One run with every float flag set to ``word``: one error per flag (a flag where inf means no bound takes
    inf). Plugin flags (--ray-call-timeout, --remote-rm-timeout) and Megatron's go through the same type."""
    from furlong.core.plugins.manager import get_plugin_manager

    flags = _float_flags()
    assert {"--lr", "--gamma", "--value-clip", "--ray-call-timeout", "--remote-rm-timeout", "--rollout-top-p",
            "--adam-beta1", "--moe-aux-loss-coeff"} <= set(flags) and len(flags) > 60
    argv = [f"{flag}={word}" for flag in flags]  # with '=': a list flag's '-inf' is a value, not a flag
    infinite = word.lower() in ("inf", "infinity")
    expected = [f"argument {flag}: expected a finite number or inf (no bound), got {word!r}." if flag in TAKES_INF
                else f"argument {flag}: expected a finite number, got {word!r}." for flag in flags
                if not (infinite and flag in TAKES_INF)]
    problems = error_of(BASE + argv, pm=get_plugin_manager()).splitlines()
    assert sorted(p for p in problems if p.startswith("argument ")) == sorted(expected)
    assert [p for p in problems if not p.startswith("argument ")] == []


def test_inf_is_no_bound_where_the_flag_says_so():
    args = parse_args(BASE + ["--value-clip", "inf", "--tis-clip", "inf", "--use-tis"])
    assert (args.value_clip, args.tis_clip) == (float("inf"), float("inf"))


def test_cli_refuses_a_non_finite_float_in_one_line(capsys):
    from furlong.core.cli.commands import main

    assert main(["train", "--print-config", *BASE, "--hf-checkpoint", "examples/demo/model", "--lr", "nan"]) == 2
    assert capsys.readouterr().err.splitlines() == ["error: argument --lr: expected a finite number, got 'nan'."]


@pytest.mark.parametrize("yaml, message", [
    ("lr: .nan\n", "--custom-config-path: lr: cannot read nan (expected a finite number, got nan)."),
    ("lr: nan\n", "--custom-config-path: lr: cannot read 'nan' (expected a finite number, got 'nan')."),
    ("gamma: .inf\n", "--custom-config-path: gamma: cannot read inf (expected a finite number, got inf)."),
    ("value_clip: -.inf\n",
     "--custom-config-path: value_clip: cannot read -inf (expected a finite number or inf (no bound), got -inf)."),
])
def test_overlay_refuses_non_finite_floats(tmp_path, yaml, message):
    path = tmp_path / "over.yaml"
    path.write_text(yaml)
    assert error_of(BASE + ["--custom-config-path", str(path)]) == message


def test_overlay_takes_inf_where_the_flag_says_so(tmp_path):
    path = tmp_path / "over.yaml"
    path.write_text("value_clip: .inf\nlr: 2.0e-5\n")
    args = parse_args(BASE + ["--custom-config-path", str(path)])
    assert (args.value_clip, args.lr) == (float("inf"), 2e-5)


# the engine plugins' rules, told by their ``configure`` (the flags parse): (extra flags after BASE, one problem)
ENGINE_ERRORS = [
    (["--rollout-backend", "sglang", "--sglang-server-impl", "furlong", "--rollout-num-gpus", "6",
      "--rollout-num-gpus-per-engine", "4"],
     "--rollout-num-gpus (6) must be a multiple of --rollout-num-gpus-per-engine (4): every engine gets the "
     "same number of GPUs."),
    (["--rollout-external"],
     "--rollout-external and --rollout-external-engine-addrs attach to SGLang servers: they need "
     "--rollout-backend sglang."),
    (["--embedded-max-batch-size", "0"], "--embedded-max-batch-size must be at least 1, got 0."),
]


@pytest.mark.parametrize("extra, message", ENGINE_ERRORS, ids=lambda v: " ".join(v)[:50] if isinstance(v, list) else "")
def test_engine_plugin_error_message(extra, message):
    assert message in configured_error_of(BASE + extra).splitlines()


def test_num_rollout_is_required_and_mentions_the_old_default():
    assert error_of(["--rollout-batch-size", "4"]) == (
        "--num-rollout is required: give the number of rollout iterations to run (it used to default to 1000; "
        "--num-rollout 0 only evaluates).")


def test_every_problem_is_reported_at_once_one_per_line():
    message = error_of(["--rollout-batch-size", "4", "--rollout-temperature", "0", "--balance-by-flops",
                        "--use-kl-loss"])
    assert message.splitlines() == [
        "--balance-by-flops: micro-batches are balanced by tokens, not FLOPs; remove it and use --balance-data "
        "(Karmarkar-Karp on token counts).",
        "--num-rollout is required: give the number of rollout iterations to run (it used to default to 1000; "
        "--num-rollout 0 only evaluates).",
        "--rollout-temperature must be > 0, got 0 (greedy decoding is for evaluation only: --eval-temperature 0).",
        "--use-kl-loss needs a reference model: give --ref-load (or --hf-checkpoint, used as the reference when "
        "--ref-load is absent).",
    ]


def test_config_error_is_a_plugin_error_with_the_problem_list():
    from furlong.hooks import PluginError

    with pytest.raises(PluginError) as excinfo:
        parse_args(["--rollout-batch-size", "4", "--balance-by-flops"])
    assert isinstance(excinfo.value, ConfigError)
    assert len(excinfo.value.problems) == 2


# --- command-dependent checks -------------------------------------------------------------

# The rules of the chosen plugins (ppo, reinforce++, gspo, grpo, fully_async, --loss-type
# custom_loss) run in their `configure` hooks after the selection: tests/test_configure.py.

@pytest.mark.parametrize("extra, command, message", [
    (["--colocate"], "train-async",
     "furlong train-async cannot run with --colocate (training and generation overlap); use furlong train."),
    (["--offload-rollout"], "train-async",
     "furlong train-async cannot run with --offload-rollout: the engines generate the next rollout while the "
     "trainer trains, so they cannot give their memory up; use furlong train."),
])
def test_command_dependent_errors(extra, command, message):
    assert error_of(BASE + ["--hf-checkpoint", "examples/demo/model"] + extra, command=command) == message


def test_command_dependent_checks_pass_for_the_right_command():
    assert parse_args(BASE + ["--fully-async"], command="train-async").fully_async is True
    assert parse_args(BASE + ["--colocate"], command="train").colocate is True
    assert parse_args(BASE + ["--fully-async"]).rollout == "fully_async"  # command unknown: not checked


def test_the_command_sets_train_mode_for_the_plugins():
    assert parse_args(BASE, command="train").train_mode == "sync"
    assert parse_args(BASE, command="train-async").train_mode == "async"
    assert parse_args(BASE).train_mode is None  # no command: the loop is not known


# --- not supported yet ------------------------------------------------------------------

UNSUPPORTED_ARGV = {
    "--true-on-policy-mode": ["--true-on-policy-mode"],
    "--balance-by-flops": ["--balance-by-flops"],
    "--multimodal-keys": ["--multimodal-keys", '{"image": "images"}'],
    "--update-weight-transfer-mode": ["--update-weight-transfer-mode", "disk-delta"],
    "--use-session-server": ["--use-session-server"],
    "--custom-async-data-buffer-path": ["--custom-async-data-buffer-path", "my.Buffer"],
    "--offload-rollout-level": ["--offload-rollout-level", "kv_cache"],
    "--disable-rollout-global-dataset": ["--disable-rollout-global-dataset"],
    "--max-seq-len": ["--max-seq-len", "4096"],
    "--session-server-ip": ["--session-server-ip", "10.0.0.1"],
    "--session-server-port": ["--session-server-port", "8000"],
    "--fsdp-cpu-backend": ["--fsdp-cpu-backend", "nccl"],
    "--pretrained-checkpoint": ["--pretrained-checkpoint", "/ckpt/base"],
}
UNSUPPORTED_MESSAGES = {
    "--opd-type": "--opd-type sglang is not supported yet (supported: megatron).",
}


# refused with a reason: the flag as the message shows it (with its value), then ": " and the row's reason
REASON_SHOWN = {"--multimodal-keys": "--multimodal-keys {'image': 'images'}",
                "--update-weight-transfer-mode": "--update-weight-transfer-mode disk-delta",
                "--use-session-server": "--use-session-server v1",
                "--custom-async-data-buffer-path": "--custom-async-data-buffer-path my.Buffer",
                "--offload-rollout-level": "--offload-rollout-level ['kv_cache']",
                "--max-seq-len": "--max-seq-len 4096",
                "--pretrained-checkpoint": "--pretrained-checkpoint /ckpt/base",
                "--session-server-ip": "--session-server-ip 10.0.0.1", "--session-server-port": "--session-server-port [8000]",
                "--fsdp-cpu-backend": "--fsdp-cpu-backend nccl"}


def test_miles_flags_that_choose_only_layout_or_memory_are_one_warning_each():
    args = parse_args(BASE + ["--qkv-format", "bshd", "--train-memory-margin-bytes", "1024"])
    report = validate(args)
    assert report.errors == []
    assert [w for w in report.warnings if "changes nothing here" in w] == [
        f"--qkv-format bshd changes nothing here: {NO_EFFECT[0].reason}",
        f"--train-memory-margin-bytes 1024 changes nothing here: {NO_EFFECT[1].reason}"]
    at_miles_default = validate(parse_args(BASE + ["--qkv-format", "thd", "--train-memory-margin-bytes",
                                                   str(1 << 30)]))
    assert not [w for w in at_miles_default.warnings if "changes nothing here" in w]


@pytest.mark.parametrize("row", UNSUPPORTED, ids=lambda r: r.flag)
def test_unsupported_flag_with_a_non_default_value_is_an_error(row):
    if row.reason is None:
        message = UNSUPPORTED_MESSAGES.get(row.flag, f"{row.flag} is not supported yet; remove it.")
    else:
        message = f"{REASON_SHOWN.get(row.flag, row.flag)}: {row.reason}"
    assert error_of(BASE + UNSUPPORTED_ARGV[row.flag]).splitlines()[0] == message


@pytest.mark.parametrize("row", [r for r in UNSUPPORTED if r.reason is not None], ids=lambda r: r.flag)
def test_a_refusal_with_a_reason_tells_what_to_do(row):
    assert "not supported yet" not in row.reason
    assert "remove it" in row.reason.lower()


def test_unsupported_flags_at_their_default_value_are_accepted():
    args = parse_args(BASE + ["--qkv-format", "thd", "--eval-num-gpus", "0", "--update-weight-transfer-mode",
                              "broadcast", "--opd-type", "megatron"])
    assert (args.qkv_format, args.eval_num_gpus, args.update_weight_transfer_mode) == ("thd", 0, "broadcast")


def test_unsupported_table_and_test_rows_match():
    assert sorted(row.flag for row in UNSUPPORTED) == sorted(UNSUPPORTED_ARGV)


# --- warnings ---------------------------------------------------------------------------

@pytest.mark.parametrize("extra, warning", [
    (["--eval-prompt-data", "t", "t.jsonl", "--eval-temperature", "0", "--n-samples-per-eval-prompt", "4"],
     "--eval-temperature 0 is greedy: the 4 samples per eval prompt (--n-samples-per-eval-prompt) are identical; 1 "
     "gives the same numbers faster."),
    (["--lr-warmup-iters", "3"],
     "--lr-warmup-iters 3 is not below the run's 3 optimizer steps (--num-rollout x --num-steps-per-rollout): the "
     "learning rate never reaches --lr."),
])
def test_settings_that_cannot_do_what_they_seem_to_warn(caplog, extra, warning):
    assert warning in warnings_of(caplog, BASE + extra)


def test_colocate_ignores_rollout_num_gpus_with_a_warning(caplog):
    warned = warnings_of(caplog, BASE + ["--colocate", "--rollout-num-gpus", "4"])
    assert warned[0] == ("--rollout-num-gpus 4 is ignored under --colocate: the engines share the trainer's 1 GPUs "
                         "(actor_num_nodes x actor_num_gpus_per_node).")
    assert parse_args(BASE + ["--colocate", "--rollout-num-gpus", "4"]).rollout_num_gpus == 1


@pytest.mark.parametrize("flags, named", [(["--colocate"], "--colocate"), (["--offload"], "--offload"),
                                          (["--offload-train", "--offload-rollout"], "--offload-train, --offload-rollout")])
def test_offloading_on_a_machine_without_a_gpu_is_said_to_change_nothing(caplog, monkeypatch, flags, named):
    monkeypatch.setattr(env, "cuda_available", lambda: False)
    assert warnings_of(caplog, BASE + flags)[-1] == (
        f"{named}: offloading to host memory changes nothing on this machine, which has no GPU (the weights and "
        "optimizer state are in host memory already).")
    assert not any("offloading" in w for w in warnings_of(caplog, BASE + flags + ["--actor-num-nodes", "2"]))
    monkeypatch.setattr(env, "cuda_available", lambda: True)
    monkeypatch.setattr(env, "cuda_device_count", lambda: 1)
    monkeypatch.setattr(env, "gpu_memory", lambda: ("NVIDIA H200", 140 * 2**30, 139 * 2**30))
    assert not any("offloading" in w for w in warnings_of(caplog, BASE + flags))
    assert not any("offloading" in w for w in warnings_of(caplog, BASE))


def test_dynamic_batching_warns_when_responses_exceed_the_token_cap(caplog):
    warned = warnings_of(caplog, BASE + ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096",
                                         "--rollout-max-response-len", "8192"])
    assert warned == ["--rollout-max-response-len (8192) is larger than --max-tokens-per-gpu (4096): a longer "
                      "sample gets a micro-batch of its own above the cap and may run out of memory."]
    assert warnings_of(caplog, BASE + ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096",
                                       "--rollout-max-response-len", "4096"]) == []


def test_partial_rollout_with_several_steps_without_tis_warns(caplog):
    argv = BASE + ["--n-samples-per-prompt", "2", "--num-steps-per-rollout", "2", "--partial-rollout"]
    assert warnings_of(caplog, argv) == [
        "--partial-rollout with --num-steps-per-rollout 2 trains on samples from older policies; add --use-tis to "
        "correct for it."]
    assert warnings_of(caplog, argv + ["--use-tis"]) == []


def test_update_weights_interval_under_sync_train_is_accepted_with_a_warning(caplog):
    def warned(argv, command):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="furlong.config"):
            args = parse_args(argv, command=command)
        return args.update_weights_interval, [r.getMessage() for r in caplog.records if r.name == "furlong.config"]

    assert warned(BASE + ["--update-weights-interval", "2"], "train") == (2, [
        "--update-weights-interval 2 is read by furlong train-async only; furlong train syncs the weights after "
        "every rollout."])
    assert warned(BASE + ["--update-weights-interval", "1"], "train") == (1, [])
    assert warned(BASE + ["--update-weights-interval", "2"], "train-async")[1] == []


def test_train_async_turns_tis_on_unless_a_correction_or_no_use_tis_is_given(caplog):
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="furlong.config"):
        assert parse_args(BASE, command="train-async").use_tis is True
    assert [r.getMessage() for r in caplog.records if r.name == "furlong.config" and "--use-tis" in r.getMessage()] == [
        "furlong train-async: --use-tis is on (rollouts are generated one or more weight versions behind the "
        "trainer); --no-use-tis trains without an off-policy correction."]
    assert parse_args(BASE + ["--no-use-tis"], command="train-async").use_tis is False
    assert parse_args(BASE + ["--use-rollout-logprobs"], command="train-async").use_tis is False
    assert parse_args(BASE, command="train").use_tis is False  # sync is on-policy: nothing to correct


def test_sglang_tp_size_is_replaced_by_gpus_per_engine(caplog):
    argv = BASE + ["--rollout-num-gpus-per-engine", "2", "--sglang-tp-size", "4"]
    assert warnings_of(caplog, argv) == ["--sglang-tp-size 4 is replaced by --rollout-num-gpus-per-engine (2)."]
    args = parse_args(argv)
    assert args.sglang_tp_size == 2 and "tp_size" not in args.sglang_passthrough


def test_colocate_disables_cuda_graph_prefill_unless_given(caplog):
    assert parse_args(BASE + ["--colocate"]).sglang_passthrough == {"cuda_graph_backend_prefill": "disabled"}
    argv = BASE + ["--colocate", "--sglang-cuda-graph-backend-prefill", "full"]
    assert [w for w in warnings_of(caplog, argv) if "offloading" not in w] == [
        "--sglang-cuda-graph-backend-prefill full under --colocate may run out of memory (NVLS buffers); furlong's "
        "default there is 'disabled'."]
    assert parse_args(argv).sglang_passthrough == {"cuda_graph_backend_prefill": "full"}


# --- derivations ------------------------------------------------------------------------

@pytest.mark.parametrize("extra, expected", [
    ([], (False, False)),
    (["--colocate"], (True, True)),
    (["--colocate", "--no-offload-train"], (False, True)),
    (["--colocate", "--no-offload-rollout"], (True, False)),
    (["--offload"], (True, True)),
    (["--offload-rollout"], (False, True)),
])
def test_offload_defaults(extra, expected):
    args = parse_args(BASE + extra)
    assert (args.offload_train, args.offload_rollout) == expected


def test_defaults_every_run_reads():
    args = parse_args(BASE)
    expected = {
        "rollout_temperature": 1.0, "rollout_top_p": 1.0, "rollout_top_k": -1, "eps_clip": 0.2,
        "eps_clip_high": 0.2, "eps_clip_c": None, "kl_loss_type": "k1", "kl_loss_coef": 0.0, "kl_coef": 0.0,
        "lr": 1e-6, "min_lr": 0.0, "weight_decay": 0.1, "adam_beta1": 0.9, "adam_beta2": 0.98, "adam_eps": 1e-8,
        "clip_grad": 1.0, "lr_decay_style": "constant", "lr_decay_iters": 3, "save_interval": 100,
        "policy_ratio_level": "token", "rollout_seed": 42, "seed": 1234, "n_samples_per_eval_prompt": 1,
        "micro_batch_size": 1, "over_sampling_batch_size": 4, "max_sampling_waves": 32, "rollout": "sync",
        "generate": "single_turn", "buffer_filter": "pop_first", "advantage_estimator": "grpo",
        "loss_type": "policy_loss", "data_source": "jsonl", "dynamic_sampling_filter": None,
        "disable_plugins": [], "apply_chat_template": False, "input_key": "input", "metadata_key": "metadata",
        "tool_key": "tools", "rollout_submission_granularity": None, "fully_async": False,
        "disable_grpo_std_normalization": False, "sglang_passthrough": {}, "router_passthrough": {},
        "megatron_flags_given": [], "seq_length": 4096, "max_position_embeddings": 4096,
        "sglang_server_concurrency": 512, "sglang_router_request_timeout_secs": 14400,
        "update_weight_buffer_size": 512 * 2**20, "pause_generation_mode": "retract", "executor": "local",
        "check_for_nan_in_loss_and_grad": True, "data_parallel_size": 1, "sglang_tp_size": 1,
    }
    assert {k: getattr(args, k) for k in expected} == expected


def test_eps_clip_high_follows_eps_clip_unless_given():
    assert parse_args(BASE + ["--eps-clip", "0.3"]).eps_clip_high == 0.3
    assert parse_args(BASE + ["--eps-clip", "0.3", "--eps-clip-high", "0.28"]).eps_clip_high == 0.28


def test_core_names_no_estimator_in_its_defaults():
    # gspo's sequence ratio, grpo's one-sample rule and ppo's critic come from their configure hooks
    args = parse_args(BASE + ["--advantage-estimator", "gspo", "--load", "/ck", "--lr", "2e-6"])
    assert (args.policy_ratio_level, args.disable_grpo_std_normalization, args.critic_load, args.critic_lr) == \
        ("token", False, None, None)


def test_eval_values_inherit_the_rollout_ones_when_unset():
    args = parse_args(BASE + ["--rollout-temperature", "0.7", "--rollout-top-p", "0.9", "--rollout-top-k", "20",
                              "--rollout-max-response-len", "512", "--input-key", "q", "--label-key", "a",
                              "--reward-key", "score", "--rollout-max-context-len", "1024",
                              "--eval-top-p", "1.0", "--n-samples-per-prompt", "8"])
    got = {k: getattr(args, k) for k in ("eval_temperature", "eval_top_p", "eval_top_k", "eval_max_response_len",
                                         "eval_input_key", "eval_label_key", "eval_tool_key", "eval_reward_key",
                                         "eval_max_context_len", "eval_max_prompt_len", "n_samples_per_eval_prompt")}
    assert got == {"eval_temperature": 0.7, "eval_top_p": 1.0, "eval_top_k": 20, "eval_max_response_len": 512,
                   "eval_input_key": "q", "eval_label_key": "a", "eval_tool_key": "tools", "eval_reward_key": "score",
                   "eval_max_context_len": 1024, "eval_max_prompt_len": None, "n_samples_per_eval_prompt": 1}


def test_eval_temperature_zero_is_greedy_and_allowed():
    assert parse_args(BASE + ["--eval-temperature", "0"]).eval_temperature == 0.0


def test_one_lone_eval_prompt_data_value_means_aime():
    assert parse_args(BASE + ["--eval-prompt-data", "/d/aime.jsonl"]).eval_prompt_data == ["aime", "/d/aime.jsonl"]


def test_over_sampling_batch_size_defaults_to_rollout_batch_size():
    assert parse_args(BASE).over_sampling_batch_size == 4
    assert parse_args(BASE + ["--over-sampling-batch-size", "6"]).over_sampling_batch_size == 6


def test_hf_checkpoint_serves_as_the_reference():
    args = parse_args(BASE + ["--use-kl-loss", "--hf-checkpoint", "/m"])
    assert (args.ref_load, args.tokenizer_model) == (None, "/m")


def test_fully_async_rollout_function_path_selects_the_fully_async_rollout():
    args = parse_args(BASE + ["--rollout-function-path", "fully_async_rollout.generate_rollout_fully_async"])
    assert (args.rollout, args.fully_async, args.rollout_function_path) == ("fully_async", True, None)


def test_rollout_fully_async_sets_the_fully_async_flag():
    args = parse_args(BASE + ["--rollout", "fully_async"])
    assert (args.rollout, args.fully_async) == ("fully_async", True)


def test_loading_debug_rollout_data_implies_train_only():
    assert parse_args(BASE + ["--load-debug-rollout-data", "/d/{rollout_id}.pt"]).debug_train_only is True


def test_dump_details_saves_the_rollouts_in_its_folder_unless_a_path_is_given():
    assert parse_args(BASE + ["--dump-details", "/d"]).save_debug_rollout_data == "/d/rollout_data/{rollout_id}.pt"
    assert parse_args(BASE + ["--dump-details", "/d", "--save-debug-rollout-data", "/e/{rollout_id}.pt"]
                      ).save_debug_rollout_data == "/e/{rollout_id}.pt"


def test_debug_exit_after_rollout_counts_from_one():
    assert error_of(BASE + ["--debug-exit-after-rollout", "0"]) == (
        "--debug-exit-after-rollout must be at least 1, got 0.")


def test_prompt_length_cap_defaults_to_context_minus_one():
    assert parse_args(BASE + ["--rollout-max-context-len", "100"]).rollout_max_prompt_len == 99


def test_fp16_turns_bf16_off():
    args = parse_args(BASE + ["--fp16"])
    assert (args.fp16, args.bf16) == (True, False)


def test_dp_attention_makes_the_router_dp_aware():
    args = parse_args(BASE + ["--sglang-dp-size", "2", "--sglang-enable-dp-attention"])
    assert args.router_passthrough == {"dp_aware": True}


def test_chat_template_path_is_sent_to_sglang():
    assert parse_args(BASE + ["--chat-template-path", "/t.jinja"]).sglang_passthrough == {"chat_template": "/t.jinja"}


def test_moe_allgather_dispatcher_runs_as_alltoall():
    assert parse_args(BASE + ["--moe-token-dispatcher-type", "allgather"]).moe_token_dispatcher_type == "alltoall"


def test_rollout_num_gpus_under_colocate_is_the_trainer_world_size():
    args = parse_args(BASE + ["--colocate", "--rollout-backend", "sglang", "--actor-num-gpus-per-node", "4"])
    assert (args.rollout_num_gpus, args.executor) == (4, "ray")


def test_executor_is_local_for_torchrun_ranks_and_ray_otherwise(monkeypatch):
    argv = BASE + ["--actor-num-gpus-per-node", "2"]
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert parse_args(argv).executor == "ray"
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert parse_args(argv).executor == "local"


def test_batch_flags_are_not_blamed_when_torchrun_started_another_number_of_ranks(monkeypatch):
    argv = BASE + ["--n-samples-per-prompt", "4", "--global-batch-size", "16", "--actor-num-gpus-per-node", "3"]
    monkeypatch.setenv("WORLD_SIZE", "2")  # the local executor refuses 3 ranks flagged for 2 processes
    problems = configured_error_of(argv)
    assert "torchrun started 2 trainer processes" in problems and "--global-batch-size" not in problems
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert "--global-batch-size (16) must be divisible by the data-parallel size 3" in configured_error_of(argv)
    monkeypatch.setenv("WORLD_SIZE", "2")  # no local executor to refuse the count: the batch flags are checked
    assert "--global-batch-size (16) must be divisible by the data-parallel size 3" in configured_error_of(
        argv + ["--executor", "ray"])


def test_cli_prints_each_flag_problem_on_its_own_error_line(capsys):
    from furlong.core.cli.commands import main

    assert main(["train", *BASE, "--hf-checkpoint", "examples/demo/model", "--global-batch-size", "3",
                 "--lr", "-1"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --lr must be at least 0, got -1.",
        "error: --rollout-batch-size (4) x --n-samples-per-prompt (1) = --global-batch-size (3) x --num-steps-per-rollout"
        " (?) has no whole solution with --num-steps-per-rollout >= 1: num_steps_per_rollout = 4 samples per rollout / 3"
        " samples per step = 1.333."]


def test_hf_checkpoint_problems_are_told_with_the_other_flag_problems(capsys):
    from furlong.core.cli.commands import main

    assert main(["train", "--num-rollout", "3", "--rollout-batch-size", "4", "--lr", "-1"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --hf-checkpoint is required: the Hugging Face model directory (config, tokenizer, weights).",
        "error: --lr must be at least 0, got -1."]
    # a path that is not a model directory too, unless the flags are only printed
    assert main(["train", "--hf-checkpoint", "/no/such/model", "--num-rollout", "3", "--rollout-batch-size", "4",
                 "--lr", "-1"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --hf-checkpoint '/no/such/model': no such directory.", "error: --lr must be at least 0, got -1."]
    assert main(["train", "--hf-checkpoint", "/no/such/model", "--num-rollout", "3", "--rollout-batch-size", "4",
                 "--lr", "-1", "--print-config"]) == 2
    assert capsys.readouterr().err.splitlines() == ["error: --lr must be at least 0, got -1."]


# --- device-dependent defaults ----------------------------------------------------------

DEVICE_KEYS = ("actor_num_gpus_per_node", "num_gpus_per_node", "attn_implementation", "bf16", "distributed_backend",
               "rollout_backend", "train_backend", "executor")


def test_cpu_defaults():
    args = parse_args(BASE)
    assert {k: getattr(args, k) for k in DEVICE_KEYS} == {
        "actor_num_gpus_per_node": 1, "num_gpus_per_node": 1, "attn_implementation": "sdpa", "bf16": False,
        "distributed_backend": "gloo", "rollout_backend": "embedded", "train_backend": "fsdp", "executor": "local"}


def _cuda(monkeypatch, gpus: int, packages: bool = True) -> None:
    """A CUDA machine with ``gpus`` visible devices; ``packages``: sglang and megatron-core importable."""
    monkeypatch.setattr(env, "cuda_available", lambda: True)
    monkeypatch.setattr(env, "cuda_device_count", lambda: gpus)
    monkeypatch.setattr(env, "sglang_available", lambda: packages)
    monkeypatch.setattr(env, "megatron_available", lambda: packages)


def test_cuda_defaults_use_the_gpus_torch_sees(monkeypatch):
    _cuda(monkeypatch, gpus=1, packages=False)  # without the sglang package the embedded engine stays the default
    args = parse_args(["--num-rollout", "3", "--rollout-batch-size", "8"])
    assert {k: getattr(args, k) for k in DEVICE_KEYS} == {
        "actor_num_gpus_per_node": 1, "num_gpus_per_node": 1, "attn_implementation": "flash_attention_2",
        "bf16": True, "distributed_backend": "nccl", "rollout_backend": "embedded", "train_backend": "fsdp",
        "executor": "local"}
    _cuda(monkeypatch, gpus=4, packages=False)
    args = parse_args(["--num-rollout", "3", "--rollout-batch-size", "8"])
    assert (args.actor_num_gpus_per_node, args.num_gpus_per_node, args.data_parallel_size) == (4, 4, 4)
    args = parse_args(["--num-rollout", "3", "--rollout-batch-size", "8", "--actor-num-gpus-per-node", "2"])
    assert (args.actor_num_gpus_per_node, args.num_gpus_per_node) == (2, 4)


def test_sglang_engines_need_rollout_num_gpus_only_for_sglang_servers_on_cuda(monkeypatch):
    import torch

    from furlong.core.config.launch_args import launch_config

    sglang = ["--rollout-backend", "sglang", "--print-config"]  # --print-config starts no router
    assert launch_config(*BASE, *sglang, "--sglang-server-impl", "furlong").rollout_num_gpus == 1  # one engine
    _cuda(monkeypatch, gpus=2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert ("--rollout-num-gpus is required with --rollout-backend sglang (GPUs for the engines), unless --colocate "
            "puts the engines on the trainer's GPUs.") in configured_error_of(BASE + sglang).splitlines()
    argv = BASE + sglang + ["--sglang-server-impl", "furlong", "--rollout-num-gpus-per-engine", "2", "--executor", "local",
                            "--actor-num-gpus-per-node", "1"]
    assert launch_config(*argv).rollout_num_gpus == 2  # furlong serve: one engine of 2 slots


def test_cuda_device_count_probe_is_zero_without_cuda(monkeypatch):
    monkeypatch.setattr(env, "cuda_available", lambda: False)
    assert env.cuda_device_count() == 0


def test_sglang_and_megatron_packages_alone_change_no_default(monkeypatch):
    _cuda(monkeypatch, gpus=2)  # both packages importable, no furlong plugin for them
    monkeypatch.setattr(env, "furlong_plugin_installed", lambda name: False)
    args = parse_args(["--num-rollout", "3", "--rollout-batch-size", "8"])
    assert (args.rollout_backend, args.train_backend) == ("embedded", "fsdp")


def test_megatron_core_on_cuda_makes_the_built_in_megatron_backend_the_default(monkeypatch):
    _cuda(monkeypatch, gpus=2)
    args = parse_args(["--num-rollout", "3", "--rollout-batch-size", "8", "--rollout-num-gpus", "1"])
    assert args.train_backend == "megatron"


def test_the_sglang_plugin_with_the_sglang_package_on_cuda_is_the_default_engine(monkeypatch):
    _cuda(monkeypatch, gpus=2)
    args = parse_args(["--num-rollout", "3", "--rollout-batch-size", "8", "--rollout-num-gpus", "1"])
    assert (args.rollout_backend, args.executor) == ("sglang", "ray")


BACKENDS = """
    from furlong.hooks import hookimpl


    class Engine:
        @hookimpl
        def rollout_engine(self, args):
            raise AssertionError("not built while parsing")


    class Trainer:
        @hookimpl
        def train_backend(self, args):
            raise AssertionError("not built while parsing")


    sglang = Engine()
    megatron = Trainer()
"""


@pytest.fixture
def backend_plugins(plugin_dist):
    """furlong plugins named sglang and megatron, installed as a distribution."""
    return plugin_dist("furlong-fake-backends", "furlong_fake_backends", BACKENDS,
                       {"sglang": "furlong_fake_backends:sglang", "megatron": "furlong_fake_backends:megatron"})


@pytest.mark.parametrize("cuda, packages, expected", [
    (True, True, ("sglang", "megatron")),
    (True, False, ("embedded", "fsdp")),  # the furlong plugins without their packages
    (False, True, ("embedded", "fsdp")),  # no CUDA
])
def test_backend_defaults_need_their_furlong_plugin_and_the_machine(monkeypatch, backend_plugins, cuda, packages,
                                                                    expected):
    from furlong.core.plugins.manager import get_plugin_manager

    _cuda(monkeypatch, gpus=2, packages=packages)
    monkeypatch.setattr(env, "cuda_available", lambda: cuda)
    argv = ["--num-rollout", "3", "--rollout-batch-size", "8", "--rollout-num-gpus", "2"]
    monkeypatch.delenv("FURLONG_DISABLE_PLUGINS", raising=False)
    for pm in (None, get_plugin_manager()):
        args = parse_args(argv, pm)
        assert (args.rollout_backend, args.train_backend) == expected


def test_a_disabled_backend_plugin_is_not_a_default(monkeypatch, backend_plugins):
    from furlong.core.plugins.manager import get_plugin_manager

    _cuda(monkeypatch, gpus=2)
    monkeypatch.delenv("FURLONG_DISABLE_PLUGINS", raising=False)
    args = parse_args(["--num-rollout", "3", "--rollout-batch-size", "8"], get_plugin_manager(["sglang,megatron"]))
    assert (args.rollout_backend, args.train_backend) == ("embedded", "fsdp")


def test_furlong_plugin_installed_reads_the_entry_points(backend_plugins):
    assert env.furlong_plugin_installed("sglang") and env.furlong_plugin_installed("megatron")
    assert env.furlong_plugin_installed("grpo") and not env.furlong_plugin_installed("no_such_plugin")


def test_machine_defaults_name_the_flags_that_came_from_the_machine(monkeypatch):
    from furlong.core.config.parser import machine_defaults

    _cuda(monkeypatch, gpus=2)
    monkeypatch.setattr(env, "furlong_plugin_installed", lambda name: name == "megatron")  # the sglang plugin absent
    args = parse_args(["--num-rollout", "3", "--rollout-batch-size", "8", "--actor-num-gpus-per-node", "1", "--fp16"])
    assert machine_defaults(args) == {
        "num_gpus_per_node": {"value": 2, "probe": "torch.cuda.device_count() = 2"},
        "attn_implementation": {"value": "flash_attention_2", "probe": "torch.cuda.is_available() = True"},
        "distributed_backend": {"value": "nccl", "probe": "torch.cuda.is_available() = True"},
        "rollout_backend": {"value": "embedded", "probe": "furlong plugin 'sglang' installed: False, CUDA: True, "
                                                          "sglang package importable: True"},
        "train_backend": {"value": "megatron", "probe": "furlong plugin 'megatron' installed: True, CUDA: True, "
                                                        "megatron.core importable: True"},
        "executor": {"value": "local", "probe": "one train rank"},
    }  # actor_num_gpus_per_node was given; --fp16 turned bf16 off


def test_print_config_shows_no_credential(capsys):
    """Miles' argv with --wandb-key printed the key; secrets (furlong.kit.redact, the loggers' list too) print as ***,
    also the SGLang server's and router's API keys passed through."""
    from furlong.core.cli.commands import main

    assert main(["train", "--print-config", *BASE, "--hf-checkpoint", "examples/demo/model", "--wandb-key", "X1",
                 "--sglang-api-key", "X2", "--router-api-key", "X3", "--sglang-enable-metrics"]) == 0
    out = capsys.readouterr().out
    args = json.loads(out)["args"]
    assert (args["wandb_key"], args["sglang_passthrough"], args["router_passthrough"]) == (
        "***", {"api_key": "***", "enable_metrics": True}, {"api_key": "***"})
    assert not any(secret in out for secret in ("X1", "X2", "X3"))
    assert main(["train", "--print-config", *BASE, "--hf-checkpoint", "examples/demo/model"]) == 0
    assert json.loads(capsys.readouterr().out)["args"]["wandb_key"] is None  # not given: nothing to hide


def test_credentials_from_a_custom_config_file_or_in_a_url_are_not_shown(tmp_path, capsys, caplog):
    """A --custom-config-path YAML's wandb_key, and keys that are no flag but name an API key (sglang_api_key), print
    and log as ***; so does the password of a URL (--wandb-host https://user:password@host)."""
    from furlong.core.cli.commands import main

    overlay = tmp_path / "cfg.yaml"
    overlay.write_text("wandb_key: Y1\nsglang_api_key: Y2\napi_key: Y3\n")
    with caplog.at_level("INFO"):
        assert main(["train", "--print-config", *BASE, "--hf-checkpoint", "examples/demo/model",
                     "--custom-config-path", str(overlay), "--wandb-host", "https://me:Y4@wandb.example"]) == 0
    out = capsys.readouterr().out
    shown = out + caplog.text
    assert not any(secret in shown for secret in ("Y1", "Y2", "Y3", "Y4")), shown
    args = json.loads(out)["args"]
    assert (args["wandb_key"], args["wandb_host"]) == ("***", "https://me:***@wandb.example")
    assert args["custom_config_extras"] == {"sglang_api_key": "***", "api_key": "***"}
    assert "--custom-config-path sets wandb_key = '***' (was None)." in caplog.text


def test_print_config_dict_is_json_serializable():
    args = parse_args(BASE + ["--sglang-enable-metrics", "--dynamic-sampling-filter", "check_reward_nonzero_std"])
    data = config_to_dict(args)
    assert json.loads(json.dumps(data)) == data
    assert data["explicit_args"] == ["dynamic_sampling_filter", "num_rollout", "rollout_batch_size"]
    assert data["sglang_passthrough"] == {"enable_metrics": True}


def test_disable_plugins_names_an_installed_plugin_or_is_an_error(monkeypatch):
    assert ("--disable-plugins megatorn: no installed plugin has that name (furlong plugins lists them). Did you mean "
            "'megatron'?") in error_of(BASE + ["--disable-plugins", "megatorn"]).splitlines()
    assert ("--disable-plugins furlong:no_such_plugin: distribution 'furlong' has no plugin 'no_such_plugin' "
            "(furlong plugins lists them).") in error_of(BASE + ["--disable-plugins", "furlong:no_such_plugin"]).splitlines()
    unknown_dist = error_of(BASE + ["--disable-plugins", "furlongg:megatron"]).splitlines()
    assert [line for line in unknown_dist if line.startswith("--disable-plugins furlongg:megatron: no installed "
            "distribution 'furlongg' offers furlong plugins (those that do: ") and line.endswith("Did you mean 'furlong'?")]
    assert parse_args(BASE + ["--disable-plugins", "megatron,furlong:tensorboard"]).disable_plugins == [
        "megatron", "furlong:tensorboard"]
    monkeypatch.setenv("FURLONG_DISABLE_PLUGINS", "tensorbaord")
    assert ("FURLONG_DISABLE_PLUGINS tensorbaord: no installed plugin has that name (furlong plugins lists them). "
            "Did you mean 'tensorboard'?") in error_of(BASE).splitlines()
