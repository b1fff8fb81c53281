"""Miles launch scripts parse unchanged: Megatron-LM's and Miles' flag tables, SGLang list flags,
one report of every problem, Megatron flags judged against the backend, Miles' own paths,
and the cheap Miles flags that work (epochs, env vars, chunked log-probs, dynamic batch,
engine health checks)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import subprocess
import sys
from argparse import Namespace

import pytest
import torch

from furlong.core.cli.commands import main
from furlong.core.config import ConfigError, build_parser, parse_args
from furlong.core.config._util import float_or_inf, port_number
from furlong.core.config.passthrough import split_passthrough
from furlong.core.config.tables import FlagRow, megatron_table, miles_table, sglang_table
from furlong.hooks import ConfigReport, MegatronFlags, PluginError

BASE = ["--num-rollout", "2", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--global-batch-size", "8"]
PASSED_THROUGH = ("--sglang-", "--router-", "--eval-sglang-")

pytestmark = pytest.mark.usefixtures("cpu_machine")  # the same defaults on every machine


@pytest.fixture(scope="module")
def pm():
    from furlong.core.plugins.manager import get_plugin_manager

    return get_plugin_manager()


@pytest.fixture(scope="module")
def parser(pm):
    return build_parser(pm)


# --- the tables ---------------------------------------------------------------------------------

def test_tables_record_where_they_come_from():
    assert megatron_table().header["repository"] == "radixark/Megatron-LM"
    assert len(megatron_table().header["commit"]) == 40 and megatron_table().header["megatron_core_version"]
    assert miles_table().header["repository"] == "radixark/miles" and len(miles_table().header["commit"]) == 40
    assert sglang_table().header["version"] == "0.5.16"
    assert len(megatron_table().rows) > 600 and len(miles_table().rows) > 350 and len(sglang_table().rows) > 400


def _values(row: FlagRow, action) -> list[str]:
    """Values for ``row``'s arity, valid for the action furlong defines."""
    if not row.takes_value:
        return []
    typed = {int: "2", float: "0.5", float_or_inf: "0.5", port_number: "8000"}
    one = str(next(iter(action.choices))) if action.choices else typed.get(action.type, "x")
    one = "{}" if getattr(action.type, "__name__", "") == "json_object" else one
    count = {"+": 2, "*": 2, "?": 1, None: 1}.get(row.nargs, row.nargs)
    return [one] * count


def _arity_mismatches(parser, rows) -> list[str]:
    """Each row given alone with its arity: what does not parse to that many values."""
    bad = []
    for row in rows:
        flag = row.flags[0]
        action = parser._option_string_actions[flag]
        values = _values(row, action)
        args, extras = parser.parse_known_args([flag, *values])
        got = getattr(args, action.dest)
        got = got[-1] if row.kind == "append" else got
        if extras:
            bad.append(f"{flag}: left {extras}")
        elif row.is_list and (not isinstance(got, list) or len(got) != len(values)):
            bad.append(f"{flag}: {len(values)} values gave {got!r}")
        elif not row.takes_value and got is isinstance(action, argparse._StoreFalseAction):
            bad.append(f"{flag}: switch gave {got!r}")
    return bad


def test_every_megatron_flag_parses_with_its_arity(parser):
    assert _arity_mismatches(parser, megatron_table().rows) == []


def test_every_miles_flag_parses_with_its_arity(parser):
    rows = [r for r in miles_table().rows if not r.flags[0].startswith(PASSED_THROUGH)]
    assert _arity_mismatches(parser, rows) == []


def test_megatron_flags_reach_the_backend_as_given():
    args = parse_args(BASE + ["--moe-router-topk", "2", "--no-rope-fusion", "--moe-layer-freq", "[0]+[1]*3",
                              "--hierarchical-context-parallel-sizes", "2", "4", "--moe-router-dtype", "fp32"])
    assert args.megatron_args == {"moe_router_topk": 2, "apply_rope_fusion": False, "moe_layer_freq": "[0]+[1]*3",
                                  "hierarchical_context_parallel_sizes": [2, 4], "moe_router_dtype": "fp32"}
    assert args.megatron_argv == ["--moe-router-topk", "2", "--no-rope-fusion", "--moe-layer-freq", "[0]+[1]*3",
                                  "--hierarchical-context-parallel-sizes", "2", "4", "--moe-router-dtype", "fp32"]
    assert not hasattr(parse_args(BASE), "moe_router_dtype")  # only given flags: Megatron's defaults are the table's


def test_every_list_valued_sglang_argument_takes_all_its_values():
    for row in sglang_table().rows:
        name = row.flags[0][2:]
        values = ["1", "2", "4"] if row.is_list else ["7"] if row.takes_value else []
        for prefix, attr in (("--sglang-", "sglang_passthrough"), ("--eval-sglang-", "eval_sglang_passthrough")):
            rest, collected, _ = split_passthrough([prefix + name, *values, "--lr", "1"], set())
            want = values if row.is_list else values[0] if values else True
            assert (rest, collected[attr][name.replace("-", "_")]) == (["--lr", "1"], want), row.flags[0]


