"""Plugin errors as a user sees them: ``python -m furlong.core`` exits 2 with one message, no traceback.

Runs use a stack of test plugins (one per chosen hook, names ``t_*``) from throwaway
installed distributions, with furlong's own built-ins disabled through
``FURLONG_DISABLE_PLUGINS``, so every expected message is exact. Each ``furlong train``
case is declared with ``_case`` next to its test; the module's fixture starts them all at
once (each imports torch, which dominates its run time) and the tests read the results.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor

import pytest

pytestmark = pytest.mark.timeout(240)

KNOBS = ["--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4"]
STACK = {  # entry-point name -> (hook, flag); t_data's data_source returns None
    "t_executor": ("executor", "--executor"),
    "t_data": ("data_source", "--data-source"),
    "t_engine": ("rollout_engine", "--rollout-backend"),
    "t_backend": ("train_backend", "--train-backend"),
    "t_rollout": ("rollout", "--rollout"),
    "t_generate": ("generate", "--generate"),
    "t_pop": ("buffer_pop", "--buffer-filter"),
    "t_adv": ("advantage", "--advantage-estimator"),
    "t_loss": ("loss", "--loss-type"),
    "t_reward": ("reward", "--rm-type"),
}
ARGNAMES = {"executor": "args", "data_source": "args", "rollout_engine": "args", "train_backend": "args",
            "rollout": "args, rollout_id, context", "generate": "args, sample", "buffer_pop": "buffer, num_samples",
            "advantage": "args, batch", "loss": "args, batch", "reward": "args, samples"}
BROKEN_IMPORT = "ModuleNotFoundError: No module named 'furlong_missing_dependency_xyz'"
BAD_ARGNAME = ("`advantage(args, batches)` takes 'batches', which is not an argument of hook `advantage`; its "
               "arguments are: config, batch (take any of them, by name); did you mean 'batch'?")
CLASH = ("`add_arguments` adds the flag --lr, which furlong core already defines; a plugin adds only new flags, "
         "prefixed with its name (--t-clash-...).")


def _module(hook: str, returns: str = "'ok'") -> str:
    return f"from furlong.hooks import hookimpl\n\n\n@hookimpl\ndef {hook}({ARGNAMES[hook]}):\n    return {returns}\n"


@pytest.fixture(scope="module")
def sites(tmp_path_factory, write_dist):
    """Three site folders: ``stack`` (the ``t_*`` plugins and a user module ``my_rm``),
    ``twin`` (a second distribution registering ``t_adv``) and ``bad`` (``t_broken`` fails
    to import, ``t_typo`` misspells its hook, ``t_argname`` names an unknown argument,
    ``t_clash`` redefines the core flag ``--lr``)."""
    root = tmp_path_factory.mktemp("cli_sites")
    stack_files = {f"furlong_cli_stack/{name}.py": _module(hook, "None" if name == "t_data" else "'ok'")
                   for name, (hook, _) in STACK.items()}
    stack_files["furlong_cli_stack/t_executor.py"] = _module(
        "executor", "__import__('furlong.builtin_plugins.executors.local', fromlist=['local']).LocalExecutor()")
    stack_files["my_rm.py"] = "def grade(args, sample):\n    return 1.0\n"
    write_dist(root / "stack", "furlong-cli-stack", "furlong_cli_stack", "",
               {n: f"furlong_cli_stack.{n}" for n in STACK}, files=stack_files)
    write_dist(root / "twin", "furlong-cli-twin", "furlong_cli_twin", _module("advantage"),
               {"t_adv": "furlong_cli_twin"}, version="2.0.0")
    bad_files = {
        "furlong_cli_bad/t_broken.py": "import furlong_missing_dependency_xyz\n",
        "furlong_cli_bad/t_typo.py": _module("advantage").replace("def advantage", "def advantge"),
        "furlong_cli_bad/t_argname.py": _module("advantage").replace("args, batch", "args, batches"),
        "furlong_cli_bad/t_clash.py": _module("reward") + (
            "\n\n@hookimpl\ndef add_arguments(parser):\n    parser.add_argument('--t-clash-depth', type=int)\n"
            "    parser.add_argument('--lr', type=float)\n"),
    }
    write_dist(root / "bad", "furlong-cli-bad", "furlong_cli_bad", "",
               {n: f"furlong_cli_bad.{n}" for n in ("t_broken", "t_typo", "t_argname", "t_clash")},
               version="0.0.1",
               files=bad_files)
    return {name: root / name for name in ("stack", "twin", "bad")}


@pytest.fixture(scope="module")
def no_builtins(installed_plugins) -> dict[str, str]:
    return {"FURLONG_DISABLE_PLUGINS": ",".join(installed_plugins)}


@pytest.fixture
def furlong_with(run_furlong, sites, no_builtins):
    """``furlong_with(*argv, extra=(), env=None)``: ``run_furlong`` with the stack (plus ``extra`` sites)."""

    def run(*argv, extra=(), env=None):
        return run_furlong(*argv, sites=[sites["stack"]] + [sites[e] for e in extra], env={**no_builtins, **(env or {})})

    return run


# --- furlong train cases, run together ----------------------------------------------------

CASES: dict[str, tuple[list[str], tuple[str, ...], dict[str, str]]] = {}


def _case(name: str, *extra_argv: str, extra_sites=(), env=None, print_config=True) -> str:
    argv = ["train"] + (["--print-config"] if print_config else []) + KNOBS
    for plugin, (_, flag) in STACK.items():
        argv += [flag, plugin]
    CASES[name] = (argv + list(extra_argv), tuple(extra_sites), env or {})
    return name


@pytest.fixture(scope="module")
def train(sites, no_builtins, tmp_path_factory):
    """``{case name: CompletedProcess}`` of every ``_case``, run three at a time."""
    cwd = tmp_path_factory.mktemp("cli_cwd")
    base = {k: v for k, v in os.environ.items() if k not in ("FURLONG_DISABLE_PLUGINS", "FURLONG_TRACE_HOOKS")}

    def run(item):
        name, (argv, extra_sites, env) = item
        paths = [str(sites["stack"])] + [str(sites[s]) for s in extra_sites]
        paths += [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p]
        full_env = {**base, "PYTHONPATH": os.pathsep.join(paths), **no_builtins, **env}
        return name, subprocess.run([sys.executable, "-m", "furlong.core", *argv], cwd=cwd, env=full_env,
                                    capture_output=True, text=True, timeout=200)

    with ThreadPoolExecutor(max_workers=3) as pool:
        return dict(pool.map(run, CASES.items()))


def _usage_error(proc) -> str:
    """stderr of a run that must end in a usage error: exit code 2 and no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    return proc.stderr


