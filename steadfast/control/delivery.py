"""The delivery watermark: what one request's client has been given, and the rule that decides whether a
worker's output goes on to it (ARCHITECTURE.md invariant 4).

An output is accepted only from the request's current owner and only if it carries exactly the next
token index, so after a takeover, handoff or migration no token is sent twice and none is skipped.
Pure: no sockets, no event loop; the engine client acts on the verdict.
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field

from steadfast.protocol import AddRequest, RequestOutput


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
