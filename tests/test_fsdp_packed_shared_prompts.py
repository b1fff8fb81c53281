"""Prompt sharing in a packed row: each prompt once, then the suffixes of the samples that share it.

The packed row is the fsdp backend's micro-batch on GPUs (:mod:`furlong.builtin_plugins.backends.fsdp.packing`);
with shared prompts each suffix attends to its prompt's keys and then its own
(:func:`furlong.builtin_plugins.backends.fsdp.packing.pack_shared`). The values and gradients must be those of the
unshared row.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_fsdp_packing import _qwen2  # noqa: E402

from furlong.builtin_plugins.backends.fsdp import packing  # noqa: E402
from furlong.builtin_plugins.backends.fsdp.logprobs import forward_log_probs  # noqa: E402
from furlong.kit.packed_attention import packed_causal_attention  # noqa: E402
from furlong.kit.shared_rows import prefix_groups  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CPU = torch.device("cpu")


def _groups(seed: int = 2):
    """Three prompts (lengths 7, 4, 2) with 3, 1 and 2 samples of several response lengths, interleaved."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 61, (n,), generator=g) for n in (7, 4, 2)]
    plan = [(0, 5), (1, 3), (0, 1), (2, 6), (0, 9), (2, 2)]
    tokens = [torch.cat([prompts[p], torch.randint(0, 61, (t,), generator=g)]) for p, t in plan]
    return tokens, [t for _, t in plan]


def _run(model, tokens, responses, share: bool):
    model.zero_grad()
    lp, ent = forward_log_probs(model, tokens, responses, 0.7, CPU, grad=True, entropy_grad=True, share_prompts=share)
    weights = [torch.linspace(-1, 1, len(x), dtype=torch.float32) for x in lp]
    (sum((w * x).sum() + 0.3 * (w * e).sum() for w, x, e in zip(weights, lp, ent))).backward()
    return [x.detach() for x in lp], [e.detach() for e in ent], {n: p.grad.clone() for n, p in model.named_parameters()}


def test_shared_packed_row_gives_the_unshared_log_probs_entropy_and_gradients(monkeypatch):
    tokens, responses = _groups()
    model = _qwen2()
    assert packing.use_packed_attention(model) is None
    rows = []
    real = packing.pack_shared
    monkeypatch.setattr(packing, "pack_shared", lambda *a: rows.append(real(*a)) or rows[-1])
    unshared = _run(model, tokens, responses, share=False)
    assert not rows
    shared = _run(model, tokens, responses, share=True)
    # the row holds 6 + 3 + 1 prompt tokens before the suffixes (each prompt but its last token, once)
    assert rows and rows[0][0].shape[1] == (6 + 3 + 1) + sum(t + 1 for t in responses)
    assert [len(x) for x in shared[0]] == responses
    for a, b in zip(unshared[0] + unshared[1], shared[0] + shared[1]):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
    assert max(g.abs().max().item() for g in unshared[2].values()) > 1e-3
    for name, grad in unshared[2].items():
        torch.testing.assert_close(shared[2][name], grad, rtol=0, atol=1e-6, msg=name)


def test_pack_shared_lays_out_prompts_suffixes_positions_and_keys():
    prompt = torch.tensor([10, 11, 12])
    tokens = [torch.cat([prompt, torch.tensor([20, 21])]), torch.tensor([30, 31, 40]), torch.cat([prompt, torch.tensor([22])])]
    shared = prefix_groups(tokens, [2, 1, 1])
    assert shared.owner == [0, 1, 0]
    ids, positions, spans, starts = packing.pack_shared(shared, CPU)
    # prefix [10, 11], suffixes [12, 20, 21] and [12, 22]; then prefix [30], suffix [31, 40]
    assert ids.tolist() == [[10, 11, 12, 20, 21, 12, 22, 30, 31, 40]]
    assert positions.tolist() == [[0, 1, 2, 3, 4, 2, 3, 0, 1, 2]]
    assert starts == [2, 8, 5]
    assert spans.bounds == [0, 2, 5, 7, 8, 10]
    assert spans.key_index.tolist() == [0, 1, 0, 1, 2, 3, 4, 0, 1, 5, 6, 7, 7, 8, 9]
    assert spans.key_bounds == [0, 2, 7, 11, 12, 15]
    assert spans.key_cu_seqlens.tolist() == spans.key_bounds and spans.key_max_length == 8 and spans.max_length == 4


def test_packed_attention_with_longer_key_segments_is_causal_from_the_bottom_right():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(5, 4, 8, generator=g, dtype=torch.float64)  # segments of 2 and 3 queries
    k, v = (torch.randn(9, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))  # 4 and 5 keys
    out = packed_causal_attention(q, k, v, torch.tensor([0, 2, 5], dtype=torch.int32), 4, 0.3, key_index=torch.arange(9),
                                  key_cu_seqlens=torch.tensor([0, 4, 9], dtype=torch.int32), key_max_length=8)
    for (a, b), (ka, kb) in zip(((0, 2), (2, 5)), ((0, 4), (4, 9))):
        for i in range(b - a):  # query i of n sees keys 0 .. m - n + i
            seen = kb - ka - (b - a) + i + 1
            scores = torch.einsum("hd,khd->hk", q[a + i], k[ka:ka + seen].repeat_interleave(2, 1)) * 0.3
            ref = torch.einsum("hk,khd->hd", scores.softmax(-1), v[ka:ka + seen].repeat_interleave(2, 1))
            torch.testing.assert_close(out[a + i], ref, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="a segment of 3 queries has 2 keys"):
        packed_causal_attention(q, k, v, torch.tensor([0, 2, 5], dtype=torch.int32), 4, 0.3, key_index=torch.arange(6),
                                key_cu_seqlens=torch.tensor([0, 4, 6], dtype=torch.int32), key_max_length=4)


def test_no_shared_prompt_keeps_the_plain_packed_row(monkeypatch):
    tokens, responses = _groups()
    model = _qwen2()
    packing.use_packed_attention(model)
    calls = []
    monkeypatch.setattr(packing, "pack_shared", lambda *a: calls.append(a))
    with torch.no_grad():  # one sample per prompt, and a one-token prompt: nothing to share
        forward_log_probs(model, tokens[:2] + tokens[3:4], responses[:2] + responses[3:4], 1.0, CPU, grad=False,
                          entropy_grad=False)
        forward_log_probs(model, [torch.tensor([5, 6, 7])] * 2, [2, 2], 1.0, CPU, grad=False, entropy_grad=False)
    assert not calls
