"""Miles' evaluation flags: the dedicated eval fleet (``--eval-num-gpus`` with its snapshots, in-flight bound and
overflow policy) and ``--eval-function-path``, end to end on the demo model and piece by piece."""

import asyncio
import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from furlong.core.config.launch_args import launch_config
from furlong.hooks import PluginError

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo"
TIMING = ("perf/eval_time", "eval/lag_steps", "eval/duration_seconds", "eval/export_time_seconds", "time")
GATE_TIMING = ("eval/duration_seconds", "eval/export_time_seconds")


@pytest.fixture(scope="module")
def demo_eval_set(tmp_path_factory):
    """The first 4 prompts of the demo's test set."""
    path = tmp_path_factory.mktemp("eval") / "test4.jsonl"
    path.write_text("".join((DEMO / "data" / "test.jsonl").read_text().splitlines(True)[:4]))
    return path


def _run(out: Path, eval_set: Path, *extra: str, command: str = "train") -> list[dict]:
    from furlong.core.plugins.manager import get_plugin_manager
    from furlong.core.plugins.selection import resolve_selection
    from furlong.core.run.loop import run

    argv = ["--hf-checkpoint", str(DEMO / "model"), "--prompt-data", str(DEMO / "data" / "train.jsonl"),
            "--input-key", "prompt", "--label-key", "label", "--rm-type", "deterministic_random",
            "--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
            "--rollout-max-response-len", "4", "--lr", "3e-3", "--seed", "5",
            "--eval-prompt-data", "t", str(eval_set), "--eval-interval", "1", "--n-samples-per-eval-prompt", "2",
            "--eval-max-response-len", "6", "--log-dir", str(out), *extra]
    pm = get_plugin_manager()
    config = launch_config(*argv, pm=pm, command=command)
    asyncio.run(run(config, pm, resolve_selection(config, pm)))
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _evals(rows: list[dict]) -> list[dict]:
    """The eval rows, without timings, in rollout order (the fleet logs a row when its evaluation ends)."""
    evals = [{k: v for k, v in r.items() if k not in TIMING} for r in rows if "eval/step" in r]
    return sorted(evals, key=lambda r: r["eval/step"])


@pytest.mark.timeout(240)
@pytest.mark.usefixtures("cpu_machine", "one_torch_thread")
@pytest.mark.parametrize("command", ["train", "train-async"])
def test_the_fleet_logs_the_inline_evaluation_at_the_same_rollouts(tmp_path, demo_eval_set, command):
    inline = _run(tmp_path / "inline", demo_eval_set, command=command)
    fleet = _run(tmp_path / "fleet", demo_eval_set, "--eval-num-gpus", "1", "--eval-hf-dir", str(tmp_path / "snap"),
                 "--eval-keep-snapshots", "1", command=command)
    assert _evals(fleet) == _evals(inline)
    steps = [r["eval/step"] for r in _evals(fleet)]
    assert steps == [0, 0, 1]  # before training (the --hf-checkpoint weights), after rollouts 0 and 1
    after = [r for r in fleet if "eval/step" in r and "eval/export_time_seconds" in r]
    assert [r["eval/step"] for r in after] == [0, 1]  # the start's evaluation loads --hf-checkpoint: no export
    assert all(r["eval/lag_steps"] >= 0 and r["eval/duration_seconds"] > 0 for r in after)
    # the weights changed (the evaluations differ), and one retired snapshot is kept
    lengths = [r["eval/t/response_len/mean"] for r in _evals(fleet)]
    assert lengths[0] != lengths[2], lengths
    assert sorted(os.listdir(tmp_path / "snap")) == ["step_1"]


