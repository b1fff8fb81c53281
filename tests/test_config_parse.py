"""Parsing the launch flags: abbreviations, unknown flags, --help groups, pass-through,
argument files, the --custom-config-path overlay and plugin-added flags."""

from __future__ import annotations

import base64
import logging

import pytest

from furlong.core.config import GROUP_TITLES, ConfigError, build_parser, parse_args
from furlong.hooks import PluginError, hookimpl

BASE = ["--num-rollout", "3", "--rollout-batch-size", "4"]


pytestmark = pytest.mark.usefixtures("cpu_machine")  # the same defaults on every machine


def error_of(argv, **kwargs) -> str:
    with pytest.raises(ConfigError) as excinfo:
        parse_args(argv, **kwargs)
    return str(excinfo.value)


# --- unknown and abbreviated flags --------------------------------------------------------

def test_abbreviated_flag_is_rejected():
    # alone: "--rollout-batch-size is required" would only repeat the hint
    assert error_of(["--num-rollout", "3", "--rollout-batch", "4"]) == (
        "unrecognized argument --rollout-batch (did you mean --rollout-batch-size? flags are never abbreviated).")


def test_a_misspelled_flag_hides_only_the_errors_about_the_flag_it_was_meant_to_be():
    lines = error_of(["--num-rollouts", "2"]).splitlines()
    assert lines[0] == "unrecognized argument --num-rollouts (did you mean --num-rollout?)."
    assert not any(line.startswith("--num-rollout is required") for line in lines)
    assert len(lines) == 2 and lines[1].startswith("--rollout-batch-size is required: give the prompts per rollout")


def test_unknown_flag_is_an_error_naming_it():
    assert error_of(BASE + ["--frobnicate", "7", "--zzz=1"]) == (
        "unrecognized argument --frobnicate.\nunrecognized argument --zzz.")


def test_stray_value_is_an_error():
    assert error_of(BASE + ["stray"]) == "unexpected value 'stray': it follows no flag that takes a value."


def test_bad_value_type_names_the_flag():
    assert error_of(["--num-rollout", "3", "--rollout-batch-size", "four"]) == (
        "argument --rollout-batch-size: invalid int value: 'four'.")


def test_bad_choice_names_the_flag():
    assert error_of(BASE + ["--kl-loss-type", "k9"]) == (
        "argument --kl-loss-type: invalid choice: 'k9' (choose from 'k1', 'k2', 'k3', 'low_var_kl').")


def test_bad_json_value_names_the_flag():
    assert error_of(BASE + ["--apply-chat-template-kwargs", "[1]"]) == (
        "argument --apply-chat-template-kwargs: expected a JSON object like '{\"k\": 1}', got '[1]'.")


def test_parser_basics():
    parser = build_parser()
    assert (parser.prog, parser.allow_abbrev, parser.fromfile_prefix_chars) == ("furlong train", False, "@")


def test_help_lists_the_groups_in_order():
    text = build_parser().format_help()
    positions = [text.index(f"\n{title}:\n") for title in GROUP_TITLES]
    assert positions == sorted(positions)
    assert GROUP_TITLES == ("cluster", "model and checkpoints", "rollout", "eval", "performance", "algorithm",
                            "optimizer", "SGLang and router", "logging", "debugging", "plugins", "Miles")


def test_selection_flags_take_any_plugin_name():
    args = parse_args(BASE + ["--advantage-estimator", "my_rloo", "--loss-type", "my_loss", "--rollout-backend",
                              "my_engine", "--agent-backend", "multi_turn"])
    assert (args.advantage_estimator, args.loss_type, args.rollout_backend, args.generate) == (
        "my_rloo", "my_loss", "my_engine", "multi_turn")


def test_dynamic_sampling_filter_takes_several_names_and_repeats():
    args = parse_args(BASE + ["--dynamic-sampling-filter", "a", "b", "--dynamic-sampling-filter", "c"])
    assert args.dynamic_sampling_filter == ["a", "b", "c"]


def test_disable_plugins_is_repeatable_and_comma_separated():
    args = parse_args(BASE + ["--disable-plugins", "grpo,furlong:gspo", "--disable-plugins", "math"])
    assert args.disable_plugins == ["grpo", "furlong:gspo", "math"]


