"""One in-process plugin per hook, called through the manager with the core's calling rule.

Each test registers a small plugin implementing one hook with the spec's argument names
and types from ``furlong.hooks``, calls it as the core does (chosen, broadcast, filters in
order, observer) and checks what comes back.
"""

from __future__ import annotations

import asyncio
from argparse import ArgumentParser

import pytest
import torch

from furlong.core.config.launch_args import launch_config
from furlong.core.config.parser import add_plugin_arguments
from furlong.hooks import (
    AdvantageInput,
    AdvantageOutput,
    DataSource,
    FilterResult,
    GenerateOutput,
    LossInput,
    LossOutput,
    ParallelLayout,
    RolloutContext,
    RolloutEngine,
    Sample,
    Status,
    TrainBackend,
    hookimpl,
)


@pytest.fixture(scope="module")
def config():
    """The configuration of a run with every default, as the core hands it to the hooks."""
    return launch_config(configure=False)


class Recorder:
    def __init__(self):
        self.events = []

    @hookimpl
    def on_hook_call(self, hook, plugin, seconds, error):
        self.events.append((hook, plugin, error))


class CountingEngine(RolloutEngine):
    """A rollout engine that answers every request with the next ``n`` token ids (subclassing the
    Protocol gives it the documented defaults of ``weight_update_ranks`` and ``context_len``)."""

    tokenizer = None

    def __init__(self, n=3):
        self.n = n

    async def generate(self, input_ids, sampling_params):
        start = max(input_ids) + 1
        ids = list(range(start, start + min(self.n, sampling_params["max_new_tokens"])))
        return GenerateOutput(output_ids=ids, output_log_probs=[-0.5] * len(ids), finish_reason="length",
                              weight_version="4")

    async def abort(self):
        pass

    async def pause_generation(self, mode):
        pass

    async def flush_cache(self):
        pass

    async def load_weights(self, named_tensors):
        pass

    async def init_weights_update_group(self, master_address, master_port, rank_offset, world_size, group_name,
                                        backend):
        pass

    async def update_weights_from_distributed(self, names, dtypes, shapes, group_name):
        pass

    async def destroy_weights_update_group(self, group_name):
        pass

    async def set_weight_version(self, version):
        pass

    async def continue_generation(self):
        pass

    async def release_memory(self):
        pass

    async def resume_memory(self):
        pass

    async def health(self):
        return True


def test_hook_add_arguments_broadcast_adds_each_plugin_s_flags(plugin_manager, register_plugin):
    class LeaveOneOut:
        @hookimpl
        def add_arguments(self, parser):
            group = parser.add_argument_group("leave_one_out")
            group.add_argument("--leave-one-out-weight", type=float, default=1.0)

    class Shaping:
        @hookimpl
        def add_arguments(self, parser):
            parser.add_argument("--shaping-bonus", type=int, default=0)

    register_plugin(LeaveOneOut(), "leave_one_out")
    register_plugin(Shaping(), "shaping")
    parser = ArgumentParser()
    add_plugin_arguments(parser, plugin_manager)
    parsed = vars(parser.parse_args(["--leave-one-out-weight", "0.5", "--shaping-bonus", "3"]))
    assert (parsed["leave_one_out_weight"], parsed["shaping_bonus"]) == (0.5, 3)
    assert "leave_one_out" in [group.title for group in parser._action_groups]


def test_hook_rollout_engine_factory_returns_a_rollout_engine(plugin_manager, register_plugin, config):
    class Factory:
        def __init__(self, n):
            self.n = n  # tokens per answer: the toy plugin's own setting, no flag of the run

        @hookimpl
        def rollout_engine(self, config, engine_index):
            return CountingEngine(n=self.n)

    register_plugin(Factory(n=2), "counting")
    engine = asyncio.run(plugin_manager.call_chosen("rollout_engine", "counting", "--rollout-backend",
                                                    config=config, engine_index=0))
    assert isinstance(engine, RolloutEngine)
    assert (engine.weight_update_ranks, engine.context_len) == (1, None)
    out = asyncio.run(engine.generate([5, 9], {"max_new_tokens": 8}))
    assert (out.output_ids, out.finish_reason) == ([10, 11], "length")


