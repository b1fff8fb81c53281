"""The frozen, typed run configuration: its fields follow the parser, it cannot change, and old-form plugins
still get a Namespace."""

from __future__ import annotations

import argparse
import asyncio
import pickle
import typing
import warnings

import attrs
import pytest

from furlong.core.config import build_parser
from furlong.core.config.freeze import freeze_config
from furlong.core.config.launch_args import launch_args, launch_config
from furlong.core.plugins.manager import get_plugin_manager
from furlong.hooks import FilterResult, PluginConfig, RunConfig, hookimpl
from furlong.hooks.run_config import FrozenMap

DERIVED_FIELDS = {"train_mode", "explicit_args", "plugin_flags_given", "megatron_flags_given", "megatron_args",
                  "megatron_argv", "sglang_passthrough", "router_passthrough", "eval_sglang_passthrough",
                  "data_parallel_size", "use_critic", "engines_in_driver", "packed_by_default", "sglang_tp_size",
                  "num_rollout_per_epoch", "eval_engine", "eval_prompt_data_lone", "custom_config_extras",
                  "plugins"}


@pytest.fixture(scope="module")
def pm():
    return get_plugin_manager()


def _core_flags(pm) -> dict[str, argparse.Action]:
    """The flags furlong core defines that a parse always sets (Megatron-LM and refused Miles flags are left unset)."""
    parser = build_parser(pm)
    parsed = vars(launch_args(pm=pm))
    return {action.dest: action for action in parser._actions
            if action.dest in parsed and action.dest not in parser.plugin_flags and action.dest != "help"}


def test_one_field_per_core_flag_plus_the_derived_values(pm):
    fields = {field.name for field in attrs.fields(RunConfig)}
    flags = set(_core_flags(pm))
    assert sorted(flags - fields) == [], "a core flag without a RunConfig field: add it to hooks/run_config.py"
    assert sorted(fields - flags - DERIVED_FIELDS) == [], "a RunConfig field no flag sets"


def test_switches_are_bools_and_typed_flags_have_their_parse_type(pm):
    hints = typing.get_type_hints(RunConfig)
    for dest, action in _core_flags(pm).items():
        options = typing.get_args(hints[dest]) or (hints[dest],)
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction,
                               argparse.BooleanOptionalAction)):
            assert hints[dest] is bool, dest
        elif action.type in (int, float) and action.nargs is None:
            assert action.type in options, dest


def test_every_value_matches_its_field_in_a_real_parse(pm):
    config = launch_config("--rm-type", "math", "--lr", "1", "--rollout-stop", "a", "b", "--eval-prompt-data",
                           "gsm8k", "g.jsonl", "--apply-chat-template-kwargs", '{"enable_thinking": false}', pm=pm)
    assert config.lr == 1.0 and isinstance(config.lr, float)  # "1" parses as an int-looking float
    assert config.rollout_stop == ("a", "b") and config.eval_prompt_data == ("gsm8k", "g.jsonl")
    assert config.apply_chat_template_kwargs == {"enable_thinking": False}
    assert isinstance(config.apply_chat_template_kwargs, FrozenMap)


def test_the_configuration_cannot_change(pm):
    config = launch_config(pm=pm)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        config.lr = 1.0
    with pytest.raises(AttributeError):
        config.no_such_flag = 1
    with pytest.raises(TypeError):
        config.apply_chat_template_kwargs["x"] = 1
    assert config.replace(lr=0.5).lr == 0.5 and config.lr != 0.5


def test_it_pickles_for_workers_and_actors(pm):
    config = launch_config("--rollout-stop", "x", embedded_max_batch_size=3, pm=pm)
    again = pickle.loads(pickle.dumps(config))
    assert again == config and again.plugin_config("embedded").embedded_max_batch_size == 3


def test_a_plugin_reads_its_own_flags_and_what_its_configure_derived(pm):
    config = launch_config("--rollout-backend", "sglang", "--sglang-server-impl", "furlong", pm=pm)
    section = config.plugin_config("sglang")
    assert isinstance(section, PluginConfig)
    assert section.sglang_server_impl == "furlong"  # a flag the sglang plugin adds
    assert section.sglang_engines_per_process == 1  # a value its configure derived
    assert config.plugin_config("no_such_plugin") == {}
    with pytest.raises(AttributeError, match="plugin 'sglang' has no flag or derived value 'typo'"):
        section.typo
    with pytest.raises(AttributeError, match=r"plugin 'sglang_typo' has no flag or derived value 'x' \(it has no "
                                             r"section: it added no flag, or no plugin is called that; sections: "
                                             r"embedded, .*sglang"):
        config.plugin_config("sglang_typo").x


def test_a_plugin_flag_read_as_a_field_says_where_it_lives(pm):
    config = launch_config(pm=pm)
    with pytest.raises(AttributeError, match=r"it is a flag of plugin 'embedded': read "
                                             r"config.plugin_config\('embedded'\).embedded_max_batch_size"):
        config.embedded_max_batch_size
    with pytest.raises(AttributeError, match="no core flag and no plugin's flag has that name"):
        config.no_such_flag


def test_the_namespace_view_holds_everything_as_argparse_would(pm):
    config = launch_config("--rollout-stop", "a", "--seq-length", "64", pm=pm)
    view = config.namespace()
    assert view.rollout_stop == ["a"] and view.embedded_max_batch_size == config.plugin_config(
        "embedded").embedded_max_batch_size
    assert view.seq_length == 64  # a Megatron-LM flag given
    view.lr = 123.0
    assert config.lr != 123.0 and config.namespace().lr == config.lr


def test_a_namespace_that_lacks_or_mistypes_a_field_does_not_freeze(pm):
    args = launch_args(pm=pm)
    plugin_flags = build_parser(pm).plugin_flags
    del args.lr
    args.seed = "7"
    args.stray_value = 1
    with pytest.raises(TypeError) as err:
        freeze_config(args, plugin_flags)
    assert "seed: expected int, got '7'" in str(err.value)
    assert "missing: lr" in str(err.value) and "no flag, derived field or plugin value: stray_value" in str(err.value)


def test_overrides_name_a_field_or_a_plugin_flag(pm):
    with pytest.raises(TypeError, match="no field or plugin flag is called lrr"):
        launch_config(lrr=1, pm=pm)


class OldForm:
    @hookimpl
    def filter(self, args, samples, rollout_id):
        return FilterResult(keep=args.lr == 0.25 and isinstance(args, argparse.Namespace))


def test_an_old_form_plugin_taking_args_gets_a_namespace_view_and_a_warning(pm):
    pm.register(OldForm(), name="old_form_filter")
    try:
        config = launch_config(lr=0.25, pm=pm)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = asyncio.run(pm.run_filters(["old_form_filter"], "--dynamic-sampling-filter", config=config,
                                                samples=[], rollout_id=0))
        assert result.keep
        assert any(issubclass(w.category, DeprecationWarning) and "old_form_filter" in str(w.message)
                   for w in caught)
    finally:
        pm.unregister(name="old_form_filter")
