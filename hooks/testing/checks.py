"""One check per hook: call the implementation with realistic inputs, apply the contract's rules."""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import math
from typing import Any, Callable

import attrs
import pluggy

from ..config_report import ConfigReport
from ..contract import (check_advantage_output, check_buffer_pop, check_filter_result, check_generate_result,
                        check_loss_output, check_loss_reducer_output, check_reward_list, check_reward_value)
from ..old_form import old_form_args, warn_old_form
from ..run_config import RunConfig
from ..types import DatasetSpec, ExecutorFit, Sample, Status
from .inputs import TinyEngine, advantage_input, loss_input, sample_group

__all__ = ["CHECKS", "NOT_EXERCISED", "ORDER", "Caller", "ContractViolation", "KitRun", "NoConfigGiven"]

NOT_EXERCISED = {
    "rollout": "needs an engine, a data cursor and the reward path of a run (test it with a short `furlong train`)",
    "rollout_engine": "builds a model server",
    "train_backend": "loads a model",
    "critic_backend": "loads a model",
    "executor": "places processes",
}


class ContractViolation(AssertionError):
    """A plugin broke a rule of the hook contract; the message names the plugin, the hook and the rule."""


class NoConfigGiven(TypeError):
    """A hook the kit calls reads the run configuration, and ``check_plugin`` was given none."""


# the order check_plugin calls the hooks in; the others (observers) follow in spec order
ORDER = ["add_arguments", "configure", "executor_fit", "data_source", "generate", "reward", "filter", "buffer_pop", "abort",
         "advantage", "loss", "loss_reducer"]


@attrs.frozen
class KitRun:
    """What :func:`~furlong.hooks.testing.check_plugin` hands every check: the run configuration
    (None when the caller gave none), the engine ``generate`` gets (None: a :class:`TinyEngine`)
    and the data set ``data_source`` reads."""

    config: RunConfig | None
    engine: Any = None
    dataset: DatasetSpec | None = None


class Caller:
    """Calls one implementation with the arguments it declares, as the core does; awaits what it returns.

    An old-form implementation that takes ``args`` gets ``config.namespace()`` where the core passes
    ``config``, as the plugin manager gives it.

    :raises NoConfigGiven: the implementation reads the run configuration and ``check_plugin`` was given none.
    """

    def __init__(self, impl: pluggy.HookImpl, name: str, hook: str):
        self.impl, self.name, self.hook = impl, name, hook
        self.where = f"plugin '{name}'"

    def __call__(self, **kwargs) -> Any:
        if self.hook in ("add_arguments", "configure") and inspect.iscoroutinefunction(self.impl.function):
            self.fail(f"it is async def; `{self.hook}` is a set-up hook, run before the event loop starts, "
                      "and may not be async")
        chosen = {k: v for k, v in kwargs.items() if k in self.impl.argnames}
        if "args" in self.impl.argnames and "args" not in kwargs and "config" in kwargs:
            warn_old_form(self.name, self.hook, f"`{self.hook}(args, ...)`",
                          "take `config` (a furlong.hooks.RunConfig) instead")
            chosen["args"] = old_form_args(kwargs) if kwargs["config"] is not None else None
        if any(chosen.get(k, False) is None for k in ("config", "args")):
            raise NoConfigGiven(f"check_plugin: `{self.hook}` of plugin '{self.name}' reads the run configuration; pass "
                            "config=furlong.core.config.launch_args.launch_config(...) (with the plugin installed, "
                            "or pm= a plugin manager that holds it).")
        try:
            result = self.impl.function(**chosen)
            if inspect.isawaitable(result):
                if self.hook in ("add_arguments", "configure"):
                    getattr(result, "close", lambda: None)()
                    self.fail(f"it is async def; `{self.hook}` is a set-up hook, run before the event loop starts, "
                              "and may not be async")
                result = asyncio.run(_await(result))
        except ContractViolation:
            raise
        except Exception as exc:  # noqa: BLE001 - a plugin that raises on realistic input fails the kit
            raise ContractViolation(
                f"plugin '{self.name}' raised in `{self.hook}` on the kit's realistic input: {type(exc).__name__}: "
                f"{exc} (a plugin that reads flags needs them in check_plugin's config)") from exc
        return result

    def fail(self, rule: str) -> None:
        raise ContractViolation(f"plugin '{self.name}' breaks the `{self.hook}` contract: {rule}.")


async def _await(awaitable):
    return await awaitable


def _check_add_arguments(call: Caller, run: KitRun) -> None:
    parser = argparse.ArgumentParser(add_help=False)
    call(parser=parser)
    prefix = "--" + call.name.replace("_", "-") + "-"
    for option, action in [(o, a) for o, a in parser._option_string_actions.items() if o.startswith("--")]:
        negated = isinstance(action, argparse.BooleanOptionalAction) and option.startswith("--no-" + prefix[2:])
        if not option.startswith(prefix) and not negated:
            call.fail(f"it adds the flag {option}; a plugin's flags start with its name ({prefix}...)")


def _check_configure(call: Caller, run: KitRun) -> None:
    report = ConfigReport(plugin=call.name)
    if call(args=run.config.namespace() if run.config is not None else None, report=report) is not None:
        call.fail("it returned a value; `configure` reports on `report` and returns None")
    for item in [*report.errors, *report.warnings, *report.infos]:
        if not isinstance(item, str) or not item:
            call.fail(f"it reported {item!r}; a report message is a non-empty sentence naming the flag and value")


