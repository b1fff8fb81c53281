"""The execution seam: the loop drives workers and engines through the executor the `executor` hook returns.

A recording executor (the local one, with every worker call and engine phase written
down) shows what crosses the seam: plain calls by name, each rank's share of the batch,
weight buckets bounded by ``--update-weight-buffer-size``, engine phases in SGLang's order.
"""

import argparse
import asyncio
import pickle

import pytest
import torch

from furlong.builtin_plugins.executors.local import InProcessWorkers, LocalExecutor
from furlong.core.config import parse_args
from furlong.core.engine_set import EngineFactory, EngineSet
from furlong.core.loop import run
from furlong.core.selection import resolve_selection
from furlong.core.train_group import _share
from furlong.core.train_worker import TrainWorker, WorkerFactory
from furlong.hooks import Executor, GenerateOutput, PluginError, TrainBatch, WorkerGroup, hookimpl


@pytest.fixture
def tiny(tiny_model_dir, arithmetic_jsonl):
    return tiny_model_dir, arithmetic_jsonl


class RecordingWorkers(InProcessWorkers):
    def __init__(self, worker, calls):
        super().__init__(worker)
        self.calls = calls

    async def call(self, method, args_per_rank):
        result = await super().call(method, args_per_rank)
        self.calls.append((method, args_per_rank[0], result[0]))
        return result


class PhaseRecorder:
    """Wraps an engine and writes down every weight-update phase."""

    def __init__(self, engine, phases):
        self.engine, self.phases = engine, phases
        self.tokenizer = engine.tokenizer

    def __getattr__(self, name):
        method = getattr(self.engine, name)

        async def recorded(*args):
            if name != "generate":
                self.phases.append((name, *[a if name != "load_weights" else [n for n, _ in a] for a in args]))
            return await method(*args)

        return recorded


class RecordingExecutor(LocalExecutor):
    def __init__(self):
        self.calls, self.phases = [], []

    async def start_train_workers(self, args, make_worker):
        return RecordingWorkers(make_worker(0, 1), self.calls)

    async def start_engines(self, args, make_engine):
        return [PhaseRecorder(await make_engine(0), self.phases)]

    @hookimpl
    def executor(self, args):
        return self


@pytest.fixture
def recording(register_plugin):
    """The recording executor, registered as plugin ``recording`` (``--executor recording``)."""
    executor = RecordingExecutor()
    register_plugin(executor, "recording")
    return executor


def _args(tiny, tmp_path, pm, *extra):
    model, data = tiny
    return parse_args(["--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
                       "--global-batch-size", "4", "--micro-batch-size", "1", "--hf-checkpoint", str(model),
                       "--prompt-data", str(data), "--input-key", "prompt", "--label-key", "label",
                       "--rm-type", "deterministic_random", "--rollout-max-response-len", "6",
                       "--save", str(tmp_path / "run"), "--save-interval", "1", *extra], pm, command="train")


def test_hook_executor_places_workers_and_engines_and_the_loop_drives_them(tiny, tmp_path, plugin_manager,
                                                                           recording):
    args = _args(tiny, tmp_path, plugin_manager, "--executor", "recording", "--update-weight-buffer-size", "2000")
    asyncio.run(run(args, plugin_manager, resolve_selection(args, plugin_manager)))

    methods = [m for m, _, _ in recording.calls]
    assert methods[0] == "init" and methods.count("train") == 2 and methods.count("save") == 2
    trains = [(a, r) for m, a, r in recording.calls if m == "train"]
    rollout_id, share = trains[0][0]
    assert rollout_id == 0 and len(share.batch.tokens) == 4 and share.batch.steps == [[[0], [1], [2], [3]]]
    assert share.batch.objective is None  # the worker builds the objective; nothing with a plugin manager travels
    pickle.dumps(share)
    # every sync: one pass over the weights, buckets of at most 2000 bytes unless one tensor is larger
    buckets = [r for m, _, r in recording.calls if m == "next_weight_bucket" and r is not None]
    assert len(buckets) > 3
    assert all(b.nbytes <= 2000 or len(b.names) == 1 for b in buckets)
    names = [n for b in buckets for n in b.names]
    syncs = methods.count("begin_weights")
    assert syncs == 3  # before rollout 0, after rollouts 0 and 1
    assert len(names) == syncs * len(set(names))
    # the engine phases of one sync, in SGLang's order (pause retracts by default)
    first = recording.phases[: recording.phases.index(("continue_generation",)) + 1]
    assert first[:2] == [("pause_generation", "retract"), ("flush_cache",)]
    assert [p[0] for p in first[2:-2]] == ["load_weights"] * len(first[2:-2])
    assert first[-2:] == [("set_weight_version", 1), ("continue_generation",)]
    assert [p for p in recording.phases if p[0] == "set_weight_version"] == [("set_weight_version", v) for v in (1, 2, 3)]


def test_pause_in_place_skips_the_cache_flush(tiny, tmp_path, plugin_manager, recording):
    args = _args(tiny, tmp_path, plugin_manager, "--executor", "recording", "--pause-generation-mode", "in_place")
    args.num_rollout = 0
    asyncio.run(run(args, plugin_manager, resolve_selection(args, plugin_manager)))
    assert [p[0] for p in recording.phases] == ["pause_generation", "load_weights", "set_weight_version",
                                                 "continue_generation"]


