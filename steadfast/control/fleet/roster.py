"""Which workers serve, as the router sees them come and go: placement's choice for a request (a standby
chosen is promoted first), the supervisor's news of a worker joining, retiring or dying, and what a
lost worker leaves: its requests handed to recovery, high priority first, a standby stepping in for the
last worker of its role."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from steadfast.control.fleet.delivery import Flight, wanted
from steadfast.control.fleet.health import HealthMonitor
from steadfast.control.fleet.hub import Hub
from steadfast.control.fleet.maintenance import Maintenance
from steadfast.control.fleet.migration import MigrationRecord, Migrations
from steadfast.control.fleet.placement import DECODE_ROLES, SERVE_ROLES, Placement
from steadfast.control.fleet.recovery import Recovery
from steadfast.control.fleet.routing import CacheIndex
from steadfast.control.fleet.timeline import EventKind, Timeline
from steadfast.control.fleet.workers import Liveness, WorkerHandle, WorkerRegistry
from steadfast.wire.worker import (
    AddRequest,
    DestinationLost,
    Priority,
    Promote,
    WorkerDied,
    WorkerJoined,
    WorkerRole,
    WorkerState,
    WorkerStatus,
)

log = logging.getLogger("steadfast.control.fleet.client")  # (one logger for the router's fleet I/O)


class Roster:
    def __init__(
        self,
        hub: Hub,
        registry: WorkerRegistry,
        placement: Placement,
        flights: dict[str, Flight],
        health: HealthMonitor,
        index: CacheIndex,
        migrations: Migrations,
        maintenance: Maintenance,
        timeline: Timeline,
        spawn: Callable[[object], None],
        ended: Callable[[MigrationRecord | None], None],
    ) -> None:
        """`flights`: the client's requests in flight by id; `index`: the routing's cache index; `spawn`:
        runs a coroutine as one of the router's tasks; `ended`: a migration record that may have ended."""
        self.hub, self.registry, self.placement, self.flights = hub, registry, placement, flights
        self.health, self.index, self.migrations, self.maintenance = health, index, migrations, maintenance
        self.timeline, self.spawn, self.ended = timeline, spawn, ended

    async def choose(
        self,
        exclude: int = -1,
        roles: tuple[WorkerRole, ...] = SERVE_ROLES,
        node: str = "",
        request: AddRequest | None = None,
    ) -> WorkerHandle | None:
        """Placement's choice (routed by `request`'s prompt when given); a standby chosen is promoted
        to `roles[0]` first."""
        if request is None:
            worker = self.placement.pick(exclude, roles, node)
        else:
            prompt, priority = request.prompt_ids, Priority(request.priority)
            worker = self.placement.pick(exclude, roles, node, prompt, priority, request.request_id)
        if worker is not None and worker.role == WorkerRole.STANDBY:
            await self.promote(worker, roles[0])
        return worker

    async def promote(self, w: WorkerHandle, role: WorkerRole) -> None:
        log.warning("promoting standby worker %d to take traffic as %s", w.worker_id, role)
        self.registry.promote(w, role)
        # The worker reports its new role from now on, so a restarted router learns it too.
        await self.hub.send(w, Promote(role))

    async def choose_with_room(self, request: AddRequest) -> WorkerHandle | None:
        """A worker for a new request, waiting a bounded time while none has room (ramping or at its
        reserve); then the least loaded takes it anyway: an accepted request is never turned away."""
        deadline = time.monotonic() + self.placement.room_wait_s
        worker = await self.choose(request=request)
        while worker is not None and not self.placement.has_room(worker) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
            worker = await self.choose(request=request)
        return worker

    async def notice(self, msg: WorkerStatus | WorkerDied | WorkerJoined) -> WorkerHandle | None:
        """A worker's status, or the supervisor's news of one joining, retiring or dying: the worker now
        lost (to hand to `lost`), if any."""
        if isinstance(msg, WorkerStatus):
            w = self.registry.observe(msg)  # (ignored from a worker already declared dead, or not announced)
            if w is not None and msg.state == WorkerState.STOPPING and not self.maintenance.draining(w.worker_id):
                self.maintenance.drain(w.worker_id)  # it was told to stop (SIGTERM): its requests move first
        elif isinstance(msg, WorkerDied):
            w = self.registry.get(msg.worker_id)
            if w is not None and not w.dead:
                moving = sum(1 for f in self.flights.values() if f.mark.owner == msg.worker_id)
                if msg.exit_code == 0:
                    log.info("worker %d (pid %d) retired", msg.worker_id, msg.pid)
                    self.timeline.note(EventKind.RETIRE, f"worker {msg.worker_id} retired", worker=msg.worker_id)
                else:
                    log.error("worker %d (pid %d) died with code %d", msg.worker_id, msg.pid, msg.exit_code)
                    why = f"pid {msg.pid} exit code {msg.exit_code}; lease fenced, {moving} request(s) to take over"
                    self.timeline.note(EventKind.CRASH, f"worker {msg.worker_id} died", why, msg.worker_id)
                return w
        elif self.registry.get(msg.worker_id) is None:  # WorkerJoined
            log.info("worker %d joined as %s at %s", msg.worker_id, msg.role, msg.address)
            why = f"replacing worker {msg.like}" if msg.like >= 0 else ""
            self.timeline.note(EventKind.JOIN, f"worker {msg.worker_id} joined as {msg.role}", why, msg.worker_id)
            w = self.hub.add(msg.worker_id, msg.address, msg.role)
            w.joining = True
            if msg.like >= 0:
                self.maintenance.joined(msg.worker_id, msg.like)
        return None

    async def lost(self, w: WorkerHandle, recovery: Recovery) -> None:
        """Stop listening to a worker and move each of its requests, high priority first."""
        w.liveness = Liveness.DEAD
        self.health.forget(w.worker_id)
        self.index.forget(w.worker_id)
        # Its sources are told at once: a move to it would otherwise wait out its session's retries
        # (30 s a path at the default timeout) before the fallback.
        sources = {f.mark.owner for f in self.flights.values() if f.add.decode_worker == w.worker_id}
        for record in self.migrations.lost(w.worker_id, f"worker {w.worker_id} died"):
            if record.to_worker == w.worker_id:
                sources.add(record.from_worker)
            self.ended(record)
        for source in sources - {w.worker_id}:
            x = self.registry.get(source)
            if x is not None and not x.dead:
                await self.hub.send(x, DestinationLost(w.worker_id))
        role, node = w.role, w.node
        moving = sorted((f for f in self.flights.values() if f.mark.owner == w.worker_id), key=lambda f: f.add.priority)
        w.in_flight.clear()
        roles = SERVE_ROLES if role == WorkerRole.MIXED else DECODE_ROLES
        for flight in moving:
            flight.mark.moving = True
            rid = flight.add.request_id
            recovery.forget(rid)  # moved to this worker, which died before answering: free the slot
            self.spawn(recovery.move(flight, w.worker_id, wanted(self.flights, flight), roles, node))
        # The last worker of its role: a standby (of its node, if there is one) steps into it.
        if role != WorkerRole.STANDBY and not any(x.role == role and not x.dead for x in self.registry):
            standby = self.placement.standby(node)
            if standby is not None:
                await self.promote(standby, role)
        self.hub.drop(w.worker_id)
