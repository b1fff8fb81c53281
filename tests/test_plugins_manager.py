"""The plugin manager's rules: discovery, disabling, and how the core calls hooks."""

from __future__ import annotations

import asyncio
import logging
import threading
from argparse import ArgumentParser

import pytest

from furlong.core.config.launch_args import launch_args, launch_config
from furlong.core.config.parser import add_plugin_arguments
from furlong.core.plugins.discovery import EntryRecord, is_disabled, read_entry_points, split_names
from furlong.core.plugins.manager import get_plugin_manager
from furlong.hooks import FilterResult, PluginError, hookimpl

ADVANTAGE_SOURCE = """
    from furlong.hooks import hookimpl

    @hookimpl
    def advantage(config, batch):
        return "from {tag}"
"""


def _advantage_dist(plugin_dist, dist, package, name, version="0.1.0", site=None):
    return plugin_dist(dist, package, ADVANTAGE_SOURCE.replace("{tag}", package), {name: package},
                       version=version, site=site)


@pytest.fixture(scope="module")
def config():
    """The configuration of a run with every default, as the core hands it to the hooks."""
    return launch_config(configure=False)


@pytest.fixture
def setup_args():
    """The validated launch flags ``configure`` receives (it runs before the freeze)."""
    return launch_args()


class Recorder:
    """An ``on_hook_call`` observer that keeps every event."""

    def __init__(self):
        self.events = []

    @hookimpl
    def on_hook_call(self, hook, plugin, seconds, error):
        self.events.append((hook, plugin, seconds, error))


# --- discovery -------------------------------------------------------------------------


def test_entry_point_is_discovered_with_its_distribution_and_version(plugin_dist, load_plugins):
    _advantage_dist(plugin_dist, "furlong-demo", "furlong_demo_a", "demo_adv", version="0.3.0")
    pm = load_plugins()
    record = pm.records["demo_adv"]
    assert (record.name, record.value, record.dist, record.version) == (
        "demo_adv", "furlong_demo_a", "furlong-demo", "0.3.0")
    assert pm.describe() == [{"name": "demo_adv", "hooks": ["advantage"], "distribution": "furlong-demo",
                              "version": "0.3.0", "status": "ok", "detail": "furlong_demo_a"}]
    assert pm.origin("demo_adv") == "furlong-demo 0.3.0"
    assert pm.names_for("advantage") == ["demo_adv"]


def test_module_object_entry_points_serve_two_names_from_one_module(plugin_dist, load_plugins, config):
    source = """
        from furlong.hooks import hookimpl

        class _Half:
            def __init__(self, scale):
                self.scale = scale

            @hookimpl
            def reward(self, config, samples):
                return [self.scale * len(s) for s in samples]

        half = _Half(0.5)
        double = _Half(2.0)
    """
    plugin_dist("furlong-scales", "furlong_scales", source,
                {"half_len": "furlong_scales:half", "double_len": "furlong_scales:double"})
    pm = load_plugins()
    assert pm.names_for("reward") == ["double_len", "half_len"]
    # reward = scale * len(sample): 0.5 * 4 = 2.0; 2.0 * 4 = 8.0
    got = [asyncio.run(pm.call_chosen("reward", name, "--rm-type", config=config, samples=["abcd"]))
           for name in ("half_len", "double_len")]
    assert got == [[2.0], [8.0]]


def test_one_distribution_found_twice_on_sys_path_counts_once(plugin_dist, load_plugins, tmp_path):
    _advantage_dist(plugin_dist, "furlong-twice", "furlong_twice", "twice_adv")
    _advantage_dist(plugin_dist, "furlong-twice", "furlong_twice", "twice_adv", site=tmp_path / "stale")
    records = [r for r in read_entry_points() if r.name == "twice_adv"]
    assert [(r.dist, r.value) for r in records] == [("furlong-twice", "furlong_twice")]
    pm = load_plugins()
    assert pm.conflicts == {}
    assert pm.names_for("advantage") == ["twice_adv"]


def test_read_entry_points_keeps_duplicates_of_two_distributions_sorted(plugin_dist):
    _advantage_dist(plugin_dist, "furlong-zeta", "furlong_zeta", "shared_adv")
    _advantage_dist(plugin_dist, "furlong-alpha", "furlong_alpha", "shared_adv")
    records = [r for r in read_entry_points() if r.name == "shared_adv"]
    assert [(r.dist, r.value) for r in records] == [("furlong-alpha", "furlong_alpha"), ("furlong-zeta", "furlong_zeta")]


