"""The ``configure`` hook: chosen plugins derive and check their own flags after the core
validated them and resolved the selection, before any model loads; and the built-in
plugins' rules that moved out of core/config (whole messages compared)."""

from __future__ import annotations

import asyncio

import json
import logging
from importlib.metadata import version

import pytest

from furlong.core.cli.commands import main
from furlong.core.config import ConfigError, parse_args
from furlong.core.config.configure import configure_plugins
from furlong.core.plugins.selection import resolve_selection
from furlong.hooks import ConfigReport, PluginError, hookimpl

BASE = ["--num-rollout", "3", "--rollout-batch-size", "4"]
FURLONG = f"furlong {version('furlong')}"  # how built-in plugins are named in messages


pytestmark = pytest.mark.usefixtures("cpu_machine")  # the same defaults on every machine


@pytest.fixture
def resolve(plugin_manager):
    """``resolve(argv, command=None) -> (args, Configured)``: parse, select, configure, as ``furlong train``."""

    def run(argv, command=None):
        args = parse_args(argv, plugin_manager, command=command)
        selection = resolve_selection(args, plugin_manager)
        return args, configure_plugins(args, plugin_manager, selection)

    return run


@pytest.fixture
def error_of(resolve):
    def run(argv, command=None) -> str:
        with pytest.raises(PluginError) as excinfo:
            resolve(argv, command)
        return str(excinfo.value)

    return run


def derived_by(configured, plugin: str) -> dict:
    """The values ``plugin``'s configure derived (other chosen plugins may derive their own)."""
    return {k: v["value"] for k, v in configured.derived.items() if v["plugin"] == plugin}


class CriticBackend:
    """Stands in for a third-party train backend that can build a critic (never built here)."""

    @hookimpl
    def train_backend(self, args):
        raise AssertionError("no model loads while configuring")

    @hookimpl
    def critic_backend(self, config):
        raise AssertionError("no model loads while configuring")


class ActorOnlyBackend:
    """A third-party train backend without a critic."""

    @hookimpl
    def train_backend(self, args):
        raise AssertionError("no model loads while configuring")


@pytest.fixture
def critic_backend(register_plugin):
    register_plugin(CriticBackend(), "critic_backend")
    register_plugin(ActorOnlyBackend(), "actor_only")


# --- the hook contract ------------------------------------------------------------------


def _recording(calls: list, hooks: tuple[str, ...], body=None):
    """A plugin implementing ``hooks`` (never called here) and ``configure``, which records its call."""

    def configure(self, args, report):
        calls.append((report.plugin, report.flags))
        if body:
            body(args, report)

    def unused(self, args):
        raise AssertionError("only configure runs here")

    namespace = {hook: hookimpl(_renamed(unused, hook)) for hook in hooks}
    namespace["configure"] = hookimpl(configure)
    return type("Recording", (), namespace)()


def _renamed(function, name):
    def wrapper(self, args):
        return function(self, args)

    wrapper.__name__ = name
    return wrapper


def test_hook_configure_runs_once_per_chosen_plugin_in_a_fixed_order(resolve, register_plugin):
    calls: list = []
    register_plugin(_recording(calls, ("advantage",)), "c_adv")
    register_plugin(_recording(calls, ("loss", "reward")), "c_both")  # also the run-wide reward
    register_plugin(_recording(calls, ("filter",)), "c_f1")
    register_plugin(_recording(calls, ("filter",)), "c_f2")
    register_plugin(_recording(calls, ("advantage",)), "c_unused")
    resolve(BASE + ["--advantage-estimator", "c_adv", "--loss-type", "c_both", "--rm-type", "c_both",
                    "--dynamic-sampling-filter", "c_f2", "c_f1"])
    assert calls == [
        ("c_adv", ("--advantage-estimator",)),
        ("c_both", ("--loss-type", "--rm-type")),
        ("c_f2", ("--dynamic-sampling-filter",)),
        ("c_f1", ("--dynamic-sampling-filter",)),
    ]