def test_refused_miles_flags_are_all_named_at_once(parser):
    refused = [a for a in parser._actions if getattr(a, "miles_refused", False)]
    assert len(refused) > 100
    argv = []
    for action in refused:
        row = miles_table().by_option()[action.option_strings[0]]
        argv += [action.option_strings[0], *_values(row, action)]
    with pytest.raises(ConfigError) as err:
        parse_args(BASE + argv)
    assert err.value.problems == [f"{a.option_strings[0]} is not supported yet; remove it." for a in refused]


# --- one report -----------------------------------------------------------------------------------

def test_every_problem_is_in_one_report_exit_2_no_traceback(capsys):
    code = main(["train", "--rollout-batch-size", "4", "--apply-chat-template", "stray", "--frobnicate", "1",
                 "--lr", "abc", "--enable-mtp-training", "--rollout-temperature", "0",
                 "--sglang-cuda-graph-bs", "1", "2", "4"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines() == [
        "error: argument --lr: invalid float value: 'abc'.",
        "error: unexpected value 'stray': it follows no flag that takes a value.",
        "error: unrecognized argument --frobnicate.",
        "error: --enable-mtp-training is not supported yet; remove it.",
        "error: --hf-checkpoint is required: the Hugging Face model directory (config, tokenizer, weights).",
        "error: --num-rollout is required: give the number of rollout iterations to run (it used to default to 1000; "
        "--num-rollout 0 only evaluates).",
        "error: --rollout-temperature must be > 0, got 0 (greedy decoding is for evaluation only: --eval-temperature 0).",
    ]


def test_parse_rule_and_backend_problems_share_one_report(capsys, caplog):
    """A bad value and an unknown flag do not hide the rules, nor the rules the backend's problems;
    the batch rule about --n-samples-per-prompt (whose value was rejected) is not reported again."""
    with caplog.at_level("INFO", logger="furlong.config"):
        code = main(["train", "--hf-checkpoint", "examples/demo/model", "--num-rollout", "1", "--rollout-batch-size",
                     "4", "--n-samples-per-prompt", "abc", "--global-batch-size", "100", "--no-such-flag", "1",
                     "--lr", "-1", "--num-experts", "8", "--train-backend", "fsdp", "--print-config"])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and "Traceback" not in err
    assert lines[:3] == ["error: argument --n-samples-per-prompt: invalid int value: 'abc'.",
                         "error: unrecognized argument --no-such-flag.", "error: --lr must be at least 0, got -1."]
    assert len(lines) == 4 and "--num-experts (the model has no experts)" in lines[3]
    assert not [m for m in caplog.messages if "--n-samples-per-prompt" in m]  # no note about its default (grpo's)


@pytest.mark.parametrize("typed, suggested", [
    ("--rollout-batch-szie", "--rollout-batch-size?"),  # a typo: no remark about abbreviations
    ("--lora-rnak", "--lora-rank?"),
    ("--rollout-batch", "--rollout-batch-size? flags are never abbreviated"),  # the one flag it abbreviates
    ("--moe-router-kind", None),  # siblings differ by a word: no suggestion
    ("--sequence-paralel-size", None),
])
def test_did_you_mean_only_when_really_close(typed, suggested):
    with pytest.raises(ConfigError) as err:
        parse_args(BASE + [typed, "1"])
    hint = f" (did you mean {suggested})" if suggested else ""
    assert f"unrecognized argument {typed}{hint}." in err.value.problems


# --- Megatron flags against the backend ---------------------------------------------------------

def _megatron_report(tmp_path, argv, support, config=None):
    from furlong.core.config.megatron_support import report_megatron_flags

    hf = tmp_path / "hf"
    if config is not None:
        hf.mkdir(exist_ok=True)
        (hf / "config.json").write_text(json.dumps(config))
    args = parse_args(BASE + ["--hf-checkpoint", str(hf)] + argv)
    report = ConfigReport(plugin="b")
    report_megatron_flags(args, "b", Namespace(MEGATRON_FLAGS=support), report)
    return report.warnings, report.errors


DENSE = {"model_type": "llama", "num_hidden_layers": 2}
MOE_MLA = {"model_type": "deepseek_v3", "n_routed_experts": 8, "kv_lora_rank": 16}
FSDP_LIKE = MegatronFlags(honours=frozenset({"lora_rank"}), at_values={"attention_dropout": (0.0,)},
                          architecture_from_hf=True)
WARN = "--train-backend b ignores these Megatron flags, which do not change results with it: "
ERR = "--train-backend b does not support these Megatron flags yet, which would change the model or the math: "
TAIL = "; remove them."
SWITCHES = ["--qk-layernorm", "--add-qkv-bias", "--untie-embeddings-and-output-weights", "--group-query-attention"]
ABSENT = "these Megatron flags describe features the model of --hf-checkpoint {hf}/config.json does not have: "


@pytest.mark.parametrize("argv, support, config, warnings, errors", [
    (["--no-rope-fusion", "--moe-permute-fusion", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
     MegatronFlags(), None, [WARN + "--no-rope-fusion --moe-permute-fusion --tensor-model-parallel-size "
                             "--sequence-parallel."], []),
    (["--fp8-format", "e4m3", "--moe-aux-loss-coeff", "0.01", "--lora-rank", "8"], FSDP_LIKE, DENSE, [],
     [ERR + "--fp8-format --moe-aux-loss-coeff" + TAIL]),
    (["--moe-aux-loss-coeff", "0"], FSDP_LIKE, DENSE, [WARN + "--moe-aux-loss-coeff."], []),  # Megatron's default
    (["--attention-dropout", "0.0"], FSDP_LIKE, DENSE, [], []),  # honoured at that value
    (["--attention-dropout", "0.2"], FSDP_LIKE, DENSE, [], [ERR + "--attention-dropout" + TAIL]),
    (["--num-experts", "8", "--multi-latent-attention", "--num-layers", "2"], FSDP_LIKE, DENSE,
     [WARN + "--num-layers."],
     [ABSENT + "--num-experts (the model has no experts) --multi-latent-attention (the model has no multi-latent "
               "attention)" + TAIL]),
    (["--num-layers", "40", "--norm-epsilon", "1e-5", "--kv-channels", "16"], FSDP_LIKE,
     {**DENSE, "hidden_size": 64, "num_attention_heads": 4, "rms_norm_eps": 1e-6}, [WARN + "--kv-channels."],
     ["--num-layers 40 disagrees with --hf-checkpoint {hf}/config.json (num_hidden_layers = 2).",
      "--norm-epsilon 1e-05 disagrees with --hf-checkpoint {hf}/config.json (rms_norm_eps = 1e-06)."]),
    (["--num-experts", "8", "--multi-latent-attention", "--q-lora-rank", "4", "--moe-router-topk", "2"], FSDP_LIKE,
     MOE_MLA, [WARN + "--num-experts --multi-latent-attention --q-lora-rank --moe-router-topk."], []),
    # Miles' deepseek-v4-flash MODEL_ARGS: its attention is multi-latent with a low-rank query (no kv_lora_rank)
    (["--multi-latent-attention", "--q-lora-rank", "1024"], FSDP_LIKE,
     {"model_type": "deepseek_v4", "q_lora_rank": 1024, "n_routed_experts": 8},
     [WARN + "--multi-latent-attention --q-lora-rank."], []),
    (["--apply-layernorm-1p"], FSDP_LIKE, DENSE, [],
     [ABSENT + "--apply-layernorm-1p (its norms scale by weight, not 1 + weight)" + TAIL]),
    (["--apply-layernorm-1p"], FSDP_LIKE, {"model_type": "gemma2"}, [WARN + "--apply-layernorm-1p."], []),
    # Miles' Qwen3.5 MODEL_ARGS: Qwen3_5RMSNorm scales by 1 + weight (the text config's model_type counts)
    (["--apply-layernorm-1p"], FSDP_LIKE, {"model_type": "qwen3_5_moe", "text_config": {"model_type": "qwen3_5_moe_text"}},
     [WARN + "--apply-layernorm-1p."], []),
    (["--apply-layernorm-1p"], FSDP_LIKE, {"model_type": "gemma4", "text_config": {"model_type": "gemma4_text"}}, [],
     [ABSENT + "--apply-layernorm-1p (its norms scale by weight, not 1 + weight)" + TAIL]),  # Gemma4RMSNorm: weight
    (SWITCHES, FSDP_LIKE, {"model_type": "llama", "attention_bias": False, "tie_word_embeddings": True,
                           "num_attention_heads": 4, "num_key_value_heads": 4}, [],
     [ABSENT + "--qk-layernorm (model_type llama has no query/key norms) --add-qkv-bias (attention_bias is false) "
               "--untie-embeddings-and-output-weights (tie_word_embeddings is true) --group-query-attention "
               "(num_key_value_heads = num_attention_heads = 4)" + TAIL]),
    (SWITCHES, FSDP_LIKE, {"model_type": "qwen3", "attention_bias": True, "tie_word_embeddings": False,
                           "num_attention_heads": 8, "num_key_value_heads": 2}, [WARN + " ".join(SWITCHES) + "."], []),
    (SWITCHES, FSDP_LIKE, {"model_type": "olmo2"}, [WARN + " ".join(SWITCHES) + "."], []),  # the config does not say
    (["--num-experts", "8"], FSDP_LIKE, None,
     ["--train-backend b takes the model from the --hf-checkpoint config, which cannot be read here ({hf}); these "
      "Megatron architecture flags are not checked against it: --num-experts."], []),
    (["--fp8-format", "e4m3", "--multi-latent-attention", "--no-rope-fusion"], MegatronFlags(honours="all"), None,
     [], []),
    (["--fp8-format", "e4m3", "--no-rope-fusion"], MegatronFlags(honours="all", except_=frozenset({"fp8"})), None,
     [], [ERR + "--fp8-format" + TAIL]),
])
def test_megatron_flags_a_backend_cannot_honour_are_one_line_each(tmp_path, argv, support, config, warnings,
                                                                  errors):
    got = _megatron_report(tmp_path, argv, support, config)
    hf = tmp_path / "hf"
    assert got == ([w.format(hf=hf) for w in warnings], [e.format(hf=hf) for e in errors])


def test_checkpoint_and_exit_flags_the_core_implements_are_not_reported_as_doing_nothing(tmp_path):
    """--finetune, --save-retain-interval, --exit-interval, --exit-duration-in-mins change what a run loads, keeps
    and when it stops: the core honours them on every backend (tests/test_e2e_checkpoint_flags.py)."""
    argv = ["--load", str(tmp_path), "--finetune", "--save", str(tmp_path), "--save-interval", "2",
            "--save-retain-interval", "4", "--exit-interval", "3", "--exit-duration-in-mins", "230", "--ckpt-step", "3",
            "--exit-on-missing-checkpoint", "--no-rope-fusion"]
    assert _megatron_report(tmp_path, argv, MegatronFlags(), DENSE) == ([WARN + "--no-rope-fusion."], [])
    args = parse_args(BASE + argv)
    assert (args.finetune, args.save_retain_interval, args.exit_interval, args.exit_duration_in_mins) == (
        True, 4, 3, 230.0)


@pytest.mark.parametrize("argv, error", [
    (["--save", "S", "--save-interval", "4", "--save-retain-interval", "6"],
     "--save-retain-interval (6) must be a multiple of --save-interval (4), as Megatron-LM requires: give "
     "--save-retain-interval 4 (or drop it to keep every checkpoint)."),
    (["--save-retain-interval", "2"], "--save-retain-interval 2 has no effect without --save: give --save DIR or "
                                      "drop --save-retain-interval."),
    (["--exit-duration-in-mins", "0"], "--exit-duration-in-mins must be more than 0 minutes, got 0."),
    (["--exit-interval", "0"], "--exit-interval must be at least 1, got 0."),
    (["--exit-on-missing-checkpoint"], "--exit-on-missing-checkpoint has no effect without --load: give --load DIR "
                                       "or drop it."),
    (["--pretrained-checkpoint", "/ckpt/base"],
     "--pretrained-checkpoint /ckpt/base: Megatron-LM's weights to fine-tune from when --load holds no checkpoint; "
     "furlong starts such a run from --ref-load (a torch_dist or Hugging Face directory), else --hf-checkpoint: pass "
     "the directory as --ref-load (it is the KL reference too) and remove it."),
])
def test_checkpoint_and_exit_flag_errors(argv, error):
    with pytest.raises(ConfigError) as excinfo:
        parse_args(BASE + argv)
    assert error in str(excinfo.value).splitlines()


@pytest.mark.parametrize("rate, errors", [("0", []),
                                         ("0.01", [ERR.replace("b ", "fsdp ") + "--moe-router-bias-update-rate" + TAIL])])
def test_fsdp_takes_miles_frozen_expert_bias_as_what_it_does(tmp_path, rate, errors):
    """Miles' DeepSeek-V3, Kimi and GLM scripts give ``--moe-router-bias-update-rate 0``: transformers keeps
    the router's ``e_score_correction_bias`` as a buffer that no optimizer step updates, which is that rate."""
    from furlong.builtin_plugins.backends import fsdp
    from furlong.core.config.megatron_support import report_megatron_flags

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(MOE_MLA))
    args = parse_args(BASE + ["--hf-checkpoint", str(hf), "--moe-router-enable-expert-bias",
                              "--moe-router-bias-update-rate", rate])
    report = ConfigReport(plugin="fsdp")
    report_megatron_flags(args, "fsdp", fsdp, report)
    assert report.errors == errors
    assert report.warnings == [WARN.replace("b ", "fsdp ") + "--moe-router-enable-expert-bias."]


def test_fsdp_refuses_the_expert_bias_updates_megatron_would_make_by_default(tmp_path):
    """``--moe-router-enable-expert-bias`` alone means Megatron's default update rate, 1e-3: the bias would move
    after every step, which fsdp does not do."""
    from furlong.builtin_plugins.backends import fsdp

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(MOE_MLA))
    for extra, errors in (([], ["--moe-router-enable-expert-bias with Megatron's default --moe-router-bias-update-rate "
                                "0.001: updating the experts' routing bias after each step is not supported yet by "
                                "--train-backend fsdp (the checkpoint's bias stays fixed); pass "
                                "--moe-router-bias-update-rate 0 to train with it fixed."]),
                          (["--moe-router-bias-update-rate", "0"], [])):
        args = parse_args(BASE + ["--hf-checkpoint", str(hf), "--moe-router-enable-expert-bias", *extra])
        report = ConfigReport(plugin="fsdp")
        fsdp.configure(args=args, report=report)
        assert [e for e in report.errors if "expert" in e] == errors


def test_an_error_about_the_backend_the_machine_chose_says_so(capsys, caplog):
    """A Miles script (Miles' default backend is megatron) read where furlong's default is fsdp."""
    argv = ["train", *BASE, "--hf-checkpoint", "examples/demo/model", "--context-parallel-size", "2", "--print-config"]
    for given, noted in (([], True), (["--train-backend", "fsdp"], False)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="furlong.config"):
            assert main([*argv, *given]) == 2
        err = capsys.readouterr().err
        assert "--train-backend fsdp does not support --context-parallel-size 2; use 1 or --train-backend megatron." in err
        notes = [m for m in caplog.messages if m.startswith("--train-backend was not given")]
        assert notes == ([
            "--train-backend was not given, so it is fsdp, this machine's default (furlong plugin 'megatron' installed: "
            "True, CUDA: False, megatron.core importable: False); a GPU machine with megatron-core chooses megatron, as "
            "Miles does. Give --train-backend megatron to check the flags as that run will read them."] if noted else [])


def test_fsdp_checks_architecture_flags_against_the_config_and_megatron_does_not_call_them_ignored(capsys, caplog):
    """The demo model: 3 layers, vocabulary 26, hidden 128, rope_theta 10000, rms_norm_eps 1e-6."""
    wrong = ["--num-layers", "40", "--vocab-size", "999", "--hidden-size", "4096", "--rotary-base", "5",
             "--norm-epsilon", "1e-5", "--qk-layernorm"]
    for backend in ("fsdp", "megatron"):
        caplog.clear()
        with caplog.at_level("WARNING", logger="furlong.config"):
            code = main(["train", *BASE, "--hf-checkpoint", "examples/demo/model", "--train-backend", backend, *wrong,
                         "--print-config"])
        err = capsys.readouterr().err
        assert code == 2 and not [m for m in caplog.messages if "ignores these Megatron flags" in m], (backend, err)
        for flag, key, value in (("--num-layers 40", "num_hidden_layers", "3"), ("--vocab-size 999", "vocab_size", "26"),
                                 ("--hidden-size 4096", "hidden_size", "128"), ("--rotary-base 5", "rope_theta", "10000.0"),
                                 ("--norm-epsilon 1e-05", "rms_norm_eps", "1e-06")):
            assert f"{flag} disagrees with --hf-checkpoint examples/demo/model/config.json ({key} = {value})." in err
        assert [line for line in err.splitlines()
                if "--qk-layernorm" in line and "examples/demo/model/config.json" in line], (backend, err)


HF_MOE_MLA_SCRIPT = """
   --num-layers 2 --hidden-size 64 --num-attention-heads 4 --swiglu --normalization RMSNorm
   --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 32 --moe-shared-expert-intermediate-size 32
   --moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-bias-update-rate 0
   --moe-router-dtype fp32 --moe-layer-freq [0]+[1]*1 --moe-permute-fusion --moe-token-dispatcher-type alltoall
   --multi-latent-attention --q-lora-rank 16 --kv-lora-rank 16 --qk-head-dim 8 --qk-pos-emb-head-dim 8
   --v-head-dim 8 --rotary-scaling-factor 40 --mscale 1.0 --beta-fast 32 --beta-slow 1 --rope-type yarn
   --transformer-impl transformer_engine --no-rope-fusion --decoder-last-pipeline-num-layers 1
   --tensor-model-parallel-size 2 --expert-model-parallel-size 2 --sequence-parallel
   --lora-rank 8 --lora-alpha 16 --target-modules all-linear --megatron-to-hf-mode bridge
   --sglang-cuda-graph-bs 1 2 4 8 16 --sglang-mem-fraction-static 0.7 --sglang-enable-dp-attention
   --num-epoch 3 --log-probs-chunk-size 1024 --train-env-vars {"NCCL_DEBUG":"WARN"}
   --use-fault-tolerance --rollout-health-check-interval 10
   --dynamic-sampling-filter-path miles.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std
   --custom-rm-path miles.rollout.rm_hub.async_rm --rm-type deepscaler
"""


def test_a_miles_style_moe_mla_lora_script_prints_its_config(tmp_path, capsys, caplog):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(MOE_MLA))
    argv = ["train", "--hf-checkpoint", str(hf), "--prompt-data", "p.jsonl", "--rollout-batch-size", "4",
            "--n-samples-per-prompt", "2", "--global-batch-size", "8", "--actor-num-gpus-per-node", "4",
            *HF_MOE_MLA_SCRIPT.split(), "--print-config"]
    with caplog.at_level("WARNING", logger="furlong.config"):
        assert main(argv) == 0, capsys.readouterr().err
    data = json.loads(capsys.readouterr().out)
    config = data["args"]
    assert config["sglang_passthrough"] == {"cuda_graph_bs": ["1", "2", "4", "8", "16"], "mem_fraction_static": "0.7",
                                           "enable_dp_attention": True}
    assert config["megatron_args"]["q_lora_rank"] == 16 and config["megatron_args"]["moe_layer_freq"] == "[0]+[1]*1"
    assert (config["lora_rank"], config["num_epoch"], config["num_rollout"]) == (8, 3, None)
    assert config["train_env_vars"] == {"NCCL_DEBUG": "WARN"}
    assert data["plugins"]["filter"] == ["check_reward_nonzero_std"] and data["plugins"]["reward"] == "deepscaler"
    assert data["machine_defaults"]["data_parallel_size"]["on_cuda"] == "2 under megatron (world 4 / TP x PP x CP 2)"
    warned = [line for line in caplog.messages if "ignores these Megatron flags" in line]
    assert len(warned) == 1 and "--no-rope-fusion" in warned[0] and "--multi-latent-attention" in warned[0]


