"""Taking workers out of service without failing a request (ARCHITECTURE.md §5): a drain migrates every
request on a worker away, then tells it to retire; a rollout replaces every worker in turn — its
replacement started and ready first, then the old one drained and retired.

The order of things and the waiting are decided here; the engine client owns the sockets and the flights
and hands in what this needs as callables, so this module never imports it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import msgspec
import zmq.asyncio

from steadfast.control.fleet.delivery import Flight
from steadfast.control.fleet.migration import MigrationError, MigrationReason, MigrationRecord, Migrations
from steadfast.control.fleet.rollout import Rollout, RolloutState, RolloutStep
from steadfast.control.fleet.timeline import EventKind, Timeline
from steadfast.control.fleet.workers import WorkerHandle, WorkerRegistry
from steadfast.wire.codec import encode
from steadfast.wire.worker import Retire, StartWorker

log = logging.getLogger(__name__)

DRAIN_POLL_S = 0.05  # how often a drain asks again for the requests it could not move yet
RETIRE_WAIT_S = 3600.0  # a rollout waits this long for a drained worker to exit


class Maintenance:
    def __init__(
        self,
        registry: WorkerRegistry,
        migrations: Migrations,
        owned: Callable[[int], list[Flight]],
        migrate: Callable[[str, int | None, MigrationReason], Awaitable[MigrationRecord]],
        send: Callable[[WorkerHandle, msgspec.Struct], Awaitable[bool]],
        spawn: Callable[[Coroutine[Any, Any, None]], None],
        supervisor: zmq.asyncio.Socket | None,
        timeline: Timeline,
        startup_timeout_s: float = 180.0,
    ) -> None:
        """`owned(worker)`: its requests in flight that no recovery is moving; `migrate(request, to,
        reason)`: the engine client's; `supervisor`: where new workers are asked for (None: a router
        started by hand, which cannot roll out); `timeline`: where drains and rollouts are noted;
        `startup_timeout_s`: how long a replacement worker may take to be ready."""
        self.registry, self.migrations = registry, migrations
        self._owned, self._migrate, self._send, self._spawn = owned, migrate, send, spawn
        self._supervisor = supervisor
        self._drains: dict[int, asyncio.Task[None]] = {}
        self._replacements: dict[int, int] = {}  # worker → the worker started to replace it
        self.rollout: Rollout | None = None
        self.startup_timeout_s = startup_timeout_s
        self.timeline = timeline

    # --- drain ---------------------------------------------------------------------------------
    def draining(self, worker_id: int) -> bool:
        task = self._drains.get(worker_id)
        return task is not None and not task.done()

    def drain(self, worker_id: int, force: bool = True) -> None:
        """Take worker `worker_id` out of placement, migrate every request on it away (those not movable
        yet are asked again, the ones nobody can take finish there), then tell it to retire. Unless
        `force`, refused (409) for the last worker serving its role: nothing would take new requests."""
        w = self.registry.get(worker_id)
        if w is None or w.dead:
            raise MigrationError(f"no worker {worker_id} is alive", 404)
        if not force and not w.draining and w.active and not self._others_serving(w):
            raise MigrationError(
                f"worker {worker_id} is the last serving {w.role.value} worker: drained, nothing would take new "
                "requests; drain it with force to stop serving",
                409,
            )
        w.draining = True
        if not self.draining(worker_id):
            n = len(self._owned(worker_id))
            self.timeline.note(EventKind.DRAIN, f"draining worker {worker_id}", f"{n} request(s) to move", worker_id)
            self._drains[worker_id] = asyncio.ensure_future(self._drain(w))

    def _others_serving(self, w: WorkerHandle) -> bool:
        return any(
            o.worker_id != w.worker_id and o.role == w.role and not o.dead and not o.leaving for o in self.registry
        )

    async def _drain(self, w: WorkerHandle) -> None:
        log.warning("draining worker %d: its requests migrate to other workers", w.worker_id)
        t0 = time.monotonic()
        while not w.dead:
            owned = self._owned(w.worker_id)
            if not owned:
                log.warning("worker %d drained in %.1fs; it retires", w.worker_id, time.monotonic() - t0)
                what = f"worker {w.worker_id} drained in {time.monotonic() - t0:.1f}s"
                self.timeline.note(EventKind.DRAIN, what, "it retires", w.worker_id)
                await self._send(w, Retire("drained"))
                return
            for flight in self.migrations.victims(owned)[: self.migrations.slots]:
                rid = flight.add.request_id
                if self.migrations.active(rid) is None:
                    with contextlib.suppress(MigrationError):  # none can take it now: asked again soon
                        await self._migrate(rid, None, MigrationReason.DRAIN)
            await asyncio.sleep(DRAIN_POLL_S)

    # --- rollout -------------------------------------------------------------------------------
    def joined(self, worker_id: int, like: int) -> None:
        """A worker the supervisor started to replace `like` (a rollout's)."""
        self._replacements[like] = worker_id

    def start_rollout(self) -> Rollout:
        """Replace every worker in turn (standbys too): start its replacement, wait until it is ready,
        drain the old one onto the others, wait until it retired. Raises MigrationError (409) when
        one is running, (503) when there is no supervisor to start workers."""
        if self._supervisor is None:
            raise MigrationError("this router has no supervisor to start workers (not under steadfast serve)", 503)
        if self.rollout is not None and self.rollout.state is RolloutState.RUNNING:
            raise MigrationError("a rollout is running already", 409)
        workers = sorted(w.worker_id for w in self.registry if not w.dead and not w.leaving)
        self.rollout = Rollout(workers)
        self.timeline.note(EventKind.ROLLOUT, "rollout started", f"workers {workers} to replace in turn")
        self._spawn(self._roll(self.rollout))
        return self.rollout

    async def _roll(self, r: Rollout) -> None:
        try:
            for old in r.workers:
                w = self.registry.get(old)
                if w is None or w.dead:
                    continue
                row = r.step(old)
                assert self._supervisor is not None
                await self._supervisor.send(encode(StartWorker(old)))
                new = await _until(lambda old=old: self._ready_replacement(old), self.startup_timeout_s)
                if new is None:
                    raise TimeoutError(
                        f"the replacement of worker {old} was not ready in {self.startup_timeout_s:.0f}s"
                    )
                row["new"], row["step"] = new, RolloutStep.DRAINING
                log.warning("rollout: worker %d is ready to replace worker %d", new, old)
                if self.registry.get(old) is not None:
                    self.drain(old)
                gone = await _until(lambda old=old: self.registry.get(old) is None or None, RETIRE_WAIT_S)
                if gone is None:
                    raise TimeoutError(f"worker {old} did not retire")
                row["step"], row["seconds"] = RolloutStep.RETIRED, time.monotonic() - row["t0"]
                self.timeline.note(EventKind.ROLLOUT, f"worker {old} replaced by worker {new}", worker=old)
            r.end(RolloutState.DONE)
            log.warning("rollout done: %d workers replaced in %.1fs", len(r.steps), r.seconds)
            self.timeline.note(EventKind.ROLLOUT, f"rollout done: {len(r.steps)} worker(s) in {r.seconds:.1f}s")
        except Exception as exc:  # the rollout stops where it is; every worker left serves on
            log.error("rollout failed: %s", exc)
            r.end(RolloutState.FAILED, str(exc))
            self.timeline.note(EventKind.ROLLOUT, "rollout failed", str(exc))

    def _ready_replacement(self, old: int) -> int | None:
        new = self._replacements.get(old)
        w = self.registry.get(new) if new is not None else None
        return new if w is not None and w.ready else None


async def _until(probe: Callable[[], object], timeout_s: float) -> object:
    """`probe()` once it is not None, polled; None after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = probe()
        if value is not None:
            return value
        await asyncio.sleep(DRAIN_POLL_S)
    return None
