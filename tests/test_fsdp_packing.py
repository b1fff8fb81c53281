"""The fsdp backend's packed micro-batches and its fused output projection give the padded path's values.

Packed: the sequences of a micro-batch in one row with per-sequence positions, each attending
only to itself (:mod:`furlong.builtin_plugins.backends.fsdp.packing`). Fused head: the output
projection and the log-prob / entropy reductions in one autograd Function with a closed-form
gradient (:mod:`furlong.builtin_plugins.backends.fsdp.head_log_probs`).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM


sys.path.insert(0, str(Path(__file__).parent))
from tiny_model import make_batch, train_config  # noqa: E402

from furlong.builtin_plugins.backends.fsdp import packing, train_backend  # noqa: E402
from furlong.builtin_plugins.backends.fsdp.head_log_probs import head_log_probs, takes_fused_head  # noqa: E402
from furlong.builtin_plugins.backends.fsdp.logprobs import chunked_log_probs, forward_log_probs  # noqa: E402
from furlong.builtin_plugins.backends.fsdp.shared_prompts import _cache_kwarg  # noqa: E402
from furlong.kit.packed_attention import packed_causal_attention  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CPU = torch.device("cpu")


def _qwen2(sliding: bool = False, seed: int = 0):
    """A tiny Qwen2 with grouped-query attention (4 query heads, 2 key/value heads), float64, sdpa."""
    config = Qwen2Config(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=61, max_position_embeddings=256,
                         use_sliding_window=sliding, sliding_window=8 if sliding else None, max_window_layers=0,
                         attn_implementation="sdpa")
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).double().eval()


def _sequences(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    lengths, responses = [9, 23, 4, 16, 11], [5, 7, 1, 16 - 3, 2]
    return [torch.randint(0, 61, (n,), generator=g) for n in lengths], responses


def _log_probs_and_grads(model, tokens, responses, temperature=0.8):
    model.zero_grad()
    lp, ent = forward_log_probs(model, tokens, responses, temperature, CPU, grad=True, entropy_grad=True,
                                share_prompts=False, chunk_size=6)
    weights = [torch.linspace(-1, 1, len(x), dtype=torch.float32) for x in lp]
    loss = sum((w * x).sum() + 0.3 * (w * e).sum() for w, x, e in zip(weights, lp, ent))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return [x.detach() for x in lp], [e.detach() for e in ent], grads


def test_packed_forward_gives_the_padded_log_probs_entropy_and_gradients():
    tokens, responses = _sequences()
    padded = _log_probs_and_grads(_qwen2(), tokens, responses)
    model = _qwen2()
    assert packing.use_packed_attention(model) is None and packing.packs(model)
    packed = _log_probs_and_grads(model, tokens, responses)
    assert [len(x) for x in packed[0]] == responses
    for a, b in zip(padded[0] + padded[1], packed[0] + packed[1]):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
    assert max(g.abs().max().item() for g in padded[2].values()) > 1e-3  # the loss reaches the weights
    for name, grad in padded[2].items():
        torch.testing.assert_close(packed[2][name], grad, rtol=0, atol=1e-6, msg=name)


def test_packed_row_keeps_each_sequence_to_itself():
    # the same sequence gives the same log-probs whatever is packed before it
    tokens, responses = _sequences()
    model = _qwen2()
    packing.use_packed_attention(model)
    with torch.no_grad():
        alone, _ = forward_log_probs(model, tokens[1:2], responses[1:2], 1.0, CPU, grad=False, entropy_grad=False)
        after, _ = forward_log_probs(model, tokens, responses, 1.0, CPU, grad=False, entropy_grad=False)
    torch.testing.assert_close(after[1], alone[0], rtol=0, atol=1e-10)


def test_packed_attention_model_without_spans_is_sdpa():
    # a padding mask (as prompt sharing and ordinary callers pass) still works after the switch
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    plain, switched = _qwen2(), _qwen2()
    packing.use_packed_attention(switched)
    with torch.no_grad():
        a = plain(input_ids=ids, attention_mask=mask).logits
        b = switched(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_packed_attention_model_continues_past_cached_keys_as_sdpa():
    # a multi-token pass after a key/value cache needs the causal mask aligned to the cache's end
    ids = torch.randint(0, 61, (1, 12), generator=torch.Generator().manual_seed(0))
    model = _qwen2()
    packing.use_packed_attention(model)
    with torch.no_grad():
        full = model(input_ids=ids).logits
        first = model(input_ids=ids[:, :5], use_cache=True)
        name = _cache_kwarg(model)[0]  # cache (transformers 5.2x) or past_key_values
        second = model(input_ids=ids[:, 5:], use_cache=True, **{name: first.past_key_values}).logits
    torch.testing.assert_close(second, full[:, 5:], rtol=0, atol=1e-10)


def test_varlen_call_asks_for_causal_attention_in_the_form_this_torch_takes(monkeypatch):
    import torch.nn.attention.varlen as varlen

    from furlong.kit import packed_attention as pa

    calls = []
    monkeypatch.setattr(varlen, "varlen_attn", lambda q, k, v, *a, **kw: calls.append((k.shape, kw)) or q)
    monkeypatch.setattr(pa, "varlen_kernel", lambda query: True)
    q, kv = torch.zeros(6, 4, 8), torch.zeros(6, 2, 8)
    bounds = torch.tensor([0, 2, 6], dtype=torch.int32)
    for parameters, causal in (({"window_size": None}, {"window_size": (-1, 0)}), ({"is_causal": None},
                                                                                     {"is_causal": True})):
        for has_gqa_switch in (False, True):
            monkeypatch.setattr(pa, "_VARLEN_PARAMETERS", {**parameters, **({"enable_gqa": None} if has_gqa_switch else {})})
            monkeypatch.setattr(pa, "_VARLEN_GQA", has_gqa_switch)
            pa.packed_causal_attention(q, kv, kv, bounds, 4, 0.5)
            gqa = {"enable_gqa": True} if has_gqa_switch else {}
            # eagerly the flash kernel takes the 2 key/value heads as they are where this torch is known to
            # pass them through (torch 2.10's form, is_causal without enable_gqa, gets them repeated)
            heads = 4 if "is_causal" in parameters and not has_gqa_switch else 2
            assert calls[-1] == (torch.Size([6, heads, 8]), {"scale": 0.5, **gqa, **causal})
            with monkeypatch.context() as compiling:
                compiling.setattr(torch.compiler, "is_compiling", lambda: True)
                pa.packed_causal_attention(q, kv, kv, bounds, 4, 0.5)
            # traced by torch.compile they are repeated per query head (the copy fuses into a compiled kernel)
            assert calls[-1] == (torch.Size([6, 4, 8]), {"scale": 0.5, **causal})


def test_packing_is_refused_where_it_cannot_run():
    eager = _qwen2()
    eager.set_attn_implementation("eager")
    assert packing.use_packed_attention(eager) == "attention 'eager' (packing runs on sdpa)"
    assert not packing.packs(eager)
    assert packing.packing_off_reason(_qwen2(sliding=True)) == (
        "the model has sliding-window or other non-full attention layers")
    dropping = _qwen2()
    dropping.config.attention_dropout = 0.1
    assert packing.use_packed_attention(dropping) == "attention dropout 0.1 (packed attention has none)"
    assert not packing.packs(dropping)


def test_packing_needs_the_attention_mask_interface_and_per_layer_caches(monkeypatch):
    from transformers import cache_utils

    monkeypatch.delattr(cache_utils, "DynamicLayer")
    reason = packing.use_packed_attention(_qwen2())
    assert reason.startswith("transformers ") and reason.endswith("has no attention-mask interface or per-layer cache")


def test_packed_attention_matches_a_block_diagonal_mask():
    g = torch.Generator().manual_seed(3)
    bounds = [0, 5, 6, 14, 14, 20]  # an empty sequence and a one-token one
    q = torch.randn(20, 4, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(20, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    out = packed_causal_attention(q, k, v, torch.tensor(bounds, dtype=torch.int32), 8, 0.3)
    seq = torch.repeat_interleave(torch.arange(5), torch.tensor(bounds).diff())
    pos = torch.arange(20)
    allowed = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1), v.repeat_interleave(2, 1).transpose(0, 1),
        attn_mask=allowed, scale=0.3).transpose(0, 1)
    assert out.shape == (20, 4, 8)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_fused_head_gives_the_checkpointed_head_values_and_gradients(temperature):
    g = torch.Generator().manual_seed(4)
    head = torch.nn.Linear(16, 50, bias=False)
    assert takes_fused_head(head) and not takes_fused_head(torch.nn.Linear(16, 50))
    states = torch.randn(37, 16, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (37,), generator=g)
    w = torch.randn(2, 37, generator=g)
    got = []
    for fn in (lambda: chunked_log_probs(head, states, targets, temperature, chunk=8),
               lambda: head_log_probs(head.weight, states, targets, temperature, chunk=8)):
        head.weight.grad = states.grad = None
        lp, ent = fn()
        ((w[0] * lp).sum() + (w[1] * ent).sum()).backward()
        got.append((lp.detach(), ent.detach(), states.grad.clone(), head.weight.grad.clone()))
    assert got[1][0].dtype == got[1][1].dtype == torch.float32
    for a, b in zip(*got):
        torch.testing.assert_close(b, a, rtol=0, atol=5e-6)
    # log p <= 0 and 0 <= H <= log V
    assert (got[1][0] <= 0).all() and (got[1][1] >= 0).all() and (got[1][1] <= torch.log(torch.tensor(50.0))).all()


def test_fused_head_entropy_without_gradient():
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(30, 8, generator=g, requires_grad=True)
    states = torch.randn(6, 8, generator=g, requires_grad=True)
    targets = torch.randint(0, 30, (6,), generator=g)
    lp, ent = head_log_probs(weight, states, targets, 1.0, entropy_grad=False, chunk=4)
    assert not ent.requires_grad
    lp.sum().backward()
    # d sum logp / d logits = onehot - p: checked against autograd through log_softmax
    ref_w, ref_s = weight.detach().clone().requires_grad_(), states.detach().clone().requires_grad_()
    torch.log_softmax(ref_s @ ref_w.t(), -1).gather(-1, targets[:, None]).sum().backward()
    torch.testing.assert_close(weight.grad, ref_w.grad, rtol=0, atol=1e-6)
    torch.testing.assert_close(states.grad, ref_s.grad, rtol=0, atol=1e-6)


def test_packed_training_step_equals_the_padded_one(tiny_model_dir, monkeypatch):
    # the backend's whole step (micro-batches, loss reduction, optimizer) on packed micro-batches
    rows = []
    original = packing.pack
    monkeypatch.setattr(packing, "pack", lambda seqs, device: rows.append(len(seqs)) or original(seqs, device))
    weights = []
    for pack in (False, True):
        backend = train_backend(config=train_config(tiny_model_dir, optimizer="sgd", sgd_momentum=0.0, lr=1.0,
                                                        clip_grad=0.0, micro_batch_size=4))
        assert asyncio.run(backend.init(backend.config)) == 0
        if pack:
            assert packing.use_packed_attention(backend.model) is None
        batch = make_batch(backend.tokenizer, [[[0, 1, 2, 3]]])
        metrics = asyncio.run(backend.train(0, batch))
        weights.append(({n: t.clone() for n, t in asyncio.run(backend.named_weights())}, metrics[0]))
    assert rows == [4]  # the packed backend's one pass over the micro-batch of 4 (mixed lengths: 6 to 21 tokens)
    (w0, m0), (w1, m1) = weights
    assert m1["loss"] == pytest.approx(m0["loss"], abs=1e-6)
    assert m1["grad_norm"] == pytest.approx(m0["grad_norm"], rel=1e-5)
    for name in w0:
        torch.testing.assert_close(w1[name], w0[name], rtol=0, atol=1e-6, msg=name)