def test_hook_train_backend_factory_returns_a_train_backend(plugin_manager, register_plugin):
    class Backend(TrainBackend):  # inherits train_forward_gives_old_log_probs() -> False
        def __init__(self, start):
            self.start = start

        async def init(self, config):
            return self.start

        async def log_probs(self, batch, model="actor"):
            return {"log_probs": [], "entropy": []}

        async def train(self, rollout_id, batch):
            return []

        def layout(self):
            return ParallelLayout()

        async def iter_weights(self):
            yield "w", None

        async def save(self, path):
            pass

        async def load(self, path):
            pass

        async def offload(self):
            pass

        async def onload(self):
            pass

    class Factory:
        @hookimpl
        async def train_backend(self, config):
            return Backend(start=config.start_rollout_id)

    register_plugin(Factory(), "tiny_backend")
    config = launch_config("--num-rollout", "8", "--start-rollout-id", "6", configure=False)
    backend = asyncio.run(plugin_manager.call_chosen("train_backend", "tiny_backend", "--train-backend",
                                                     config=config))
    assert isinstance(backend, TrainBackend)
    assert asyncio.run(backend.init(config)) == 6  # the --start-rollout-id given
    assert backend.train_forward_gives_old_log_probs() is False


def test_hook_data_source_factory_returns_rows_and_state(plugin_manager, register_plugin, config):
    class ListSource:
        def __init__(self, rows):
            self.rows, self.offset = rows, 0

        def next_rows(self, k):
            out = [self.rows[(self.offset + i) % len(self.rows)] for i in range(k)]
            self.offset += k
            return out

        def state(self):
            return {"offset": self.offset}

        def load_state(self, state):
            self.offset = state["offset"]

    class Factory:
        def __init__(self, prompts):
            self.prompts = prompts  # the toy plugin holds its rows itself (no --prompt-data file)

        @hookimpl
        def data_source(self, config):
            return ListSource([{"prompt": p, "label": None, "metadata": {}} for p in self.prompts])

    register_plugin(Factory(["a", "b"]), "list_source")
    source = asyncio.run(plugin_manager.call_chosen("data_source", "list_source", "--data-source",
                                                    config=config))
    assert isinstance(source, DataSource)
    assert [row["prompt"] for row in source.next_rows(3)] == ["a", "b", "a"]  # rolls over the epoch
    assert source.state() == {"offset": 3}


def test_hook_rollout_chosen_returns_groups_from_the_context(plugin_manager, register_plugin):
    class Data:
        def get_samples(self, k):
            return [[Sample(prompt=f"p{i}", index=2 * i + j) for j in range(2)] for i in range(k)]

    async def generate_group(group, evaluation=False):
        for sample in group:
            sample.response, sample.status = "done", Status.COMPLETED
        return group

    async def filter_group(group, rollout_id):
        return FilterResult(keep=True)

    async def abort(rollout_id):
        pass

    class Rollout:
        @hookimpl
        async def rollout(self, config, rollout_id, context):
            groups = context.data.get_samples(config.rollout_batch_size)
            done = [await context.generate_group(g) for g in groups]
            context.metrics["rollout/id"] = rollout_id
            return done

    register_plugin(Rollout(), "plain_rollout")
    context = RolloutContext(engine=CountingEngine(), data=Data(), generate_group=generate_group,
                             filter_group=filter_group, abort=abort)
    groups = asyncio.run(plugin_manager.call_chosen("rollout", "plain_rollout", "--rollout",
                                                    config=launch_config("--rollout-batch-size", "2",
                                                                         configure=False),
                                                    rollout_id=3,
                                                    context=context))
    assert [[(s.prompt, s.index, s.status) for s in g] for g in groups] == [
        [("p0", 0, Status.COMPLETED), ("p0", 1, Status.COMPLETED)],
        [("p1", 2, Status.COMPLETED), ("p1", 3, Status.COMPLETED)],
    ]
    assert context.metrics == {"rollout/id": 3}


def test_hook_generate_chosen_fills_the_sample_from_the_engine(plugin_manager, register_plugin, config):
    class OneTurn:
        @hookimpl
        async def generate(self, config, sample, sampling_params, engine, evaluation):
            out = await engine.generate(sample.tokens, sampling_params)
            sample.tokens = sample.tokens + out.output_ids
            sample.response_length = len(out.output_ids)
            sample.rollout_log_probs = out.output_log_probs
            sample.weight_versions.append(out.weight_version)
            sample.status = Status.TRUNCATED if out.finish_reason == "length" else Status.COMPLETED
            return sample

    register_plugin(OneTurn(), "one_turn")
    sample = Sample(prompt="2+2?", tokens=[7, 8])
    out = asyncio.run(plugin_manager.call_chosen("generate", "one_turn", "--generate", config=config,
                                                 sample=sample, sampling_params={"max_new_tokens": 2},
                                                 engine=CountingEngine(n=5), evaluation=False))
    assert out is sample
    out.validate()
    assert (out.tokens, out.response_length, out.rollout_log_probs, out.weight_versions, out.status) == (
        [7, 8, 9, 10], 2, [-0.5, -0.5], ["4"], Status.TRUNCATED)


