"""What a plugin's ``configure`` hook hands back: errors, warnings and notes on its flags."""

from __future__ import annotations

from argparse import Namespace
from typing import Any

import attrs

__all__ = ["ConfigReport"]


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
    (:meth:`use_plugin`).
    """

    plugin: str
    flags: tuple[str, ...] = ()
    errors: list[str] = attrs.field(factory=list)
    warnings: list[str] = attrs.field(factory=list)
    infos: list[str] = attrs.field(factory=list)
    uses: list[str] = attrs.field(factory=list)

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
