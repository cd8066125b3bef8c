"""The router's client of its workers: a request out (placed, sent through the hub), its outputs back
to its caller in order (the watermark decides what goes on), a resume taking a request over. A caller
iterates `generate()`; leaving early (client gone) aborts the request on its owner. The rest is the
parts', built here and given what they need: hub (sockets), roster (who serves; joins and deaths),
watch (silence, health, retry-once, stalls), handoffs, migration start, recovery, maintenance.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
import zmq
import zmq.asyncio

from steadfast.config import HealthConfig, MigrationConfig, RoutingConfig, SchedulerConfig, TakeoverConfig
from steadfast.control.fleet.delivery import Flight, Quiet, Verdict, Watermark, log_fault, wanted
from steadfast.control.fleet.handoff import Handoffs
from steadfast.control.fleet.health import HealthMonitor
from steadfast.control.fleet.maintenance import Maintenance
from steadfast.control.fleet.migration import (
    MigrationReason,
    MigrationRecord,
    Migrations,
)
from steadfast.control.fleet.migration_start import MigrationStart
from steadfast.control.fleet.parts import FleetParts
from steadfast.control.fleet.placement import Placement
from steadfast.control.fleet.recovery import Recovery, Takeover
from steadfast.control.fleet.resume import Known, Resumption, Turns
from steadfast.control.fleet.roster import Roster
from steadfast.control.fleet.routing import Loads, Router
from steadfast.control.fleet.timeline import Timeline
from steadfast.control.fleet.watch import Watch
from steadfast.control.fleet.workers import WorkerHandle
from steadfast.util.log import about
from steadfast.wire.curve import KeyFile
from steadfast.wire.worker import (
    AbortRequest,
    AddRequest,
    CacheEvents,
    FinishReason,
    FromWorker,
    Handoff,
    Priority,
    RequestOutput,
    StepOutputs,
    WorkerDied,
    WorkerJoined,
    WorkerRole,
)

log = logging.getLogger(__name__)


# The error a stream ends with when its client resumed it on another connection (a newer resume).
RESUMED_ELSEWHERE = "this stream was resumed on another connection"


class EngineDeadError(RuntimeError):
    """No worker can take the request, or the worker serving it died."""


class EngineClient:
    def __init__(
        self,
        workers: list[tuple[int, str, WorkerRole]],
        output_address: str,
        status_interval_s: float,
        takeover: TakeoverConfig | None = None,
        idempotency_window_s: float = 60.0,
        ledger_urls: list[str] | tuple[str, ...] = (),
        max_in_flight: int = 128,
        request_timeout_s: float = 60.0,
        migration: MigrationConfig | None = None,
        block_size: int = 16,
        supervisor: str = "",
        health: HealthConfig | None = None,
        routing: RoutingConfig | None = None,
        scheduler: SchedulerConfig | None = None,
        keys: KeyFile | None = None,
        startup_timeout_s: float = 180.0,
        on_handoff: Callable[[Handoff], None] = lambda h: None,
        on_migration: Callable[[MigrationRecord], None] = lambda r: None,
        parts: FleetParts | None = None,
        loads: Loads | None = None,
    ) -> None:
        """`workers`: (id, input address, role) of each worker. `ledger_urls`: each node's ledger,
        where a restarted router finds requests it never saw (to resume them for reconnecting clients).
        `keys`: a router part's, whose workers are on other hosts: every queue is CURVE over TCP.
        `startup_timeout_s`: a new worker's time to be ready; `on_handoff`, `on_migration`: metrics, told
        of each handoff and of each migration that ended. `parts`: shared with the ladder (default: made
        here); `loads`: the ladder's view of each worker's load, for KV-aware routing."""
        self.output_address = output_address
        self.status_interval_s = status_interval_s
        self.request_timeout_s = request_timeout_s
        takeover = takeover or TakeoverConfig()
        parts = parts or FleetParts.make(output_address, keys, routing or RoutingConfig(), block_size)
        self.parts = parts
        self.registry = parts.registry
        self.hub = parts.hub
        for worker_id, address, role in workers:
            self.hub.add(worker_id, address, role)
        self.health = HealthMonitor(health or HealthConfig())
        self.router = Router(routing or RoutingConfig(), scheduler or SchedulerConfig(), block_size, parts.index, loads)
        self.placement = Placement(self.registry, takeover, max_in_flight, self.router, self.health)
        self._flights = parts.flights
        self._tasks: list[asyncio.Task[None]] = []
        self.migrations = Migrations(migration or MigrationConfig(), self.registry, block_size)
        # The supervisor, asked for new workers by a rollout (absent: a router started by hand).
        to_supervisor: zmq.asyncio.Socket | None = None
        if supervisor:
            to_supervisor = self.hub.ctx.socket(zmq.PUSH)
            to_supervisor.setsockopt(zmq.LINGER, 0)
            to_supervisor.connect(supervisor)
        self.timeline = Timeline()  # joins, deaths, retirements, drains, rollouts (control/fleet/timeline.py)
        self.on_handoff, self.on_migration = on_handoff, on_migration
        self.maintenance = Maintenance(
            self.registry,
            self.migrations,
            self._owned,
            self._migrate,
            self.hub.send,
            self._spawn,
            to_supervisor,
            self.timeline,
            startup_timeout_s,
        )
        self.roster = Roster(
            self.hub,
            self.registry,
            self.placement,
            self._flights,
            self.health,
            self.router.index,
            self.migrations,
            self.maintenance,
            self.timeline,
            self._spawn,
            self._ended,
        )
        self.recovery = Recovery(takeover, self.placement, self.roster.choose, self.hub.send)
        self.resumption_records = Resumption(idempotency_window_s, ledger_urls)
        self.turns = Turns()  # resumes of one request one at a time, the newest winning
        # A stream with no output this long ends with an error: past every bound of the router's own (a
        # stalled request moved at `request_timeout`, the move's `wait_timeout`, `request_timeout` more on
        # its new worker), so it only ends what nothing else would (a wait no part of the router watches).
        self.idle_limit_s = 2 * request_timeout_s + takeover.wait_timeout
        self.starts = MigrationStart(
            self._flights, self.registry, self.migrations, self.placement, self.hub, self.roster.promote, self._ended
        )
        self.watch = Watch(
            self.hub,
            self.registry,
            self._flights,
            self.health,
            self.migrations,
            self.recovery,
            self.resumption_records,
            self._migrate,
            self._spawn,
            status_interval_s,
            request_timeout_s,
        )
        self.handoffs = Handoffs(
            self.registry,
            self.migrations,
            self.recovery,
            self.hub,
            lambda flight: wanted(self._flights, flight),
            self._spawn,
            self._ended,
            on_handoff,
        )

    @property
    def workers(self) -> list[WorkerHandle]:
        return list(self.registry)

    @property
    def takeovers(self) -> list[Takeover]:
        return self.recovery.takeovers

    @property
    def ready(self) -> bool:
        return self.registry.ready

    @property
    def pending(self) -> int:
        """Requests admitted and not finished (their streams still open)."""
        return len(self._flights)

    def flights(self) -> list[Flight]:
        """Every request in flight (admitted, stream open)."""
        return list(self._flights.values())

    def end_all(self, why: str) -> int:
        """End every stream in flight with an error event saying `why` (shutdown past its timeout); the
        requests are aborted on their workers as each stream closes. Returns how many were ended."""
        flights = list(self._flights.values())
        for flight in flights:
            rid = flight.add.request_id
            flight.queue.put_nowait(RequestOutput(rid, [], finish_reason=FinishReason.ERROR, error=why))
        return len(flights)

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self.watch.run())]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self.hub.close()

    async def notice(self, msg: WorkerDied | WorkerJoined) -> None:
        """A supervisor's news that came another way than the output socket (a node's record in etcd)."""
        await self._handle(msg)

    # --- placement -----------------------------------------------------------------------------
    # --- requests ------------------------------------------------------------------------------
    async def generate(
        self,
        request: AddRequest,
        skip_until: int = 0,
        quiet_s: float | None = None,
        resuming: Known | None = None,
    ) -> AsyncIterator[RequestOutput | None]:
        """Outputs of one request, in order, ending with the one that carries a finish_reason; a None
        each time `quiet_s` passes without one (its caller's keep-alive).

        A client reconnecting (`resuming`: what was known of the request when it asked; `request.resume`:
        what it holds) waits for the request's turn (`Turns`) and takes it over (`_take_over`); outputs
        below `skip_until` (tokens its client holds already) are swallowed. Nothing for `idle_limit_s`
        ends the request with an error output: no caller waits for ever.
        """
        rid = request.request_id
        quiet = Quiet(quiet_s, self.idle_limit_s)
        flight: Flight | None = None
        if resuming is None:
            flight = await self._open(request, skip_until)
        else:
            turn, mine = self.turns.enter(rid)
            try:
                # Once a newer resume of it has asked, that one carries the stream on: this one stops unsent.
                while mine == turn.newest:
                    if await quiet.wait(turn.lock.acquire) is not None:
                        try:
                            if mine == turn.newest:
                                flight = await self._take_over(request, skip_until, resuming)
                        finally:
                            turn.lock.release()
                        break
                    if quiet.over:
                        yield self._given_up(rid, quiet)
                        return
                    yield None
            finally:
                self.turns.leave(rid, turn)
        if flight is None:
            yield RequestOutput(rid, [], finish_reason=FinishReason.ERROR, error=RESUMED_ELSEWHERE)
            return
        finished = False
        try:
            while True:
                queue = flight.queue
                out = queue.get_nowait() if not queue.empty() else await quiet.wait(queue.get)
                if out is None:
                    if quiet.over:
                        yield self._given_up(rid, quiet)
                        return
                    yield None
                    continue
                quiet.heard()
                finished = out.finish_reason is not None
                yield out
                if finished:
                    return
        finally:
            await self._close(flight, finished)

    async def _open(self, request: AddRequest, skip_until: int) -> Flight:
        """Place a request, register its flight and send it; EngineDeadError when no worker takes it."""
        worker = None
        pair = None
        if request.resume is None:
            pair = self.placement.disaggregated(request.prompt_ids, Priority(request.priority), request.request_id)
        if pair is not None:  # prefill here, then decode on the worker chosen now
            worker, decode = pair
            p, d = worker.status, decode.status
            # On another node the KV is streamed there; on this one it changes owner in the ledger.
            paths = list(d.kv_addresses) if p is not None and d is not None and p.node != d.node else []
            request = msgspec.structs.replace(request, decode_worker=decode.worker_id, kv_paths=paths)
        if worker is None:
            worker = await self.roster.choose_with_room(request)
        if worker is None:
            raise EngineDeadError("no worker is ready")
        rid = request.request_id
        mark = Watermark(worker.worker_id, skip_until=skip_until)
        if request.resume is not None:
            mark.delivered = list(request.resume.output_ids)
            mark.text_chars = request.resume.text_chars
        flight = Flight(request, asyncio.Queue(), mark)
        if request.resume is None:
            flight.cached = self.parts.cached_on(worker.worker_id, request.prompt_ids)
        self._flights[rid] = flight
        self.resumption_records.forget(rid)
        worker.in_flight.add(rid)
        try:
            sent = await self.hub.send(worker, request)
        except BaseException:  # (its client gone meanwhile: the flight must not outlive its stream)
            await self._close(flight, finished=False)
            raise
        if not sent:
            await self._close(flight, finished=False)
            raise EngineDeadError(f"worker {worker.worker_id} cannot be reached")
        return flight

    async def _close(self, flight: Flight, finished: bool) -> None:
        """A request's stream is over: its flight retired (kept for a resume) and, unfinished, stopped on
        its worker. Nothing when a resume took the request over meanwhile (and stopped this run of it)."""
        rid = flight.add.request_id
        if self._flights.get(rid) is not flight:
            return
        del self._flights[rid]
        self._ended(self.migrations.finished(rid))
        self.resumption_records.retire(flight)
        owner = self.registry.get(flight.mark.owner)
        if owner is not None:
            owner.in_flight.discard(rid)
            if not finished and not owner.dead:
                await self.abort(owner, rid)

    def known(self, request_id: str) -> Known:
        """What is known of a request a client resumes: its flight while it streams, else the router's
        record within the idempotency window, else the ledgers'. UnknownRequestError when none knows it.
        Changes nothing: the resume itself happens in the request's turn (`generate`)."""
        live = self._flights.get(request_id)
        if live is not None:
            return Known(live.add, list(live.mark.delivered), live.mark.owner)
        return self.resumption_records.lookup(request_id)

    async def _take_over(self, request: AddRequest, skip_until: int, known: Known) -> Flight:
        """A client's resume, in the request's turn: the stream still open on another connection (a
        half-dead one not yet noticed, a second tab, an earlier resume) ends with an error event saying
        where the stream went, rather than stall for ever; its run is stopped (or, after a router
        restart, the run the ledger names), and the request is placed and sent again from what the client
        holds. The next resume's turn starts after this one's flight is registered and sent."""
        rid = request.request_id
        live = self._flights.get(rid)
        if live is not None:
            live.queue.put_nowait(RequestOutput(rid, [], finish_reason=FinishReason.ERROR, error=RESUMED_ELSEWHERE))
            await self._close(live, finished=False)
            kept = self.resumption_records.lookup(rid)  # (its record now: what that stream had delivered)
            if len(kept.tokens) > len(known.tokens):
                known = kept
        else:
            # It may still run for nobody where it was, and the ledger's owner may be stale (a resume
            # the ledger did not record yet): stopped on every live worker (the soak's seed 7).
            for stale in [w for w in self.registry if not w.dead]:
                stale.in_flight.discard(rid)
                await self.abort(stale, rid)
        assert request.resume is not None
        request = Resumption.request(known, skip_until, request.resume.text_chars, request.params)
        return await self._open(request, skip_until)

    def _given_up(self, rid: str, quiet: Quiet) -> RequestOutput:
        why = f"the request had no output for {quiet.limit_s:.0f}s: given up"
        log.error("request %s: %s", rid, why, extra=about(rid))
        return RequestOutput(rid, [], finish_reason=FinishReason.ERROR, error=why)

    async def abort(self, worker: WorkerHandle, request_id: str) -> None:
        await self.hub.send(worker, AbortRequest([request_id]))

    # --- outputs -------------------------------------------------------------------------------
    async def _receive(self) -> None:
        while True:
            try:
                await self._handle(await self.hub.receive())
            except Exception:  # one bad message must not stop the router hearing its workers
                log.exception("failed to handle a message from a worker or the supervisor")

    async def _handle(self, msg: FromWorker) -> None:
        if isinstance(msg, StepOutputs):
            await self._deliver(msg)
        elif isinstance(msg, CacheEvents):
            if self.registry.get(msg.worker_id) is not None:
                self.router.index.apply(msg)
        else:
            lost = await self.roster.notice(msg)
            if lost is not None:
                await self.roster.lost(lost, self.recovery)

    async def _deliver(self, msg: StepOutputs) -> None:
        self.registry.seen(msg.worker_id)
        for out in msg.outputs:
            flight = self._flights.get(out.request_id)
            if flight is None:
                continue  # finished or aborted
            if out.handoff is not None and out.handoff.migration:
                await self.handoffs.migrated(flight, msg.worker_id, out.handoff)
                continue
            verdict = flight.mark.accept(out, msg.worker_id)
            self.migrations.mismatches += verdict is Verdict.MISMATCH
            log_fault(out, verdict, len(flight.mark.delivered))
            if not verdict.accepted:
                continue
            failed = out.retryable and out.finish_reason is FinishReason.ERROR
            if failed and await self.watch.retry(flight, msg.worker_id, out):
                continue
            self._ended(self.watch.heard(flight, msg.worker_id, msg.at, out))
            if verdict is Verdict.FORWARD:
                flight.queue.put_nowait(out)
            if out.handoff is not None and out.finish_reason is None:
                await self.handoffs.handed(flight, msg.worker_id, out.handoff)
            elif out.handoff is not None:  # the chain ended in an error
                self.on_handoff(out.handoff)
            if out.finish_reason is not None:
                w = self.registry.get(msg.worker_id)
                if w is not None:
                    w.in_flight.discard(out.request_id)

    # --- migration -----------------------------------------------------------------------------
    def find(self, key: str) -> Flight | None:
        """A request in flight by its id."""
        return self._flights.get(key)

    def _migrate(self, request_id: str, to: int | None, reason: MigrationReason) -> Awaitable[MigrationRecord]:
        return self.starts.migrate(request_id, to, reason)  # (built after the parts that are given this)

    def _owned(self, worker_id: int) -> list[Flight]:
        return [f for f in self._flights.values() if f.mark.owner == worker_id and not f.mark.moving]

    def _ended(self, record: MigrationRecord | None) -> None:
        if record is not None and record.done:
            self.on_migration(record)

    # --- failure -------------------------------------------------------------------------------
    def _spawn(self, coro: object) -> None:
        self._tasks = [t for t in self._tasks if not t.done()]
        self._tasks.append(asyncio.ensure_future(coro))  # type: ignore[arg-type]
