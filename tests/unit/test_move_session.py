"""The move session state machine (steadfast/kv/moves/session.py): every transition, ABORT from each
state on either side, the watchdog, a lost COMMIT ack, duplicates, invalid calls, and a hypothesis
state machine that runs both sides over a lossy, reordering channel with a ledger whose answers can be
late or lost. After every step it checks that at most one side acts as the owner, and that side is the
ledger's owner. It also checks that no block is released twice or leaked.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

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
from steadfast.kv.moves.session import DestinationSession, SourceSession

pytestmark = pytest.mark.unit

S = "move-1"
C, A = MoveOutcome.COMMITTED, MoveOutcome.ABORTED


def source(kind: MoveKind = MoveKind.TRANSFER, **kw) -> SourceSession:
    return SourceSession(S, kind, timeout_s=1.0, retries=kw.pop("retries", 2), **kw)


def dest() -> DestinationSession:
    return DestinationSession(S, timeout_s=5.0)


def sent(actions: list[Action]) -> list[Message]:
    return [a.message for a in actions if isinstance(a, Send)]


def reserved_pair(n: int = 3, kind: MoveKind = MoveKind.TRANSFER, **kw) -> tuple[SourceSession, DestinationSession]:
    """A source in COPYING and a destination in RESERVED with blocks 10, 11, ... (time 0)."""
    src, dst = source(kind, **kw), dest()
    (prealloc,) = sent(src.prealloc(n, 0.0))
    assert dst.receive(prealloc, 0.0) == [Reserve(n)]
    (answer,) = sent(dst.on_granted(list(range(10, 10 + n)), 0.0))
    assert src.receive(answer, 0.0) == []
    return src, dst


def prepared_pair(n: int = 3) -> tuple[SourceSession, DestinationSession]:
    """Both sides after the final copy and the destination's ack; the source has not heard the ack yet."""
    src, dst = reserved_pair(n)
    for msg in sent(src.final_copy(0.0)) + sent(src.commit(0.0)):
        dst.receive(msg, 0.0)
    assert dst.state is DestinationState.PREPARED
    return src, dst


# --- the whole protocol, one transition at a time -----------------------------------------------------
def test_transfer_commits_with_stages_and_ownership_moves_only_when_the_ledger_records_it():
    src, dst = source(), dest()
    assert src.prealloc(3, 0.0) == [Send(Prealloc(S, 3))] and src.state is SourceState.PREALLOCATING
    assert dst.receive(Prealloc(S, 3), 0.0) == [Reserve(3)] and dst.state is DestinationState.RESERVING
    assert dst.on_granted([7, 8, 9], 0.0) == [Send(Reserved(S, (7, 8, 9)))]
    assert dst.state is DestinationState.RESERVED and dst.holds_reservation
    assert src.receive(Reserved(S, (7, 8, 9)), 0.0) == [] and src.state is SourceState.COPYING
    assert src.dest_blocks == (7, 8, 9)
    stage = src.copy_stage([1, 0], 0.1)
    assert stage == [Send(Copy(S, 0, (0, 1), False))]
    assert dst.receive(Copy(S, 0, (0, 1), False), 0.1) == [] and dst.state is DestinationState.RECEIVING
    assert src.final_copy(0.2) == [PauseRequest(), Send(Copy(S, 1, (2,), True))]
    dst.receive(Copy(S, 1, (2,), True), 0.2)
    assert src.commit(0.3) == [Send(Commit(S, 0, 2))] and src.state is SourceState.COMMITTING
    assert dst.receive(Commit(S, 0, 2), 0.3) == [Send(CommitAck(S, 0))]
    assert dst.state is DestinationState.PREPARED and not dst.owns_request
    assert src.receive(CommitAck(S, 0), 0.4) == [Decide(S, C)]
    assert src.state is SourceState.DECIDING and not src.owns_request  # in doubt: paused, keeps its blocks
    assert src.on_decided(C, 0.5) == [Send(Committed(S)), LetGo()]
    assert src.state is SourceState.COMMITTED and not src.owns_request and src.finished
    assert dst.receive(Committed(S), 0.6) == [Adopt((7, 8, 9))]
    assert dst.owns_request and dst.finished and not dst.holds_reservation


