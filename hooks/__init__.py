"""furlong's hook contract: hookspecs, the ``hookimpl`` marker, shared types, Protocols."""

from . import answers, kl, specs
from .config_report import ConfigReport
from .errors import PluginError
from .markers import PROJECT, hookimpl, hookspec
from .protocols import DataSource, RolloutContext, RolloutEngine, StepObjective, TrainBackend
from .types import (
    AdvantageInput,
    AdvantageOutput,
    FilterResult,
    GenerateOutput,
    LossInput,
    LossOutput,
    Sample,
    Status,
    TrainBatch,
)

__all__ = [
    "PROJECT",
    "AdvantageInput",
    "AdvantageOutput",
    "ConfigReport",
    "DataSource",
    "FilterResult",
    "GenerateOutput",
    "LossInput",
    "LossOutput",
    "PluginError",
    "RolloutContext",
    "RolloutEngine",
    "Sample",
    "Status",
    "StepObjective",
    "TrainBackend",
    "TrainBatch",
    "hookimpl",
    "hookspec",
    "answers",
    "kl",
    "specs",
]
