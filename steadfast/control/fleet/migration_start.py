"""Starting a live migration of a running request: check it can move, choose the worker it goes to
(a standby promoted for a drain with nowhere else to go), and ask its worker to move it (`Migrate`), or,
where no KV can travel, compute it again on the destination. What happens next is the move protocol's
(the source's answer arrives as a Handoff to the client); the records are `Migrations`'."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from steadfast.control.fleet.delivery import Flight
from steadfast.control.fleet.hub import Hub
from steadfast.control.fleet.migration import (
    MIGRATION_ROLES,
    MigrationError,
    MigrationMode,
    MigrationReason,
    MigrationRecord,
    Migrations,
)
from steadfast.control.fleet.placement import Placement
from steadfast.control.fleet.workers import WorkerHandle, WorkerRegistry
from steadfast.wire.worker import AbortRequest, AddRequest, Handoff, Migrate, Resume, WorkerRole, WorkerState


class MigrationStart:
    def __init__(
        self,
        flights: dict[str, Flight],
        registry: WorkerRegistry,
        migrations: Migrations,
        placement: Placement,
        hub: Hub,
        promote: Callable[[WorkerHandle, WorkerRole], Awaitable[None]],
        ended: Callable[[MigrationRecord | None], None],
    ) -> None:
        """`flights`: the client's requests in flight by id; `promote`: a standby to a role; `ended`: told
        of a record that ended before it started (nothing sent)."""
        self.flights, self.registry, self.migrations, self.placement = flights, registry, migrations, placement
        self.hub, self.promote, self.ended = hub, promote, ended

    async def migrate(
        self,
        request_id: str,
        to: int | None = None,
        reason: MigrationReason = MigrationReason.OPERATOR,
        mode: MigrationMode = MigrationMode.KV,
    ) -> MigrationRecord:
        """Ask a running request's worker to move it to worker `to` (None: the policy's target). Raises
        MigrationError (with the status an operator's call gets) when it cannot start. `mode` RECOMPUTE:
        the source drops it and the destination computes prompt and delivered tokens again (what a server
        without KV moves does; the baseline of the migration benchmark)."""
        flight = self.flights.get(request_id)
        if flight is None:
            raise MigrationError(f"no request {request_id} is in flight", 404)
        mark = flight.mark
        source = self.registry.get(mark.owner)
        if mark.moving or source is None or source.dead:
            raise MigrationError(f"request {request_id} is being recovered from a dead worker", 409)
        if self.migrations.active(request_id) is not None:
            raise MigrationError(f"request {request_id} is migrating already", 409)
        if to is None:
            target = self.migrations.target(flight, source)
            if target is None and reason is MigrationReason.DRAIN:
                # A drain with no worker left to take its requests: a standby steps in — its node's first,
                # unless the worker is stopping (SIGTERM): then its node is, standbys and all.
                stopping = source.status is not None and source.status.state == WorkerState.STOPPING
                target = self.placement.standby(source.node, elsewhere=stopping)
                if target is not None:
                    await self.promote(target, source.role if source.role in MIGRATION_ROLES else WorkerRole.MIXED)
            if target is None:
                raise MigrationError(f"no other worker can take request {request_id} (ready, with room)", 409)
        else:
            target = self.registry.get(to)
            if target is None or target.worker_id not in {w.worker_id for w in self.registry.live()}:
                raise MigrationError(f"worker {to} is not ready to take requests", 409)
            if target.worker_id == source.worker_id:
                raise MigrationError(f"request {request_id} runs on worker {to} already", 409)
            if target.role not in MIGRATION_ROLES:
                raise MigrationError(f"worker {to} is a {target.role} worker: it does not decode", 409)
        if mode is MigrationMode.RECOMPUTE:
            return await self._recompute_at(flight, source, target, reason)
        paths: list[str] = []
        if target.node != source.node:
            paths = list(target.status.kv_addresses) if target.status is not None else []
            if not paths:  # no KV wire to that node (parts on several hosts): it computes the request again
                return await self._recompute_at(flight, source, target, reason)
        record = self.migrations.begin(flight, source.worker_id, target.worker_id, reason)
        cfg = self.migrations.cfg
        ask = Migrate(
            request_id, target.worker_id, record.move, paths, cfg.max_stages, cfg.final_stage_blocks, cfg.timeout
        )
        if not await self.hub.send(source, ask):
            self.ended(self.migrations.answered(request_id, Handoff(target.worker_id, error="not sent"), 0.0))
        return record

    async def _recompute_at(
        self, flight: Flight, source: WorkerHandle, target: WorkerHandle, reason: MigrationReason
    ) -> MigrationRecord:
        rid, mark = flight.add.request_id, flight.mark
        record = self.migrations.begin(flight, source.worker_id, target.worker_id, reason)
        self.migrations.recomputing(rid, flight.progress)
        source.in_flight.discard(rid)
        await self.hub.send(
            source, AbortRequest([rid])
        )  # its outputs still on the way are the old owner's: never resent
        mark.hand_to(target.worker_id)
        target.in_flight.add(rid)
        add = flight.add
        resume = Resume(list(mark.delivered), mark.text_chars, source.worker_id)
        await self.hub.send(target, AddRequest(rid, add.prompt_ids, add.params, add.priority, resume=resume))
        return record

    async def migrate_and_wait(
        self, request_id: str, to: int | None, timeout_s: float, mode: MigrationMode = MigrationMode.KV
    ) -> MigrationRecord:
        """An operator's migration: started, then awaited until it commits, aborts or `timeout_s` passes."""
        record = await self.migrate(request_id, to, MigrationReason.OPERATOR, mode)
        deadline = time.monotonic() + timeout_s
        while not record.done and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return record
