"""Multi-turn tool calling in Miles' form (the ``multi_turn`` generate plugin).

Miles' ``--custom-generate-function-path miles.rollout.generate_hub.multi_turn.generate``
resolves here, and so does ``--generate multi_turn``. Each turn the model writes; the tool
calls in its text are found with the parser ``--generate-tool-call-parser`` names
(:mod:`furlong.kit.tool_parsers`); each runs through the user's
``--generate-execute-tool-function-path`` function; the results are rendered as ``tool``
messages with the tokenizer's chat template (the next assistant opening included) and
appended with ``loss_mask`` 0; the model goes on from there, for at most
``--generate-max-turns`` turns. ``--generate-tool-specs-path`` names the tools (OpenAI tool
specs), given to the chat template with a chat-message prompt and to the parser.
"""

from __future__ import annotations

import functools
import inspect
import json
from pathlib import Path
from typing import Any

from furlong.hooks import PluginError, Status, hookimpl
from furlong.kit.dotted import import_dotted
from furlong.kit.tool_parsers import ToolCall, tool_call_parser
from furlong.kit.turns import append_generated, append_inserted, appended_messages_ids, tokens_left

__all__ = ["abort", "configure", "execute_function", "generate", "load_tool_specs"]

SPECS_FLAG = "--generate-tool-specs-path"
EXECUTE_FLAG = "--generate-execute-tool-function-path"


class _Episode:
    """One sample in flight; the ``abort`` hook flags it so that no further turn starts."""

    aborted = False


_live: set[_Episode] = set()


@hookimpl
def abort(config, rollout_id):
    """Stop every episode in flight: no further turn starts and the sample ends ``aborted`` (the
    engine's own abort ends the turn being generated; a tool call running now finishes)."""
    for episode in list(_live):
        episode.aborted = True


@hookimpl
def configure(args, report):
    """Check the four flags before any model loads: a known parser, tool specs that load,
    an execute function that imports and is callable, at least one turn; refuse
    ``--partial-rollout`` (an episode cannot resume between turns, as in Miles)."""
    for check in (lambda: tool_call_parser(args.generate_tool_call_parser),
                  lambda: load_tool_specs(args.generate_tool_specs_path),
                  lambda: execute_function(args.generate_execute_tool_function_path)):
        try:
            check()
        except PluginError as exc:
            report.error(str(exc))
    if args.generate_max_turns < 1:
        report.error(f"--generate-max-turns must be at least 1, got {args.generate_max_turns}.")
    if args.partial_rollout:
        report.error("generate 'multi_turn' with --partial-rollout is not supported: an aborted episode cannot "
                     "resume between its turns (Miles refuses it too).")


@functools.lru_cache(maxsize=8)
def load_tool_specs(path: str | None) -> tuple[dict, ...]:
    """The tool specs ``--generate-tool-specs-path`` names: a dotted path to a list of OpenAI
    tool specs (``[{"type": "function", "function": {"name", "description", "parameters"}}]``,
    Miles' form, e.g. ``examples.retool_v2.tool_sandbox.tool_specs``), or a ``.json`` file
    holding such a list.

    :raises PluginError: no path, a path that does not import or read, or a value that is not
        a list of specs each with a function name.
    """
    if not path:
        raise PluginError(f"{SPECS_FLAG} is needed: a dotted path to the list of tool specs (OpenAI form), "
                          "or a .json file holding it.")
    if path.endswith(".json"):
        try:
            specs = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise PluginError(f"{SPECS_FLAG} {path}: cannot read the tool specs: {exc}") from exc
    else:
        specs = import_dotted(path, SPECS_FLAG)
    if not isinstance(specs, (list, tuple)) or not all(
            isinstance(s, dict) and isinstance((s.get("function") or s).get("name"), str) for s in specs):
        raise PluginError(f"{SPECS_FLAG} {path}: expected a list of tool specs, each "
                          '{"type": "function", "function": {"name": ..., "parameters": {...}}}; got '
                          f"{type(specs).__name__}.")
    return tuple(specs)


@functools.lru_cache(maxsize=8)
def execute_function(path: str | None):
    """The user's function ``--generate-execute-tool-function-path`` names:
    ``[async] def execute(name: str, arguments: dict) -> str`` (Miles' signature), returning
    the tool's result as text.

    :raises PluginError: no path, a path that does not import, or an object that is not callable.
    """
    if not path:
        raise PluginError(f"{EXECUTE_FLAG} is needed: module.function, called as function(name, arguments) for "
                          "each tool call, returning the result as a string.")
    fn = import_dotted(path, EXECUTE_FLAG)
    if not callable(fn):
        raise PluginError(f"{EXECUTE_FLAG} {path}: {type(fn).__name__} is not callable.")
    return fn


async def _run_call(path: str, call: ToolCall, call_id: str) -> dict[str, Any]:
    """The ``tool`` message of one call: its result under ``call_id``."""
    try:
        result = execute_function(path)(call.name, dict(call.arguments))
        if inspect.isawaitable(result):
            result = await result
    except PluginError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's tool failed: say which call
        raise PluginError(f"{EXECUTE_FLAG} {path} raised on tool '{call.name}' with arguments "
                          f"{json.dumps(call.arguments)}: {type(exc).__name__}: {exc}") from exc
    if not isinstance(result, str):
        raise PluginError(f"{EXECUTE_FLAG} {path} returned {type(result).__name__} for tool '{call.name}'; it must "
                          "return the result as a string.")
    return {"role": "tool", "tool_call_id": call_id, "content": result, "name": call.name}