# --- Miles' own dotted paths -----------------------------------------------------------------------

PATH_FLAGS = {"filter": "--dynamic-sampling-filter-path", "reward": "--custom-rm-path",
              "buffer_pop": "--buffer-filter-path", "data_source": "--data-source-path",
              "generate": "--custom-generate-function-path", "rollout": "--rollout-function-path",
              "reward_post_process": "--custom-reward-post-process-path"}


def test_every_miles_path_resolves_to_its_built_in_plugin(pm, caplog):
    from furlong.core.plugins.miles_paths import CORE_DOES_IT, MILES_BUILTINS, RM_TYPE
    from furlong.core.plugins.selection import resolve_selection

    for path, (hook, plugin) in MILES_BUILTINS.items():
        with caplog.at_level("INFO", logger="furlong.config"):
            args = parse_args(BASE + [PATH_FLAGS[hook], path, "--rm-type", "math"])
            selection = resolve_selection(args, pm)
        if plugin == CORE_DOES_IT:
            assert hook not in selection.paths, path
            assert any(path in m and "furlong's core does this by itself" in m for m in caplog.messages), path
            caplog.clear()
            continue
        want = "math" if plugin == RM_TYPE else plugin
        got = {"filter": lambda: [n for n, _ in selection.filters], "reward": lambda: selection.reward[0]}.get(
            hook, lambda: selection.chosen[hook][0])()
        assert got == ([want] if hook == "filter" else want), path
        assert any(path in m and f"furlong's built-in plugin '{want}'" in m for m in caplog.messages), path
        caplog.clear()


