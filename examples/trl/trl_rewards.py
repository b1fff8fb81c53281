"""Reward functions in TRL's form, for the data set of docs/from-trl.md.

TRL calls each of a ``GRPOTrainer``'s ``reward_funcs`` as ``f(prompts=..., completions=..., **columns)``
on a batch and reads one float per completion; furlong calls a function of that form the same way when
``--custom-rm-path`` names it (PYTHONPATH=examples/trl ... --custom-rm-path trl_rewards.boxed_accuracy).
"""

from __future__ import annotations

import re

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def _text(completion) -> str:
    """A completion's text: conversational completions are lists of messages, the last one the model's."""
    return completion[-1]["content"] if isinstance(completion, list) else completion


def boxed_accuracy(completions, solution, **kwargs):
    """1.0 when the completion's last ``\\boxed{}`` holds the row's ``solution``, else 0.0."""
    rewards = []
    for completion, answer in zip(completions, solution):
        boxes = _BOXED.findall(_text(completion))
        rewards.append(1.0 if boxes and boxes[-1].strip() == str(answer).strip() else 0.0)
    return rewards
