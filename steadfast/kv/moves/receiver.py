"""The destination side of a KV move between nodes: `KVReceiver` binds one ZeroMQ ROUTER socket per path and
runs a move session (`kv/moves/session.py`) per incoming move: it reserves blocks from its node's pool at
PREALLOC, writes verified frames into them, acks a complete COMMIT (PREPARED), records the decision in its
node's ledger when the source asks for it, and keeps committed blocks for the engine thread to claim.

This module owns the receiving half of the wire and the blocks reserved for a move until they are claimed.
It must never keep a block nobody will claim (stalled, aborted, superseded or unclaimed moves give theirs
back), write a byte without the lease check, record COMMITTED for blocks it does not hold verified, or let
one bad message stop the receiver.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import xxhash
import zmq

from steadfast.kv.arena import KVArena
from steadfast.kv.moves.messages import (
    Abort,
    AbortReason,
    Action,
    Adopt,
    Commit,
    CommitAck,
    Copy,
    Decide,
    DestinationState,
    MoveOutcome,
    Prealloc,
    Release,
    Reserve,
    Send,
)
from steadfast.kv.moves.packing import slots_for, write_span
from steadfast.kv.moves.session import DestinationSession
from steadfast.kv.moves.wire import (
    MAX_MESSAGE_BYTES,
    AskDecision,
    Decision,
    KVFrame,
    ToDestination,
    decode_to_destination,
    encode,
)

log = logging.getLogger(__name__)

CLAIM_TIMEOUT_S = 30.0  # a committed move nobody claimed this long is given back to the pool
QUIET_FLOOR_S = 2.0  # a source is taken to be gone only after this long without a word, at least
TOMBSTONE_S = 60.0  # an ended session is remembered this long: a late PREALLOC never reserves again

Decider = Callable[[str, MoveOutcome], MoveOutcome]


class MemoryDecisions:
    """The decision record when there is no ledger (a receiver on its own, in tests): first writer wins."""

    def __init__(self) -> None:
        self._decided: dict[str, MoveOutcome] = {}

    def __call__(self, session: str, proposal: MoveOutcome) -> MoveOutcome:
        return self._decided.setdefault(session, proposal)


@dataclass
class _Incoming:
    session: DestinationSession
    request_id: str
    sock: zmq.Socket
    peer: bytes  # the source's identity on `sock`: where answers go
    manifests: dict[int, Copy] = field(default_factory=dict)
    parts: dict[int, set[int]] = field(default_factory=dict)  # stage -> parts written and verified
    ended: float = math.inf


class KVReceiver:
    """The decode side: one thread binds `address`es, reserves blocks for each incoming move from the
    node's pool (`grant`), writes verified frames into them and acknowledges a complete commit. The
    engine thread `claim`s a committed move's blocks; blocks of a move that stalls, is aborted or never
    claimed are given back (`release`): nothing leaks."""

    def __init__(
        self,
        arena: KVArena,
        block_size: int,
        addresses: list[str],
        grant: Callable[[int], list[int]],
        release: Callable[[list[int]], None],
        timeout_s: float,
        lease_check: Callable[[], None] = lambda: None,
        decide: Decider | None = None,
    ) -> None:
        """`addresses`: one per path (`tcp://host:0` takes a free port). `lease_check` raises unless
        this worker's lease is surely valid: no byte is written without. `decide`: records a session's
        decision in this node's ledger unless one is recorded, returning the recorded one (None: kept
        in memory, for a receiver with no ledger). A source quiet for `2 * timeout_s` (at least
        `QUIET_FLOOR_S`) is taken to be gone."""
        self.arena, self.block_size = arena, block_size
        self.lease_check = lease_check
        self.grant, self.release, self.timeout_s = grant, release, timeout_s
        self.decide: Decider = decide if decide is not None else MemoryDecisions()
        # A step of a loaded prefill worker (its sender thread shares the cores with the forward pass)
        # can outlast a short timeout, and taking a live source for a vanished one costs it a path.
        self.quiet_s = max(2 * timeout_s, QUIET_FLOOR_S)
        self.ctx = zmq.Context.instance()
        self.socks: list[zmq.Socket] = []
        self.addresses: list[str] = []
        for address in addresses:
            sock = self.ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            if address.endswith(":0"):
                host = address.rsplit(":", 1)[0]
                address = f"{host}:{sock.bind_to_random_port(host)}"
            else:
                sock.bind(address)
            self.socks.append(sock)
            self.addresses.append(address)
        self._lock = threading.Lock()
        self._sessions: dict[str, _Incoming] = {}
        self._latest: dict[str, str] = {}  # request -> its newest session
        self._claims: dict[str, tuple[list[int], float]] = {}  # request -> committed blocks, since when
        self._stop = False
        self.received_bytes = 0
        self.corrupt_chunks = 0
        self._thread = threading.Thread(target=self._run, name="kv-receiver", daemon=True)
        self._thread.start()

    def claim(self, request_id: str) -> list[int] | None:
        """The blocks of a committed move, now the engine's; None if there is none (expired)."""
        with self._lock:
            claimed = self._claims.pop(request_id, None)
            return claimed[0] if claimed is not None else None

    def close(self) -> None:
        """Stop; blocks reserved or committed and not claimed go back to the pool."""
        self._stop = True
        self._thread.join(timeout=5)
        for sock in self.socks:
            sock.close(linger=0)
        with self._lock:
            for inc in self._sessions.values():
                if inc.session.holds_reservation and inc.session.block_ids:
                    self.release(list(inc.session.block_ids))
            for blocks, _ in self._claims.values():
                self.release(blocks)
            self._sessions.clear()
            self._claims.clear()

    def _run(self) -> None:
        poller = zmq.Poller()
        for sock in self.socks:
            poller.register(sock, zmq.POLLIN)
        while not self._stop:
            for sock, _ in poller.poll(100):
                for _ in range(256):  # what is waiting, a bounded batch per socket
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if len(frames) != 2:
                        continue
                    try:
                        self._handle(sock, frames[0], decode_to_destination(frames[1]))
                    except Exception as exc:  # one bad message must not stop the receiver
                        log.exception("bad KV move message")
                        self.corrupt_chunks += isinstance(exc, msgspec.DecodeError | msgspec.ValidationError)
            # Only with every socket read: a source whose messages wait unread is not a quiet one.
            if not any(sock.getsockopt(zmq.EVENTS) & zmq.POLLIN for sock in self.socks):
                self._expire()

    def _handle(self, sock: zmq.Socket, peer: bytes, msg: ToDestination) -> None:
        now = time.monotonic()
        with self._lock:
            inc = self._sessions.get(msg.session)
            if inc is None:
                if isinstance(msg, AskDecision):  # a session never held here cannot commit here
                    sock.send_multipart(
                        [peer, encode(Decision(msg.session, self.decide(msg.session, MoveOutcome.ABORTED)))]
                    )
                if isinstance(msg, Commit | Copy):  # forgotten or never opened: the source moves on now
                    sock.send_multipart([peer, encode(Abort(msg.session, AbortReason.DESTINATION_ABORT))])
                if not isinstance(msg, Prealloc):
                    return
                inc = self._open(sock, peer, msg)
            inc.sock, inc.peer = sock, peer
            d = inc.session
            match msg:
                case KVFrame():
                    self._frame(inc, msg, now)
                    return
                case Copy():
                    if d.holds_reservation and 0 <= msg.stage < 64 and 0 <= msg.parts <= 1 << 16:
                        inc.manifests[msg.stage] = msg
                        d.heard(now)
                        self._complete(inc, msg.stage, now)
                    return
                case AskDecision():
                    # Only blocks held verified may be recorded as the destination's.
                    held = d.state in (DestinationState.PREPARED, DestinationState.COMMITTED)
                    outcome = self.decide(msg.session, msg.proposal if held else MoveOutcome.ABORTED)
                    sock.send_multipart([peer, encode(Decision(msg.session, outcome))])
                    if held or d.finished:
                        self._act(inc, d.on_decided(outcome, now), now)
                    else:  # decided aborted before it prepared: the reservation goes back now
                        self._act(inc, d.abort(AbortReason.DESTINATION_ABORT, now), now)
                    return
                case Commit():
                    actions = [self._with_parts(inc, a) for a in d.on_commit(msg, now)]
                case _:
                    actions = d.receive(msg, now)
            self._act(inc, actions, now)

    def _open(self, sock: zmq.Socket, peer: bytes, msg: Prealloc) -> _Incoming:
        """A new session. An older one of the same request (the source moved to another path) is given
        up first, so a request never holds two reservations here."""
        rid = msg.session.rsplit("/", 1)[0]
        old = self._sessions.get(self._latest.get(rid, ""))
        if old is not None and not old.session.finished:
            self._act(old, old.session.abort(AbortReason.SOURCE_ABORT, time.monotonic()), time.monotonic())
        inc = self._sessions[msg.session] = _Incoming(DestinationSession(msg.session, self.quiet_s), rid, sock, peer)
        self._latest[rid] = msg.session
        return inc

    def _frame(self, inc: _Incoming, f: KVFrame, now: float) -> None:
        d = inc.session
        if d.state not in (DestinationState.RESERVED, DestinationState.RECEIVING):
            return  # a straggler, or a resend no longer needed
        d.heard(now)
        spec = self.arena.spec
        if not (
            0 <= f.layer < spec.num_layers
            and f.start >= 0
            and 0 < f.count <= len(d.block_ids) * self.block_size - f.start
        ):
            raise ValueError(f"frame of {f.session}: layer {f.layer}, tokens {f.start}+{f.count} outside the move")
        self.lease_check()
        got = inc.parts.setdefault(f.stage, set())
        if xxhash.xxh3_64_intdigest(f.data) != f.checksum:
            self.corrupt_chunks += 1
            got.discard(f.part)
            return
        write_span(self.arena, f.layer, slots_for(list(d.block_ids), self.block_size, f.start, f.count), f.data)
        self.received_bytes += len(f.data)
        got.add(f.part)
        self._complete(inc, f.stage, now)

    def _complete(self, inc: _Incoming, stage: int, now: float) -> None:
        """A stage whose manifest and every part are in counts as received."""
        m = inc.manifests.get(stage)
        if m is not None and stage not in inc.session.got and inc.parts.get(stage, set()) >= set(range(m.parts)):
            self._act(inc, inc.session.on_copy(m, now), now)

    def _with_parts(self, inc: _Incoming, action: Action) -> Action:
        """An ack that names missing stages also names their missing parts, so only those are resent."""
        if not (isinstance(action, Send) and isinstance(action.message, CommitAck) and action.message.missing):
            return action
        parts = tuple(
            (stage, k)
            for stage in action.message.missing
            if stage in inc.manifests
            for k in range(inc.manifests[stage].parts)
            if k not in inc.parts.get(stage, set())
        )
        return Send(msgspec.structs.replace(action.message, parts=parts))

    def _act(self, inc: _Incoming, actions: list[Action], now: float) -> None:
        work = list(actions)
        while work:
            match work.pop(0):
                case Send(message=m):
                    inc.sock.send_multipart([inc.peer, encode(m)])
                case Reserve(n_blocks=n):
                    # More than the whole arena is no room, whoever asks; asking the pool could not help.
                    granted = self.grant(n) if 0 < n <= self.arena.spec.num_blocks else None if n else []
                    work[:0] = inc.session.on_granted(granted, now)
                case Release(block_ids=ids):
                    self.release(list(ids))
                case Decide(session=sid, proposal=proposal):
                    work[:0] = inc.session.on_decided(self.decide(sid, proposal), now)
                case Adopt(block_ids=ids):
                    self._claims[inc.request_id] = (list(ids), now)
        if inc.session.finished and inc.ended == math.inf:
            inc.ended = now

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            for sid, inc in list(self._sessions.items()):
                if not inc.session.finished:
                    try:
                        self._act(inc, inc.session.expire(now), now)
                    except Exception:
                        log.exception("KV move %s: the watchdog failed; it tries again", sid)
                    if inc.session.state is DestinationState.ABORTED:
                        log.warning(
                            "KV transfer of %s expired (session %s: its source went quiet for %.2f s); its blocks"
                            " go back to the pool",
                            inc.request_id,
                            sid,
                            now - inc.session.last_heard,
                        )
                elif now - inc.ended > TOMBSTONE_S:
                    del self._sessions[sid]
                    if self._latest.get(inc.request_id) == sid:
                        del self._latest[inc.request_id]
            # A committed move waits longer for the engine to claim it (the router sends the request on
            # after the prefill side hears).
            for rid, (blocks, since) in list(self._claims.items()):
                if now - since > max(CLAIM_TIMEOUT_S, 4 * self.timeout_s):
                    log.warning("KV move of %s was never claimed; its blocks go back to the pool", rid)
                    del self._claims[rid]
                    self.release(blocks)