@pytest.mark.parametrize("flag, path, message", [
    ("--rollout-function-path", "miles.rollout.agentic_rollout.generate_rollout",
     "--rollout-function-path 'miles.rollout.agentic_rollout.generate_rollout' names a function of Miles itself, "
     "which furlong does not import: choose one of furlong's built-in rollout plugins instead "
     "(fully_async, sft, sync)."),
    ("--custom-rm-path", "miles_plugins.rewards.judge.reward",
     "--custom-rm-path 'miles_plugins.rewards.judge.reward' names a function of Miles itself, which furlong does "
     "not import: choose one of furlong's built-in reward plugins instead (remote_rm, zero, the --rm-type reward)."),
    ("--data-source-path", "miles.rollout.data_source.StreamingDataSource",
     "--data-source-path 'miles.rollout.data_source.StreamingDataSource' names a function of Miles itself, which "
     "furlong does not import: choose one of furlong's built-in data_source plugins instead (jsonl)."),
])
def test_a_miles_path_furlong_does_not_map_names_the_built_ins_to_use(pm, flag, path, message):
    from furlong.core.plugins.selection import resolve_selection

    args = parse_args(BASE + [flag, path, "--rm-type", "math"])
    with pytest.raises(PluginError) as err:
        resolve_selection(args, pm)
    assert str(err.value) == message + (" docs/miles.md (\"Miles' own dotted paths\") lists the Miles paths furlong "
                                        "maps to its built-ins.")


