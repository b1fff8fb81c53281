"""Configuration notes held back until the whole configuration is accepted.

The core's notes (``INFO`` lines of the ``furlong.config`` logger, such as "--save-interval
defaults to 100 rollouts") are written when the flags parse, but plugin selection and the
plugins' ``configure`` hooks may still reject the run. A rejected run prints its errors alone,
so the notes are kept until :func:`held_notes` exits without an exception. Warnings pass at once:
they may explain an error.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

__all__ = ["held_notes"]

CONFIG_LOGGER = "furlong.config"


class _Hold(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.INFO:
            return True
        self.records.append(record)
        return False


@contextlib.contextmanager
def held_notes() -> Iterator[None]:
    """Hold the ``furlong.config`` logger's ``INFO`` records while the block runs; write them in
    order when it succeeds, drop them when it raises."""
    hold = _Hold()
    logger = logging.getLogger(CONFIG_LOGGER)
    logger.addFilter(hold)
    try:
        yield
    finally:
        logger.removeFilter(hold)
    for record in hold.records:
        logger.handle(record)
