"""The router's stop (SIGTERM, SIGINT): new calls are refused while the streams in flight finish; past
`server.shutdown_timeout` (or at a second signal) what is left ends with an error event; then uvicorn
exits and the process with code 0.

Uvicorn's own handler would close every connection at the first signal and re-raise the signal once
stopped (the process would die of it). `GracefulServer` only tells `Shutdown`, which the guard reads to
refuse calls, and `Shutdown.drain` runs the rest.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

if TYPE_CHECKING:
    from steadfast.control.fleet.client import EngineClient

log = logging.getLogger(__name__)

ENDED = "the server shut down before this request finished"
POLL_S = 0.05
FLUSH_S = 2.0  # for the ended streams to send their error event and close


class Phase(enum.Enum):
    SERVING = "serving"
    DRAINING = "draining"  # new /v1 calls refused; the calls in flight go on
    ENDING = "ending"  # past the timeout, or told twice: what is left ends with an error event


class Shutdown:
    """Where the router's stop is. The guard refuses new /v1 calls once it has begun and counts those it
    let through (one still being tokenized is no request in flight yet, but will be one)."""

    def __init__(self) -> None:
        self.phase = Phase.SERVING
        self.signals = 0
        self.calls = 0
        self._asked = asyncio.Event()

    @property
    def refusing(self) -> bool:
        return self.phase is not Phase.SERVING

    def ask(self) -> None:
        """Begin the stop; asked again, end what is left now. Called in the event loop."""
        self.signals += 1
        if self.phase is Phase.SERVING:
            self.phase = Phase.DRAINING
        self._asked.set()

    async def drain(self, client: EngineClient, server: uvicorn.Server, timeout_s: float) -> None:
        """Wait to be asked, then for the calls in flight to end (at most `timeout_s`); end the rest
        with an error event, give them a moment to send it, and make `server` exit."""
        await self._asked.wait()
        log.info("stopping: new requests are refused; %d in flight get %.0fs to finish", client.pending, timeout_s)
        deadline = time.monotonic() + timeout_s
        while self._busy(client) and time.monotonic() < deadline and self.signals < 2:
            await asyncio.sleep(POLL_S)
        if self._busy(client):
            self.phase = Phase.ENDING
            ended: set[str] = set()
            if count := await self._end(client, ended):
                log.warning("%d request(s) still running at shutdown ended with an error", count)
            flush_deadline = time.monotonic() + FLUSH_S
            while self._busy(client) and time.monotonic() < flush_deadline:
                if any(rid not in ended for w in client.workers for rid in w.in_flight):
                    await self._end(client, ended)  # admitted meanwhile: it was being tokenized
                await asyncio.sleep(POLL_S)
        server.should_exit = True

    def _busy(self, client: EngineClient) -> bool:
        return client.pending > 0 or self.calls > 0

    async def _end(self, client: EngineClient, ended: set[str]) -> int:
        """End every request in flight (adding their ids to `ended`); return how many there were."""
        owned = [(w, rid) for w in client.workers for rid in w.in_flight if rid not in ended]
        count = client.end_all(ENDED)
        # `end_all`'s error event is each stream's finish, so nothing aborts the requests on their
        # workers: tell the owners, or they compute on for closed streams (and a worker stopped next
        # would wait for them).
        for worker, rid in owned:
            ended.add(rid)
            await client.abort(worker, rid)
        return count


class GracefulServer(uvicorn.Server):
    """Uvicorn's server, stopped by `Shutdown.drain` rather than at the first signal."""

    def __init__(self, config: uvicorn.Config, shutdown: Shutdown) -> None:
        super().__init__(config)
        self.stopping = shutdown  # (not `shutdown`: that is uvicorn's own method)
        self._loop = asyncio.get_running_loop()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler runs between any two steps of the loop: the state changes in the loop.
        self._loop.call_soon_threadsafe(self.stopping.ask)
