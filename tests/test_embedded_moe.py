"""The embedded engine on a mixture-of-experts model (tiny Qwen3-MoE): log-probs, batching, routing, weights."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from tiny_model import build_tiny_moe_model  # noqa: E402

from furlong.builtin_plugins.engines import embedded  # noqa: E402
from furlong.builtin_plugins.engines.embedded.experts import experts_kernels  # noqa: E402
from furlong.hooks import PluginError  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["Hello there", "Q: 1+1=", "x", "abc", "Q: 1+1="]
KERNELS = [None, ("eager", "batched_mm"), ("grouped_mm", "grouped_mm")]


def _run(coro):
    return asyncio.run(coro)


def _params(i: int, n: int, temperature: float = 1.0) -> dict:
    return {"temperature": temperature, "max_new_tokens": n, "sampling_seed": 40 + i, "stop_token_ids": [5, 9]}


async def _together(eng, prompts, params):
    return await asyncio.gather(*[eng.generate(eng.tokenizer.encode(p), dict(q)) for p, q in zip(prompts, params)])


@pytest.fixture(scope="module")
def reference(tiny_moe_model_dir):
    """transformers' own model on the checkpoint (its default experts implementation), float32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_moe_model_dir).eval()


def _reference_pass(reference, tokens: list[int]):
    """transformers' log-prob of every token given the ones before, and the top-k of its router logits per
    fed token: ``([len - 1], [len - 1, layers, k])``."""
    with torch.no_grad():
        out = reference(torch.tensor([tokens]), output_router_logits=True)
    ids = torch.tensor(tokens)
    log_probs = torch.log_softmax(out.logits[0, :-1].float(), -1).gather(1, ids[1:, None])[:, 0]
    k = reference.config.num_experts_per_tok
    routed = torch.stack([logits.topk(k, dim=-1).indices for logits in out.router_logits], dim=1)[:-1]
    return log_probs, routed


@pytest.mark.parametrize(("device", "dtype", "capability", "kernels"), [
    ("cpu", torch.float32, None, ("grouped_mm", "grouped_mm")),
    ("cuda", torch.bfloat16, (9, 0), ("grouped_mm", "grouped_mm")),
    ("cuda", torch.bfloat16, (8, 0), ("grouped_mm", "grouped_mm")),
    ("cuda", torch.bfloat16, (7, 5), ("eager", "batched_mm")),
    ("cuda", torch.float16, (9, 0), ("eager", "batched_mm")),
    ("cuda", torch.float32, (9, 0), ("eager", "batched_mm")),
])
def test_experts_kernels_keep_decode_steps_capturable(device, dtype, capability, kernels):
    # grouped_mm runs without a host sync only in bfloat16 on SM80+; batched_mm in any dtype
    assert experts_kernels(device, dtype, capability) == kernels


@pytest.mark.parametrize("kernels", KERNELS)
def test_log_probs_equal_transformers_on_the_checkpoint(tiny_moe_model_dir, reference, kernels):
    eng = embedded.load_engine(str(tiny_moe_model_dir), max_batch_size=3, experts=kernels)
    if kernels is not None:
        assert eng._decoder.experts.kernels == kernels
    params = [_params(i, n) for i, n in enumerate([6, 11, 4, 9, 7])]
    outs = _run(_together(eng, PROMPTS, params))
    for prompt, out in zip(PROMPTS, outs):
        ids = eng.tokenizer.encode(prompt)
        expected, _ = _reference_pass(reference, ids + out.output_ids)
        torch.testing.assert_close(torch.tensor(out.output_log_probs), expected[len(ids) - 1:], rtol=0, atol=2e-6)


@pytest.mark.parametrize("overlap", [False, True])
def test_continuous_batching_equals_one_request_at_a_time(tiny_moe_model_dir, overlap):
    # 2 slots, 5 greedy requests of different budgets and stop tokens; with overlap (as on CUDA) each step is
    # launched before the previous step's flags are read, over bucketed attention widths
    eng = embedded.load_engine(str(tiny_moe_model_dir), max_batch_size=2, record_routing=True)
    eng._decoder.overlap = eng._decoder.bucket_widths = overlap
    params = [_params(i, n, temperature=0) for i, n in enumerate([3, 19, 5, 30, 12])]
    together = _run(_together(eng, PROMPTS, params))
    for prompt, q, out in zip(PROMPTS, params, together):
        alone = _run(eng.generate(eng.tokenizer.encode(prompt), dict(q)))
        assert (out.output_ids, out.finish_reason) == (alone.output_ids, alone.finish_reason)
        assert out.output_log_probs == pytest.approx(alone.output_log_probs, abs=1e-6)
        assert np.array_equal(out.routed_experts, alone.routed_experts)
    assert {o.finish_reason for o in together} == {"stop", "length"}


