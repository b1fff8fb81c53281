"""The megatron critic on CPU (gloo, one rank): the policy's GPTModel with a value head.

Its values, clipped value loss and optimizer steps equal the fsdp critic's on the same tiny model
(float32, AdamW); its ``torch_dist`` checkpoints resume exactly; it starts from a saved fsdp critic's
Hugging Face folder (``--critic-load``) or from an actor's ``torch_dist`` checkpoint (``--ref-load``)
with a fresh head; a ppo run with ``--train-backend megatron`` trains actor and critic.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core", reason="the megatron extra (megatron-core) is not installed")

from furlong.builtin_plugins.backends.fsdp import FSDPCritic  # noqa: E402
from furlong.builtin_plugins.backends.megatron import critic_backend, train_backend  # noqa: E402
from furlong.builtin_plugins.backends.megatron.model import init_parallel  # noqa: E402
from furlong.core.config.launch_args import launch_config  # noqa: E402
from furlong.hooks import PluginError  # noqa: E402

from .megatron_critic_ranks import LENGTHS, TP_STEPS, tp_config  # noqa: E402
from .megatron_critic_ranks import critic_batch as _batch  # noqa: E402
from .megatron_critic_ranks import values_then_train as _values_then_train  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def one_rank_groups():
    init_parallel(1, CPU)


def _config(model_dir, *extra):
    return launch_config("--hf-checkpoint", str(model_dir), "--advantage-estimator", "ppo", "--lr", "1e-3",
                         "--critic-lr", "0.05", "--value-clip", "0.2", "--weight-decay", "0", "--clip-grad", "1.0",
                         "--rollout-batch-size", "3", "--n-samples-per-prompt", "1", "--global-batch-size", "3",
                         "--micro-batch-size", "1", *[str(x) for x in extra])


def _critic(make, model_dir, *extra):
    config = _config(model_dir, *extra)
    critic = make(config)
    asyncio.run(critic.init(config))
    return config, critic


def _head(critic):
    model = critic.model
    return (model.output_layer.weight, model.output_layer.bias) if hasattr(model, "output_layer") else (
        model.value_head.weight, model.value_head.bias)


def test_values_value_loss_and_steps_equal_the_fsdp_critic(tiny_model_dir, plugin_manager):
    """Three AdamW steps (the first moves only the zero head; the clip bites in the later ones): values,
    metrics and the head after them agree with the fsdp critic's to float32 rounding."""
    steps = [[[0, 1], [2]], [[2], [0, 1]], [[0, 1, 2]]]
    results = {}
    for name, make in (("fsdp", FSDPCritic), ("megatron", critic_backend)):
        config, critic = _critic(make, tiny_model_dir)
        results[name] = (*_values_then_train(critic, config, plugin_manager, steps), _head(critic))
    (f_start, f_metrics, f_after, f_head), (m_start, m_metrics, m_after, m_head) = results["fsdp"], results["megatron"]
    assert [v.tolist() for v in m_start] == [[0.0] * n for n in LENGTHS]  # a fresh head is zero
    assert [v.tolist() for v in f_start] == [[0.0] * n for n in LENGTHS]
    assert len(m_metrics) == len(f_metrics) == 3
    assert max(m["vf_clipfrac"] for m in m_metrics) > 0  # the clip is exercised
    for a, b in zip(f_metrics, m_metrics):
        assert b.keys() == a.keys()
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key
    for a, b in zip(f_after, m_after):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    for a, b in zip(f_head, m_head):
        torch.testing.assert_close(b.detach(), a.detach().reshape(b.shape), rtol=1e-5, atol=1e-6)
    assert all(float(v.abs().max()) > 0.01 for v in m_after)  # it did train


def test_packed_micro_batches_give_the_padded_values_and_steps(tiny_model_dir, plugin_manager):
    """Packed (``thd``, as on a GPU in bfloat16) and right-padded micro-batches: the same values and steps."""
    results = []
    for packed in (False, True):
        config, critic = _critic(critic_backend, tiny_model_dir)
        critic._packed = lambda tokens, packed=packed: packed
        results.append(_values_then_train(critic, config, plugin_manager, TP_STEPS))
    (values, metrics, after), (p_values, p_metrics, p_after) = results
    for a, b in zip(values + after, p_values + p_after):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    for a, b in zip(metrics, p_metrics):
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key


def test_checkpoint_round_trip_resumes_exactly(tiny_model_dir, plugin_manager, tmp_path):
    steps = [[[0, 1, 2]]]
    config, first = _critic(critic_backend, tiny_model_dir, "--critic-lr-warmup-iters", "3", "--num-rollout", "5")
    _values_then_train(first, config, plugin_manager, steps)
    asyncio.run(first.save(str(tmp_path / "iter_0000000")))
    _, second = _critic(critic_backend, tiny_model_dir, "--critic-lr-warmup-iters", "3", "--num-rollout", "5")
    asyncio.run(second.load(str(tmp_path / "iter_0000000")))
    assert second.global_step == first.global_step == 1 and second.scheduler.num_steps == 1
    results = [_values_then_train(c, config, plugin_manager, steps) for c in (first, second)]
    for a, b in zip(*(r[0] + r[2] for r in results)):
        assert torch.equal(a, b)
    assert results[0][1] == results[1][1]  # loss, lr, grad norm
    assert results[0][1][0]["lr"] == pytest.approx(0.05 / 3)  # warmup: step 1 of 3 (step 0 is at lr 0)
    for (name, a), (_, b) in zip(first.model.named_parameters(), second.model.named_parameters()):
        assert torch.equal(a, b), name
    # an actor's checkpoint is not a critic's: it has no value head
    actor = train_backend(config=config.replace(advantage_estimator="grpo"))
    asyncio.run(actor.init(actor.config))
    asyncio.run(actor.save(str(tmp_path / "actor")))
    with pytest.raises(PluginError, match="cannot load it into this model"):
        asyncio.run(second.load(str(tmp_path / "actor")))


