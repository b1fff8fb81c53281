"""PPO with a critic: the critic train group beside the actor's, a third-party critic, the fsdp critic.

The core asks the chosen train backend for a critic through its ``critic_backend`` hook and drives it
with the actor's group class (role ``critic``): its values go into GAE, its returns train it with the
clipped value loss. A scripted critic (a third-party train backend's, here) shows the whole train step
against the hand-worked GAE vectors of tests/test_advantage_estimators.py; the fsdp critic's value-head
gradient is checked against a hand computation on the two-layer tiny model.
"""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from furlong.builtin_plugins.backends.fsdp import FSDPBackend, FSDPCritic
from furlong.builtin_plugins.executors.local import InProcessWorkers
from furlong.core.config.launch_args import launch_config
from furlong.core.plugins.selection import resolve_selection
from furlong.core.train.group import TrainGroup, explained_variance
from furlong.core.train.objective import StepObjective
from furlong.core.train.worker import TrainWorker
from furlong.hooks import ParallelLayout, Sample, Status, TrainBatch, hookimpl
from furlong.hooks.testing.processes import signal_state

from .test_advantage_estimators import GAE_A, GAE_R

V_OLD = [0.5, 0.4, 0.2]  # the values GAE_A and GAE_R were worked out with (gamma 0.9, lambda 0.8, reward 1)
SHIFT = [0.3, 0.0, -0.1]  # the scripted critic's values at training time: V_OLD + SHIFT


class ScriptedCritic:
    """A third-party critic: values ``V_OLD`` at scoring time, ``V_OLD + shift`` (``shift`` trainable) when it
    trains; it records what the core hands its train step."""

    def __init__(self):
        self.shift = torch.tensor(SHIFT, requires_grad=True)
        self.seen = []

    async def init(self, config):
        return 0

    def layout(self):
        return ParallelLayout()

    async def values(self, batch):
        return {"values": [torch.tensor(V_OLD) for _ in batch.tokens]}

    async def train(self, rollout_id, batch):
        steps = []
        for step in batch.steps:
            for mb in step:
                values = [torch.tensor(V_OLD) + self.shift for _ in mb]
                loss, metrics = await batch.objective(list(mb), None, None, values=values)
                loss.backward()
                self.seen.append({"batch": batch, "loss": float(loss.detach()), "grad": self.shift.grad.tolist(),
                                  "metrics": {k: float(v) for k, v in metrics.items()}})
            steps.append({k: float(v) for k, v in metrics.items()})
        return steps

    async def save(self, path):
        pass

    async def load(self, path):
        pass

    async def offload(self):
        pass

    async def onload(self):
        pass


class ScriptedBackend:
    """A third-party train backend that can build a critic: the fsdp actor and :class:`ScriptedCritic`."""

    def __init__(self):
        self.critic = ScriptedCritic()

    @hookimpl
    def train_backend(self, config):
        return FSDPBackend(config)

    @hookimpl
    def critic_backend(self, config):
        return self.critic


def _samples(n: int, reward: float = 1.0) -> list[list[Sample]]:
    return [[Sample(index=i, group_index=i, tokens=[5, 6, 7, 8, 9, 10], response_length=3, reward=reward,
                    status=Status.COMPLETED)] for i in range(n)]


def _groups(config, pm):
    selection = resolve_selection(config, pm)
    chosen = dict(selection.chosen)
    actor = TrainGroup(config, pm, selection, InProcessWorkers(TrainWorker(config, chosen, 0, 1, pm)))
    critic = TrainGroup(config, pm, selection, InProcessWorkers(TrainWorker(config, chosen, 0, 1, pm, "critic")),
                        role="critic")
    return actor, critic


def _ppo_config(model, pm, *extra):
    return launch_config("--hf-checkpoint", str(model), "--train-backend", "scripted", "--advantage-estimator", "ppo",
                         "--gamma", "0.9", "--lambd", "0.8", "--value-clip", "0.2", "--rollout-batch-size", "1",
                         "--n-samples-per-prompt", "1", "--global-batch-size", "1", "--micro-batch-size", "1",
                         "--lr", "1e-3", *extra, pm=pm)