def test_recorded_routing_equals_the_top_k_of_transformers_router_logits(tiny_moe_model_dir, reference):
    # 3 slots, 7 sampled requests: a group sharing one prompt (one prefill row, copied keys and routing), slots
    # refilled mid-decode, and compaction moving requests (and their routing) into freed slots
    eng = embedded.load_engine(str(tiny_moe_model_dir), max_batch_size=3, record_routing=True)
    prompts = ["Hello there"] * 3 + ["Q: 1+1=", "x", "a longer prompt of text", "abc"]
    params = [_params(i, n) for i, n in enumerate([9, 3, 14, 6, 20, 5, 11])]
    outs = _run(_together(eng, prompts, params))
    assert len({tuple(o.output_ids) for o in outs[:3]}) == 3
    for prompt, out in zip(prompts, outs):
        tokens = eng.tokenizer.encode(prompt) + out.output_ids
        _, expected = _reference_pass(reference, tokens)
        assert out.routed_experts.dtype == np.int32 and out.routed_experts.shape == (len(tokens) - 1, 2, 2)
        assert np.array_equal(out.routed_experts, expected.numpy())


def test_aborted_requests_return_the_routing_of_the_tokens_they_fed(tiny_moe_model_dir, reference):
    eng = embedded.load_engine(str(tiny_moe_model_dir), max_batch_size=1, record_routing=True)
    ids = eng.tokenizer.encode("Hello there")

    async def run():
        seen = []
        first = asyncio.ensure_future(eng.generate(ids, {"max_new_tokens": 400, "ignore_eos": True, "sampling_seed": 1},
                                                   on_token=lambda t, lp: seen.append(t)))
        queued = asyncio.ensure_future(eng.generate(ids, {"max_new_tokens": 5}))
        while len(seen) < 4:
            await asyncio.sleep(0.01)
        await eng.abort()
        return await first, await queued

    partial, queued = _run(run())
    assert partial.finish_reason == "abort" and 4 <= len(partial.output_ids) < 400
    _, expected = _reference_pass(reference, ids + partial.output_ids)
    assert np.array_equal(partial.routed_experts, expected.numpy())
    assert (queued.finish_reason, queued.output_ids, queued.routed_experts) == ("abort", [], None)


def test_routing_is_recorded_only_when_asked_and_only_for_mixture_of_experts_models(tiny_moe_model_dir,
                                                                                     tiny_model_dir):
    eng = embedded.load_engine(str(tiny_moe_model_dir))
    assert not eng._decoder.cache.routes
    out = _run(eng.generate(eng.tokenizer.encode("x"), {"max_new_tokens": 3}))
    assert out.routed_experts is None
    with pytest.raises(PluginError) as err:
        embedded.load_engine(str(tiny_model_dir), record_routing=True)
    assert str(err.value) == ("--use-rollout-routing-replay: the model (LlamaForCausalLM) has no mixture-of-experts "
                              "layer, so there is no routing to record; run without the flag.")


def test_rollout_engine_hook_records_routing_under_the_flag(tiny_moe_model_dir):
    from furlong.core.config.launch_args import launch_config

    config = launch_config(hf_checkpoint=str(tiny_moe_model_dir), configure=False)
    assert embedded.rollout_engine(config=config, engine_index=0)._decoder.cache.routes == []
    eng = embedded.rollout_engine(config=config.replace(use_rollout_routing_replay=True), engine_index=0)
    assert eng._decoder.experts.record and eng.routing.moe_layers == (0, 1) and eng.routing.topk == 2


# --- weight sync ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def other_checkpoint(tmp_path_factory):
    """The tiny MoE with other random weights (seed 1)."""
    return build_tiny_moe_model(tmp_path_factory.mktemp("tiny_moe_seed1") / "model", seed=1)


def _buckets(named: list, size: int) -> list[list]:
    return [named[i:i + size] for i in range(0, len(named), size)]


def test_a_sync_of_per_expert_checkpoint_tensors_equals_loading_that_checkpoint(tiny_moe_model_dir,
                                                                              other_checkpoint):
    from safetensors.torch import load_file

    on_disk = load_file(str(other_checkpoint / "model.safetensors"))
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in on_disk  # the names Megatron's converter sends
    eng = embedded.load_engine(str(tiny_moe_model_dir), record_routing=True)
    loaded = embedded.load_engine(str(other_checkpoint), record_routing=True)
    params = [_params(i, 12) for i in range(3)]
    before = _run(_together(eng, PROMPTS[:3], params))  # the decode graphs, if any, were made with the old weights
    fused = eng.model.model.layers[0].mlp.experts.gate_up_proj
    pointer = fused.data_ptr()
    for bucket in _buckets(sorted(on_disk.items()), 7):
        _run(eng.update_weights(bucket, 1))
    assert fused.data_ptr() == pointer  # written in place
    for name, tensor in loaded.model.state_dict().items():
        assert torch.equal(eng.model.state_dict()[name], tensor), name
    synced, expected = _run(_together(eng, PROMPTS[:3], params)), _run(_together(loaded, PROMPTS[:3], params))
    assert [o.output_ids for o in synced] != [o.output_ids for o in before]
    for a, b in zip(synced, expected):
        assert (a.output_ids, a.output_log_probs) == (b.output_ids, b.output_log_probs)
        assert np.array_equal(a.routed_experts, b.routed_experts)