def test_hook_reward_chosen_returns_one_value_per_sample_in_order(plugin_manager, register_plugin, config):
    class ExactMatch:
        @hookimpl
        def reward(self, config, samples):
            return [1.0 if s.response.strip() == str(s.label) else 0.0 for s in samples]

    register_plugin(ExactMatch(), "exact_match")
    samples = [Sample(response=" 4", label=4), Sample(response="5", label=4), Sample(response="x", label="x")]
    out = asyncio.run(plugin_manager.call_chosen("reward", "exact_match", "--rm-type", config=config,
                                                 samples=samples))
    assert out == [1.0, 0.0, 1.0]


def test_hook_filter_every_chosen_filter_in_flag_order(plugin_manager, register_plugin, config):
    class NonzeroStd:
        @hookimpl
        def filter(self, samples):
            rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
            if rewards.std() > 1e-8:
                return FilterResult(keep=True)
            return FilterResult(keep=False, reason=f"zero_std_{round(float(rewards[0]), 1)}")

    class NoAborted:
        @hookimpl
        async def filter(self, samples, rollout_id):
            return not any(s.status == Status.ABORTED for s in samples)

    register_plugin(NonzeroStd(), "nonzero_std")
    register_plugin(NoAborted(), "not_aborted")
    order = ["not_aborted", "nonzero_std"]

    def run(rewards, statuses):
        group = [Sample(reward=r, status=st) for r, st in zip(rewards, statuses)]
        return asyncio.run(plugin_manager.run_filters(order, "--dynamic-sampling-filter", config=config,
                                                      samples=group, rollout_id=0))

    assert run([1.0, 1.0], ["completed", "completed"]) == FilterResult(keep=False, reason="zero_std_1.0")
    assert run([1.0, 1.0], ["aborted", "completed"]) == FilterResult(keep=False, reason=None)
    assert run([0.0, 1.0], ["completed", "truncated"]) == FilterResult(keep=True, reason=None)


def test_hook_buffer_pop_chosen_removes_what_it_returns(plugin_manager, register_plugin, config):
    class PopOldest:
        @hookimpl
        def buffer_pop(self, buffer, num_samples):
            j = min(len(buffer), num_samples)
            out = buffer[:j]
            del buffer[:j]
            return out

    register_plugin(PopOldest(), "pop_oldest")
    buffer = [[Sample(index=0)], [Sample(index=1)], [Sample(index=2)]]
    out = asyncio.run(plugin_manager.call_chosen("buffer_pop", "pop_oldest", "--buffer-filter", config=config,
                                                 rollout_id=1, buffer=buffer, num_samples=2))
    assert [[s.index for s in g] for g in out] == [[0], [1]]
    assert [[s.index for s in g] for g in buffer] == [[2]]


def test_hook_abort_broadcast_reaches_every_implementation(plugin_manager, register_plugin, config):
    torn_down = []

    class Sandbox:
        def __init__(self, tag):
            self.tag = tag

        @hookimpl
        async def abort(self, rollout_id):
            torn_down.append((self.tag, rollout_id))

    register_plugin(Sandbox("docker"), "docker_sandbox")
    register_plugin(Sandbox("browser"), "browser_sandbox")
    asyncio.run(plugin_manager.broadcast("abort", config=config, rollout_id=9))
    assert sorted(torn_down) == [("browser", 9), ("docker", 9)]


def test_hook_advantage_chosen_maps_rewards_to_per_token_advantages(plugin_manager, register_plugin, config):
    class CenteredPerGroup:
        @hookimpl
        def advantage(self, config, batch):
            adv = []
            for i, mask in enumerate(batch.loss_masks):
                group = batch.rewards[batch.group_ids == batch.group_ids[i]]
                adv.append(torch.full_like(mask, float(batch.rewards[i] - group.mean()), dtype=torch.float32))
            return AdvantageOutput(advantages=adv, returns=adv)

    register_plugin(CenteredPerGroup(), "centered")
    batch = AdvantageInput(rewards=torch.tensor([1.0, 0.0, 0.0, 0.0]), group_ids=torch.tensor([0, 0, 1, 1]),
                           loss_masks=[torch.ones(2), torch.ones(1), torch.ones(3), torch.ones(1)])
    out = asyncio.run(plugin_manager.call_chosen("advantage", "centered", "--advantage-estimator",
                                                 config=config, batch=batch))
    # group 0 mean = (1 + 0) / 2 = 0.5 -> A = +0.5, -0.5; group 1 mean = 0 -> A = 0, 0
    assert [a.tolist() for a in out.advantages] == [[0.5, 0.5], [-0.5], [0.0, 0.0, 0.0], [0.0]]
    assert out.returns is out.advantages