def test_handoff_has_no_blocks_and_no_copy_stages():
    src, dst = reserved_pair(0, MoveKind.HANDOFF)
    assert dst.block_ids == () and src.max_stages == 0
    with pytest.raises(MoveProtocolError):
        src.copy_stage([0], 0.0)
    assert src.final_copy(0.0) == [PauseRequest()]  # nothing left to copy: no COPY message at all
    assert src.commit(0.0) == [Send(Commit(S, 0, 0))]
    assert dst.receive(Commit(S, 0, 0), 0.0) == [Send(CommitAck(S, 0))]
    with pytest.raises(MoveProtocolError):
        source(MoveKind.HANDOFF).prealloc(2, 0.0)


def test_migration_stages_are_capped_and_the_final_copy_takes_the_rest():
    src, _ = reserved_pair(5, MoveKind.MIGRATION, max_stages=2)
    src.copy_stage([0], 0.0)
    src.copy_stage([1, 2], 0.0)
    with pytest.raises(MoveProtocolError):
        src.copy_stage([3], 0.0)
    assert src.final_copy(0.0) == [PauseRequest(), Send(Copy(S, 2, (3, 4), True))]


def test_no_room_refuses_and_the_source_keeps_the_request():
    src, dst = source(), dest()
    dst.receive(sent(src.prealloc(4, 0.0))[0], 0.0)
    refusal = dst.on_granted(None, 0.0)
    assert refusal == [Send(Abort(S, AbortReason.NO_ROOM))] and dst.state is DestinationState.ABORTED
    assert src.receive(Abort(S, AbortReason.NO_ROOM), 0.0) == [ResumeAtSource(AbortReason.NO_ROOM)]
    assert src.owns_request and src.reason is AbortReason.NO_ROOM


def test_a_partial_grant_is_given_back():
    dst = dest()
    dst.receive(Prealloc(S, 3), 0.0)
    assert dst.on_granted([4, 5], 0.0) == [Release((4, 5)), Send(Abort(S, AbortReason.NO_ROOM))]


# --- ABORT from every state, either side ---------------------------------------------------------------
def _source_in(state: str) -> tuple[SourceSession, DestinationSession]:
    if state == "idle":
        return source(), dest()
    if state == "preallocating":
        src, dst = source(), dest()
        src.prealloc(2, 0.0)
        return src, dst
    if state == "copying":
        return reserved_pair(2)
    if state == "paused":
        src, dst = reserved_pair(2)
        src.final_copy(0.0)
        return src, dst
    src, dst = prepared_pair(2)  # committing
    return src, dst


@pytest.mark.parametrize("state", ["idle", "preallocating", "copying", "paused", "committing"])
def test_source_abort_keeps_the_request_and_frees_the_reservation(state):
    src, dst = _source_in(state)
    actions = src.abort(AbortReason.REQUEST_ENDED, 1.0)
    assert actions[-1] == ResumeAtSource(AbortReason.REQUEST_ENDED)
    assert src.state is SourceState.ABORTED and src.owns_request
    assert sent(actions) == ([] if state == "idle" else [Abort(S, AbortReason.REQUEST_ENDED)])
    held = dst.block_ids
    released = [a for msg in sent(actions) for a in dst.receive(msg, 1.0)]
    assert released == ([Release(held)] if held else [])
    assert dst.state is (DestinationState.NEW if state == "idle" else DestinationState.ABORTED)
    assert src.abort(AbortReason.TIMEOUT, 2.0) == []  # idempotent


def test_source_cannot_abort_once_the_ledger_decides():
    src, dst = prepared_pair()
    src.receive(CommitAck(S, 0), 0.0)
    with pytest.raises(MoveProtocolError):
        src.abort(AbortReason.REQUEST_ENDED, 0.0)
    assert src.receive(Abort(S, AbortReason.DESTINATION_ABORT), 0.0) == []  # the ledger's answer counts
    src.on_decided(C, 0.0)
    with pytest.raises(MoveProtocolError):
        src.abort(AbortReason.REQUEST_ENDED, 0.0)


