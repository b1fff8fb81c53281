"""A contract test kit for plugin authors: call a plugin's hooks the way the core does, check what comes back.

Use it in your plugin's own tests::

    from furlong.hooks.testing import check_plugin
    import my_plugin

    def test_my_plugin_meets_the_furlong_contract():
        report = check_plugin(my_plugin, "my_plugin")
        assert "reward" in report.checked

:func:`check_plugin` registers the plugin in a pluggy manager holding furlong's hookspecs
(so a misspelled hook or argument fails here, as it would when furlong loads it), then
calls every hook it implements that the kit can exercise without a model or a cluster,
with realistic inputs: :class:`~furlong.hooks.Sample` objects, a tiny deterministic
engine (:class:`TinyEngine`) for ``generate``, and ``AdvantageInput``/``LossInput``
tensors of the right shapes. What comes back is checked with the same functions the core
applies where a plugin's output enters it (:mod:`furlong.hooks.contract`), plus a few
rules the core cannot afford to check on every call (finite advantages and losses, a
loss that carries grad, the token budget across turns). A broken rule raises
:class:`ContractViolation` naming the plugin, the hook and the rule.

Not exercised (they need a model, files or a cluster): ``rollout``, ``rollout_engine``,
``train_backend``, ``executor``; ``data_source`` only when ``args`` is given (it reads
``--prompt-data``). They are listed in :attr:`ContractReport.not_exercised`.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import math
from typing import Any, Callable

import attrs
import pluggy

from . import specs
from .config_report import ConfigReport
from .contract import (argument_name_problems, check_advantage_output, check_buffer_pop, check_filter_result,
                       check_generate_result, check_loss_output, check_loss_reducer_output, check_reward_list,
                       check_reward_value,
                       no_hookimpl_problem, unknown_hook_problems)
from .errors import PluginError
from .markers import PROJECT
from .types import AdvantageInput, GenerateOutput, LossInput, Sample, Status

__all__ = ["CharTokenizer", "ContractReport", "ContractViolation", "TinyEngine", "check_plugin", "sample_group"]

NOT_EXERCISED = {
    "rollout": "needs an engine, a data cursor and the reward path of a run (test it with a short `furlong train`)",
    "rollout_engine": "builds a model server",
    "train_backend": "loads a model",
    "executor": "places processes",
}


class ContractViolation(AssertionError):
    """A plugin broke a rule of the hook contract; the message names the plugin, the hook and the rule."""


@attrs.define
class ContractReport:
    """What :func:`check_plugin` did: ``checked`` hooks, in order, and ``not_exercised`` ``{hook: why}``."""

    plugin: str
    checked: list[str] = attrs.field(factory=list)
    not_exercised: dict[str, str] = attrs.field(factory=dict)


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


def check_plugin(plugin: object, name: str, args: argparse.Namespace | None = None,
                 engine: Any = None) -> ContractReport:
    """Check every hook ``plugin`` implements against furlong's hook contract.

    :param plugin: the plugin object (usually the module your entry point names).
    :param name: its entry-point name (flags it adds should start with ``--<name>-``).
    :param args: the launch flags the hooks get. Default: a Namespace of the plugin's own
        flag defaults (from its ``add_arguments``); a plugin that reads furlong's flags
        needs the real ones: ``furlong.core.launch_args.launch_args()``.
    :param engine: the engine ``generate`` gets (default a :class:`TinyEngine`).
    :returns: a :class:`ContractReport`.
    :raises ContractViolation: the first broken rule (plugin, hook and rule named).
    """
    pm = _register(plugin, name)
    hooks = [caller.name for caller in pm.get_hookcallers(plugin)]
    ordered = [h for h in specs.__all__ if h in hooks]
    report = ContractReport(plugin=name)
    if args is None:
        args = _own_flag_defaults(pm, plugin, name)
    for hook in sorted(ordered, key=lambda h: (_ORDER.index(h) if h in _ORDER else len(_ORDER), ordered.index(h))):
        if hook in NOT_EXERCISED or (hook == "data_source" and getattr(args, "prompt_data", None) is None):
            report.not_exercised[hook] = NOT_EXERCISED.get(hook, "needs --prompt-data in args")
            continue
        impl = next(i for i in getattr(pm.hook, hook).get_hookimpls() if i.plugin is plugin)
        check = _CHECKS[hook]
        try:
            check(_Caller(impl, name, hook), args, engine)
        except PluginError as exc:  # a rule of furlong.hooks.contract, the one the core applies
            rule = str(exc).removeprefix(f"plugin '{name}'").removeprefix(":").strip()
            raise ContractViolation(f"plugin '{name}' breaks the `{hook}` contract: {rule}") from None
        except ContractViolation:
            raise
        except Exception as exc:  # noqa: BLE001 - e.g. a data source method that raises
            raise ContractViolation(f"plugin '{name}': what `{hook}` returned raised on the kit's realistic "
                                    f"input: {type(exc).__name__}: {exc}") from exc
        report.checked.append(hook)
    return report


# --- calling --------------------------------------------------------------------------------


class _Caller:
    """Calls one implementation with the arguments it declares; awaits what it returns."""

    def __init__(self, impl: pluggy.HookImpl, name: str, hook: str):
        self.impl, self.name, self.hook = impl, name, hook
        self.where = f"plugin '{name}'"

    def __call__(self, **kwargs) -> Any:
        try:
            result = self.impl.function(**{k: v for k, v in kwargs.items() if k in self.impl.argnames})
            if inspect.isawaitable(result):
                if self.hook == "add_arguments":
                    getattr(result, "close", lambda: None)()
                    self.fail("it is async def; `add_arguments` runs while the parser is built and may not be async")
                result = asyncio.run(_await(result))
        except ContractViolation:
            raise
        except Exception as exc:  # noqa: BLE001 - a plugin that raises on realistic input fails the kit
            raise ContractViolation(
                f"plugin '{self.name}' raised in `{self.hook}` on the kit's realistic input: {type(exc).__name__}: "
                f"{exc} (a plugin that reads flags needs them in check_plugin's args)") from exc
        return result

    def fail(self, rule: str) -> None:
        raise ContractViolation(f"plugin '{self.name}' breaks the `{self.hook}` contract: {rule}.")


async def _await(awaitable):
    return await awaitable


def _register(plugin: object, name: str) -> pluggy.PluginManager:
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(specs)
    try:
        pm.register(plugin, name=name)
    except pluggy.PluginValidationError as exc:
        problem = argument_name_problems(pm, plugin) or str(exc)
        raise ContractViolation(f"plugin '{name}' does not register: {problem}") from None
    problem = unknown_hook_problems(pm, plugin) or no_hookimpl_problem(pm, plugin)
    if problem:
        raise ContractViolation(f"plugin '{name}' does not register: {problem}")
    return pm


_ORDER = ["add_arguments", "configure", "data_source", "generate", "reward", "filter", "buffer_pop", "abort",
          "advantage", "loss", "loss_reducer"]


def _own_flag_defaults(pm: pluggy.PluginManager, plugin: object, name: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(add_help=False)
    for impl in pm.hook.add_arguments.get_hookimpls():
        if impl.plugin is plugin:
            _Caller(impl, name, "add_arguments")(parser=parser)
    args = parser.parse_args([])
    args.explicit_args = []
    return args


# --- one check per hook -----------------------------------------------------------------------


def _check_add_arguments(call: _Caller, args, engine) -> None:
    parser = argparse.ArgumentParser(add_help=False)
    call(parser=parser)
    prefix = "--" + call.name.replace("_", "-") + "-"
    for option in [o for o in parser._option_string_actions if o.startswith("--")]:
        if not option.startswith(prefix):
            call.fail(f"it adds the flag {option}; a plugin's flags start with its name ({prefix}...)")


def _check_configure(call: _Caller, args, engine) -> None:
    report = ConfigReport(plugin=call.name)
    if call(args=args, report=report) is not None:
        call.fail("it returned a value; `configure` reports on `report` and returns None")
    for item in [*report.errors, *report.warnings, *report.infos]:
        if not isinstance(item, str) or not item:
            call.fail(f"it reported {item!r}; a report message is a non-empty sentence naming the flag and value")


def _check_data_source(call: _Caller, args, engine) -> None:
    source = call(args=args)
    for method in ("next_rows", "state", "load_state"):
        if not callable(getattr(source, method, None)):
            call.fail(f"it returned {type(source).__name__}, which lacks {method}(); a data source meets "
                      "furlong.hooks.DataSource")
    state = source.state()
    try:
        json.dumps(state)
    except (TypeError, ValueError) as exc:
        call.fail(f"state() returned {state!r}, which is not JSON-serializable ({exc}); checkpoints store it as JSON")
    rows = source.next_rows(2)
    if not isinstance(rows, list) or len(rows) != 2 or not all(isinstance(r, dict) and "prompt" in r for r in rows):
        call.fail(f"next_rows(2) returned {rows!r}; it returns 2 dicts with a 'prompt' key (rolling over epochs)")
    source.load_state(state)
    if source.next_rows(2) != rows:
        call.fail("next_rows(2) after load_state(state()) returned other rows; a resumed run must see the same data")


def _check_generate(call: _Caller, args, engine) -> None:
    for max_new, evaluation in ((64, False), (5, False), (64, True)):
        tiny = engine or TinyEngine()
        sample = Sample(prompt="What is 1+1?", label="2", group_index=0, index=0)
        params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": max_new, "stop": None,
                  "stop_token_ids": None, "skip_special_tokens": False, "no_stop_trim": True,
                  "spaces_between_special_tokens": False, "sampling_seed": 1234}
        before, generated_before = len(getattr(tiny, "requests", ())), getattr(tiny, "generated", 0)
        result = call(args=args, sample=sample, sampling_params=dict(params), engine=tiny, evaluation=evaluation)
        samples = check_generate_result(result, call.where, sample.index)
        if not isinstance(tiny, TinyEngine):
            continue
        calls = len(tiny.requests) - before
        versions = sum(len(s.weight_versions) for s in samples)
        if calls and versions != calls:
            call.fail(f"it made {calls} engine call(s) but recorded {versions} weight version(s); append "
                      "GenerateOutput.weight_version to sample.weight_versions once per engine call")
        generated = tiny.generated - generated_before
        if generated > max_new:
            call.fail(f"the engine generated {generated} tokens for max_new_tokens={max_new}; the budget "
                      "covers every turn together: ask each turn for what is left")
        for s in samples:
            if calls and s.status != Status.ABORTED and s.rollout_log_probs is None:
                call.fail(f"sample {s.index} has no rollout_log_probs; keep the engine's log-probs (one per "
                          "response token, 0.0 for tokens the model did not generate)")


def _check_reward(call: _Caller, args, engine) -> None:
    for samples in (sample_group(1), sample_group(4)):
        rewards = check_reward_list(call(args=args, samples=samples), len(samples), call.where, samples[0].index)
        for sample, value in zip(samples, rewards):
            check_reward_value(value, call.where, sample.index)


def _check_filter(call: _Caller, args, engine) -> None:
    result = check_filter_result(call(args=args, samples=sample_group(4, scored=True), rollout_id=0), call.where)
    if result.reason is not None and (not isinstance(result.reason, str) or not result.reason.isidentifier()):
        call.fail(f"it gave the reason {result.reason!r}; a reason is a short snake_case word (counted in "
                  "rollout/dynamic_filter/drop_<reason>) or None")


def _check_buffer_pop(call: _Caller, args, engine) -> None:
    buffer = [sample_group(2, group_index=g, first_index=2 * g) for g in range(3)]
    before = [id(g) for g in buffer]
    popped = check_buffer_pop(call(args=args, rollout_id=1, buffer=buffer, num_samples=2), 2, call.where)
    for group in popped:
        if id(group) not in before:
            call.fail("it returned a group that was not in the buffer")
        if any(group is g for g in buffer):
            call.fail("it returned a group it left in the buffer; remove the returned groups from `buffer`")
    if len(buffer) + len(popped) != len(before):
        call.fail(f"the buffer went from {len(before)} to {len(buffer)} groups while {len(popped)} were returned")


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


def _check_advantage(call: _Caller, args, engine) -> None:
    batch = advantage_input()
    out = check_advantage_output(call(args=args, batch=batch), batch.loss_masks, call.where)
    for label, rows in (("advantages", out.advantages), ("returns", out.returns or [])):
        _finite_on_mask(call, label, rows, batch.loss_masks)


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


def _check_loss(call: _Caller, args, engine) -> None:
    batch = loss_input()
    out = check_loss_output(call(args=args, batch=batch), batch.loss_masks, call.where)
    _finite_on_mask(call, "token_loss", out.token_loss, batch.loss_masks)
    if not any(t.requires_grad for t in out.token_loss):
        call.fail("token_loss carries no grad; compute it from batch.log_probs (or batch.values) without detaching")


def _check_loss_reducer(call: _Caller, args, engine) -> None:
    batch = loss_input()
    values = [-(lp - old).exp() * a for lp, old, a in zip(batch.log_probs, batch.old_log_probs, batch.advantages)]
    total_lengths = [12 + int(m.numel()) for m in batch.loss_masks]
    value = check_loss_reducer_output(call(args=args, values=values, loss_masks=batch.loss_masks,
                                           total_lengths=total_lengths), call.where)
    if not math.isfinite(float(value.detach())):
        call.fail(f"it returned {float(value.detach())}; the reduced loss must be finite")
    if not value.requires_grad:
        call.fail("its result carries no grad; reduce `values` without detaching them")
    value.backward()
    masked_grads = [lp.grad.reshape(-1)[m.reshape(-1) == 0] for lp, m in zip(batch.log_probs, batch.loss_masks)]
    if any(bool((g != 0).any()) for g in masked_grads if g.numel()):
        call.fail("a masked token (loss_masks 0) got a gradient; only trained tokens may count")


def _finite_on_mask(call: _Caller, label: str, rows: list, masks: list) -> None:
    for i, (row, mask) in enumerate(zip(rows, masks)):
        values = row.detach().reshape(-1)[mask.reshape(-1) > 0].tolist()
        bad = next((v for v in values if not math.isfinite(v)), None)
        if bad is not None:
            call.fail(f"{label}[{i}] holds {bad} on a trained token; per-token values must be finite")


def _check_abort(call: _Caller, args, engine) -> None:
    if call(args=args, rollout_id=0) is not None:
        call.fail("it returned a value; `abort` returns None")


def _observer(**kwargs) -> Callable:
    def check(call: _Caller, args, engine) -> None:
        call(args=args, **kwargs)
    return check


_CHECKS: dict[str, Callable] = {
    "add_arguments": _check_add_arguments,
    "configure": _check_configure,
    "data_source": _check_data_source,
    "generate": _check_generate,
    "reward": _check_reward,
    "filter": _check_filter,
    "buffer_pop": _check_buffer_pop,
    "abort": _check_abort,
    "advantage": _check_advantage,
    "loss": _check_loss,
    "loss_reducer": _check_loss_reducer,
    "on_rollout_end": _observer(rollout_id=0, metrics={"rollout/raw_reward": 0.5, "perf/rollout_time": 1.0}),
    "on_train_step_end": _observer(rollout_id=0, step=0, metrics={"train/loss": 0.1, "train/grad_norm": 1.0}),
    "on_eval_end": _observer(rollout_id=0, metrics={"eval/demo": 0.5}),
    "on_checkpoint_saved": _observer(rollout_id=0, path="iter_0000000"),
    "on_hook_call": lambda call, args, engine: call(hook="reward", plugin="math", seconds=0.01, error=None),
}