# --- the cheap Miles flags ------------------------------------------------------------------------

def test_num_epoch_derives_num_rollout_from_the_loaded_data(tmp_path, arithmetic_jsonl, pm):
    from furlong.core.config.launch_args import launch_config
    from furlong.core.run.epochs import derive_num_rollout
    from furlong.core.rollout.side import RolloutSide
    from furlong.core.plugins.selection import resolve_selection

    config = launch_config("--num-epoch", "2", "--rollout-batch-size", "8", "--global-batch-size", "8",
                           "--prompt-data", str(arithmetic_jsonl), "--input-key", "prompt", "--label-key", "label",
                           "--rm-type", "math", pm=pm)  # a run names its reward before the data loads
    assert (config.num_rollout, config.lr_decay_iters) == (None, None)
    side = RolloutSide(config, resolve_selection(config, pm), pm)
    asyncio.run(side.load_data())
    size = asyncio.run(side.dataset_size())
    derived = derive_num_rollout(config, size, "jsonl")
    assert (size, derived.num_rollout_per_epoch, derived.num_rollout, derived.lr_decay_iters) == (60, 7, 14, 14)
    assert (config.num_rollout, config.num_rollout_per_epoch) == (None, None)  # a new config; this one is frozen
    given = launch_config(*BASE, "--num-epoch", "5", pm=pm)
    assert derive_num_rollout(given, 60, "jsonl") is given  # --num-rollout wins
    with pytest.raises(PluginError, match="less than one rollout"):
        derive_num_rollout(launch_config("--num-epoch", "1", "--rollout-batch-size", "80", pm=pm), 60, "jsonl")
    with pytest.raises(PluginError, match="has no len"):
        derive_num_rollout(launch_config("--num-epoch", "1", "--rollout-batch-size", "4", pm=pm), None, "custom")


