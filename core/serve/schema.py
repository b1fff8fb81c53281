"""Request bodies of ``furlong serve``: SGLang's field names, checked before anything runs.

Field names, types and defaults are those of SGLang 0.5.23 (``sglang/api/v1/api_types.py``
for ``/generate`` and its ``sampling_params``; ``sglang/srt/managers/io_struct.py`` for
the control endpoints). Every problem is a :class:`BadRequest` (HTTP 400) naming the
endpoint and field. furlong is stricter than SGLang in one respect: a field SGLang does
not know is refused instead of ignored, and a field SGLang knows but furlong does not
implement is refused unless it has its "off" value (null, false, 0, an empty list), so a
request never silently means something else. An unknown ``/generate`` field with an off
value passes: routers re-serialise bodies and add their own (sglang-router 0.3.2 adds
``"model": null``).
"""

from __future__ import annotations

import uuid
from typing import Any, Callable

import attrs

__all__ = ["BadRequest", "BodyError", "ContractError", "Field", "GenerateItem", "check_body", "check_bool", "check_int", "check_number", "check_str",
           "list_of", "one_of", "optional", "parse_generate"]


class BadRequest(ValueError):
    """A request the server refuses with HTTP 400; ``str(exc)`` is the message sent back.

    The body of the answer follows SGLang 0.5.23 (``srt/entrypoints/http_server.py``), which
    has three: a plain refusal of a valid request (a prompt longer than the context)
    answers ``{"error": {"message"}}``; :class:`ContractError` and :class:`BodyError` below.
    """


class ContractError(BadRequest):
    """A ``/generate`` body that breaks SGLang's JSON contract: ``{"error": "<message>"}``."""


class BodyError(BadRequest):
    """A control endpoint's body its request type refuses: ``{"object": "error", "message", "type":
    "Bad Request", "param": null, "code": 400}`` (SGLang's answer to a failed body validation)."""


# --- value checks: each returns the value or raises BadRequest --------------------------------


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _type_error(where: str, value: Any, expected: str) -> BadRequest:
    return BadRequest(f"{where}: expected {expected}, got {type(value).__name__} {value!r:.60}")


def check_str(where, v):
    """``v`` if it is a string, else :class:`BadRequest` naming ``where``."""
    if not isinstance(v, str):
        raise _type_error(where, v, "a string")
    return v


def check_bool(where, v):
    """``v`` if it is true or false (not 0 or 1)."""
    if not isinstance(v, bool):
        raise _type_error(where, v, "true or false")
    return v


def check_int(where, v):
    """``v`` if it is an integer (not a boolean, not a float)."""
    if not _is_int(v):
        raise _type_error(where, v, "an integer")
    return v


def check_number(where, v):
    """``v`` if it is an integer or a float (not a boolean)."""
    if not (_is_int(v) or isinstance(v, float)):
        raise _type_error(where, v, "a number")
    return v


def list_of(item: Callable) -> Callable:
    """A check for a list whose every element passes ``item``."""
    def check(where, v):
        if not isinstance(v, list):
            raise _type_error(where, v, "a list")
        return [item(f"{where}[{i}]", x) for i, x in enumerate(v)]
    return check


def optional(check: Callable) -> Callable:
    """A check that also lets null through."""
    return lambda where, v: None if v is None else check(where, v)


def one_of(*choices: str) -> Callable:
    """A check for one of ``choices``."""
    def check(where, v):
        if v not in choices:
            raise BadRequest(f"{where}: {v!r} is not one of {', '.join(map(repr, choices))}")
        return v
    return check


def _str_or_list(where, v):
    return [check_str(where, v)] if isinstance(v, str) else list_of(check_str)(where, v)


@attrs.define(frozen=True)
class Field:
    """One body field: its check, its default, and whether furlong honours it.

    ``honoured=False``: SGLang knows the field but furlong does not implement it; only
    its "off" value (``off``, or null) is accepted.
    """

    check: Callable
    default: Any = None
    honoured: bool = True
    off: Any = None


def _is_off(value: Any, field: Field) -> bool:
    if isinstance(value, list):
        return all(_is_off(v, field) for v in value)
    if isinstance(value, dict):  # an options object whose every option is off (``{"enabled": false}``)
        return all(_is_off(v, field) for v in value.values())
    return value is None or value is False or value == field.off or value in ([], {}, "")


