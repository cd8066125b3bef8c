"""A rolling restart: every worker in turn is replaced by a new process (which loads the code installed
now) — its replacement started and ready first, then the old one drained onto the others and retired —
so an upgrade is "install the new version, run `steadfast rollout`" and no request fails.

The record of one rollout; the engine client runs it (it owns the sockets and the drains).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any


class RolloutState(enum.StrEnum):
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


class RolloutStep(enum.StrEnum):
    STARTING = "starting"  # the replacement is loading
    DRAINING = "draining"  # the old worker's requests migrate away
    RETIRED = "retired"  # the old worker exited


@dataclass
class Rollout:
    workers: list[int]  # the workers to replace, in order
    started: float = field(default_factory=time.time)
    t0: float = field(default_factory=time.monotonic)
    state: RolloutState = RolloutState.RUNNING
    steps: list[dict[str, Any]] = field(default_factory=list)  # one per worker: old, new, step, seconds
    error: str = ""
    seconds: float | None = None

    def step(self, old: int) -> dict[str, Any]:
        row: dict[str, Any] = {"old": old, "new": None, "step": RolloutStep.STARTING, "seconds": None}
        row["t0"] = time.monotonic()
        self.steps.append(row)
        return row

    def end(self, state: RolloutState, error: str = "") -> None:
        self.state, self.error, self.seconds = state, error, time.monotonic() - self.t0

    def view(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "workers": self.workers,
            "steps": [{k: v for k, v in s.items() if k != "t0"} for s in self.steps],
            "error": self.error,
            "started": self.started,
            "seconds": self.seconds if self.seconds is not None else time.monotonic() - self.t0,
        }