PRINT_CONFIG = _case("print_config", "--custom-rm-path", "my_rm.grade")


def test_print_config_shows_the_chosen_plugins_and_a_dotted_path(train):
    proc = train[PRINT_CONFIG]
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["plugins"] == {
        "executor": "t_executor", "data_source": "t_data", "rollout_engine": "t_engine", "train_backend": "t_backend", "rollout": "t_rollout",
        "generate": "t_generate", "buffer_pop": "t_pop", "advantage": "t_adv", "loss": "t_loss", "filter": [],
        "reward": "my_rm.grade"}


UNKNOWN = _case("unknown", "--advantage-estimator", "t_adw")


def test_unknown_name_lists_names_with_distributions_and_a_guess(train):
    assert _usage_error(train[UNKNOWN]) == (
        "error: --advantage-estimator 't_adw': no installed plugin of that name implements `advantage`.\n"
        "error:   Available: t_adv (furlong-cli-stack 0.1.0).\n"
        "error:   Did you mean 't_adv'? List them with: furlong plugins --hook advantage\n"
    )


EVERY_BAD = _case("every_bad", "--loss-type", "t_adv", "--custom-generate-function-path", "my_rm.score",
                  "--rm-type", "boxed_t_rewrd")


def test_every_bad_choice_is_reported_at_once(train):
    assert _usage_error(train[EVERY_BAD]) == (
        # a dotted path whose module lacks the function
        "error: --custom-generate-function-path 'my_rm.score': module 'my_rm' has no attribute 'score'\n"
        # a chosen plugin that lacks the hook
        "error: --loss-type 't_adv': plugin 't_adv' (furlong-cli-stack 0.1.0) does not implement `loss`; "
        "it implements: advantage.\n"
        # boxed_<name> with an unknown <name>
        "error: --rm-type 'boxed_t_rewrd' grades the last \\boxed{} with reward plugin 't_rewrd':\n"
        "error:   --rm-type 't_rewrd': no installed plugin of that name implements `reward`.\n"
        "error:   Available: t_reward (furlong-cli-stack 0.1.0).\n"
        "error:   Did you mean 't_reward'? List them with: furlong plugins --hook reward\n"
    )