def test_epoch_ends_are_save_and_eval_points_too():
    from furlong.core.run.checkpoints import periodic, should_save
    from furlong.core.run.epochs import derive_num_rollout
    from furlong.core.config.launch_args import launch_config

    assert [r for r in range(14) if periodic(r, 5, 14, epoch=7)] == [4, 6, 9, 13]
    assert [r for r in range(14) if periodic(r, 5, 14)] == [4, 9, 13]
    config = launch_config("--num-epoch", "2", save="/ckpt", save_interval=100, save_trigger_sentinel=None)
    config = derive_num_rollout(config, 7, "jsonl")  # 7 prompts, one a rollout: 2 epochs of 7 rollouts
    assert (config.num_rollout, config.num_rollout_per_epoch) == (14, 7)
    assert [r for r in range(14) if should_save(config, r)] == [6, 13]


def test_train_env_vars_are_set_in_the_train_worker_process(monkeypatch):
    from furlong.core.config.launch_args import launch_config
    from furlong.core.train.worker import WorkerFactory

    monkeypatch.delenv("FURLONG_TEST_ENV", raising=False)
    config = launch_config(*BASE, "--train-env-vars", '{"FURLONG_TEST_ENV": "on", "FURLONG_TEST_N": 3}')
    WorkerFactory(config, {"train_backend": ("fsdp", "--train-backend"), "loss": ("policy_loss", "--loss-type")})(0, 1)
    assert (os.environ.pop("FURLONG_TEST_ENV"), os.environ.pop("FURLONG_TEST_N")) == ("on", "3")