def test_hook_configure_derives_defaults_only_for_flags_not_given(resolve, register_plugin):
    def body(args, report):
        report.default(args, "eps_clip_c", 3.0)
        report.default(args, "tis_clip", 5.0)

    register_plugin(_recording([], ("advantage",), body), "c_adv")
    args, configured = resolve(BASE + ["--advantage-estimator", "c_adv", "--tis-clip", "1.5"])
    assert (args.eps_clip_c, args.tis_clip) == (3.0, 1.5)
    assert configured.derived["eps_clip_c"] == {"value": 3.0, "plugin": "c_adv"}
    assert derived_by(configured, "c_adv") == {"eps_clip_c": 3.0}


def test_hook_configure_errors_of_every_plugin_are_reported_together(error_of, register_plugin):
    def two_errors(args, report):
        report.error("--advantage-estimator c_adv needs --use-tis.")
        report.error("--advantage-estimator c_adv needs --gamma 1.")

    def raises_plugin_error(args, report):
        raise PluginError("--loss-type c_loss needs --calculate-per-token-loss.")

    def crashes(args, report):
        return {}["missing"]

    register_plugin(_recording([], ("advantage",), two_errors), "c_adv")
    register_plugin(_recording([], ("loss",), raises_plugin_error), "c_loss")
    register_plugin(_recording([], ("filter",), crashes), "c_filter")
    message = error_of(BASE + ["--advantage-estimator", "c_adv", "--loss-type", "c_loss",
                               "--dynamic-sampling-filter", "c_filter"])
    assert message == (
        "--advantage-estimator c_adv needs --use-tis.\n"
        "--advantage-estimator c_adv needs --gamma 1.\n"
        "--loss-type c_loss needs --calculate-per-token-loss.\n"
        "plugin 'c_filter' (registered in-process) failed in `configure`: KeyError: 'missing'"
    )


def test_hook_configure_errors_are_a_config_error_and_the_cli_exits_2(plugin_dist, run_furlong):
    dist = plugin_dist("furlong-strict", "furlong_strict", """
        from furlong.hooks import hookimpl

        @hookimpl
        def advantage(args, batch):
            return None

        @hookimpl
        def configure(args, report):
            report.error(f"--advantage-estimator {report.plugin} needs --normalize-advantages.")
    """, {"strict": "furlong_strict"})
    proc = run_furlong("train", *BASE, "--advantage-estimator", "strict", "--hf-checkpoint", "/nonexistent",
                       "--prompt-data", "/nonexistent.jsonl", sites=[dist.site])
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1] == "error: --advantage-estimator strict needs --normalize-advantages."


def test_a_stopped_run_prints_its_errors_without_notes(run_furlong):
    # notes on derived values (--save-interval's default, grpo's one-sample groups) would only bury the error;
    # --save makes the core note its --save-interval default when the run goes on
    proc = run_furlong("train", "--num-rollout", "1", "--save", "/tmp/unused-save-dir", "--rollout-temprature", "1",
                       "--hf-checkpoint", "/nonexistent", "--prompt-data", "/nonexistent.jsonl")
    assert proc.returncode == 2
    assert "INFO" not in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[0] == ("error: unrecognized argument --rollout-temprature (did you mean "
                                           "--rollout-temperature?).")


def test_hook_configure_changing_a_given_flag_is_an_error_and_is_undone(resolve, register_plugin):
    def overrides(args, report):
        args.eps_clip = 0.5

    register_plugin(_recording([], ("advantage",), overrides), "c_adv")
    with pytest.raises(ConfigError) as excinfo:
        resolve(BASE + ["--advantage-estimator", "c_adv", "--eps-clip", "0.1"])
    assert str(excinfo.value) == (
        "plugin 'c_adv' (registered in-process) changed --eps-clip in `configure` from 0.1 to 0.5, but that flag "
        "was given; `configure` sets only flags that were not given (args.explicit_args).")


