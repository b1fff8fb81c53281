"""The execution seam: the loop drives workers and engines through the executor the `executor` hook returns.

A recording executor (the local one, with every worker call and engine phase written
down) shows what crosses the seam: plain calls by name, each rank's share of the batch,
weight buckets bounded by ``--update-weight-buffer-size``, engine phases in SGLang's order.
"""

import asyncio
import pickle

import pytest
import torch

from furlong.builtin_plugins.executors.local import InProcessWorkers, LocalExecutor
from furlong.core.rollout.engines import EngineFactory, EngineSet
from furlong.core.config.launch_args import launch_args, launch_config
from furlong.core.run.loop import run
from furlong.core.plugins.selection import resolve_selection
from furlong.core.train.advantage_stages import compute_advantages
from furlong.core.train.batching import plan_steps
from furlong.core.train.objective import StepObjective
from furlong.core.train.data import (advantage_input, flatten, post_process_rewards, to_train_batch, trajectory_ids,
                                     truncated_flags)
from furlong.core.train.group import TrainGroup, _global_denominators, _share
from furlong.core.train.worker import TrainWorker, WorkerFactory
from furlong.hooks import (Executor, GenerateOutput, ParallelLayout, PluginError, Sample, Status, TrainBatch,
                           WorkerGroup, hookimpl)


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

    async def start_train_workers(self, config, make_worker):
        return RecordingWorkers(make_worker(0, 1), self.calls)

    async def start_engines(self, config, make_engine):
        return [PhaseRecorder(await make_engine(0), self.phases)]

    @hookimpl
    def executor(self, config):
        return self


@pytest.fixture
def recording(register_plugin):
    """The recording executor, registered as plugin ``recording`` (``--executor recording``)."""
    executor = RecordingExecutor()
    register_plugin(executor, "recording")
    return executor


def _config(tiny, tmp_path, pm, *extra, **overrides):
    model, data = tiny
    return launch_config("--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
                         "--global-batch-size", "4", "--micro-batch-size", "1", "--hf-checkpoint", str(model),
                         "--prompt-data", str(data), "--input-key", "prompt", "--label-key", "label",
                         "--rm-type", "deterministic_random", "--rollout-max-response-len", "6",
                         "--save", str(tmp_path / "run"), "--save-interval", "1", *extra, pm=pm, **overrides)


def test_hook_executor_places_workers_and_engines_and_the_loop_drives_them(tiny, tmp_path, plugin_manager,
                                                                           recording):
    config = _config(tiny, tmp_path, plugin_manager, "--executor", "recording", "--update-weight-buffer-size", "2000")
    asyncio.run(run(config, plugin_manager, resolve_selection(config, plugin_manager)))

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
    versions = [p for p in recording.phases if p[0] == "set_weight_version"]
    assert versions == [("set_weight_version", v) for v in (1, 2, 3)]


def test_pause_in_place_skips_the_cache_flush(tiny, tmp_path, plugin_manager, recording):
    config = _config(tiny, tmp_path, plugin_manager, "--executor", "recording", "--pause-generation-mode", "in_place",
                     num_rollout=0)
    asyncio.run(run(config, plugin_manager, resolve_selection(config, plugin_manager)))
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
    config = launch_config("--num-rollout", "1", "--rollout-batch-size", "16", "--global-batch-size", "16",
                         pm=plugin_manager)
    worker = WorkerFactory(config, {"train_backend": ("fsdp", "--train-backend"),
                                    "loss": ("policy_loss", "--loss-type")}, plugin_manager)
    engine = EngineFactory(config, ("embedded", "--rollout-backend"), plugin_manager)
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
    config = _config(tiny, tmp_path, plugin_manager, "--executor", "recording", "--colocate", num_rollout=1)
    assert config.offload_train and config.offload_rollout  # implied by --colocate
    asyncio.run(run(config, plugin_manager, resolve_selection(config, plugin_manager)))
    engine = [p[0] for p in recording.phases if p[0] in ("release_memory", "resume_memory", "set_weight_version")]
    assert engine == ["release_memory", "resume_memory", "set_weight_version",  # start, first sync
                      "release_memory", "resume_memory", "set_weight_version"]  # after generate, before the sync
    trainer = [m for m, _, _ in recording.calls if m in ("init", "offload", "onload", "train", "begin_weights")]
    assert trainer == ["init", "offload", "begin_weights", "onload", "train", "offload", "begin_weights"]