CONFLICT = _case("conflict", extra_sites=("twin",))
DISABLE_FLAG = _case("disable_flag", "--disable-plugins", "furlong-cli-twin:t_adv", extra_sites=("twin",))


def test_name_registered_by_two_distributions_names_both(train):
    assert _usage_error(train[CONFLICT]) == (
        "error: plugin name 't_adv' is registered twice in entry-point group 'furlong':\n"
        "error:   furlong-cli-stack 0.1.0 -> furlong_cli_stack.t_adv; furlong-cli-twin 2.0.0 -> furlong_cli_twin.\n"
        "error:   Uninstall one, or pick one with --disable-plugins furlong-cli-twin:t_adv.\n"
    )


def test_disable_plugins_flag_picks_one_of_two_distributions(train, furlong_with):
    proc = train[DISABLE_FLAG]
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["plugins"]["advantage"] == "t_adv"
    listed = furlong_with("plugins", "--json", "--hook", "advantage", "--disable-plugins",
                          "furlong-cli-stack:t_adv", extra=("twin",))
    assert [(r["name"], r["distribution"], r["status"]) for r in json.loads(listed.stdout)] == [
        ("t_adv", "furlong-cli-twin", "ok")]


def test_disable_plugins_environment_variable_picks_one(furlong_with, no_builtins):
    env = {"FURLONG_DISABLE_PLUGINS": no_builtins["FURLONG_DISABLE_PLUGINS"] + ",furlong-cli-stack:t_adv"}
    listed = furlong_with("plugins", "--json", "--hook", "advantage", extra=("twin",), env=env)
    assert listed.returncode == 0, listed.stderr
    assert [(r["name"], r["distribution"]) for r in json.loads(listed.stdout)] == [("t_adv", "furlong-cli-twin")]


# --- broken plugins ----------------------------------------------------------------------


def test_plugins_lists_a_plugin_that_fails_to_import_as_broken(furlong_with):
    proc = furlong_with("plugins", "--hook", "loss", extra=("bad",))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (
        "NAME       HOOKS  DISTRIBUTION       VERSION  STATUS\n"
        f"t_argname  -      furlong-cli-bad    0.0.1    broken: {BAD_ARGNAME}\n"
        f"t_broken   -      furlong-cli-bad    0.0.1    broken: {BROKEN_IMPORT}\n"
        f"t_clash    -      furlong-cli-bad    0.0.1    broken: {CLASH}\n"
        "t_loss     loss   furlong-cli-stack  0.1.0    ok\n"
        "t_typo     -      furlong-cli-bad    0.0.1    broken: implements unknown hook `advantge` "
        "(did you mean `advantage`?)\n"
    )


CHOOSE_BROKEN = _case("choose_broken", "--advantage-estimator", "t_broken", "--loss-type", "t_typo",
                      "--buffer-filter", "t_argname", "--rm-type", "t_clash", extra_sites=("bad",))


