"""Failpoints: places a fault test arms (STEADFAST_FAILPOINTS) to stall a process where a real fault
would, leaving a marker file so the test knows the fault really happened. Unarmed, one dict lookup."""

from __future__ import annotations

import os
import time
from pathlib import Path

from steadfast.config.env import failpoint, failpoint_dir

_hits: dict[str, int] = {}


def stall(name: str) -> None:
    """When a test armed `name`: on its chosen hit, leave a marker and sleep for its seconds."""
    armed = failpoint(name)
    if armed is None:
        return
    seconds, on_hit = armed
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] != on_hit:
        return
    folder = failpoint_dir()
    if folder:
        Path(folder, f"{name}.{os.getpid()}").write_text(str(time.time()))
    time.sleep(seconds)


def broken(name: str) -> bool:
    """When a test armed `name` (`name=0@hit`): True from its chosen hit on, every time — a part that
    stays broken (a worker whose logits turned non-finite). The first time leaves the marker."""
    armed = failpoint(name)
    if armed is None:
        return False
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] < armed[1]:
        return False
    folder = failpoint_dir()
    if _hits[name] == armed[1] and folder:
        Path(folder, f"{name}.{os.getpid()}").write_text(str(time.time()))
    return True
