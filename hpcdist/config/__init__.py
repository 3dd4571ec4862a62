"""Typed job configuration: YAML + ``section.key=value`` overrides -> a validated :class:`JobConfig`.

Torch-free, and imports nothing from ``parallel``, ``launch`` or ``trainer`` (they import it). Modules:

* :mod:`~hpcdist.config.schema`: the nested dataclasses, one per YAML section; their docstrings are the reference.
* :mod:`~hpcdist.config.loader`: generic YAML + overrides -> dataclasses, all problems in one :class:`ConfigError`
  (also used for cluster profiles).
* :mod:`~hpcdist.config.job`: ``load`` / ``dump`` / ``save`` of a JobConfig (presets merged, rules run).
* :mod:`~hpcdist.config.rules` and :mod:`~hpcdist.config.layout`: the checks, without and with the world size.
* :mod:`~hpcdist.config.dirs`: the file-system checks of run.dir and checkpoint.dir.
* :mod:`~hpcdist.config.vocab`: ``model.vocab_size: auto`` and the start-up check of the prepared data.
"""

from hpcdist.byte_vocab import BYTE_VOCAB
from hpcdist.config.dirs import check_run_dir
from hpcdist.config.job import dump, load, save
from hpcdist.config.layout import LayoutKind, needs_planner
from hpcdist.config.loader import ConfigError, parse_overrides
from hpcdist.config.rules import (
    DATA_SOURCES,
    DTYPES,
    LR_SCHEDULES,
    STRATEGIES,
    VERIFY_MODES,
    check,
    check_world,
    describe_spares,
    grad_accum_steps,
    shrink_problems,
)
from hpcdist.config.schema import (
    ACTIVATION_CHECKPOINTING,
    CheckpointConfig,
    DataConfig,
    DataSourceConfig,
    FaultConfig,
    FSDPConfig,
    JobConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
    ZeroConfig,
)
from hpcdist.config.vocab import VOCAB_MULTIPLE, DataError, check_data

__all__ = [
    "ACTIVATION_CHECKPOINTING",
    "BYTE_VOCAB",
    "DATA_SOURCES",
    "DTYPES",
    "LR_SCHEDULES",
    "STRATEGIES",
    "VERIFY_MODES",
    "VOCAB_MULTIPLE",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "DataError",
    "DataSourceConfig",
    "FSDPConfig",
    "FaultConfig",
    "JobConfig",
    "LayoutKind",
    "LoggingConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "RunConfig",
    "TrainConfig",
    "ZeroConfig",
    "check",
    "check_data",
    "check_run_dir",
    "check_world",
    "describe_spares",
    "dump",
    "grad_accum_steps",
    "load",
    "needs_planner",
    "parse_overrides",
    "save",
    "shrink_problems",
]