@pytest.mark.parametrize("state", ["new", "reserved", "receiving"])
def test_destination_abort_before_its_ack_releases_and_tells_the_source(state):
    src, dst = (source(), dest()) if state == "new" else reserved_pair(2)
    if state == "receiving":
        dst.receive(sent(src.copy_stage([0], 0.0))[0], 0.0)
    held = dst.block_ids
    actions = dst.abort(AbortReason.DESTINATION_ABORT, 1.0)
    assert actions == [*([Release(held)] if held else []), Send(Abort(S, AbortReason.DESTINATION_ABORT))]
    assert dst.abort(AbortReason.DESTINATION_ABORT, 1.0) == []  # released once only
    if state != "new":
        assert src.receive(sent(actions)[0], 1.0) == [ResumeAtSource(AbortReason.DESTINATION_ABORT)]


def test_destination_aborted_while_reserving_releases_the_late_grant():
    dst = dest()
    dst.receive(Prealloc(S, 2), 0.0)
    dst.receive(Abort(S, AbortReason.SOURCE_ABORT), 0.0)
    assert dst.on_granted([3, 4], 0.0) == [Release((3, 4))]
    with pytest.raises(MoveProtocolError):
        dst.on_granted([3, 4], 0.0)


@pytest.mark.parametrize("ledger", [A, C])
def test_prepared_destination_abort_goes_through_the_ledger(ledger):
    _, dst = prepared_pair(2)
    assert dst.abort(AbortReason.DESTINATION_ABORT, 1.0) == [Decide(S, A)]
    assert dst.holds_reservation  # nothing released before the ledger answers
    expected = [Adopt((10, 11))] if ledger is C else [Release((10, 11))]
    assert dst.on_decided(ledger, 1.0) == expected
    assert dst.on_decided(ledger, 1.0) == []


def test_prepared_destination_releases_on_the_sources_abort():
    src, dst = prepared_pair(2)
    assert dst.receive(Abort(S, AbortReason.TIMEOUT), 1.0) == [Release((10, 11))]
    assert dst.receive(Commit(S, 1, 1), 1.0) == [Send(Abort(S, AbortReason.TIMEOUT))]  # a straggler


# --- the watchdog and timeouts ------------------------------------------------------------------------
def test_watchdog_releases_the_reservation_of_a_vanished_source():
    _, dst = reserved_pair(2)
    assert dst.expire(5.0) == []  # quiet, but not for longer than the timeout
    assert dst.expire(5.1) == [Release((10, 11)), Send(Abort(S, AbortReason.SOURCE_VANISHED))]
    assert dst.expire(50.0) == [] and dst.reason is AbortReason.SOURCE_VANISHED
    assert dst.receive(Prealloc(S, 2), 51.0) == [Send(Abort(S, AbortReason.SOURCE_VANISHED))]  # no new grant


def test_watchdog_of_a_prepared_destination_asks_the_ledger_and_adopts_if_the_source_won():
    _, dst = prepared_pair(2)
    assert dst.expire(5.1) == [Decide(S, A)]
    assert dst.expire(5.2) == []  # asked again only after another timeout
    assert dst.expire(10.2) == [Decide(S, A)]
    assert dst.on_decided(C, 10.3) == [Adopt((10, 11))]  # the Committed message was lost


def test_lost_commit_ack_leaves_the_request_with_the_source():
    src, dst = prepared_pair(2)
    # The ack was lost. The source resends the COMMIT with backoff: 1 s, then 2 s, then 4 s.
    assert src.on_timeout(0.9) == []
    assert src.on_timeout(1.0) == [Send(Commit(S, 1, 1))]
    assert dst.receive(Commit(S, 1, 1), 1.0) == [Send(CommitAck(S, 1))]  # prepared: ack again; also lost
    assert src.on_timeout(2.9) == []
    assert src.on_timeout(3.0) == [Send(Commit(S, 2, 1))]
    assert src.on_timeout(7.0) == [Send(Abort(S, AbortReason.TIMEOUT)), ResumeAtSource(AbortReason.TIMEOUT)]
    assert src.owns_request and src.state is SourceState.ABORTED
    assert src.receive(CommitAck(S, 1), 7.5) == [Send(Abort(S, AbortReason.TIMEOUT))]  # late: free it
    assert dst.receive(Abort(S, AbortReason.TIMEOUT), 7.5) == [Release((10, 11))]


