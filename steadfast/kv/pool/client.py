"""A worker's side of the pool: registration, block grants in batches, and its lease.

`PoolClient` talks to the kvpool daemon (retrying across a daemon restart; a malformed reply is logged
and dropped, never raised). `LeaseKeeper` renews the
worker's lease from a thread and knows, locally, until when the lease is surely valid: a worker must
not write KV bytes or ledger records past that instant, and once a renewal is refused it never writes
again (it cannot renew its way back after being fenced).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from steadfast.kv.ledger.interface import FencedError, LedgerError
from steadfast.kv.ledger.open import open_ledger
from steadfast.wire.codec import encode
from steadfast.wire.pool import (
    PoolAttach,
    PoolFence,
    PoolGrant,
    PoolRegister,
    PoolRelease,
    PoolReply,
    ToPool,
    decode_pool_reply,
)

log = logging.getLogger(__name__)


class Throttled:
    """Warnings at most one per `every_s` (the next one says how many were dropped): a peer that sends
    junk in a loop must not flood the log, nor the disk under it."""

    def __init__(self, logger: logging.Logger, every_s: float = 10.0) -> None:
        self.logger = logger
        self.every_s = every_s
        self._next = 0.0
        self._dropped = 0

    def warning(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now < self._next:
            self._dropped += 1
            return
        if self._dropped:
            msg = f"{msg} ({self._dropped} more like it since the last)"
        self.logger.warning(msg, *args)
        self._next, self._dropped = now + self.every_s, 0


class LeaseLostError(RuntimeError):
    """This worker's lease was fenced or expired: it must stop writing and exit."""


class PoolUnavailableError(RuntimeError):
    pass


class PoolClient:
    def __init__(
        self,
        address: str,
        worker: str,
        timeout_s: float = 2.0,
        attempts: int = 10,
        epoch: int = 0,
        on_made: Callable[[int], None] | None = None,
    ) -> None:
        """`epoch`: the lease's, for a client of a worker registered already (by another client: the one
        that registered had no arena yet to tell); `on_made`: told how much of the arena the pool has
        made, with every answer that says (`PoolReply.made`)."""
        self.address = address
        self.worker = worker
        self.timeout_ms = int(timeout_s * 1000)
        self.attempts = attempts
        self.ctx = zmq.Context.instance()
        self.sock: zmq.Socket | None = None
        self.epoch = epoch
        self._junk = Throttled(log)
        self.on_made = on_made

    def _connect(self) -> zmq.Socket:
        if self.sock is not None:
            self.sock.close(linger=0)
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(self.address)
        return self.sock

    def _call(self, msg: ToPool, attempts: int | None = None) -> PoolReply:
        sock = self.sock or self._connect()
        attempts = attempts or self.attempts
        for attempt in range(attempts):
            sock.send(encode(msg))
            reply = self._reply(sock)
            if reply is not None:
                if reply.fenced:
                    raise LeaseLostError(reply.error)
                if not reply.ok:
                    raise LedgerError(reply.error)
                if reply.made and self.on_made is not None:
                    self.on_made(reply.made)
                return reply
            # No answer: the daemon may be restarting. A fresh socket drops any stale reply.
            log.warning("kvpool did not answer (attempt %d); retrying", attempt + 1)
            sock = self._connect()
        raise PoolUnavailableError(f"kvpool at {self.address} did not answer {attempts} times")

    def _reply(self, sock: zmq.Socket) -> PoolReply | None:
        """The first well-formed reply within the timeout, or None. Anything else is dropped: a reply is
        one frame (more would be read as the next reply) that decodes as a PoolReply."""
        deadline = time.monotonic() + self.timeout_ms / 1000
        while sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            frames = sock.recv_multipart()
            try:
                if len(frames) != 1:
                    raise ValueError(f"{len(frames)} frames")
                return decode_pool_reply(frames[0])
            except (ValueError, msgspec.DecodeError) as exc:
                self._junk.warning("malformed reply from the kvpool at %s dropped: %s", self.address, exc)
        return None

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None

    def register(self, pid: int) -> PoolReply:
        reply = self._call(PoolRegister(self.worker, pid))
        self.epoch = reply.epoch
        return reply

    def attach(self, pid: int) -> PoolReply:
        """Where the arena and ledger are; takes no lease (inspectors, standbys)."""
        return self._call(PoolAttach(pid))

    def fence_dead(self, worker: str, pid: int) -> list[int]:
        """For the supervisor, which reaped `pid`: fence `worker` and reclaim; returns the sealed blocks kept."""
        return self._call(PoolFence(worker, pid)).block_ids

    def grant(self, count: int) -> list[int]:
        return self._call(PoolGrant(self.worker, self.epoch, count)).block_ids

    def release(self, block_ids: list[int], attempts: int | None = None) -> None:
        if block_ids:
            self._call(PoolRelease(self.worker, self.epoch, list(block_ids)), attempts)


class LeaseKeeper:
    """Renews (worker, epoch) every `renew_s` on its own ledger connection, but only while the engine's
    loop makes progress: once the loop has beaten (`beat`), a loop silent for `stall_s` stops the
    renewals, so a hung engine's lease lapses, its pool fences it, the supervisor kills it and its
    requests move (a thread that renews regardless would keep a stuck engine's clients waiting for ever)."""

    def __init__(
        self, ledger_url: str, worker: str, epoch: int, renew_s: float, ttl_s: float, stall_s: float = 15.0
    ) -> None:
        self.ledger = open_ledger(ledger_url)
        self.worker = worker
        self.epoch = epoch
        self.renew_s = renew_s
        self.ttl_s = ttl_s
        self.stall_s = stall_s
        self._beat: float | None = None  # the loop's last sign of progress; None before it runs
        self.stalled = False
        # Trust the lease for less than its full term: a renewal written just before a stall still
        # leaves the ledger's expiry ahead of this local deadline.
        self.valid_until = time.monotonic() + ttl_s / 2
        self.lost: str | None = None
        self._renewing = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease-keeper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def renew(self) -> None:
        # One renewal at a time on the keeper's connection: its thread's and the engine loop's (`check`).
        with self._renewing:
            started = time.monotonic()
            try:
                self.ledger.renew_lease(self.worker, self.epoch, self.ttl_s)
            except FencedError as exc:
                self.lost = str(exc)
                raise LeaseLostError(self.lost) from exc
            self.valid_until = started + self.ttl_s / 2

    def check(self) -> None:
        """Raise unless the lease is surely still ours; renew at once if it is about to lapse."""
        if self.lost:
            raise LeaseLostError(self.lost)
        if time.monotonic() >= self.valid_until:
            self.renew()

    def beat(self) -> None:
        """The engine loop went round once (called by it, never by this keeper's thread)."""
        self._beat = time.monotonic()
        if self.stalled:
            log.warning("engine loop of %s is making progress again", self.worker)
            self.stalled = False

    def _run(self) -> None:
        while not self._stop.wait(self.renew_s):
            beat = self._beat
            if beat is not None and time.monotonic() - beat > self.stall_s:
                if not self.stalled:
                    log.error(
                        "engine loop of %s made no progress for %.1fs: its lease is left to lapse",
                        self.worker,
                        time.monotonic() - beat,
                    )
                self.stalled = True
                continue
            try:
                self.renew()
            except LeaseLostError:
                log.error("lease of %s (epoch %d) lost: %s", self.worker, self.epoch, self.lost)
                return
            except LedgerError as exc:  # e.g. the store busy too long (LedgerUnavailableError): try next tick
                log.warning("lease renewal failed: %s", exc)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.ledger.close()
