"""What a plugin's ``configure`` hook hands back: errors, warnings and notes on its flags."""

from __future__ import annotations

from argparse import Namespace
from typing import Any

import attrs

__all__ = ["ConfigReport", "DataParallelRule", "Machine"]


@attrs.frozen
class Machine:
    """The machine a run starts on, as the core probed it before ``configure``
    (``report.machine``): what machine-following defaults are computed from.

    ``gpu_total_bytes`` and ``gpu_free_bytes`` are those of the first GPU (bytes, at the
    probe: before any model loads); all zero without CUDA.
    """

    cuda: bool = False
    gpu_name: str = ""
    gpu_count: int = 0
    gpu_total_bytes: int = 0
    gpu_free_bytes: int = 0

    def describe(self) -> str:
        """One phrase for notes: ``"1 x NVIDIA H200, 139.3 of 139.8 GiB free"``, or ``"no CUDA device"``."""
        if not self.cuda:
            return "no CUDA device"
        return (f"{self.gpu_count} x {self.gpu_name}, {self.gpu_free_bytes / 2**30:.1f} of "
                f"{self.gpu_total_bytes / 2**30:.1f} GiB free")


@attrs.frozen
class DataParallelRule:
    """How a train backend splits the trainer's ranks (``report.data_parallel_rule``).

    Each model replica spans the product of ``model_parallel``'s sizes (ranks that hold
    parts of one model, e.g. ``(("TP", 2), ("PP", 1), ("CP", 1))``); the replicas are the
    data-parallel ranks: ``D = world / product``, where ``world`` is
    ``--actor-num-nodes x --actor-num-gpus-per-node``. Empty (the default, and the rule of
    a backend that reports none): every rank holds the whole model, ``D = world``.
    """

    model_parallel: tuple[tuple[str, int], ...] = ()

    @property
    def model_size(self) -> int:
        """Ranks per model replica (1 when ``model_parallel`` is empty)."""
        size = 1
        for _name, value in self.model_parallel:
            size *= value
        return size


@attrs.define
class ConfigReport:
    """The problems one chosen plugin found in the launch flags (``configure`` hook).

    The core makes one report per plugin, passes it to the plugin's ``configure``, then
    prints the warnings and notes (on rank 0 only) and stops the run with every error of
    every plugin, one per line, before any model loads (exit code 2). Messages are printed
    as written: name the flag and value at fault and what to do, e.g.
    ``"--advantage-estimator ppo needs --kl-coef 0, got 0.1."``.

    ``plugin`` is the plugin's name (its entry-point name); ``flags`` the selection flags
    that chose it (``("--advantage-estimator",)``); ``uses`` the other plugins it runs
    (:meth:`use_plugin`); ``machine`` the machine the run starts on; ``machine_defaults``
    the flags :meth:`machine_default` set, and why.
    """

    plugin: str
    flags: tuple[str, ...] = ()
    errors: list[str] = attrs.field(factory=list)
    warnings: list[str] = attrs.field(factory=list)
    infos: list[str] = attrs.field(factory=list)
    uses: list[str] = attrs.field(factory=list)
    data_parallel: DataParallelRule | None = None
    machine: Machine = attrs.field(factory=Machine)
    machine_defaults: dict[str, str] = attrs.field(factory=dict)

    def error(self, message: str) -> None:
        """A flag combination the plugin cannot run with: the run stops (exit code 2)."""
        self.errors.append(message)

    def warn(self, message: str) -> None:
        """A combination that runs but probably does not do what the user meant."""
        self.warnings.append(message)

    def info(self, message: str) -> None:
        """A note on a value the plugin derived (logged at INFO)."""
        self.infos.append(message)

    def use_plugin(self, name: str) -> None:
        """This run also runs plugin ``name`` through this one (e.g. an engine behind a server
        this plugin starts), so ``name``'s own flags are read. Without it the core refuses a
        given flag of a plugin that no flag chose, as a flag that would do nothing."""
        if name not in self.uses:
            self.uses.append(name)

    def data_parallel_rule(self, **model_parallel: int) -> None:
        """Train backends: how this run's trainer ranks split into model replicas.

        ``model_parallel`` names each size a model replica spans, in the order it is shown
        (``report.data_parallel_rule(TP=2, PP=1, CP=1)``); the core derives the data-parallel
        size ``D = world / product`` (``config.data_parallel_size``), checks that it divides
        the world and the batch flags, and names the sizes in its messages. Without
        arguments: every rank holds the whole model, ``D = world``, which is also the
        rule of a backend that reports nothing (:class:`DataParallelRule`).
        """
        self.data_parallel = DataParallelRule(tuple((name, int(value)) for name, value in model_parallel.items()))

    @staticmethod
    def given(args: Namespace, dest: str) -> bool:
        """True when flag attribute ``dest`` was given (command line or ``--custom-config-path``)."""
        return dest in set(getattr(args, "explicit_args", ()) or ())

    def default(self, args: Namespace, dest: str, value: Any) -> Any:
        """Set ``args.<dest> = value`` unless the user gave that flag; return the value in effect.

        The only way a plugin should change ``args``: the core refuses a ``configure``
        that changes a flag the user gave.
        """
        if not self.given(args, dest):
            setattr(args, dest, value)
        return getattr(args, dest)

    def machine_default(self, args: Namespace, dest: str, value: Any, why: str) -> Any:
        """:meth:`default`, for a value that follows the machine (``report.machine``): listed by
        ``--print-config`` under ``machine_defaults`` with ``why`` (what was probed and the rule
        applied), so a user sees which flag to give to pin it."""
        if not self.given(args, dest):
            setattr(args, dest, value)
            self.machine_defaults[dest] = why
        return getattr(args, dest)
