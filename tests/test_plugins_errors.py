"""Every plugin error a user can cause, compared as whole messages."""

from __future__ import annotations

import asyncio
import os
from argparse import ArgumentParser, Namespace

import pytest

from furlong.core.config.launch_args import launch_args
from furlong.core.plugins.manager import get_plugin_manager
from furlong.core.plugins.selection import boxed_base, check_reward_name, resolve_selection
from furlong.hooks import PluginError, hookimpl


def _source(*hooks: str) -> str:
    lines = ["from furlong.hooks import hookimpl", ""]
    args = {"advantage": "args, batch", "reward": "args, samples", "loss": "args, batch"}
    for hook in hooks:
        lines += ["@hookimpl", f"def {hook}({args[hook]}):", f"    return '{hook}'", ""]
    return "\n".join(lines)


@pytest.fixture
def estimators(plugin_dist):
    """Two advantage estimators and one reward, from two distributions."""
    plugin_dist("furlong-rloo", "furlong_rloo_pkg", _source("advantage"), {"rloo": "furlong_rloo_pkg"}, version="0.3.0")
    plugin_dist("furlong-extra", "furlong_extra_pkg", "",
                {"grpo_plus": "furlong_extra_pkg.grpo_plus", "exact": "furlong_extra_pkg.exact"}, version="1.2.0",
                files={"furlong_extra_pkg/grpo_plus.py": _source("advantage"),
                       "furlong_extra_pkg/exact.py": _source("reward")})


def _raises(fn, *args, **kwargs) -> str:
    with pytest.raises(PluginError) as excinfo:
        fn(*args, **kwargs)
    return str(excinfo.value)


# --- unknown names ---------------------------------------------------------------------


def test_unknown_name_lists_the_hook_s_plugins_with_distributions_and_a_guess(estimators, load_plugins):
    pm = load_plugins()
    assert _raises(pm.chosen_impl, "advantage", "grpo_pls", "--advantage-estimator") == (
        "--advantage-estimator 'grpo_pls': no installed plugin of that name implements `advantage`.\n"
        "  Available: grpo_plus (furlong-extra 1.2.0), rloo (furlong-rloo 0.3.0).\n"
        "  Did you mean 'grpo_plus'? List them with: furlong plugins --hook advantage"
    )


def test_unknown_name_without_a_close_match(estimators, load_plugins):
    pm = load_plugins()
    assert _raises(pm.chosen_impl, "advantage", "vapo", "--advantage-estimator") == (
        "--advantage-estimator 'vapo': no installed plugin of that name implements `advantage`.\n"
        "  Available: grpo_plus (furlong-extra 1.2.0), rloo (furlong-rloo 0.3.0).\n"
        "  List them with: furlong plugins --hook advantage"
    )


def test_unknown_name_when_no_plugin_implements_the_hook(load_plugins):
    pm = load_plugins()
    assert _raises(pm.chosen_impl, "buffer_pop", "pop_last", "--buffer-filter") == (
        "--buffer-filter 'pop_last': no installed plugin of that name implements `buffer_pop`.\n"
        "  Available: none.\n"
        "  List them with: furlong plugins --hook buffer_pop"
    )


# --- a chosen plugin that lacks the hook -----------------------------------------------


def test_chosen_plugin_without_the_hook_says_which_hooks_it_implements(estimators, load_plugins):
    pm = load_plugins()
    assert _raises(pm.chosen_impl, "advantage", "exact", "--advantage-estimator") == (
        "--advantage-estimator 'exact': plugin 'exact' (furlong-extra 1.2.0) does not implement `advantage`; "
        "it implements: reward."
    )


def test_a_module_without_any_hookimpl_is_broken_with_a_hint_at_the_decorator(plugin_dist, load_plugins):
    plugin_dist("furlong-empty", "furlong_empty_pkg", "HELPER = 1\n", {"empty": "furlong_empty_pkg"})
    pm = load_plugins()
    assert _raises(pm.chosen_impl, "loss", "empty", "--loss-type") == (
        "--loss-type 'empty': plugin 'empty' is broken: entry point 'empty = furlong_empty_pkg' of furlong-empty "
        "0.1.0 failed to load: implements no hook: no function is marked @hookimpl; decorate each hook function "
        "with @hookimpl (from furlong.hooks import hookimpl) and name it after its hook (furlong.hooks.specs lists "
        "the hooks)."
    )


