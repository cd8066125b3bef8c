"""The destination side of a KV move between nodes: `KVReceiver` binds one ZeroMQ ROUTER socket per path and
runs a move session (`kv/moves/session.py`) per incoming move: it reserves blocks from its node's pool at
PREALLOC, writes verified frames into them, acks a complete COMMIT (PREPARED), records the decision in its
node's ledger when the source asks for it, and keeps committed blocks for the engine thread to claim.

This module owns the receiving half of the wire and the blocks reserved for a move until they are claimed.
It must never keep a block nobody will claim (stalled, aborted, superseded or unclaimed moves give theirs
back), write a byte without the lease check, record COMMITTED for blocks it does not hold verified (every
layer of every token, each frame checksummed), take a session's messages from another connection than the
one that opened it, reserve beyond its limits (`kv/moves/checks.py`), or let one bad message stop the
receiver. With keys, only the deployment's senders get through at all (`wire/curve.py`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable

import msgspec
import xxhash
import zmq

from steadfast.config import TransferConfig
from steadfast.kv.arena.arena import KVArena
from steadfast.kv.moves.checks import (
    Drop,
    IncomingLimits,
    RateLimitedLog,
    frame_problem,
    message_problem,
)
from steadfast.kv.moves.faults import FaultSwitch
from steadfast.kv.moves.incoming import Decider, Incoming, MemoryDecisions
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
    MoveProtocolError,
    Prealloc,
    Release,
    Reserve,
    Reserved,
    Send,
)
from steadfast.kv.moves.packing import slots_for, write_span
from steadfast.kv.moves.receiver_sockets import ReceiverSockets
from steadfast.kv.moves.seal import Opener, SealError
from steadfast.kv.moves.session import DestinationSession
from steadfast.kv.moves.transport import path_names
from steadfast.kv.moves.wire import (
    AskDecision,
    Decision,
    KVFrame,
    Probe,
    Progress,
    ToDestination,
    decode_to_destination,
    encode,
)
from steadfast.wire.curve import KeyFile

log = logging.getLogger(__name__)


CLAIM_TIMEOUT_S = 30.0  # a committed move nobody claimed this long is given back to the pool
QUIET_FLOOR_S = 2.0  # a source is taken to be gone only after this long without a word, at least
TOMBSTONE_S = 60.0  # an ended session is remembered this long: a late PREALLOC never reserves again


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
        keys: KeyFile | None = None,
        limits: IncomingLimits | None = None,
        faults: FaultSwitch | None = None,
    ) -> None:
        """`addresses`: one per path (`tcp://host:0` takes a free port). `lease_check` raises unless
        this worker's lease is surely valid: no byte is written without. `decide`: records a session's
        decision in this node's ledger unless one is recorded, returning the recorded one (None: kept
        in memory, for a receiver with no ledger). A source quiet for `2 * timeout_s` (at least
        `QUIET_FLOOR_S`) is taken to be gone. `keys`: the receiving side's CURVE keys (None: anyone who
        can connect is heard). `limits`: moves and blocks held at once (None: `transfer`'s defaults). `faults`:
        the drill switch, asked at every new session (its `drop_acks` and `hold_s` act here)."""
        self.arena, self.block_size = arena, block_size
        self.lease_check = lease_check
        self.grant, self.release, self.timeout_s = grant, release, timeout_s
        self.decide: Decider = decide if decide is not None else MemoryDecisions()
        # A step of a loaded prefill worker (its sender thread shares the cores with the forward pass)
        # can outlast a short timeout, and taking a live source for a vanished one costs it a path.
        self.quiet_s = max(2 * timeout_s, QUIET_FLOOR_S)
        self.limits = limits or IncomingLimits.of(TransferConfig(), arena.spec.num_blocks)
        self.fault_source = faults
        self.net = ReceiverSockets(arena.spec, addresses, keys)
        self.socks, self.data_socks, self.addresses = self.net.socks, self.net.data_socks, self.net.addresses
        self._data_port = self.net.data_port
        self._lock = threading.Lock()
        self._sessions: dict[str, Incoming] = {}
        self._latest: dict[str, str] = {}  # request -> its newest session
        self._claims: dict[str, tuple[list[int], float]] = {}  # request -> committed blocks, since when
        self._stop = False
        self.received_bytes = 0
        # Every key present from the start: another thread may copy these while this one counts.
        self.dropped: Counter[Drop] = Counter(dict.fromkeys(Drop, 0))  # messages dropped, by why (logged)
        self.refused: Counter[AbortReason] = Counter(dict.fromkeys(AbortReason, 0))  # PREALLOCs answered ABORT
        self._log = RateLimitedLog(log)
        self._thread = threading.Thread(target=self._run, name="kv-receiver", daemon=True)
        self._thread.start()

    def counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """(dropped, refused) by reason, the nonzero ones: for the worker's status report."""
        return (
            {str(k): v for k, v in list(self.dropped.items()) if v},
            {str(k): v for k, v in list(self.refused.items()) if v},
        )

    @property
    def corrupt_chunks(self) -> int:
        return self.dropped[Drop.CHECKSUM]

    @property
    def reserved_blocks(self) -> int:
        """Blocks held by incoming moves that have not committed."""
        with self._lock:
            return self._reserved()

    @property
    def held_blocks(self) -> int:
        """Blocks held for moves here: reserved, or committed and not claimed yet."""
        with self._lock:
            return self._reserved() + sum(len(blocks) for blocks, _ in self._claims.values())

    def claim(self, request_id: str) -> list[int] | None:
        """The blocks of a committed move, now the engine's; None if there is none (expired)."""
        with self._lock:
            claimed = self._claims.pop(request_id, None)
            return claimed[0] if claimed is not None else None

    def close(self) -> None:
        """Stop; blocks reserved or committed and not claimed go back to the pool."""
        self._stop = True
        self._thread.join(timeout=5)
        self.net.close()
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
        for sock in self.socks + self.data_socks:
            poller.register(sock, zmq.POLLIN)
        while not self._stop:
            for sock, _ in poller.poll(100):
                for _ in range(256):  # what is waiting, a bounded batch per socket
                    try:
                        # copy=False: a frame's K/V is decoded as a view into the message (written to
                        # the arena once, never copied on the way).
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    if sock in self.data_socks:
                        self._receive_sealed([f.buffer for f in frames])
                    else:
                        self._receive(sock, [f.buffer for f in frames])
            self._release_held()
            # Only with every socket read: a source whose messages wait unread is not a quiet one.
            if not any(sock.getsockopt(zmq.EVENTS) & zmq.POLLIN for sock in self.socks + self.data_socks):
                self._expire()

    def _receive(self, sock: zmq.Socket, frames: list[memoryview]) -> None:
        """One message off the wire; whatever is wrong with it is logged and dropped here."""
        try:
            msg = decode_to_destination(frames[1]) if len(frames) == 2 else None
        except (msgspec.DecodeError, msgspec.ValidationError):
            msg = None
        if msg is None:
            self._drop(Drop.UNDECODABLE, "?", f"{len(frames)} frame(s), not a source's message")
            return
        self._dispatch(sock, bytes(frames[0]), msg)

    def _dispatch(self, sock: zmq.Socket, peer: bytes, msg: ToDestination) -> None:
        """A decoded message, as from `peer` on `sock`: checked against what any session may hold, then
        handled; whatever is wrong with it is logged and dropped here."""
        why = message_problem(msg)
        if why is not None:
            self._drop(why, msg.session, f"a {type(msg).__name__} no session may have")
            return
        try:
            self._handle(sock, peer, msg)
        except MoveProtocolError as exc:  # the source contradicted its session: refused, nothing else
            self._drop(Drop.PROTOCOL, msg.session, str(exc))
        except Exception:  # a bug: loud, but one bad message must not stop the receiver
            log.exception("KV move %s: handling a %s failed", msg.session, type(msg).__name__)

    def _receive_sealed(self, frames: list[memoryview]) -> None:
        """One message off a data channel: [session, nonce, sealed message]. It counts only if it opens
        under that session's key after the last one opened; then it is the session's own, as if its
        connection had sent it."""
        if len(frames) != 3:
            self._drop(Drop.UNSEALED, "?", f"{len(frames)} frame(s) on the data channel")
            return
        session = bytes(frames[0]).decode("utf-8", "replace")
        with self._lock:
            inc = self._sessions.get(session)
        # (Opened outside the lock: only this thread uses an opener or removes a session.)
        if inc is None or inc.opener is None:
            self._drop(Drop.UNSEALED, session, "no session here has a data channel by that name")
            return
        try:
            msg = decode_to_destination(inc.opener.open(frames[1], frames[2]))
        except SealError as exc:
            self._drop(Drop.UNSEALED, session, str(exc))
            return
        except (msgspec.DecodeError, msgspec.ValidationError):
            msg = None
        if msg is None or msg.session != session:
            self._drop(Drop.UNDECODABLE, session, "sealed by the session's source, yet not its message")
            return
        self._dispatch(inc.sock, inc.peer, msg)

    def _release_held(self) -> None:
        """A drill's held stages whose time is up are handled now, in the order they came."""
        now = time.monotonic()
        with self._lock:
            due = [i for i in self._sessions.values() if i.held and now >= i.held_until]
        for inc in due:
            msgs, inc.held = inc.held, []
            for msg in msgs:
                try:
                    self._handle(inc.sock, inc.peer, msg)
                except MoveProtocolError as exc:
                    self._drop(Drop.PROTOCOL, msg.session, str(exc))

    def _drop(self, why: Drop, session: str, detail: str) -> None:
        self.dropped[why] += 1
        self._log.warning(why, "KV move %s: message dropped (%s: %s)", session, why, detail)

    def _reserved(self) -> int:
        return sum(len(i.session.block_ids) for i in self._sessions.values() if i.session.holds_reservation)

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
                inc = self._open(sock, peer, msg, now)
                if inc is None:
                    return
            elif inc.sock is not sock or inc.peer != peer:
                self._drop(Drop.WRONG_PEER, msg.session, "another connection opened this session")
                if isinstance(msg, Prealloc | Commit | Copy):  # (a new source reusing the name: next path)
                    sock.send_multipart([peer, encode(Abort(msg.session, AbortReason.DESTINATION_ABORT))])
                return
            d = inc.session
            if inc.held_back(msg, now):
                return
            match msg:
                case KVFrame():
                    self._frame(inc, msg, now)
                    return
                case Probe():
                    if d.holds_reservation:
                        sock.send_multipart([peer, encode(Progress(msg.session, msg.sent))])
                    return
                case Copy():
                    if d.holds_reservation:
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
                case Commit() if inc.prepares(msg) and not inc.covered(self.arena.spec.num_layers, self.block_size):
                    # Every announced part came and checked, yet some layer lacks tokens: the blocks would
                    # hold stale bytes of their last owner. The source is broken; resending cannot help.
                    self._drop(Drop.INCOMPLETE, msg.session, "the parts leave tokens of some layer unwritten")
                    actions = d.abort(AbortReason.DESTINATION_ABORT, now)
                case Commit():
                    actions = [inc.with_parts(a) for a in d.on_commit(msg, now)]
                case _:
                    actions = d.receive(msg, now)
            self._act(inc, actions, now)

    def _open(self, sock: zmq.Socket, peer: bytes, msg: Prealloc, now: float) -> Incoming | None:
        """A new session, or None when refused (answered ABORT, nothing reserved, nothing kept). An older
        one of the same request (the source moved to another path) is given up first, so a request never
        holds two reservations here; a request whose KV already committed here gets no second move (it
        would replace the blocks the engine claims and seals into its prefix cache)."""
        rid = msg.session.rsplit("/", 1)[0]
        old = self._sessions.get(self._latest.get(rid, ""))
        if rid in self._claims or (old is not None and old.session.state is DestinationState.COMMITTED):
            return self._refuse(sock, peer, msg, AbortReason.DESTINATION_ABORT)
        if old is not None and not old.session.finished:
            self._act(old, old.session.abort(AbortReason.SOURCE_ABORT, now), now)
        if sum(not i.session.finished for i in self._sessions.values()) >= self.limits.sessions:
            return self._refuse(sock, peer, msg, AbortReason.BUSY)
        if self._reserved() + msg.n_blocks > self.limits.blocks:
            return self._refuse(sock, peer, msg, AbortReason.NO_ROOM)
        inc = self._sessions[msg.session] = Incoming(DestinationSession(msg.session, self.quiet_s), rid, sock, peer)
        self._latest[rid] = msg.session
        if msg.seal_key and sock in self._data_port:
            inc.opener, inc.data_port = Opener(msg.seal_key, msg.session), self._data_port[sock]
        faults = self.fault_source() if self.fault_source is not None else None
        if faults is not None and faults.applies_to(path_names(len(self.socks))[self.socks.index(sock)]):
            inc.faults = faults
        return inc

    def _refuse(self, sock: zmq.Socket, peer: bytes, msg: Prealloc, reason: AbortReason) -> None:
        self.refused[reason] += 1
        self._log.warning(reason, "KV move %s refused (%s, %d blocks asked)", msg.session, reason, msg.n_blocks)
        sock.send_multipart([peer, encode(Abort(msg.session, reason))])

    def _frame(self, inc: Incoming, f: KVFrame, now: float) -> None:
        d = inc.session
        if d.state not in (DestinationState.RESERVED, DestinationState.RECEIVING):
            return  # a straggler, or a resend no longer needed: nothing is written once prepared
        d.heard(now)
        m = inc.manifests.get(f.stage)
        why = frame_problem(f, self.arena.spec, len(d.block_ids), m.parts if m is not None else None)
        if why is not None:
            # From the session's own connection, a frame no session of it may hold: the source is broken
            # (another model, another arena shape), and its reservation goes back now, not at the watchdog.
            self._drop(why, f.session, f"part {f.part}: layer {f.layer}, tokens {f.start}+{f.count}")
            self._act(inc, d.abort(AbortReason.DESTINATION_ABORT, now), now)
            return
        self.lease_check()
        got = inc.spans.setdefault(f.stage, {})
        if xxhash.xxh3_64_intdigest(f.data) != f.checksum:
            self._drop(Drop.CHECKSUM, f.session, f"part {f.part}: the ack names it")
            got.pop(f.part, None)
            return
        write_span(self.arena, f.layer, slots_for(list(d.block_ids), self.block_size, f.start, f.count), f.data)
        self.received_bytes += len(f.data)
        got[f.part] = (f.layer, f.start, f.count)
        self._complete(inc, f.stage, now)

    def _complete(self, inc: Incoming, stage: int, now: float) -> None:
        """A stage whose manifest and every part are in counts as received."""
        m = inc.manifests.get(stage)
        if m is not None and stage not in inc.session.got and inc.spans.get(stage, {}).keys() >= set(range(m.parts)):
            self._act(inc, inc.session.on_copy(m, now), now)

    def _act(self, inc: Incoming, actions: list[Action], now: float) -> None:
        work = list(actions)
        while work:
            match work.pop(0):
                case Send(message=CommitAck(missing=())) if inc.faults and inc.acks_dropped < inc.faults.drop_acks:
                    inc.acks_dropped += 1
                    log.warning("KV move %s: fault drill: its COMMIT ack is dropped", inc.session.session)
                case Send(message=Reserved() as m) if inc.data_port:
                    m = msgspec.structs.replace(m, data_port=inc.data_port)  # the session's data channel
                    inc.sock.send_multipart([inc.peer, encode(m)])
                case Send(message=m):
                    inc.sock.send_multipart([inc.peer, encode(m)])
                case Reserve(n_blocks=n):  # (within the limits: `_open` refused the rest)
                    work[:0] = inc.session.on_granted(self.grant(n), now)
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