def test_megatron_flags_given_lists_them_in_order():
    args = parse_args(BASE + ["--num-layers", "2", "--lr", "1e-5", "--tensor-model-parallel-size", "1",
                              "--attention-dropout=0.0", "--num-layers", "3"])
    assert args.megatron_flags_given == ["--num-layers", "--tensor-model-parallel-size", "--attention-dropout"]
    assert (args.num_layers, args.attention_dropout) == (3, 0.0)


def test_explicit_args_records_the_given_flags_only():
    args = parse_args(BASE + ["--no-offload-train", "--global-batch-size", "4", "--agent-backend", "x"])
    assert args.explicit_args == ["generate", "global_batch_size", "num_rollout", "offload_train",
                                  "rollout_batch_size"]


# --- pass-through -------------------------------------------------------------------------

def test_sglang_and_router_pass_through_forms(monkeypatch):
    monkeypatch.setenv("FURLONG_ALLOW_UNKNOWN_SGLANG_ARGS", "1")  # --sglang-enable-ep-moe left SGLang's table: no warning
    args = parse_args(BASE + [
        "--sglang-mem-fraction-static", "0.7",          # bare flag takes the next token
        "--sglang-enable-ep-moe",                        # not in the table, followed by a flag: a switch
        "--sglang-context-length=32768",                # = form
        "--sglang-random-seed", "-1",                    # a value starting with a single dash is a value
        "--router-balance-abs-threshold", "0",
        "--sglang-router-ip", "10.0.0.1",                # core flags, not pass-through
        "--sglang-server-concurrency", "64",
        "--sglang-enable-metrics",                       # last token: a switch
    ])
    assert args.sglang_passthrough == {"mem_fraction_static": "0.7", "enable_ep_moe": True,
                                       "context_length": "32768", "random_seed": "-1", "enable_metrics": True}
    assert args.router_passthrough == {"balance_abs_threshold": "0"}
    assert (args.sglang_router_ip, args.sglang_server_concurrency) == ("10.0.0.1", 64)


def test_pass_through_equals_form_keeps_a_value_starting_with_dashes():
    args = parse_args(BASE + ["--sglang-log-level=--quiet"])
    assert args.sglang_passthrough == {"log_level": "--quiet"}


# --- argument files -----------------------------------------------------------------------

def test_argument_file_with_comments_quotes_and_nesting(tmp_path):
    (tmp_path / "inner.args").write_text("--rollout-stop '</answer>' \"end here\"\n")
    (tmp_path / "run.args").write_text(
        "# rollout\n"
        "--num-rollout 3   # iterations\n"
        "\n"
        "--rollout-batch-size 4 --n-samples-per-prompt 2\n"
        "   # indented comment\n"
        f"@{tmp_path / 'inner.args'}\n"
        "--sglang-mem-fraction-static 0.5\n"
    )
    args = parse_args([f"@{tmp_path / 'run.args'}", "--n-samples-per-prompt", "4"])
    assert (args.num_rollout, args.rollout_batch_size, args.n_samples_per_prompt) == (3, 4, 4)
    assert args.rollout_stop == ["</answer>", "end here"]
    assert args.sglang_passthrough == {"mem_fraction_static": "0.5"}
    assert args.global_batch_size == 16


def test_missing_argument_file_is_an_error(tmp_path):
    missing = tmp_path / "nope.args"
    assert error_of([f"@{missing}"]) == f"argument file {missing}: cannot read it (No such file or directory)."


def test_an_unbalanced_quote_in_an_argument_file_names_file_and_line(tmp_path):
    path = tmp_path / "run.args"
    path.write_text("--num-rollout 3\n# the learning rate\n--rollout-batch-size 4\n\n--lr \"1e-4\n")
    assert error_of([f"@{path}"]) == (
        f'{path}, line 5: a quote is not closed (--lr "1e-4); close it, or escape a quote meant literally with a '
        "backslash.")


def test_a_backslash_at_a_line_s_end_in_an_argument_file_names_file_and_line(tmp_path):
    path = tmp_path / "run.args"
    path.write_text("--num-rollout 3 \\\n--rollout-batch-size 4\n")
    assert error_of([f"@{path}"]) == (
        f"{path}, line 1: the line ends with a backslash (--num-rollout 3 \\); each line is read alone: remove the "
        "backslash.")