def test_destination_watchdog_wins_the_race_against_a_late_ack():
    src, dst = prepared_pair(2)
    ledger: list[MoveOutcome] = []
    (decide,) = dst.expire(6.0)
    ledger.append(decide.proposal)
    assert dst.on_decided(ledger[0], 6.0) == [Release((10, 11))]
    assert src.receive(CommitAck(S, 0), 6.5) == [Decide(S, C)]
    assert src.on_decided(ledger[0], 6.5) == [ResumeAtSource(AbortReason.DESTINATION_ABORT)]
    assert src.owns_request


def test_a_lost_ledger_answer_leaves_the_source_in_doubt_and_the_destination_may_adopt():
    src, dst = prepared_pair(2)
    (decide,) = src.receive(CommitAck(S, 0), 0.0)
    recorded = decide.proposal  # the ledger recorded COMMITTED; its answer to the source was lost
    assert not src.owns_request and not dst.owns_request  # in doubt: paused, nobody acts
    assert dst.abort(AbortReason.DESTINATION_ABORT, 0.5) == [Decide(S, A)]
    assert dst.on_decided(recorded, 0.5) == [Adopt((10, 11))]  # too late to abort: it owns the request
    assert dst.owns_request and not src.owns_request
    assert src.on_timeout(1.0) == [Decide(S, C)]
    assert src.on_decided(recorded, 1.0) == [Send(Committed(S)), LetGo()]
    assert dst.receive(Committed(S), 1.1) == []


def test_a_source_waiting_for_the_ledger_asks_again():
    src, _ = prepared_pair()
    src.receive(CommitAck(S, 0), 0.0)
    assert src.on_timeout(0.5) == [] and src.on_timeout(1.0) == [Decide(S, C)]


def test_preallocating_source_resends_then_times_out():
    src = source(retries=1)
    src.prealloc(2, 0.0)
    assert src.on_timeout(1.0) == [Send(Prealloc(S, 2))]
    assert src.on_timeout(3.0) == [Send(Abort(S, AbortReason.TIMEOUT)), ResumeAtSource(AbortReason.TIMEOUT)]


def test_missing_stages_are_resent_then_the_path_is_given_up():
    src, dst = reserved_pair(2, retries=1)
    src.copy_stage([0], 0.0)  # lost on the way
    (final,) = sent(src.final_copy(0.0))
    dst.receive(final, 0.0)
    (commit,) = sent(src.commit(0.0))
    (nack,) = sent(dst.receive(commit, 0.0))
    assert nack == CommitAck(S, 0, (0,))
    assert src.receive(nack, 0.1) == [Send(Copy(S, 0, (0,), False)), Send(Commit(S, 1, 2))]
    assert src.receive(nack, 0.1) == []  # a complaint about an older attempt
    assert src.receive(CommitAck(S, 1, (0,)), 0.2) == [
        Send(Abort(S, AbortReason.PATH_FAILED)),
        ResumeAtSource(AbortReason.PATH_FAILED),
    ]


# --- duplicates and stragglers ------------------------------------------------------------------------
def test_duplicates_are_answered_or_ignored_idempotently():
    src, dst = reserved_pair(2)
    assert dst.receive(Prealloc(S, 2), 0.0) == [Send(Reserved(S, (10, 11)))]  # no second Reserve
    assert src.receive(Reserved(S, (10, 11)), 0.0) == []
    (copy,) = sent(src.final_copy(0.0))
    assert dst.receive(copy, 0.0) == [] and dst.receive(copy, 0.0) == []
    (commit,) = sent(src.commit(0.0))
    assert dst.receive(commit, 0.0) == dst.receive(commit, 0.0) == [Send(CommitAck(S, 0))]
    assert src.receive(CommitAck(S, 0), 0.0) == [Decide(S, C)]
    assert src.receive(CommitAck(S, 0), 0.0) == []
    assert src.on_decided(C, 0.0)[-1] == LetGo() and src.on_decided(C, 0.0) == []
    assert dst.receive(Committed(S), 0.0) == [Adopt((10, 11))]
    assert dst.receive(Committed(S), 0.0) == [] and dst.receive(commit, 0.0) == [] and dst.receive(copy, 0.0) == []
    assert src.receive(Reserved(S, (10, 11)), 0.0) == [] and src.receive(Abort(S, AbortReason.TIMEOUT), 0.0) == []


