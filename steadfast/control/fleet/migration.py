"""Live migration, the router's half (ARCHITECTURE.md §5): which request moves (victims), where to
(target), how many at once, and the record of each migration for `/admin/migrations` and the metrics.

Pure decisions and bookkeeping over the registry and the flights: nothing here sends a message; the
engine client sends `Migrate` and switches delivery when the source's answer says the KV went.
"""

from __future__ import annotations

import enum
import secrets
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from steadfast.config import MigrationConfig
from steadfast.control.fleet.delivery import Flight
from steadfast.control.fleet.workers import WorkerHandle, WorkerRegistry
from steadfast.wire.worker import Handoff, WorkerRole

HEADROOM = 1.2  # a target has at least this many times the victim's KV blocks free
RECORDS = 1024  # migrations kept for /admin/migrations
MIGRATION_ROLES = (WorkerRole.DECODE, WorkerRole.MIXED)  # who may continue a decoding request


class MigrationReason(enum.StrEnum):
    OPERATOR = "operator"  # POST /admin/requests/{id}/migrate
    DRAIN = "drain"  # its worker is being drained (an operator, SIGTERM to the worker, a rollout)
    HEALTH = "health"  # its worker's health score is over the threshold (control/fleet/health.py)


class MigrationMode(enum.StrEnum):
    KV = "kv"  # the KV moves (same node: change of owner; across nodes: copied in stages)
    RECOMPUTE = "recompute"  # prompt and delivered tokens re-sent: the destination computes the KV again


class MigrationOutcome(enum.StrEnum):
    RUNNING = "running"  # asked of the source; no answer yet
    SWITCHED = "switched"  # the KV is the destination's; its first token not seen yet
    COMMITTED = "committed"  # the destination produced the request's next token
    ABORTED = "aborted"  # the source kept the request (it said why)
    LOST = "lost"  # its owner died first (the source, or the destination after the switch): taken over


