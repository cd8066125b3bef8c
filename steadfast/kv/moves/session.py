"""The move session state machine (ARCHITECTURE.md §4): one source and one destination agree on moving a
request's KV, whatever carries the bytes (handoff, transfer, migration, offload). Pure: no sockets, threads,
clocks or ledger calls; each method takes the time `now` and returns the `Action`s its caller must perform, so
transports and tests drive it the same way. `receive` hands each message to its `on_*` method.

Ownership rule: the ledger's decision record, set once by its first writer (a compare-and-set; `Decide`). Only
the source proposes COMMITTED (that transaction also makes the destination owner of the request and its blocks),
once the destination acked the COMMIT; only an acked (PREPARED) destination proposes ABORTED, and before its ack
it releases on its own. The loser learns the decision from the same call (`on_decided`), so the owner changes at
exactly one point and `owns_request` ("may act as the owner now") is True on at most one side, the one the ledger
names. Acked (DECIDING), the source is in doubt, COMMITTED may be recorded with the answer lost: it owns nothing,
stays paused and keeps its blocks until the ledger answers (`LetGo` or `ResumeAtSource`), asking on every timeout.
A lost ack never moves ownership: the source resends the COMMIT, then after `retries` aborts without a ledger
write. A PREPARED destination releases on ABORT (the source never proposes after sending one); hearing nothing,
its watchdog proposes ABORTED and adopts if the ledger answers COMMITTED. Every granted block is adopted or
released exactly once. Callers keep finished sessions as tombstones for longer than a message can live and treat
a message for an unknown session as reaching a NEW destination, so a late PREALLOC never reserves again.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from steadfast.kv.moves.messages import (
    Abort,
    AbortReason,
    Action,
    Adopt,
    Commit,
    CommitAck,
    Committed,
    Copy,
    Decide,
    DestinationState,
    LetGo,
    Message,
    MoveKind,
    MoveOutcome,
    MoveProtocolError,
    PauseRequest,
    Prealloc,
    Release,
    Reserve,
    Reserved,
    ResumeAtSource,
    Send,
    SourceState,
)
from steadfast.kv.moves.retry import RetryPolicy


class SourceSession:
    """The side that owns the request. It drives the session. It retries PREALLOC and COMMIT with
    exponential backoff (the moves' one `RetryPolicy`: `timeout_s`, then twice that, ...) and aborts with
    TIMEOUT after `retries` resends."""

    def __init__(self, session: str, kind: MoveKind, timeout_s: float, retries: int = 3, max_stages: int = 4):
        self.session, self.kind, self.timeout_s = session, kind, timeout_s
        self.retry = RetryPolicy(retries, timeout_s)
        self.max_stages = 0 if kind is MoveKind.HANDOFF else max_stages  # copy stages before the final one
        self.state, self.n_blocks, self.paused, self.attempt, self.deadline = SourceState.IDLE, 0, False, 0, math.inf
        self.reason: AbortReason | None = None
        self.dest_blocks: tuple[int, ...] = ()
        self.copies: list[Copy] = []  # every copy stage sent, the final one included (kept for resends)

    @property
    def owns_request(self) -> bool:
        """True up to the ack, and again after an abort. In doubt while DECIDING: paused, blocks kept."""
        return self.state not in (SourceState.DECIDING, SourceState.COMMITTED)

    @property
    def finished(self) -> bool:
        return self.state in (SourceState.COMMITTED, SourceState.ABORTED)

    @property
    def can_abort(self) -> bool:
        """False once the ack arrived: from then on the ledger decides, not the source."""
        return self.state in (SourceState.IDLE, SourceState.PREALLOCATING, SourceState.COPYING, SourceState.COMMITTING)

    def prealloc(self, n_blocks: int, now: float) -> list[Action]:
        self._expect("prealloc", SourceState.IDLE)
        if n_blocks < 0 or (self.kind is MoveKind.HANDOFF and n_blocks):
            raise MoveProtocolError(f"{self.kind} cannot reserve {n_blocks} blocks")
        self.n_blocks, self.state = n_blocks, SourceState.PREALLOCATING
        self._arm(now, 0)
        return [Send(Prealloc(self.session, n_blocks))]

    def copy_stage(self, positions: Sequence[int], now: float, parts: int = 0) -> list[Action]:
        """Copy `positions` (blocks sealed since the previous stage) while the request keeps running;
        `parts`: how many data frames carry its bytes (the destination waits for each)."""
        self._expect("copy_stage", SourceState.COPYING)
        if self.paused or len(self.copies) >= self.max_stages:
            raise MoveProtocolError(f"no copy stage {len(self.copies) + 1} in {self.kind} (at most {self.max_stages})")
        sent, given = self._sent(), set(positions)
        if not given or len(given) < len(positions) or any(p in sent or not 0 <= p < self.n_blocks for p in given):
            raise MoveProtocolError(f"bad positions for a copy stage: {list(positions)}")
        return self._copy(tuple(sorted(positions)), final=False, parts=parts)

    def final_copy(self, now: float, parts: int = 0) -> list[Action]:
        """Pause the request, then copy every block not copied yet, the partial block included."""
        self._expect("final_copy", SourceState.COPYING)
        if self.paused:
            raise MoveProtocolError("final_copy twice")
        self.paused, sent = True, self._sent()
        rest = tuple(p for p in range(self.n_blocks) if p not in sent)
        return [PauseRequest(), *(self._copy(rest, final=True, parts=parts) if rest else [])]

    def commit(self, now: float) -> list[Action]:
        self._expect("commit", SourceState.COPYING)
        if not self.paused:
            raise MoveProtocolError("commit before final_copy: the request must be paused first")
        self.state = SourceState.COMMITTING
        self._arm(now, 0)
        return [Send(Commit(self.session, 0, len(self.copies)))]

    def abort(self, reason: AbortReason, now: float) -> list[Action]:
        if self.state is SourceState.ABORTED:
            return []
        if not self.can_abort:
            raise MoveProtocolError(f"abort while {self.state}: the ledger decides now")
        return self._abort(reason, tell=self.state is not SourceState.IDLE)

    def receive(self, msg: Message, now: float) -> list[Action]:
        _check_session(self.session, msg)
        if isinstance(msg, Reserved):
            return self.on_reserved(msg, now)
        if isinstance(msg, CommitAck):
            return self.on_commit_ack(msg, now)
        if isinstance(msg, Abort):
            return self.on_abort(msg, now)
        raise MoveProtocolError(f"a source does not receive {type(msg).__name__}")

    def on_reserved(self, msg: Reserved, now: float) -> list[Action]:
        if self.state is SourceState.ABORTED:  # a late grant: have it released now
            return [Send(Abort(self.session, self.reason or AbortReason.SOURCE_ABORT))]
        if self.state is not SourceState.PREALLOCATING:
            return []  # the answer to a resent PREALLOC
        if len(msg.block_ids) != self.n_blocks:
            raise MoveProtocolError(f"asked for {self.n_blocks} blocks, reserved {len(msg.block_ids)}")
        self.dest_blocks, self.state, self.deadline = msg.block_ids, SourceState.COPYING, math.inf
        return []

    def on_commit_ack(self, msg: CommitAck, now: float) -> list[Action]:
        if self.state is SourceState.ABORTED:  # the destination waits prepared: free it
            return [Send(Abort(self.session, self.reason or AbortReason.SOURCE_ABORT))]
        if self.state is not SourceState.COMMITTING:
            return []
        if not msg.missing:
            self.state = SourceState.DECIDING
            self._arm(now, 0)
            return [Decide(self.session, MoveOutcome.COMMITTED)]
        if msg.attempt != self.attempt:
            return []  # a complaint about an older attempt; the current one is already on its way
        if self.attempt >= self.retry.retries:
            return self._abort(AbortReason.PATH_FAILED, tell=True)
        self._arm(now, self.attempt + 1)
        resend = [Send(self.copies[s]) for s in msg.missing]
        return [*resend, Send(Commit(self.session, self.attempt, len(self.copies)))]

    def on_decided(self, outcome: MoveOutcome, now: float) -> list[Action]:
        if self.state is not SourceState.DECIDING:
            if self.state.value == outcome.value:
                return []  # the answer to a retried Decide
            raise MoveProtocolError(f"ledger says {outcome} to a source {self.state}")
        if outcome is MoveOutcome.COMMITTED:
            self.state, self.deadline = SourceState.COMMITTED, math.inf
            return [Send(Committed(self.session)), LetGo()]
        # The destination's watchdog gave up first. It has released, so nothing to tell it.
        return self._abort(AbortReason.DESTINATION_ABORT, tell=False)

    def on_abort(self, msg: Abort, now: float) -> list[Action]:
        if self.state in (SourceState.PREALLOCATING, SourceState.COPYING, SourceState.COMMITTING):
            return self._abort(msg.reason, tell=False)
        return []  # DECIDING: the ledger's answer is what counts; finished: a straggler

    def on_timeout(self, now: float) -> list[Action]:
        if now < self.deadline:
            return []
        if self.state is SourceState.DECIDING:
            self._arm(now, 0)
            return [Decide(self.session, MoveOutcome.COMMITTED)]
        if self.attempt >= self.retry.retries:
            return self._abort(AbortReason.TIMEOUT, tell=True)
        self._arm(now, self.attempt + 1)
        if self.state is SourceState.PREALLOCATING:
            return [Send(Prealloc(self.session, self.n_blocks))]
        return [Send(Commit(self.session, self.attempt, len(self.copies)))]

    def _copy(self, positions: tuple[int, ...], final: bool, parts: int = 0) -> list[Action]:
        self.copies.append(Copy(self.session, len(self.copies), positions, final, parts))
        return [Send(self.copies[-1])]

    def _sent(self) -> set[int]:
        return {p for copy in self.copies for p in copy.positions}

    def _arm(self, now: float, attempt: int) -> None:
        self.attempt, self.deadline = attempt, now + self.retry.wait(attempt)

    def _abort(self, reason: AbortReason, tell: bool) -> list[Action]:
        self.state, self.reason, self.deadline = SourceState.ABORTED, reason, math.inf
        return [*([Send(Abort(self.session, reason))] if tell else []), ResumeAtSource(reason)]

    def _expect(self, call: str, *states: SourceState) -> None:
        if self.state not in states:
            raise MoveProtocolError(f"{call} while {self.state}")


class DestinationSession:
    """The receiving side. It holds the reservation and, once committed, the request. `expire(now)` is
    its watchdog: a source quiet for longer than `timeout_s` is taken to be gone."""

    def __init__(self, session: str, timeout_s: float):
        self.session, self.timeout_s, self.state, self.n_blocks = session, timeout_s, DestinationState.NEW, 0
        self.reason: AbortReason | None = None
        self._grant_pending = False  # a Reserve is out: its grant must come back even if aborted meanwhile
        self.block_ids: tuple[int, ...] = ()  # granted to this session; released or adopted exactly once
        self.got: dict[int, tuple[int, ...]] = {}  # stage -> positions received
        self.last_heard = -math.inf

    @property
    def owns_request(self) -> bool:
        return self.state is DestinationState.COMMITTED

    @property
    def finished(self) -> bool:
        return self.state in (DestinationState.COMMITTED, DestinationState.ABORTED)

    @property
    def holds_reservation(self) -> bool:
        return self.state in (DestinationState.RESERVED, DestinationState.RECEIVING, DestinationState.PREPARED)

    def receive(self, msg: Message, now: float) -> list[Action]:
        _check_session(self.session, msg)
        if isinstance(msg, Prealloc):
            return self.on_prealloc(msg, now)
        if isinstance(msg, Copy):
            return self.on_copy(msg, now)
        if isinstance(msg, Commit):
            return self.on_commit(msg, now)
        if isinstance(msg, Committed):
            return self.on_committed(msg, now)
        if isinstance(msg, Abort):
            return self.on_abort(msg, now)
        raise MoveProtocolError(f"a destination does not receive {type(msg).__name__}")

    def on_prealloc(self, msg: Prealloc, now: float) -> list[Action]:
        self.heard(now)
        if self.state is DestinationState.NEW:
            self.state, self.n_blocks, self._grant_pending = DestinationState.RESERVING, msg.n_blocks, True
            return [Reserve(msg.n_blocks)]
        if self.holds_reservation:
            return [Send(Reserved(self.session, self.block_ids))]  # the source resent: reserve nothing more
        return self._refuse()

    def on_granted(self, block_ids: Sequence[int] | None, now: float) -> list[Action]:
        """The pool's answer to `Reserve`: the blocks, or None (or fewer) when there is no room."""
        if not self._grant_pending:
            raise MoveProtocolError(f"a grant nobody asked for ({self.state})")
        self._grant_pending = False
        self.heard(now)  # a slow pool is not a quiet source
        granted = tuple(block_ids or ())
        if self.state is DestinationState.ABORTED:  # aborted while the pool was being asked
            return [Release(granted)] if granted else []
        if block_ids is None or len(granted) != self.n_blocks:
            return [*([Release(granted)] if granted else []), *self._fail(AbortReason.NO_ROOM, tell=True)]
        self.block_ids, self.state = granted, DestinationState.RESERVED
        return [Send(Reserved(self.session, granted))]

    def on_copy(self, msg: Copy, now: float) -> list[Action]:
        self.heard(now)
        if self.state not in (DestinationState.RESERVED, DestinationState.RECEIVING):
            return []  # a straggler or a resend that is no longer needed
        if any(not 0 <= p < len(self.block_ids) for p in msg.positions):
            raise MoveProtocolError(f"copy to positions {list(msg.positions)} of {len(self.block_ids)} blocks")
        self.got[msg.stage], self.state = msg.positions, DestinationState.RECEIVING
        return []

    def on_commit(self, msg: Commit, now: float) -> list[Action]:
        self.heard(now)
        if self.state in (DestinationState.RESERVED, DestinationState.RECEIVING):
            missing = tuple(s for s in range(msg.stages) if s not in self.got)
            if missing:
                return [Send(CommitAck(self.session, msg.attempt, missing))]
            if sorted(p for s in range(msg.stages) for p in self.got[s]) != list(range(len(self.block_ids))):
                raise MoveProtocolError("the copy stages do not cover every reserved block exactly once")
            self.state = DestinationState.PREPARED
        if self.state is DestinationState.PREPARED:
            return [Send(CommitAck(self.session, msg.attempt))]
        return self._refuse()

    def on_committed(self, msg: Committed, now: float) -> list[Action]:
        self.heard(now)
        return self.on_decided(MoveOutcome.COMMITTED, now)

    def on_decided(self, outcome: MoveOutcome, now: float) -> list[Action]:
        if self.state is DestinationState.PREPARED:
            if outcome is MoveOutcome.COMMITTED:
                self.state = DestinationState.COMMITTED
                return [Adopt(self.block_ids)]
            return self._fail(self.reason or AbortReason.SOURCE_VANISHED, tell=False)
        if self.state.value == outcome.value:
            return []  # a duplicate COMMITTED, or the answer to a retried Decide
        raise MoveProtocolError(f"decision {outcome} reached a destination {self.state}")

    def on_abort(self, msg: Abort, now: float) -> list[Action]:
        self.heard(now)
        if self.state is DestinationState.COMMITTED:
            raise MoveProtocolError("ABORT after the ledger recorded COMMITTED")
        # A source sends ABORT only before it proposes COMMITTED, so release even when PREPARED.
        return [] if self.state is DestinationState.ABORTED else self._fail(msg.reason, tell=False)

    def abort(self, reason: AbortReason, now: float) -> list[Action]:
        """Give the move up locally (draining, shutting down)."""
        if self.state is DestinationState.PREPARED:
            self.reason = reason
            return [Decide(self.session, MoveOutcome.ABORTED)]  # the source may already have decided
        return [] if self.finished else self._fail(reason, tell=True)

    def expire(self, now: float) -> list[Action]:
        """The watchdog: act on a source that has been quiet too long."""
        if now - self.last_heard <= self.timeout_s or not self.holds_reservation:
            return []
        if self.state is DestinationState.PREPARED:
            self.last_heard = now  # ask again after another timeout if the ledger has not answered
            return self.abort(AbortReason.SOURCE_VANISHED, now)
        return self._fail(AbortReason.SOURCE_VANISHED, tell=True)

    def _fail(self, reason: AbortReason, tell: bool) -> list[Action]:
        actions: list[Action] = [Release(self.block_ids)] if self.holds_reservation and self.block_ids else []
        self.state, self.reason = DestinationState.ABORTED, reason
        return [*actions, *([Send(Abort(self.session, reason))] if tell else [])]

    def heard(self, now: float) -> None:
        """The source is alive (a data frame of this session arrived): the watchdog waits again."""
        self.last_heard = max(self.last_heard, now)

    def _refuse(self) -> list[Action]:
        if self.state is DestinationState.ABORTED:
            return [Send(Abort(self.session, self.reason or AbortReason.DESTINATION_ABORT))]
        return []


def _check_session(session: str, msg: Message) -> None:
    if msg.session != session:
        raise MoveProtocolError(f"a message of session {msg.session} reached session {session}")