def test_hook_loss_chosen_returns_per_token_values_only(plugin_manager, register_plugin, config):
    class Reinforce:
        @hookimpl
        def loss(self, batch):
            token_loss = [-a * lp for a, lp in zip(batch.advantages, batch.log_probs)]
            return LossOutput(token_loss=token_loss, token_metrics={"pg_loss": [t.detach() for t in token_loss]})

    register_plugin(Reinforce(), "reinforce")
    log_probs = [torch.tensor([-1.0, -2.0], requires_grad=True)]
    batch = LossInput(log_probs=log_probs, old_log_probs=[torch.tensor([-1.0, -2.0])],
                      advantages=[torch.tensor([0.5, 0.5])], loss_masks=[torch.tensor([1.0, 0.0])])
    out = asyncio.run(plugin_manager.call_chosen("loss", "reinforce", "--loss-type", config=config, batch=batch))
    # l_t = -A_t * logp_t = -0.5 * -1 = 0.5 and -0.5 * -2 = 1.0 (masks are the core's business)
    assert out.token_loss[0].tolist() == [0.5, 1.0]
    out.token_loss[0].sum().backward()
    assert log_probs[0].grad.tolist() == [-0.5, -0.5]


class Sink:
    """Observer plugin: keeps what each observer hook receives (every argument but ``config``)."""

    def __init__(self):
        self.seen = []

    @hookimpl
    def on_rollout_end(self, rollout_id, metrics):
        self.seen.append(("on_rollout_end", rollout_id, metrics))

    @hookimpl
    async def on_train_step_end(self, rollout_id, step, metrics):
        self.seen.append(("on_train_step_end", rollout_id, step, metrics))

    @hookimpl
    def on_eval_end(self, rollout_id, metrics):
        self.seen.append(("on_eval_end", rollout_id, metrics))

    @hookimpl
    def on_checkpoint_saved(self, rollout_id, path):
        self.seen.append(("on_checkpoint_saved", rollout_id, path))


def test_hook_on_rollout_end_observer_sees_metrics(plugin_manager, register_plugin, config):
    recorder = register_plugin(Recorder(), "recorder")
    sink = register_plugin(Sink(), "sink")
    asyncio.run(plugin_manager.notify("on_rollout_end", config=config, rollout_id=2,
                                      metrics={"rollout/raw_reward": 0.75}))
    assert sink.seen == [("on_rollout_end", 2, {"rollout/raw_reward": 0.75})]
    assert recorder.events == []  # observers are never timed


def test_hook_on_train_step_end_observer_sees_the_global_step(plugin_manager, register_plugin, config):
    recorder = register_plugin(Recorder(), "recorder")
    sink = register_plugin(Sink(), "sink")
    # global step = rollout_id * num_steps_per_rollout + s = 3 * 2 + 1 = 7
    asyncio.run(plugin_manager.notify("on_train_step_end", config=config, rollout_id=3, step=3 * 2 + 1,
                                      metrics={"train/grad_norm": 1.5}))
    assert sink.seen == [("on_train_step_end", 3, 7, {"train/grad_norm": 1.5})]
    assert recorder.events == []


def test_hook_on_eval_end_observer_sees_eval_metrics(plugin_manager, register_plugin, config):
    recorder = register_plugin(Recorder(), "recorder")
    sink = register_plugin(Sink(), "sink")
    asyncio.run(plugin_manager.notify("on_eval_end", config=config, rollout_id=0, metrics={"eval/gsm8k": 0.25}))
    assert sink.seen == [("on_eval_end", 0, {"eval/gsm8k": 0.25})]
    assert recorder.events == []


def test_hook_on_checkpoint_saved_observer_sees_the_path(plugin_manager, register_plugin, config):
    recorder = register_plugin(Recorder(), "recorder")
    sink = register_plugin(Sink(), "sink")
    asyncio.run(plugin_manager.notify("on_checkpoint_saved", config=config, rollout_id=5,
                                      path="/runs/a/iter_0000005"))
    assert sink.seen == [("on_checkpoint_saved", 5, "/runs/a/iter_0000005")]
    assert recorder.events == []


def test_hook_on_hook_call_sees_every_chosen_call_with_its_error(plugin_manager, register_plugin, config):
    recorder = register_plugin(Recorder(), "recorder")

    class Flaky:
        @hookimpl
        def reward(self, samples):
            if not samples:
                raise ValueError("empty group")
            return [0.0] * len(samples)

    register_plugin(Flaky(), "flaky")
    asyncio.run(plugin_manager.call_chosen("reward", "flaky", "--rm-type", config=config, samples=[Sample()]))
    with pytest.raises(ValueError):
        asyncio.run(plugin_manager.call_chosen("reward", "flaky", "--rm-type", config=config, samples=[]))
    assert recorder.events == [("reward", "flaky", None), ("reward", "flaky", "ValueError: empty group")]
