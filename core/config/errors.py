"""The error type of the launch configuration."""

from __future__ import annotations

from furlong.hooks import PluginError

__all__ = ["ConfigError"]


class ConfigError(PluginError):
    """One or more problems with the launch flags.

    The message holds every problem found, one per line, each naming the flags and
    values at fault. The CLI prints it and exits with code 2.

    ``partial``: when parsing found problems but still produced a Namespace of the flags
    that did parse (validated), that Namespace, so later checks (the chosen plugins'
    ``configure``) can add their problems to the same report; else None.
    ``bad_flags``: option strings whose value was rejected; a later problem naming one of
    them is a consequence of an error already reported.
    """

    def __init__(self, problems: list[str] | str, *, partial=None, bad_flags: frozenset[str] = frozenset()) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        self.partial = partial
        self.bad_flags = frozenset(bad_flags)
        super().__init__("\n".join(self.problems))