@pytest.mark.parametrize("flags, cleared", [((), 0), (("--colocate", "--no-offload-train"), 1)])
def test_the_trainer_s_cache_is_emptied_only_for_engines_sharing_its_gpus(tiny, tmp_path, plugin_manager, recording,
                                                                          flags, cleared):
    config = _config(tiny, tmp_path, plugin_manager, "--executor", "recording", *flags, num_rollout=1)
    asyncio.run(run(config, plugin_manager, resolve_selection(config, plugin_manager)))
    methods = [m for m, _, _ in recording.calls]
    assert methods.count("clear_memory") == cleared and methods.count("offload") == 0
    if cleared:
        assert methods.index("clear_memory") > methods.index("train")


def test_an_executor_plugin_returning_the_wrong_object_is_named(tiny, tmp_path, plugin_manager, register_plugin):
    class Plugin:
        @hookimpl
        def executor(self, config):
            return "nope"

    register_plugin(Plugin(), "wrong")
    config = _config(tiny, tmp_path, plugin_manager, "--executor", "wrong")
    with pytest.raises(PluginError) as err:
        asyncio.run(run(config, plugin_manager, resolve_selection(config, plugin_manager)))
    assert str(err.value) == ("--executor 'wrong': `executor` returned str, which lacks is_driver, weights_in_process, "
                              "start_train_workers, start_engines, start_rollout_side, serve, shutdown; return an "
                              "object meeting furlong.hooks.Executor.")


def test_ray_configure_checks_engines_and_machine_size_on_gpus(monkeypatch):
    from furlong.builtin_plugins.executors import ray_executor
    from furlong.hooks.config_report import ConfigReport

    def check(gpus, ray=True, **flags):
        monkeypatch.setattr(ray_executor, "_ray_installed", lambda: ray)
        monkeypatch.setattr(ray_executor, "_has_gpus", lambda: gpus > 0)
        monkeypatch.setattr(ray_executor, "_gpu_count", lambda: gpus)
        values = dict(rollout_num_gpus_per_engine=1, num_gpus_per_node=8, actor_num_nodes=1,
                      actor_num_gpus_per_node=4, rollout_num_gpus=None, colocate=False, ray_call_timeout=3600.0,
                      ray_engine_restarts=3)
        report = ConfigReport("ray", ("--executor",))
        ray_executor.configure(launch_args(**{**values, **flags}), report)
        return report.errors

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert check(8, rollout_num_gpus=4) == []
    assert check(0, rollout_num_gpus_per_engine=4, num_gpus_per_node=1) == []  # CPU slots: no node to span
    assert check(8, rollout_num_gpus_per_engine=16, rollout_num_gpus=16) == [
        "--rollout-num-gpus-per-engine 16 is more than --num-gpus-per-node 8: an engine spanning nodes is not "
        "supported yet; use at most 8 GPUs per engine.",
        "--executor ray on this machine needs 20 GPUs (trainer 4, engines 16) but torch sees 8; lower "
        "--actor-num-gpus-per-node or --rollout-num-gpus, or run on a Ray cluster (ray job submit, docs/ray.md)."]
    assert check(4, rollout_num_gpus=4, colocate=True) == []  # colocated: max(4, 4) bundles
    assert check(0, ray=False) == ['--executor ray needs Ray: pip install "furlong[ray]" (or pass --executor local).']
    assert check(0, ray_call_timeout=-5.0, ray_engine_restarts=-1) == [
        "--ray-call-timeout must be a positive number of seconds, got -5.",
        "--ray-engine-restarts must be at least 0, got -1."]
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    assert check(1, rollout_num_gpus=4) == []  # a cluster has its own size