def _prompt_ids(tokenizer, prompt, tools) -> list[int]:
    if not isinstance(prompt, str):  # chat messages: rendered with the tools and the assistant opening
        prompt = tokenizer.apply_chat_template(list(prompt), tools=list(tools), tokenize=False,
                                               add_generation_prompt=True)
    return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])


@hookimpl
async def generate(config, sample, sampling_params, engine, evaluation):
    """Generate ``sample``'s response over up to ``--generate-max-turns`` turns, running the
    tool calls of each turn between turns.

    A turn is one engine request from every token so far. Its text is parsed with
    ``--generate-tool-call-parser``; a turn with no call (or one that ends ``length`` or
    ``abort``) ends the episode. Otherwise each call runs through
    ``--generate-execute-tool-function-path`` (``function(name, arguments) -> str``, awaited
    when async), the results become ``{"role": "tool", "tool_call_id", "content", "name"}``
    messages, and the ids the chat template puts after the assistant turn for them (up to
    the next assistant opening, :func:`furlong.kit.turns.appended_messages_ids`) are appended:
    ``loss_mask`` 0, ``rollout_log_probs`` 0.0. The model's tokens get ``loss_mask`` 1 and the
    engine's log-probs. As in Miles, the tools of the last allowed turn still run.

    A string prompt is encoded as it is (``--apply-chat-template`` rendered it); a list of
    chat messages is rendered here with the tool specs and the generation prompt. The budget
    ``max_new_tokens`` covers every response token, the tools' too (Miles gives each turn the
    whole budget; furlong's multi-turn contract caps the sample); ``--rollout-max-context-len``
    (``--eval-max-context-len``) caps prompt plus response. Status: from the last turn's
    finish reason; ``truncated`` when the budget runs out (a tool result is cut to fit);
    ``aborted`` when the engine aborts a turn or the ``abort`` hook stops the episode.
    ``metadata["round_number"]`` counts the model's turns, ``metadata["tool_call_count"]`` the
    calls run, ``metadata["tool_calls_dropped"]`` the calls the parser dropped (unknown tool,
    bad JSON).

    :raises PluginError: the sample already holds a response (resuming is not supported), the
        user's function raised or returned something other than a string, or the chat template
        cannot append tool results.
    """
    if sample.response_length:
        raise PluginError(f"generate 'multi_turn': sample {sample.index} already holds {sample.response_length} "
                          "response tokens; resuming a multi-turn episode is not supported.")
    tokenizer = engine.tokenizer
    tools = load_tool_specs(config.generate_tool_specs_path)
    parse = tool_call_parser(config.generate_tool_call_parser)
    params = dict(sampling_params)
    budget = params.get("max_new_tokens")
    cap = config.eval_max_context_len if evaluation else config.rollout_max_context_len
    sample.tokens = _prompt_ids(tokenizer, sample.prompt, tools)
    sample.loss_mask, sample.rollout_log_probs = [], []
    sample.response, sample.response_length = "", 0
    rounds = calls_run = dropped = 0
    episode = _Episode()
    _live.add(episode)
    try:
        for turn in range(config.generate_max_turns):
            if episode.aborted:
                sample.status = Status.ABORTED
                break
            stats = await _turn(config, sample, engine, parse, tools, params, budget, cap, turn)
            if stats is None:
                break
            rounds += 1
            calls_run += stats[0]
            dropped += stats[1]
            if not stats[2]:
                break
    finally:
        _live.discard(episode)
    sample.metadata = {**(sample.metadata or {}), "round_number": rounds, "tool_call_count": calls_run,
                       "tool_calls_dropped": dropped}
    return sample


async def _turn(config, sample, engine, parse, tools, params, budget, cap, turn) -> tuple[int, int, bool] | None:
    """One model turn and its tool calls: ``(calls run, calls dropped, go on)``, or None when no
    request was made (the budget is spent: ``truncated``)."""
    tokenizer = engine.tokenizer
    left = tokens_left(sample, budget, cap)
    if left is not None and left <= 0:
        sample.status = Status.TRUNCATED
        return None
    out = await engine.generate(list(sample.tokens), {**params, "max_new_tokens": left})
    start = len(sample.response)
    append_generated(sample, out, tokenizer, params)
    if out.finish_reason in ("length", "abort"):
        return 0, 0, False
    parsed = parse(sample.response[start:], tools)
    if not parsed.calls:
        return 0, parsed.dropped, False
    ids = [f"call_{turn}_{k}" for k in range(len(parsed.calls))]
    messages = [await _run_call(config.generate_execute_tool_function_path, call, call_id)
                for call, call_id in zip(parsed.calls, ids)]
    asked = [{"id": call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
             for call, call_id in zip(parsed.calls, ids)]
    inserted = appended_messages_ids(tokenizer, messages, calls=asked, tools=tools)
    room = tokens_left(sample, budget, cap)
    if room is not None and len(inserted) > room:
        append_inserted(sample, inserted[:max(room, 0)], tokenizer)
        sample.status = Status.TRUNCATED
        return len(messages), parsed.dropped, False
    append_inserted(sample, inserted, tokenizer)
    return len(messages), parsed.dropped, True
