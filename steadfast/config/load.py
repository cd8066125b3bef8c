"""The whole config: its sections, loaded from YAML with overrides, every value checked when built."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from steadfast.config import env
from steadfast.config.access import AccessConfig, ApiKey
from steadfast.config.base import ConfigError, parse_duration
from steadfast.config.engine import CacheConfig, ModelConfig, SchedulerConfig
from steadfast.config.health import HealthConfig, RoutingConfig
from steadfast.config.ladder import DegradationConfig, SloConfig
from steadfast.config.moves import MigrationConfig, SpeculativeConfig, TransferConfig
from steadfast.config.recovery import (
    FaultRecoveryConfig,
)
from steadfast.config.server import ServerConfig


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    fault_recovery: FaultRecoveryConfig = field(default_factory=FaultRecoveryConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    migration: MigrationConfig = field(default_factory=MigrationConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    slo: SloConfig = field(default_factory=SloConfig)
    degradation: DegradationConfig = field(default_factory=DegradationConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    access: AccessConfig = field(default_factory=AccessConfig)

    def __post_init__(self) -> None:
        if self.server.prefill_workers and not self.fault_recovery.kv_cache.external_ledger:
            # The handoff is a change of owner in the ledger of one arena the workers share.
            raise ConfigError("prefill/decode workers need fault_recovery.kv_cache.external_ledger: true")

    def replace(self, **sections: dict[str, Any]) -> Config:
        """A copy with some keys changed, nested as in YAML: `cfg.replace(model={"dtype": "float32"})`."""
        return config_from_dict(_merge(self.to_dict(), sections))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def public(self) -> Config:
        """This config without its secrets, for command lines; children read keys from `env`."""
        server = dataclasses.replace(self.server, api_key="", admin_api_key="")
        return dataclasses.replace(self, server=server, access=dataclasses.replace(self.access, keys=()))

    def with_env_keys(self) -> Config:
        """Keys unset in the config taken from the environment (STEADFAST_API_KEY, STEADFAST_ADMIN_KEY,
        STEADFAST_API_KEYS)."""
        server = dataclasses.replace(
            self.server,
            api_key=self.server.api_key or env.api_key(),
            admin_api_key=self.server.admin_api_key or env.admin_api_key(),
        )
        access = self.access
        if not access.keys and (listed := env.api_keys()):
            keys = tuple(_build(ApiKey, item, f"STEADFAST_API_KEYS[{i}]") for i, item in enumerate(listed))
            access = dataclasses.replace(access, keys=keys)
        return dataclasses.replace(self, server=server, access=access)


def _merge(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _refuse_unknown(given: dict[str, Any], known: dict[str, Any], what: str) -> None:
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ConfigError(f"unknown {what}: {', '.join(unknown)}; known: {', '.join(known)}")


def _build(cls: type, values: Any, where: str) -> Any:
    if not isinstance(values, dict):
        raise ConfigError(f"config section {where!r} must be a mapping")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    _refuse_unknown(values, fields, f"key(s) in {where}" if where else "config section(s)")
    hints = typing.get_type_hints(cls)
    typed: dict[str, Any] = {}
    for key, value in values.items():
        path = f"{where}.{key}" if where else key
        want = hints[key]
        if dataclasses.is_dataclass(want):
            typed[key] = _build(want, value, path)
        elif typing.get_origin(want) is tuple:
            typed[key] = _sequence(value, typing.get_args(want)[0], path)
        elif fields[key].metadata.get("duration"):
            typed[key] = parse_duration(value, path)
        elif fields[key].metadata.get("switch") and isinstance(value, bool):
            typed[key] = "on" if value else "off"
        else:
            typed[key] = _coerce(value, want.__name__, path)
    return cls(**typed)


def _sequence(value: Any, item: type, where: str) -> tuple[Any, ...]:
    """A YAML list as a tuple of `item` (a section's dataclass, or a plain type)."""
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{where} must be a list")
    if dataclasses.is_dataclass(item):
        return tuple(_build(item, v, f"{where}[{i}]") for i, v in enumerate(value))
    return tuple(_coerce(v, item.__name__, f"{where}[{i}]") for i, v in enumerate(value))


def _coerce(value: Any, type_name: str, where: str) -> Any:
    if type_name == "bool":
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    if type_name == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        return value
    if type_name == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        return float(value)
    if type_name == "str":
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string, got {value!r}")
        return value
    raise ConfigError(f"{where}: unsupported type {type_name}")


def config_from_dict(data: dict[str, Any]) -> Config:
    if not isinstance(data, dict):
        raise ConfigError("the config file must hold a mapping at its top level")
    return _build(Config, data, "")


def load_config(path: str | None = None, overrides: dict[str, dict[str, Any]] | None = None) -> Config:
    """Read a YAML file (if given) and apply CLI overrides (`{"model": {"dtype": ...}}`)."""
    cfg = Config()
    if path:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from exc
        cfg = config_from_dict(data)
    if overrides:
        cfg = cfg.replace(**{k: v for k, v in overrides.items() if v})
    return cfg.with_env_keys()