def test_chunked_log_probs_equal_one_pass():
    from furlong.builtin_plugins.backends.fsdp.logprobs import chunked_token_log_probs, token_log_probs

    logits, targets = torch.randn(11, 37), torch.randint(0, 37, (11,))
    whole = token_log_probs(logits, targets, 0.7)
    for chunk in (1, 3, 11, 64):
        parts = chunked_token_log_probs(logits, targets, 0.7, chunk_size=chunk)
        assert all(torch.equal(a, b) for a, b in zip(parts, whole)), chunk


@pytest.mark.parametrize("groups, dp, kept", [([4, 4], 2, 2), ([3, 3, 3], 2, 2), ([3, 3, 3], 3, 3), ([2, 1], 2, 1)])
def test_dynamic_global_batch_keeps_whole_groups_to_a_multiple_of_dp(groups, dp, kept):
    from furlong.core.train.batching import dynamic_global_batch

    assert dynamic_global_batch(groups, dp) == kept


def test_dynamic_global_batch_trains_one_step_per_rollout():
    from furlong.core.config.train_rules import steps_per_rollout

    args = parse_args(["--num-rollout", "3", "--rollout-batch-size", "4", "--global-batch-size", "2",
                       "--use-dynamic-global-batch-size"])
    assert (args.num_steps_per_rollout, steps_per_rollout(args), args.lr_decay_iters) == (2, 1, 3)


class FlakyEngine:
    """An engine whose ``health()`` answers from a script (False, or hangs) and that can be restarted."""

    def __init__(self, script):
        self.script, self.checks, self.recovered = list(script), 0, 0
        self.who = f"flaky engine {id(self)}"

    async def health(self):
        self.checks += 1
        answer = self.script.pop(0) if self.script else True
        if answer == "hang":
            await asyncio.sleep(10)
        return answer

    async def recover(self):
        self.recovered += 1


def test_health_monitor_restarts_engines_that_fail_or_hang(caplog):
    from furlong.core.rollout.engine_health import EngineHealthMonitor

    ok, down, hung = FlakyEngine([True, True]), FlakyEngine([False, True]), FlakyEngine(["hang", True])

    async def run():
        monitor = EngineHealthMonitor([ok, down, hung], interval=0.01, timeout=0.05, first_wait=0.0)
        monitor.start()
        while monitor.restarts < 2:
            await asyncio.sleep(0.01)
        monitor.pause()
        checks = ok.checks
        await asyncio.sleep(0.05)
        assert ok.checks == checks  # paused: no checks
        await monitor.stop()
        return monitor

    with caplog.at_level("WARNING", logger="furlong.engines"):
        monitor = asyncio.run(asyncio.wait_for(run(), 5))
    assert (ok.recovered, down.recovered, hung.recovered, monitor.restarts) == (0, 1, 1, 2)
    assert f"{down.who} failed its health check; restarting it." in caplog.messages