class MigrationError(Exception):
    """A migration that cannot start, with the HTTP status an operator's call gets."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class MigrationRecord:
    move: str  # the move's name (<request>/migration-<random>): unique, its ledger decision is written once
    request_id: str
    from_worker: int
    to_worker: int
    reason: MigrationReason
    at_token: int  # tokens the client had when it was asked
    started: float = field(default_factory=time.time)  # wall clock, for people
    t0: float = field(default_factory=time.monotonic)
    outcome: MigrationOutcome = MigrationOutcome.RUNNING
    path: str = ""  # same_node, or the wire path that carried the KV
    stages: int = 0
    bytes: int = 0
    blocks: int = 0
    retries: int = 0  # messages the wire sent again (a lost frame, an unanswered COMMIT)
    error: str = ""
    paused_at: float = 0.0  # the source's clock when the request last ran there
    switched_at: float = 0.0  # when the router switched delivery to the destination
    last_token_at: float = 0.0  # when the client got its last token from the source
    downtime_s: float | None = None  # the request in no running batch: source's last step → destination's first
    gap_s: float | None = None  # the longest pause the client saw across the switch
    seconds: float | None = None  # asked → committed or aborted

    @property
    def done(self) -> bool:
        return self.outcome not in (MigrationOutcome.RUNNING, MigrationOutcome.SWITCHED)


class Migrations:
    def __init__(self, cfg: MigrationConfig, registry: WorkerRegistry, block_size: int) -> None:
        self.cfg = cfg
        self.registry = registry
        self.block_size = block_size
        self.records: deque[MigrationRecord] = deque(maxlen=RECORDS)
        self._active: dict[str, MigrationRecord] = {}  # request id → its migration in progress
        self.mismatches = 0  # tokens the old and the new owner both produced, and differently

    # --- policy ------------------------------------------------------------------------------------
    @property
    def slots(self) -> int:
        """Migrations that may start now (the cap on concurrent ones)."""
        return max(0, self.cfg.max_concurrent - len(self._active))

    @staticmethod
    def victims(flights: Iterable[Flight]) -> list[Flight]:
        """Which requests go first: lowest priority (the largest number), then least recently active."""
        return sorted(flights, key=lambda f: (-f.add.priority, f.progress))

    def blocks_of(self, flight: Flight) -> int:
        return -(-(len(flight.add.prompt_ids) + len(flight.mark.delivered)) // self.block_size)

    def target(
        self, flight: Flight, source: WorkerHandle, allowed: Callable[[WorkerHandle], bool] | None = None
    ) -> WorkerHandle | None:
        """The least loaded ready worker that can decode, other than the source and not leaving, with at
        least 1.2 × the victim's KV blocks free (by its last report), and `allowed` where given; its own
        node first, where the KV changes owner without a byte copied."""
        need = HEADROOM * self.blocks_of(flight)
        candidates = [
            w
            for w in self.registry.live(source.worker_id)
            if w.role in MIGRATION_ROLES
            and (w.status is None or self._free(w) >= need)
            and (allowed is None or allowed(w))
        ]
        return min(candidates, key=lambda w: (w.node != source.node, w.load, w.kv_use, w.worker_id), default=None)

    @staticmethod
    def _free(w: WorkerHandle) -> int:
        s = w.status
        return s.kv_blocks_total - s.kv_blocks_used if s is not None else 0

    # --- records -----------------------------------------------------------------------------------
    def active(self, request_id: str) -> MigrationRecord | None:
        return self._active.get(request_id)

    def begin(self, flight: Flight, source: int, to: int, reason: MigrationReason) -> MigrationRecord:
        rid = flight.add.request_id
        move = f"{rid}/migration-{secrets.token_hex(4)}"
        record = MigrationRecord(move, rid, source, to, reason, len(flight.mark.delivered))
        self._active[rid] = record
        self.records.append(record)
        return record

    def answered(self, request_id: str, h: Handoff, last_token_at: float) -> MigrationRecord | None:
        """The source's answer: the KV went (`switched`), or it stayed (aborted)."""
        record = self._active.get(request_id)
        if record is None or record.move != h.migration:
            return None
        record.path, record.stages, record.bytes, record.blocks = h.path, h.stages, h.bytes, len(h.block_ids)
        record.retries = h.retries
        record.paused_at, record.last_token_at = h.paused_at, last_token_at
        if h.error:
            self._end(record, MigrationOutcome.ABORTED, h.error)
        else:
            record.outcome, record.switched_at = MigrationOutcome.SWITCHED, time.monotonic()
        return record

    def resumed(self, request_id: str, resumed_at: float, now: float) -> MigrationRecord | None:
        """The destination's first token: the migration is committed; its downtime and gap are known."""
        record = self._active.get(request_id)
        if record is None or record.outcome is not MigrationOutcome.SWITCHED:
            return None
        if resumed_at and record.paused_at:
            record.downtime_s = max(0.0, resumed_at - record.paused_at)
        elif record.path == MigrationMode.RECOMPUTE:  # aborted at the switch; running again at its first token
            record.downtime_s = now - record.switched_at
        if record.last_token_at:
            record.gap_s = now - record.last_token_at
        self._end(record, MigrationOutcome.COMMITTED)
        return record

    def recomputing(self, request_id: str, last_token_at: float) -> None:
        """A migration by recompute: switched at once (the source is told to drop the request)."""
        record = self._active[request_id]
        record.path, record.last_token_at = MigrationMode.RECOMPUTE.value, last_token_at
        record.outcome, record.switched_at = MigrationOutcome.SWITCHED, time.monotonic()

    def lost(self, worker_id: int, why: str) -> list[MigrationRecord]:
        """A worker died: its migrations, either way, end; the takeover recovers their requests."""
        gone = [
            r
            for r in self._active.values()
            # Once switched, the source's death changes nothing: the request is the destination's.
            if r.to_worker == worker_id or (r.from_worker == worker_id and r.outcome is MigrationOutcome.RUNNING)
        ]
        for record in gone:
            # The destination died before the switch: the request never left its source.
            kept = record.to_worker == worker_id and record.outcome is MigrationOutcome.RUNNING
            self._end(record, MigrationOutcome.ABORTED if kept else MigrationOutcome.LOST, why)
        return gone

    def finished(self, request_id: str) -> None:
        """The request ended (finished, aborted by its client) before its migration did."""
        record = self._active.get(request_id)
        if record is not None:
            self._end(record, MigrationOutcome.ABORTED, "the request ended first")

    def _end(self, record: MigrationRecord, outcome: MigrationOutcome, error: str = "") -> None:
        record.outcome, record.error = outcome, error
        record.seconds = time.monotonic() - record.t0
        if self._active.get(record.request_id) is record:
            del self._active[record.request_id]
