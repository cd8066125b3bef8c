"""Recovery orchestration: when the supervisor says a worker died, move each of its requests to a live
worker (of its node first, where its sealed KV can be adopted), high priority first, a bounded number
at a time (storm control: a slot stays taken until the new owner answers).

It decides and records; the engine client carries the messages (`send`) and promotes standbys.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from steadfast.config import TakeoverConfig
from steadfast.control.fleet.delivery import Flight
from steadfast.control.fleet.placement import DECODE_ROLES, Placement
from steadfast.control.fleet.workers import WorkerHandle
from steadfast.util.log import about
from steadfast.wire.worker import AddRequest, FinishReason, RequestOutput, Resume, Route, WorkerRole

log = logging.getLogger("steadfast.control.fleet.client")

TAKEOVERS_KEPT = 1000  # records at /admin/takeovers


@dataclass
class Takeover:
    """A record of one request moved off a dead worker (exposed at /admin/takeovers)."""

    request_id: str
    from_worker: int
    to_worker: int
    at_token: int
    started: float
    first_token_s: float | None = None
    wall: float = field(default_factory=time.time)  # when, for people
    route: Route = Route.NONE
    adopted_tokens: int = 0
    recomputed_tokens: int = 0
    answered: asyncio.Event = field(default_factory=asyncio.Event)  # the new owner's first output came


class Recovery:
    def __init__(
        self,
        cfg: TakeoverConfig,
        placement: Placement,
        choose: Callable[[int, tuple[WorkerRole, ...], str], Awaitable[WorkerHandle | None]],
        send: Callable[[WorkerHandle, AddRequest], Awaitable[bool]],
    ) -> None:
        """`choose(exclude, roles, node)`: a placement that promotes a chosen standby; `send`: to a worker."""
        self.cfg = cfg
        self.placement = placement
        self._choose = choose
        self._send = send
        self._slots = asyncio.Semaphore(cfg.max_concurrent)
        self.takeovers: list[Takeover] = []
        self._pending: dict[str, Takeover] = {}

    def forget(self, request_id: str) -> None:
        """The request was moved to a worker that died before answering: its slot is free again."""
        unanswered = self._pending.pop(request_id, None)
        if unanswered is not None:
            unanswered.answered.set()

    def answered(self, out: RequestOutput) -> None:
        """The new owner's first accepted output: the takeover is done; record what it cost."""
        t = self._pending.pop(out.request_id, None)
        if t is None:
            return
        t.answered.set()
        t.first_token_s = time.monotonic() - t.started
        t.route, t.adopted_tokens, t.recomputed_tokens = out.route, out.adopted_tokens, out.recomputed_tokens
        log.info(
            "request %s taken over by worker %d at token %d: %s, %d adopted, %d recomputed, first token after %.0f ms",
            t.request_id,
            t.to_worker,
            t.at_token,
            t.route,
            t.adopted_tokens,
            t.recomputed_tokens,
            1000 * t.first_token_s,
        )

    async def move(
        self,
        flight: Flight,
        dead: int,
        still_wanted: Callable[[], bool],
        roles: tuple[WorkerRole, ...] = DECODE_ROLES,
        node: str = "",
        why: str = "its worker died and no other could take it",
    ) -> None:
        """Resume `flight` on another worker of `roles` (the first that has a ready one), of the dead
        worker's `node` if one is there; an error output when none comes within the wait."""
        rid = flight.add.request_id
        mark = flight.mark
        async with self._slots:
            if mark.owner != dead:
                # Another move took it off `dead` while this one waited for a slot (a death and a stall,
                # or two deaths, each asked for one): moving it again would move it off its new owner and
                # hold a slot the moves still queued need (the soak's seed 7: a request shuffled late by
                # stale moves, then its last move queued past its client's deadline).
                return
            deadline = time.monotonic() + self.cfg.wait_timeout
            target = await self._choose(dead, roles, node)
            while target is None and time.monotonic() <= deadline and still_wanted():
                await asyncio.sleep(0.05)
                target = await self._choose(dead, roles, node)
            if not still_wanted():
                return  # its client left meanwhile
            if target is None:
                mark.moving = False
                flight.queue.put_nowait(RequestOutput(rid, [], finish_reason=FinishReason.ERROR, error=why))
                return
            resume = Resume(list(mark.delivered), mark.text_chars, dead)
            add = AddRequest(rid, flight.add.prompt_ids, flight.add.params, flight.add.priority, resume=resume)
            record = Takeover(rid, dead, target.worker_id, len(mark.delivered), time.monotonic())
            self._pending[rid] = record
            self.takeovers.append(record)
            del self.takeovers[:-TAKEOVERS_KEPT]
            mark.hand_to(target.worker_id)
            flight.progress = time.monotonic()  # its stall clock starts again with its new owner
            target.in_flight.add(rid)
            await self._send(target, add)
            log.warning(
                "request %s: moved from worker %d, resuming on worker %d", rid, dead, target.worker_id, extra=about(rid)
            )
            # Storm control: this slot stays taken until the new owner answers (or the request ends).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(record.answered.wait(), self.cfg.wait_timeout)
            if self._pending.get(rid) is record:
                del self._pending[rid]