def test_a_sync_of_fused_in_memory_tensors_equals_loading_that_checkpoint(tiny_moe_model_dir, other_checkpoint):
    # the fsdp backend sends transformers' in-memory names: mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]
    eng = embedded.load_engine(str(tiny_moe_model_dir))
    loaded = embedded.load_engine(str(other_checkpoint))
    named = sorted(loaded.model.state_dict().items())
    assert ("model.layers.0.mlp.experts.gate_up_proj", (4, 32, 32)) in [(k, tuple(v.shape)) for k, v in named]
    for bucket in _buckets(named, 5):
        _run(eng.update_weights(bucket, 1))
    for name, tensor in named:
        assert torch.equal(eng.model.state_dict()[name], tensor), name


@pytest.mark.parametrize(("name", "shape", "message"), [
    ("model.layers.0.mlp.experts.4.gate_proj.weight", (16, 32),
     "embedded engine: update_weights got unknown tensor 'model.layers.0.mlp.experts.4.gate_proj.weight'; names "
     "must match the model's Hugging Face state_dict or its checkpoint's per-expert names."),
    ("model.layers.2.mlp.experts.0.down_proj.weight", (32, 16),
     "embedded engine: update_weights got unknown tensor 'model.layers.2.mlp.experts.0.down_proj.weight'; names "
     "must match the model's Hugging Face state_dict or its checkpoint's per-expert names."),
    ("model.layers.0.mlp.experts.0.gate_proj.bias", (16,),
     "embedded engine: update_weights got unknown tensor 'model.layers.0.mlp.experts.0.gate_proj.bias'; names "
     "must match the model's Hugging Face state_dict or its checkpoint's per-expert names."),
    ("model.layers.0.mlp.experts.1.down_proj.weight", (16, 32),
     "embedded engine: update_weights tensor 'model.layers.0.mlp.experts.1.down_proj.weight' has shape (16, 32), "
     "the model expects (32, 16)."),
])
def test_unknown_expert_names_and_shapes_are_one_clear_error(tiny_moe_model_dir, name, shape, message):
    eng = embedded.load_engine(str(tiny_moe_model_dir))
    with pytest.raises(PluginError) as err:
        _run(eng.update_weights([(name, torch.zeros(shape))], 1))
    assert str(err.value) == message


def test_single_turn_generation_puts_the_routing_of_every_fed_token_into_the_sample(tiny_moe_model_dir, reference):
    # a fresh sample, then a partial one resumed with the budget it has left: the resumed request feeds the earlier
    # response again, so its record covers the whole sequence
    from furlong.builtin_plugins.generate import single_turn
    from furlong.core.config.launch_args import launch_config
    from furlong.hooks import Sample, Status

    config = launch_config(hf_checkpoint=str(tiny_moe_model_dir), configure=False)
    eng = embedded.load_engine(str(tiny_moe_model_dir), record_routing=True)
    params = {"temperature": 1.0, "max_new_tokens": 10, "ignore_eos": True, "sampling_seed": 3}
    sample = _run(single_turn.generate(config=config, sample=Sample(prompt="Hello there"), sampling_params=params,
                                       engine=eng, evaluation=False))
    sample.validate()
    _, expected = _reference_pass(reference, sample.tokens)
    assert sample.status == Status.TRUNCATED and np.array_equal(sample.rollout_routed_experts, expected.numpy())

    partial = Sample(prompt="Q: 1+1=", tokens=eng.tokenizer.encode("Q: 1+1=") + [70, 71, 72], response="def",
                     response_length=3, rollout_log_probs=[-1.0] * 3, status=Status.ABORTED)
    resumed = _run(single_turn.generate(config=config, sample=partial, sampling_params=params, engine=eng,
                                        evaluation=False))
    resumed.validate()
    assert resumed.response_length == 10
    _, expected = _reference_pass(reference, resumed.tokens)
    assert np.array_equal(resumed.rollout_routed_experts, expected.numpy())


def test_a_record_that_no_longer_covers_the_tokens_is_dropped(tiny_moe_model_dir):
    # an engine that records nothing: new tokens leave the sample no record; no new token keeps the one it has
    from scripted_engine import ScriptedEngine

    from furlong.builtin_plugins.generate import single_turn
    from furlong.core.config.launch_args import launch_config
    from furlong.hooks import Sample, Status

    config = launch_config(hf_checkpoint=str(tiny_moe_model_dir), configure=False)
    for text, kept in (("de", False), ("", True)):
        engine = ScriptedEngine(lambda prompt, n, text=text: (text, "abort"))
        routed = np.zeros((4, 2, 2), dtype=np.int32)
        partial = Sample(prompt="abc", tokens=[97, 98, 99, 100, 101], response="de", response_length=2,
                         rollout_log_probs=[-1.0, -1.0], status=Status.ABORTED, rollout_routed_experts=routed)
        out = _run(single_turn.generate(config=config, sample=partial, sampling_params={"max_new_tokens": 6},
                                        engine=engine, evaluation=False))
        out.validate()
        assert (out.rollout_routed_experts is routed) == kept and (out.rollout_routed_experts is None) != kept