def test_choosing_broken_plugins_names_entry_point_distribution_and_error(train):
    assert _usage_error(train[CHOOSE_BROKEN]) == (
        # an implementation naming an argument its hookspec lacks
        "error: --buffer-filter 't_argname': plugin 't_argname' is broken: entry point "
        f"'t_argname = furlong_cli_bad.t_argname' of furlong-cli-bad 0.0.1 failed to load: {BAD_ARGNAME}\n"
        # a plugin that fails to import
        "error: --advantage-estimator 't_broken': plugin 't_broken' is broken: entry point "
        f"'t_broken = furlong_cli_bad.t_broken' of furlong-cli-bad 0.0.1 failed to load: {BROKEN_IMPORT}\n"
        # a misspelled hook name
        "error: --loss-type 't_typo': plugin 't_typo' is broken: entry point "
        "'t_typo = furlong_cli_bad.t_typo' of furlong-cli-bad 0.0.1 failed to load: "
        "implements unknown hook `advantge` (did you mean `advantage`?)\n"
        # a plugin whose add_arguments redefines a core flag
        "error: --rm-type 't_clash': plugin 't_clash' is broken: entry point 't_clash = furlong_cli_bad.t_clash' of "
        f"furlong-cli-bad 0.0.1 was set aside: {CLASH}\n"
    )


DEMO_MODEL = str(Path(__file__).resolve().parent.parent / "examples" / "demo" / "model")
RUN_WITH_BROKEN = _case("run_with_broken", "--hf-checkpoint", DEMO_MODEL, extra_sites=("bad",), print_config=False)


def test_a_run_warns_about_broken_plugins_and_a_chosen_none_is_an_error(train):
    stderr = _usage_error(train[RUN_WITH_BROKEN])
    assert [line for line in stderr.splitlines() if line.startswith("WARNING furlong:")] == [
        f"WARNING furlong: plugin 't_argname' (furlong-cli-bad 0.0.1) is broken and cannot be chosen: {BAD_ARGNAME}",
        f"WARNING furlong: plugin 't_broken' (furlong-cli-bad 0.0.1) is broken and cannot be chosen: {BROKEN_IMPORT}",
        f"WARNING furlong: plugin 't_clash' (furlong-cli-bad 0.0.1) is broken and cannot be chosen: {CLASH}",
        "WARNING furlong: plugin 't_typo' (furlong-cli-bad 0.0.1) is broken and cannot be chosen: "
        "implements unknown hook `advantge` (did you mean `advantage`?)",
    ]
    assert stderr.endswith(
        "error: plugin 't_data' (furlong-cli-stack 0.1.0) returned None from `data_source` (chosen by --data-source); "
        "a chosen `data_source` must return its result.\n"
    )


DEBUG = _case("debug", "--advantage-estimator", "t_adw", "--debug")


def test_debug_adds_the_traceback(train):
    proc = train[DEBUG]
    assert proc.returncode == 2
    assert "Traceback (most recent call last)" in proc.stderr
    assert proc.stderr.endswith("  Did you mean 't_adv'? List them with: furlong plugins --hook advantage\n")


# --- furlong plugins and the command itself ------------------------------------------------


def test_plugins_json_rows(furlong_with):
    proc = furlong_with("plugins", "--json", "--hook", "buffer_pop")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [{"name": "t_pop", "hooks": ["buffer_pop"], "distribution": "furlong-cli-stack",
                                        "version": "0.1.0", "status": "ok", "detail": "furlong_cli_stack.t_pop"}]


def test_plugins_with_an_unknown_hook(furlong_with):
    proc = furlong_with("plugins", "--hook", "advantge")
    assert _usage_error(proc) == (
        "error: --hook 'advantge': no such hook. Hooks: abort, add_arguments, advantage, buffer_pop, configure, "
        "critic_backend, data_source, executor, executor_fit, filter, generate, loss, loss_reducer, on_checkpoint_saved, on_eval_end, on_hook_call, "
        "on_rollout_end, on_train_step_end, reward, rollout, rollout_engine, train_backend.\n"
    )


def test_unknown_command(run_furlong):
    proc = run_furlong("trian")
    assert _usage_error(proc).startswith("error: unknown command 'trian' (did you mean 'train'?).\n"
                                         "usage: furlong [--version] COMMAND")
    assert _usage_error(run_furlong("frobnicate")).startswith("error: unknown command 'frobnicate'.\nusage:")
