"""Plugin errors as a user sees them: ``python -m furlong.core`` exits 2 with one message, no traceback.

Runs use a stack of test plugins (one per chosen hook, names ``t_*``) from a throwaway
installed distribution, with furlong's own built-ins disabled through
``FURLONG_DISABLE_PLUGINS``, so every expected message is exact.
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.timeout(180)

KNOBS = ["--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4"]
STACK = {  # entry-point name -> (hook, flag)
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
ARGNAMES = {"data_source": "args", "rollout_engine": "args", "train_backend": "args",
            "rollout": "args, rollout_id, context", "generate": "args, sample", "buffer_pop": "buffer, num_samples",
            "advantage": "args, batch", "loss": "args, batch", "reward": "args, samples"}


def _module(hook: str, returns: str = "'ok'") -> str:
    return f"from furlong.hooks import hookimpl\n\n\n@hookimpl\ndef {hook}({ARGNAMES[hook]}):\n    return {returns}\n"


@pytest.fixture
def stack(plugin_dist, furlong_entry_points):
    """Install the ``t_*`` stack; return ``(sites, env)`` for ``run_furlong``.

    ``t_data``'s ``data_source`` forgets to return its object (returns None). The site
    also holds ``my_rm.py`` (a user module for dotted-path flags).
    """
    files = {f"furlong_cli_stack/{name}.py": _module(hook, "None" if name == "t_data" else "'ok'")
             for name, (hook, _) in STACK.items()}
    files["my_rm.py"] = "def grade(args, sample):\n    return 1.0\n"
    dist = plugin_dist("furlong-cli-stack", "furlong_cli_stack", "", {n: f"furlong_cli_stack.{n}" for n in STACK},
                       files=files)
    env = {"FURLONG_DISABLE_PLUGINS": ",".join(f"furlong:{name}" for name in furlong_entry_points)}
    return [dist.site], env


def _train_argv(*extra: str, print_config: bool = True) -> list[str]:
    argv = ["train"] + (["--print-config"] if print_config else []) + KNOBS
    for name, (_, flag) in STACK.items():
        argv += [flag, name]
    return argv + list(extra)


def _usage_error(proc) -> str:
    """stderr of a run that must end in a usage error: exit code 2 and no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    return proc.stderr


# --- the stack itself ------------------------------------------------------------------


def test_print_config_shows_the_chosen_plugins_and_a_dotted_path(stack, run_furlong):
    sites, env = stack
    proc = run_furlong(*_train_argv("--custom-rm-path", "my_rm.grade"), sites=sites, env=env)
    assert proc.returncode == 0, proc.stderr
    plugins = json.loads(proc.stdout)["plugins"]
    assert plugins == {"data_source": "t_data", "rollout_engine": "t_engine", "train_backend": "t_backend",
                       "rollout": "t_rollout", "generate": "t_generate", "buffer_pop": "t_pop",
                       "advantage": "t_adv", "loss": "t_loss", "filter": [], "reward": "my_rm.grade"}


# --- furlong train: choosing plugins ---------------------------------------------------


def test_unknown_name_lists_names_with_distributions_and_a_guess(stack, run_furlong):
    sites, env = stack
    proc = run_furlong(*_train_argv("--advantage-estimator", "t_adw"), sites=sites, env=env)
    assert _usage_error(proc) == (
        "error: --advantage-estimator 't_adw': no installed plugin of that name implements `advantage`.\n"
        "  Available: t_adv (furlong-cli-stack 0.1.0).\n"
        "  Did you mean 't_adv'? List them with: furlong plugins --hook advantage\n"
    )


def test_every_bad_choice_is_reported_at_once(stack, run_furlong):
    sites, env = stack
    proc = run_furlong(*_train_argv("--loss-type", "t_adv", "--custom-generate-function-path", "my_rm.score",
                                    "--rm-type", "boxed_t_rewrd"), sites=sites, env=env)
    assert _usage_error(proc) == (
        "error: --custom-generate-function-path 'my_rm.score': module 'my_rm' has no attribute 'score'\n"
        "--loss-type 't_adv': plugin 't_adv' (furlong-cli-stack 0.1.0) does not implement `loss`; "
        "it implements: advantage.\n"
        "--rm-type 'boxed_t_rewrd' grades the last \\boxed{} with reward plugin 't_rewrd':\n"
        "  --rm-type 't_rewrd': no installed plugin of that name implements `reward`.\n"
        "  Available: t_reward (furlong-cli-stack 0.1.0).\n"
        "  Did you mean 't_reward'? List them with: furlong plugins --hook reward\n"
    )


