"""Transport paths for KV transfers: the interface a sender talks to (`Transport`) and the ZeroMQ path
that implements it (`ZmqPath`: a DEALER socket to a receiver's ROUTER address over TCP).

This is the only module that knows about the sending side of ZeroMQ; another transport (NIXL, RDMA)
replaces `ZmqPath` behind the same interface. A path must never retry, back off, inject faults or
block without a bound: a path that cannot take data raises `PathDownError` and the sender decides.
"""

from __future__ import annotations

import os
from typing import Protocol

import msgspec
import zmq

from steadfast.kv.moves import curve
from steadfast.kv.moves.curve import CurveKeys
from steadfast.kv.moves.wire import KVFrame, ToDestination, ToSource, decode_to_source, encode


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
    side's), CURVE-authenticated and talking only to the deployment's receivers."""

    def __init__(
        self, ctx: zmq.Context, name: str, address: str, send_timeout_s: float, keys: CurveKeys | None = None
    ) -> None:
        self.name, self.address = name, address
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # The receiver hears a session only from the connection that opened it; a routing id of our own
        # (random: nobody else can claim it) keeps the sessions ours across a reconnect.
        self.sock.setsockopt(zmq.ROUTING_ID, os.urandom(16))
        if keys is not None:
            curve.as_client(self.sock, keys)
        # Nothing queued for a peer that is not connected, and no send waits long: a dead receiver
        # must fail the attempt (PathDownError), never hang the sender.
        self.sock.setsockopt(zmq.IMMEDIATE, 1)
        self.sock.setsockopt(zmq.SNDTIMEO, max(1, int(send_timeout_s * 1000)))
        self.sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)  # answers are small: a peer sending more is not one
        self.sock.connect(address)

    def _send(self, data: bytes) -> None:
        try:
            self.sock.send(data, copy=False)
        except zmq.Again as exc:
            raise PathDownError(f"{self.name} path to {self.address} is not taking data") from exc

    def send_frame(self, frame: KVFrame) -> int:
        self._send(encode(frame))
        return len(frame.data)

    def send(self, msg: ToDestination) -> None:
        self._send(encode(msg))

    def recv(self) -> ToSource | None:
        while True:
            try:
                data = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return None
            try:
                return decode_to_source(data)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue  # not a receiver's answer: skip it

    def close(self) -> None:
        self.sock.close(linger=0)


def path_names(count: int) -> list[str]:
    """The names of a receiver's `count` paths, in fallback order: primary, alternate, alternate2, ..."""
    return ["primary", *(f"alternate{i}" if i > 1 else "alternate" for i in range(1, count))][:count]
