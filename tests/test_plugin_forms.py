"""The two forms of a hook implementation (PLUGINS.md, "Deprecations"): the new one takes ``config`` and
reads its own flags from its section; the old one takes ``args``, still runs on a Namespace view and warns once."""

from __future__ import annotations

import asyncio
import importlib
import sys
import types
import warnings

import pytest

from furlong.core.config.launch_args import launch_config
from furlong.hooks import Sample, hookimpl


def _add_scale(name: str):
    def add_arguments(parser):
        parser.add_argument_group(name).add_argument(f"--{name}-scale", type=float, default=2.0)
    return add_arguments


def _score(pm, name, config, samples):
    return asyncio.run(pm.call_chosen("reward", name, "--rm-type", config=config, samples=samples))


def test_a_new_form_plugin_reads_its_own_flag_from_its_section(plugin_manager, register_plugin):
    def reward(config, samples):
        own = config.plugin_config("scaled")
        return [own.scaled_scale * len(s.response) / config.rollout_batch_size for s in samples]

    register_plugin(types.SimpleNamespace(add_arguments=hookimpl(_add_scale("scaled")), reward=hookimpl(reward)),
                    "scaled")
    samples = [Sample(response="abcd"), Sample(response="ab")]
    default = launch_config("--rm-type", "scaled", "--rollout-batch-size", "2", pm=plugin_manager)
    assert _score(plugin_manager, "scaled", default, samples) == [4.0, 2.0]  # the default its flag declares
    given = launch_config("--rm-type", "scaled", "--rollout-batch-size", "2", "--scaled-scale", "0.5",
                          pm=plugin_manager)
    assert _score(plugin_manager, "scaled", given, samples) == [1.0, 0.5]
    with pytest.raises(AttributeError, match="plugin 'scaled' has no flag or derived value 'other' "
                                             r"\(its section holds: scaled_scale\)"):
        given.plugin_config("scaled").other


def test_an_old_form_plugin_runs_on_a_namespace_view_and_warns_once(plugin_manager, register_plugin, caplog):
    def reward(args, samples):
        return [args.legacy_scale * len(s.response) / args.rollout_batch_size for s in samples]

    register_plugin(types.SimpleNamespace(add_arguments=hookimpl(_add_scale("legacy")), reward=hookimpl(reward)),
                    "legacy")
    config = launch_config("--rm-type", "legacy", "--rollout-batch-size", "2", pm=plugin_manager)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = _score(plugin_manager, "legacy", config, [Sample(response="abcd")])
        second = _score(plugin_manager, "legacy", config, [Sample(response="ab")])
    assert (first, second) == ([4.0], [2.0])
    old_form = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert old_form == ["plugin 'legacy': `reward(args, ...)` is the old form of the hook; take `config` (a "
                        "furlong.hooks.RunConfig) instead. The old form goes away in the next minor version "
                        "(PLUGINS.md, \"Deprecations\")."]
    assert [r.getMessage() for r in caplog.records if r.name == "furlong.plugins"] == old_form  # seen in a run too


@pytest.mark.parametrize("module", ["answers", "compute_thread", "dist", "epochs", "hf", "kl", "masked",
                                    "master_weights", "packed_attention", "trainer", "vocab_softmax"])
def test_a_helper_that_moved_to_the_kit_still_imports_from_furlong_hooks_with_a_warning(module, monkeypatch):
    monkeypatch.delitem(sys.modules, f"furlong.hooks.{module}", raising=False)
    with pytest.warns(DeprecationWarning, match=f"furlong.hooks.{module} moved to furlong.kit.{module}"):
        old = importlib.import_module(f"furlong.hooks.{module}")
    assert old is importlib.import_module(f"furlong.kit.{module}")
