"""Transport paths for KV transfers: the interface a sender talks to (`Transport`) and the ZeroMQ path
that implements it (`ZmqPath`: a DEALER socket to a receiver's ROUTER address over TCP).

This is the only module that knows about the sending side of ZeroMQ; another transport (NIXL, RDMA)
replaces `ZmqPath` behind the same interface. A path must never retry, back off, inject faults or
block without a bound: a path that cannot take data raises `PathDownError` and the sender decides.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from typing import Protocol

import msgspec
import zmq

from steadfast.kv.moves.messages import Prealloc, Reserved
from steadfast.kv.moves.seal import Sealer, new_key
from steadfast.kv.moves.wire import KVFrame, ToDestination, ToSource, decode_to_source, encode
from steadfast.wire import curve
from steadfast.wire.curve import KeyFile, TransferSide

log = logging.getLogger(__name__)

SEALED_SESSIONS = 256  # sessions a path keeps a data-channel key for (the oldest's go back to CURVE)
DATA_SNDHWM = 64  # sealed messages queued for a data channel before a send waits (then PathDownError)


class PathDownError(ConnectionError):
    """A transport path cannot take data now (no peer connected, or it stopped reading)."""


class Transport(Protocol):
    """One path to a receiver."""

    name: str  # "primary", "alternate", ...: what results and metrics call it

    def send_frame(self, frame: KVFrame) -> int:
        """Send one frame of K/V; returns the bytes of K/V put on the wire (0 when none went)."""
        ...

    def send(self, msg: ToDestination) -> None: ...

    def recv(self) -> ToSource | None:
        """The receiver's next message if one is waiting (never blocks); None when none is."""
        ...

    def close(self) -> None: ...


class ZmqPath:
    """One transport path to a receiver: a DEALER socket to its ROUTER address; with `keys` (the sending
    side's), CURVE-authenticated and talking only to the deployment's receivers. A CURVE path gives each
    session a key in its PREALLOC; once the RESERVED names a data port, the session's later messages go
    there sealed (`kv/moves/seal.py`) on one PUSH socket per port, in the order they are sent."""

    def __init__(
        self, ctx: zmq.Context, name: str, address: str, send_timeout_s: float, keys: KeyFile | None = None
    ) -> None:
        self.name, self.address = name, address
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # The receiver hears a session only from the connection that opened it; a routing id of our own
        # (random: nobody else can claim it) keeps the sessions ours across a reconnect.
        self.sock.setsockopt(zmq.ROUTING_ID, os.urandom(16))
        if keys is not None:
            curve.as_client(self.sock, keys.expect(TransferSide.SEND))
        # Nothing queued for a peer that is not connected, and no send waits long: a dead receiver
        # must fail the attempt (PathDownError), never hang the sender.
        self.sock.setsockopt(zmq.IMMEDIATE, 1)
        self.sock.setsockopt(zmq.SNDTIMEO, max(1, int(send_timeout_s * 1000)))
        self.sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)  # answers are small: a peer sending more is not one
        self.sock.connect(address)
        self.ctx, self.send_timeout_s = ctx, send_timeout_s
        self._keys: OrderedDict[str, bytes] | None = OrderedDict() if keys is not None else None
        self._sealed: dict[str, tuple[Sealer, zmq.Socket]] = {}
        self._data: dict[int, zmq.Socket] = {}  # by port
        self.sealed_sent = 0  # messages that went over a data channel

    def _send(self, msg: ToDestination) -> None:
        data = encode(msg)
        # PREALLOC (the handshake, and the heartbeat that finds a restarted receiver) always on CURVE.
        sealed = None if isinstance(msg, Prealloc) else self._sealed.get(msg.session)
        try:
            if sealed is None:
                self.sock.send(data, copy=False)
                return
            sealer, sock = sealed
            nonce, box = sealer.seal(data)
            sock.send_multipart([msg.session.encode(), nonce, box], copy=False)
            self.sealed_sent += 1
        except zmq.Again as exc:
            raise PathDownError(f"{self.name} path to {self.address} is not taking data") from exc

    def send_frame(self, frame: KVFrame) -> int:
        self._send(frame)
        return len(frame.data)

    def send(self, msg: ToDestination) -> None:
        if isinstance(msg, Prealloc) and self._keys is not None:
            msg = msgspec.structs.replace(msg, seal_key=self._key(msg.session))
        self._send(msg)

    def _key(self, session: str) -> bytes:
        """The session's data-channel key: one per session, kept for the most recent sessions only."""
        assert self._keys is not None
        key = self._keys.get(session)
        if key is None:
            key = self._keys[session] = new_key()
            while len(self._keys) > SEALED_SESSIONS:
                old, _ = self._keys.popitem(last=False)
                self._sealed.pop(old, None)
        return key

    def _open_channel(self, msg: Reserved) -> None:
        """A RESERVED naming a data port: the session's later messages go there, sealed with its key."""
        key = self._keys.get(msg.session) if self._keys is not None else None
        if key is None or msg.session in self._sealed:
            return
        sock = self._data.get(msg.data_port)
        if sock is None:
            # A new port: the receiver was started again. Channels no session uses any more are closed.
            used = {id(s) for _, s in self._sealed.values()}
            for port, old in list(self._data.items()):
                if id(old) not in used:
                    old.close(linger=0)
                    del self._data[port]
            sock = self._data[msg.data_port] = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            # Queued while it connects; a receiver that stopped reading fails the send, never hangs it.
            sock.setsockopt(zmq.SNDHWM, DATA_SNDHWM)
            sock.setsockopt(zmq.SNDTIMEO, max(1, int(self.send_timeout_s * 1000)))
            sock.connect(f"{self.address.rsplit(':', 1)[0]}:{msg.data_port}")
            log.info("KV wire %s to %s: sealed data channel on port %d", self.name, self.address, msg.data_port)
        self._sealed[msg.session] = (Sealer(key, msg.session), sock)

    def recv(self) -> ToSource | None:
        while True:
            try:
                data = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return None
            try:
                msg = decode_to_source(data)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue  # not a receiver's answer: skip it
            if isinstance(msg, Reserved) and msg.data_port:
                self._open_channel(msg)
            return msg

    def close(self) -> None:
        self.sock.close(linger=0)
        for sock in self._data.values():
            sock.close(linger=0)


def path_names(count: int) -> list[str]:
    """The names of a receiver's `count` paths, in fallback order: primary, alternate, alternate2, ..."""
    return ["primary", *(f"alternate{i}" if i > 1 else "alternate" for i in range(1, count))][:count]
