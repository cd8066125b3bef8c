"""The router's view of its workers: send requests over ZeroMQ, route outputs back to each caller, and
move a dead worker's requests to a live one without the caller noticing.

One PULL socket receives every worker's outputs and status reports, and the supervisor's notices of
workers dying and joining; one PUSH socket per worker sends requests. For each request in flight the
router keeps what its client has been given (token ids, characters of text): that record, not any
worker's, decides what is sent next. An output is forwarded only if it comes from the request's current
owner and carries exactly the next token index, so after a takeover no token is sent twice and none is
skipped. A caller iterates `generate()`; leaving early (client gone) aborts the request on its owner.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from steadfast import protocol
from steadfast.config import TakeoverConfig
from steadfast.protocol import (
    AbortRequest,
    AddRequest,
    Handoff,
    Promote,
    RequestOutput,
    Resume,
    SamplingParams,
    StepOutputs,
    WorkerDied,
    WorkerJoined,
    WorkerStatus,
)

log = logging.getLogger(__name__)


# Roles that serve a request start to end, in order of preference (a decode worker computes the prompt
# itself when no prefill worker can); a dead decode worker's requests go to another decode worker first.
SERVE_ROLES = ("mixed", "decode", "prefill")
DECODE_ROLES = ("decode", "mixed", "prefill")


class EngineDeadError(RuntimeError):
    """No worker can take the request, or the worker serving it died."""


@dataclass
class WorkerHandle:
    worker_id: int
    address: str
    sock: zmq.asyncio.Socket
    role: str = "mixed"  # "mixed" takes traffic; "standby" waits to take over a dead worker's
    status: WorkerStatus | None = None
    last_seen: float = 0.0
    dead: bool = False
    unresponsive: bool = False  # silent past the limit: no new requests until it reports again
    promoted_at: float | None = None  # when a standby started taking traffic (its warm-up ramp)
    in_flight: set[str] = field(default_factory=set)

    @property
    def ready(self) -> bool:
        return not self.dead and not self.unresponsive and self.status is not None and self.status.state == "ready"

    @property
    def active(self) -> bool:
        return self.role != "standby"

    @property
    def node(self) -> str:
        return self.status.node if self.status is not None else ""

    @property
    def load(self) -> int:
        # Requests the router sent that the worker has not finished, whatever its last report says.
        return len(self.in_flight)


@dataclass
class Flight:
    """One request in flight and what its client has received."""

    add: AddRequest
    queue: asyncio.Queue[RequestOutput]
    owner: int
    delivered: list[int] = field(default_factory=list)
    text_chars: int = 0
    moving: bool = False  # being taken over: no owner answers for it right now
    skip_until: int = 0  # the client already holds tokens below this index: regenerated, not resent


@dataclass
class Retired:
    """A request no longer streaming (finished, or its client left), kept for a reconnect."""

    add: AddRequest
    delivered: list[int]
    owner: int
    until: float  # monotonic deadline of the idempotency window


class UnknownRequestError(KeyError):
    """A Last-Event-ID names a request this router does not know (never, or no longer)."""


@dataclass
class Takeover:
    """A record of one request moved off a dead worker (exposed at /admin/takeovers)."""

    request_id: str
    from_worker: int
    to_worker: int
    at_token: int
    started: float
    first_token_s: float | None = None
    route: str = ""
    adopted_tokens: int = 0
    recomputed_tokens: int = 0
    answered: asyncio.Event = field(default_factory=asyncio.Event)  # the new owner's first output came


class EngineClient:
    def __init__(
        self,
        workers: list[tuple[int, str, str]],
        output_address: str,
        status_interval_s: float,
        takeover: TakeoverConfig | None = None,
        idempotency_window_s: float = 60.0,
        ledger_paths: list[str] | tuple[str, ...] = (),
        max_in_flight: int = 128,
    ) -> None:
        """`workers`: (id, input address, role) of each worker. `ledger_paths`: each node's ledger,
        where a restarted router finds requests it never saw (to resume them for reconnecting clients)."""
        self.ctx = zmq.asyncio.Context()
        self.output_address = output_address
        self.status_interval_s = status_interval_s
        self.takeover_cfg = takeover or TakeoverConfig()
        self._pull = self.ctx.socket(zmq.PULL)
        self._pull.bind(output_address)
        self._workers: dict[int, WorkerHandle] = {}
        for worker_id, address, role in workers:
            self._add_worker(worker_id, address, role)
        self._flights: dict[str, Flight] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._moves = asyncio.Semaphore(self.takeover_cfg.max_concurrent)
        self.takeovers: list[Takeover] = []
        self._pending_takeover: dict[str, Takeover] = {}
        self.window_s = idempotency_window_s
        self.max_in_flight = max_in_flight
        self._retired: dict[str, Retired] = {}
        self.ledger_paths = list(ledger_paths)
        self.on_handoff: Callable[[Handoff], None] | None = None  # metrics hook

    @property
    def workers(self) -> list[WorkerHandle]:
        return list(self._workers.values())

    def _add_worker(self, worker_id: int, address: str, role: str) -> WorkerHandle:
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        handle = WorkerHandle(worker_id, address, sock, role)
        self._workers[worker_id] = handle
        return handle

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._watch())]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self.ctx.destroy(linger=0)

    @property
    def ready(self) -> bool:
        """Every worker taking traffic is ready, and there is at least one (standbys may be loading)."""
        active = [w for w in self._workers.values() if w.active and not w.dead]
        return bool(active) and all(w.ready for w in active)

    def _pick(self, exclude: int = -1, roles: tuple[str, ...] = SERVE_ROLES, node: str = "") -> WorkerHandle | None:
        """The least loaded ready worker of the first of `roles` that has one, on `node` if one is
        there (a dead worker's KV is adoptable only on its own node); when none has, a standby (of
        `node` first) is promoted to `roles[0]`."""
        live = [w for w in self._workers.values() if w.ready and w.worker_id != exclude]
        for role in roles:
            candidates = [w for w in live if w.role == role]
            if candidates:
                return min(candidates, key=lambda w: (bool(node) and w.node != node, w.load, w.worker_id))
        standby = self._standby(live, node)
        if standby is not None:
            self._promote(standby, roles[0])
        return standby

    @staticmethod
    def _standby(live: list[WorkerHandle], node: str) -> WorkerHandle | None:
        standbys = [w for w in live if w.role == "standby"]
        return min(standbys, key=lambda w: (bool(node) and w.node != node, w.worker_id), default=None)

    def _pick_decode(self) -> WorkerHandle | None:
        """Where a prefilled request decodes: a decode worker with room, by load then KV in use."""
        live = [w for w in self._workers.values() if w.ready and w.role == "decode"]

        def key(w: WorkerHandle) -> tuple[bool, int, float]:
            s = w.status
            used = s.kv_blocks_used / s.kv_blocks_total if s is not None and s.kv_blocks_total else 0.0
            return (not self.has_room(w), w.load, used)

        return min(live, key=key, default=None)

    def has_room(self, w: WorkerHandle, now: float | None = None) -> bool:
        """Whether `w` may take one more new request: it keeps its KV reserve for takeovers, and a
        promoted standby ramps its limit up linearly from 1 over the warm-up period instead of taking
        a full share of load at once."""
        s = w.status
        if s is not None and s.kv_blocks_total:
            if s.kv_blocks_used >= (1 - self.takeover_cfg.reserve_fraction) * s.kv_blocks_total:
                return False
        warmup = self.takeover_cfg.warmup
        if w.promoted_at is None or warmup <= 0:
            return True
        elapsed = (time.monotonic() if now is None else now) - w.promoted_at
        if elapsed >= warmup:
            return True
        return w.load < max(1, int(self.max_in_flight * elapsed / warmup))

    async def _pick_with_room(self) -> WorkerHandle | None:
        """A worker for a new request, waiting a bounded time while none has room (ramping or at its
        reserve); then the least loaded takes it anyway: an accepted request is never turned away."""
        deadline = time.monotonic() + max(self.takeover_cfg.warmup, self.takeover_cfg.reserve_wait)
        worker = self._pick()
        while worker is not None and not self.has_room(worker) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
            worker = self._pick()
        return worker

    def _promote(self, w: WorkerHandle, role: str = "mixed") -> None:
        log.warning("promoting standby worker %d to take traffic as %s", w.worker_id, role)
        w.role = role
        w.promoted_at = time.monotonic()
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no event loop (unit tests): nobody to tell
            return
        # The worker reports its new role from now on, so a restarted router learns it too.
        asyncio.ensure_future(w.sock.send(protocol.encode(Promote(role))))

    async def generate(self, request: AddRequest, skip_until: int = 0) -> AsyncIterator[RequestOutput]:
        """Outputs of one request, in order, ending with the one that carries a finish_reason.

        A request with `resume` continues from its tokens; outputs below `skip_until` (tokens its
        client already holds) are swallowed.
        """
        worker = None
        if request.resume is None:  # disaggregated: prefill here, then decode on a worker chosen now
            prefill = self._pick(roles=("prefill",)) if self._has_role("prefill") else None
            decode = self._pick_decode() if prefill is not None else None
            if prefill is not None and decode is not None:
                worker, request.decode_worker = prefill, decode.worker_id
                p, d = prefill.status, decode.status
                if p is not None and d is not None and p.node != d.node:  # another node: stream the KV there
                    request.kv_paths = list(d.kv_addresses)
        if worker is None:
            worker = await self._pick_with_room()
        if worker is None:
            raise EngineDeadError("no worker is ready")
        rid = request.request_id
        flight = Flight(request, asyncio.Queue(), worker.worker_id, skip_until=skip_until)
        if request.resume is not None:
            flight.delivered = list(request.resume.output_ids)
            flight.text_chars = request.resume.text_chars
        self._flights[rid] = flight
        self._retired.pop(rid, None)
        worker.in_flight.add(rid)
        finished = False
        try:
            await worker.sock.send(protocol.encode(request))
            while True:
                out = await flight.queue.get()
                finished = out.finish_reason is not None
                yield out
                if finished:
                    return
        finally:
            # Unless a reconnect already took the request over (and stopped this run of it).
            if self._flights.get(rid) is flight:
                del self._flights[rid]
                self._retire(flight)
                owner = self._workers.get(flight.owner)
                if owner is not None:
                    owner.in_flight.discard(rid)
                    if not finished and not owner.dead:
                        await self.abort(owner, rid)

    def _has_role(self, role: str) -> bool:
        return any(w.role == role and w.ready for w in self._workers.values())

    def _retire(self, flight: Flight) -> None:
        now = time.monotonic()
        for rid in [r for r, x in self._retired.items() if x.until < now]:
            del self._retired[rid]
        add = flight.add
        self._retired[add.request_id] = Retired(add, flight.delivered, flight.owner, now + self.window_s)

    async def resumption(self, request_id: str, have_tokens: int, have_chars: int) -> tuple[AddRequest, int]:
        """The request to send so a client holding `have_tokens` tokens (`have_chars` characters of
        text) continues where it is, and the index below which outputs are not resent.

        The router's own record when it has one (a dropped connection); else the ledger's last
        checkpoint (the router restarted). What the record lacks is regenerated (fixed seed per
        token index), never resent. Raises UnknownRequestError when neither knows the request.
        """
        live = self._flights.pop(request_id, None)
        if live is not None:  # the old stream's handler has not noticed its client left yet
            self._retire(live)
            owner = self._workers.get(live.owner)
            if owner is not None:
                owner.in_flight.discard(request_id)
                await self.abort(owner, request_id)
        known = self._retired.get(request_id)
        if known is not None and known.until >= time.monotonic():
            add, tokens = known.add, known.delivered
        else:
            add, tokens, owner_id = self._from_ledger(request_id)
            owner = self._workers.get(owner_id)
            if owner is not None:  # it may still run where it was, for nobody: stop it there
                await self.abort(owner, request_id)
        base = tokens[:have_tokens]
        resume = Resume(list(base), have_chars)
        return AddRequest(request_id, add.prompt_ids, add.params, add.priority, resume=resume), have_tokens

    def _from_ledger(self, request_id: str) -> tuple[AddRequest, list[int], int]:
        """The request's newest checkpoint among the nodes' ledgers (a request decoded on another
        node than its prefill left a row there too, until the prefill worker let it go)."""
        from steadfast.kv.sqlite_ledger import SqliteLedger  # only a restarted router reads the ledger

        best = None
        for path in self.ledger_paths:
            ledger = SqliteLedger(path)
            try:
                ck = ledger.request(request_id)
            finally:
                ledger.close()
            if ck is not None and (best is None or len(ck.generated_ids) > len(best.generated_ids)):
                best = ck
        if best is None:
            raise UnknownRequestError(request_id)
        params = msgspec.json.decode(best.params, type=SamplingParams)
        owner = int(best.owner.removeprefix("worker")) if (best.owner or "").startswith("worker") else -1
        return AddRequest(request_id, best.prompt_ids, params), list(best.generated_ids), owner

    async def abort(self, worker: WorkerHandle, request_id: str) -> None:
        with contextlib.suppress(zmq.ZMQError):
            await worker.sock.send(protocol.encode(AbortRequest([request_id])))

    # --- outputs -------------------------------------------------------------------------------
    async def _receive(self) -> None:
        while True:
            data = await self._pull.recv()
            try:
                self._handle(protocol.decode_from_worker(data))
            except Exception:  # one bad message must not stop the router hearing its workers
                log.exception("failed to handle a message from a worker or the supervisor")

    def _handle(self, msg: StepOutputs | WorkerStatus | WorkerDied | WorkerJoined) -> None:
        if isinstance(msg, StepOutputs):
            self._deliver(msg)
        elif isinstance(msg, WorkerStatus):
            w = self._workers.get(msg.worker_id)
            if w is None:
                return  # a worker already declared dead, or not announced yet
            if w.status is None and w.role != msg.role:
                w.role = msg.role  # a restarted router learns who was promoted from the workers
            w.status, w.last_seen = msg, time.monotonic()
        elif isinstance(msg, WorkerDied):
            w = self._workers.get(msg.worker_id)
            if w is not None and not w.dead:
                log.error("worker %d (pid %d) died with code %d", msg.worker_id, msg.pid, msg.exit_code)
                self._lost(w)
        elif msg.worker_id not in self._workers:  # WorkerJoined
            log.info("worker %d joined as %s at %s", msg.worker_id, msg.role, msg.address)
            self._add_worker(msg.worker_id, msg.address, msg.role)

    def _deliver(self, msg: StepOutputs) -> None:
        w = self._workers.get(msg.worker_id)
        if w is not None:
            w.last_seen = time.monotonic()
        for out in msg.outputs:
            flight = self._flights.get(out.request_id)
            if flight is None or flight.owner != msg.worker_id or flight.moving:
                continue  # finished, aborted, or from a worker that no longer owns it (dead, fenced)
            if out.token_ids and out.index != len(flight.delivered):
                # Exactly once, in order: a token already given to the client is never given again.
                log.warning(
                    "request %s: dropped output at index %d, client has %d tokens",
                    out.request_id,
                    out.index,
                    len(flight.delivered),
                )
                continue
            flight.delivered.extend(out.token_ids)
            if out.request_id in self._pending_takeover:
                self._record_takeover(out)
            if out.token_ids and out.index < flight.skip_until and not out.finish_reason:
                continue  # regenerated: the client has these tokens already
            flight.text_chars += len(out.text)
            if out.token_ids or out.text or out.finish_reason is not None:
                flight.queue.put_nowait(out)  # (a transfer's outcome alone carries nothing for the client)
            if out.handoff is not None and out.finish_reason is None:
                self._handed(flight, msg.worker_id, out.handoff)
            elif out.handoff is not None and self.on_handoff is not None:  # the chain ended in an error
                self.on_handoff(out.handoff)
            if out.finish_reason is not None and w is not None:
                w.in_flight.discard(out.request_id)

    def _handed(self, flight: Flight, from_worker: int, h: Handoff) -> None:
        """A prefill worker handed a request's KV to a decode worker (or could not): send it there."""
        rid = flight.add.request_id
        if self.on_handoff is not None:
            self.on_handoff(h)
        if h.error and h.fallback != "recompute":
            log.warning("request %s: KV not handed to %d (%s); decoded on %d", rid, h.to_worker, h.error, from_worker)
            return
        if h.error:  # every transfer path failed: the decode worker computes the prompt itself
            log.warning("request %s: KV transfer to %d failed (%s); it recomputes", rid, h.to_worker, h.error)
        source = self._workers.get(from_worker)
        if source is not None:
            source.in_flight.discard(rid)
        flight.owner = h.to_worker
        target = self._workers.get(h.to_worker)
        if target is None or target.dead:  # died after the handoff: its blocks are reclaimed, adoptable
            flight.moving = True
            self._tasks.append(asyncio.create_task(self._move(flight, h.to_worker)))
            return
        target.in_flight.add(rid)
        add = flight.add
        resume = Resume(list(flight.delivered), flight.text_chars, from_worker)
        handed = AddRequest(
            rid, add.prompt_ids, add.params, add.priority, resume=resume, handoff=None if h.error else h
        )
        # Sent now (pyzmq tries at once), so an abort of this request cannot overtake it.
        asyncio.ensure_future(target.sock.send(protocol.encode(handed)))

    def _record_takeover(self, out: RequestOutput) -> None:
        t = self._pending_takeover.pop(out.request_id)
        t.answered.set()
        t.first_token_s = time.monotonic() - t.started
        t.route, t.adopted_tokens, t.recomputed_tokens = out.route, out.adopted_tokens, out.recomputed_tokens
        log.info(
            "request %s taken over by worker %d at token %d: %s, %d adopted, %d recomputed, first token after %.0f ms",
            t.request_id,
            t.to_worker,
            t.at_token,
            t.route,
            t.adopted_tokens,
            t.recomputed_tokens,
            1000 * t.first_token_s,
        )

    # --- failure -------------------------------------------------------------------------------
    async def _watch(self) -> None:
        """Take a worker that stops reporting out of rotation for new requests until it reports again.

        Its requests stay where they are: a silent worker may only be slow. Requests move when its
        death is certain: the supervisor reaps it (a hung worker's lease expires, the pool fences it,
        the supervisor kills the fenced process) and says so with WorkerDied.
        """
        limit = max(5 * self.status_interval_s, 3.0)
        while True:
            await asyncio.sleep(self.status_interval_s)
            now = time.monotonic()
            for w in self._workers.values():
                if w.status is None or w.dead or w.status.state == "loading":
                    continue
                silent = now - w.last_seen > limit
                if silent and not w.unresponsive:
                    log.error(
                        "worker %d silent for %.1fs: no new requests until it reports", w.worker_id, now - w.last_seen
                    )
                w.unresponsive = silent

    def _lost(self, w: WorkerHandle) -> None:
        """Stop listening to a worker and move each of its requests, high priority first."""
        w.dead = True
        role, w.role, node = w.role, "dead", w.node
        moving = sorted(
            (f for f in self._flights.values() if f.owner == w.worker_id),
            key=lambda f: f.add.priority,
        )
        w.in_flight.clear()
        for flight in moving:
            flight.moving = True
            unanswered = self._pending_takeover.pop(flight.add.request_id, None)
            if unanswered is not None:  # moved to this worker, which died before answering: free the slot
                unanswered.answered.set()
            roles = SERVE_ROLES if role == "mixed" else DECODE_ROLES
            self._tasks.append(asyncio.create_task(self._move(flight, w.worker_id, roles, node)))
        # The last worker of its role: a standby (of its node, if there is one) steps into it.
        if role != "standby" and not any(x.role == role and not x.dead for x in self._workers.values()):
            standby = self._standby([x for x in self._workers.values() if x.ready], node)
            if standby is not None:
                self._promote(standby, role)
        self._workers.pop(w.worker_id, None)
        with contextlib.suppress(zmq.ZMQError):
            w.sock.close(linger=0)
        self._tasks = [t for t in self._tasks if not t.done()]

    async def _move(self, flight: Flight, dead: int, roles: tuple[str, ...] = DECODE_ROLES, node: str = "") -> None:
        """Resume a request on another worker of `roles` (the first that has a ready one), of the
        dead worker's `node` if one is there."""
        rid = flight.add.request_id
        async with self._moves:
            deadline = time.monotonic() + self.takeover_cfg.wait_timeout
            target = self._pick(dead, roles, node)
            while target is None:
                if time.monotonic() > deadline or rid not in self._flights:
                    break
                await asyncio.sleep(0.05)
                target = self._pick(dead, roles, node)
            if rid not in self._flights:
                return  # its client left meanwhile
            if target is None:
                flight.moving = False
                flight.queue.put_nowait(
                    RequestOutput(rid, [], finish_reason="error", error="its worker died and no other could take it")
                )
                return
            resume = Resume(list(flight.delivered), flight.text_chars, dead)
            add = AddRequest(rid, flight.add.prompt_ids, flight.add.params, flight.add.priority, resume=resume)
            record = Takeover(rid, dead, target.worker_id, len(flight.delivered), time.monotonic())
            self._pending_takeover[rid] = record
            self.takeovers.append(record)
            del self.takeovers[:-1000]
            flight.owner = target.worker_id
            flight.moving = False
            target.in_flight.add(rid)
            await target.sock.send(protocol.encode(add))
            log.warning("request %s: worker %d died, resuming on worker %d", rid, dead, target.worker_id)
            # Storm control: this slot stays taken until the new owner answers (or the request ends).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(record.answered.wait(), self.takeover_cfg.wait_timeout)
            if self._pending_takeover.get(rid) is record:
                del self._pending_takeover[rid]
