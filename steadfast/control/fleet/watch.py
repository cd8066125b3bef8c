"""The router's watch over its workers and requests, every status interval: a worker that stops
reporting is probed, then taken out of rotation until it reports again; the health check scores every
worker and moves work off a degraded or sick one; a request that failed is retried once elsewhere; a
request that received no token for too long moves to another worker. It decides; the hub sends, the
recovery moves, the migrations' start is the client's (`migrate`, given at construction)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from steadfast.control.fleet.delivery import Flight, wanted
from steadfast.control.fleet.health import HealthMonitor
from steadfast.control.fleet.hub import Hub
from steadfast.control.fleet.migration import MigrationError, MigrationReason, MigrationRecord, Migrations
from steadfast.control.fleet.placement import DECODE_ROLES, SERVE_ROLES
from steadfast.control.fleet.recovery import Recovery
from steadfast.control.fleet.resume import Resumption
from steadfast.control.fleet.workers import Liveness, WorkerRegistry
from steadfast.util.log import about
from steadfast.wire.worker import AbortRequest, Ping, RequestOutput, WorkerRole

log = logging.getLogger("steadfast.control.fleet.client")  # (one logger for the router's fleet I/O)


class Watch:
    def __init__(
        self,
        hub: Hub,
        registry: WorkerRegistry,
        flights: dict[str, Flight],
        health: HealthMonitor,
        migrations: Migrations,
        recovery: Recovery,
        resumption: Resumption,
        migrate: Callable[[str, int | None, MigrationReason], Awaitable[MigrationRecord]],
        spawn: Callable[[object], None],
        status_interval_s: float,
        request_timeout_s: float,
    ) -> None:
        """`flights`: the client's requests in flight by id (read here, never changed); `migrate`: starts
        a live migration; `spawn`: runs a coroutine as one of the router's tasks."""
        self.hub, self.registry, self.flights, self.health = hub, registry, flights, health
        self.migrations, self.recovery, self.resumption = migrations, recovery, resumption
        self.migrate, self.spawn = migrate, spawn
        self.status_interval_s, self.request_timeout_s = status_interval_s, request_timeout_s
        self._health_moved: dict[str, float] = {}  # request id → when it was last moved for health
        self._probes = 0

    def heard(self, flight: Flight, worker_id: int, at: float, out: RequestOutput) -> MigrationRecord | None:
        """An output accepted for `flight` from `worker_id` (`at`: the worker's own stamp of its step):
        the request progressed, its worker answered (health: the gap since its last token), a recovery
        or a migration that moved it is over. The migration's record when this was its first token there."""
        now = time.monotonic()
        if out.token_ids:
            stamp = at or now
            if flight.last_worker == worker_id:
                self.health.token_gap(worker_id, out.request_id, stamp - flight.last_stamp, now)
            flight.last_token, flight.last_stamp, flight.last_worker = now, stamp, worker_id
            if (source := self.registry.get(worker_id)) is not None:
                source.last_token_at = now
            self.health.answered(worker_id, out.request_id, now, time.time())
        flight.progress = now
        self.recovery.answered(out)
        if out.token_ids and self.migrations.active(out.request_id) is not None:  # its first token there
            return self.migrations.resumed(out.request_id, out.resumed_at, flight.progress)
        return None

    def _owned(self, worker_id: int) -> list[Flight]:
        return [f for f in self.flights.values() if f.mark.owner == worker_id and not f.mark.moving]

    async def run(self) -> None:
        """Take a worker that stops reporting out of rotation for new requests until it reports again:
        past the silence limit it is SUSPECT and probed once more (`Ping`), SILENT when that goes
        unanswered too (the second probe: one late report does not make a worker silent).

        Its requests stay where they are: a silent worker may only be slow. Requests move when its
        death is certain: the supervisor reaps it (a hung worker's lease expires, the pool fences it,
        the supervisor kills the fenced process) and says so with WorkerDied. Each round also runs the
        health check (`health_round`) and moves stalled requests.
        """
        limit = max(5 * self.status_interval_s, 3.0)
        probe = max(2 * self.status_interval_s, 1.0)
        next_health = 0.0
        while True:
            await asyncio.sleep(min(self.status_interval_s, self.health.cfg.interval_s))
            if self.hub.behind():
                continue  # reports are waiting unread: the silence is the router's, not the workers'
            suspect, silent = self.registry.sweep_silent(limit, probe)
            for w in suspect:
                self._probes += 1
                log.warning("worker %d quiet for %.1fs: probing it", w.worker_id, limit)
                await self.hub.send(w, Ping(self._probes))
            for w in silent:
                log.error("worker %d silent, probe unanswered: no new requests until it reports", w.worker_id)
            now = time.monotonic()
            if now >= next_health:
                next_health = now + self.health.cfg.interval_s
                await self.health_round(now)
            await self.move_stalled(now)
            self.resumption.expire(now)

    async def health_round(self, now: float) -> None:
        """Sample every worker, score it, and act: a degraded worker's lowest-priority, least recently
        active requests migrate to the least loaded healthy worker with room (not moved again within
        the request cooldown); a sick worker's requests are retried elsewhere."""
        waiting: dict[int, dict[str, float]] = {}
        for rid, f in self.flights.items():
            if f.last_token and not f.mark.moving and f.last_worker == f.mark.owner:
                waiting.setdefault(f.mark.owner, {})[rid] = now - f.last_token
        self.health.tick(self.registry, waiting, now, time.time())
        cooldown = self.health.cfg.request_cooldown_s
        self._health_moved = {r: t for r, t in self._health_moved.items() if now - t < cooldown}
        for w in self.registry:
            if w.dead or w.role == WorkerRole.STANDBY:
                continue
            if self.health.excluded(w.worker_id):  # sick: everything on it moves, started or not
                for flight in self._owned(w.worker_id):
                    if not await self.retry(flight, w.worker_id, None):
                        await self.move_off(flight, f"its worker {w.worker_id} is sick and no other could take it")
                continue
            owned = [f for f in self._owned(w.worker_id) if f.mark.delivered]  # decoding: what can migrate
            moved = []
            for flight, target in self.health.moves(w, owned, self.migrations, self._health_moved, now):
                rid = flight.add.request_id
                with contextlib.suppress(MigrationError):
                    await self.migrate(rid, target.worker_id, MigrationReason.HEALTH)
                    self._health_moved[rid] = now
                    moved.append(f"{rid} -> {target.worker_id}")
            if moved:
                self.health.evicting(w.worker_id, len(moved), now, time.time(), ", ".join(moved))
                log.warning("worker %d health score over threshold: migrating %s", w.worker_id, ", ".join(moved))

    async def retry(self, flight: Flight, worker_id: int, out: RequestOutput | None) -> bool:
        """A request failed (`out`, a retryable error) or must leave a sick worker (None) on `worker_id`:
        counted against the worker and retried once on another, from what its client holds. False
        when it was retried before (its error then goes to the client) or the health check is off."""
        if not self.health.cfg.enabled or flight.retried or flight.mark.moving:
            return False
        rid = flight.add.request_id
        now = time.monotonic()
        if out is not None:
            why = out.error or "error"
            log.warning(
                "request %s failed on worker %d (%s): retrying it elsewhere", rid, worker_id, why, extra=about(rid)
            )
            if self.health.failure(worker_id, rid, why, now, time.time()):
                log.error("worker %d is sick: out of rotation, its requests move", worker_id)
        flight.retried = True
        self.health.retried += 1
        await self.move_off(flight, f"it failed on worker {worker_id} and no other worker could take it")
        return True

    async def move_off(self, flight: Flight, why: str) -> None:
        """Take a request off its live owner (told to drop it) and resume it on another worker."""
        mark, rid = flight.mark, flight.add.request_id
        owner = self.registry.get(mark.owner)
        flight.progress = time.monotonic()
        mark.moving = True
        roles, node = SERVE_ROLES, ""
        if owner is not None:
            owner.in_flight.discard(rid)
            await self.hub.send(owner, AbortRequest([rid]))
            roles = SERVE_ROLES if owner.role in (WorkerRole.MIXED, WorkerRole.PREFILL) else DECODE_ROLES
            node = owner.node
        self.spawn(self.recovery.move(flight, mark.owner, wanted(self.flights, flight), roles, node, why))

    async def move_stalled(self, now: float) -> None:
        """A request that received no token for `request_timeout` (sooner, after the health check's
        `stall_s`, a decoding one on a worker that reports but produced no token at all since) moves to
        another worker (its own is told to drop it), or fails with an error saying so when none can take
        it within the wait. Such a stall counts against its worker."""
        stall = self.health.cfg.stall_s if self.health.cfg.enabled else self.request_timeout_s
        for flight in list(self.flights.values()):
            mark = flight.mark
            owner = self.registry.get(mark.owner)
            # A decoding request on a worker that reports but has produced no token for anybody since (a
            # request merely waiting — swapped out, preempted, paced — while others get tokens is not; a
            # silent worker is the process layer's business).
            stalled = (
                bool(mark.delivered)
                and owner is not None
                and owner.liveness is Liveness.ALIVE
                and now - owner.last_token_at >= stall
            )
            limit = min(stall, self.request_timeout_s) if stalled else self.request_timeout_s
            if mark.moving or now - flight.progress < limit:
                continue
            rid = flight.add.request_id
            quiet = now - flight.progress
            log.error(
                "request %s received no token for %.0fs on worker %d: moving it",
                rid,
                quiet,
                mark.owner,
                extra=about(rid),
            )
            if stalled and self.health.failure(mark.owner, rid, f"no token for {quiet:.0f}s", now, time.time()):
                log.error("worker %d is sick: out of rotation, its requests move", mark.owner)
            await self.move_off(flight, f"it received no token for {quiet:.0f}s and no other worker could take it")
