"""Configuration: one frozen dataclass per section, loaded from YAML with overrides (`load.py`).

Every value is checked when its dataclass is built, so a bad config fails at start-up with a message
naming the key, never later inside a worker. Environment variables are read in `env.py` only.
"""

from steadfast.config.access import AccessConfig, ApiKey
from steadfast.config.base import ConfigError, parse_duration
from steadfast.config.engine import CacheConfig, ModelConfig, SchedulerConfig
from steadfast.config.health import HealthConfig, RoutingConfig, RoutingPolicy
from steadfast.config.ladder import DegradationConfig, SloConfig
from steadfast.config.load import Config, config_from_dict, load_config
from steadfast.config.moves import MigrationConfig, SpeculativeConfig, TransferConfig
from steadfast.config.platform import cpu_only_torch, default_model_path
from steadfast.config.recovery import (
    RECOVERY_MODES,
    FaultRecoveryConfig,
    LeaseConfig,
    LedgerConfig,
    RequestRecoveryConfig,
    TakeoverConfig,
)
from steadfast.config.server import ServerConfig

__all__ = [
    "RoutingPolicy",
    "RECOVERY_MODES",
    "FaultRecoveryConfig",
    "LeaseConfig",
    "LedgerConfig",
    "RequestRecoveryConfig",
    "AccessConfig",
    "ApiKey",
    "ServerConfig",
    "CacheConfig",
    "ModelConfig",
    "Config",
    "ConfigError",
    "DegradationConfig",
    "HealthConfig",
    "MigrationConfig",
    "RoutingConfig",
    "SchedulerConfig",
    "SloConfig",
    "SpeculativeConfig",
    "TakeoverConfig",
    "TransferConfig",
    "config_from_dict",
    "cpu_only_torch",
    "default_model_path",
    "load_config",
    "parse_duration",
]
