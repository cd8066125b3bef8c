"""The router's registry of workers: who each is (role, node), how it has been (a window of its status
reports, not only the last), whether it is alive, and which requests the router sent it.

Pure state, no sockets and no event loop: the engine client does the I/O and tells the registry what
it heard. Placement, recovery and (later) health read it.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from steadfast.wire.worker import WorkerRole, WorkerState, WorkerStatus

STATUS_HISTORY = 120  # reports kept per worker: two minutes at the default 1 s interval


class Liveness(enum.Enum):
    ALIVE = "alive"
    SUSPECT = "suspect"  # no report past the limit: probed once more (Ping), no new requests meanwhile
    SILENT = "silent"  # the probe went unanswered too: no new requests until it reports again
    DEAD = "dead"  # reaped and fenced by the supervisor: its requests move


@dataclass
class WorkerHandle:
    worker_id: int
    address: str
    role: WorkerRole = WorkerRole.MIXED
    history: deque[tuple[float, WorkerStatus]] = field(default_factory=lambda: deque(maxlen=STATUS_HISTORY))
    last_seen: float = 0.0
    liveness: Liveness = Liveness.ALIVE
    promoted_at: float | None = None  # when a standby started taking traffic (its warm-up ramp)
    in_flight: set[str] = field(default_factory=set)
    draining: bool = False  # its requests are being migrated away: it takes nothing new
    joining: bool = False  # started while serving (a rollout's replacement): /health does not wait for it
    last_token_at: float = 0.0  # when a token of any of its requests last came (router's clock)

    @property
    def status(self) -> WorkerStatus | None:
        return self.history[-1][1] if self.history else None

    @property
    def dead(self) -> bool:
        return self.liveness is Liveness.DEAD

    @property
    def ready(self) -> bool:
        s = self.status
        return self.liveness is Liveness.ALIVE and s is not None and s.state == WorkerState.READY

    @property
    def leaving(self) -> bool:
        """Drained, or stopping by itself (SIGTERM): it takes nothing new, and /health does not wait for it."""
        s = self.status
        return self.draining or (s is not None and s.state == WorkerState.STOPPING)

    @property
    def active(self) -> bool:
        return self.role != WorkerRole.STANDBY

    @property
    def node(self) -> str:
        s = self.status
        return s.node if s is not None else ""

    @property
    def load(self) -> int:
        # Requests the router sent that the worker has not finished, whatever its last report says.
        return len(self.in_flight)

    @property
    def kv_use(self) -> float:
        s = self.status
        return s.kv_blocks_used / s.kv_blocks_total if s is not None and s.kv_blocks_total else 0.0


class WorkerRegistry:
    def __init__(self) -> None:
        self._workers: dict[int, WorkerHandle] = {}

    def __iter__(self) -> Iterator[WorkerHandle]:
        return iter(list(self._workers.values()))

    def __len__(self) -> int:
        return len(self._workers)

    def get(self, worker_id: int) -> WorkerHandle | None:
        return self._workers.get(worker_id)

    def add(self, worker_id: int, address: str, role: WorkerRole) -> WorkerHandle:
        handle = WorkerHandle(worker_id, address, WorkerRole(role))
        self._workers[worker_id] = handle
        return handle

    def remove(self, worker_id: int) -> None:
        self._workers.pop(worker_id, None)

    def observe(self, status: WorkerStatus, now: float | None = None) -> WorkerHandle | None:
        """Record a status report; None when the worker is not (or no longer) registered."""
        w = self._workers.get(status.worker_id)
        if w is None:
            return None
        if w.status is None and w.role != status.role:
            w.role = status.role  # a restarted router learns who was promoted from the workers
        now = time.monotonic() if now is None else now
        w.history.append((now, status))
        w.last_seen = now
        w.joining = w.joining and status.state != WorkerState.READY
        return w

    def seen(self, worker_id: int, now: float | None = None) -> None:
        w = self._workers.get(worker_id)
        if w is not None:
            w.last_seen = time.monotonic() if now is None else now

    def sweep_silent(
        self, limit_s: float, probe_s: float, now: float | None = None
    ) -> tuple[list[WorkerHandle], list[WorkerHandle]]:
        """Workers quiet past `limit_s` become SUSPECT (the caller probes them), past `limit_s + probe_s`
        SILENT; one reporting again is ALIVE. Returns (newly suspect, newly silent)."""
        now = time.monotonic() if now is None else now
        suspect, silent = [], []
        for w in self._workers.values():
            s = w.status
            if s is None or w.dead or s.state == WorkerState.LOADING:
                continue
            quiet = now - w.last_seen
            state = Liveness.ALIVE
            if quiet > limit_s + probe_s:
                state = Liveness.SILENT
            elif quiet > limit_s:
                state = Liveness.SUSPECT
            if state is Liveness.SUSPECT and w.liveness is Liveness.ALIVE:
                suspect.append(w)
            if state is Liveness.SILENT and w.liveness is not Liveness.SILENT:
                silent.append(w)
            w.liveness = state
        return suspect, silent

    @staticmethod
    def promote(w: WorkerHandle, role: WorkerRole, now: float | None = None) -> None:
        """A standby takes traffic as `role` from now on, ramping up over the warm-up period."""
        w.role = role
        w.promoted_at = time.monotonic() if now is None else now

    @property
    def ready(self) -> bool:
        """Every worker taking traffic is ready, and there is at least one (standbys may be loading)."""
        active = [w for w in self._workers.values() if w.active and not w.dead and not w.leaving and not w.joining]
        return bool(active) and all(w.ready for w in active)

    def live(self, exclude: int = -1) -> list[WorkerHandle]:
        """Ready workers that may take a request (a draining one may not)."""
        return [w for w in self._workers.values() if w.ready and not w.draining and w.worker_id != exclude]

    def has_role(self, role: WorkerRole) -> bool:
        return any(w.role == role and w.ready for w in self._workers.values())
