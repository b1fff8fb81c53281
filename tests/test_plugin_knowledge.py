"""Plugins own their knowledge: a train backend reports its data-parallel rule from ``configure``
and an executor says whether it fits the machine; core applies both without knowing any name."""

from __future__ import annotations

import pytest

from furlong.core.config import ConfigError, parse_args
from furlong.core.config.configure import configure_plugins
from furlong.core.config.parser import machine_defaults
from furlong.core.plugins.manager import get_plugin_manager
from furlong.core.plugins.selection import resolve_selection
from furlong.hooks import ExecutorFit, hookimpl

BASE = ["--num-rollout", "3", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2"]

pytestmark = pytest.mark.usefixtures("cpu_machine")  # the same defaults on every machine


class PipelineBackend:
    """A third-party train backend whose replicas span ``--actor-num-gpus-per-node`` / 2 pipeline stages."""

    @hookimpl
    def configure(self, args, report):
        report.data_parallel_rule(STAGES=2)

    @hookimpl
    def train_backend(self, args):
        raise AssertionError("not built in these tests")


class SilentBackend:
    """A third-party train backend that reports no rule."""

    @hookimpl
    def train_backend(self, args):
        raise AssertionError("not built in these tests")


class ClusterExecutor:
    """A third-party executor that fits when ``fits`` says so."""

    def __init__(self, fits, why="inside the test cluster"):
        self.fits, self.why = fits, why

    @hookimpl
    def executor_fit(self, args):
        return ExecutorFit(self.fits, self.why) if isinstance(self.fits, bool) else self.fits

    @hookimpl
    def executor(self, args):
        raise AssertionError("not started in these tests")


def configured(pm, argv):
    args = parse_args(argv, pm, command="train")
    return args, configure_plugins(args, pm, resolve_selection(args, pm))


def test_hook_configure_a_third_party_backend_reports_its_own_data_parallel_rule(plugin_manager, register_plugin):
    register_plugin(PipelineBackend(), "pipeline_backend")
    cluster = ["--train-backend", "pipeline_backend", "--actor-num-gpus-per-node", "4", "--executor", "ray"]
    args, done = configured(plugin_manager, BASE + cluster)
    assert args.data_parallel_size == 2  # 4 ranks / 2 stages
    assert done.data_parallel.model_parallel == (("STAGES", 2),)
    with pytest.raises(ConfigError) as excinfo:
        configured(plugin_manager, BASE + cluster + ["--global-batch-size", "3", "--rollout-batch-size", "3",
                                                     "--n-samples-per-prompt", "1"])
    assert str(excinfo.value) == (
        "--global-batch-size (3) must be divisible by the data-parallel size 2 (actor_num_nodes 1 x "
        "actor_num_gpus_per_node 4 / (STAGES 2)): every rank trains on the same number of samples per step.")
    with pytest.raises(ConfigError) as excinfo:
        configured(plugin_manager, BASE + ["--train-backend", "pipeline_backend", "--actor-num-gpus-per-node", "3",
                                           "--executor", "ray", "--n-samples-per-prompt", "3"])
    assert str(excinfo.value) == ("trainer world size 3 (actor_num_nodes 1 x actor_num_gpus_per_node 3) is not "
                                  "divisible by STAGES 2 = 2.")


def test_a_backend_that_reports_no_rule_trains_on_every_rank(plugin_manager, register_plugin):
    register_plugin(SilentBackend(), "silent_backend")
    args, done = configured(plugin_manager, BASE + ["--train-backend", "silent_backend",
                                                    "--actor-num-gpus-per-node", "4", "--executor", "ray"])
    assert (done.data_parallel, args.data_parallel_size) == (None, 4)


def test_the_built_in_backends_report_their_rules(plugin_manager):
    _, fsdp = configured(plugin_manager, BASE)
    assert fsdp.data_parallel.model_parallel == ()
    args, megatron = configured(plugin_manager, BASE + [
        "--train-backend", "megatron", "--hf-checkpoint", "examples/demo/model", "--actor-num-gpus-per-node", "4",
        "--tensor-model-parallel-size", "2", "--sequence-parallel", "--executor", "ray"])
    assert megatron.data_parallel.model_parallel == (("TP", 2), ("PP", 1), ("CP", 1))
    assert args.data_parallel_size == 2


def test_hook_executor_fit_a_third_party_executor_that_fits_is_the_default(plugin_manager, register_plugin):
    register_plugin(ClusterExecutor(True), "cluster_executor")
    args = parse_args(BASE, plugin_manager)
    assert (args.executor, args.engines_in_driver) == ("cluster_executor", False)
    assert machine_defaults(args, plugin_manager)["executor"] == {"value": "cluster_executor",
                                                                  "probe": "inside the test cluster"}


def test_hook_executor_fit_an_executor_that_does_not_fit_leaves_the_default_to_the_next(plugin_manager,
                                                                                      register_plugin):
    register_plugin(ClusterExecutor(False, "not inside the test cluster"), "cluster_executor")
    args = parse_args(BASE, plugin_manager)
    assert (args.executor, args.engines_in_driver) == ("local", True)  # one train rank
    args = parse_args(BASE + ["--actor-num-gpus-per-node", "2"], plugin_manager)
    assert (args.executor, args.engines_in_driver) == ("ray", False)  # two ranks, no torchrun
    args = parse_args(BASE + ["--executor", "cluster_executor"], plugin_manager)
    assert (args.executor, args.engines_in_driver) == ("cluster_executor", False)  # given: not asked to fit


def test_no_executor_fitting_is_an_error_listing_every_answer(monkeypatch):
    monkeypatch.delenv("FURLONG_DISABLE_PLUGINS", raising=False)
    pm = get_plugin_manager(disable=["local", "ray"])
    pm.register_checked(ClusterExecutor(False, "not inside the test cluster"), "cluster_executor")
    with pytest.raises(ConfigError) as excinfo:
        parse_args(BASE, pm)
    assert str(excinfo.value) == ("no executor fits this machine and these flags (cluster_executor: not inside the "
                                  "test cluster); choose one with --executor NAME.")


def test_an_executor_fit_that_returns_something_else_is_named(plugin_manager, register_plugin):
    register_plugin(ClusterExecutor("yes"), "cluster_executor")
    with pytest.raises(ConfigError) as excinfo:
        parse_args(BASE, plugin_manager)
    assert "plugin 'cluster_executor' (registered in-process): `executor_fit` returned str, not an ExecutorFit." \
        in str(excinfo.value)


def test_an_engine_lacking_a_protocol_member_is_refused_naming_the_plugin_and_the_member(plugin_manager,
                                                                                       register_plugin):
    import asyncio

    from furlong.core.config.launch_args import launch_config
    from furlong.core.rollout.engines import EngineFactory
    from furlong.hooks import PluginError

    class NoRanks:
        tokenizer = context_len = None

        def __getattr__(self, name):  # every method the core calls, but no weight_update_ranks
            if name == "weight_update_ranks" or name.startswith("__"):
                raise AttributeError(name)
            return lambda *a, **k: None

    class Factory:
        @hookimpl
        def rollout_engine(self, config):
            return NoRanks()

    register_plugin(Factory(), "no_ranks")
    make = EngineFactory(launch_config(configure=False), ("no_ranks", "--rollout-backend"), plugin_manager)
    with pytest.raises(PluginError) as excinfo:
        asyncio.run(make(0))
    assert str(excinfo.value) == (
        "--rollout-backend 'no_ranks': the engine it returned (NoRanks) lacks weight_update_ranks (see "
        "furlong.hooks.RolloutEngine; subclassing it gives the documented defaults of weight_update_ranks and "
        "context_len).")