# --- invalid calls ------------------------------------------------------------------------------------
def test_invalid_transitions_raise():
    src, dst = source(), dest()
    for call in (lambda: src.copy_stage([0], 0.0), lambda: src.final_copy(0.0), lambda: src.commit(0.0)):
        with pytest.raises(MoveProtocolError):
            call()
    with pytest.raises(MoveProtocolError):
        dst.on_granted([1], 0.0)  # never asked
    src, dst = reserved_pair(3)
    with pytest.raises(MoveProtocolError):
        src.prealloc(3, 0.0)
    with pytest.raises(MoveProtocolError):
        src.commit(0.0)  # before the final copy paused the request
    for bad in ([], [3], [0, 0]):
        with pytest.raises(MoveProtocolError):
            src.copy_stage(bad, 0.0)
    src.final_copy(0.0)
    with pytest.raises(MoveProtocolError):
        src.final_copy(0.0)
    with pytest.raises(MoveProtocolError):
        dst.receive(Committed(S), 0.0)  # the source cannot have decided before the ack
    with pytest.raises(MoveProtocolError):
        src.receive(Prealloc(S, 1), 0.0)  # wrong direction
    with pytest.raises(MoveProtocolError):
        dst.receive(CommitAck(S, 0), 0.0)
    with pytest.raises(MoveProtocolError):
        src.on_decided(C, 0.0)  # never asked the ledger
    with pytest.raises(MoveProtocolError):
        dst.receive(Abort("another-move", AbortReason.TIMEOUT), 0.0)


def test_the_watchdog_counts_from_the_last_message_whichever_way_it_came():
    src, dst = reserved_pair(2)
    dst.on_copy(sent(src.copy_stage([0], 4.0))[0], 4.0)  # a typed handler, not receive()
    assert dst.expire(8.9) == [] and dst.expire(9.1)[0] == Release((10, 11))


def test_contradicting_the_ledger_raises():
    src, dst = prepared_pair(1)
    dst.on_decided(C, 0.0)
    with pytest.raises(MoveProtocolError):
        dst.receive(Abort(S, AbortReason.SOURCE_ABORT), 0.0)
    src, dst = prepared_pair(1)
    dst.receive(Abort(S, AbortReason.SOURCE_ABORT), 0.0)
    with pytest.raises(MoveProtocolError):
        dst.on_decided(C, 0.0)
    with pytest.raises(MoveProtocolError):
        src.on_decided(A, 0.0)  # still COMMITTING: it never asked the ledger
    src.receive(CommitAck(S, 0), 0.0)
    src.on_decided(A, 0.0)
    with pytest.raises(MoveProtocolError):
        src.on_decided(C, 0.0)  # the ledger never changes its answer


def test_a_reserved_answer_of_the_wrong_size_raises():
    src = source()
    src.prealloc(2, 0.0)
    with pytest.raises(MoveProtocolError):
        src.receive(Reserved(S, (1,)), 0.0)


# --- both sides over a lossy, reordering channel ------------------------------------------------------
REASONS = st.sampled_from(list(AbortReason))
DISRUPTIONS = st.sampled_from(["source_aborts", "destination_aborts", "source_vanishes"])
# Rules are drawn about evenly, so one rule draws a weighted event instead: mostly deliveries and
# progress, now and then a loss, a clock jump past the watchdog, or an abort. Hypothesis favours the
# ends of a list, so both ends are deliveries.
EVENTS = st.sampled_from(
    ["deliver"] * 3
    + ["advance", "ledger", "pool", "tick", "advance", "lose", "ledger", "wait", "duplicate", "tick", "advance"]
    + ["disrupt"]
    + ["deliver"] * 3
)


