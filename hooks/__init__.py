"""furlong's hook contract: hookspecs, the ``hookimpl`` marker, shared types, Protocols.

Helpers for plugin authors (trainer utilities, Hugging Face loading, KL estimators, answer
extraction, epoch order, ...) live in :mod:`furlong.kit`. Their old module paths under
``furlong.hooks`` still import, with a ``DeprecationWarning``, until the next minor version.
"""

from . import _moved, rows, specs
from .config_report import ConfigReport, DataParallelRule, Machine
from .errors import PluginError
from .markers import PROJECT, hookimpl, hookspec
from .megatron_flags import MegatronFlags
from .run_config import PluginConfig, RunConfig
from .protocols import (DataSource, Executor, RolloutContext, RolloutEngine, StepObjective, TrainBackend,
                        WorkerGroup)
from .types import (
    AdvantageInput,
    AdvantageOutput,
    DatasetSpec,
    ExecutorFit,
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
    "DataParallelRule",
    "DatasetSpec",
    "DataSource",
    "Executor",
    "ExecutorFit",
    "FilterResult",
    "GenerateOutput",
    "LossInput",
    "LossOutput",
    "Machine",
    "MegatronFlags",
    "ParallelLayout",
    "PluginConfig",
    "PluginError",
    "RolloutContext",
    "RolloutEngine",
    "RunConfig",
    "Sample",
    "Status",
    "StepObjective",
    "TrainBackend",
    "TrainBatch",
    "WeightBucket",
    "WorkerGroup",
    "hookimpl",
    "hookspec",
    "rows",
    "specs",
]