def test_an_argument_file_that_reads_itself_is_an_error(tmp_path):
    path = tmp_path / "run.args"
    path.write_text(f"--num-rollout 3\n@{path}\n")
    assert error_of([f"@{path}"]) == (
        f"argument file {path}: it is read again from within itself (@{path}); remove that line.")


def test_an_argument_file_error_exits_2_without_a_traceback(tmp_path, run_furlong):
    (tmp_path / "file.args").write_text("--num-rollout 1\n--rollout-batch-size 2\n\n\n--lr \"1e-4\n")
    done = run_furlong("train", "@file.args")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        'error: file.args, line 5: a quote is not closed (--lr "1e-4); close it, or escape a quote meant literally '
        "with a backslash."]


@pytest.mark.parametrize("flag", ["--prometheus-port", "--sglang-router-port"])
def test_port_flags_take_a_tcp_port(flag):
    assert error_of(BASE + [flag, "70000"]) == f"argument {flag}: a TCP port is 1 to 65535, got 70000."
    assert getattr(parse_args(BASE + [flag, "65535"]), flag[2:].replace("-", "_")) == 65535


# --- --custom-config-path -------------------------------------------------------------------

def test_overlay_file_is_applied_and_validated_again(tmp_path, caplog):
    path = tmp_path / "over.yaml"
    path.write_text("global_batch_size: 2\nrollout-temperature: 0.5\nmy_extra_knob: [1, 2]\n")
    with caplog.at_level(logging.INFO, logger="furlong.config"):
        args = parse_args(BASE + ["--custom-config-path", str(path)])
    # 4 prompts x 1 sample = global batch 2 x S  ->  S = 2 (derived again after the overlay)
    assert (args.global_batch_size, args.num_steps_per_rollout, args.lr_decay_iters) == (2, 2, 6)
    assert (args.rollout_temperature, args.eval_temperature, args.my_extra_knob) == (0.5, 0.5, [1, 2])
    assert {"global_batch_size", "rollout_temperature", "my_extra_knob"} <= set(args.explicit_args)
    assert "--custom-config-path sets global_batch_size = 2 (was 4)." in caplog.messages
    assert ("--custom-config-path sets a key that is not a furlong flag, kept for the custom functions that read it: "
            "my_extra_knob = [1, 2].") in caplog.messages


MILES_MIS_OVERLAY = """use_tis: true
use_rs: true
tis_level: "token"
tis_mode: "truncate"
tis_lower_bound: 0.5
tis_upper_bound: 2.0
rs_lower_bound: null
rs_veto_threshold: 1.0e-4
tis_batch_normalize: true
"""


def test_overlay_keys_that_are_no_flag_reach_the_run_configuration(tmp_path):
    """Miles' run-qwen3-4b-mis.sh overlay (examples/infra_features/train_infer_mismatch_helper): its TIS/RS keys
    are for the custom TIS function, which reads them from the run configuration (a traceback before)."""
    from furlong.core.config.launch_args import launch_config

    path = tmp_path / "mis.yaml"
    path.write_text(MILES_MIS_OVERLAY)
    config = launch_config(*BASE, "--hf-checkpoint", "examples/demo/model", "--custom-config-path", str(path))
    assert dict(config.custom_config_extras) == {"use_rs": True, "tis_level": "token", "tis_mode": "truncate",
                                                 "tis_lower_bound": 0.5, "tis_upper_bound": 2.0,
                                                 "rs_lower_bound": None, "rs_veto_threshold": 1e-4,
                                                 "tis_batch_normalize": True}
    assert config.use_tis is True  # a flag: set as the flag, not kept aside
    namespace = config.namespace()
    assert (namespace.tis_mode, namespace.tis_upper_bound, namespace.rs_veto_threshold) == ("truncate", 2.0, 1e-4)
    assert launch_config(*BASE, "--hf-checkpoint", "examples/demo/model").custom_config_extras == {}