def test_misspelled_hook_is_broken_and_check_pending_passes(plugin_dist, load_plugins):
    source = """
        from furlong.hooks import hookimpl

        @hookimpl
        def advantge(config, batch):
            return None
    """
    plugin_dist("furlong-typo", "furlong_typo", source, {"typo_adv": "furlong_typo"})
    pm = load_plugins()  # get_plugin_manager runs check_pending(): it must not raise
    assert pm.get_plugin("typo_adv") is None
    assert pm.describe() == [{"name": "typo_adv", "hooks": [], "distribution": "furlong-typo", "version": "0.1.0",
                              "status": "broken",
                              "detail": "implements unknown hook `advantge` (did you mean `advantage`?)"}]


# --- disabling -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("item", "disabled"),
    [
        ("grpo", True),
        ("furlong:grpo", True),
        ("FURLONG:grpo", True),  # distribution names compare case-insensitively
        ("other-dist:grpo", False),
        ("grpo2", False),
        ("furlong:gspo", False),
    ],
)
def test_is_disabled_matches_name_or_dist_and_name(item, disabled):
    record = EntryRecord("grpo", "furlong.builtin_plugins.advantage.grpo", "furlong", "0.1.0", entry_point=None)
    assert is_disabled(record, [item]) is disabled


def test_split_names_takes_commas_and_lists():
    assert split_names("a, b,,dist:c ") == ["a", "b", "dist:c"]
    assert split_names(["a,b", "c"]) == ["a", "b", "c"]
    assert split_names(None) == []


def test_disable_by_name_by_dist_and_by_environment(plugin_dist, load_plugins, monkeypatch):
    _advantage_dist(plugin_dist, "furlong-one", "furlong_one", "one_adv")
    _advantage_dist(plugin_dist, "furlong-two", "furlong_two", "two_adv")
    assert load_plugins().names_for("advantage") == ["one_adv", "two_adv"]
    assert load_plugins(["one_adv"]).names_for("advantage") == ["two_adv"]
    assert load_plugins(["Furlong-Two:two_adv"]).names_for("advantage") == ["one_adv"]
    monkeypatch.setenv("FURLONG_DISABLE_PLUGINS", "furlong-one:one_adv,two_adv")
    pm = get_plugin_manager([f"furlong:{r.name}" for r in read_entry_points() if r.dist == "furlong"])
    assert pm.names_for("advantage") == []


# --- chosen hooks ----------------------------------------------------------------------


def test_chosen_hook_calls_only_the_named_plugin(plugin_manager, register_plugin, config):
    calls = []

    class Estimator:
        def __init__(self, tag):
            self.tag = tag

        @hookimpl
        def advantage(self, config, batch):
            calls.append(self.tag)
            return f"{self.tag}:{batch}"

    register_plugin(Estimator("a"), "est_a")
    register_plugin(Estimator("b"), "est_b")
    out = asyncio.run(plugin_manager.call_chosen("advantage", "est_b", "--advantage-estimator",
                                                 config=config, batch="B"))
    assert out == "b:B"
    assert calls == ["b"]


def test_chosen_hook_awaits_an_async_implementation(plugin_manager, register_plugin, config):
    class AsyncLoss:
        @hookimpl
        async def loss(self, config, batch):
            await asyncio.sleep(0)
            return ("loss of", batch)

    register_plugin(AsyncLoss(), "async_loss")
    out = asyncio.run(plugin_manager.call_chosen("loss", "async_loss", "--loss-type", config=config, batch=7))
    assert out == ("loss of", 7)


def test_set_up_call_refuses_async_def_without_running_it(plugin_manager, register_plugin, recwarn, setup_args):
    ran = []

    class AsyncFit:
        @hookimpl
        async def executor_fit(self, args):
            ran.append(args)

    register_plugin(AsyncFit(), "async_fit")
    with pytest.raises(PluginError) as excinfo:
        plugin_manager.call_setup("executor_fit", "async_fit", args=setup_args)
    assert str(excinfo.value) == ("plugin 'async_fit': `executor_fit` may not be async def; set-up hooks run "
                                  "before the event loop starts (make it a plain def).")
    assert ran == [] and not [w for w in recwarn if "never awaited" in str(w.message)]