def test_a_hook_function_without_the_decorator_is_named(plugin_dist, load_plugins):
    source = "def reward(args, samples):\n    return [1.0 for _ in samples]\n"
    plugin_dist("furlong-bare", "furlong_bare_pkg", source, {"bare": "furlong_bare_pkg"})
    pm = load_plugins()
    assert pm.describe()[0]["detail"] == (
        "defines `reward` without @hookimpl: decorate each hook function with @hookimpl "
        "(from furlong.hooks import hookimpl)."
    )


# --- two distributions, one name -------------------------------------------------------


@pytest.fixture
def twin_dists(plugin_dist):
    plugin_dist("furlong-rloo", "furlong_rloo_a", _source("advantage").replace("'advantage'", "'from a'"),
                {"rloo": "furlong_rloo_a"}, version="0.3.0")
    plugin_dist("rloo-fast", "rloo_fast_b", _source("advantage").replace("'advantage'", "'from b'"),
                {"rloo": "rloo_fast_b"}, version="0.2.0")


CONFLICT = (
    "plugin name 'rloo' is registered twice in entry-point group 'furlong':\n"
    "  furlong-rloo 0.3.0 -> furlong_rloo_a; rloo-fast 0.2.0 -> rloo_fast_b.\n"
    "  Uninstall one, or pick one with --disable-plugins rloo-fast:rloo."
)


def test_a_name_two_distributions_register_is_an_error_naming_both(twin_dists, load_plugins):
    pm = load_plugins()
    assert pm.get_plugin("rloo") is None
    assert [(r["distribution"], r["status"]) for r in pm.describe()] == [("furlong-rloo", "conflict"),
                                                                          ("rloo-fast", "conflict")]
    assert _raises(pm.chosen_impl, "advantage", "rloo", "--advantage-estimator") == CONFLICT


def test_disable_dist_name_picks_one_of_two_distributions(twin_dists, load_plugins):
    pm = load_plugins(["rloo-fast:rloo"])
    assert pm.conflicts == {}
    assert pm.origin("rloo") == "furlong-rloo 0.3.0"
    out = asyncio.run(pm.call_chosen("advantage", "rloo", "--advantage-estimator", args=None, batch=None))
    assert out == "from a"


def test_disable_environment_variable_picks_the_other(twin_dists, load_plugins, monkeypatch):
    monkeypatch.setenv("FURLONG_DISABLE_PLUGINS", "furlong-rloo:rloo")
    pm = load_plugins()
    assert pm.origin("rloo") == "rloo-fast 0.2.0"
    out = asyncio.run(pm.call_chosen("advantage", "rloo", "--advantage-estimator", args=None, batch=None))
    assert out == "from b"


# --- plugins that fail to load ---------------------------------------------------------


def test_plugin_that_fails_to_import_is_broken_and_an_error_only_when_chosen(plugin_dist, load_plugins):
    plugin_dist("furlong-rloo", "furlong_rloo_pkg", "import furlong_missing_dependency_xyz\n",
                {"rloo": "furlong_rloo_pkg"}, version="0.3.0")
    pm = load_plugins()
    error = "ModuleNotFoundError: No module named 'furlong_missing_dependency_xyz'"
    assert pm.describe() == [{"name": "rloo", "hooks": [], "distribution": "furlong-rloo", "version": "0.3.0",
                              "status": "broken", "detail": error}]
    assert _raises(pm.chosen_impl, "advantage", "rloo", "--advantage-estimator") == (
        "--advantage-estimator 'rloo': plugin 'rloo' is broken: entry point 'rloo = furlong_rloo_pkg' "
        f"of furlong-rloo 0.3.0 failed to load: {error}"
    )


def test_entry_point_naming_a_missing_object_is_broken(plugin_dist, load_plugins):
    plugin_dist("furlong-rloo", "furlong_rloo_pkg", _source("advantage"), {"rloo": "furlong_rloo_pkg:plugin"},
                version="0.3.0")
    pm = load_plugins()
    assert _raises(pm.chosen_impl, "advantage", "rloo", "--advantage-estimator") == (
        "--advantage-estimator 'rloo': plugin 'rloo' is broken: entry point 'rloo = furlong_rloo_pkg:plugin' "
        "of furlong-rloo 0.3.0 failed to load: AttributeError: module 'furlong_rloo_pkg' has no attribute 'plugin'"
    )


