"""Multi-turn tool use for furlong: the model calls a calculator or a sandboxed Python tool
between turns, and the tools' output is part of the response but not of the loss.

The model calls a tool by writing ``<calculator>6*7</calculator>`` or
``<python>print(6*7)</python>``; generation stops at the closing tag, the plugin runs the
tool and appends ``<result>...</result>`` to the response, and the model goes on from there,
until it ends a turn without a call. Chosen with ``--generate tool_use`` (or
``--agent-backend tool_use``). The prompt must teach the model these tags:
:data:`TOOL_INSTRUCTIONS` is a starting point.
"""

from __future__ import annotations

import textwrap

from furlong.hooks import PluginConfig, PluginError, Status, hookimpl
from furlong.kit.turns import append_generated, append_inserted, tokens_left

from .calculator import calculate
from .sandbox import kill, run_python

__all__ = ["TOOLS", "TOOL_INSTRUCTIONS", "abort", "add_arguments", "configure", "generate", "tool_output_text"]

TOOLS = ("calculator", "python")

TOOL_INSTRUCTIONS = (
    "You can use tools. Write <calculator>EXPRESSION</calculator> to evaluate arithmetic, or "
    "<python>CODE</python> to run Python (print what you need). The result comes back as "
    "<result>...</result>. When you know the answer, write it as \\boxed{ANSWER}."
)

PLUGIN = "tool_use"
"""The plugin's name: its section of the run configuration."""


class _Episode:
    """One sample being generated: the abort hook flags it and kills its running tool."""

    def __init__(self) -> None:
        self.aborted = False
        self.process = None

    def stop(self) -> None:
        self.aborted = True
        if self.process is not None:
            kill(self.process)


_live: set[_Episode] = set()


@hookimpl
def add_arguments(parser):
    group = parser.add_argument_group("tool_use (multi-turn generate)")
    group.add_argument("--tool-use-tools", nargs="+", choices=TOOLS, default=list(TOOLS), metavar="TOOL",
                       help="tools the model may call: calculator, python (default both)")
    group.add_argument("--tool-use-max-turns", type=int, default=4, metavar="N",
                       help="most tool calls per sample (default 4); a call past it ends the sample as truncated")
    group.add_argument("--tool-use-timeout", type=float, default=5.0, metavar="SECONDS",
                       help="wall-clock and CPU seconds one python call may take (default 5)")
    group.add_argument("--tool-use-memory-mb", type=int, default=512, metavar="MIB",
                       help="address-space limit of one python call in MiB (default 512)")
    group.add_argument("--tool-use-max-output-chars", type=int, default=1000, metavar="N",
                       help="a tool's output is cut to its last N characters (default 1000)")


@hookimpl
def configure(args, report):
    """Check the limits; refuse what the plugin cannot do yet."""
    for flag, dest, low in (("--tool-use-max-turns", "tool_use_max_turns", 0),
                            ("--tool-use-memory-mb", "tool_use_memory_mb", 64),
                            ("--tool-use-max-output-chars", "tool_use_max_output_chars", 1)):
        if getattr(args, dest) < low:
            report.error(f"{flag} must be at least {low}, got {getattr(args, dest)}.")
    if args.tool_use_timeout <= 0:
        report.error(f"--tool-use-timeout must be positive, got {args.tool_use_timeout:g}.")
    if args.partial_rollout:
        report.error("--generate tool_use with --partial-rollout is not supported yet: an aborted episode "
                     "cannot resume in the middle of its turns.")


@hookimpl
def abort(config, rollout_id):
    """Stop every episode in flight: a running tool is killed, no further turn starts, and the
    sample ends ``aborted`` (the engine's own abort ends the turn being generated)."""
    for episode in list(_live):
        episode.stop()