def test_set_up_call_of_a_plugin_without_the_hook_is_an_error(plugin_manager, register_plugin, setup_args):
    class NoConfigure:
        @hookimpl
        def advantage(self, config, batch):
            return "adv"

    register_plugin(NoConfigure(), "no_configure")
    with pytest.raises(PluginError) as excinfo:
        plugin_manager.call_setup("configure", "no_configure", args=setup_args, report=None)
    assert str(excinfo.value) == "plugin 'no_configure' (registered in-process) does not implement `configure`."


def test_implementation_receives_only_the_arguments_it_names(plugin_manager, register_plugin, config):
    seen = {}

    class OnlyBatch:
        @hookimpl
        def advantage(self, batch):
            seen["batch"] = batch
            return "ok"

    register_plugin(OnlyBatch(), "only_batch")
    asyncio.run(plugin_manager.call_chosen("advantage", "only_batch", "--advantage-estimator",
                                           config=config, batch=[1, 2]))
    assert seen == {"batch": [1, 2]}


# --- broadcast and observers -----------------------------------------------------------


def test_broadcast_abort_failure_warns_and_the_rest_still_run(plugin_manager, register_plugin, caplog, config):
    ran = []

    class Good:
        def __init__(self, tag):
            self.tag = tag

        @hookimpl
        async def abort(self, config, rollout_id):
            ran.append((self.tag, rollout_id))

    class Bad:
        @hookimpl
        def abort(self, config, rollout_id):
            raise RuntimeError("sandbox gone")

    register_plugin(Good("first"), "first_abort")
    register_plugin(Bad(), "bad_abort")
    register_plugin(Good("last"), "last_abort")
    with caplog.at_level(logging.WARNING, logger="furlong.plugins"):
        asyncio.run(plugin_manager.broadcast("abort", config=config, rollout_id=4))
    assert sorted(ran) == [("first", 4), ("last", 4)]
    assert [r.getMessage() for r in caplog.records if "_abort'" in r.getMessage()] == [
        "plugin 'bad_abort' failed in `abort`: RuntimeError: sandbox gone"
    ]


def test_broadcast_of_a_non_observer_hook_runs_all_then_raises_naming_the_plugin(plugin_manager, register_plugin):
    from furlong.hooks import PluginError

    ran = []

    class Adds:
        def __init__(self, flag):
            self.flag = flag

        @hookimpl
        def add_arguments(self, parser):
            parser.add_argument(self.flag)
            ran.append(self.flag)

    class Fails:
        @hookimpl
        def add_arguments(self, parser):
            raise KeyError("group")

    register_plugin(Adds("--alpha-x"), "alpha")
    register_plugin(Fails(), "fails")
    register_plugin(Adds("--omega-x"), "omega")
    with pytest.raises(PluginError) as excinfo:
        asyncio.run(plugin_manager.broadcast("add_arguments", parser=ArgumentParser()))
    assert str(excinfo.value) == "plugin 'fails' (registered in-process) failed in `add_arguments`: KeyError: 'group'"
    assert sorted(ran) == ["--alpha-x", "--omega-x"]


def test_observer_failure_is_a_warning_and_others_still_observe(plugin_manager, register_plugin, caplog, config):
    seen = []

    class Logger:
        @hookimpl
        def on_rollout_end(self, rollout_id, metrics):
            seen.append((rollout_id, dict(metrics)))

    class Broken:
        @hookimpl
        async def on_rollout_end(self, metrics):
            raise ValueError("no disk")

    register_plugin(Broken(), "broken_logger")
    register_plugin(Logger(), "logger")
    with caplog.at_level(logging.WARNING, logger="furlong.plugins"):
        asyncio.run(plugin_manager.notify("on_rollout_end", config=config, rollout_id=2,
                                          metrics={"rollout/step": 2}))
    assert seen == [(2, {"rollout/step": 2})]
    assert [r.getMessage() for r in caplog.records if "logger'" in r.getMessage()] == [
        "plugin 'broken_logger' failed in `on_rollout_end`: ValueError: no disk"
    ]


