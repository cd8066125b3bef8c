"""The router's view of its workers: send requests over ZeroMQ, route outputs back to each caller.

One PULL socket receives every worker's outputs and status reports; one PUSH socket per worker sends
requests. A caller iterates `generate()`; leaving the iteration early (client gone) aborts the request
on its worker. A worker that stops reporting is marked dead and its requests end with an error,
never silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from steadfast import protocol
from steadfast.protocol import AbortRequest, AddRequest, RequestOutput, StepOutputs, WorkerStatus

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """No worker can take the request, or the worker serving it died."""


@dataclass
class WorkerHandle:
    worker_id: int
    address: str
    sock: zmq.asyncio.Socket
    status: WorkerStatus | None = None
    last_seen: float = 0.0
    dead: bool = False
    in_flight: set[str] = field(default_factory=set)

    @property
    def ready(self) -> bool:
        return not self.dead and self.status is not None and self.status.state == "ready"

    @property
    def load(self) -> int:
        # Requests the router sent that the worker has not finished, whatever its last report says.
        return len(self.in_flight)


class EngineClient:
    def __init__(self, worker_addresses: list[str], output_address: str, status_interval_s: float) -> None:
        self.ctx = zmq.asyncio.Context()
        self.output_address = output_address
        self.status_interval_s = status_interval_s
        self._pull = self.ctx.socket(zmq.PULL)
        self._pull.bind(output_address)
        self.workers: list[WorkerHandle] = []
        for i, address in enumerate(worker_addresses):
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            self.workers.append(WorkerHandle(i, address, sock))
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._owner: dict[str, WorkerHandle] = {}
        self._tasks: list[asyncio.Task[None]] = []

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
        return bool(self.workers) and all(w.ready for w in self.workers)

    def _pick(self) -> WorkerHandle:
        candidates = [w for w in self.workers if w.ready]
        if not candidates:
            raise EngineDeadError("no worker is ready")
        return min(candidates, key=lambda w: (w.load, w.worker_id))

    async def generate(self, request: AddRequest) -> AsyncIterator[RequestOutput]:
        """Outputs of one request, in order, ending with the one that carries a finish_reason."""
        worker = self._pick()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        rid = request.request_id
        self._queues[rid] = queue
        self._owner[rid] = worker
        worker.in_flight.add(rid)
        finished = False
        try:
            await worker.sock.send(protocol.encode(request))
            while True:
                out = await queue.get()
                finished = out.finish_reason is not None
                yield out
                if finished:
                    return
        finally:
            self._queues.pop(rid, None)
            self._owner.pop(rid, None)
            worker.in_flight.discard(rid)
            if not finished and not worker.dead:
                await self.abort(worker, rid)

    async def abort(self, worker: WorkerHandle, request_id: str) -> None:
        with contextlib.suppress(zmq.ZMQError):
            await worker.sock.send(protocol.encode(AbortRequest([request_id])))

    async def _receive(self) -> None:
        while True:
            msg = protocol.decode_from_worker(await self._pull.recv())
            if isinstance(msg, StepOutputs):
                for out in msg.outputs:
                    queue = self._queues.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(out)
                    if out.finish_reason is not None:
                        self.workers[msg.worker_id].in_flight.discard(out.request_id)
                self.workers[msg.worker_id].last_seen = time.monotonic()
            elif isinstance(msg, WorkerStatus):
                w = self.workers[msg.worker_id]
                w.status, w.last_seen = msg, time.monotonic()
                if w.dead and msg.state == "ready":
                    log.warning("worker %d reports again; taking it back", w.worker_id)
                    w.dead = False

    async def _watch(self) -> None:
        """Declare a worker dead after several missed reports and fail what it was serving."""
        limit = max(5 * self.status_interval_s, 3.0)
        while True:
            await asyncio.sleep(self.status_interval_s)
            now = time.monotonic()
            for w in self.workers:
                if w.status is None or w.dead or w.status.state == "loading":
                    continue
                if now - w.last_seen > limit:
                    w.dead = True
                    log.error(
                        "worker %d silent for %.1fs: failing its %d requests",
                        w.worker_id,
                        now - w.last_seen,
                        len(w.in_flight),
                    )
                    self.fail_worker(w, "the worker serving this request stopped responding")

    def fail_worker(self, worker: WorkerHandle, why: str) -> None:
        for rid in list(worker.in_flight):
            queue = self._queues.get(rid)
            if queue is not None:
                queue.put_nowait(RequestOutput(rid, [], finish_reason="error", error=why))
        worker.in_flight.clear()