def test_overlay_key_that_looks_like_a_typo_gets_a_warning(tmp_path, caplog):
    path = tmp_path / "over.yaml"
    path.write_text("rollout_bach_size: 4\n")
    with caplog.at_level(logging.WARNING, logger="furlong.config"):
        parse_args(BASE + ["--custom-config-path", str(path)])
    assert caplog.messages == ["--custom-config-path sets a key that is not a furlong flag, kept for the custom "
                               "functions that read it: rollout_bach_size = 4 (did you mean rollout_batch_size?)."]


def test_overlay_keys_that_are_no_flag_are_one_warning_suggesting_only_near_identical_flags(tmp_path, caplog):
    """Miles' TIS/RS keys got a warning each, with suggestions the command line would never make (tis_mode: did you
    mean train_mode?); the overlay uses the command line's suggestion, so only the typo gets one."""
    path = tmp_path / "mis.yaml"
    path.write_text(MILES_MIS_OVERLAY + "rollout_bach_size: 4\n")
    with caplog.at_level(logging.WARNING, logger="furlong.config"):
        parse_args(BASE + ["--custom-config-path", str(path)])
    assert caplog.messages == [
        "--custom-config-path sets 9 keys that are not furlong flags, kept for the custom functions that read them: "
        "use_rs = True, tis_level = 'token', tis_mode = 'truncate', tis_lower_bound = 0.5, tis_upper_bound = 2.0, "
        "rs_lower_bound = None, rs_veto_threshold = 0.0001, tis_batch_normalize = True, rollout_bach_size = 4 "
        "(did you mean rollout_batch_size?)."]


def test_overlay_base64(tmp_path):
    text = base64.b64encode(b"eps_clip: 0.3\n").decode()
    args = parse_args(BASE + ["--custom-config-path", f"base64:{text}"])
    assert (args.eps_clip, args.eps_clip_high) == (0.3, 0.3)


def test_overlay_that_breaks_a_rule_is_an_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("rollout_temperature: 0\nglobal_batch_size: 3\n")
    assert error_of(BASE + ["--custom-config-path", str(path)]) == (
        "after --custom-config-path: --rollout-temperature must be > 0, got 0 (greedy decoding is for evaluation "
        "only: --eval-temperature 0).\n"
        "after --custom-config-path: --rollout-batch-size (4) x --n-samples-per-prompt (1) = --global-batch-size (3) "
        "x --num-steps-per-rollout (?) has no whole solution with --num-steps-per-rollout >= 1: "
        "num_steps_per_rollout = 4 samples per rollout / 3 samples per step = 1.333.")


def test_overlay_wins_on_derived_attributes(tmp_path):
    path = tmp_path / "over.yaml"
    path.write_text("sglang_tp_size: 4\n")
    assert parse_args(BASE + ["--custom-config-path", str(path)]).sglang_tp_size == 4


@pytest.mark.parametrize("content, message", [
    ("- a\n- b\n", "--custom-config-path {path}: expected a YAML mapping of flag names to values, got list."),
    ("a: [1\n", None),
])
def test_overlay_must_be_a_yaml_mapping(tmp_path, content, message):
    path = tmp_path / "over.yaml"
    path.write_text(content)
    got = error_of(BASE + ["--custom-config-path", str(path)])
    if message:
        assert got == message.format(path=path)
    else:
        assert got.startswith(f"--custom-config-path {path}: not valid YAML: ")


def test_overlay_file_missing(tmp_path):
    path = tmp_path / "absent.yaml"
    assert error_of(BASE + ["--custom-config-path", str(path)]) == (
        f"--custom-config-path {path}: cannot read the file (No such file or directory).")


# --- plugin flags ---------------------------------------------------------------------------

class FlagPlugin:
    """An in-process plugin whose add_arguments adds ``flags``."""

    def __init__(self, *flags: str):
        self.flags = flags

    @hookimpl
    def add_arguments(self, parser):
        group = parser.add_argument_group(type(self).__name__)
        for flag in self.flags:
            group.add_argument(flag, type=int, default=7)


def test_built_in_plugins_add_their_flags(plugin_manager):
    args = parse_args(BASE + ["--embedded-max-batch-size", "3"], plugin_manager)
    assert args.embedded_max_batch_size == 3


