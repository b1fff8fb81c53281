"""Dotted-path flags: the user's function is called positionally, Miles-style, as a plugin."""

from __future__ import annotations

import asyncio
import sys
import textwrap
from argparse import Namespace

import pytest

from furlong.core.config.launch_args import launch_args, launch_config
from furlong.core.plugins.selection import resolve_selection
from furlong.hooks import FilterResult, PluginError, hookimpl

USER_MODULE = '''
CALLS = []


async def rm(*args, **kwargs):
    CALLS.append(("rm", args, kwargs))
    return float(len(args[1]))


def group_rm(*args, **kwargs):
    CALLS.append(("group_rm", args, kwargs))
    return [float(i) for i, _ in enumerate(args[1])]


def keep_all(*args, **kwargs):
    CALLS.append(("keep_all", args, kwargs))
    return FilterResult(keep=False, reason="seen")


def keep_two(args, samples):
    CALLS.append(("keep_two", (args, samples), {}))
    return len(samples) == 2


async def advantage(*args, **kwargs):
    CALLS.append(("advantage", args, kwargs))
    return "advantages"


def loss(*args, **kwargs):
    CALLS.append(("loss", args, kwargs))
    return "per-token loss"


def pop_last(*args, **kwargs):
    CALLS.append(("pop_last", args, kwargs))
    buffer, k = args[2], args[3]
    out = buffer[-k:]
    del buffer[-k:]
    return out


async def generate(args, sample, sampling_params, evaluation=False):
    CALLS.append(("generate", (args, sample, sampling_params), {"evaluation": evaluation}))
    return sample + "+response"


def generate_plain(*args):
    CALLS.append(("generate_plain", args, {}))
    return args[1] + "+plain"


async def rollout(*args, **kwargs):
    CALLS.append(("rollout", args, kwargs))
    return [["group"]]


class Rows:
    def __init__(self, *args, **kwargs):
        CALLS.append(("Rows", args, kwargs))


async def run_agent(*args, **kwargs):
    return None


async def abort(*args, **kwargs):
    CALLS.append(("abort", args, kwargs))
'''