@pytest.mark.parametrize("concurrent", [False, True])
def test_hook_critic_backend_gae_and_the_clipped_value_loss_through_the_whole_train_step(
        tiny_model_dir, plugin_manager, register_plugin, concurrent):
    plugin = register_plugin(ScriptedBackend(), "scripted")
    config = _ppo_config(tiny_model_dir, plugin_manager)
    assert config.use_critic
    actor, critic = _groups(config, plugin_manager)

    async def go():
        await actor.init()
        await critic.init()
        return await actor.train(0, _samples(1), critic, concurrent)

    [metrics] = asyncio.run(go())
    [seen] = plugin.critic.seen
    batch = seen["batch"]
    assert batch.advantages[0].tolist() == pytest.approx(GAE_A)
    assert batch.returns[0].tolist() == pytest.approx(GAE_R)
    assert batch.values[0].tolist() == pytest.approx(V_OLD)
    # v = [0.8, 0.4, 0.1]: token 0 moved 0.3 > 0.2 (clipped: v_clip = 0.7, (0.7-R)^2 < (0.8-R)^2, the unclipped
    # term wins); tokens 1 and 2 within the clip. Per-sample mean over the 3 tokens.
    v = [0.8, 0.4, 0.1]
    errors = [(a - b) ** 2 for a, b in zip(v, GAE_R)]
    assert seen["loss"] == pytest.approx(sum(errors) / 3, rel=1e-6)
    assert seen["grad"] == pytest.approx([2 * (a - b) / 3 for a, b in zip(v, GAE_R)], rel=1e-6)
    assert seen["metrics"]["vf_clipfrac"] == pytest.approx(1 / 3)
    assert seen["metrics"]["vpred_mean"] == pytest.approx(sum(v) / 3)
    assert metrics["critic/steps"][0]["value_loss"] == pytest.approx(sum(errors) / 3, rel=1e-6)
    assert len(metrics["train/steps"]) == 1  # the actor trained too
    returns = torch.tensor(GAE_R, dtype=torch.float64)
    expected = 1 - float((returns - torch.tensor(V_OLD, dtype=torch.float64)).var(unbiased=False) /
                         returns.var(unbiased=False))
    assert metrics["critic/explained_variance"] == pytest.approx(expected)


def test_critic_only_steps_leave_the_actor_untouched(tiny_model_dir, plugin_manager, register_plugin):
    plugin = register_plugin(ScriptedBackend(), "scripted")
    config = _ppo_config(tiny_model_dir, plugin_manager, "--num-critic-only-steps", "1")
    actor, critic = _groups(config, plugin_manager)

    async def go():
        await actor.init()
        await critic.init()
        backend = actor.workers.worker.backend
        before = {k: v.clone() for k, v in backend.model.state_dict().items()}
        [first] = await actor.train(0, _samples(1), critic)
        same = all(torch.equal(before[k], v) for k, v in backend.model.state_dict().items())
        [second] = await actor.train(1, _samples(1), critic)
        return first, same, second

    first, same, second = asyncio.run(go())
    assert same and first["train/steps"] == [] and len(first["critic/steps"]) == 1
    assert len(second["train/steps"]) == 1 and len(plugin.critic.seen) == 2


def test_explained_variance_by_hand():
    masks = [torch.tensor([1.0, 1.0, 0.0]), torch.tensor([1.0])]
    returns = [torch.tensor([1.0, 2.0, 99.0]), torch.tensor([3.0])]
    # trained returns [1, 2, 3] (variance 2/3); residuals R - V = [0, 1, -1] (mean 0, variance 2/3)
    assert explained_variance([torch.tensor([1.0, 1.0, 0.0]), torch.tensor([4.0])], returns, masks) == \
        pytest.approx(0.0, abs=1e-12)
    assert explained_variance([torch.tensor([1.0, 2.0, -5.0]), torch.tensor([3.0])], returns, masks) == 1.0
    assert explained_variance([torch.ones(3), torch.ones(1)], [torch.ones(3), torch.ones(1)], masks) == 0.0


# --- the fsdp critic ------------------------------------------------------------------------


def _critic(model_dir, **flags):
    config = launch_config("--hf-checkpoint", str(model_dir), "--advantage-estimator", "ppo", "--optimizer", "sgd",
                           "--lr", "0.5", "--clip-grad", "0", "--weight-decay", "0", "--rollout-batch-size", "2",
                           "--n-samples-per-prompt", "1", "--global-batch-size", "2", "--micro-batch-size", "2",
                           *[str(x) for kv in flags.items() for x in kv])
    critic = FSDPCritic(config)
    asyncio.run(critic.init(config))
    return config, critic