def test_hook_configure_warnings_and_notes_go_to_the_config_logger(resolve, register_plugin, caplog):
    def notes(args, report):
        report.warn("--advantage-estimator c_adv ignores --gamma.")
        report.info("c_adv: baseline weight 1.")

    register_plugin(_recording([], ("advantage",), notes), "c_adv")
    with caplog.at_level(logging.INFO, logger="furlong.config"):
        resolve(BASE + ["--advantage-estimator", "c_adv"])
    logged = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "furlong.config"]
    assert ("WARNING", "--advantage-estimator c_adv ignores --gamma.") in logged
    assert ("INFO", "c_adv: baseline weight 1.") in logged


class FlaggedGenerate:
    """A third-party generate plugin with a flag of its own."""

    @hookimpl
    def add_arguments(self, parser):
        parser.add_argument_group("flagged").add_argument("--flagged-turns", type=int, default=2)

    @hookimpl
    def generate(self, args, sample, sampling_params, engine, evaluation):
        raise AssertionError("nothing generates while configuring")


class FlaggedReward:
    @hookimpl
    def add_arguments(self, parser):
        parser.add_argument_group("flagged_rm").add_argument("--flagged-rm-bonus", type=float, default=0.0)

    @hookimpl
    def reward(self, args, samples):
        return [0.0 for _ in samples]


class FlaggedObserver:
    @hookimpl
    def add_arguments(self, parser):
        parser.add_argument_group("flagged_log").add_argument("--flagged-log-every", type=int, default=1)

    @hookimpl
    def on_rollout_end(self, args, rollout_id, metrics):
        pass


def test_a_flag_of_a_plugin_the_run_does_not_choose_is_an_error(resolve, error_of, register_plugin):
    register_plugin(FlaggedGenerate(), "flagged")
    assert error_of(BASE + ["--flagged-turns", "3"]) == (
        "--flagged-turns is a flag of plugin 'flagged' (registered in-process), which this run does not use: "
        "choose the plugin (--generate flagged) or leave --flagged-turns out.")
    args, _ = resolve(BASE + ["--generate", "flagged", "--flagged-turns", "3"])
    assert (args.flagged_turns, args.plugin_flags_given) == (3, {"--flagged-turns": "flagged"})
    args, _ = resolve(BASE)  # not given: nothing to say
    assert (args.flagged_turns, args.plugin_flags_given) == (2, {})


def test_a_plugin_run_by_a_chosen_one_has_its_flags_read(resolve, error_of, register_plugin):
    def runs_flagged(args, report):
        report.use_plugin("flagged")

    register_plugin(FlaggedGenerate(), "flagged")
    register_plugin(_recording([], ("advantage",), runs_flagged), "c_adv")
    args, _ = resolve(BASE + ["--advantage-estimator", "c_adv", "--flagged-turns", "4"])
    assert args.flagged_turns == 4
    # the built-in case: --sglang-server-impl furlong starts `furlong serve`, which runs the embedded engine
    args, _ = resolve(BASE + ["--rollout-backend", "sglang", "--sglang-server-impl", "furlong", "--executor", "local",
                              "--embedded-max-batch-size", "8"])
    assert args.embedded_max_batch_size == 8
    # under SGLang's own servers the sglang plugin's error says it, once
    assert error_of(BASE + ["--rollout-backend", "sglang", "--rollout-external", "--rollout-external-engine-addrs",
                            "127.0.0.1:1", "--embedded-max-batch-size", "8"]).count("--embedded-max-batch-size") == 1


def test_a_built_in_plugin_s_flag_is_refused_when_its_plugin_is_not_chosen(error_of):
    assert error_of(BASE + ["--ray-call-timeout", "30", "--sglang-server-restarts", "2"]) == (
        f"--ray-call-timeout is a flag of plugin 'ray' ({FURLONG}), which this run does not use: choose the "
        "plugin (--executor ray) or leave --ray-call-timeout out.\n"
        f"--sglang-server-restarts is a flag of plugin 'sglang' ({FURLONG}), which this run does not use: "
        "choose the plugin (--rollout-backend sglang) or leave --sglang-server-restarts out.")


