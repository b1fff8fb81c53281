"""Adapters that turn a Miles-style dotted ``module.function`` flag into a plugin.

Each adapter is registered with the plugin manager under the dotted path itself, so the
core calls it exactly like a plugin chosen by name, and only the plugin manager calls user
code. The user's function is called positionally, Miles-style (``async def rm(args, sample)
-> float``), with ``args`` an ``argparse.Namespace`` (``config.namespace()`` when the core
passes the typed configuration); it may be sync or async. A reward function written for TRL
or verl is called in its own form (:mod:`furlong.core.plugins.reward_forms`). The flags that
no public hook covers reach their function through the hooks of
:mod:`furlong.core.plugins.path_specs`.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from typing import Any, Callable

from furlong.hooks import PluginError, hookimpl

from furlong.kit.dotted import import_dotted

from .reward_forms import reward_adapter

__all__ = ["ADAPTERS", "PATH_ADAPTERS", "MilesStyle", "import_dotted", "make_adapter", "agent_abort_adapter"]

log = logging.getLogger("furlong.config")


async def _resolve(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def _accepts(fn: Callable, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


class MilesStyle:
    """Base of the adapters. The plugin manager knows them by ``dotted_path_adapter``: they ask for
    ``args`` on purpose, to hand a Namespace to a Miles-style function, so they get
    ``config.namespace()`` without a deprecation warning; and they may implement the hooks of
    :mod:`furlong.core.plugins.path_specs`, which no installed plugin may."""

    dotted_path_adapter = True

    def __init__(self, fn):
        self.fn = fn


class _RolloutAdapter(MilesStyle):
    @hookimpl
    async def rollout(self, args, rollout_id, context):
        return await _resolve(self.fn(args, rollout_id, context))


class _GenerateAdapter(MilesStyle):
    @hookimpl
    async def generate(self, args, sample, sampling_params, evaluation):
        if _accepts(self.fn, "evaluation"):
            return await _resolve(self.fn(args, sample, sampling_params, evaluation=evaluation))
        return await _resolve(self.fn(args, sample, sampling_params))


class _RewardAdapter(MilesStyle):
    @hookimpl
    async def reward(self, args, samples):
        if args.group_rm:
            return await _resolve(self.fn(args, samples))
        return [await _resolve(self.fn(args, sample)) for sample in samples]


class _FilterAdapter(MilesStyle):
    @hookimpl
    async def filter(self, args, samples, rollout_id):
        if _accepts(self.fn, "rollout_id"):
            return await _resolve(self.fn(args, samples, rollout_id=rollout_id))
        return await _resolve(self.fn(args, samples))


class _BufferPopAdapter(MilesStyle):
    @hookimpl
    async def buffer_pop(self, args, rollout_id, buffer, num_samples):
        return await _resolve(self.fn(args, rollout_id, buffer, num_samples))


class _AdvantageAdapter(MilesStyle):
    @hookimpl
    async def advantage(self, args, batch):
        return await _resolve(self.fn(args, batch))


class _LossAdapter(MilesStyle):
    @hookimpl
    async def loss(self, args, batch):
        return await _resolve(self.fn(args, batch))


class _LossReducerAdapter(MilesStyle):
    """Miles' reducer factory ``fn(total_lengths, response_lengths, loss_masks, calculate_per_token_loss)
    -> reducer``, whose ``reducer(flat)`` sums the micro-batch's pg values concatenated in sample order."""

    @hookimpl
    async def loss_reducer(self, args, values, loss_masks, total_lengths):
        import torch

        response_lengths = [int(m.numel()) for m in loss_masks]
        reducer = await _resolve(self.fn(total_lengths, response_lengths, loss_masks,
                                         bool(args.calculate_per_token_loss)))
        flat = torch.cat([v.reshape(-1).float() for v in values]) if values else torch.zeros(0)
        return await _resolve(reducer(flat))


class _DataSourceAdapter(MilesStyle):
    @hookimpl
    def data_source(self, args):
        return self.fn(args)


class _PathFunction(MilesStyle):
    """A function of one of the flags of :mod:`furlong.core.plugins.path_specs`; a failure names the flag."""

    def __init__(self, fn, path: str, flag: str):
        super().__init__(fn)
        self.path, self.flag = path, flag

    async def _run(self, *fn_args, **fn_kwargs) -> Any:
        try:
            return await _resolve(self.fn(*fn_args, **fn_kwargs))
        except PluginError:
            raise
        except Exception as exc:  # noqa: BLE001 - name the function at fault
            raise PluginError(f"{self.flag} '{self.path}' failed: {type(exc).__name__}: {exc}") from exc


class _SampleFilterAdapter(_PathFunction):
    @hookimpl
    async def rollout_sample_filter(self, args, samples):
        await self._run(args, samples)


class _AllSamplesProcessAdapter(_PathFunction):
    @hookimpl
    async def rollout_all_samples_process(self, args, all_samples, data_source):
        await self._run(args, all_samples, data_source)


class _RewardPostProcessAdapter(_PathFunction):
    @hookimpl
    async def reward_post_process(self, args, samples):
        raw, rewards = await self._run(args, samples)
        if len(raw) != len(samples) or len(rewards) != len(samples):
            raise PluginError(f"{self.flag} '{self.path}' returned {len(raw)} raw and {len(rewards)} rewards for "
                              f"{len(samples)} samples.")
        return [float(r) for r in raw], [float(r) for r in rewards]