def test_a_rank_s_share_is_its_own_batch_with_local_micro_batches():
    batch = TrainBatch(tokens=[[i] * (i + 2) for i in range(6)], response_lengths=[1] * 6,
                       loss_masks=[torch.ones(1) for _ in range(6)], truncated=[False] * 6,
                       sample_indices=list(range(10, 16)), temperature=0.7)
    share = _share(batch, [[[1, 3], [5]], [[4]]])
    assert share.sample_ids == [1, 3, 5, 4]
    assert share.batch.steps == [[[0, 1], [2]], [[3]]]
    assert share.batch.tokens == [batch.tokens[i] for i in (1, 3, 5, 4)]
    assert share.batch.sample_indices == [11, 13, 15, 14] and share.batch.temperature == 0.7


def test_factories_travel_without_the_plugin_manager(plugin_manager):
    args = parse_args(["--num-rollout", "1", "--rollout-batch-size", "16", "--global-batch-size", "16"],
                      plugin_manager, command="train")
    worker = WorkerFactory(args, {"train_backend": ("fsdp", "--train-backend"), "loss": ("policy_loss", "--loss-type")},
                           plugin_manager)
    engine = EngineFactory(args, ("embedded", "--rollout-backend"), plugin_manager)
    assert worker(1, 2).pm is plugin_manager  # in-process: the driver's manager
    copy = pickle.loads(pickle.dumps(worker))
    built = copy(1, 2)
    assert isinstance(built, TrainWorker) and built.pm is None and (built.rank, built.world) == (1, 2)
    assert pickle.loads(pickle.dumps(engine)).pm is None


def test_local_executor_meets_the_protocols():
    local = LocalExecutor()
    assert isinstance(local, Executor)
    assert isinstance(asyncio.run(local.start_train_workers(None, lambda r, w: object())), WorkerGroup)


class Counting:
    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, []

    async def generate(self, input_ids, sampling_params):
        self.calls.append(input_ids)
        await asyncio.sleep(0.01)
        return GenerateOutput(output_ids=[1], output_log_probs=[0.0], finish_reason="stop", weight_version="1")

    async def abort(self):
        self.calls.append("abort")


def test_an_engine_set_spreads_requests_and_broadcasts_control_calls():
    engines = [Counting("tok"), Counting("tok")]
    pool = EngineSet(engines)

    async def main():
        await asyncio.gather(*(pool.generate([i], {}) for i in range(6)))
        await pool.abort()

    asyncio.run(main())
    assert pool.tokenizer == "tok"
    assert [len([c for c in e.calls if c != "abort"]) for e in engines] == [3, 3]
    assert all(e.calls[-1] == "abort" for e in engines)


def test_colocate_takes_turns_on_the_device_in_spec_order(tiny, tmp_path, plugin_manager, recording):
    args = _args(tiny, tmp_path, plugin_manager, "--executor", "recording", "--colocate")
    assert args.offload_train and args.offload_rollout  # implied by --colocate
    args.num_rollout = 1
    asyncio.run(run(args, plugin_manager, resolve_selection(args, plugin_manager)))
    engine = [p[0] for p in recording.phases if p[0] in ("release_memory", "resume_memory", "set_weight_version")]
    assert engine == ["release_memory", "resume_memory", "set_weight_version",  # start, first sync
                      "release_memory", "resume_memory", "set_weight_version"]  # after generate, before the sync
    trainer = [m for m, _, _ in recording.calls if m in ("init", "offload", "onload", "train", "begin_weights")]
    assert trainer == ["init", "offload", "begin_weights", "onload", "train", "offload", "begin_weights"]


def test_an_executor_plugin_returning_the_wrong_object_is_named(tiny, tmp_path, plugin_manager, register_plugin):
    class Plugin:
        @hookimpl
        def executor(self, args):
            return "nope"

    register_plugin(Plugin(), "wrong")
    args = _args(tiny, tmp_path, plugin_manager, "--executor", "wrong")
    with pytest.raises(PluginError) as err:
        asyncio.run(run(args, plugin_manager, resolve_selection(args, plugin_manager)))
    assert str(err.value) == ("--executor 'wrong': `executor` returned str, which lacks is_driver, weights_in_process, "
                              "start_train_workers, start_engines, serve, shutdown; return an object meeting "
                              "furlong.hooks.Executor.")


def test_ray_configure_checks_that_an_engine_fits_a_node():
    from furlong.builtin_plugins.executors.ray_executor import configure
    from furlong.hooks.config_report import ConfigReport

    report = ConfigReport("ray", ("--executor",))
    configure(argparse.Namespace(rollout_num_gpus_per_engine=4, num_gpus_per_node=2), report)
    assert report.errors == ["--rollout-num-gpus-per-engine 4 is more than --num-gpus-per-node 2: an engine spanning "
                             "nodes is not supported yet."]
    fits = ConfigReport("ray", ("--executor",))
    configure(argparse.Namespace(rollout_num_gpus_per_engine=2, num_gpus_per_node=2), fits)
    assert fits.errors == []
