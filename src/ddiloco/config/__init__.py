"""A run's configuration: one ``TrainConfig``, nested by concern (model, data, optim, sync,
world, chaos, runtime), declared once with a docstring under every field and validated on
construction. Both engines, the launcher, ``ddiloco syncer`` and ``ddiloco learner`` read
it; the command line is generated from it (``ddiloco.config.flags``) and it round-trips
through TOML (``ddiloco.config.files``)."""

from ddiloco.config.chaos import CHAOS_PRESETS, ChaosConfig, chaos_preset
from ddiloco.config.files import CONFIG_FILE, dump_config, dumps_config, load_config, loads_config
from ddiloco.config.run import FLAT, PRESETS, TrainConfig, preset
from ddiloco.config.sections import (
    ENGINES,
    INNER_OPTIMIZERS,
    METHODS,
    SECTIONS,
    DataConfig,
    ModelConfig,
    OptimConfig,
    RuntimeConfig,
    SyncConfig,
    WorldConfig,
)

__all__ = [
    "TrainConfig",
    "ModelConfig",
    "DataConfig",
    "OptimConfig",
    "SyncConfig",
    "WorldConfig",
    "ChaosConfig",
    "RuntimeConfig",
    "SECTIONS",
    "FLAT",
    "METHODS",
    "ENGINES",
    "INNER_OPTIMIZERS",
    "preset",
    "PRESETS",
    "load_config",
    "loads_config",
    "dump_config",
    "dumps_config",
    "CONFIG_FILE",
    "CHAOS_PRESETS",
    "chaos_preset",
]