def test_misspelled_hook_name_is_an_error_naming_the_plugin(plugin_dist, load_plugins):
    source = "from furlong.hooks import hookimpl\n\n@hookimpl\ndef advantge(args, batch):\n    return 1\n"
    plugin_dist("furlong-rloo", "furlong_rloo_pkg", source, {"rloo": "furlong_rloo_pkg"}, version="0.3.0")
    pm = load_plugins()
    assert _raises(pm.chosen_impl, "advantage", "rloo", "--advantage-estimator") == (
        "--advantage-estimator 'rloo': plugin 'rloo' is broken: entry point 'rloo = furlong_rloo_pkg' "
        "of furlong-rloo 0.3.0 failed to load: implements unknown hook `advantge` (did you mean `advantage`?)"
    )


def test_unknown_argument_name_is_an_error_naming_the_plugin(plugin_dist, load_plugins):
    source = "from furlong.hooks import hookimpl\n\n@hookimpl\ndef advantage(args, batches):\n    return 1\n"
    plugin_dist("furlong-rloo", "furlong_rloo_pkg", source, {"rloo": "furlong_rloo_pkg"}, version="0.3.0")
    pm = load_plugins()
    assert _raises(pm.chosen_impl, "advantage", "rloo", "--advantage-estimator") == (
        "--advantage-estimator 'rloo': plugin 'rloo' is broken: entry point 'rloo = furlong_rloo_pkg' "
        "of furlong-rloo 0.3.0 failed to load: `advantage(args, batches)` takes 'batches', which is not an "
        "argument of hook `advantage`; its arguments are: config, batch (take any of them, by name); did you mean "
        "'batch'?"
    )


def test_one_module_under_two_names_breaks_the_second_name(plugin_dist, load_plugins):
    plugin_dist("furlong-rloo", "furlong_rloo_pkg", _source("advantage"),
                {"rloo": "furlong_rloo_pkg", "rloo_alias": "furlong_rloo_pkg"}, version="0.3.0")
    pm = load_plugins()
    assert pm.names_for("advantage") == ["rloo"]
    assert _raises(pm.chosen_impl, "advantage", "rloo_alias", "--advantage-estimator") == (
        "--advantage-estimator 'rloo_alias': plugin 'rloo_alias' is broken: entry point "
        "'rloo_alias = furlong_rloo_pkg' of furlong-rloo 0.3.0 failed to load: it is the object already "
        "registered as plugin 'rloo'; give each name its own object (entry point 'module:object')"
    )


def test_registering_a_taken_name_in_process_keeps_the_first(plugin_manager, register_plugin):
    class First:
        @hookimpl
        def reward(self, args, samples):
            return [1.0]

    register_plugin(First(), "taken")
    assert _raises(plugin_manager.register_checked, First(), "taken") == (
        "plugin name 'taken' is already registered (registered in-process)."
    )
    assert plugin_manager.names_for("reward").count("taken") == 1
    assert "taken" not in plugin_manager.broken


# --- what a chosen plugin returns ------------------------------------------------------


class _ReturnsNone:
    @hookimpl
    async def generate(self, args, sample):
        sample.append("generated")  # forgot to return the sample

    @hookimpl
    def data_source(self, args):
        pass

    @hookimpl
    def filter(self, samples):
        return "keep"


def test_chosen_hook_returning_none_is_an_error_naming_the_plugin(plugin_manager, register_plugin):
    register_plugin(_ReturnsNone(), "forgetful")
    sample = []
    coro = plugin_manager.call_chosen("generate", "forgetful", "--generate", args=None, sample=sample)
    assert _raises(asyncio.run, coro) == (
        "plugin 'forgetful' (registered in-process) returned None from `generate` (chosen by --generate); "
        "a chosen `generate` must return its result."
    )
    assert sample == ["generated"]


def test_filter_returning_neither_result_nor_bool_is_an_error(plugin_manager, register_plugin):
    register_plugin(_ReturnsNone(), "forgetful")
    coro = plugin_manager.run_filters(["forgetful"], "--dynamic-sampling-filter", args=None, samples=[], rollout_id=0)
    assert _raises(asyncio.run, coro) == (
        "plugin 'forgetful' (registered in-process) returned str from `filter`; expected FilterResult or bool."
    )


def test_filter_returning_none_or_raising_is_an_error_naming_the_plugin(plugin_manager, register_plugin):
    class Filters:
        @hookimpl
        def filter(self, args, samples, rollout_id):
            if samples:
                raise ValueError("filter boom")
            return None

    register_plugin(Filters(), "picky")

    def run(samples):
        coro = plugin_manager.run_filters(["picky"], "--dynamic-sampling-filter", args=None, samples=samples,
                                          rollout_id=0)
        return _raises(asyncio.run, coro)

    assert run([]) == ("plugin 'picky' (registered in-process) returned None from `filter` (chosen by "
                       "--dynamic-sampling-filter); expected FilterResult or bool.")
    assert run(["s"]) == "filter plugin 'picky' (registered in-process) failed: ValueError: filter boom"