def test_a_reward_plugin_s_flag_only_warns_as_samples_may_choose_the_plugin(resolve, register_plugin, caplog):
    register_plugin(FlaggedReward(), "flagged_rm")
    with caplog.at_level(logging.WARNING, logger="furlong.config"):
        args, _ = resolve(BASE + ["--rm-type", "math", "--flagged-rm-bonus", "0.5"])
    assert args.flagged_rm_bonus == 0.5
    assert [r.getMessage() for r in caplog.records if r.name == "furlong.config"] == [
        "--flagged-rm-bonus is a flag of reward plugin 'flagged_rm' (registered in-process), which no flag chooses "
        "(the run's reward is math): it takes effect only for samples whose metadata['rm_type'] is 'flagged_rm'."]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="furlong.config"):
        resolve(BASE + ["--rm-type", "boxed_flagged_rm", "--flagged-rm-bonus", "0.5"])  # its boxed form uses it
    assert not [r for r in caplog.records if r.name == "furlong.config"]


def test_an_observer_plugin_s_flags_are_always_used(resolve, register_plugin):
    register_plugin(FlaggedObserver(), "flagged_log")
    args, _ = resolve(BASE + ["--flagged-log-every", "5"])
    assert args.flagged_log_every == 5


def test_the_cli_refuses_an_unchosen_plugin_s_flag_with_exit_2(run_furlong, tiny_model_dir):
    proc = run_furlong("train", *BASE, "--hf-checkpoint", str(tiny_model_dir), "--prompt-data", "/nonexistent.jsonl",
                       "--ray-engine-restarts", "1")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        f"error: --ray-engine-restarts is a flag of plugin 'ray' ({FURLONG}), which this run does not use: "
        "choose the plugin (--executor ray) or leave --ray-engine-restarts out.")


def test_hook_configure_async_def_still_runs_with_a_deprecation_warning(resolve, register_plugin):
    """``configure`` is a set-up hook, a plain function; the old ``async def`` form runs (no event loop is running
    yet) and warns, until the next minor version."""
    class AsyncConfigure:
        @hookimpl
        def advantage(self, config, batch):
            return None

        @hookimpl
        async def configure(self, args, report):
            report.default(args, "gamma", 0.5)

    register_plugin(AsyncConfigure(), "c_async")
    with pytest.warns(DeprecationWarning, match="plugin 'c_async': `async def configure` is the old form of the hook; make it a plain def"):
        args, configured = resolve(BASE + ["--advantage-estimator", "c_async"])
    assert args.gamma == 0.5 and derived_by(configured, "c_async") == {"gamma": 0.5}


def test_an_async_set_up_hook_is_refused_inside_a_running_loop(plugin_manager, register_plugin):
    class AsyncConfigure:
        @hookimpl
        async def configure(self, args, report):
            pass

    register_plugin(AsyncConfigure(), "c_async_in_loop")

    async def inside():
        plugin_manager.call_setup("configure", "c_async_in_loop", args=None, report=None)

    with pytest.raises(PluginError, match="`configure` may not be async def; set-up hooks run before the event loop"):
        asyncio.run(inside())


def test_config_report_default_and_given():
    from argparse import Namespace

    args = Namespace(gamma=1.0, lambd=1.0, explicit_args=["lambd"])
    report = ConfigReport(plugin="p")
    assert (report.default(args, "gamma", 0.9), report.default(args, "lambd", 0.9)) == (0.9, 1.0)
    assert (report.given(args, "gamma"), report.given(args, "lambd")) == (False, True)


