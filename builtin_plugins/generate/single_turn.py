"""One request per sample: prompt in, response out (the ``single_turn`` generate plugin)."""

from __future__ import annotations

import functools

from furlong.hooks import PluginError, Status, hookimpl
from furlong.kit.turns import append_generated


@hookimpl
async def generate(config, sample, sampling_params, engine, evaluation):
    """Generate ``sample``'s response with one engine request, or continue a partial one.

    A resumed partial sample (``response_length > 0``) continues from its ``tokens`` with
    the budget left, ``max_new_tokens - response_length`` (never the whole budget again); no
    budget left means ``truncated`` without a request. ``--rollout-max-context-len`` caps prompt +
    response tokens the same way. Appends output ids to ``tokens``, their log-probs to
    ``rollout_log_probs``, the text to ``response``, the engine's weight version to
    ``weight_versions`` (and, for a request that straddled a weight update, its spans in
    response-token positions to ``extra["weight_version_spans"]``); status from the finish reason (stop → completed, length →
    truncated, abort → aborted). An engine that records routing (``--use-rollout-routing-replay``) gives the
    experts of every fed token, prompt and response: they become ``rollout_routed_experts`` (a resumed sample's
    earlier tokens were fed again, so the new record covers them; new tokens without a record leave none).

    :raises PluginError: the prompt is a chat message list and ``--apply-chat-template``
        is off.
    """
    if not isinstance(sample.prompt, str):
        raise PluginError(
            f"sample {sample.index}: the prompt is a list of chat messages; single_turn generation needs a "
            "string. Pass --apply-chat-template to render message lists with the tokenizer's chat template."
        )
    params = dict(sampling_params)
    budget = None if params.get("max_new_tokens") is None else int(params["max_new_tokens"])
    if sample.response_length > 0:
        input_ids = list(sample.tokens)
        if budget is not None:
            budget -= sample.response_length
    else:
        input_ids = list(_prompt_ids(engine.tokenizer, sample.prompt))
        sample.tokens = list(input_ids)
    context_cap = config.eval_max_context_len if evaluation else config.rollout_max_context_len
    if context_cap:
        room = int(context_cap) - len(input_ids)
        budget = room if budget is None else min(budget, room)
    if budget is not None and budget <= 0:
        sample.status = Status.TRUNCATED
        return sample
    params["max_new_tokens"] = budget  # None: the engine's own default (SGLang's and the embedded engine's: 128)
    out = await engine.generate(input_ids, params)
    _append(config, sample, out, engine.tokenizer, params)
    return sample


@functools.lru_cache(maxsize=4096)
def _prompt_ids(tokenizer, prompt: str) -> tuple[int, ...]:
    """The prompt's token ids (no special tokens added), once per prompt: a group's samples share it."""
    return tuple(tokenizer(prompt, add_special_tokens=False)["input_ids"])


def _append(config, sample, out, tokenizer, params) -> None:
    previous = sample.response_length
    append_generated(sample, out, tokenizer, params)
    if config.mask_offpolicy_in_partial_rollout and previous:
        sample.loss_mask = [0] * previous + [1] * len(out.output_ids)
