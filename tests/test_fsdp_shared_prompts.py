"""Prompt sharing in the fsdp backend's forward: each distinct prompt of a micro-batch runs once, and the
log-probs, entropy and parameter gradients equal those of one pass over every whole sequence."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import attrs
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from tiny_model import run_two_ranks  # noqa: E402

from furlong.builtin_plugins.backends.fsdp import logprobs, shared_prompts  # noqa: E402
from furlong.builtin_plugins.backends.fsdp.model import enable_activation_checkpointing  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 40


def _tiny(model_type: str, attention: str = "sdpa"):
    """A 2-layer random causal LM of ``model_type`` (hidden 32, 4 query heads, 2 key/value heads)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16} if model_type == "qwen3_moe" else {}
    if model_type == "mistral":
        extra["sliding_window"] = None
    config = AutoConfig.for_model(model_type, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=VOCAB,
                                  max_position_embeddings=128, tie_word_embeddings=False, **extra)
    config._attn_implementation = attention
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def _micro_batch():
    """Two groups with different prompt and response lengths, a pair whose prompts differ only in their last
    token (they share a prefix), and two samples with a prompt of their own; one response is empty."""
    g = torch.Generator().manual_seed(1)

    def draw(n):
        return torch.randint(4, VOCAB, (n,), generator=g).tolist()

    a, b, c, d = draw(9), draw(4), draw(12), draw(6)
    samples = [(a, draw(3)), (c, draw(5)), (a, draw(7)), (a, draw(1)), (b, draw(6)), (b, draw(2)), (a, []),
               (d, draw(4)), (d[:-1] + [d[-1] % 7 + 4], draw(3))]
    return [p + r for p, r in samples], [len(r) for _, r in samples]


def _run(model, tokens, lengths, *, share: bool, grad: bool, calls: list | None = None, **kwargs):
    model.zero_grad(set_to_none=True)
    lp, ent = logprobs.forward_log_probs(model, tokens, lengths, 0.7, torch.device("cpu"), grad=grad,
                                         entropy_grad=grad, share_prompts=share, **kwargs)
    grads = None
    if grad:
        (sum(x.sum() for x in lp) + 0.1 * sum(e.sum() for e in ent)).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return [x.detach() for x in lp], [e.detach() for e in ent], grads


@pytest.fixture
def counted(monkeypatch):
    """The list of ``(micro-batch size, layout)`` of the passes that went through prompt sharing."""
    calls = []
    original = shared_prompts.shared_forward

    def spy(model, decoder, shared, device):
        calls.append((len(shared.owner), shared.layout))
        return original(model, decoder, shared, device)

    monkeypatch.setattr(shared_prompts, "shared_forward", spy)
    return calls


@pytest.fixture(params=[shared_prompts.ROWS, shared_prompts.TWO_PASSES])
def layout(request, monkeypatch):
    """Every plan made in the test takes this layout."""
    original = shared_prompts.plan_sharing

    def forced(*args, **kwargs):
        plan = original(*args, **kwargs)
        return None if plan is None else attrs.evolve(plan, layout=request.param)

    monkeypatch.setattr(shared_prompts, "plan_sharing", forced)
    return request.param


