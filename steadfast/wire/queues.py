"""The worker's typed ZeroMQ ends of the router <-> worker queues (CURVE when they cross hosts)."""

from __future__ import annotations

import logging

import msgspec
import zmq

from steadfast.wire.codec import encode
from steadfast.wire.curve import KeyFile, as_client, as_server
from steadfast.wire.worker import ToWorker, decode_to_worker

# Largest router → worker message taken (a request's prompt ids are its bulk): a peer past it is cut off.
MAX_MESSAGE_BYTES = 64 * 2**20


class WorkerInbox:
    """The worker's end of router → worker messages (PULL, bound by the worker)."""

    def __init__(self, ctx: zmq.Context, address: str, keys: KeyFile | None = None) -> None:
        """`keys`: a node part's (the router connects over TCP; `ctx` guarded by `cluster_keys.guard`)."""
        self.sock = ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        if keys is not None:
            as_server(self.sock, keys)
        self.sock.bind(address)

    def poll(self, timeout_ms: int) -> bool:
        return bool(self.sock.poll(timeout_ms))

    def drain(self) -> list[ToWorker]:
        messages = []
        while True:
            try:
                data = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return messages
            try:
                messages.append(decode_to_worker(data))
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                # Only this user can reach the socket (it lives in the launcher's private run
                # folder), but a bad message must still never take the worker's requests down.
                logging.getLogger(__name__).error("dropped a malformed message to the worker: %s", exc)


class WorkerOutbox:
    """The worker's end of worker → router messages (PUSH, connected to the router)."""

    def __init__(self, ctx: zmq.Context, address: str, keys: KeyFile | None = None) -> None:
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 1000)
        if keys is not None:
            as_client(self.sock, keys)
        self.sock.connect(address)

    def send(self, message: msgspec.Struct) -> None:
        self.sock.send(encode(message))