@pytest.fixture
def twin(plugin_dist, stack):
    """A second distribution that also registers ``t_adv``."""
    plugin_dist("furlong-cli-twin", "furlong_cli_twin", _module("advantage"), {"t_adv": "furlong_cli_twin"},
                version="2.0.0", site=stack[0][0])
    return stack


def test_name_registered_by_two_distributions_names_both(twin, run_furlong):
    sites, env = twin
    proc = run_furlong(*_train_argv(), sites=sites, env=env)
    assert _usage_error(proc) == (
        "error: plugin name 't_adv' is registered twice in entry-point group 'furlong':\n"
        "  furlong-cli-stack 0.1.0 -> furlong_cli_stack.t_adv; furlong-cli-twin 2.0.0 -> furlong_cli_twin.\n"
        "  Uninstall one, or pick one with --disable-plugins furlong-cli-twin:t_adv.\n"
    )


def test_disable_plugins_flag_picks_one_of_two_distributions(twin, run_furlong):
    sites, env = twin
    proc = run_furlong(*_train_argv("--disable-plugins", "furlong-cli-twin:t_adv"), sites=sites, env=env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["plugins"]["advantage"] == "t_adv"
    listed = run_furlong("plugins", "--json", "--hook", "advantage", "--disable-plugins", "furlong-cli-stack:t_adv",
                         sites=sites, env=env)
    assert [(r["name"], r["distribution"], r["status"]) for r in json.loads(listed.stdout)] == [
        ("t_adv", "furlong-cli-twin", "ok")]


def test_disable_plugins_environment_variable_picks_one(twin, run_furlong):
    sites, env = twin
    env = {"FURLONG_DISABLE_PLUGINS": env["FURLONG_DISABLE_PLUGINS"] + ",furlong-cli-stack:t_adv"}
    listed = run_furlong("plugins", "--json", "--hook", "advantage", sites=sites, env=env)
    assert listed.returncode == 0, listed.stderr
    assert [(r["name"], r["distribution"]) for r in json.loads(listed.stdout)] == [("t_adv", "furlong-cli-twin")]


# --- broken plugins --------------------------------------------------------------------


@pytest.fixture
def broken(plugin_dist, stack):
    """``t_broken`` fails to import; ``t_typo`` misspells its hook; ``t_argname`` names an unknown argument."""
    files = {
        "furlong_cli_bad/t_broken.py": "import furlong_missing_dependency_xyz\n",
        "furlong_cli_bad/t_typo.py": _module("advantage").replace("def advantage", "def advantge"),
        "furlong_cli_bad/t_argname.py": _module("advantage").replace("args, batch", "args, batches"),
    }
    plugin_dist("furlong-cli-bad", "furlong_cli_bad", "",
                {n: f"furlong_cli_bad.{n}" for n in ("t_broken", "t_typo", "t_argname")}, version="0.0.1",
                files=files, site=stack[0][0])
    return stack


BROKEN_IMPORT = "ModuleNotFoundError: No module named 'furlong_missing_dependency_xyz'"


def test_plugins_lists_a_plugin_that_fails_to_import_as_broken(broken, run_furlong):
    sites, env = broken
    proc = run_furlong("plugins", "--hook", "loss", sites=sites, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (
        "NAME       HOOKS  DISTRIBUTION       VERSION  STATUS\n"
        "t_argname  -      furlong-cli-bad    0.0.1    broken: PluginValidationError: Plugin 't_argname' for hook "
        "'advantage'\nhookimpl definition: advantage(args, batches)\n"
        "Argument(s) {'batches'} are declared in the hookimpl but can not be found in the hookspec\n"
        f"t_broken   -      furlong-cli-bad    0.0.1    broken: {BROKEN_IMPORT}\n"
        "t_loss     loss   furlong-cli-stack  0.1.0    ok\n"
        "t_typo     -      furlong-cli-bad    0.0.1    broken: implements unknown hook `advantge` "
        "(did you mean `advantage`?)\n"
    )


def test_choosing_broken_plugins_names_entry_point_distribution_and_error(broken, run_furlong):
    sites, env = broken
    proc = run_furlong(*_train_argv("--advantage-estimator", "t_broken", "--loss-type", "t_typo",
                                    "--buffer-filter", "t_argname"), sites=sites, env=env)
    assert _usage_error(proc) == (
        # a plugin that fails to import
        "error: --buffer-filter 't_argname': plugin 't_argname' is broken: entry point "
        "'t_argname = furlong_cli_bad.t_argname' of furlong-cli-bad 0.0.1 failed to load: "
        # an implementation naming an argument its hookspec lacks
        "PluginValidationError: Plugin 't_argname' for hook 'advantage'\n"
        "hookimpl definition: advantage(args, batches)\n"
        "Argument(s) {'batches'} are declared in the hookimpl but can not be found in the hookspec\n"
        "--advantage-estimator 't_broken': plugin 't_broken' is broken: entry point "
        f"'t_broken = furlong_cli_bad.t_broken' of furlong-cli-bad 0.0.1 failed to load: {BROKEN_IMPORT}\n"
        # a misspelled hook name
        "--loss-type 't_typo': plugin 't_typo' is broken: entry point "
        "'t_typo = furlong_cli_bad.t_typo' of furlong-cli-bad 0.0.1 failed to load: "
        "implements unknown hook `advantge` (did you mean `advantage`?)\n"
    )


def test_a_run_warns_about_broken_plugins_and_a_chosen_none_is_an_error(broken, run_furlong):
    sites, env = broken
    proc = run_furlong(*_train_argv(print_config=False), sites=sites, env=env)
    stderr = _usage_error(proc)
    warnings = [line for line in stderr.splitlines() if line.startswith("WARNING furlong:")]
    assert warnings == [
        "WARNING furlong: plugin 't_argname' (furlong-cli-bad 0.0.1) is broken and cannot be chosen: "
        "PluginValidationError: Plugin 't_argname' for hook 'advantage'",
        f"WARNING furlong: plugin 't_broken' (furlong-cli-bad 0.0.1) is broken and cannot be chosen: {BROKEN_IMPORT}",
        "WARNING furlong: plugin 't_typo' (furlong-cli-bad 0.0.1) is broken and cannot be chosen: "
        "implements unknown hook `advantge` (did you mean `advantage`?)",
    ]
    assert stderr.endswith(
        "error: plugin 't_data' (furlong-cli-stack 0.1.0) returned None from `data_source` (chosen by --data-source); "
        "a chosen `data_source` must return its result.\n"
    )


def test_debug_adds_the_traceback(stack, run_furlong):
    sites, env = stack
    proc = run_furlong(*_train_argv("--advantage-estimator", "t_adw", "--debug"), sites=sites, env=env)
    assert proc.returncode == 2
    assert "Traceback (most recent call last)" in proc.stderr
    assert proc.stderr.endswith("  Did you mean 't_adv'? List them with: furlong plugins --hook advantage\n")


# --- furlong plugins and the command itself --------------------------------------------


def test_plugins_json_rows(stack, run_furlong):
    sites, env = stack
    proc = run_furlong("plugins", "--json", "--hook", "buffer_pop", sites=sites, env=env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [{"name": "t_pop", "hooks": ["buffer_pop"], "distribution": "furlong-cli-stack",
                                        "version": "0.1.0", "status": "ok", "detail": "furlong_cli_stack.t_pop"}]


def test_plugins_with_an_unknown_hook(stack, run_furlong):
    sites, env = stack
    proc = run_furlong("plugins", "--hook", "advantge", sites=sites, env=env)
    assert _usage_error(proc) == (
        "error: --hook 'advantge': no such hook. Hooks: abort, add_arguments, advantage, buffer_pop, data_source, "
        "filter, generate, loss, on_checkpoint_saved, on_eval_end, on_hook_call, on_rollout_end, on_train_step_end, "
        "reward, rollout, rollout_engine, train_backend.\n"
    )


def test_unknown_command(run_furlong):
    proc = run_furlong("trian")
    assert _usage_error(proc).startswith("furlong: unknown command 'trian'.\nusage: furlong [--version] COMMAND")
