"""The delivery watermark: what one request's client has been given, and the rule that decides whether a
worker's output goes on to it (ARCHITECTURE.md invariant 4).

An output is accepted only from the request's current owner and only if it carries exactly the next
token index, so after a takeover, handoff or migration no token is sent twice and none is skipped.
Pure: no sockets, no event loop; the engine client acts on the verdict.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from steadfast.util.log import about
from steadfast.wire.worker import AddRequest, RequestOutput

log = logging.getLogger("steadfast.control.fleet.client")  # (one logger for the router's fleet I/O)


class Verdict(enum.Enum):
    FORWARD = "forward"  # new tokens, text or the finish: give it to the client
    SWALLOW = "swallow"  # regenerated tokens the client already holds: recorded, not resent
    EMPTY = "empty"  # accepted, but nothing for the client (a transfer's outcome alone)
    NOT_OWNER = "not_owner"  # from a worker that does not own the request (dead, fenced, handed off)
    MOVING = "moving"  # being taken over: no owner answers for it right now
    DUPLICATE = "duplicate"  # an index the client has already
    LATE = "late"  # from the owner before a migration, a token the client has from the new one, the same
    MISMATCH = "mismatch"  # ...and a different token: sampling is not reproducible (counted, never sent)
    GAP = "gap"  # an index past the next one: never forwarded out of order

    @property
    def accepted(self) -> bool:
        return self in (Verdict.FORWARD, Verdict.SWALLOW, Verdict.EMPTY)


@dataclass
class Watermark:
    owner: int
    delivered: list[int] = field(default_factory=list)  # token ids the client has, in order
    text_chars: int = 0  # characters of text the client has
    moving: bool = False
    skip_until: int = 0  # the client already holds tokens below this index: regenerated, not resent
    previous: int = -1  # the owner before the last handoff or migration

    def accept(self, out: RequestOutput, from_worker: int) -> Verdict:
        """Judge one output of worker `from_worker`, advancing the watermark when it is accepted."""
        if from_worker != self.owner:
            if from_worker == self.previous and out.token_ids and out.index < len(self.delivered):
                same = self.delivered[out.index : out.index + len(out.token_ids)] == out.token_ids
                return Verdict.LATE if same else Verdict.MISMATCH
            return Verdict.NOT_OWNER
        if self.moving:
            return Verdict.MOVING
        if out.token_ids and out.index != len(self.delivered):
            return Verdict.DUPLICATE if out.index < len(self.delivered) else Verdict.GAP
        self.delivered.extend(out.token_ids)
        if out.token_ids and out.index < self.skip_until and out.finish_reason is None:
            return Verdict.SWALLOW
        self.text_chars += len(out.text)
        if out.token_ids or out.text or out.finish_reason is not None:
            return Verdict.FORWARD
        return Verdict.EMPTY

    def hand_to(self, worker_id: int) -> None:
        """The request has a new owner: only its outputs count from now on, from the same index."""
        self.previous, self.owner = self.owner, worker_id
        self.moving = False


@dataclass
class Flight:
    """One request in flight: what was asked, its client's queue of outputs, and its watermark."""

    add: AddRequest
    queue: asyncio.Queue[RequestOutput]
    mark: Watermark
    # When it last moved forward (admitted, an output accepted, moved): `request_timeout` counts from it.
    progress: float = field(default_factory=time.monotonic)
    # Its last token: when it came (router's clock), when its worker's step ended (the worker's), and from
    # which worker (the health check's token gaps are per worker, by the worker's stamps).
    last_token: float = 0.0
    last_stamp: float = 0.0
    last_worker: int = -1
    retried: bool = False  # it failed or stalled on a worker once and was retried elsewhere
    # Tokens of its prompt cached on the worker it was placed on, then: the ladder's TTFT prediction
    # counts only the rest as prefill ahead of later requests.
    cached: int = 0


T = TypeVar("T")


class Quiet:
    """How long a request's caller has had nothing: each wait lasts at most `every_s` (then it may send
    a keep-alive) and none goes past `limit_s` since the last output."""

    def __init__(self, every_s: float | None, limit_s: float) -> None:
        self.every_s, self.limit_s = every_s, limit_s
        self.since = time.monotonic()

    def heard(self) -> None:
        self.since = time.monotonic()

    @property
    def over(self) -> bool:
        return time.monotonic() - self.since >= self.limit_s

    async def wait(self, ask: Callable[[], Awaitable[T]]) -> T | None:
        """`ask()`'s result, or None when this wait's time is up first. `ask` is called again on the next
        wait, so it must lose nothing when cancelled (a queue's get, a lock's acquire)."""
        left = self.limit_s - (time.monotonic() - self.since)
        if self.every_s is not None:
            left = min(left, self.every_s)
        if left <= 0:
            return None
        try:
            async with asyncio.timeout(left):
                return await ask()
        except TimeoutError:
            return None


def wanted(flights: dict[str, Flight], flight: Flight) -> Callable[[], bool]:
    """Whether `flight` still streams to a client: not ended, nor taken over by a resume of it."""
    rid = flight.add.request_id
    return lambda: flights.get(rid) is flight


def log_fault(out: RequestOutput, verdict: Verdict, held: int) -> None:
    """Say so when an output was judged a fault: a token that differs between a request's old and new
    owner, or one out of order (`held`: the tokens its client has)."""
    rid = out.request_id
    if verdict is Verdict.MISMATCH:
        log.error("request %s: token %d differs between its old and new owner", rid, out.index, extra=about(rid))
    elif verdict in (Verdict.DUPLICATE, Verdict.GAP):
        log.warning("request %s: dropped output at index %d, client has %d tokens", rid, out.index, held)