def test_async_add_arguments_is_an_error_naming_the_plugin(plugin_manager, register_plugin):
    class AsyncFlags:
        @hookimpl
        async def add_arguments(self, parser):
            parser.add_argument("--async-flags-x")

    register_plugin(AsyncFlags(), "async_flags")
    message = _raises(plugin_manager.call_setup, "add_arguments", "async_flags", parser=ArgumentParser())
    assert message == ("plugin 'async_flags': `add_arguments` may not be async def; set-up hooks run before the "
                       "event loop starts (make it a plain def).")


# --- the boxed_<name> rule -------------------------------------------------------------


def test_boxed_base_strips_the_prefix_only_when_no_plugin_has_the_whole_name(plugin_manager, register_plugin):
    class Reward:
        @hookimpl
        def reward(self, args, samples):
            return [1.0]

    register_plugin(Reward(), "exact_match")
    register_plugin(Reward(), "boxed_special")
    assert boxed_base(plugin_manager, "boxed_exact_match") == "exact_match"
    assert boxed_base(plugin_manager, "boxed_special") is None  # a plugin owns that exact name
    assert boxed_base(plugin_manager, "exact_match") is None
    assert boxed_base(plugin_manager, "boxed_") == ""
    check_reward_name(plugin_manager, "boxed_exact_match", "--rm-type")  # resolves through the base
    check_reward_name(plugin_manager, "boxed_special", "--rm-type")


def test_boxed_name_with_an_unknown_base_names_what_the_user_typed(estimators, load_plugins):
    pm = load_plugins()
    assert _raises(check_reward_name, pm, "boxed_exakt", "--rm-type") == (
        "--rm-type 'boxed_exakt' grades the last \\boxed{} with reward plugin 'exakt':\n"
        "  --rm-type 'exakt': no installed plugin of that name implements `reward`.\n"
        "  Available: exact (furlong-extra 1.2.0).\n"
        "  Did you mean 'exact'? List them with: furlong plugins --hook reward"
    )


def test_boxed_name_whose_base_is_not_a_reward(estimators, load_plugins):
    pm = load_plugins()
    assert _raises(check_reward_name, pm, "boxed_rloo", "--rm-type") == (
        "--rm-type 'boxed_rloo' grades the last \\boxed{} with reward plugin 'rloo':\n"
        "  --rm-type 'rloo': plugin 'rloo' (furlong-rloo 0.3.0) does not implement `reward`; "
        "it implements: advantage."
    )


# --- selection reports every error at once --------------------------------------------


def _launch_args(**overrides) -> Namespace:
    return launch_args(**overrides)


def test_selection_reports_every_bad_choice_in_one_message(estimators, load_plugins):
    pm = load_plugins()
    args = _launch_args(advantage_estimator="rloo", loss_type="rloo", rm_type="exakt",
                        dynamic_sampling_filter=["zero_std"], custom_advantage_function_path=None,
                        explicit_args=["advantage_estimator", "dynamic_sampling_filter", "loss_type", "rm_type"])
    message = _raises(resolve_selection, args, pm, ("advantage", "loss", "filter", "reward"))
    assert message == (
        "--loss-type 'rloo': plugin 'rloo' (furlong-rloo 0.3.0) does not implement `loss`; it implements: advantage.\n"
        "--dynamic-sampling-filter 'zero_std': no installed plugin of that name implements `filter`.\n"
        "  Available: none.\n"
        "  List them with: furlong plugins --hook filter\n"
        "--rm-type 'exakt': no installed plugin of that name implements `reward`.\n"
        "  Available: exact (furlong-extra 1.2.0).\n"
        "  Did you mean 'exact'? List them with: furlong plugins --hook reward"
    )


def test_a_plugin_chosen_by_default_says_its_flag_was_not_given(estimators, load_plugins):
    pm = load_plugins()
    args = _launch_args(advantage_estimator="rloo", loss_type="rloo", explicit_args=["advantage_estimator"])
    assert _raises(resolve_selection, args, pm, ("loss",)) == (
        "--loss-type 'rloo': plugin 'rloo' (furlong-rloo 0.3.0) does not implement `loss`; it implements: advantage.\n"
        "  (--loss-type was not given; 'rloo' is its default here.)")


