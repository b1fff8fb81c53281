"""The embedded engine's Triton decode kernels (attention over a slot, plain sampling), run by Triton's
interpreter (``TRITON_INTERPRET=1`` executes them on CPU tensors), against the torch code they replace on
CUDA: the attention over each row's own columns and the cache it leaves, the torch sampler's tokens and
log-probs, and a whole engine run with both kernels switched on. The interpreter's bfloat16 ``tl.dot`` is
wrong (garbage even for a 16 x 16 product), so attention is compared in float32 here and in bfloat16 on a
GPU by ``benchmarks/bench_gpu.py`` (part ``kernels``); the sampler has no ``tl.dot`` and is compared in
both dtypes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from furlong.builtin_plugins.engines.embedded import decode_kernels  # noqa: E402
from furlong.builtin_plugins.engines.embedded.decode import SlotDecoder  # noqa: E402


def _interpreted(script: str, *argv: str) -> dict:
    if sys.platform != "linux":
        pytest.importorskip("triton", reason="Triton publishes wheels for Linux only (the dev extra installs it there)")
    done = subprocess.run([sys.executable, "-c", script, *argv], env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


ATTENTION = r"""
import json, torch
from furlong.builtin_plugins.engines.embedded.decode_kernels import decode_attention
from furlong.builtin_plugins.engines.embedded.slots import SlotCache, SlotPass, slot_attention