class MoveMachine(RuleBasedStateMachine):
    """A source and a destination joined by a channel that loses, duplicates and reorders messages. The
    pool and the ledger (the decision record) answer late; the pool may grant only part of a request,
    and a ledger answer may be lost. The clock jumps, either side aborts, the source may vanish."""

    @initialize(kind=st.sampled_from(list(MoveKind)), n_blocks=st.integers(0, 4), spare=st.integers(-1, 2))
    def start(self, kind: MoveKind, n_blocks: int, spare: int) -> None:
        n_blocks = 0 if kind is MoveKind.HANDOFF else n_blocks
        self.now = 0.0
        self.src = SourceSession(S, kind, timeout_s=1.0, retries=2, max_stages=2)
        self.dst = DestinationSession(S, timeout_s=3.0)
        self.free = list(range(100, 100 + max(0, n_blocks + spare)))
        self.granted: set[int] = set()
        self.released: list[int] = []
        self.adopted: tuple[int, ...] | None = None
        self.decision: MoveOutcome | None = None
        self.ledger_calls: list[tuple[str, MoveOutcome]] = []  # (side, proposal) not yet applied
        self.pool_calls: list[int] = []  # blocks asked for, not yet granted
        self.wire: list[tuple[str, Message]] = []  # (to side, message)
        self.source_alive = True
        self.paused = self.let_go = 0
        self.resumed: list[AbortReason] = []
        self.do("src", self.src.prealloc(n_blocks, self.now))

    def side(self, name: str) -> SourceSession | DestinationSession:
        return self.src if name == "src" else self.dst

    def do(self, name: str, actions: list[Action]) -> None:
        for action in actions:
            match action:
                case Send(message):
                    self.wire.append(("dst" if name == "src" else "src", message))
                case Reserve(n):
                    self.pool_calls.append(n)
                case Release(ids):
                    assert name == "dst" and set(ids) <= self.granted, ids
                    assert not set(ids) & set(self.released), f"released twice: {ids}"
                    assert self.adopted is None, "released blocks in use"
                    self.released += ids
                case Decide(_, proposal):
                    self.ledger_calls.append((name, proposal))
                case PauseRequest():
                    self.paused += 1
                case ResumeAtSource(reason):
                    self.resumed.append(reason)
                case LetGo():
                    self.let_go += 1
                case Adopt(ids):
                    assert self.adopted is None and ids == self.dst.block_ids and not set(ids) & set(self.released)
                    self.adopted = ids

    def answer_pool(self) -> None:
        n = self.pool_calls.pop(0)
        grant = self.free[:n]  # all it has, which may be fewer than asked
        del self.free[:n]
        self.granted |= set(grant)
        self.do("dst", self.dst.on_granted(grant if grant or not n else None, self.now))

    def answer_ledger(self, i: int, lose_answer: bool) -> None:
        who, proposal = self.ledger_calls.pop(i % len(self.ledger_calls))
        if self.decision is None:
            self.decision = proposal  # the one compare-and-set
        if not lose_answer and (who == "dst" or self.source_alive):
            self.do(who, self.side(who).on_decided(self.decision, self.now))

    def deliver(self, i: int) -> None:
        to, msg = self.wire.pop(i % len(self.wire))
        if to == "dst" or self.source_alive:
            self.do(to, self.side(to).receive(msg, self.now))

    # --- the one rule: a weighted event, so that runs get deep into the protocol before things go wrong
    @rule(event=EVENTS, i=st.integers(0, 20), data=st.data())
    def step(self, event: str, i: int, data: st.DataObject) -> None:
        if event in ("deliver", "lose", "duplicate") and self.wire:
            if event == "deliver":
                self.deliver(i)  # any message in flight: the channel reorders
            elif event == "lose":
                del self.wire[i % len(self.wire)]
            else:
                self.wire.append(self.wire[i % len(self.wire)])
        elif event == "pool" and self.pool_calls:
            self.answer_pool()
        elif event == "ledger" and self.ledger_calls:
            self.answer_ledger(i, lose_answer=data.draw(st.sampled_from([False, False, True]), label="lose answer"))
        elif event == "advance" and self.source_alive and self.src.state is SourceState.COPYING:
            self.source_advances(data)
        elif event in ("tick", "wait"):
            self.time_passes(0.5 if event == "tick" else 4.0)  # a wait outlasts the destination's watchdog
        elif event == "disrupt":
            self.disrupt(data.draw(DISRUPTIONS, label="disruption"), data.draw(REASONS, label="reason"))

    def source_advances(self, data: st.DataObject) -> None:
        """A copy stage of some blocks not sent yet, else the final copy, else the commit."""
        src, unsent = self.src, [p for p in range(self.src.n_blocks) if p not in self.src._sent()]
        if unsent and not src.paused and len(src.copies) < src.max_stages and data.draw(st.booleans(), label="stage"):
            positions = data.draw(st.lists(st.sampled_from(unsent), min_size=1, unique=True), label="positions")
            self.do("src", src.copy_stage(positions, self.now))
        else:
            self.do("src", src.commit(self.now) if src.paused else src.final_copy(self.now))

    def time_passes(self, dt: float) -> None:
        self.now += dt
        if self.source_alive:
            self.do("src", self.src.on_timeout(self.now))
        self.do("dst", self.dst.expire(self.now))

    def disrupt(self, what: str, reason: AbortReason) -> None:
        if what == "source_aborts" and self.source_alive and self.src.can_abort:
            self.do("src", self.src.abort(reason, self.now))
        elif what == "destination_aborts" and self.dst.state is not DestinationState.NEW:
            self.do("dst", self.dst.abort(reason, self.now))
        elif what == "source_vanishes":
            self.source_alive = False

    # --- checks ---
    @invariant()
    def one_owner(self) -> None:
        src, dst, committed = self.src, self.dst, self.decision is C
        # The ledger names one owner. A side that acts as the owner is that one. The source knows the
        # ledger's answer in every state except DECIDING, where it is in doubt and acts for nobody.
        assert dst.owns_request <= committed and not (src.owns_request and dst.owns_request)
        if src.state is not SourceState.DECIDING:
            assert src.owns_request == (not committed)
        assert not (committed and dst.state is DestinationState.ABORTED)
        assert self.let_go <= 1 and len(self.resumed) <= 1 and not (self.let_go and self.resumed)
        assert self.paused == src.paused

    @invariant()
    def blocks_accounted(self) -> None:
        held = set(self.dst.block_ids) if self.dst.holds_reservation else set()
        assert held <= self.granted - set(self.released)
        assert not self.granted & set(self.free)
        if self.dst.state is DestinationState.ABORTED:
            assert set(self.released) == self.granted  # released, and nothing leaked
        if self.src.finished and self.dst.finished:
            self.check_ending()

    def check_ending(self) -> None:
        if self.src.state is SourceState.COMMITTED:
            assert self.dst.state is DestinationState.COMMITTED and self.decision is C
            assert self.adopted is not None and set(self.adopted) == self.granted and not self.released
            assert self.let_go == 1
        else:
            assert self.dst.state is not DestinationState.COMMITTED and self.decision is not C
            assert set(self.released) == self.granted and self.adopted is None and len(self.resumed) == 1

    def teardown(self) -> None:
        """No more faults: both sides must finish, consistently. Time passes only when nothing else can."""
        for _ in range(100):
            if self.pool_calls:
                self.answer_pool()
            elif self.ledger_calls:
                self.answer_ledger(0, lose_answer=False)
            elif self.wire:
                self.deliver(0)
            elif self.source_alive and self.src.state is SourceState.COPYING:
                self.do("src", self.src.commit(self.now) if self.src.paused else self.src.final_copy(self.now))
            elif (self.src.finished or not self.source_alive) and self.dst.state in (
                DestinationState.NEW,
                DestinationState.COMMITTED,
                DestinationState.ABORTED,
            ):
                break
            else:
                self.time_passes(10.0)
            self.one_owner()
            self.blocks_accounted()
        else:
            raise AssertionError(f"never settled: source {self.src.state}, destination {self.dst.state}")
        assert self.src.owns_request + self.dst.owns_request == 1 or not self.source_alive
        if self.source_alive:
            self.check_ending()
        elif self.decision is C:
            assert self.dst.owns_request and set(self.adopted or ()) == self.granted
        else:  # a vanished source keeps the request: recovery adopts it from the ledger's owner
            assert set(self.released) == self.granted and not self.dst.owns_request


TestMoveSessionStateful = MoveMachine.TestCase
TestMoveSessionStateful.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
