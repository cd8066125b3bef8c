"""What every config section needs: the error a bad value raises, and durations (`60s`, `500ms`)."""

from __future__ import annotations

import re
from typing import Any


class ConfigError(ValueError):
    """A configuration value or key that Steadfast cannot accept."""


_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: Any, where: str) -> float:
    """Seconds from `60s`, `500ms`, `2m`, `1h` or a plain number of seconds."""
    if isinstance(value, bool):
        raise ConfigError(f"{where} must be a duration like 60s or 500ms, got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(ms|s|m|h)\s*", value)
        if not match:
            raise ConfigError(f"{where} must be a duration like 60s or 500ms, got {value!r}")
        seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2)]
    else:
        raise ConfigError(f"{where} must be a duration like 60s or 500ms, got {value!r}")
    if seconds < 0:
        raise ConfigError(f"{where} must not be negative")
    return seconds
