"""Stream resumption: what to send so a client reconnecting with `Last-Event-ID` continues where it is.

The router's own record of a request that stopped streaming (finished, or its client left) is kept for
the idempotency window; past it, or after a router restart, the newest checkpoint among the nodes'
ledgers stands in. What a record lacks is regenerated (fixed seed per token index), never resent.
Resumptions of one request take turns (`Turns`), the newest winning.
"""

from __future__ import annotations

import asyncio
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from steadfast.control.fleet.delivery import Flight
from steadfast.kv.ledger.interface import LedgerError, RequestCheckpoint
from steadfast.kv.ledger.open import open_ledger
from steadfast.wire.worker import AddRequest, Resume, SamplingParams


class UnknownRequestError(KeyError):
    """A Last-Event-ID names a request this router does not know (never, or no longer)."""


@dataclass
class Retired:
    """A request no longer streaming, kept for a reconnect: only what continuing it takes, its token ids
    packed (4 bytes each, where a list of ints costs ~36)."""

    request_id: str
    prompt: array
    params: SamplingParams
    priority: int
    delivered: array
    until: float  # monotonic deadline of the idempotency window

    def known(self) -> Known:
        add = AddRequest(self.request_id, self.prompt.tolist(), self.params, self.priority)
        return Known(add, self.delivered.tolist(), -1)  # (its stream already stopped it)


@dataclass(frozen=True)
class Known:
    """What is known of a request to resume: as asked, the tokens on record, and who last ran it."""

    add: AddRequest
    tokens: list[int]
    owner: int  # -1: no live worker to stop


class Resumption:
    def __init__(
        self,
        window_s: float,
        ledger_urls: list[str] | tuple[str, ...] = (),
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        """`ledger_urls`: each node's ledger, where a restarted router finds requests it never saw.
        `wall_clock`: the ledgers' time (rows are stamped by other processes)."""
        self.window_s = window_s
        self.wall_clock = wall_clock
        self.ledger_urls = list(ledger_urls)
        self._retired: dict[str, Retired] = {}

    def retire(self, flight: Flight) -> None:
        now = time.monotonic()
        self.expire(now)
        add = flight.add
        delivered = array("i", flight.mark.delivered)
        self._retired.pop(add.request_id, None)  # (re-inserted last: the records stay in deadline order)
        self._retired[add.request_id] = Retired(
            add.request_id, array("i", add.prompt_ids), add.params, add.priority, delivered, now + self.window_s
        )

    def expire(self, now: float) -> None:
        """Forget the records past the window (the router's watch loop calls this each round, so that
        what they hold is let go on time however quiet the router is)."""
        while self._retired:
            request_id, oldest = next(iter(self._retired.items()))
            if oldest.until >= now:
                return
            del self._retired[request_id]

    def forget(self, request_id: str) -> None:
        self._retired.pop(request_id, None)

    def lookup(self, request_id: str) -> Known:
        """The router's record within the window, else the ledgers'; UnknownRequestError if neither."""
        known = self._retired.get(request_id)
        if known is not None and known.until >= time.monotonic():
            return known.known()
        return self._from_ledger(request_id)

    @staticmethod
    def request(known: Known, have_tokens: int, have_chars: int, params: SamplingParams | None = None) -> AddRequest:
        """The request that continues a client holding `have_tokens` tokens and `have_chars` characters
        (`params`: in place of the known ones, e.g. asking the prompt's logprobs again)."""
        add = known.add
        resume = Resume(list(known.tokens[:have_tokens]), have_chars)
        return AddRequest(add.request_id, add.prompt_ids, params or add.params, add.priority, resume=resume)

    def _from_ledger(self, request_id: str) -> Known:
        """The request's newest checkpoint among the nodes' ledgers (a request decoded on another
        node than its prefill left a row there too, until the prefill worker let it go)."""
        best: RequestCheckpoint | None = None
        for url in self.ledger_urls:
            try:
                ledger = open_ledger(url)
            except LedgerError:
                continue  # a node's ledger unreadable now: the others may know the request
            try:
                ck = ledger.request(request_id)
            finally:
                ledger.close()
            if ck is None or not ck.prompt_ids:
                continue  # (no prompt: its body is still being written)
            if ck.phase == "finished" and self.wall_clock() - ck.updated_at > self.window_s:
                continue  # (a finished request's row outlives the window only until the pool prunes it)
            if best is None or len(ck.generated_ids) > len(best.generated_ids):
                best = ck
        if best is None:
            raise UnknownRequestError(request_id)
        params = msgspec.json.decode(best.params, type=SamplingParams)
        owner = int(best.owner.removeprefix("worker")) if (best.owner or "").startswith("worker") else -1
        return Known(AddRequest(request_id, best.prompt_ids, params), list(best.generated_ids), owner)


@dataclass
class Turn:
    """One request's resumptions: a lock held from stopping its old runs to its new flight's send, and
    the number of the newest resume to ask for it."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    newest: int = 0
    users: int = 0  # resumes waiting or holding: the turn is forgotten when none is left


class Turns:
    """Resumptions of one request one at a time, the newest winning: a client that reconnects several
    times at once (a retry while its first resume is still under way, or ten) gets one stream that
    carries on, and every other resume ends at once with an error; none waits for tokens that go to
    another connection. A resume that waited while a newer one arrived gives its turn up unsent."""

    def __init__(self) -> None:
        self._turns: dict[str, Turn] = {}

    def enter(self, request_id: str) -> tuple[Turn, int]:
        """The request's turn and this resume's number in it (compare with `Turn.newest`)."""
        turn = self._turns.setdefault(request_id, Turn())
        turn.newest += 1
        turn.users += 1
        return turn, turn.newest

    def leave(self, request_id: str, turn: Turn) -> None:
        turn.users -= 1
        if not turn.users and self._turns.get(request_id) is turn:
            del self._turns[request_id]

    def __len__(self) -> int:
        return len(self._turns)