def check_body(endpoint: str, body: Any, fields: dict[str, Field], unknown_off_ok: bool = False) -> dict[str, Any]:
    """Check a JSON body against ``fields``; return every field's value (defaults filled in).

    :param endpoint: the path, for messages (``"/abort_request"``).
    :param body: the parsed JSON (None for an empty body: all defaults).
    :param unknown_off_ok: accept (and drop) unknown fields whose value is null, false or empty.
    :raises BadRequest: not an object, an unknown field, a wrong type, a field furlong does
        not implement given a value that is not "off".
    """
    body = {} if body is None else body
    if not isinstance(body, dict):
        raise BadRequest(f"{endpoint}: the body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(k for k in set(body) - set(fields) if not (unknown_off_ok and _is_off(body[k], Field(None))))
    if unknown:
        raise BadRequest(f"{endpoint}: unknown field {', '.join(map(repr, unknown))}; "
                         f"fields: {', '.join(sorted(fields))}")
    out = {}
    for name, field in fields.items():
        if name not in body:
            out[name] = field.default
            continue
        value = body[name]
        if not field.honoured:
            if not _is_off(value, field):
                also = "" if field.off is None else f" or {field.off}"
                raise BadRequest(f"{endpoint}: field '{name}' = {value!r:.60} is not supported by furlong serve "
                                 f"(only its off value: null, false, empty{also})")
            out[name] = field.default
            continue
        out[name] = field.default if value is None else field.check(f"{endpoint} '{name}'", value)
    return out


# --- /generate ---------------------------------------------------------------------------------

def _ANY(where, v):  # noqa: N802 - checked elsewhere (per batch item) or never used (off values only)
    return v


# SGLang 0.5.23 api_types.SamplingParams: every key, with its check. Unknown keys are a 400 there
# too. Keys furlong does not implement are accepted at their neutral value only.
SAMPLING_FIELDS: dict[str, Field] = {
    "max_new_tokens": Field(check_int),
    "stop": Field(_str_or_list),
    "stop_token_ids": Field(list_of(check_int)),
    "temperature": Field(check_number),
    "top_p": Field(check_number),
    "top_k": Field(check_int),
    "min_new_tokens": Field(check_int),
    "ignore_eos": Field(check_bool),
    "skip_special_tokens": Field(check_bool),
    "spaces_between_special_tokens": Field(check_bool),
    "no_stop_trim": Field(check_bool),
    "stream_interval": Field(check_int),
    "sampling_seed": Field(check_int),
    "n": Field(check_int, honoured=False, off=1),
    "min_p": Field(check_number, honoured=False, off=0),
    "frequency_penalty": Field(check_number, honoured=False, off=0),
    "presence_penalty": Field(check_number, honoured=False, off=0),
    "repetition_penalty": Field(check_number, honoured=False, off=1),
    "stop_regex": Field(_str_or_list, honoured=False),
    "json_schema": Field(check_str, honoured=False),
    "regex": Field(check_str, honoured=False),
    "ebnf": Field(check_str, honoured=False),
    "structural_tag": Field(check_str, honoured=False),
    "logit_bias": Field(_ANY, honoured=False),
    "custom_params": Field(_ANY, honoured=False),
    "beam_width": Field(check_int, honoured=False, off=1),
    "watermark": Field(_ANY, honoured=False),
    "choice": Field(list_of(check_str), honoured=False),
}

# Fields that only steer SGLang's logging, metrics or routing: they change no output here.
_INERT = ("log_metrics", "no_logs", "custom_labels", "routing_key", "conversation_id", "session_id", "priority",
          "received_time", "external_trace_header", "http_worker_ipc", "routed_dp_rank", "data_parallel_rank",
          "disagg_prefill_dp_rank", "extra_key", "cache_salt", "model")

# SGLang 0.5.23 GenerateReqInput fields furlong serve does not implement (accepted when off).
_NOT_IMPLEMENTED = (
    "input_embeds", "image_data", "video_data", "audio_data", "mm_hashes", "mm_content_hashes", "use_audio_in_video",
    "video_config", "token_ids_logprob", "return_sampling_mask", "sampling_logprobs_mode",
    "return_flat_raw_top_logprobs", "return_flat_raw_output_top_logprobs", "return_hidden_states",
    "return_indexer_topk", "modalities", "session_params",
    "lora_path", "lora_id", "custom_logit_processor", "positional_embed_overrides", "bootstrap_host",
    "bootstrap_port", "bootstrap_room", "bootstrap_pair_key", "decode_tp_size", "background", "require_reasoning",
    "max_thinking_tokens", "return_bytes", "return_entropy", "return_prompt_token_ids", "need_wait_for_mm_inputs",
    "num_items_assigned", "encoder_urls", "max_dynamic_patch", "min_dynamic_patch", "image_max_dynamic_patch",
    "video_max_dynamic_patch", "images_config", "mm_processor_kwargs", "multi_item_delimiter_indices",
    "token_indices_to_pool", "kv_hints",
)

GENERATE_FIELDS: dict[str, Field] = {
    "rid": Field(_ANY), "text": Field(_ANY), "input_ids": Field(_ANY), "sampling_params": Field(_ANY),
    "return_logprob": Field(_ANY), "stream": Field(check_bool, False), "return_text_in_logprobs":
    Field(check_bool, False), "logprob_start_len": Field(_ANY),
    "top_logprobs_num": Field(_ANY, honoured=False, off=0),
    "return_routed_experts": Field(check_bool, False), "routed_experts_start_len": Field(check_int, 0),
    **{name: Field(_ANY) for name in _INERT},
    **{name: Field(_ANY, honoured=False) for name in _NOT_IMPLEMENTED},
}


@attrs.define
class GenerateItem:
    """One prompt of a ``/generate`` request, checked.

    ``input_ids`` or ``text`` (exactly one); ``sampling_params`` with only SGLang keys,
    type-checked (ranges are the engine's to check); ``output_params`` the keys that
    shape the response rather than the sampling (``no_stop_trim``,
    ``spaces_between_special_tokens``, ``stream_interval``). ``return_routed_experts``: answer
    the experts each fed token was routed to, from input position ``routed_experts_start_len`` on.
    """

    rid: str
    sampling_params: dict
    output_params: dict
    return_logprob: bool
    input_ids: list[int] | None = None
    text: str | None = None
    logprob_start_len: int = -1
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0


_OUTPUT_KEYS = ("no_stop_trim", "spaces_between_special_tokens", "stream_interval")


def parse_generate(body: Any) -> tuple[list[GenerateItem], bool, dict]:
    """Check a ``/generate`` body; return ``(items, is_batch, top-level fields)``.

    A batch is ``text`` as a list of strings or ``input_ids`` as a list of lists;
    ``sampling_params`` and ``return_logprob`` may then be one value for all or a list;
    a string ``rid`` becomes ``rid_0``, ``rid_1``... (SGLang's rule); no ``rid``: random.

    :raises BadRequest: see :func:`check_body`; neither or both of ``text`` and
        ``input_ids``; an empty prompt; list lengths that differ from the batch; an
        unknown sampling key; ``n`` other than 1; repeated request ids.
    """
    top = check_body("/generate", body, GENERATE_FIELDS, unknown_off_ok=True)
    text, input_ids = top["text"], top["input_ids"]
    if (text is None) == (input_ids is None):
        raise BadRequest("/generate: give exactly one of 'text' and 'input_ids'")
    if text is not None:
        batch = isinstance(text, list)
        prompts = _str_or_list("/generate 'text'", text)
    else:
        batch = isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)
        rows = input_ids if batch else [input_ids]
        prompts = [list_of(check_int)(f"/generate 'input_ids'{f'[{i}]' if batch else ''}", r)
                   for i, r in enumerate(rows)]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise BadRequest("/generate: empty prompt; give at least one character or token id per prompt")
    n = len(prompts)
    params = _per_item("sampling_params", top["sampling_params"], n, batch, dict, {})
    logprob = _per_item("return_logprob", top["return_logprob"], n, batch, bool, False)
    starts = _per_item("logprob_start_len", top["logprob_start_len"], n, batch, int, -1)
    rids = _rids(top["rid"], n, batch)
    items = []
    for i in range(n):
        where = f"/generate 'sampling_params'{f'[{i}]' if batch else ''}"
        check_body(where, params[i], SAMPLING_FIELDS)
        given = {k: v for k, v in params[i].items() if v is not None and SAMPLING_FIELDS[k].honoured}
        output = {k: given.pop(k) for k in _OUTPUT_KEYS if k in given}
        items.append(GenerateItem(rid=rids[i], sampling_params=given, output_params=output,
                                  return_logprob=logprob[i], logprob_start_len=starts[i],
                                  return_routed_experts=top["return_routed_experts"],
                                  routed_experts_start_len=top["routed_experts_start_len"],
                                  **{"text" if text is not None else "input_ids": prompts[i]}))
    return items, batch, top