def test_print_config_shows_plugin_and_machine_defaults(capsys):
    assert main(["train", *BASE, "--advantage-estimator", "gspo", "--attn-implementation", "eager",
                 "--print-config"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["args"]["policy_ratio_level"] == "sequence"
    assert {k: v for k, v in data["plugin_defaults"].items() if v["plugin"] == "gspo"} == {
        "policy_ratio_level": {"value": "sequence", "plugin": "gspo"},
        "disable_grpo_std_normalization": {"value": True, "plugin": "gspo"},  # one sample per prompt
    }
    gpus = "torch.cuda.device_count()"
    assert data["machine_defaults"] == {
        "actor_num_gpus_per_node": {"value": 1, "probe": "no CUDA device: 1", "on_cuda": gpus},
        "num_gpus_per_node": {"value": 1, "probe": "no CUDA device: 1", "on_cuda": gpus},
        "bf16": {"value": False, "probe": "torch.cuda.is_available() = False", "on_cuda": True},
        "distributed_backend": {"value": "gloo", "probe": "torch.cuda.is_available() = False", "on_cuda": "nccl"},
        "rollout_backend": {"value": "embedded", "probe": "furlong plugin 'sglang' installed: True, CUDA: False, "
                                                          "sglang package importable: False",
                            "on_cuda": "sglang (with the furlong sglang plugin and the sglang package)"},
        "train_backend": {"value": "fsdp", "probe": "furlong plugin 'megatron' installed: True, CUDA: False, "
                                                    "megatron.core importable: False",
                          "on_cuda": "megatron (with the furlong megatron plugin and megatron-core)"},
        "data_parallel_size": {"value": 1, "probe": "--train-backend fsdp: the world size (1 = actor_num_nodes x "
                                                    "actor_num_gpus_per_node)"},
        "executor": {"value": "local", "probe": "one train rank"},
    }
    assert data["machine_note"].startswith("These values depend on this machine, which has no CUDA; ")
    assert "train_backend fsdp (on CUDA: megatron (with the furlong megatron plugin and megatron-core))" in \
        data["machine_note"]


def test_print_config_s_attention_note_names_no_backend(capsys):
    """Under --train-backend megatron the note said what the fsdp backend's configure does; it is neutral now."""
    for backend in ("megatron", "fsdp"):
        assert main(["train", *BASE, "--train-backend", backend, "--print-config"]) == 0
        note = json.loads(capsys.readouterr().out)["machine_defaults"]["attn_implementation"]["on_cuda"]
        assert note == ("flash_attention_2 (the flag's default; a train backend that reads the flag may set another "
                        "in its configure, shown under plugin_defaults)")


# --- rules the built-in plugins own (moved from core/config) ------------------------------

PLUGIN_ERRORS = [
    (["--context-parallel-size", "2"], None,
     "--train-backend fsdp does not support --context-parallel-size 2; use 1 or --train-backend megatron."),
    (["--actor-num-gpus-per-node", "2", "--dp-replicate-size", "3", "--global-batch-size", "2", "--executor", "ray"],
     None, "--dp-replicate-size (3) must divide the trainer world size 2."),
    (["--advantage-estimator", "reinforce_plus_plus"], None,
     "--advantage-estimator reinforce_plus_plus requires --normalize-advantages (its advantages are whitened "
     "over the rollout)."),
    (["--advantage-estimator", "reinforce_plus_plus_baseline"], None,
     "--advantage-estimator reinforce_plus_plus_baseline requires --normalize-advantages (its advantages are "
     "whitened over the rollout)."),
    (["--fully-async", "--colocate"], None,
     "--fully-async cannot be combined with --colocate (the producer generates while the trainer trains)."),
    (["--fully-async", "--partial-rollout"], None,
     "--fully-async cannot be combined with --partial-rollout (unfinished groups simply stay in flight)."),
    (["--rollout", "fully_async", "--rollout-all-samples-process-path", "json.loads"], None,
     "--fully-async cannot be combined with --rollout-all-samples-process-path (there is no end of a rollout "
     "to see all samples at)."),
    (["--fully-async", "--pause-generation-mode", "abort"], None,
     "--fully-async cannot use --pause-generation-mode abort: generation is always in flight, so every weight "
     "update would throw it away; use retract or in_place."),
    (["--fully-async"], "train",
     "fully async rollout (--rollout fully_async, --fully-async) needs furlong train-async."),
    (["--loss-type", "custom_loss"], None,
     "--loss-type custom_loss needs --custom-loss-function-path module.function."),
]


@pytest.mark.parametrize("extra, command, message", PLUGIN_ERRORS,
                         ids=lambda v: " ".join(v)[:50] if isinstance(v, list) else str(v))
def test_plugin_rule_error_message(error_of, extra, command, message):
    assert error_of(BASE + extra, command) == message


def test_ppo_under_train_async_needs_a_correction_for_the_old_policy(error_of):
    assert error_of(BASE + ["--advantage-estimator", "ppo", "--no-use-tis"], "train-async") == (
        "furlong train-async with --advantage-estimator ppo needs --use-rollout-logprobs, --use-tis or "
        "--keep-old-actor (the old policy is gone by the time the batch trains).")


def test_ppo_asks_for_a_critic_and_derives_its_defaults(resolve):
    argv = BASE + ["--advantage-estimator", "ppo", "--load", "/ck", "--save", "/ck", "--lr", "2e-6"]
    args, configured = resolve(argv, "train")
    assert args.use_critic is True
    assert (args.critic_load, args.critic_save, args.critic_lr) == ("/ck_critic", "/ck_critic", 2e-6)
    assert derived_by(configured, "ppo") == {"critic_load": "/ck_critic", "critic_save": "/ck_critic",
                                             "critic_lr": 2e-6}
    args, _ = resolve(argv + ["--critic-save", "/mine", "--critic-lr", "1e-5"], "train")
    assert (args.critic_load, args.critic_save, args.critic_lr) == ("/mine", "/mine", 1e-5)
    args, _ = resolve(BASE + ["--advantage-estimator", "ppo", "--load", "/a", "--save", "/b"], "train")
    assert (args.critic_load, args.critic_save) == ("/a_critic", "/b_critic")
    args, _ = resolve(BASE + ["--advantage-estimator", "ppo", "--kl-coef", "0.1", "--ref-load", "/ref"], "train")
    assert args.use_critic is True and args.kl_coef == 0.1  # KL folded into the per-token rewards


def test_ppo_with_a_third_party_backend_that_can_build_a_critic(resolve, critic_backend):
    args, _ = resolve(BASE + ["--advantage-estimator", "ppo", "--train-backend", "critic_backend"], "train")
    assert args.use_critic is True


def test_ppo_with_a_backend_that_cannot_build_a_critic_is_one_error(error_of, critic_backend):
    assert error_of(BASE + ["--advantage-estimator", "ppo", "--train-backend", "actor_only"], "train") == (
        "--advantage-estimator ppo trains a critic (value model), but --train-backend actor_only cannot build one "
        "(it implements no `critic_backend` hook); use --train-backend critic_backend or fsdp or megatron.")


def test_ppo_with_megatron_trains_its_critic(resolve, tiny_model_dir):
    args, _ = resolve(BASE + ["--advantage-estimator", "ppo", "--train-backend", "megatron", "--hf-checkpoint",
                              str(tiny_model_dir)], "train")
    assert args.use_critic is True


def test_critic_defaults_are_ppo_s_only(resolve):
    args, _ = resolve(BASE + ["--load", "/ck", "--save", "/ck", "--lr", "2e-6"])
    assert (args.critic_load, args.critic_save, args.critic_lr) == (None, None, None)


def test_rules_follow_the_plugin_actually_chosen(resolve):
    # a dotted path replaces the named estimator: reinforce_plus_plus's rule does not apply
    args, _ = resolve(BASE + ["--advantage-estimator", "reinforce_plus_plus", "--custom-advantage-function-path",
                              "furlong.builtin_plugins.advantage._group.group_relative_advantages"])
    assert args.normalize_advantages is False
    assert resolve(BASE + ["--advantage-estimator", "reinforce_plus_plus", "--normalize-advantages"])


def test_gspo_makes_the_ratio_sequence_level_unless_given(resolve):
    two = ["--n-samples-per-prompt", "2"]
    assert resolve(BASE + two)[0].policy_ratio_level == "token"
    args, configured = resolve(BASE + two + ["--advantage-estimator", "gspo"])
    assert (args.policy_ratio_level, derived_by(configured, "gspo")) == ("sequence", {"policy_ratio_level": "sequence"})
    args, configured = resolve(BASE + two + ["--advantage-estimator", "gspo", "--policy-ratio-level", "token"])
    assert (args.policy_ratio_level, derived_by(configured, "gspo")) == ("token", {})


def test_a_third_party_estimator_may_choose_the_sequence_ratio_too(resolve, register_plugin):
    def sequence(args, report):
        report.default(args, "policy_ratio_level", "sequence")

    register_plugin(_recording([], ("advantage",), sequence), "seq_adv")
    assert resolve(BASE + ["--advantage-estimator", "seq_adv"])[0].policy_ratio_level == "sequence"


@pytest.mark.parametrize("estimator", ["grpo", "gspo"])
def test_group_estimators_warn_about_one_sample_groups(resolve, caplog, estimator):
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="furlong.config"):
        args, _ = resolve(BASE + ["--advantage-estimator", estimator, "--n-samples-per-prompt", "1",
                                  "--global-batch-size", "4"])
    warned = [r.getMessage() for r in caplog.records if r.name == "furlong.config" and r.levelno == logging.WARNING]
    assert warned == [f"--advantage-estimator {estimator} with --n-samples-per-prompt 1: a group of one sample has "
                      "advantage r - mean(r) = 0, so nothing is learned; sample several responses per prompt."]
    assert args.disable_grpo_std_normalization is True


def test_group_std_normalization_is_forced_off_only_for_one_sample_groups(resolve, caplog):
    with caplog.at_level(logging.INFO, logger="furlong.config"):
        args, configured = resolve(BASE)  # one sample per prompt by default: no warning, a note
    assert args.disable_grpo_std_normalization is True
    assert derived_by(configured, "grpo") == {"disable_grpo_std_normalization": True}
    logged = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "furlong.config"]
    assert ("INFO", "--n-samples-per-prompt 1: group std normalization is off (a one-sample group has no std).") \
        in logged
    assert not [m for level, m in logged if level == "WARNING" and "a group of one sample" in m]
    assert resolve(BASE + ["--n-samples-per-prompt", "4"])[0].disable_grpo_std_normalization is False