# --- filters ---------------------------------------------------------------------------


def _filters(register_plugin, log, decisions):
    for name, decision in decisions.items():
        class Filter:
            def __init__(self, name, decision):
                self.name, self.decision = name, decision

            @hookimpl
            async def filter(self, config, samples, rollout_id):
                log.append(self.name)
                return self.decision

        register_plugin(Filter(name, decision), name)


def test_filters_run_in_flag_order_and_the_first_rejecting_gives_the_reason(plugin_manager, register_plugin, config):
    log = []
    _filters(register_plugin, log, {
        "keeps": True,
        "drops_short": FilterResult(keep=False, reason="too_short"),
        "drops_zero": FilterResult(keep=False, reason="zero_std_0.0"),
    })
    order = ["keeps", "drops_zero", "drops_short"]
    result = asyncio.run(plugin_manager.run_filters(order, "--dynamic-sampling-filter",
                                                    config=config, samples=[], rollout_id=0))
    assert result == FilterResult(keep=False, reason="zero_std_0.0")
    assert log == ["keeps", "drops_zero"]


def test_filters_that_all_keep_give_keep_without_reason(plugin_manager, register_plugin, config):
    log = []
    _filters(register_plugin, log, {"keep_bool": True, "keep_result": FilterResult(keep=True, reason="fine")})
    result = asyncio.run(plugin_manager.run_filters(["keep_result", "keep_bool"], "--dynamic-sampling-filter",
                                                    config=config, samples=[], rollout_id=0))
    assert result == FilterResult(keep=True, reason=None)
    assert log == ["keep_result", "keep_bool"]


def test_a_bare_false_filter_rejects_with_no_reason(plugin_manager, register_plugin, config):
    log = []
    _filters(register_plugin, log, {"false_filter": False, "never_reached": True})
    result = asyncio.run(plugin_manager.run_filters(["false_filter", "never_reached"], "--dynamic-sampling-filter",
                                                    config=config, samples=[], rollout_id=0))
    assert result == FilterResult(keep=False, reason=None)
    assert log == ["false_filter"]


# --- on_hook_call and tracing ----------------------------------------------------------


def test_on_hook_call_times_every_non_observer_call(plugin_manager, register_plugin, config):
    recorder = register_plugin(Recorder(), "recorder")

    class Slow:
        @hookimpl
        async def advantage(self, config, batch):
            await asyncio.sleep(0.05)
            return "adv"

        @hookimpl
        def loss(self, config, batch):
            raise ZeroDivisionError("empty micro-batch")

    register_plugin(Slow(), "slow")
    asyncio.run(plugin_manager.call_chosen("advantage", "slow", "--advantage-estimator", config=config, batch=None))
    with pytest.raises(ZeroDivisionError):
        asyncio.run(plugin_manager.call_chosen("loss", "slow", "--loss-type", config=config, batch=None))
    assert [(hook, plugin, error) for hook, plugin, _, error in recorder.events] == [
        ("advantage", "slow", None),
        ("loss", "slow", "ZeroDivisionError: empty micro-batch"),
    ]
    advantage_seconds, loss_seconds = recorder.events[0][2], recorder.events[1][2]
    assert 0.05 <= advantage_seconds < 5.0  # includes the awaited asyncio.sleep(0.05)
    assert 0.0 <= loss_seconds < 0.05


def test_on_hook_call_is_never_emitted_for_observers(plugin_manager, register_plugin, config):
    recorder = register_plugin(Recorder(), "recorder")

    class Observer:
        @hookimpl
        def on_train_step_end(self, step):
            pass

        @hookimpl
        def on_checkpoint_saved(self, path):
            pass

    register_plugin(Observer(), "observer")
    asyncio.run(plugin_manager.notify("on_train_step_end", config=config, rollout_id=0, step=1, metrics={}))
    asyncio.run(plugin_manager.notify("on_checkpoint_saved", config=config, rollout_id=0, path="/x"))
    asyncio.run(plugin_manager.notify("on_hook_call", hook="h", plugin="p", seconds=0.0, error=None))
    assert recorder.events == [("h", "p", 0.0, None)]  # only the direct call, nothing emitted


