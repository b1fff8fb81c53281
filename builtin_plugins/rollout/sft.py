"""Supervised fine-tuning through the RL loop: each rollout tokenizes conversations instead of generating.

``--rollout sft`` (Miles: ``--rollout-function-path miles.rollout.sft_rollout.generate_rollout``)
takes ``--rollout-batch-size`` rows per rollout, whose ``--input-key`` holds a chat
conversation, and turns each into one finished sample: the conversation's tokens, a loss
mask over the assistant turns (:mod:`furlong.kit.chat_masks`, ``--loss-mask-type``, with
``--apply-chat-template-kwargs`` passed to the template), the
response starting at the first trained token, reward 0. Train them with ``--loss-type
sft_loss`` (the negative log-likelihood of the masked tokens); ``--calculate-per-token-loss``
averages over the step's trained tokens, as an SFT trainer does. No engine is asked for anything.
"""

from __future__ import annotations

import logging

from furlong.hooks import PluginError, Status, hookimpl
from furlong.kit.chat_masks import assistant_loss_mask, response_span
from furlong.kit.hf import load_tokenizer

__all__ = ["configure", "rollout"]

log = logging.getLogger("furlong.rollout")

PLUGIN = "sft"
NEEDS_REWARD = False
"""The samples are scored 0 here; the run needs no --rm-type (read by the core before the first rollout)."""


@hookimpl
def configure(args, report):
    """One sample per row (``--n-samples-per-prompt 1``) and a loss that does not need rewards."""
    if args.n_samples_per_prompt != 1:
        report.error(f"--rollout sft makes one sample per conversation: --n-samples-per-prompt must be 1, got "
                     f"{args.n_samples_per_prompt}.")
    if args.loss_type != "sft_loss":
        report.error(f"--rollout sft: its samples carry no reward, so --loss-type {args.loss_type} would learn "
                     "nothing from them; give --loss-type sft_loss.")
    if args.apply_chat_template:
        report.error("--rollout sft renders each conversation itself, with its loss mask; drop "
                     "--apply-chat-template (the rows keep their messages).")


@hookimpl
async def rollout(config, rollout_id, context):
    """Tokenize ``--rollout-batch-size`` conversations into finished, masked samples.

    :returns: ``rollout_batch_size`` groups of one sample each; ``tokens`` = the rendered
        conversation, ``response_length`` = from its first trained token to the end,
        ``loss_mask`` = the mask over that span, ``reward`` 0.0, status completed.
    :raises PluginError: a row whose prompt is not a list of chat messages, or one with no
        trained token (names the sample).
    """
    tokenizer = context.state.get("tokenizer")
    if tokenizer is None:
        tokenizer = context.state["tokenizer"] = load_tokenizer(config.hf_checkpoint, "--hf-checkpoint")
        if config.chat_template_path:
            with open(config.chat_template_path, encoding="utf-8") as handle:
                tokenizer.chat_template = handle.read()
    style, template_kwargs = config.loss_mask_type, dict(config.apply_chat_template_kwargs or {})
    groups = await context.data.get_samples(config.rollout_batch_size)
    for group in groups:
        for sample in group:
            where = f"sample {sample.index}"
            if not isinstance(sample.prompt, list):
                raise PluginError(f"--rollout sft: {where}: --input-key must hold a list of chat messages, got "
                                  f"{type(sample.prompt).__name__}.")
            tokens, mask = assistant_loss_mask(tokenizer, sample.prompt, style, sample.metadata.get("tools"), where,
                                               template_kwargs)
            length = response_span(mask)
            if not length:
                raise PluginError(f"--rollout sft: {where} has no assistant turn to train on.")
            sample.tokens, sample.response_length = tokens, length
            sample.loss_mask = mask[-length:]
            sample.response = tokenizer.decode(tokens[-length:])
            sample.reward = 0.0
            sample.status = Status.COMPLETED
    if rollout_id == 0 and groups:
        first = groups[0][0]
        log.info("--rollout sft: sample %s has %d tokens, %d of them trained", first.index, len(first.tokens),
                 sum(first.loss_mask))
    return groups