@pytest.fixture
def eval_functions(tmp_path, monkeypatch):
    """A module ``my_eval`` with a Miles-style eval function recording its calls in ``my_eval.CALLS``."""
    (tmp_path / "my_eval.py").write_text(textwrap.dedent("""
        CALLS = []

        async def evaluate(args, rollout_id, data_source, evaluation=False):
            sets = data_source.eval_sets
            CALLS.append((rollout_id, evaluation, [s.name for s in sets], args.n_samples_per_eval_prompt,
                          data_source.hf_dir))
            data = {}
            for s in sets:
                groups = s.groups()
                for group in groups:
                    await data_source.generate_group(group, s.sampling_params)
                samples = [x for g in groups for x in g]
                data[s.name] = {"rewards": [float(i % 2) for i in range(len(samples))], "samples": samples,
                                "truncated": [x.status.value == "truncated" for x in samples]}
            return data, {"eval/my_metric": 10.0 + rollout_id}
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("my_eval", None)


@pytest.mark.timeout(240)
@pytest.mark.usefixtures("cpu_machine", "one_torch_thread", "eval_functions")
@pytest.mark.parametrize("where", ["inline", "fleet"])
def test_a_custom_eval_function_is_called_miles_style_and_its_result_logged(tmp_path, demo_eval_set, where):
    snap = tmp_path / "snap"
    fleet = ["--eval-num-gpus", "1", "--eval-hf-dir", str(snap)] if where == "fleet" else []
    rows = _run(tmp_path / "out", demo_eval_set, "--eval-function-path", "my_eval.evaluate",
                "--skip-eval-before-train", *fleet)
    import my_eval

    hf_dirs = [os.path.join(snap, f"step_{r}") if fleet else None for r in (0, 1)]
    assert my_eval.CALLS == [(0, True, ["t"], 2, hf_dirs[0]), (1, True, ["t"], 2, hf_dirs[1])]
    evals = _evals(rows)
    assert [r["eval/step"] for r in evals] == [0, 1]
    for r in evals:  # 8 samples, rewards 0 1 0 1 ...: the mean is 0.5
        assert r["eval/t"] == 0.5 and r["eval/t-none_reward_ratio"] == 0.0
        assert r["eval/my_metric"] == 10.0 + r["eval/step"]
        assert "eval/t/response_len/mean" in r and "eval/t-truncated_ratio" in r


def test_eval_function_results_are_read_in_miles_forms_and_checked():
    from furlong.core.rollout.eval_function import read_result

    data = {"t": {"rewards": [1.0, None]}}

    class Output:  # Miles' RolloutFnEvalOutput
        def __init__(self):
            self.data, self.metrics = data, {"eval/x": 1.0}

    assert read_result(data, "f") == (data, {})
    assert read_result((data, {"eval/x": 1.0}), "f") == (data, {"eval/x": 1.0})
    assert read_result(Output(), "f") == (data, {"eval/x": 1.0})
    with pytest.raises(PluginError, match='eval set \'t\' has no "rewards" list'):
        read_result({"t": {"scores": [1.0]}}, "f")
    with pytest.raises(PluginError, match='has 1 "samples" for 2 rewards'):
        read_result({"t": {"rewards": [1.0, 0.0], "samples": [None]}}, "f")
    with pytest.raises(PluginError, match="returned list"):
        read_result([1.0], "f")


@pytest.mark.usefixtures("cpu_machine")
def test_a_class_as_eval_function_is_refused_with_the_form_to_use(tmp_path, monkeypatch, demo_eval_set):
    from furlong.core.plugins.manager import get_plugin_manager
    from furlong.core.plugins.selection import resolve_selection

    (tmp_path / "my_class_eval.py").write_text("class Eval:\n    def __init__(self, input):\n        pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    pm = get_plugin_manager()
    with pytest.raises(PluginError, match="is a class; Miles' class-based eval functions"):
        config = launch_config("--hf-checkpoint", str(DEMO / "model"), "--prompt-data", str(demo_eval_set),
                               "--rm-type", "math", "--eval-prompt-data", "t", str(demo_eval_set),
                               "--eval-interval", "1", "--eval-function-path", "my_class_eval.Eval", pm=pm)
        resolve_selection(config, pm)
    sys.modules.pop("my_class_eval", None)


@pytest.mark.usefixtures("cpu_machine")
def test_miles_own_eval_function_is_the_built_in_evaluation(demo_eval_set):
    from furlong.core.plugins.manager import get_plugin_manager
    from furlong.core.plugins.selection import resolve_selection

    pm = get_plugin_manager()
    config = launch_config("--hf-checkpoint", str(DEMO / "model"), "--prompt-data", str(demo_eval_set),
                           "--rm-type", "math", "--eval-prompt-data", "t", str(demo_eval_set), "--eval-interval", "1",
                           "--eval-function-path", "miles.rollout.sglang_rollout.generate_rollout", pm=pm)
    assert "eval_function" not in resolve_selection(config, pm).paths
    with pytest.raises(PluginError, match="leave --eval-function-path out for furlong's built-in evaluation"):
        launch_config("--hf-checkpoint", str(DEMO / "model"), "--prompt-data", str(demo_eval_set), "--rm-type",
                      "math", "--eval-prompt-data", "t", str(demo_eval_set), "--eval-interval", "1",
                      "--eval-function-path", "miles.rollout.sglang_rollout.eval_rollout", pm=pm)


# --- the dispatch: in-flight bound, overflow policy, snapshots ------------------------------------------------


class _Gates:
    """An evaluation per rollout id that ends when the test opens its gate; the export writes a real HF directory."""

    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir
        self.gates: dict[int, asyncio.Event] = {}
        self.started: list[int] = []
        self.starts: list[bool] = []  # each evaluation's start flag (the weights a rollout starts from)
        self.logged: list[tuple[int, dict]] = []

    async def evaluate(self, rollout_id: int, hf_dir: str, start: bool = False) -> dict:
        self.started.append(rollout_id)
        self.starts.append(start)
        await self.gates.setdefault(rollout_id, asyncio.Event()).wait()
        if rollout_id == 99:
            raise PluginError("the eval set could not be scored")
        return {"eval/t": float(rollout_id)}

    async def export(self, path: str) -> None:
        import shutil

        shutil.copytree(self.model_dir, path)

    async def log_point(self, rollout_id: int, metrics: dict) -> None:
        self.logged.append((rollout_id, {k: v for k, v in metrics.items() if k not in GATE_TIMING}))

    def open(self, rollout_id: int) -> None:
        self.gates.setdefault(rollout_id, asyncio.Event()).set()


def _fleet(tmp_path, tiny_model_dir, data, *flags: str):
    from furlong.builtin_plugins.engines.embedded import load_engine
    from furlong.core.run.eval_fleet import EvalFleet

    config = launch_config("--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(data), "--rm-type", "math",
                           "--eval-prompt-data", "t", str(data), "--eval-interval", "1", "--eval-num-gpus", "1",
                           "--eval-hf-dir", str(tmp_path / "snap"), *flags)
    gates = _Gates(str(tiny_model_dir))
    engine = load_engine(str(tiny_model_dir), max_batch_size=2)
    return EvalFleet(config, [engine], gates.evaluate, gates.export, gates.log_point, lambda: 5), gates


async def _settled() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def _until(condition) -> None:
    """Wait until ``condition()`` holds (the snapshot loads in a worker thread first); at most 60 s."""
    for _ in range(6000):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the condition never held")


@pytest.mark.usefixtures("cpu_machine", "one_torch_thread")
def test_skip_drops_a_point_beyond_the_bound_and_logs_it(tmp_path, tiny_model_dir, arithmetic_jsonl):
    async def go():
        fleet, gates = _fleet(tmp_path, tiny_model_dir, arithmetic_jsonl, "--eval-max-in-flight", "1", "--eval-overflow-policy", "skip")
        await fleet.dispatch(0, start=True)
        await _settled()
        await fleet.dispatch(1)  # 0 still runs: dropped, logged at once
        assert gates.logged == [(1, {"eval/skipped_busy": 1})]
        last = asyncio.ensure_future(fleet.dispatch(2, force=True))  # the run's last point waits for 0 instead
        await _settled()
        assert not last.done()
        gates.open(0)
        await last
        gates.open(2)
        await fleet.drain()
        return gates

    gates = asyncio.run(go())
    assert gates.started == [0, 2]
    assert gates.starts == [True, False]  # the start's evaluation says so in its errors ("before rollout 0")
    assert gates.logged == [(1, {"eval/skipped_busy": 1}), (0, {"eval/t": 0.0, "eval/lag_steps": 5}),
                            (2, {"eval/t": 2.0, "eval/lag_steps": 3})]  # lag: training is at rollout 5


def _ignoring_lag(logged):
    return [(r, {k: v for k, v in m.items() if k != "eval/lag_steps"}) for r, m in logged]


@pytest.mark.usefixtures("cpu_machine", "one_torch_thread")
def test_backpressure_waits_for_the_oldest_and_snapshots_are_kept_as_asked(tmp_path, tiny_model_dir, arithmetic_jsonl):
    async def go():
        fleet, gates = _fleet(tmp_path, tiny_model_dir, arithmetic_jsonl, "--eval-max-in-flight", "2", "--eval-keep-snapshots", "1")
        await fleet.dispatch(0)
        await fleet.dispatch(1)
        await _until(lambda: gates.started == [0])
        third = asyncio.ensure_future(fleet.dispatch(2))  # two pending: waits for rollout 0's evaluation
        await _settled()
        assert not third.done() and gates.started == [0]
        assert sorted(os.listdir(tmp_path / "snap")) == ["step_0", "step_1"]
        gates.open(0)
        await third
        assert [r for r, _ in gates.logged] == [0]
        for r in (1, 2):
            gates.open(r)
        await fleet.drain()
        return gates

    gates = asyncio.run(go())
    assert _ignoring_lag(gates.logged) == [(0, {"eval/t": 0.0}), (1, {"eval/t": 1.0}), (2, {"eval/t": 2.0})]
    assert gates.started == [0, 1, 2]  # one evaluation at a time, in order
    assert sorted(os.listdir(tmp_path / "snap")) == ["step_2"]  # --eval-keep-snapshots 1


@pytest.mark.usefixtures("cpu_machine", "one_torch_thread")
def test_a_failed_or_missing_snapshot_evaluation_is_a_skipped_point(tmp_path, tiny_model_dir, arithmetic_jsonl):
    async def go():
        fleet, gates = _fleet(tmp_path, tiny_model_dir, arithmetic_jsonl, "--eval-keep-snapshots", "0")
        gates.open(99)
        await fleet.dispatch(99)
        fleet.export = None  # no trainer: the snapshot of rollout 3 is not there
        await fleet.dispatch(3)
        await fleet.drain()
        return gates

    gates = asyncio.run(go())
    assert sorted(gates.logged, key=lambda x: x[0]) == [(3, {"eval/skipped_ckpt_missing": 1}),
                                                         (99, {"eval/skipped_crashed": 1})]
    assert os.listdir(tmp_path / "snap") == []  # --eval-keep-snapshots 0: retired at once


# --- flags ---------------------------------------------------------------------------------------------------


def _problems(*flags: str) -> str:
    from furlong.core.config import ConfigError

    with pytest.raises(ConfigError) as info:
        launch_config("--hf-checkpoint", str(DEMO / "model"), "--prompt-data", str(DEMO / "data" / "test.jsonl"),
                      "--rm-type", "math", *flags)
    return str(info.value)


@pytest.mark.usefixtures("cpu_machine")
def test_fleet_flags_are_checked_with_what_to_do(demo_eval_set):
    ev = ("--eval-prompt-data", "t", str(demo_eval_set), "--eval-interval", "2")
    assert "--eval-hf-dir DIR" in _problems(*ev, "--eval-num-gpus", "1")
    assert "must be a multiple of --save-interval" in _problems(*ev, "--eval-num-gpus", "1", "--save", "/tmp/x",
                                                                "--save-hf", "/tmp/x/hf_{rollout_id}",
                                                                "--save-interval", "3")
    assert "multiple of --eval-num-gpus-per-engine" in _problems(*ev, "--eval-num-gpus", "3",
                                                                 "--eval-num-gpus-per-engine", "2",
                                                                 "--eval-hf-dir", "/tmp/s")
    assert "give --eval-interval N" in _problems("--eval-num-gpus", "1", "--eval-hf-dir", "/tmp/s")
    assert "(choose from 'backpressure', 'skip')" in _problems(*ev, "--eval-num-gpus", "1", "--eval-hf-dir", "/tmp/s",
                                              "--eval-overflow-policy", "drop")
    assert "--eval-max-in-flight must be at least 1" in _problems(*ev, "--eval-num-gpus", "1", "--eval-hf-dir",
                                                                  "/tmp/s", "--eval-max-in-flight", "0")
    assert "--debug-rollout-only runs only one" in _problems(*ev, "--eval-num-gpus", "1", "--eval-hf-dir", "/tmp/s",
                                                             "--debug-rollout-only")


@pytest.mark.usefixtures("cpu_machine")
def test_snapshot_flags_without_the_fleet_say_they_do_nothing(demo_eval_set, caplog):
    import logging

    caplog.set_level(logging.WARNING, logger="furlong.config")
    launch_config("--hf-checkpoint", str(DEMO / "model"), "--prompt-data", str(demo_eval_set), "--rm-type", "math",
                  "--eval-hf-dir", "/tmp/s", "--eval-max-in-flight", "3")
    assert "--eval-hf-dir, --eval-max-in-flight configure the dedicated eval fleet and does nothing without " \
           "--eval-num-gpus N" in caplog.text


@pytest.mark.usefixtures("cpu_machine")
def test_an_sglang_fleet_cannot_attach_to_external_servers(demo_eval_set):
    problems = _problems("--eval-prompt-data", "t", str(demo_eval_set), "--eval-interval", "1", "--eval-num-gpus",
                         "1", "--eval-hf-dir", "/tmp/s", "--rollout-backend", "sglang", "--rollout-external",
                         "--rollout-external-engine-addrs", "127.0.0.1:30000")
    assert "--eval-num-gpus starts SGLang servers of its own for the eval fleet" in problems