def _per_item(name: str, value: Any, n: int, batch: bool, kind: type, default: Any) -> list:
    where = f"/generate '{name}'"
    if value is None:
        return [default] * n
    if isinstance(value, list) and batch:
        if len(value) != n:
            raise BadRequest(f"{where}: {len(value)} values for a batch of {n} prompts")
        values = value
    else:
        values = [value] * n
    expected = {dict: "an object", bool: "true or false", int: "an integer"}[kind]
    for i, v in enumerate(values):
        if v is not None and (not isinstance(v, kind) or (kind is int and isinstance(v, bool))):
            raise _type_error(f"{where}[{i}]" if batch else where, v, expected)
    return [default if v is None else v for v in values]


def _rids(rid: Any, n: int, batch: bool) -> list[str]:
    if rid is None:
        return [uuid.uuid4().hex for _ in range(n)]
    if isinstance(rid, str):
        return [f"{rid}_{i}" for i in range(n)] if batch else [rid]
    rids = list_of(check_str)("/generate 'rid'", rid)
    if not batch or len(rids) != n:
        raise BadRequest(f"/generate 'rid': {len(rids)} ids for {n} prompt(s); give one string per prompt")
    if len(set(rids)) != n:
        raise BadRequest(f"/generate 'rid': repeated request ids {sorted({r for r in rids if rids.count(r) > 1})}")
    return rids
