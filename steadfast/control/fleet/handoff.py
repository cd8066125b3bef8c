"""A request changing worker by its KV: a prefill worker handing it to a decode worker (or failing to,
then the decode worker computes the prompt itself), a live migration's source answering. From the
handoff on, its outputs are delivered from the new owner, from the watermark on (delivery.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from steadfast.control.fleet.delivery import Flight
from steadfast.control.fleet.hub import Hub
from steadfast.control.fleet.migration import MigrationRecord, Migrations
from steadfast.control.fleet.recovery import Recovery
from steadfast.control.fleet.workers import WorkerRegistry
from steadfast.util.log import about
from steadfast.wire.worker import AddRequest, Fallback, Handoff, Resume

log = logging.getLogger("steadfast.control.fleet.client")  # (one logger for the router's fleet I/O)


class Handoffs:
    def __init__(
        self,
        registry: WorkerRegistry,
        migrations: Migrations,
        recovery: Recovery,
        hub: Hub,
        wanted: Callable[[Flight], Callable[[], bool]],
        spawn: Callable[[object], None],
        ended: Callable[[MigrationRecord | None], None],
        on_handoff: Callable[[Handoff], None],
    ) -> None:
        """`wanted`: whether a flight still streams to a client; `spawn`: runs a coroutine as one of the
        router's tasks; `ended`: a migration record that may have ended; `on_handoff`: metrics."""
        self.registry, self.migrations, self.recovery, self.hub = registry, migrations, recovery, hub
        self.wanted, self.spawn, self.ended, self.on_handoff = wanted, spawn, ended, on_handoff

    async def handed(self, flight: Flight, from_worker: int, h: Handoff) -> None:
        """A prefill worker handed a request's KV to a decode worker (or could not): send it there."""
        rid = flight.add.request_id
        self.on_handoff(h)
        if h.error and h.fallback is not Fallback.RECOMPUTE:
            log.warning(
                "request %s: KV not handed to %d (%s); decoded on %d",
                rid,
                h.to_worker,
                h.error,
                from_worker,
                extra=about(rid),
            )
            return
        if h.error:  # every transfer path failed: the decode worker computes the prompt itself
            log.warning(
                "request %s: KV transfer to %d failed (%s); it recomputes", rid, h.to_worker, h.error, extra=about(rid)
            )
        await self._switch(flight, from_worker, h)

    async def _switch(self, flight: Flight, from_worker: int, h: Handoff) -> None:
        """The KV is `h.to_worker`'s now (or must be recomputed there): deliver from it from the watermark on."""
        rid = flight.add.request_id
        source = self.registry.get(from_worker)
        if source is not None:
            source.in_flight.discard(rid)
        flight.mark.hand_to(h.to_worker)
        target = self.registry.get(h.to_worker)
        if target is None or target.dead:  # died after the handoff: its blocks are reclaimed, adoptable
            flight.mark.moving = True
            self.spawn(self.recovery.move(flight, h.to_worker, self.wanted(flight)))
            return
        target.in_flight.add(rid)
        add, mark = flight.add, flight.mark
        resume = Resume(list(mark.delivered), mark.text_chars, from_worker)
        handed = AddRequest(
            rid, add.prompt_ids, add.params, add.priority, resume=resume, handoff=None if h.error else h
        )
        # Awaited here, before the next message is handled, so an abort of this request cannot overtake it.
        await self.hub.send(target, handed)

    async def migrated(self, flight: Flight, from_worker: int, h: Handoff) -> None:
        """The source's answer to a Migrate: the KV went (deliver from the destination on), or it stayed."""
        rid = flight.add.request_id
        record = self.migrations.answered(rid, h, flight.progress)
        if from_worker != flight.mark.owner or flight.mark.moving:
            return  # no longer its request (recovered meanwhile): nothing moved that counts
        if h.error:
            log.info(
                "request %s: not migrated from %d to %d (%s)", rid, from_worker, h.to_worker, h.error, extra=about(rid)
            )
            self.ended(record)
            return
        log.info(
            "request %s migrated from %d to %d at token %d", rid, from_worker, h.to_worker, len(flight.mark.delivered)
        )
        await self._switch(flight, from_worker, h)