def _assert_same(a, b, lengths, atol=1e-5):
    lp_a, ent_a, g_a = a
    lp_b, ent_b, g_b = b
    assert [len(x) for x in lp_a] == list(lengths)
    for x, y in zip(lp_a + ent_a, lp_b + ent_b):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=atol)
    if g_b is not None:
        assert g_a.keys() == g_b.keys()
        for name in g_b:
            torch.testing.assert_close(g_a[name], g_b[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("model_type", sorted(shared_prompts.MODEL_TYPES))
@pytest.mark.parametrize("whole_logits", [False, True])
def test_shared_prompts_give_the_unshared_values_and_gradients(model_type, whole_logits, layout, counted, monkeypatch):
    model = _tiny(model_type)
    model.config.use_cache = False  # as the backend loads it: the cache must be asked for explicitly
    if whole_logits:  # the path of FSDP2-sharded models and soft-capped logits
        monkeypatch.setattr(logprobs, "_split_head", lambda m: None)
    tokens, lengths = _micro_batch()
    for grad in (False, True):
        shared = _run(model, tokens, lengths, share=True, grad=grad)
        _assert_same(shared, _run(model, tokens, lengths, share=False, grad=grad), lengths)
    assert counted == [(len(tokens), layout)] * 2


def test_eager_attention_shares_in_both_layouts(layout, counted):
    model = _tiny("llama", attention="eager")
    tokens, lengths = _micro_batch()
    _assert_same(_run(model, tokens, lengths, share=True, grad=True),
                 _run(model, tokens, lengths, share=False, grad=True), lengths)
    assert counted == [(len(tokens), layout)]


def test_plan_groups_samples_by_prefix():
    tokens, lengths = _micro_batch()
    seqs = [torch.tensor(t) for t in tokens]
    plan = shared_prompts.plan_sharing(seqs, lengths)
    assert plan.owner == [0, 1, 0, 0, 2, 2, 0, 3, 3]
    assert [len(p) for p in plan.prefixes] == [8, 11, 3, 5]
    assert [len(s) for s in plan.suffixes] == [t + 1 for t in lengths]
    assert plan.layout == shared_prompts.ROWS
    assert shared_prompts.plan_sharing(seqs[:2], lengths[:2]) is None  # nothing shared
    assert shared_prompts.plan_sharing([torch.tensor([5, 6, 7])] * 2, [2, 2]) is None  # one-token prompts


def test_plan_takes_the_layout_of_least_work(monkeypatch):
    # a long unshared prompt beside a short shared one: one pass pads to 3 x 22 = 66 tokens, two passes to
    # 2 x 19 + 3 x 11 = 71, rows to 2 x max(19 + 3, 1 + 11 + 11) = 46
    long, short = list(range(4, 24)), [5, 6]
    seqs = [torch.tensor(long + [7, 7]), torch.tensor(short + [8] * 10), torch.tensor(short + [9] * 10)]
    assert shared_prompts.plan_sharing(seqs, [2, 10, 10]).layout == shared_prompts.ROWS
    monkeypatch.setattr(shared_prompts, "ROWS_MASK_LIMIT", 2 * 23 * 23 - 1)  # the rows' mask is over the limit
    assert shared_prompts.plan_sharing(seqs, [2, 10, 10]) is None
    # four samples of 30 response tokens after a 3-token prompt, a query-key pair costing 0.01 token: one
    # pass 4 x 33 + 0.01 x 4 x 33^2 = 175.6; rows (one of 2 + 4 x 31) 126 + 0.01 x 126^2 = 284.8;
    # two passes 2 + 4 x 31 + 0.01 x (2^2 + 4 x 31 x 33) = 167.0
    seqs = [torch.tensor([5, 6, 7] + [8 + k] * 30) for k in range(4)]
    assert shared_prompts.plan_sharing(seqs, [30] * 4, pair_cost=0.01).layout == shared_prompts.TWO_PASSES
    assert shared_prompts.plan_sharing(seqs, [30] * 4, pair_cost=0.001).layout == shared_prompts.TWO_PASSES
    # responses of 1, 2, 3 and 10 tokens: two passes pad every suffix to 11, 2 + 4 x 11 + 0.01 x (4 + 4 x 11 x 13)
    # = 51.8; rows lay them end to end, 2 + 20 + 0.01 x 22^2 = 26.8
    seqs = [torch.tensor([5, 6, 7] + [8 + k] * n) for k, n in enumerate((1, 2, 3, 10))]
    assert shared_prompts.plan_sharing(seqs, [1, 2, 3, 10], pair_cost=0.01).layout == shared_prompts.ROWS
    # the same responses of 3 tokens each pad alike in both (18 tokens), and two passes have fewer query-key pairs
    seqs = [torch.tensor([5, 6, 7] + [8 + k] * 3) for k in range(4)]
    assert shared_prompts.plan_sharing(seqs, [3] * 4, pair_cost=0.01).layout == shared_prompts.TWO_PASSES


def test_attention_pair_cost_counts_the_layer_weights():
    from transformers import AutoConfig

    demo = AutoConfig.from_pretrained(Path(__file__).parents[1] / "examples" / "demo" / "model")
    # 4 heads of 32; weights 128 x 32 x (2 x 4 + 2 x 4) + 3 x 128 x 256 = 163,840
    assert shared_prompts.attention_pair_cost(demo) == 2 * 4 * 32 / 163_840
    moe = AutoConfig.for_model("qwen3_moe", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               intermediate_size=999, moe_intermediate_size=32, num_experts_per_tok=2)
    assert shared_prompts.attention_pair_cost(moe) == 2 * 4 * 16 / (64 * 16 * (8 + 4) + 3 * 64 * 64)


def test_a_second_pass_costs_a_fixed_number_of_tokens():
    from transformers import AutoConfig

    demo = AutoConfig.from_pretrained(Path(__file__).parents[1] / "examples" / "demo" / "model")
    assert shared_prompts.pass_cost(demo) == shared_prompts.PASS_OVERHEAD / 163_840
    # the demo's micro-batch: 8 prompts whose prefixes are 11 tokens, 8 samples each of 12 response tokens;
    # with c = 1/640, rows: 8 x 115 + 8 x 115^2 c = 1085.3; two passes: 8 x 11 + 64 x 13 + (8 x 11^2 + 64 x 13 x 24) c
    # = 952.7, below rows until the second pass's fixed cost (about 201 tokens here) is counted
    g = torch.Generator().manual_seed(0)
    seqs = []
    for _ in range(8):
        prompt = torch.randint(4, 26, (12,), generator=g)
        seqs += [torch.cat([prompt, torch.randint(4, 26, (12,), generator=g)]) for _ in range(8)]
    pair, fixed = shared_prompts.attention_pair_cost(demo), shared_prompts.pass_cost(demo)
    assert shared_prompts.plan_sharing(seqs, [12] * 64, pair).layout == shared_prompts.TWO_PASSES
    assert shared_prompts.plan_sharing(seqs, [12] * 64, pair, fixed).layout == shared_prompts.ROWS
    assert shared_prompts.pass_cost(AutoConfig.for_model("llama", hidden_size=0)) == 0.0


def test_lora_model_shares_prompts(counted):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_tiny("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    tokens, lengths = _micro_batch()
    _assert_same(_run(model, tokens, lengths, share=True, grad=True),
                 _run(model, tokens, lengths, share=False, grad=True), lengths)
    assert counted == [(len(tokens), shared_prompts.ROWS)]


def test_bf16_autocast_stays_close(layout):
    model = _tiny("qwen2")
    tokens, lengths = _micro_batch()

    def run(share):
        return _run(model, tokens, lengths, share=share, grad=True,
                    autocast=torch.autocast("cpu", dtype=torch.bfloat16))

    (lp_a, ent_a, g_a), (lp_b, ent_b, g_b) = run(True), run(False)
    for x, y in zip(lp_a + ent_a, lp_b + ent_b):  # bfloat16 matmuls in other shapes round differently
        torch.testing.assert_close(x, y, rtol=0.05, atol=0.05)
    for name in g_b:
        assert torch.cosine_similarity(g_a[name].flatten(), g_b[name].flatten(), dim=0) > 0.99, name


def test_gradient_checkpointing_keeps_two_passes_to_eval_mode(layout, counted, caplog, monkeypatch):
    """The backend trains in train mode (checkpointed layers drop the cache, which only ``two_passes`` needs) and
    computes log-probs in eval mode."""
    monkeypatch.setattr(shared_prompts, "_logged", set())  # the choice is logged once per process
    model = _tiny("llama")
    enable_activation_checkpointing(model)
    model.train()
    tokens, lengths = _micro_batch()
    with caplog.at_level(logging.INFO, logger="furlong.backends.fsdp"):
        _assert_same(_run(model, tokens, lengths, share=True, grad=True),
                     _run(model, tokens, lengths, share=False, grad=True), lengths)
        assert counted == ([(len(tokens), layout)] if layout == shared_prompts.ROWS else [])
        model.eval()
        _assert_same(_run(model, tokens, lengths, share=True, grad=False),
                     _run(model, tokens, lengths, share=False, grad=False), lengths)
        assert counted[-1] == (len(tokens), layout)
    off = ("fsdp: prompt sharing is off (--gradient-checkpointing drops the key/value cache in training passes); "
           "every sample runs its whole sequence")
    assert (off in caplog.messages) == (layout == shared_prompts.TWO_PASSES)
    assert "fsdp: samples that share a prompt run it once per micro-batch (prompt sharing)" in caplog.messages


@pytest.mark.parametrize("case", ["eager_attention", "sliding_window", "other_model_type"])
def test_models_that_cannot_share_say_why(case):
    if case == "eager_attention":
        assert shared_prompts.sharing_off_reason(_tiny("llama", attention="eager")) is None
        return
    if case == "sliding_window":
        model = _tiny("mistral")
        model.config.sliding_window = 8
        model.config.layer_types = ["sliding_attention"] * 2
        expected = "the model has sliding-window or other non-full attention layers"
    else:
        from transformers import GPT2Config, GPT2LMHeadModel

        model = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=VOCAB))
        expected = "model type 'gpt2' is not one of llama, mistral, qwen2, qwen3, qwen3_moe"
    assert shared_prompts.sharing_off_reason(model) == expected


@pytest.mark.timeout(240)
def test_two_rank_fsdp2_shares_prompts(tiny_model_dir, tmp_path):
    """Two gloo ranks, FSDP2-sharded: each rank's shared-prompt pass gives the unshared log-probs and gradients;
    a micro-batch shares only when every rank's does, and in the layout of fewer passes when their plans differ
    (each pass all-gathers every layer on all ranks)."""
    run_two_ranks("fsdp_shared_prompts_two_ranks.py", str(tiny_model_dir), str(tmp_path))
    for rank in (0, 1):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert result["shared_calls"] == 1
        _assert_same(result["shared"], result["unshared"], result["lengths"])
        assert result["mixed_calls"] == 0  # only rank 0 could share, so neither did
        if rank == 0:  # (the gradients, summed over ranks, include rank 1's other micro-batch)
            _assert_same(result["mixed"][:2] + (None,), result["unshared"][:2] + (None,), result["lengths"])
        # rank 0 planned rows, rank 1 two passes: both ran two passes (one forward pass each would not match)
        assert result["shared_layouts"] == [shared_prompts.ROWS, shared_prompts.TWO_PASSES]
        _assert_same(result["layouts"], result["unshared"], result["lengths"])
