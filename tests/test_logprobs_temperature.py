"""Trainer log-probs divide the logits by the rollout temperature, as the sampling engine does."""

from __future__ import annotations

import math

import pytest
import torch

from furlong.builtin_plugins.backends.fsdp.logprobs import forward_log_probs, token_log_probs
from furlong.builtin_plugins.engines.embedded.sampling import sample_batch


def test_c014_trainer_log_prob_uses_the_temperature():
    # log_softmax([2, 0] / 0.5)[0] = log_softmax([4, 0])[0] = -log(1 + e^-4) = -0.018150
    logp, _ = token_log_probs(torch.tensor([[2.0, 0.0]]), torch.tensor([0]), temperature=0.5)
    assert logp.item() == pytest.approx(-0.018150, abs=1e-6)
    # the engine reports -0.018150, so the TIS ratio exp(train - rollout) is 1.000
    assert math.exp(logp.item() - (-0.018150)) == pytest.approx(1.0, abs=1e-5)


def test_c014_without_scaling_gives_the_buggy_value():
    # temperature 1 (no scaling): -log(1 + e^-2) = -0.126928, the value the bug reports at T = 0.5
    logp, _ = token_log_probs(torch.tensor([[2.0, 0.0]]), torch.tensor([0]), temperature=1.0)
    assert logp.item() == pytest.approx(-0.126928, abs=1e-6)
    assert math.exp(logp.item() - (-0.018150)) == pytest.approx(0.8969, abs=1e-4)


def test_c014_engine_reports_the_same_log_prob():
    # the embedded engine's sampler reports log_softmax(logits / T) of the chosen token
    tokens, logp = sample_batch(torch.tensor([[2.0, 0.0]]), torch.tensor([0.5]), torch.tensor([False]),
                                torch.tensor([0]), torch.tensor([0]))
    expected = {0: -0.018150, 1: -4.018150}[int(tokens)]  # log_softmax([4, 0]) = [-0.018150, -4.018150]
    assert float(logp) == pytest.approx(expected, abs=1e-6)


def test_entropy_of_the_scaled_distribution():
    # p = softmax([4, 0]) = [0.982014, 0.017986], log p = [-0.018150, -4.018150]
    # H = 0.982014 * 0.018150 + 0.017986 * 4.018150 = 0.017824 + 0.072271 = 0.090095
    _, ent = token_log_probs(torch.tensor([[2.0, 0.0]]), torch.tensor([1]), temperature=0.5)
    assert ent.item() == pytest.approx(0.090095, abs=1e-6)


def test_zero_temperature_means_no_scaling():
    # greedy rollouts (T = 0) report unscaled log-probs; the trainer does not divide by 0
    logp, _ = token_log_probs(torch.tensor([[2.0, 0.0]]), torch.tensor([0]), temperature=0.0)
    assert logp.item() == pytest.approx(-0.126928, abs=1e-6)


class _FixedLogits(torch.nn.Module):
    """A 'model' whose logits at position j are table[token_j]: checks the one-position shift."""

    def __init__(self, table):
        super().__init__()
        self.table = table

    def forward(self, input_ids, use_cache, attention_mask=None):
        return type("Out", (), {"logits": self.table[input_ids]})()


def test_forward_uses_the_logits_of_the_previous_position():
    # vocab 2; after token 0 the logits are [2, 0], after token 1 they are [0, 2]
    table = torch.tensor([[2.0, 0.0], [0.0, 2.0]])
    model = _FixedLogits(table)
    # sample A: prompt [0], response [0, 1]: token 0 follows 0 -> [2,0][0]; token 1 follows 0 -> [2,0][1]
    # sample B (shorter, right-padded): prompt [1], response [1]: follows 1 -> [0,2][1]
    lp, ent = forward_log_probs(model, [[0, 0, 1], [1, 1]], [2, 1], 0.5, torch.device("cpu"), grad=False,
                                entropy_grad=False)
    a, b = -0.018150, -4.018150  # log_softmax([4, 0])
    assert torch.allclose(lp[0], torch.tensor([a, b]), atol=1e-6)
    assert torch.allclose(lp[1], torch.tensor([a]), atol=1e-6)
    assert [x.shape for x in ent] == [torch.Size([2]), torch.Size([1])]


def test_forward_rejects_a_response_without_a_prompt_token():
    model = _FixedLogits(torch.zeros(2, 2))
    with pytest.raises(ValueError) as err:
        forward_log_probs(model, [[0, 1]], [2], 1.0, torch.device("cpu"), grad=False, entropy_grad=False)
    assert str(err.value) == "sample 0: response_length 2 leaves no prompt token in 2 tokens"
