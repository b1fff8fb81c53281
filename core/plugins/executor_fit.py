"""The default executor: the first executor plugin whose ``executor_fit`` says it fits this machine."""

from __future__ import annotations

from argparse import Namespace

from furlong.hooks import ExecutorFit, PROJECT, PluginError

from .manager import FurlongPluginManager

__all__ = ["NO_FIT", "asked_order", "default_executor", "executor_fit_of", "resolve_executor"]

NO_FIT = ExecutorFit(False, "", engines_in_driver=False)


def asked_order(pm: FurlongPluginManager) -> list[str]:
    """Executor plugins in the order their ``executor_fit`` is asked: plugins outside furlong's own
    distribution first, then furlong's, each group in name order."""
    names = [name for name in pm.names_for("executor_fit") if "executor" in pm.hooks_of(name)]
    return sorted(names, key=lambda name: (_is_own(pm, name), name))


def executor_fit_of(args: Namespace, pm: FurlongPluginManager, name: str) -> ExecutorFit:
    """Executor plugin ``name``'s answer (:data:`NO_FIT` when it has no ``executor_fit``).

    :raises PluginError: the hook raised, or returned something other than an
        :class:`~furlong.hooks.ExecutorFit` (the message names the plugin).
    """
    if name not in pm.names_for("executor_fit"):
        return NO_FIT
    try:
        fit = pm.call_setup("executor_fit", name, args=args)
    except PluginError:
        raise
    except Exception as exc:  # noqa: BLE001 - name the plugin at fault
        raise PluginError(f"plugin '{name}' ({pm.origin(name)}) failed in `executor_fit`: "
                          f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(fit, ExecutorFit):
        raise PluginError(f"plugin '{name}' ({pm.origin(name)}): `executor_fit` returned {type(fit).__name__}, "
                          "not an ExecutorFit.")
    return fit


def default_executor(args: Namespace, pm: FurlongPluginManager) -> tuple[str, ExecutorFit]:
    """``(name, its answer)`` of the first executor that fits (:func:`asked_order`).

    :raises PluginError: no executor fits; the message lists every answer.
    """
    answers = []
    for name in asked_order(pm):
        fit = executor_fit_of(args, pm, name)
        if fit.fits:
            return name, fit
        answers.append(f"{name}: {fit.why}")
    raise PluginError("no executor fits this machine and these flags (" + "; ".join(answers or ["none installed"])
                      + "); choose one with --executor NAME.")


def resolve_executor(args: Namespace, pm: FurlongPluginManager, given: bool) -> None:
    """Set ``args.executor`` (the default when not ``given``) and ``args.engines_in_driver`` from its answer.

    An executor named by ``--executor`` is not asked whether it fits (its ``configure``
    checks the flags); a name no plugin serves leaves ``engines_in_driver`` False (the
    selection reports the name).

    :raises PluginError: see :func:`default_executor` and :func:`executor_fit_of`.
    """
    if given and args.executor is not None:
        fit = executor_fit_of(args, pm, args.executor) if pm.get_plugin(args.executor) is not None else NO_FIT
    else:
        args.executor, fit = default_executor(args, pm)
    args.engines_in_driver = fit.engines_in_driver


def _is_own(pm: FurlongPluginManager, name: str) -> bool:
    record = pm.records.get(name)
    return record is not None and record.dist == PROJECT
