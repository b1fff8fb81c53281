"""furlong's hook contract: hookspecs, the ``hookimpl`` marker, shared types, Protocols."""

from . import answers, epochs, kl, rows, specs
from .config_report import ConfigReport
from .errors import PluginError
from .markers import PROJECT, hookimpl, hookspec
from .megatron_flags import MegatronFlags
from .protocols import (DataSource, Executor, RolloutContext, RolloutEngine, StepObjective, TrainBackend,
                        WorkerGroup)
from .types import (
    AdvantageInput,
    AdvantageOutput,
    FilterResult,
    GenerateOutput,
    LossInput,
    LossOutput,
    ParallelLayout,
    Sample,
    Status,
    TrainBatch,
    WeightBucket,
)

__all__ = [
    "PROJECT",
    "AdvantageInput",
    "AdvantageOutput",
    "ConfigReport",
    "DataSource",
    "Executor",
    "FilterResult",
    "GenerateOutput",
    "LossInput",
    "LossOutput",
    "MegatronFlags",
    "ParallelLayout",
    "PluginError",
    "RolloutContext",
    "RolloutEngine",
    "Sample",
    "Status",
    "StepObjective",
    "TrainBackend",
    "TrainBatch",
    "WeightBucket",
    "WorkerGroup",
    "hookimpl",
    "hookspec",
    "answers",
    "epochs",
    "kl",
    "rows",
    "specs",
]