def test_plugin_flag_is_parsed(plugin_manager, register_plugin):
    register_plugin(FlagPlugin("--alpha-width"), "alpha")
    assert parse_args(BASE + ["--alpha-width", "3"], plugin_manager).alpha_width == 3
    assert parse_args(BASE, plugin_manager).alpha_width == 7


class FlagReward(FlagPlugin):
    """A reward plugin whose add_arguments adds ``flags``."""

    @hookimpl
    def reward(self, samples):
        return [1.0 for _ in samples]


def test_a_plugin_adding_another_plugin_s_flag_is_set_aside_whole(plugin_manager, register_plugin):
    register_plugin(FlagPlugin("--shared-width"), "alpha")
    register_plugin(FlagReward("--beta-depth", "--shared-width"), "beta")
    parser = build_parser(plugin_manager)
    assert "--beta-depth" not in parser._option_string_actions  # nothing half-added
    assert plugin_manager.get_plugin("beta") is None
    assert plugin_manager.broken["beta"][1] == (
        "`add_arguments` adds the flag --shared-width, which plugin 'alpha' already adds; a flag may be added by one "
        "plugin only: uninstall one of them or skip one with --disable-plugins NAME.")
    assert parse_args(BASE + ["--shared-width", "3"], plugin_manager).shared_width == 3


def test_a_plugin_redefining_a_core_flag_breaks_only_runs_that_choose_it(plugin_manager, register_plugin):
    register_plugin(FlagReward("--clash-depth", "--lr"), "clash")
    args = parse_args(BASE, plugin_manager)  # a run that does not choose it
    assert args.lr == 1e-6 and not hasattr(args, "clash_depth")
    with pytest.raises(PluginError) as excinfo:
        plugin_manager.chosen_impl("reward", "clash", "--rm-type")
    assert str(excinfo.value) == (
        "--rm-type 'clash': plugin 'clash' is broken: it was set aside: `add_arguments` adds the flag --lr, which "
        "furlong core already defines; a plugin adds only new flags, prefixed with its name (--clash-...).")


def test_a_plugin_whose_add_arguments_fails_is_set_aside(plugin_manager, register_plugin):
    class Broken:
        @hookimpl
        def add_arguments(self, parser):
            raise RuntimeError("boom")

    register_plugin(Broken(), "broken_flags")
    build_parser(plugin_manager)  # other plugins' runs go on
    assert plugin_manager.broken["broken_flags"][1] == "failed in `add_arguments`: RuntimeError: boom"
    with pytest.raises(PluginError) as excinfo:
        plugin_manager.chosen_impl("add_arguments", "broken_flags", "--rm-type")
    assert str(excinfo.value) == ("--rm-type 'broken_flags': plugin 'broken_flags' is broken: it was set aside: "
                                  "failed in `add_arguments`: RuntimeError: boom")


def test_an_async_add_arguments_is_set_aside(plugin_manager, register_plugin):
    class Async:
        @hookimpl
        async def add_arguments(self, parser):
            parser.add_argument("--async-width")

    register_plugin(Async(), "async_flags")
    assert "--async-width" not in build_parser(plugin_manager)._option_string_actions
    assert plugin_manager.broken["async_flags"][1] == ("`add_arguments` may not be async def; set-up hooks run before "
                                                       "the event loop starts (make it a plain def).")


def test_overlay_text_values_of_typed_flags_are_converted(tmp_path):
    path = tmp_path / "over.yaml"
    path.write_text("lr: 1e-5\n")  # YAML 1.1 reads 1e-5 (no dot) as text
    assert parse_args(BASE + ["--custom-config-path", str(path)]).lr == 1e-5


def test_overlay_value_of_the_wrong_type_is_an_error(tmp_path):
    path = tmp_path / "over.yaml"
    path.write_text("rollout_batch_size: many\n")
    assert error_of(BASE + ["--custom-config-path", str(path)]) == (
        "--custom-config-path: rollout_batch_size: cannot read 'many' (invalid literal for int() with base 10: "
        "'many').")


def test_negative_values_in_scientific_notation_are_values_not_flags():
    assert error_of(BASE + ["--lr", "-1e-4"]) == "--lr must be at least 0, got -0.0001."
    assert parse_args(BASE + ["--entropy-coef", "-1e-3"]).entropy_coef == -1e-3