def test_fully_async_submits_per_sample_unless_given(resolve):
    assert resolve(BASE)[0].rollout_submission_granularity is None  # only the fully async rollout reads it
    args, configured = resolve(BASE + ["--rollout", "fully_async"], "train-async")
    assert args.rollout_submission_granularity == "sample"
    assert derived_by(configured, "fully_async") == {"rollout_submission_granularity": "sample"}
    args, _ = resolve(BASE + ["--fully-async", "--rollout-submission-granularity", "group"], "train-async")
    assert args.rollout_submission_granularity == "group"


def test_the_sync_rollout_warns_about_the_fully_async_rollout_s_flags(resolve, caplog):
    def warnings(argv, command):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="furlong.config"):
            resolve(BASE + argv, command)
        return [r.getMessage() for r in caplog.records if r.name == "furlong.config"]

    assert warnings(["--max-weight-staleness", "2", "--async-unused-samples-handler", "retry"], "train") == [
        "--max-weight-staleness, --async-unused-samples-handler: read by the fully async rollout only (--rollout "
        "fully_async, with furlong train-async); the sync rollout ignores them."]
    assert warnings(["--rollout-submission-granularity", "group"], "train-async") == [
        "--rollout-submission-granularity: read by the fully async rollout only (--rollout fully_async, with furlong "
        "train-async); the sync rollout ignores it."]
    assert warnings(["--rollout", "fully_async", "--max-weight-staleness", "2"], "train-async") == []


def test_fully_async_function_path_selects_the_plugin_and_its_defaults(resolve):
    args, _ = resolve(BASE + ["--rollout-function-path", "fully_async_rollout.generate_rollout_fully_async"],
                      "train-async")
    assert (args.rollout, args.rollout_submission_granularity) == ("fully_async", "sample")
