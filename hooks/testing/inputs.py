"""Realistic inputs of the contract kit: a character tokenizer, a tiny engine, samples and tensors."""

from __future__ import annotations

from typing import Callable

from ..types import AdvantageInput, GenerateOutput, LossInput, Sample, Status

__all__ = ["CharTokenizer", "TinyEngine", "advantage_input", "loss_input", "sample_group"]


class CharTokenizer:
    """One token per character (token id = code point); id 0 is end-of-sequence."""

    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids if i != 0)


class TinyEngine:
    """A deterministic stand-in for a :class:`~furlong.hooks.RolloutEngine`, for ``generate`` plugins.

    ``reply(prompt_text, call_number) -> text`` (default: a short worked answer ending in
    ``\\boxed{2}``). Each request returns at most ``max_new_tokens`` tokens of the reply
    (finish reason ``length`` when cut, else ``stop``), log-prob -0.5 per token and the
    weight version ``version``. ``requests`` records every request (input ids and
    sampling parameters); ``generated`` counts the tokens returned.
    """

    def __init__(self, reply: Callable[[str, int], str] | None = None, version: int = 3):
        self.tokenizer = CharTokenizer()
        self.reply = reply or (lambda prompt, call: "1+1 makes two. \\boxed{2}")
        self.version = version
        self.requests: list[dict] = []
        self.generated = 0

    async def generate(self, input_ids, sampling_params) -> GenerateOutput:
        self.requests.append({"input_ids": list(input_ids), **sampling_params})
        ids = self.tokenizer(self.reply(self.tokenizer.decode(input_ids), len(self.requests)))["input_ids"]
        budget = int(sampling_params.get("max_new_tokens", len(ids)))
        out = ids[:budget]
        self.generated += len(out)
        return GenerateOutput(output_ids=out, output_log_probs=[-0.5] * len(out),
                              finish_reason="length" if len(ids) > budget else "stop",
                              weight_version=str(self.version), text=self.tokenizer.decode(out))

    async def abort(self) -> None:
        return None

    async def health(self) -> bool:
        return True


def sample_group(n: int = 4, group_index: int = 0, first_index: int = 0, scored: bool = False) -> list[Sample]:
    """``n`` finished samples of one prompt ("What is 1+1?", label "2"), as the core hands them to rewards and filters.

    Responses alternate between a right boxed answer and a wrong one; prompt and response
    are tokenized with :class:`CharTokenizer`, with rollout log-probs and weight versions
    as ``generate`` leaves them. ``scored``: rewards set (1.0 right, 0.0 wrong).
    """
    tok = CharTokenizer()
    prompt = "What is 1+1?"
    samples = []
    for i in range(n):
        response = "1+1 makes two. \\boxed{2}" if i % 2 == 0 else "It is \\boxed{3}"
        ids = tok(response)["input_ids"]
        samples.append(Sample(prompt=prompt, label="2", metadata={}, group_index=group_index, index=first_index + i,
                              tokens=tok(prompt)["input_ids"] + ids, response=response, response_length=len(ids),
                              rollout_log_probs=[-0.5] * len(ids), weight_versions=["3"], status=Status.COMPLETED,
                              reward=(1.0 if i % 2 == 0 else 0.0) if scored else None))
    return samples


def _token_tensors(lengths: list[int], low: float, high: float, seed: int) -> list:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [low + (high - low) * torch.rand(t, generator=gen) for t in lengths]


LENGTHS = [5, 3, 7, 4, 6, 2, 5, 3]


def advantage_input() -> AdvantageInput:
    """A batch of 2 prompts x 4 samples with every optional field, as the core builds it (float32, int64)."""
    import torch

    masks = [torch.ones(t) for t in LENGTHS]
    masks[2][:2] = 0  # a multi-turn sample whose first tokens are not trained
    return AdvantageInput(
        rewards=torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0]),
        group_ids=torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]),
        trajectory_ids=torch.arange(len(LENGTHS)),
        loss_masks=masks,
        log_probs=_token_tensors(LENGTHS, -3.0, -0.1, 1),
        ref_log_probs=_token_tensors(LENGTHS, -3.0, -0.1, 2),
        values=_token_tensors(LENGTHS, -1.0, 1.0, 3),
        teacher_log_probs=_token_tensors(LENGTHS, -3.0, -0.1, 4),
    )


def loss_input(n: int = 3):
    """A micro-batch of ``n`` samples as the core builds it; ``log_probs`` carry grad."""
    import torch

    lengths = LENGTHS[:n]
    log_probs = [t.requires_grad_() for t in _token_tensors(lengths, -3.0, -0.1, 5)]
    masks = [torch.ones(t) for t in lengths]
    masks[0][-1] = 0
    return LossInput(
        log_probs=log_probs, old_log_probs=_token_tensors(lengths, -3.0, -0.1, 6),
        advantages=_token_tensors(lengths, -1.0, 1.0, 7), loss_masks=masks,
        ref_log_probs=_token_tensors(lengths, -3.0, -0.1, 8), rollout_log_probs=_token_tensors(lengths, -3.0, -0.1, 9),
        entropy=_token_tensors(lengths, 0.1, 2.0, 10), values=[t.requires_grad_() for t in _token_tensors(lengths, -1, 1, 11)],
        old_values=_token_tensors(lengths, -1.0, 1.0, 12), returns=_token_tensors(lengths, -1.0, 1.0, 13),
    )