def test_on_hook_call_times_synchronous_set_up_calls(plugin_manager, register_plugin, setup_args):
    recorder = register_plugin(Recorder(), "recorder")

    class SetUp:
        @hookimpl
        def add_arguments(self, parser):
            parser.add_argument("--set-up-x")

        @hookimpl
        def configure(self, args, report):
            raise ValueError("bad flag")

    register_plugin(SetUp(), "set_up")
    add_plugin_arguments(ArgumentParser(), plugin_manager)
    with pytest.raises(ValueError):
        plugin_manager.call_setup("configure", "set_up", args=setup_args, report=None)
    # add_arguments runs twice per plugin: on a scratch parser (the clash check), then on the real one
    assert [(hook, plugin, error) for hook, plugin, _, error in recorder.events if plugin == "set_up"] == [
        ("add_arguments", "set_up", None),
        ("add_arguments", "set_up", None),
        ("configure", "set_up", "ValueError: bad flag"),
    ]
    assert sorted({p for h, p, _, _ in recorder.events if h == "add_arguments"}) == plugin_manager.names_for(
        "add_arguments")


def test_set_up_call_inside_a_running_loop_starts_no_thread_and_no_loop(plugin_manager, register_plugin,
                                                                         setup_args):
    """An ``async def`` observer of a set-up call made inside a running loop is scheduled on that loop."""
    seen = []

    class AsyncRecorder:
        @hookimpl
        async def on_hook_call(self, hook, plugin):
            seen.append((hook, plugin, asyncio.get_running_loop(), threading.get_ident()))

    class SetUp:
        @hookimpl
        def configure(self, args, report):
            return None

    register_plugin(AsyncRecorder(), "async_recorder")
    register_plugin(SetUp(), "set_up")

    async def main():
        threads = threading.active_count()
        plugin_manager.call_setup("configure", "set_up", args=setup_args, report=None)
        assert threading.active_count() == threads
        await asyncio.sleep(0)
        return asyncio.get_running_loop()

    loop = asyncio.run(main())
    assert seen == [("configure", "set_up", loop, threading.get_ident())]


def test_trace_hooks_logs_every_call(monkeypatch, caplog, config):
    monkeypatch.setenv("FURLONG_TRACE_HOOKS", "1")
    pm = get_plugin_manager()
    assert pm.trace_calls is True

    class Reward:
        @hookimpl
        def reward(self, samples):
            return [1.0] * len(samples)

    pm.register_checked(Reward(), "traced_reward")
    with caplog.at_level(logging.INFO, logger="furlong.plugins"):
        asyncio.run(pm.call_chosen("reward", "traced_reward", "--rm-type", config=config, samples=["a", "b"]))
    assert [r.getMessage() for r in caplog.records if r.name == "furlong.plugins"] == [
        "hook reward[traced_reward](config=RunConfig, samples=list) -> [1.0, 1.0]"
    ]


def test_hooks_of_and_origin_describe_in_process_plugins(plugin_manager, register_plugin):
    class Both:
        @hookimpl
        def reward(self, config, samples):
            return [0.0]

        @hookimpl
        def filter(self, config, samples, rollout_id):
            return True

    register_plugin(Both(), "both")
    assert plugin_manager.hooks_of("both") == ["filter", "reward"]
    assert plugin_manager.hooks_of("nobody") == []
    assert plugin_manager.origin("both") == "registered in-process"


def test_a_distribution_whose_metadata_cannot_be_read_is_left_out(monkeypatch, tmp_path):
    """A *.dist-info without METADATA (a broken install, or pip writing one in another process) stopped every
    command with MetadataNotFound; it offers no plugin, and the others are still found."""
    import importlib.metadata as md

    from furlong.core.plugins import discovery

    info = tmp_path / "half_written-1.0.dist-info"
    info.mkdir()
    (info / "entry_points.txt").write_text("[furlong]\nhalf = half_written:plugin\n")

    class HalfWritten(md.PathDistribution):
        def read_text(self, filename):
            if filename in ("METADATA", "PKG-INFO", ""):
                raise FileNotFoundError(filename)
            return super().read_text(filename)

    installed = list(md.distributions())
    before = read_entry_points()
    monkeypatch.setattr(discovery.md, "distributions", lambda: [HalfWritten(info), *installed])
    assert read_entry_points() == before and "half" not in {r.name for r in before}
