"""Configuration: a tree of dataclasses, loaded from YAML, with dotted command-line overrides.

Every error names the dotted key (``moe.top_k``) and says what is allowed. Each component
receives only its own sub-config (``cfg.model``, ``cfg.moe``, ...). The sections and their
checks are in :mod:`moetrain.config.sections` (the model's two in :mod:`moetrain.config.model` and :mod:`moetrain.config.moe`),
loading in :mod:`moetrain.config.loading`.
"""

from moetrain.config.checks import ConfigError
from moetrain.config.loading import (
    apply_overrides,
    config_from_dict,
    load_config,
    read_config_data,
)
from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.config.sections import (
    CheckpointConfig,
    Config,
    DataConfig,
    LoggingConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
    WandbConfig,
)

__all__ = [
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "LoggingConfig",
    "ModelConfig",
    "MoEConfig",
    "OptimConfig",
    "ParallelConfig",
    "TrainConfig",
    "WandbConfig",
    "apply_overrides",
    "config_from_dict",
    "load_config",
    "read_config_data",
]
