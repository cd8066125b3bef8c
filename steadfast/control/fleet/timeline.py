"""What happened to the service, in order, for people (the dashboard's timeline, `steadfast status`).

Events that other parts already keep a record of (level changes: the ladder's history; health standings:
the health monitor's events; migrations and drains' migrations: `Migrations`; takeovers: `Recovery`) are
read from those records when a timeline is asked for (control/http/dashboard.py); this log holds the rest:
workers joining, dying (a death means its lease was fenced: the supervisor reaps, then tells), retiring,
drains and rollouts starting and ending.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass

KEPT = 1000  # events kept: a bound on memory, not on history worth reading


class EventKind(enum.StrEnum):
    JOIN = "join"
    CRASH = "crash"  # a worker died (its lease fenced, its requests taken over)
    RETIRE = "retire"
    TAKEOVER = "takeover"
    LEVEL = "level"
    MIGRATION = "migration"
    DRAIN = "drain"
    ROLLOUT = "rollout"
    HEALTH = "health"


@dataclass(frozen=True)
class Event:
    at: float  # wall clock (Unix seconds)
    kind: EventKind
    worker: int | None
    what: str
    reason: str = ""

    def as_dict(self) -> dict[str, object]:
        return {"at": self.at, "kind": self.kind.value, "worker": self.worker, "what": self.what, "reason": self.reason}


class Timeline:
    def __init__(self, kept: int = KEPT) -> None:
        self.events: deque[Event] = deque(maxlen=kept)

    def note(self, kind: EventKind, what: str, reason: str = "", worker: int | None = None) -> None:
        self.events.append(Event(time.time(), kind, worker, what, reason))