def _fixed_groups(n_groups=4, per_group=2):
    """Rollout groups with fixed tokens, lengths and rewards (ids of the tiny model's vocabulary)."""
    groups = []
    for g in range(n_groups):
        group = []
        for k in range(per_group):
            i = g * per_group + k
            response = [5 + (i * 7 + t) % 40 for t in range(2 + i % 4)]
            group.append(Sample(prompt=f"p{g}", group_index=g, index=i, tokens=[3, 4 + g, 9] + response,
                                response_length=len(response), reward=float((i * 5) % 3 == 0),
                                status=Status.COMPLETED))
        groups.append(group)
    return groups


def test_the_driver_worker_split_reproduces_the_whole_batch_computation_exactly(tiny_model_dir, plugin_manager):
    """Losses, gradient norms and weights of the seam equal one objective over the whole batch in one place."""
    config = launch_config("--hf-checkpoint", str(tiny_model_dir), "--num-rollout", "1", "--rollout-batch-size", "4",
                         "--n-samples-per-prompt", "2", "--global-batch-size", "4", "--micro-batch-size", "2",
                         "--use-kl-loss", "--kl-loss-coef", "0.1", "--lr", "1e-3", pm=plugin_manager)
    selection = resolve_selection(config, plugin_manager)
    chosen = {h: selection.chosen[h] for h in ("train_backend", "loss")}

    async def seam():
        worker = TrainWorker(config, chosen, 0, 1, plugin_manager)
        group = TrainGroup(config, plugin_manager, selection, InProcessWorkers(worker))
        await group.init()
        [metrics] = await group.train(0, _fixed_groups())
        return metrics["train/steps"], await worker.backend.named_weights()

    async def whole_batch():
        backend = await plugin_manager.call_chosen("train_backend", *chosen["train_backend"], config=config)
        await backend.init(config)
        samples = flatten(_fixed_groups())
        raw, rewards = await post_process_rewards(config, samples, plugin_manager, selection)
        batch = to_train_batch(config, samples)
        batch.rewards, batch.truncated, tids = rewards, truncated_flags(samples), trajectory_ids(samples)
        batch.steps = plan_steps(lengths=[len(t) for t in batch.tokens], global_batch_size=4, num_steps=2,
                                 dp_size=1, rank=0, micro_batch_size=2, max_tokens_per_gpu=None, dynamic=False,
                                 balance=False, trajectory_ids=tids)
        batch.ref_log_probs = (await backend.log_probs(batch, model="ref"))["log_probs"]
        batch.old_log_probs = (await backend.log_probs(batch, model="actor"))["log_probs"]
        adv = await compute_advantages(config, plugin_manager, advantage_input(samples, rewards, batch),
                                       *selection.chosen["advantage"])
        batch.advantages, batch.returns = adv.advantages, adv.returns
        batch.objective = StepObjective(config, plugin_manager, batch, *chosen["loss"], trajectory_ids=tids,
                                        **_global_denominators(config, batch, tids, 4, 2))
        return await backend.train(0, batch), await backend.named_weights()

    torch.manual_seed(0)
    steps, weights = asyncio.run(seam())
    torch.manual_seed(0)
    ref_steps, ref_weights = asyncio.run(whole_batch())
    assert len(steps) == 2 and steps == ref_steps  # every metric of both optimizer steps, bit for bit
    assert steps[0]["kl_loss"] == 0.0 and steps[1]["kl_loss"] > 0  # the second step moved away from the reference
    for (name, tensor), (ref_name, ref) in zip(weights, ref_weights):
        assert name == ref_name and torch.equal(tensor, ref)