@hookimpl
async def generate(config, sample, sampling_params, engine, evaluation):
    """Generate ``sample``'s response over several turns, running a tool between turns.

    Each turn is one engine request from all tokens so far (prompt, earlier turns, tool
    output), stopping at the closing tag of an enabled tool (added to ``stop``, with
    ``no_stop_trim`` so that SGLang-style servers keep the tag in the text). When the
    turn ends with a complete call, the tool runs and ``\\n<result>\\nOUTPUT\\n</result>\\n``
    is tokenized and appended. The model's tokens get ``loss_mask`` 1 and the engine's
    log-probs; tool tokens get ``loss_mask`` 0 and ``rollout_log_probs`` 0.0 (the model did
    not sample them). ``weight_versions`` gets one entry per engine request.

    The token budget ``max_new_tokens`` counts every response token, the model's and the
    tools'; ``--rollout-max-context-len`` (``--eval-max-context-len``) caps prompt and
    response together. Status: ``completed`` when a turn ends without a call,
    ``truncated`` when the budget runs out (a tool output is cut to fit) or the model
    calls a tool past ``--tool-use-max-turns``, ``aborted`` when the engine aborts a turn
    or the ``abort`` hook stops the episode. ``metadata["tool_use"]`` records ``calls``
    and ``errors`` (tool outputs that start with ``error:`` or hold a traceback).

    :raises PluginError: the prompt is a list of chat messages (pass
        ``--apply-chat-template``), or the sample already holds a partial response.
    """
    if not isinstance(sample.prompt, str):
        raise PluginError(f"generate 'tool_use': sample {sample.index}'s prompt is a list of chat messages; pass "
                          "--apply-chat-template to render it with the tokenizer's chat template.")
    if sample.response_length:
        raise PluginError(f"generate 'tool_use': sample {sample.index} already holds {sample.response_length} "
                          "response tokens; resuming a multi-turn episode is not supported.")
    tokenizer = engine.tokenizer
    own = config.plugin_config(PLUGIN)
    tools = tuple(own.tool_use_tools)
    params = dict(sampling_params)
    params["stop"] = list(params.get("stop") or []) + [f"</{tool}>" for tool in tools]
    params["no_stop_trim"] = True  # the closing tag must stay in the text to find the call
    budget = params.get("max_new_tokens")
    cap = config.eval_max_context_len if evaluation else config.rollout_max_context_len
    sample.tokens = list(tokenizer(sample.prompt, add_special_tokens=False)["input_ids"])
    sample.loss_mask, sample.rollout_log_probs = [], []
    sample.response, sample.response_length = "", 0
    calls = errors = 0
    episode = _Episode()
    _live.add(episode)
    try:
        while True:
            left = _tokens_left(sample, budget, cap)
            if episode.aborted or left <= 0:
                sample.status = Status.ABORTED if episode.aborted else Status.TRUNCATED
                break
            out = await engine.generate(list(sample.tokens), {**params, "max_new_tokens": left})
            start = len(sample.response)
            append_generated(sample, out, tokenizer, params)
            call = _call_at_end(sample.response[start:], tools) if sample.status == Status.COMPLETED else None
            if call is None:
                break
            if calls >= own.tool_use_max_turns:
                sample.status = Status.TRUNCATED
                break
            calls += 1
            output = await _run_tool(own, episode, *call)
            if episode.aborted:
                sample.status = Status.ABORTED
                break
            errors += output.startswith("error:") or "Traceback (most recent call last)" in output
            ids = list(tokenizer(tool_output_text(output), add_special_tokens=False)["input_ids"])
            room = _tokens_left(sample, budget, cap)
            append_inserted(sample, ids[:room], tokenizer)
            if len(ids) > room:
                sample.status = Status.TRUNCATED
                break
    finally:
        _live.discard(episode)
    sample.metadata = {**(sample.metadata or {}), "tool_use": {"calls": calls, "errors": int(errors)}}
    return sample


def tool_output_text(output: str) -> str:
    """The text appended after a tool call: ``\\n<result>\\nOUTPUT\\n</result>\\n``."""
    return f"\n<result>\n{output.strip()}\n</result>\n"


def _tokens_left(sample, budget, cap) -> int:
    left = tokens_left(sample, budget, cap)
    return 1 << 30 if left is None else left


def _call_at_end(text: str, tools: tuple[str, ...]) -> tuple[str, str] | None:
    """``(tool, argument)`` of the call the turn ends with, or None."""
    stripped = text.rstrip()
    for tool in tools:
        close = f"</{tool}>"
        if stripped.endswith(close):
            start = stripped.rfind(f"<{tool}>")
            if start >= 0:
                return tool, stripped[start + len(tool) + 2:-len(close)]
    return None


async def _run_tool(own: PluginConfig, episode: _Episode, tool: str, argument: str) -> str:
    limit = own.tool_use_max_output_chars
    if tool == "calculator":
        return calculate(argument)[-limit:]

    def started(process):
        episode.process = process
        if episode.aborted:  # the abort came while the process was starting
            kill(process)

    try:
        return await run_python(textwrap.dedent(argument.strip("\n")), own.tool_use_timeout, own.tool_use_memory_mb, limit,
                                on_start=started)
    finally:
        episode.process = None