@pytest.fixture
def user(tmp_path, monkeypatch):
    """The user's module ``my_funcs`` (and ``plain_agent``, with no ``abort``) on sys.path."""
    (tmp_path / "my_funcs.py").write_text("from furlong.hooks import FilterResult\n" + textwrap.dedent(USER_MODULE))
    (tmp_path / "plain_agent.py").write_text("async def run_agent(*args, **kwargs):\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_funcs

    yield my_funcs
    sys.modules.pop("my_funcs", None)
    sys.modules.pop("plain_agent", None)


def _args(**overrides) -> Namespace:
    return launch_args(**overrides)


def _select(load_plugins, hooks, **overrides):
    pm = load_plugins()
    args = _args(**overrides)
    return pm, args, resolve_selection(args, pm, hooks)


def test_reward_path_is_called_once_per_sample_positionally(user, load_plugins):
    pm, args, selection = _select(load_plugins, ("reward",), custom_rm_path="my_funcs.rm")
    assert selection.reward == ("my_funcs.rm", "--custom-rm-path")
    out = asyncio.run(pm.call_chosen("reward", "my_funcs.rm", "--custom-rm-path", args=args, samples=["ab", "abc"]))
    assert out == [2.0, 3.0]  # len(sample)
    assert user.CALLS == [("rm", (args, "ab"), {}), ("rm", (args, "abc"), {})]
    assert pm.origin("my_funcs.rm") == "from --custom-rm-path"
    assert [row for row in pm.describe() if row["name"] == "my_funcs.rm"] == [
        {"name": "my_funcs.rm", "hooks": ["reward"], "distribution": "-", "version": "-", "status": "ok", "detail": ""}
    ]


def test_reward_path_gets_the_whole_group_under_group_rm(user, load_plugins):
    pm, args, _ = _select(load_plugins, ("reward",), custom_rm_path="my_funcs.group_rm", group_rm=True)
    group = ["a", "b", "c"]
    out = asyncio.run(pm.call_chosen("reward", "my_funcs.group_rm", "--custom-rm-path", args=args, samples=group))
    assert out == [0.0, 1.0, 2.0]
    assert user.CALLS == [("group_rm", (args, group), {})]


def test_filter_paths_run_after_named_filters_in_flag_order(user, load_plugins):
    pm, args, selection = _select(load_plugins, ("filter",),
                                  dynamic_sampling_filter_path=["my_funcs.keep_two", "my_funcs.keep_all"])
    assert selection.filters == [("my_funcs.keep_two", "--dynamic-sampling-filter-path"),
                                 ("my_funcs.keep_all", "--dynamic-sampling-filter-path")]
    names = [name for name, _ in selection.filters]
    result = asyncio.run(pm.run_filters(names, "--dynamic-sampling-filter-path",
                                        args=args, samples=["s0", "s1"], rollout_id=5))
    assert result == FilterResult(keep=False, reason="seen")
    # keep_two takes (args, samples) only; keep_all takes **kwargs, so it also gets rollout_id
    assert user.CALLS == [("keep_two", (args, ["s0", "s1"]), {}),
                          ("keep_all", (args, ["s0", "s1"]), {"rollout_id": 5})]


def test_advantage_and_loss_paths_get_args_and_batch(user, load_plugins):
    pm, args, selection = _select(load_plugins, ("advantage", "loss"),
                                  custom_advantage_function_path="my_funcs.advantage",
                                  custom_loss_function_path="my_funcs.loss")
    assert selection.chosen == {"advantage": ("my_funcs.advantage", "--custom-advantage-function-path"),
                                "loss": ("my_funcs.loss", "--custom-loss-function-path")}
    adv = asyncio.run(pm.call_chosen("advantage", *selection.chosen["advantage"], args=args, batch="B1"))
    loss = asyncio.run(pm.call_chosen("loss", *selection.chosen["loss"], args=args, batch="B2"))
    assert (adv, loss) == ("advantages", "per-token loss")
    assert user.CALLS == [("advantage", (args, "B1"), {}), ("loss", (args, "B2"), {})]


def test_buffer_pop_path_gets_rollout_id_buffer_and_count(user, load_plugins):
    pm, args, selection = _select(load_plugins, ("buffer_pop",), buffer_filter_path="my_funcs.pop_last")
    buffer = [["g0"], ["g1"], ["g2"]]
    out = asyncio.run(pm.call_chosen("buffer_pop", *selection.chosen["buffer_pop"], args=args, rollout_id=3,
                                     buffer=buffer, num_samples=2))
    assert out == [["g1"], ["g2"]]
    assert buffer == [["g0"]]
    (name, positional, keywords), = user.CALLS
    assert (name, positional[0], positional[1], positional[2] is buffer, positional[3], keywords) == (
        "pop_last", args, 3, True, 2, {})


def test_generate_path_gets_evaluation_only_when_it_accepts_it(user, load_plugins):
    pm, args, selection = _select(load_plugins, ("generate",), custom_generate_function_path="my_funcs.generate")
    params = {"temperature": 1.0}
    out = asyncio.run(pm.call_chosen("generate", *selection.chosen["generate"], args=args, sample="p",
                                     sampling_params=params, engine=object(), evaluation=True))
    assert out == "p+response"
    assert user.CALLS == [("generate", (args, "p", params), {"evaluation": True})]

    pm, args, selection = _select(load_plugins, ("generate",), custom_generate_function_path="my_funcs.generate_plain")
    out = asyncio.run(pm.call_chosen("generate", *selection.chosen["generate"], args=args, sample="q",
                                     sampling_params=params, engine=object(), evaluation=False))
    assert out == "q+plain"
    assert user.CALLS[-1] == ("generate_plain", (args, "q", params), {})


def test_rollout_path_gets_args_rollout_id_and_context(user, load_plugins):
    pm, args, selection = _select(load_plugins, ("rollout",), rollout_function_path="my_funcs.rollout")
    out = asyncio.run(pm.call_chosen("rollout", *selection.chosen["rollout"], args=args, rollout_id=7, context="ctx"))
    assert out == [["group"]]
    assert user.CALLS == [("rollout", (args, 7, "ctx"), {})]


def test_data_source_path_constructs_the_class_with_args(user, load_plugins):
    pm, args, selection = _select(load_plugins, ("data_source",), data_source_path="my_funcs.Rows")
    source = asyncio.run(pm.call_chosen("data_source", *selection.chosen["data_source"], args=args))
    assert isinstance(source, user.Rows)
    assert user.CALLS == [("Rows", (args,), {})]


def test_agent_module_abort_is_registered_and_broadcast(user, load_plugins):
    pm, args, _ = _select(load_plugins, ("abort",), custom_agent_function_path="my_funcs.run_agent")
    assert pm.names_for("abort") == ["my_funcs.run_agent:abort"]
    assert pm.origin("my_funcs.run_agent:abort") == "from --custom-agent-function-path"
    asyncio.run(pm.broadcast("abort", args=args, rollout_id=1))
    assert user.CALLS == [("abort", (args,), {})]


def test_agent_module_without_abort_registers_nothing(user, load_plugins):
    pm, _, _ = _select(load_plugins, ("abort",), custom_agent_function_path="plain_agent.run_agent")
    assert pm.names_for("abort") == []


def test_one_path_given_twice_is_registered_once(user, load_plugins):
    pm, args, selection = _select(load_plugins, ("advantage", "filter"),
                                  custom_advantage_function_path="my_funcs.advantage",
                                  dynamic_sampling_filter_path=["my_funcs.keep_all", "my_funcs.keep_all"])
    assert [name for name, _ in selection.filters] == ["my_funcs.keep_all", "my_funcs.keep_all"]
    assert pm.names_for("filter") == ["my_funcs.keep_all"]
    # the same selection resolved again reuses the registered adapters
    assert resolve_selection(args, pm, ("advantage", "filter")).filters == selection.filters


def test_a_path_to_something_not_callable_is_an_error_before_anything_runs(user, load_plugins, tmp_path):
    (tmp_path / "my_values.py").write_text("NOT_A_FUNCTION = 3\n")
    with pytest.raises(PluginError) as err:
        _select(load_plugins, ("generate",), custom_generate_function_path="my_values.NOT_A_FUNCTION")
    assert str(err.value) == ("--custom-generate-function-path 'my_values.NOT_A_FUNCTION': 'NOT_A_FUNCTION' is a "
                              "int, not callable; point the flag at a function.")
    sys.modules.pop("my_values", None)


MILES_FILTER = "miles.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std"


def test_miles_filter_hub_paths_resolve_to_the_built_in_plugins(caplog):
    from furlong.core.plugins.miles_paths import MILES_BUILTINS
    from furlong.core.plugins.manager import get_plugin_manager

    pm = get_plugin_manager()
    paths = [path for path, (hook, _) in MILES_BUILTINS.items() if hook == "filter"]
    with caplog.at_level("INFO", logger="furlong.config"):
        selection = resolve_selection(_args(dynamic_sampling_filter_path=paths), pm, ("filter",))
    assert selection.filters == [(MILES_BUILTINS[p][1], "--dynamic-sampling-filter-path") for p in paths]
    assert (f"--dynamic-sampling-filter-path {MILES_FILTER}: furlong's built-in plugin 'check_reward_nonzero_std' "
            "does this; using it.") in caplog.messages
    from furlong.hooks import Sample

    def verdict(rewards):
        group = [Sample(reward=r) for r in rewards]
        return asyncio.run(pm.run_filters([selection.filters[0][0]], "--dynamic-sampling-filter-path",
                                          config=launch_config(configure=False), samples=group, rollout_id=0)).keep

    assert (verdict([0.0, 1.0]), verdict([1.0, 1.0])) == (True, False)  # the built-in's behaviour


def test_a_miles_path_whose_built_in_is_disabled_is_imported_as_written(load_plugins):
    pm = load_plugins()  # built-ins disabled: the path is the user's to provide
    with pytest.raises(PluginError) as err:
        resolve_selection(_args(dynamic_sampling_filter_path=[MILES_FILTER]), pm, ("filter",))
    assert str(err.value).startswith(f"--dynamic-sampling-filter-path '{MILES_FILTER}': ")


def test_a_file_name_instead_of_a_dotted_path_gets_the_right_form():
    from furlong.core.plugins.adapters import import_dotted
    from furlong.hooks import PluginError

    with pytest.raises(PluginError, match=r"^--custom-rm-path 'myrm\.py': a dotted path names the module without "
                                          r"'\.py' and then the function: 'myrm\.FUNCTION'\.$"):
        import_dotted("myrm.py", "--custom-rm-path")


def test_a_path_function_given_the_run_configuration_gets_a_namespace_view_without_warning(user, recwarn):
    from furlong.core.config.launch_args import launch_config
    from furlong.core.plugins.manager import get_plugin_manager

    pm = get_plugin_manager()
    config = launch_config("--custom-advantage-function-path", "my_funcs.advantage", pm=pm)
    selection = resolve_selection(config.namespace(), pm, ("advantage",))
    out = asyncio.run(pm.call_chosen("advantage", *selection.chosen["advantage"], config=config, batch="B"))
    [(name, (args, batch), _)] = user.CALLS
    assert (out, name, batch) == ("advantages", "advantage", "B")
    assert isinstance(args, Namespace) and args.custom_advantage_function_path == "my_funcs.advantage"
    assert [str(w.message) for w in recwarn if issubclass(w.category, DeprecationWarning)] == []


def test_every_path_function_call_is_reported_to_on_hook_call(user, load_plugins):
    events = []

    class Recorder:
        @hookimpl
        def on_hook_call(self, hook, plugin, error):
            events.append((hook, plugin, error))

    pm, args, selection = _select(load_plugins, ("advantage",), custom_advantage_function_path="my_funcs.advantage")
    pm.register_checked(Recorder(), "recorder")
    asyncio.run(pm.call_chosen("advantage", *selection.chosen["advantage"], args=args, batch="B"))
    assert events == [("advantage", "my_funcs.advantage", None)]
