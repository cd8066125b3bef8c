"""The decode side of a KV transfer between nodes: `KVReceiver` binds one ZeroMQ ROUTER socket per path,
takes blocks from its node's pool for each incoming transfer, writes verified chunks into them and
acknowledges a complete commit; the engine thread then claims the blocks.

This module owns the receiving half of the wire and the blocks it granted until they are claimed. It
must never keep a block nobody will claim (stalled, aborted or unclaimed transfers give theirs back),
write a byte without the lease check, or let one bad message stop the receiver.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import xxhash
import zmq

from steadfast.kv.arena import KVArena
from steadfast.kv.moves.packing import slots_for, write_span
from steadfast.kv.moves.wire import KVAbort, KVAck, KVChunk, KVCommit, decode_to_receiver, encode

log = logging.getLogger(__name__)

CLAIM_TIMEOUT_S = 30.0  # a completed transfer nobody claimed this long is given back to the pool


@dataclass
class _Incoming:
    request_id: str
    attempt: int
    num_tokens: int
    block_ids: list[int]
    got: set[tuple[int, int]] = field(default_factory=set)  # (layer, start) written and verified
    bad: set[tuple[int, int]] = field(default_factory=set)
    last: float = field(default_factory=time.monotonic)
    done: bool = False


class KVReceiver:
    """The decode side: one thread binds `address`, takes blocks for each incoming transfer from the
    node's pool (`grant`), writes verified chunks into them and acknowledges a complete commit. The
    engine thread `claim`s a completed transfer's blocks; blocks of a transfer that stalls, is aborted
    or never claimed within `timeout_s` are given back (`release`): nothing leaks."""

    def __init__(
        self,
        arena: KVArena,
        block_size: int,
        addresses: list[str],
        grant: Callable[[int], list[int]],
        release: Callable[[list[int]], None],
        timeout_s: float,
        lease_check: Callable[[], None] = lambda: None,
    ) -> None:
        """`addresses`: one per path (`tcp://host:0` takes a free port). `lease_check` raises unless
        this worker's lease is surely valid: no byte is written without."""
        self.arena, self.block_size = arena, block_size
        self.lease_check = lease_check
        self.grant, self.release, self.timeout_s = grant, release, timeout_s
        self.ctx = zmq.Context.instance()
        self.socks: list[zmq.Socket] = []
        self.addresses: list[str] = []
        for address in addresses:
            sock = self.ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            if address.endswith(":0"):
                host = address.rsplit(":", 1)[0]
                address = f"{host}:{sock.bind_to_random_port(host)}"
            else:
                sock.bind(address)
            self.socks.append(sock)
            self.addresses.append(address)
        self._lock = threading.Lock()
        self._incoming: dict[str, _Incoming] = {}
        self._stop = False
        self.received_bytes = 0
        self.corrupt_chunks = 0
        self._thread = threading.Thread(target=self._run, name="kv-receiver", daemon=True)
        self._thread.start()

    def claim(self, request_id: str) -> list[int] | None:
        """The blocks of a completed transfer, now the engine's; None if there is none (expired)."""
        with self._lock:
            t = self._incoming.get(request_id)
            if t is None or not t.done:
                return None
            del self._incoming[request_id]
            return t.block_ids

    def close(self) -> None:
        """Stop; blocks of transfers nobody claimed go back to the pool."""
        self._stop = True
        self._thread.join(timeout=5)
        for sock in self.socks:
            sock.close(linger=0)
        with self._lock:
            for rid in list(self._incoming):
                self._drop(rid)

    def _run(self) -> None:
        poller = zmq.Poller()
        for sock in self.socks:
            poller.register(sock, zmq.POLLIN)
        while not self._stop:
            for sock, _ in poller.poll(100):
                peer, data = sock.recv_multipart()
                try:
                    reply = self._handle(decode_to_receiver(data))
                except Exception as exc:  # one bad message must not stop the receiver
                    log.exception("bad KV transfer message")
                    reply = None
                    self.corrupt_chunks += isinstance(exc, msgspec.DecodeError)
                if reply is not None:
                    sock.send_multipart([peer, encode(reply)])
            self._expire()

    def _handle(self, msg: KVChunk | KVCommit | KVAbort) -> KVAck | None:
        with self._lock:
            if isinstance(msg, KVAbort):
                self._drop(msg.request_id)
                return None
            t = self._incoming.get(msg.request_id)
            if t is not None and msg.attempt > t.attempt and not t.done:
                t.attempt, t.got, t.bad = msg.attempt, set(), set()  # a new path: start clean, same blocks
            if t is None:
                need = -(-msg.num_tokens // self.block_size)
                blocks = self.grant(need)
                if len(blocks) < need:
                    self.release(blocks)
                    if isinstance(msg, KVCommit):
                        return KVAck(msg.request_id, msg.attempt, False, error=f"no room for {need} KV blocks")
                    return None
                t = self._incoming[msg.request_id] = _Incoming(msg.request_id, msg.attempt, msg.num_tokens, blocks)
            t.last = time.monotonic()
            if msg.attempt != t.attempt:
                return None  # a straggler of an attempt given up on
            if isinstance(msg, KVChunk):
                self.lease_check()
                self._write(t, msg)
                return None
            expected = {(layer, start) for start, _ in msg.spans for layer in range(msg.num_layers)}
            missing = sorted(expected - t.got)
            if missing:
                return KVAck(msg.request_id, msg.attempt, False, missing=missing)
            t.done = True
            return KVAck(msg.request_id, msg.attempt, True, block_ids=t.block_ids)

    def _write(self, t: _Incoming, chunk: KVChunk) -> None:
        key = (chunk.layer, chunk.start)
        if xxhash.xxh3_64_intdigest(chunk.data) != chunk.checksum:
            self.corrupt_chunks += 1
            t.bad.add(key)
            t.got.discard(key)
            return
        write_span(
            self.arena, chunk.layer, slots_for(t.block_ids, self.block_size, chunk.start, chunk.count), chunk.data
        )
        self.received_bytes += len(chunk.data)
        t.got.add(key)
        t.bad.discard(key)

    def _drop(self, request_id: str) -> None:
        t = self._incoming.pop(request_id, None)
        if t is not None:
            self.release(t.block_ids)

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            # A transfer in progress that went quiet is given up soon; a complete one waits longer for
            # the engine to claim it (the router sends the request on after the prefill side hears).
            stale = [
                rid
                for rid, t in self._incoming.items()
                if now - t.last > (max(CLAIM_TIMEOUT_S, 4 * self.timeout_s) if t.done else 2 * self.timeout_s)
            ]
            for rid in stale:
                log.warning("KV transfer of %s expired; its blocks go back to the pool", rid)
                self._drop(rid)
