"""The error type of the launch configuration."""

from __future__ import annotations

from furlong.hooks import PluginError

__all__ = ["ConfigError"]


class ConfigError(PluginError):
    """One or more problems with the launch flags.

    The message holds every problem found, one per line, each naming the flags and
    values at fault. The CLI prints it and exits with code 2.
    """

    def __init__(self, problems: list[str] | str) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))
