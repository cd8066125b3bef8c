"""The router's I/O with its workers: send requests over ZeroMQ, route outputs back to each caller.

One PULL socket receives every worker's outputs and status reports, and the supervisor's notices of
workers dying and joining; one PUSH socket per worker sends requests. The decisions are the parts':
the registry (who the workers are and how they have been), the watermark (what a client has been
given, and whether an output goes on to it), placement (which worker takes a request), recovery
(moving a dead worker's requests) and resumption (a reconnecting client). A caller iterates
`generate()`; leaving early (client gone) aborts the request on its owner.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import msgspec
import zmq
import zmq.asyncio

from steadfast import protocol
from steadfast.cluster_keys import ClusterKeys, as_client, as_server, guard
from steadfast.config import HealthConfig, MigrationConfig, RoutingConfig, SchedulerConfig, TakeoverConfig
from steadfast.control.delivery import Flight, Verdict, Watermark
from steadfast.control.health import HealthMonitor
from steadfast.control.maintenance import Maintenance
from steadfast.control.migration import (
    MIGRATION_ROLES,
    MigrationError,
    MigrationMode,
    MigrationReason,
    MigrationRecord,
    Migrations,
)
from steadfast.control.placement import DECODE_ROLES, SERVE_ROLES, Placement
from steadfast.control.recovery import Recovery, Takeover
from steadfast.control.resume import Known, Resumption, Turns
from steadfast.control.routing import Router
from steadfast.control.timeline import EventKind, Timeline
from steadfast.control.workers import Liveness, WorkerHandle, WorkerRegistry
from steadfast.ipc import MAX_MESSAGE_BYTES, about
from steadfast.protocol import (
    AbortRequest,
    AddRequest,
    CacheEvents,
    Fallback,
    FinishReason,
    Handoff,
    Migrate,
    Ping,
    Priority,
    Promote,
    RequestOutput,
    Resume,
    StepOutputs,
    WorkerDied,
    WorkerJoined,
    WorkerRole,
    WorkerState,
    WorkerStatus,
)

log = logging.getLogger(__name__)


# The error a stream ends with when its client resumed it on another connection (a newer resume).
RESUMED_ELSEWHERE = "this stream was resumed on another connection"
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """No worker can take the request, or the worker serving it died."""


class Quiet:
    """How long a request's caller has had nothing: each wait lasts at most `every_s` (then it may send
    a keep-alive) and none goes past `limit_s` since the last output."""

    def __init__(self, every_s: float | None, limit_s: float) -> None:
        self.every_s, self.limit_s = every_s, limit_s
        self.since = time.monotonic()

    def heard(self) -> None:
        self.since = time.monotonic()

    @property
    def over(self) -> bool:
        return time.monotonic() - self.since >= self.limit_s

    async def wait(self, ask: Callable[[], Awaitable[T]]) -> T | None:
        """`ask()`'s result, or None when this wait's time is up first. `ask` is called again on the next
        wait, so it must lose nothing when cancelled (a queue's get, a lock's acquire)."""
        left = self.limit_s - (time.monotonic() - self.since)
        if self.every_s is not None:
            left = min(left, self.every_s)
        if left <= 0:
            return None
        try:
            async with asyncio.timeout(left):
                return await ask()
        except TimeoutError:
            return None


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
        keys: ClusterKeys | None = None,
    ) -> None:
        """`workers`: (id, input address, role) of each worker. `ledger_urls`: each node's ledger,
        where a restarted router finds requests it never saw (to resume them for reconnecting clients).
        `keys`: a router part's, whose workers are on other hosts: every queue is CURVE over TCP."""
        self.ctx = zmq.asyncio.Context()
        self.output_address = output_address
        self.status_interval_s = status_interval_s
        self.request_timeout_s = request_timeout_s
        takeover = takeover or TakeoverConfig()
        self._keys = keys
        self._auth = guard(self.ctx, keys) if keys is not None else None  # (before anything binds)
        self._pull = self.ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        if keys is not None:
            as_server(self._pull, keys)
        self._pull.bind(output_address)
        self.registry = WorkerRegistry()
        self._socks: dict[int, zmq.asyncio.Socket] = {}
        for worker_id, address, role in workers:
            self._add_worker(worker_id, address, role)
        self.health = HealthMonitor(health or HealthConfig())
        self.router = Router(routing or RoutingConfig(), scheduler or SchedulerConfig(), block_size)
        self.placement = Placement(self.registry, takeover, max_in_flight, self.router, self.health)
        self._health_moved: dict[str, float] = {}  # request id → when it was last moved for health
        self._probes = 0
        self.recovery = Recovery(takeover, self.placement, self._choose, self._send)
        self.resumption_records = Resumption(idempotency_window_s, ledger_urls)
        self.turns = Turns()  # resumes of one request one at a time, the newest winning
        # A stream with no output this long ends with an error: past every bound of the router's own (a
        # stalled request moved at `request_timeout`, the move's `wait_timeout`, `request_timeout` more on
        # its new worker), so it only ends what nothing else would (a wait no part of the router watches).
        self.idle_limit_s = 2 * request_timeout_s + takeover.wait_timeout
        self._flights: dict[str, Flight] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self.migrations = Migrations(migration or MigrationConfig(), self.registry, block_size)
        # The supervisor, asked for new workers by a rollout (absent: a router started by hand).
        to_supervisor: zmq.asyncio.Socket | None = None
        if supervisor:
            to_supervisor = self.ctx.socket(zmq.PUSH)
            to_supervisor.setsockopt(zmq.LINGER, 0)
            to_supervisor.connect(supervisor)
        self.timeline = Timeline()  # joins, deaths, retirements, drains, rollouts (control/timeline.py)
        self.maintenance = Maintenance(
            self.registry, self.migrations, self._owned, self.migrate, self._send, self._spawn, to_supervisor
        )
        self.maintenance.timeline = self.timeline
        self.on_handoff: Callable[[Handoff], None] | None = None  # metrics hook
        self.on_migration: Callable[[MigrationRecord], None] | None = None  # metrics hook: one that ended

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

    async def broadcast(self, message: msgspec.Struct) -> None:
        """Send `message` to every worker not dead (standbys and draining ones too)."""
        for w in [w for w in self.registry if not w.dead]:
            await self._send(w, message)

    def end_all(self, why: str) -> int:
        """End every stream in flight with an error event saying `why` (shutdown past its timeout); the
        requests are aborted on their workers as each stream closes. Returns how many were ended."""
        flights = list(self._flights.values())
        for flight in flights:
            rid = flight.add.request_id
            flight.queue.put_nowait(RequestOutput(rid, [], finish_reason=FinishReason.ERROR, error=why))
        return len(flights)

    def _add_worker(self, worker_id: int, address: str, role: WorkerRole) -> WorkerHandle:
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        if self._keys is not None:
            as_client(sock, self._keys)
        sock.connect(address)
        self._socks[worker_id] = sock
        return self.registry.add(worker_id, address, role)

    def _drop_worker(self, worker_id: int) -> None:
        self.registry.remove(worker_id)
        sock = self._socks.pop(worker_id, None)
        if sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                sock.close(linger=0)

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._watch())]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if self._auth is not None:
            self._auth.stop()
        self.ctx.destroy(linger=0)

    async def notice(self, msg: WorkerDied | WorkerJoined) -> None:
        """A supervisor's news that came another way than the output socket (a node's record in etcd)."""
        await self._handle(msg)

    async def _send(self, worker: WorkerHandle, message: msgspec.Struct) -> bool:
        """Send to a worker; False (logged) when its socket is gone or refuses."""
        sock = self._socks.get(worker.worker_id)
        if sock is None:
            log.warning("worker %d has no socket: %s not sent", worker.worker_id, type(message).__name__)
            return False
        try:
            await sock.send(protocol.encode(message))
        except zmq.ZMQError as exc:
            log.warning("worker %d: %s not sent (%s)", worker.worker_id, type(message).__name__, exc)
            return False
        return True

    # --- placement -----------------------------------------------------------------------------
    async def _choose(
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
            await self._promote(worker, roles[0])
        return worker

    async def _promote(self, w: WorkerHandle, role: WorkerRole) -> None:
        log.warning("promoting standby worker %d to take traffic as %s", w.worker_id, role)
        self.registry.promote(w, role)
        # The worker reports its new role from now on, so a restarted router learns it too.
        await self._send(w, Promote(role))

    async def _choose_with_room(self, request: AddRequest) -> WorkerHandle | None:
        """A worker for a new request, waiting a bounded time while none has room (ramping or at its
        reserve); then the least loaded takes it anyway: an accepted request is never turned away."""
        deadline = time.monotonic() + self.placement.room_wait_s
        worker = await self._choose(request=request)
        while worker is not None and not self.placement.has_room(worker) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
            worker = await self._choose(request=request)
        return worker

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
            worker = await self._choose_with_room(request)
        if worker is None:
            raise EngineDeadError("no worker is ready")
        rid = request.request_id
        mark = Watermark(worker.worker_id, skip_until=skip_until)
        if request.resume is not None:
            mark.delivered = list(request.resume.output_ids)
            mark.text_chars = request.resume.text_chars
        flight = Flight(request, asyncio.Queue(), mark)
        if request.resume is None:
            flight.cached = self.router.cached_on(worker.worker_id, request.prompt_ids)
        self._flights[rid] = flight
        self.resumption_records.forget(rid)
        worker.in_flight.add(rid)
        try:
            sent = await self._send(worker, request)
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
            stale = self.registry.get(known.owner)
            if stale is not None:  # it may still run where it was, for nobody: stop it there
                stale.in_flight.discard(rid)
                await self.abort(stale, rid)
        assert request.resume is not None
        request = Resumption.request(known, skip_until, request.resume.text_chars)
        return await self._open(request, skip_until)

    def _given_up(self, rid: str, quiet: Quiet) -> RequestOutput:
        why = f"the request had no output for {quiet.limit_s:.0f}s: given up"
        log.error("request %s: %s", rid, why, extra=about(rid))
        return RequestOutput(rid, [], finish_reason=FinishReason.ERROR, error=why)

    async def abort(self, worker: WorkerHandle, request_id: str) -> None:
        await self._send(worker, AbortRequest([request_id]))

    # --- outputs -------------------------------------------------------------------------------
    async def _receive(self) -> None:
        while True:
            data = await self._pull.recv()
            try:
                await self._handle(protocol.decode_from_worker(data))
            except Exception:  # one bad message must not stop the router hearing its workers
                log.exception("failed to handle a message from a worker or the supervisor")

    async def _handle(self, msg: protocol.FromWorker) -> None:
        if isinstance(msg, StepOutputs):
            await self._deliver(msg)
        elif isinstance(msg, CacheEvents):
            if self.registry.get(msg.worker_id) is not None:
                self.router.index.apply(msg)
        elif isinstance(msg, WorkerStatus):
            w = self.registry.observe(msg)  # (ignored from a worker already declared dead, or not announced)
            if w is not None and msg.state == WorkerState.STOPPING and not self.maintenance.draining(w.worker_id):
                self.maintenance.drain(w.worker_id)  # it was told to stop (SIGTERM): its requests move first
        elif isinstance(msg, WorkerDied):
            w = self.registry.get(msg.worker_id)
            if w is not None and not w.dead:
                moving = sum(1 for f in self._flights.values() if f.mark.owner == msg.worker_id)
                if msg.exit_code == 0:
                    log.info("worker %d (pid %d) retired", msg.worker_id, msg.pid)
                    self.timeline.note(EventKind.RETIRE, f"worker {msg.worker_id} retired", worker=msg.worker_id)
                else:
                    log.error("worker %d (pid %d) died with code %d", msg.worker_id, msg.pid, msg.exit_code)
                    why = f"pid {msg.pid} exit code {msg.exit_code}; lease fenced, {moving} request(s) to take over"
                    self.timeline.note(EventKind.CRASH, f"worker {msg.worker_id} died", why, msg.worker_id)
                await self._lost(w)
        elif self.registry.get(msg.worker_id) is None:  # WorkerJoined
            log.info("worker %d joined as %s at %s", msg.worker_id, msg.role, msg.address)
            why = f"replacing worker {msg.like}" if msg.like >= 0 else ""
            self.timeline.note(EventKind.JOIN, f"worker {msg.worker_id} joined as {msg.role}", why, msg.worker_id)
            w = self._add_worker(msg.worker_id, msg.address, msg.role)
            w.joining = True
            if msg.like >= 0:
                self.maintenance.joined(msg.worker_id, msg.like)

    async def _deliver(self, msg: StepOutputs) -> None:
        self.registry.seen(msg.worker_id)
        for out in msg.outputs:
            flight = self._flights.get(out.request_id)
            if flight is None:
                continue  # finished or aborted
            if out.handoff is not None and out.handoff.migration:
                await self._migrated(flight, msg.worker_id, out.handoff)
                continue
            verdict = flight.mark.accept(out, msg.worker_id)
            if verdict is Verdict.MISMATCH:
                self.migrations.mismatches += 1
                log.error(
                    "request %s: token %d differs between its old and new owner",
                    out.request_id,
                    out.index,
                    extra=about(out.request_id),
                )
            if verdict in (Verdict.DUPLICATE, Verdict.GAP):
                log.warning(
                    "request %s: dropped output at index %d, client has %d tokens",
                    out.request_id,
                    out.index,
                    len(flight.mark.delivered),
                )
            if not verdict.accepted:
                continue
            failed = out.retryable and out.finish_reason is FinishReason.ERROR
            if failed and await self._retry(flight, msg.worker_id, out):
                continue
            now = time.monotonic()
            if out.token_ids:
                stamp = msg.at or now
                if flight.last_worker == msg.worker_id:
                    self.health.token_gap(msg.worker_id, out.request_id, stamp - flight.last_stamp, now)
                flight.last_token, flight.last_stamp, flight.last_worker = now, stamp, msg.worker_id
                if (source := self.registry.get(msg.worker_id)) is not None:
                    source.last_token_at = now
                self.health.answered(msg.worker_id, out.request_id, now, time.time())
            flight.progress = now
            self.recovery.answered(out)
            if out.token_ids and self.migrations.active(out.request_id) is not None:  # its first token there
                self._ended(self.migrations.resumed(out.request_id, out.resumed_at, flight.progress))
            if verdict is Verdict.FORWARD:
                flight.queue.put_nowait(out)
            if out.handoff is not None and out.finish_reason is None:
                await self._handed(flight, msg.worker_id, out.handoff)
            elif out.handoff is not None and self.on_handoff is not None:  # the chain ended in an error
                self.on_handoff(out.handoff)
            if out.finish_reason is not None:
                w = self.registry.get(msg.worker_id)
                if w is not None:
                    w.in_flight.discard(out.request_id)

    async def _handed(self, flight: Flight, from_worker: int, h: Handoff) -> None:
        """A prefill worker handed a request's KV to a decode worker (or could not): send it there."""
        rid = flight.add.request_id
        if self.on_handoff is not None:
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
            self._spawn(self.recovery.move(flight, h.to_worker, self._wanted(flight)))
            return
        target.in_flight.add(rid)
        add, mark = flight.add, flight.mark
        resume = Resume(list(mark.delivered), mark.text_chars, from_worker)
        handed = AddRequest(
            rid, add.prompt_ids, add.params, add.priority, resume=resume, handoff=None if h.error else h
        )
        # Awaited here, before the next message is handled, so an abort of this request cannot overtake it.
        await self._send(target, handed)

    # --- migration -----------------------------------------------------------------------------
    def find(self, key: str) -> Flight | None:
        """A request in flight by its id."""
        return self._flights.get(key)

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
        flight = self._flights.get(request_id)
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
                    await self._promote(target, source.role if source.role in MIGRATION_ROLES else WorkerRole.MIXED)
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
        if not await self._send(source, ask):
            self._ended(self.migrations.answered(request_id, Handoff(target.worker_id, error="not sent"), 0.0))
        return record

    async def _recompute_at(
        self, flight: Flight, source: WorkerHandle, target: WorkerHandle, reason: MigrationReason
    ) -> MigrationRecord:
        rid, mark = flight.add.request_id, flight.mark
        record = self.migrations.begin(flight, source.worker_id, target.worker_id, reason)
        self.migrations.recomputing(rid, flight.progress)
        source.in_flight.discard(rid)
        await self.abort(source, rid)  # its outputs still on the way are the old owner's: never resent
        mark.hand_to(target.worker_id)
        target.in_flight.add(rid)
        add = flight.add
        resume = Resume(list(mark.delivered), mark.text_chars, source.worker_id)
        await self._send(target, AddRequest(rid, add.prompt_ids, add.params, add.priority, resume=resume))
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

    async def _migrated(self, flight: Flight, from_worker: int, h: Handoff) -> None:
        """The source's answer to a Migrate: the KV went (deliver from the destination on), or it stayed."""
        rid = flight.add.request_id
        record = self.migrations.answered(rid, h, flight.progress)
        if from_worker != flight.mark.owner or flight.mark.moving:
            return  # no longer its request (recovered meanwhile): nothing moved that counts
        if h.error:
            log.info(
                "request %s: not migrated from %d to %d (%s)", rid, from_worker, h.to_worker, h.error, extra=about(rid)
            )
            self._ended(record)
            return
        log.info(
            "request %s migrated from %d to %d at token %d", rid, from_worker, h.to_worker, len(flight.mark.delivered)
        )
        await self._switch(flight, from_worker, h)

    def _wanted(self, flight: Flight) -> Callable[[], bool]:
        """Whether `flight` still streams to a client: not ended, nor taken over by a resume of it."""
        rid = flight.add.request_id
        return lambda: self._flights.get(rid) is flight

    def _owned(self, worker_id: int) -> list[Flight]:
        return [f for f in self._flights.values() if f.mark.owner == worker_id and not f.mark.moving]

    def _ended(self, record: MigrationRecord | None) -> None:
        if record is not None and record.done and self.on_migration is not None:
            self.on_migration(record)

    # --- failure -------------------------------------------------------------------------------
    def _spawn(self, coro: object) -> None:
        self._tasks = [t for t in self._tasks if not t.done()]
        self._tasks.append(asyncio.ensure_future(coro))  # type: ignore[arg-type]

    async def _watch(self) -> None:
        """Take a worker that stops reporting out of rotation for new requests until it reports again:
        past the silence limit it is SUSPECT and probed once more (`Ping`), SILENT when that goes
        unanswered too (the second probe: one late report does not make a worker silent).

        Its requests stay where they are: a silent worker may only be slow. Requests move when its
        death is certain: the supervisor reaps it (a hung worker's lease expires, the pool fences it,
        the supervisor kills the fenced process) and says so with WorkerDied. Each round also runs the
        health check (`_health_round`) and moves stalled requests.
        """
        limit = max(5 * self.status_interval_s, 3.0)
        probe = max(2 * self.status_interval_s, 1.0)
        next_health = 0.0
        while True:
            await asyncio.sleep(min(self.status_interval_s, self.health.cfg.interval_s))
            if self._behind():
                continue  # reports are waiting unread: the silence is the router's, not the workers'
            suspect, silent = self.registry.sweep_silent(limit, probe)
            for w in suspect:
                self._probes += 1
                log.warning("worker %d quiet for %.1fs: probing it", w.worker_id, limit)
                await self._send(w, Ping(self._probes))
            for w in silent:
                log.error("worker %d silent, probe unanswered: no new requests until it reports", w.worker_id)
            now = time.monotonic()
            if now >= next_health:
                next_health = now + self.health.cfg.interval_s
                await self._health_round(now)
            await self._move_stalled(now)
            self.resumption_records.expire(now)

    async def _health_round(self, now: float) -> None:
        """Sample every worker, score it, and act: a degraded worker's lowest-priority, least recently
        active requests migrate to the least loaded healthy worker with room (not moved again within
        the request cooldown); a sick worker's requests are retried elsewhere."""
        waiting: dict[int, dict[str, float]] = {}
        for rid, f in self._flights.items():
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
                    if not await self._retry(flight, w.worker_id, None):
                        await self._move_off(flight, f"its worker {w.worker_id} is sick and no other could take it")
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

    async def _retry(self, flight: Flight, worker_id: int, out: RequestOutput | None) -> bool:
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
        await self._move_off(flight, f"it failed on worker {worker_id} and no other worker could take it")
        return True

    async def _move_off(self, flight: Flight, why: str) -> None:
        """Take a request off its live owner (told to drop it) and resume it on another worker."""
        mark, rid = flight.mark, flight.add.request_id
        owner = self.registry.get(mark.owner)
        flight.progress = time.monotonic()
        mark.moving = True
        roles, node = SERVE_ROLES, ""
        if owner is not None:
            owner.in_flight.discard(rid)
            await self.abort(owner, rid)
            roles = SERVE_ROLES if owner.role in (WorkerRole.MIXED, WorkerRole.PREFILL) else DECODE_ROLES
            node = owner.node
        self._spawn(self.recovery.move(flight, mark.owner, self._wanted(flight), roles, node, why))

    async def _move_stalled(self, now: float) -> None:
        """A request that received no token for `request_timeout` (sooner, after the health check's
        `stall_s`, a decoding one on a worker that reports but produced no token at all since) moves to
        another worker (its own is told to drop it), or fails with an error saying so when none can take
        it within the wait. Such a stall counts against its worker."""
        stall = self.health.cfg.stall_s if self.health.cfg.enabled else self.request_timeout_s
        for flight in list(self._flights.values()):
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
            await self._move_off(flight, f"it received no token for {quiet:.0f}s and no other worker could take it")

    def _behind(self) -> bool:
        """Messages wait on the output socket: a starved router (niced, on a loaded machine) has not
        read what its workers sent, so how long it last heard from one says nothing of the worker."""
        try:
            return bool(self._pull.get(zmq.EVENTS) & zmq.POLLIN)
        except zmq.ZMQError:
            return False

    async def _lost(self, w: WorkerHandle) -> None:
        """Stop listening to a worker and move each of its requests, high priority first."""
        w.liveness = Liveness.DEAD
        self.health.forget(w.worker_id)
        self.router.index.forget(w.worker_id)
        for record in self.migrations.lost(w.worker_id, f"worker {w.worker_id} died"):
            self._ended(record)
        role, node = w.role, w.node
        moving = sorted(
            (f for f in self._flights.values() if f.mark.owner == w.worker_id), key=lambda f: f.add.priority
        )
        w.in_flight.clear()
        roles = SERVE_ROLES if role == WorkerRole.MIXED else DECODE_ROLES
        for flight in moving:
            flight.mark.moving = True
            rid = flight.add.request_id
            self.recovery.forget(rid)  # moved to this worker, which died before answering: free the slot
            self._spawn(self.recovery.move(flight, w.worker_id, self._wanted(flight), roles, node))
        # The last worker of its role: a standby (of its node, if there is one) steps into it.
        if role != WorkerRole.STANDBY and not any(x.role == role and not x.dead for x in self.registry):
            standby = self.placement.standby(node)
            if standby is not None:
                await self._promote(standby, role)
        self._drop_worker(w.worker_id)