def _check_executor_fit(call: Caller, run: KitRun) -> None:
    fit = call(args=run.config.namespace() if run.config is not None else None)
    if not isinstance(fit, ExecutorFit):
        call.fail(f"it returned {type(fit).__name__}; `executor_fit` returns a furlong.hooks.ExecutorFit")
    if not isinstance(fit.why, str) or not fit.why:
        call.fail(f"its ExecutorFit.why is {fit.why!r}; say in one phrase what decided it")


def _check_data_source(call: Caller, run: KitRun) -> None:
    source = call(config=run.config, dataset=run.dataset)
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


def _check_generate(call: Caller, run: KitRun) -> None:
    for max_new, evaluation in ((64, False), (5, False), (64, True)):
        tiny = run.engine or TinyEngine()
        sample = Sample(prompt="What is 1+1?", label="2", group_index=0, index=0)
        params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": max_new, "stop": None,
                  "stop_token_ids": None, "skip_special_tokens": False, "no_stop_trim": True,
                  "spaces_between_special_tokens": False, "sampling_seed": 1234}
        before, generated_before = len(getattr(tiny, "requests", ())), getattr(tiny, "generated", 0)
        result = call(config=run.config, sample=sample, sampling_params=dict(params), engine=tiny, evaluation=evaluation)
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


def _check_reward(call: Caller, run: KitRun) -> None:
    for samples in (sample_group(1), sample_group(4)):
        rewards = check_reward_list(call(config=run.config, samples=samples), len(samples), call.where, samples[0].index)
        for sample, value in zip(samples, rewards):
            check_reward_value(value, call.where, sample.index)


def _check_filter(call: Caller, run: KitRun) -> None:
    result = check_filter_result(call(config=run.config, samples=sample_group(4, scored=True), rollout_id=0), call.where)
    if result.reason is not None and (not isinstance(result.reason, str) or not result.reason.isidentifier()):
        call.fail(f"it gave the reason {result.reason!r}; a reason is a short snake_case word (counted in "
                  "rollout/dynamic_filter/drop_<reason>) or None")


def _check_buffer_pop(call: Caller, run: KitRun) -> None:
    buffer = [sample_group(2, group_index=g, first_index=2 * g) for g in range(3)]
    before = [id(g) for g in buffer]
    popped = check_buffer_pop(call(config=run.config, rollout_id=1, buffer=buffer, num_samples=2), 2, call.where)
    for group in popped:
        if id(group) not in before:
            call.fail("it returned a group that was not in the buffer")
        if any(group is g for g in buffer):
            call.fail("it returned a group it left in the buffer; remove the returned groups from `buffer`")
    if len(buffer) + len(popped) != len(before):
        call.fail(f"the buffer went from {len(before)} to {len(buffer)} groups while {len(popped)} were returned")


def _check_advantage(call: Caller, run: KitRun) -> None:
    batch = advantage_input()
    out = check_advantage_output(call(config=run.config, batch=batch), batch.loss_masks, call.where)
    for label, rows in (("advantages", out.advantages), ("returns", out.returns or [])):
        _finite_on_mask(call, label, rows, batch.loss_masks)


def _check_loss(call: Caller, run: KitRun) -> None:
    batch = loss_input()
    out = check_loss_output(call(config=run.config, batch=batch), batch.loss_masks, call.where)
    _finite_on_mask(call, "token_loss", out.token_loss, batch.loss_masks)
    if not any(t.requires_grad for t in out.token_loss):
        call.fail("token_loss carries no grad; compute it from batch.log_probs (or batch.values) without detaching")


def _check_loss_reducer(call: Caller, run: KitRun) -> None:
    batch = loss_input()
    values = [-(lp - old).exp() * a for lp, old, a in zip(batch.log_probs, batch.old_log_probs, batch.advantages)]
    total_lengths = [12 + int(m.numel()) for m in batch.loss_masks]
    value = check_loss_reducer_output(call(config=run.config, values=values, loss_masks=batch.loss_masks,
                                           total_lengths=total_lengths), call.where)
    if not math.isfinite(float(value.detach())):
        call.fail(f"it returned {float(value.detach())}; the reduced loss must be finite")
    if not value.requires_grad:
        call.fail("its result carries no grad; reduce `values` without detaching them")
    value.backward()
    masked_grads = [lp.grad.reshape(-1)[m.reshape(-1) == 0] for lp, m in zip(batch.log_probs, batch.loss_masks)]
    if any(bool((g != 0).any()) for g in masked_grads if g.numel()):
        call.fail("a masked token (loss_masks 0) got a gradient; only trained tokens may count")


def _finite_on_mask(call: Caller, label: str, rows: list, masks: list) -> None:
    for i, (row, mask) in enumerate(zip(rows, masks)):
        values = row.detach().reshape(-1)[mask.reshape(-1) > 0].tolist()
        bad = next((v for v in values if not math.isfinite(v)), None)
        if bad is not None:
            call.fail(f"{label}[{i}] holds {bad} on a trained token; per-token values must be finite")


def _check_abort(call: Caller, run: KitRun) -> None:
    if call(config=run.config, rollout_id=0) is not None:
        call.fail("it returned a value; `abort` returns None")


def _observer(**kwargs) -> Callable:
    def check(call: Caller, run: KitRun) -> None:
        call(config=run.config, **kwargs)
    return check


CHECKS: dict[str, Callable] = {
    "add_arguments": _check_add_arguments,
    "configure": _check_configure,
    "executor_fit": _check_executor_fit,
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
    "on_hook_call": lambda call, run: call(hook="reward", plugin="math", seconds=0.01, error=None),
}