def test_fsdp_value_head_gradient_equals_the_hand_computation(tiny_model_dir, plugin_manager):
    config, critic = _critic(tiny_model_dir)
    tokens = [[3, 4, 5, 6, 7, 8], [9, 10, 11, 12]]
    lengths = [3, 2]
    returns = [torch.tensor([1.0, -0.5, 2.0]), torch.tensor([0.25, 1.5])]
    masks = [torch.ones(3), torch.ones(2)]
    batch = TrainBatch(tokens=tokens, response_lengths=lengths, loss_masks=masks, steps=[[[0, 1]]],
                       returns=returns, advantages=[torch.zeros(3), torch.zeros(2)])
    start = asyncio.run(critic.values(batch))["values"]
    assert [v.tolist() for v in start] == [[0.0] * 3, [0.0] * 2]  # a fresh head is zero
    batch.values = start
    decoder = {k: v.clone() for k, v in critic.model.model.state_dict().items()}
    with torch.no_grad():
        hidden = [critic.model.model(input_ids=torch.tensor([t])).last_hidden_state[0, len(t) - n - 1: len(t) - 1]
                  for t, n in zip(tokens, lengths)]
    batch.objective = StepObjective(config, plugin_manager, batch, "value_loss", "--advantage-estimator",
                                    old_values=start, reducer=False)
    asyncio.run(critic.train(0, batch))
    # L = (1/2) sum_i mean_t (V_it - R_it)^2 with V = w.h + b = 0: dL/dw = (1/2) sum_i mean_t -2 R_it h_it,
    # dL/db = (1/2) sum_i mean_t -2 R_it; SGD's first step from zero: w = -lr dL/dw
    grad_w = sum((-2 * r[:, None] * h).mean(0) for r, h in zip(returns, hidden)) / 2
    grad_b = sum((-2 * r).mean() for r in returns) / 2
    torch.testing.assert_close(critic.model.value_head.weight.detach()[0], -0.5 * grad_w, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(critic.model.value_head.bias.detach()[0], -0.5 * grad_b, rtol=1e-5, atol=1e-7)
    # the head was zero, so no gradient reached the decoder
    assert all(torch.equal(decoder[k], v) for k, v in critic.model.model.state_dict().items())
    after = asyncio.run(critic.values(batch))["values"]
    for h, v in zip(hidden, after):
        expected = h @ critic.model.value_head.weight.detach()[0] + critic.model.value_head.bias.detach()[0]
        torch.testing.assert_close(v, expected, rtol=1e-5, atol=1e-6)


def test_fsdp_critic_checkpoint_round_trip_and_critic_load_from_its_model_folder(tiny_model_dir, tmp_path):
    _, critic = _critic(tiny_model_dir)
    with torch.no_grad():
        critic.model.value_head.weight.fill_(0.125)
        critic.model.value_head.bias.fill_(-1.0)
    asyncio.run(critic.save(str(tmp_path / "iter")))
    _, fresh = _critic(tiny_model_dir)
    asyncio.run(fresh.load(str(tmp_path / "iter")))
    assert torch.equal(fresh.model.value_head.weight, critic.model.value_head.weight)
    _, loaded = _critic(tiny_model_dir, **{"--critic-load": tmp_path / "iter" / "model"})
    assert float(loaded.model.value_head.bias) == -1.0
    assert all(torch.equal(a, b) for a, b in zip(loaded.model.state_dict().values(), critic.model.state_dict().values()))


# --- whole runs -----------------------------------------------------------------------------


def _ppo_command(model, data, save, *extra):
    return [sys.executable, "-m", "furlong.core", "train", "--hf-checkpoint", str(model), "--prompt-data", str(data),
            "--input-key", "prompt", "--label-key", "label", "--rm-type", "deterministic_random", "--rollout-shuffle",
            "--num-rollout", "4", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size",
            "4", "--rollout-max-response-len", "6", "--advantage-estimator", "ppo", "--lr", "1e-3", "--critic-lr",
            "1e-2", "--critic-lr-warmup-iters", "2", "--lr-decay-style", "linear", "--save", str(save), "--load",
            str(save), "--save-interval", "1", *extra]


def _weights(path):
    return load_file(str(path / "model" / "model.safetensors"))


def _assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.signals
@pytest.mark.timeout(300)
def test_a_killed_ppo_run_resumes_to_the_actor_and_critic_of_an_uninterrupted_run(tmp_path, tiny_model_dir,
                                                                                  arithmetic_jsonl):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    subprocess.run(_ppo_command(tiny_model_dir, arithmetic_jsonl, whole), check=True, capture_output=True, timeout=150)
    proc = subprocess.Popen(_ppo_command(tiny_model_dir, arithmetic_jsonl, killed), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, preexec_fn=signal_state())
    marker = killed / "latest_checkpointed_iteration.txt"
    deadline = time.time() + 120
    while time.time() < deadline and not (marker.exists() and marker.read_text().strip() == "1"):
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = int(marker.read_text().strip())
    assert killed_at in (1, 2)
    resumed = subprocess.run(_ppo_command(tiny_model_dir, arithmetic_jsonl, killed), capture_output=True, text=True,
                             timeout=150)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"critic resumes from {tmp_path / 'killed_critic' / f'iter_{killed_at:07d}'}" in resumed.stderr
    critic_whole, critic_killed = tmp_path / "whole_critic", tmp_path / "killed_critic"
    assert (critic_killed / "latest_checkpointed_iteration.txt").read_text() == "3"
    _assert_same_weights(_weights(whole / "iter_0000003"), _weights(killed / "iter_0000003"))
    _assert_same_weights(_weights(critic_whole / "iter_0000003"), _weights(critic_killed / "iter_0000003"))
    start = load_file(str(tiny_model_dir / "model.safetensors"))
    trained = _weights(critic_whole / "iter_0000003")
    assert float(trained["value_head.weight"].abs().max()) > 0 and "lm_head.weight" not in trained
    assert max(float((trained[k] - start[k]).abs().max()) for k in trained if k in start) > 0  # the decoder trained
    rows = [json.loads(line) for line in (killed / "metrics.jsonl").read_text().splitlines()]
    lrs = {r["train/step"]: r["critic/lr"] for r in rows if "train/step" in r}
    # --critic-lr-warmup-iters 2 to --critic-lr, then the actor's linear decay over the run's 4 steps
    assert lrs == {0: 0.0, 1: 0.005, 2: 0.01, 3: 0.005}


def test_a_critic_load_given_that_does_not_exist_stops_the_run_before_any_model_loads(tiny_model_dir, tmp_path):
    from furlong.core.run.preflight import check_paths
    from furlong.hooks import PluginError

    argv = ["--hf-checkpoint", str(tiny_model_dir), "--advantage-estimator", "ppo", "--save", str(tmp_path / "run")]
    check_paths(launch_config(*argv))  # the derived critic folders need not exist yet
    with pytest.raises(PluginError) as err:
        check_paths(launch_config(*argv, "--critic-load", str(tmp_path / "nowhere")))
    assert str(err.value) == (f"--critic-load '{tmp_path / 'nowhere'}': no such directory (a critic checkpoint folder "
                              "or a Hugging Face directory); leave it out to start the critic from --hf-checkpoint.")


def test_a_critic_folder_of_another_run_stops_a_fresh_run_before_any_model_loads(tiny_model_dir, tmp_path):
    from furlong.core.run.preflight import check_paths
    from furlong.hooks import PluginError

    stale = tmp_path / "run_critic"
    (stale / "iter_0000002").mkdir(parents=True)
    (stale / "latest_checkpointed_iteration.txt").write_text("2")
    argv = ["--hf-checkpoint", str(tiny_model_dir), "--advantage-estimator", "ppo", "--save", str(tmp_path / "run")]
    with pytest.raises(PluginError) as err:
        check_paths(launch_config(*argv))
    assert str(err.value) == (
        f"--critic-save '{stale}': already holds another run's critic (latest checkpoint 2), which this run would "
        "start from and overwrite; move it away, choose another --save (the critic goes to --save + '_critic') or "
        "--critic-save.")  # --save holds no actor checkpoint: nothing to resume
    check_paths(launch_config(*argv[:-1], str(tmp_path / "other")))  # another --save: its critic folder is new
    actor = tmp_path / "run"
    (actor / "iter_0000002").mkdir(parents=True)
    (actor / "latest_checkpointed_iteration.txt").write_text("2")
    check_paths(launch_config(*argv, "--load", str(actor)))  # resuming the run that wrote both


def test_critic_flags_without_a_critic_say_they_do_nothing(tiny_model_dir, caplog):
    argv = ["--hf-checkpoint", str(tiny_model_dir), "--critic-lr", "1e-3", "--num-critic-only-steps", "2"]
    with caplog.at_level("WARNING", logger="furlong.config"):
        launch_config(*argv)
    assert ("--critic-lr, --num-critic-only-steps do nothing: this run trains no critic (--advantage-estimator grpo; "
            "--advantage-estimator ppo trains one).") in caplog.messages
    caplog.clear()
    with caplog.at_level("WARNING", logger="furlong.config"):
        launch_config(*argv, "--advantage-estimator", "ppo")
    assert not [m for m in caplog.messages if "trains no critic" in m]


def test_a_ppo_run_whose_critic_only_steps_cover_every_rollout_is_warned(tiny_model_dir, caplog):
    """The actor trains from rollout --num-critic-only-steps on: at --num-rollout or more it never trains (a
    warning naming both flags, not an error: a critic may be warmed up on purpose, then resumed)."""
    argv = ["--hf-checkpoint", str(tiny_model_dir), "--advantage-estimator", "ppo", "--num-rollout", "3"]
    warned = ("--num-critic-only-steps 3 is not below --num-rollout 3: this run trains only the critic, never the "
              "actor (the actor trains from rollout 3 on; resume with --load and a larger --num-rollout to train it).")
    with caplog.at_level("WARNING", logger="furlong.config"):
        launch_config(*argv, "--num-critic-only-steps", "3")
    assert warned in caplog.messages
    caplog.clear()
    with caplog.at_level("WARNING", logger="furlong.config"):
        launch_config(*argv, "--num-critic-only-steps", "2")
        launch_config(*argv[:-2], "--num-rollout", "0", "--num-critic-only-steps", "2")  # evaluation only
    assert not [m for m in caplog.messages if "--num-critic-only-steps" in m]