def test_critic_load_takes_a_saved_fsdp_critic_and_ref_load_an_actor_checkpoint(tiny_model_dir, plugin_manager,
                                                                              tmp_path):
    steps = [[[0, 1, 2]], [[0, 1, 2]]]
    config, fsdp = _critic(FSDPCritic, tiny_model_dir)
    _values_then_train(fsdp, config, plugin_manager, steps)
    asyncio.run(fsdp.save(str(tmp_path / "fsdp")))
    _, loaded = _critic(critic_backend, tiny_model_dir, "--critic-load", tmp_path / "fsdp" / "model")
    want, got = (asyncio.run(c.values(_batch(steps)))["values"] for c in (fsdp, loaded))
    assert float(want[0].abs().max()) > 0.01
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    # --ref-load an actor's torch_dist checkpoint (bfloat16 over float32 masters too): its decoder, a fresh head
    actor = train_backend(config=config.replace(advantage_estimator="grpo"))
    asyncio.run(actor.init(actor.config))
    with torch.no_grad():
        actor.model.decoder.final_layernorm.weight.mul_(1.5)
    asyncio.run(actor.save(str(tmp_path / "actor")))
    for extra in ((), ("--bf16",)):
        _, critic = _critic(critic_backend, tiny_model_dir, "--ref-load", tmp_path / "actor", *extra)
        assert not critic.model.output_layer.weight.any()
        norm = critic.model.decoder.final_layernorm.weight
        source = critic.masters.master_of(norm) if critic.masters else norm
        assert torch.equal(source, actor.model.decoder.final_layernorm.weight)


def test_pipeline_and_context_parallelism_and_moe_models_are_refused_for_the_critic(tiny_model_dir,
                                                                                    tiny_moe_model_dir):
    for dest in ("pipeline_model_parallel_size", "context_parallel_size"):
        config = launch_config(configure=False, hf_checkpoint=str(tiny_model_dir), **{dest: 2})
        with pytest.raises(PluginError, match=f"--{dest.replace('_', '-')} 2 with --advantage-estimator ppo is not "
                                              "supported yet by --train-backend megatron"):
            critic_backend(config=config)
    critic = critic_backend(config=tp_config(tiny_moe_model_dir))
    with pytest.raises(PluginError, match="a critic for a mixture-of-experts model is not supported yet"):
        asyncio.run(critic.init(critic.config))
    assert critic.model is None  # refused before the model is built


@pytest.mark.timeout(300)
def test_tensor_parallel_two_ranks(tiny_model_dir, plugin_manager, tmp_path):
    """Two gloo ranks at TP=2 (every rank holds the whole head and computes every value), also with
    --sequence-parallel (the head gathers the sequence first) padded and packed: values, two AdamW steps of
    the clipped value loss and the values after them equal one rank's."""
    worker = Path(__file__).with_name("megatron_critic_ranks.py")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(worker.parent))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(worker),
           str(tiny_model_dir), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    config = tp_config(tiny_model_dir)
    critic = critic_backend(config=config)
    asyncio.run(critic.init(critic.config))
    values, metrics, after = _values_then_train(critic, config, plugin_manager, TP_STEPS)
    assert metrics[1]["vf_clipfrac"] > 0
    for layout, got in torch.load(tmp_path / "tp.pt", weights_only=True).items():
        for a, b in zip(values + after, got["values"] + got["after"]):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=lambda m: f"{layout}: {m}")
        for a, b in zip(metrics, got["metrics"]):
            for key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (layout, key)


@pytest.mark.timeout(540)
def test_a_ppo_run_with_megatron_trains_actor_and_critic_on_the_demo_model_and_resumes(tmp_path):
    save = tmp_path / "run"
    cmd = [sys.executable, "-m", "furlong.core", "train", "--train-backend", "megatron",
           "--hf-checkpoint", "examples/demo/model", "--prompt-data", "examples/demo/data/train.jsonl",
           "--input-key", "prompt", "--label-key", "label", "--rm-type", "math", "--num-rollout", "2",
           "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "16",
           "--rollout-max-response-len", "12", "--advantage-estimator", "ppo", "--lr", "1e-4", "--critic-lr", "1e-3",
           "--save", str(save), "--save-interval", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "train/step" in r]
    assert len(trained) == 2 and all(r["critic/value_loss"] > 0 for r in trained)
    assert trained[0]["critic/vpred_mean"] == 0.0 and trained[1]["critic/vpred_mean"] != 0.0  # a fresh head, trained
    assert [r["critic/lr"] for r in trained] == [1e-3, 1e-3]
    critic = save.parent / "run_critic"
    assert (critic / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert (critic / "iter_0000001" / "metadata.json").exists() and (save / "iter_0000001" / "metadata.json").exists()
    # one more rollout: actor and critic resume from their torch_dist checkpoints of rollout 1
    more = [*cmd[:cmd.index("--num-rollout") + 1], "3", *cmd[cmd.index("--num-rollout") + 2:], "--load", str(save)]
    done = subprocess.run(more, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"critic resumes from {critic / 'iter_0000001'}" in done.stderr
    assert (critic / "latest_checkpointed_iteration.txt").read_text() == "2"