class _PostSaveAdapter(_PathFunction):
    @hookimpl
    def post_save(self, args, rollout_id, ckpt_dir, hf_dir):
        try:
            result = self.fn(args, rollout_id, ckpt_dir, hf_dir)
        except Exception as exc:  # noqa: BLE001 - name the hook at fault
            raise PluginError(f"{self.flag} '{self.path}' failed after saving {ckpt_dir}: {type(exc).__name__}: "
                              f"{exc}") from exc
        if inspect.isawaitable(result):
            getattr(result, "close", lambda: None)()
            raise PluginError(f"{self.flag} '{self.path}' returned an awaitable: the hook is called synchronously "
                              f"after each save; make it a plain function.")


class _RolloutLogAdapter(_PathFunction):
    @hookimpl
    async def rollout_log(self, args, rollout_id, samples, extra, rollout_time):
        return bool(await self._run(rollout_id, args, samples, extra, rollout_time))


class _EvalRolloutLogAdapter(_PathFunction):
    @hookimpl
    async def eval_rollout_log(self, args, rollout_id, data, extra):
        return bool(await self._run(rollout_id, args, data, extra))


class _TisAdapter(_PathFunction):
    @hookimpl
    async def tis_function(self, args, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths,
                           response_lengths):
        out = await self._run(args=args, pg_loss=pg_loss, train_log_probs=train_log_probs,
                              rollout_log_probs=rollout_log_probs, loss_masks=loss_masks, total_lengths=total_lengths,
                              response_lengths=response_lengths, parallel_state=None, max_seq_lens=None)
        if not (isinstance(out, (tuple, list)) and len(out) == 3 and isinstance(out[2], dict)
                and len(out[1]) == len(loss_masks)):
            raise PluginError(f"{self.flag} '{self.path}' must return (pg_loss, loss_masks, metrics): a tensor, "
                              f"{len(loss_masks)} masks and a dict; it returned {type(out).__name__}.")
        return tuple(out)


class _ConvertAdapter(_PathFunction):
    @hookimpl
    async def convert_samples_to_train_data(self, args, samples):
        data = await self._run(args, samples)
        if not isinstance(data, dict):
            raise PluginError(f"{self.flag} '{self.path}' must return a dict of train data (Miles' form), not "
                              f"{type(data).__name__}.")
        return data


class _DataPostprocessAdapter(_PathFunction):
    @hookimpl
    async def rollout_data_postprocess(self, args, rollout_data):
        if _positional_count(self.fn) >= 2:
            await self._run(args, rollout_data)
        else:  # Miles' form: fn(args)
            await self._run(args)


def _positional_count(fn: Callable) -> int:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 1
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return 2
    return sum(p.kind in kinds for p in params)


class _EvalFunctionAdapter(_PathFunction):
    @hookimpl
    async def eval_function(self, args, rollout_id, context):
        if _accepts(self.fn, "evaluation"):
            return await self._run(args, rollout_id, context, evaluation=True)
        return await self._run(args, rollout_id, context)


PATH_ADAPTERS: dict[str, type] = {
    "rollout_sample_filter": _SampleFilterAdapter,
    "rollout_all_samples_process": _AllSamplesProcessAdapter,
    "reward_post_process": _RewardPostProcessAdapter,
    "post_save": _PostSaveAdapter,
    "rollout_log": _RolloutLogAdapter,
    "eval_rollout_log": _EvalRolloutLogAdapter,
    "tis_function": _TisAdapter,
    "convert_samples_to_train_data": _ConvertAdapter,
    "rollout_data_postprocess": _DataPostprocessAdapter,
    "eval_function": _EvalFunctionAdapter,
}


ADAPTERS: dict[str, type] = {
    "rollout": _RolloutAdapter,
    "generate": _GenerateAdapter,
    "reward": _RewardAdapter,
    "filter": _FilterAdapter,
    "buffer_pop": _BufferPopAdapter,
    "advantage": _AdvantageAdapter,
    "loss": _LossAdapter,
    "loss_reducer": _LossReducerAdapter,
    "data_source": _DataSourceAdapter,
}


def make_adapter(hook: str, path: str, flag: str) -> object:
    """Import ``path`` and wrap it in the adapter of ``hook``.

    :raises PluginError: as :func:`import_dotted`, or the attribute is not callable.
    """
    fn = import_dotted(path, flag)
    if not callable(fn):
        kind = "a class" if hook == "data_source" else "a function"
        raise PluginError(f"{flag} '{path}': '{path.rpartition('.')[2]}' is a {type(fn).__name__}, not callable; "
                          f"point the flag at {kind}.")
    if hook == "eval_function" and inspect.isclass(fn):
        raise PluginError(f"{flag} '{path}': '{path.rpartition('.')[2]}' is a class; Miles' class-based eval "
                          "functions (a RolloutFn class, a CheckpointEvalFn subclass) are built on Miles' runtime, "
                          "which furlong does not run. Point the flag at a function fn(args, rollout_id, context, "
                          "evaluation=True) returning Miles' eval data (docs/miles.md, \"Evaluation\").")
    if hook == "reward":  # a TRL or verl reward function keeps its own form (core/plugins/reward_forms.py)
        return reward_adapter(fn, path, _RewardAdapter)
    if hook in PATH_ADAPTERS:
        return PATH_ADAPTERS[hook](fn, path, flag)
    return ADAPTERS[hook](fn)


class _AgentAbort(MilesStyle):
    @hookimpl
    async def abort(self, args, rollout_id):
        await _resolve(self.fn(args))


def agent_abort_adapter(agent_path: str) -> object | None:
    """The ``abort`` function beside ``--custom-agent-function-path``, wrapped, or None."""
    import_dotted(agent_path, "--custom-agent-function-path")
    module = importlib.import_module(agent_path.rpartition(".")[0])
    fn = getattr(module, "abort", None)
    return _AgentAbort(fn) if callable(fn) else None
