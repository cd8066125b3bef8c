"""The router's sockets to its workers: one PUSH socket to each worker, one PULL socket for every
worker's outputs and status reports and the supervisor's notices; CURVE over TCP when the workers are
on other hosts. Sends and receives bytes as msgspec messages; decides nothing about them."""

from __future__ import annotations

import contextlib
import logging

import msgspec
import zmq
import zmq.asyncio

from steadfast.control.fleet.workers import WorkerHandle, WorkerRegistry
from steadfast.wire.codec import encode
from steadfast.wire.curve import KeyFile, as_client, as_server, guard
from steadfast.wire.queues import MAX_MESSAGE_BYTES
from steadfast.wire.worker import FromWorker, WorkerRole, decode_from_worker

log = logging.getLogger(__name__)


class Hub:
    def __init__(self, registry: WorkerRegistry, output_address: str, keys: KeyFile | None = None) -> None:
        """`keys`: a router part's, whose workers are on other hosts: every queue is CURVE over TCP."""
        self.registry = registry
        self.ctx = zmq.asyncio.Context()
        self._keys = keys
        self._auth = guard(self.ctx, keys.peers) if keys is not None else None  # (before anything binds)
        self._pull = self.ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        if keys is not None:
            as_server(self._pull, keys)
        self._pull.bind(output_address)
        self._socks: dict[int, zmq.asyncio.Socket] = {}

    def add(self, worker_id: int, address: str, role: WorkerRole) -> WorkerHandle:
        """A worker to send to, known to the registry from now on."""
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        if self._keys is not None:
            as_client(sock, self._keys)
        sock.connect(address)
        self._socks[worker_id] = sock
        return self.registry.add(worker_id, address, role)

    def drop(self, worker_id: int) -> None:
        self.registry.remove(worker_id)
        sock = self._socks.pop(worker_id, None)
        if sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                sock.close(linger=0)

    async def send(self, worker: WorkerHandle, message: msgspec.Struct) -> bool:
        """Send to a worker; False (logged) when its socket is gone or refuses."""
        sock = self._socks.get(worker.worker_id)
        if sock is None:
            log.warning("worker %d has no socket: %s not sent", worker.worker_id, type(message).__name__)
            return False
        try:
            await sock.send(encode(message))
        except zmq.ZMQError as exc:
            log.warning("worker %d: %s not sent (%s)", worker.worker_id, type(message).__name__, exc)
            return False
        return True

    async def broadcast(self, message: msgspec.Struct) -> None:
        """Send `message` to every worker not dead (standbys and draining ones too)."""
        for w in [w for w in self.registry if not w.dead]:
            await self.send(w, message)

    async def receive(self) -> FromWorker:
        """The next message on the output socket (msgspec errors for a malformed one)."""
        return decode_from_worker(await self._pull.recv())

    def behind(self) -> bool:
        """Messages wait on the output socket: a starved router (on a loaded machine) has not read what
        its workers sent, so how long it last heard from one says nothing of the worker."""
        try:
            return bool(self._pull.get(zmq.EVENTS) & zmq.POLLIN)
        except zmq.ZMQError:
            return False

    def close(self) -> None:
        if self._auth is not None:
            self._auth.stop()
        self.ctx.destroy(linger=0)