def test_selection_with_good_choices_names_each_plugin_and_flag(estimators, load_plugins):
    pm = load_plugins()
    args = _launch_args(advantage_estimator="grpo_plus", rm_type="boxed_exact")
    selection = resolve_selection(args, pm, ("advantage", "reward"))
    assert selection.chosen == {"advantage": ("grpo_plus", "--advantage-estimator")}
    assert selection.reward == ("boxed_exact", "--rm-type")
    assert selection.as_dict() == {"advantage": "grpo_plus", "filter": [], "reward": "boxed_exact"}


# --- dotted paths ----------------------------------------------------------------------


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A user's module ``my_rm`` on sys.path, with ``score`` absent and ``broken_mod`` failing."""
    (tmp_path / "my_rm.py").write_text("def grade(args, sample):\n    return 1.0\n")
    (tmp_path / "broken_mod.py").write_text("raise RuntimeError('bad config at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    import sys

    for name in ("my_rm", "broken_mod"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("my_rm.score", "--custom-rm-path 'my_rm.score': module 'my_rm' has no attribute 'score'"),
        ("score", "--custom-rm-path 'score': expected a dotted path 'module.function'."),
        ("no_such_module_xyz.grade",
         "--custom-rm-path 'no_such_module_xyz.grade': cannot import module 'no_such_module_xyz': "
         "ModuleNotFoundError: No module named 'no_such_module_xyz' (not installed, not on PYTHONPATH and not in the "
         "working directory {cwd}: run furlong from the folder holding it, or set PYTHONPATH to that folder)"),
        ("broken_mod.grade",
         "--custom-rm-path 'broken_mod.grade': cannot import module 'broken_mod': RuntimeError: bad config at import"),
    ],
)
def test_bad_dotted_path_names_flag_module_and_attribute(user_module, load_plugins, path, expected):
    pm = load_plugins()
    args = _launch_args(custom_rm_path=path)
    assert _raises(resolve_selection, args, pm, ("reward",)) == expected.replace("{cwd}", os.getcwd())


def test_bad_dotted_path_chains_the_import_error(user_module):
    from furlong.core.plugins.adapters import import_dotted

    with pytest.raises(PluginError) as excinfo:
        import_dotted("broken_mod.grade", "--custom-rm-path")
    assert type(excinfo.value.__cause__) is RuntimeError


def test_no_plugin_is_loaded_when_every_name_is_disabled(monkeypatch):
    monkeypatch.delenv("FURLONG_DISABLE_PLUGINS", raising=False)
    from furlong.core.plugins.discovery import read_entry_points

    pm = get_plugin_manager([f"{r.dist}:{r.name}" for r in read_entry_points()])
    assert pm.describe() == []


def test_a_module_in_the_working_directory_imports_as_under_python_m(tmp_path, monkeypatch, caplog):
    """The furlong console script does not put the working directory on sys.path; python -m does. A module there
    imports, and the directory goes on PYTHONPATH for the run's other processes."""
    import logging
    import sys

    from furlong.core.plugins.adapters import import_dotted

    (tmp_path / "cwd_reward_mod.py").write_text("def rm(args, sample):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    caplog.set_level(logging.INFO, logger="furlong.config")
    try:
        fn = import_dotted("cwd_reward_mod.rm", "--custom-rm-path")
        assert fn(None, None) == 1.0
        assert sys.path[0] == str(tmp_path)
        assert os.environ["PYTHONPATH"] == os.pathsep.join([str(tmp_path), "/elsewhere"])
        assert caplog.messages == [
            f"--custom-rm-path cwd_reward_mod.rm: 'cwd_reward_mod' imported from the working directory {tmp_path} "
            "(as python -m would); added to PYTHONPATH for the run's other processes."]
    finally:
        sys.modules.pop("cwd_reward_mod", None)


def test_the_console_script_reads_a_reward_module_from_the_working_directory(tmp_path):
    import json
    import subprocess
    import sys

    (tmp_path / "myrm.py").write_text("def rm(args, sample):\n    return 1.0\n")
    script = os.path.join(os.path.dirname(sys.executable), "furlong")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FURLONG_DISABLE_PLUGINS")}
    done = subprocess.run([script, "train", "--print-config", "--hf-checkpoint", "m", "--prompt-data", "d.jsonl",
                           "--num-rollout", "1", "--rollout-batch-size", "2", "--custom-rm-path", "myrm.rm"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["plugins"]["reward"] == "myrm.rm"
    assert f"'myrm' imported from the working directory {tmp_path}" in done.stderr
