"""The KV receiver's sockets: one ZeroMQ ROUTER per path, bound only once CURVE's check runs (when there
are keys), and a plain data channel beside each for sealed bytes. Never reads a message: the receiver's
thread does."""

from __future__ import annotations

import zmq

from steadfast.kv.arena.spec import ArenaSpec
from steadfast.kv.moves.checks import max_message_bytes
from steadfast.wire import curve
from steadfast.wire.curve import KeyFile, TransferSide

DATA_RCVHWM = 16  # messages a data channel buffers unread (each at most one layer of the arena)


class ReceiverSockets:
    def __init__(self, spec: ArenaSpec, addresses: list[str], keys: KeyFile | None) -> None:
        """`addresses`: one per path (`tcp://host:0` takes a free port; `self.addresses` names it)."""
        # A context of its own: the ZAP handler that checks CURVE clients serves one context, and a
        # receiver's must answer for its sockets only. It runs before any socket binds (none unchecked).
        self.ctx = zmq.Context()
        self.auth = curve.guard(self.ctx, keys.expect(TransferSide.RECEIVE).peers) if keys is not None else None
        self.socks: list[zmq.Socket] = []
        self.addresses: list[str] = []
        for address in addresses:
            sock = self.ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            # Bigger than one layer of the whole arena is no frame: libzmq drops it with its connection
            # from the length in its header, before buffering it.
            sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes(spec))
            # A source that reconnects with its routing id (the sender's paths keep one) keeps its sessions.
            sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
            if keys is not None:
                curve.as_server(sock, keys)
            if address.endswith(":0"):
                host = address.rsplit(":", 1)[0]
                address = f"{host}:{sock.bind_to_random_port(host)}"
            else:
                sock.bind(address)
            self.socks.append(sock)
            self.addresses.append(address)
        # With CURVE, a plain socket beside each: sessions whose source sent a key move their bytes there
        # sealed (`kv/moves/seal.py`), without CURVE's cost. Anyone may connect; nothing unsealed is read.
        self.data_socks: list[zmq.Socket] = []
        self.data_port: dict[zmq.Socket, int] = {}  # a path's socket → the port of its data channel
        for sock, address in zip(self.socks, self.addresses, strict=True) if keys is not None else ():
            data = self.ctx.socket(zmq.PULL)
            data.setsockopt(zmq.LINGER, 0)
            data.setsockopt(zmq.MAXMSGSIZE, max_message_bytes(spec))
            data.setsockopt(zmq.RCVHWM, DATA_RCVHWM)  # what an unauthenticated peer can make us buffer
            self.data_port[sock] = data.bind_to_random_port(address.rsplit(":", 1)[0])
            self.data_socks.append(data)

    def close(self) -> None:
        for sock in self.socks + self.data_socks:
            sock.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()