out = {}
for heads, kv_heads, dim, capacity in ((14, 2, 64, 150), (4, 4, 16, 40), (8, 2, 128, 70)):
    gen = torch.Generator().manual_seed(heads + dim)
    rows = 5
    cache = SlotCache(1, kv_heads, dim, torch.float32, torch.device("cpu"))
    cache.ensure(8, capacity)
    for buffer in (*cache.keys, *cache.values):
        buffer.normal_(generator=gen)
    before = [b.clone() for b in (*cache.keys, *cache.values)]
    query = torch.randn(rows, heads, 1, dim, generator=gen)
    key, value = torch.randn(rows, kv_heads, 1, dim, generator=gen), torch.randn(rows, kv_heads, 1, dim, generator=gen)
    pos = torch.tensor([0, 3, 64, 65, capacity - 1]) % capacity
    scale = 0.3
    # the reference: each row's columns 0 .. pos with the new key and value in place, key/value head h // group
    k_ref, v_ref = before[0].clone(), before[1].clone()
    for b in range(rows):
        k_ref[b, :, pos[b]], v_ref[b, :, pos[b]] = key[b, :, 0], value[b, :, 0]
    ref = []
    for b in range(rows):
        keys = k_ref[b, :, : pos[b] + 1].repeat_interleave(heads // kv_heads, 0)
        values = v_ref[b, :, : pos[b] + 1].repeat_interleave(heads // kv_heads, 0)
        weights = (query[b, :, 0, None, :] @ keys.transpose(-1, -2) * scale).softmax(-1)
        ref.append((weights @ values)[:, 0])
    ref = torch.stack(ref)[:, None]
    module = type("Layer", (), {"layer_idx": 0})()
    step = SlotPass(cache=cache, rows=torch.arange(rows), columns=pos[:, None], kernel=True)
    got, _ = slot_attention(module, query, key, value, None, scaling=scale, slot_pass=step)
    untouched = all(torch.equal(a[rows:], b[rows:]) for a, b in zip((*cache.keys, *cache.values), before))
    # the same call through torch's attention (the path without the kernel)
    cache_torch = SlotCache(1, kv_heads, dim, torch.float32, torch.device("cpu"))
    cache_torch.ensure(8, capacity)
    cache_torch.keys[0].copy_(before[0]); cache_torch.values[0].copy_(before[1])
    visible = (torch.arange(capacity)[None, :] <= pos[:, None])[:, None, None, :]
    plain, _ = slot_attention(module, query, key, value, None, scaling=scale,
                              slot_pass=SlotPass(cache=cache_torch, rows=torch.arange(rows), columns=pos[:, None],
                                                 visible=visible, width=capacity))
    out[f"{heads}x{kv_heads}x{dim}"] = {
        "shape": list(got.shape), "gap": (got - ref).abs().max().item(), "gap_torch": (got - plain).abs().max().item(),
        "keys": torch.equal(cache.keys[0][:rows], k_ref[:rows]), "values": torch.equal(cache.values[0][:rows], v_ref[:rows]),
        "same_cache_as_torch": torch.equal(cache.keys[0], cache_torch.keys[0]) and torch.equal(cache.values[0], cache_torch.values[0]),
        "other_slots_untouched": untouched}
print(json.dumps(out))
"""


def test_decode_attention_attends_each_row_s_own_columns_and_writes_its_key_and_value():
    got = _interpreted(ATTENTION)
    assert set(got) == {"14x2x64", "4x4x16", "8x2x128"}
    for shape, r in got.items():
        heads, _, dim = map(int, shape.split("x"))
        assert r["shape"] == [5, 1, heads, dim]
        assert r["gap"] < 1e-5 and r["gap_torch"] < 1e-5, (shape, r)  # float32 sums in another order
        assert r["keys"] and r["values"] and r["same_cache_as_torch"] and r["other_slots_untouched"], (shape, r)


SAMPLING = r"""
import json, torch
from furlong.builtin_plugins.engines.embedded.decode_kernels import BLOCK, sample_plain
from furlong.builtin_plugins.engines.embedded.sampling import sample_batch

out = {}
gen = torch.Generator().manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    for vocab in (50, BLOCK, 2 * BLOCK + 37):
        rows = 12
        logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)
        logits[3, 17] = 40.0  # a row that is almost greedy
        logits[4, : vocab // 2] = logits[4, vocab // 2 :][: vocab // 2]  # ties: the first maximum wins
        logits[6, : min(vocab - 1, BLOCK)] = float("-inf")  # a whole block banned (masked vocabulary): no NaN
        logits[9, 1:] = float("-inf")  # greedy over one allowed token
        temperature = torch.tensor([1.0, 0.7, 1.0, 1.3, 1.0, 2.0, 1.0, 0.5, 1.0, 1.0, 1.1, 1.0])
        greedy = torch.zeros(rows, dtype=torch.bool)
        greedy[[2, 4, 9]] = True
        seeds = torch.arange(rows) * 7919 + 5
        counters = torch.arange(rows) * 3
        draws = []
        for step in range(6):  # successive tokens of every row
            ref_tokens, ref_lp = sample_batch(logits.float(), temperature, greedy, seeds, counters + step)
            tokens, lp = sample_plain(logits, temperature, greedy, seeds, counters + step)
            draws.append([ref_tokens.tolist(), tokens.tolist(), (ref_lp - lp).abs().max().item(), str(tokens.dtype),
                          str(lp.dtype)])
        out[f"{dtype}-{vocab}"] = draws
print(json.dumps(out))
"""


def test_plain_sampling_kernels_draw_the_torch_sampler_s_tokens_and_log_probs():
    got = _interpreted(SAMPLING)
    assert len(got) == 6
    for case, draws in got.items():
        distinct = set()
        for ref_tokens, tokens, gap, tok_dtype, lp_dtype in draws:
            assert tokens == ref_tokens, case
            assert gap < 2e-6 and (tok_dtype, lp_dtype) == ("torch.int64", "torch.float32"), case  # (NaN fails)
            distinct.update(tokens[k] for k in (0, 1, 5))
        assert len(distinct) > 3, case  # sampled rows draw different tokens at successive steps


ENGINE = r"""
import asyncio, json, sys, torch
from furlong.builtin_plugins.engines import embedded
from furlong.builtin_plugins.engines.embedded import decode_kernels

torch.set_num_threads(1)
prompts = ["Hello there", "Q: 1+1=", "x", "abc", "Q: 1+1=", "a longer prompt of text"]
params = [{"temperature": t, "max_new_tokens": n, "sampling_seed": 3 + i, "ignore_eos": True}
          for i, (t, n) in enumerate([(1.0, 9), (0.7, 20), (0, 5), (1.3, 14), (1.0, 9), (1.0, 12)])]
# steps with a filtering row (top-k, top-p) and a banning one (min_new_tokens before a stop token) run the torch
# sampler on the kernel attention's logits
params[1] |= {"top_k": 5, "top_p": 0.9}
params[3] |= {"min_new_tokens": 6, "stop_token_ids": [7, 8, 9]}
outs = {}
routing = sys.argv[2] == "routing"
for name in ("torch", "kernels"):
    eng = embedded.load_engine(sys.argv[1], max_batch_size=3, record_routing=routing)
    if name == "kernels":  # what a CUDA decoder chooses (the kernels run here in the interpreter)
        eng._decoder.attention_kernel = True
        eng._decoder._sample = decode_kernels.sample_plain

    async def run():
        return await asyncio.gather(*[eng.generate(eng.tokenizer.encode(p), dict(q)) for p, q in zip(prompts, params)])

    outs[name] = [[o.output_ids, o.output_log_probs, o.finish_reason,
                   None if o.routed_experts is None else o.routed_experts.tolist()] for o in asyncio.run(run())]
print(json.dumps(outs))
"""


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_an_engine_decoding_with_both_kernels_gives_the_torch_path_s_results(model, tiny_model_dir,
                                                                               tiny_moe_model_dir):
    """Continuous batching (6 requests in 3 slots: slots freed, refilled and compacted), shared prompts,
    greedy and sampled rows: the same tokens and finish reasons, log-probs to float rounding; a
    mixture-of-experts model with its routing recorded: the same experts at every fed token."""
    folder, routing = (tiny_model_dir, "") if model == "dense" else (tiny_moe_model_dir, "routing")
    got = _interpreted(ENGINE, str(folder), routing)
    assert len(got["torch"]) == 6
    for (ids, lps, reason, routed), (k_ids, k_lps, k_reason, k_routed) in zip(got["torch"], got["kernels"]):
        assert k_ids == ids and k_reason == reason and reason in ("length", "stop")
        assert k_lps == pytest.approx(lps, abs=1e-5)
        assert k_routed == routed and (routed is None) == (model == "dense")


def test_a_decoder_without_cuda_uses_torch_s_attention_and_sampler(tiny_model_dir):
    import threading

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from furlong.builtin_plugins.engines.embedded.sampling import sample_batch

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    decoder = SlotDecoder(model, AutoTokenizer.from_pretrained(tiny_model_dir), max_slots=2, lock=threading.Lock())
    assert (decoder.attention_kernel, decoder.sampling_kernel, decoder._sample) == (False, False, sample_batch)


@pytest.mark.parametrize("shape, fits", [((14, 2, 64), True), ((32, 8, 128), True), ((4, 4, 16), True),
                                         ((12, 4, 80), False), ((8, 8, 8), False), ((8, 8, 512), False),
                                         ((6, 4, 64), False)])
def test_attention_kernel_takes_power_of_two_heads_of_16_to_256_and_whole_groups(shape, fits):
    assert decode_kernels.attention_fits(*shape) is (fits and decode_kernels.triton_available())


def test_prefill_attention_with_repeated_key_value_heads_equals_grouped_attention():
    """The CUDA prefill path (key/value heads repeated, memory-efficient kernel first) against
    ``enable_gqa`` on the same inputs, run here on CPU tensors: left-padded rows, 14 query heads on 2."""
    from furlong.builtin_plugins.engines.embedded.slots import prefill_attention

    gen = torch.Generator().manual_seed(5)
    rows, width, dim = 3, 9, 16
    query = torch.randn(rows, 14, width, dim, generator=gen)
    key, value = torch.randn(rows, 2, width, dim, generator=gen), torch.randn(rows, 2, width, dim, generator=gen)
    valid = torch.ones(rows, width, dtype=torch.bool)
    valid[1, :4] = valid[2, :7] = False
    mask = ((torch.ones(width, width, dtype=torch.bool).tril()[None] & valid[:, None, :])
            | torch.eye(width, dtype=torch.bool)[None])[:, None]
    grouped = prefill_attention(query, key, value, mask, 0.25, cuda=False)
    repeated = prefill_attention(query, key, value, mask, 0.25, cuda=True)
    assert repeated.shape == (rows, 14, width, dim)
    assert torch.allclose(repeated, grouped, atol=1e-6, rtol=0)
    head = 9  # query head 9 reads key/value head 9 // 7 = 1
    scores = (query[:, head] @ key[:, 1].transpose(-1, -2) * 0.25).masked_fill(~mask[:, 0], float("-inf"))
    assert torch.allclose(grouped[:, head], scores.softmax(-1) @ value[:, 1], atol=1e-6, rtol=0)