def test_an_engine_that_cannot_restart_is_reported_once_per_failure(caplog):
    from furlong.core.rollout.engine_health import EngineHealthMonitor

    class NoRestart:
        who = "an engine without recover()"

        def __init__(self, script):
            self.script = list(script)

        async def health(self):
            return self.script.pop(0)

    engine = NoRestart([False, False, True, False])
    monitor = EngineHealthMonitor([engine], interval=0.01, timeout=0.05, first_wait=0.0)
    monitor._running.set()
    with caplog.at_level("ERROR", logger="furlong.engines"):
        for _ in range(4):
            asyncio.run(monitor.check_all())
    assert caplog.messages == [f"{engine.who} failed its health check and cannot be restarted (its plugin has no "
                               "recover())."] * 2  # down, still down (not repeated), up, down again


def test_fault_tolerance_flags_are_checked():
    with pytest.raises(ConfigError) as err:
        parse_args(BASE + ["--use-fault-tolerance", "--ft-components", "rollout", "train",
                           "--rollout-health-check-timeout", "0"])
    assert err.value.problems == [
        "--ft-components train is not supported yet (train-worker fault tolerance); use rollout.",
        "--rollout-health-check-timeout must be > 0 seconds, got 0.",
    ]


def test_a_run_with_epochs_health_checks_and_a_dynamic_global_batch(tmp_path, tiny_model_dir):
    """``furlong train --num-epoch 2``: 12 prompts // 4 = 3 rollouts an epoch, saved and evaluated at each epoch's
    end; one optimizer step per rollout (8 samples, though --global-batch-size 4 would make two); the engine
    is health-checked all along; log-probs in chunks of 2 tokens."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "label": str(a + b)}) + "\n"
                            for a in range(4) for b in range(3)))
    save = tmp_path / "ckpt"
    command = [sys.executable, "-m", "furlong.core", "train", "--hf-checkpoint", str(tiny_model_dir),
               "--prompt-data", str(data), "--input-key", "prompt", "--label-key", "label", "--rm-type", "math",
               "--num-epoch", "2", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
               "--global-batch-size", "4", "--rollout-max-response-len", "4", "--lr", "1e-3",
               "--use-dynamic-global-batch-size", "--use-fault-tolerance", "--rollout-health-check-interval", "0.05",
               "--log-probs-chunk-size", "2", "--train-env-vars", '{"FURLONG_TEST_ENV": "1"}',
               "--save", str(save), "--save-interval", "100", "--eval-interval", "100",
               "--eval-prompt-data", "ev", str(data)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "--num-epoch 2 x (12 prompts // --rollout-batch-size 4): --num-rollout 6." in run.stderr
    assert sorted(p.name for p in save.glob("iter_*")) == ["iter_0000002", "iter_0000005"]
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/step"] for r in rows if "train/step" in r] == [0, 1, 2, 3, 4, 5]
    assert [r["eval/step"] for r in rows if "eval/step" in r] == [0, 2, 5]


# --- --sglang-* flags against SGLang's table -------------------------------------------------------

def test_misspelt_sglang_flags_warn_with_a_suggestion_and_pass_on(monkeypatch, caplog):
    argv = BASE + ["--sglang-mem-fractoin-static", "0.5", "--sglang-no-such-arg", "3", "--sglang-cuda-graph-bs", "1",
                   "2", "--router-anything", "1"]
    with caplog.at_level(logging.WARNING, logger="furlong.config"):
        args = parse_args(argv)
    version = sglang_table().header["version"]
    tail = ("; it is passed to the server as given (an SGLang that lacks it refuses to start); "
            "FURLONG_ALLOW_UNKNOWN_SGLANG_ARGS=1 silences this warning.")
    warned = [r.getMessage() for r in caplog.records if "SGLang" in r.getMessage()]
    assert warned == [f"--sglang-mem-fractoin-static is not an argument of SGLang {version} (did you mean "
                      f"--sglang-mem-fraction-static?)" + tail,
                      f"--sglang-no-such-arg is not an argument of SGLang {version}" + tail]
    assert args.sglang_passthrough == {"mem_fractoin_static": "0.5", "no_such_arg": "3", "cuda_graph_bs": ["1", "2"]}
    caplog.clear()
    monkeypatch.setenv("FURLONG_ALLOW_UNKNOWN_SGLANG_ARGS", "1")
    with caplog.at_level(logging.WARNING, logger="furlong.config"):
        args = parse_args(argv)
    assert [r for r in caplog.records if "SGLang" in r.getMessage()] == []
    assert args.sglang_passthrough == {"mem_fractoin_static": "0.5", "no_such_arg": "3", "cuda_graph_bs": ["1", "2"]}