class TensorParallelPeers:
    """Four fake ranks: two data-parallel ranks, each with a tensor-parallel peer that returns no outputs."""

    size = 4
    layouts = [ParallelLayout(dp_rank=d, dp_size=2, returns_outputs=r == 0, rank=2 * d + r, world=4)
               for d in (0, 1) for r in (0, 1)]

    def __init__(self, reuse: bool = False):
        self.received, self.reuse = {}, reuse

    async def call(self, method, args_per_rank):
        self.received[method] = args_per_rank
        out = []
        for rank, args in enumerate(args_per_rank):
            layout = self.layouts[rank]
            if method == "init":
                out.append((0, layout))
            elif method == "train_forward_gives_old_log_probs":
                out.append(self.reuse)
            elif method in ("log_probs", "train_log_probs"):
                share = args[0]  # the sample's global index, or garbage from a rank whose outputs are not kept
                value = (lambda i: float(i)) if layout.returns_outputs else (lambda i: -1.0)
                out.append({"log_probs": [torch.full((share.batch.response_lengths[k],), value(i))
                                          for k, i in enumerate(share.sample_ids)], "entropy": None})
            else:  # train
                out.append([{"loss": float(layout.dp_rank) if layout.returns_outputs else -1.0}])
        return out


def test_parallel_peers_get_the_same_share_and_only_returning_ranks_are_read(tiny_model_dir, plugin_manager):
    # the ray executor's own check of the machine is left out (configure=False): these ranks are fakes
    config = launch_config("--hf-checkpoint", str(tiny_model_dir), "--num-rollout", "1", "--rollout-batch-size", "4",
                         "--n-samples-per-prompt", "2", "--global-batch-size", "8", "--micro-batch-size", "2",
                         "--actor-num-gpus-per-node", "4", "--executor", "ray", pm=plugin_manager, configure=False,
                         data_parallel_size=2)  # a backend with TP 2 on 4 ranks
    workers = TensorParallelPeers()
    group = TrainGroup(config, plugin_manager, resolve_selection(config, plugin_manager), workers)

    async def main():
        await group.init()
        return await group.train(0, _fixed_groups())

    [metrics] = asyncio.run(main())
    shares = [a[0] for a in workers.received["log_probs"]]
    assert shares[0] is shares[1] and shares[2] is shares[3] and shares[0] is not shares[2]
    assert sorted(shares[0].sample_ids + shares[2].sample_ids) == list(range(8))
    assert metrics["train/steps"] == [{"loss": 0.0}]  # from data-parallel rank 0's returning rank
    trained = [a[1] for a in workers.received["train"]]
    assert trained[0] is trained[1] and trained[2] is trained[3]
    for share in (trained[0], trained[2]):  # old log-probs put back from the returning ranks, by global index
        assert [float(t[0]) for t in share.batch.old_log_probs] == [float(i) for i in share.sample_ids]


def test_pi_old_from_the_training_forward_is_gathered_from_the_returning_ranks(tiny_model_dir, plugin_manager):
    """One step per rollout and a backend whose training forward is its log-prob pass: no log_probs call; the
    old log-probs the ranks' training forwards kept come back by global index for the rollout metrics."""
    # the ray executor's own check of the machine is left out (configure=False): these ranks are fakes
    config = launch_config("--hf-checkpoint", str(tiny_model_dir), "--num-rollout", "1", "--rollout-batch-size", "4",
                         "--n-samples-per-prompt", "2", "--global-batch-size", "8", "--micro-batch-size", "2",
                         "--actor-num-gpus-per-node", "4", "--executor", "ray", pm=plugin_manager, configure=False,
                         data_parallel_size=2)
    workers = TensorParallelPeers(reuse=True)
    group = TrainGroup(config, plugin_manager, resolve_selection(config, plugin_manager), workers)

    async def main():
        await group.init()
        return await group.train(0, _fixed_groups())

    [metrics] = asyncio.run(main())
    assert "log_probs" not in workers.received
    trained = [a[1] for a in workers.received["train"]]
    assert all(share.reuse_old_log_probs and share.batch.old_log_probs is None for share in trained)
    # TP peers' -1 rows are not read; group 2 (samples 4 and 5) got one reward for both, so its zero-advantage
    # samples were not trained (--skip-zero-advantage-samples) and have no pi_old from a training forward
    assert sorted(trained[0].sample_ids + trained[2].sample_ids) == [0, 1, 2, 3, 6, 7]
    assert metrics["rollout/log_probs"] == pytest.approx((0 + 1 + 2 + 3 + 6 + 7) / 6)
    assert metrics["perf/skipped_samples"] == 2.0
