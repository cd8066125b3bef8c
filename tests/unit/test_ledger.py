"""The ledger on every backend: leases and fencing epochs, block states, checkpoints, use from many
threads, and a history checker; and what is SQLite's own (an old file, a busy database)."""

from __future__ import annotations

import json
import sqlite3
import threading
import time

import pytest

from steadfast.kv.ledger.history import DIED, Op, RecordingLedger, check_history, load_journal
from steadfast.kv.ledger.interface import (
    BlockState,
    FencedError,
    LeaseHeldError,
    LeaseState,
    LedgerError,
    LedgerUnavailableError,
    RequestCheckpoint,
)
from steadfast.kv.ledger.open import open_ledger
from steadfast.kv.ledger.sqlite import SqliteLedger
from steadfast.kv.moves.messages import MoveOutcome
from tests.unit.conftest import lapse, ledger_url_in

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def ledger(ledger_factory, clock):
    led = ledger_factory(clock=clock)
    led.format(8)
    return led


def test_epochs_strictly_increase_and_fence_blocks_every_write(ledger, clock):
    a = ledger.acquire_lease("w0", pid=11, ttl_s=5)
    b = ledger.acquire_lease("w1", pid=12, ttl_s=5)
    assert b.epoch > a.epoch
    blocks = ledger.grant("w0", a.epoch, 3)
    assert blocks == [0, 1, 2]
    new = ledger.fence("w0")
    assert new > b.epoch
    for write in (
        lambda: ledger.renew_lease("w0", a.epoch, 5),
        lambda: ledger.grant("w0", a.epoch, 1),
        lambda: ledger.authorize_write("w0", a.epoch, 0),
        lambda: ledger.seal("w0", a.epoch, [(0, b"h")]),
        lambda: ledger.free("w0", a.epoch, [0]),
        lambda: ledger.checkpoint("w0", a.epoch, []),
    ):
        with pytest.raises(FencedError):
            write()
    # Guessing the new epoch does not help: the lease is fenced, not active.
    with pytest.raises(FencedError):
        ledger.grant("w0", new, 1)
    assert ledger.check_integrity() == []


def test_expired_lease_refuses_writes_before_anyone_fences_it(ledger, clock):
    lease = ledger.acquire_lease("w0", 1, ttl_s=5)
    clock.now += 4
    ledger.renew_lease("w0", lease.epoch, 5)
    lapse(ledger, "w0", clock)
    assert ledger.lease("w0").state == LeaseState.ACTIVE and ledger.lease("w0").expires < clock.now
    with pytest.raises(FencedError, match="expired"):
        ledger.grant("w0", lease.epoch, 1)
    with pytest.raises(FencedError):
        ledger.renew_lease("w0", lease.epoch, 5)  # cannot renew its way back


def test_an_etcd_lease_expires_on_etcds_clock(ledger_factory, ledger_backend):
    """Not the test's clock: etcd ends the lease at its TTL, and from then on etcd refuses the writes."""
    if ledger_backend != "etcd":
        pytest.skip("SQLite's leases run on the process's clock (the tests above move it)")
    ledger = ledger_factory(clock=Clock())  # a clock that never moves
    ledger.format(2)
    lease = ledger.acquire_lease("w0", 1, ttl_s=1)
    assert ledger.grant("w0", lease.epoch, 1) == [0]
    deadline = time.monotonic() + 10
    while ledger.lease("w0").expires > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    with pytest.raises(FencedError, match="expired"):
        ledger.grant("w0", lease.epoch, 1)
    with pytest.raises(FencedError):
        ledger.renew_lease("w0", lease.epoch, 1)
    assert ledger.acquire_lease("w1", 2, ttl_s=5).epoch > lease.epoch


def test_a_live_lease_cannot_be_taken_twice(ledger, clock):
    ledger.acquire_lease("w0", 1, ttl_s=5)
    with pytest.raises(LeaseHeldError):
        ledger.acquire_lease("w0", 2, ttl_s=5)
    lapse(ledger, "w0", clock)
    assert ledger.acquire_lease("w0", 2, ttl_s=5).pid == 2


def test_block_lifecycle_and_reclaim_after_fence(ledger, clock):
    lease = ledger.acquire_lease("w0", 1, ttl_s=5)
    e = lease.epoch
    assert ledger.grant("w0", e, 3) == [0, 1, 2]
    ledger.seal("w0", e, [(0, b"h0"), (1, b"h1")])
    with pytest.raises(LedgerError):
        ledger.seal("w0", e, [(0, b"again")])  # sealed blocks never change
    with pytest.raises(LedgerError):
        ledger.authorize_write("w0", e, 1)
    ledger.authorize_write("w0", e, 2)
    ledger.free("w0", e, [1])
    with pytest.raises(LedgerError):
        ledger.reclaim("w0")  # not fenced: nothing is taken on suspicion
    ledger.fence("w0")
    sealed, quarantined = ledger.reclaim("w0")
    assert (sealed, quarantined) == ([0], [2])
    states = {b.block_id: b.state for b in ledger.blocks()}
    assert states[0] == BlockState.SEALED and states[1] == BlockState.FREE and states[2] == BlockState.QUARANTINED
    assert ledger.check_integrity() == []


def test_sealed_blocks_are_found_by_token_name_until_unsealed_or_freed(ledger, clock):
    e = ledger.acquire_lease("w0", 1, ttl_s=5).epoch
    assert ledger.grant("w0", e, 4) == [0, 1, 2, 3]
    ledger.seal("w0", e, [(0, b"h0", b"n0"), (1, b"h1", b"n1"), (2, b"h2", b"n0"), (3, b"h3")])
    found = ledger.sealed_with_content([b"n0", b"n1", b"n0", b"nx"])
    assert [(b.block_id, b.hash, b.content) for b in found] == [(0, b"h0", b"n0"), (1, b"h1", b"n1"), (2, b"h2", b"n0")]
    ledger.unseal("w0", e, [0])
    ledger.free("w0", e, [1])
    assert [b.block_id for b in ledger.sealed_with_content([b"n0", b"n1"])] == [2]
    assert [b.content for b in ledger.blocks()][:4] == [None, None, b"n0", None]
    ledger.fence("w0")
    ledger.reclaim("w0")
    e2 = ledger.acquire_lease("w1", 2, ttl_s=5).epoch
    assert [b.owner for b in ledger.sealed_with_content([b"n0"])] == [None]  # ownerless, still named
    # Granted as a fresh block (nobody adopted it), the name goes with the old bytes' meaning.
    assert 2 in ledger.grant("w1", e2, 8)
    assert ledger.sealed_with_content([b"n0"]) == []


def test_a_ledger_file_from_before_token_names_gains_the_column(tmp_path):
    path = str(tmp_path / "old.db")
    db = sqlite3.connect(path)
    db.execute(
        "CREATE TABLE blocks (id INTEGER PRIMARY KEY, state TEXT NOT NULL, owner TEXT, epoch INTEGER, "
        "request TEXT, refs INTEGER NOT NULL DEFAULT 0, hash BLOB, tier TEXT)"
    )
    db.executemany("INSERT INTO blocks (id, state) VALUES (?, 'FREE')", ((i,) for i in range(4)))
    db.commit()
    db.close()
    led = SqliteLedger(path)
    led.format(4)
    e = led.acquire_lease("w0", 1, ttl_s=5).epoch
    led.grant("w0", e, 1)
    led.seal("w0", e, [(0, b"h", b"n")])
    assert [b.block_id for b in led.sealed_with_content([b"n"])] == [0]
    led.close()


def test_a_replaced_arena_fences_every_lease_and_voids_every_block(ledger, clock):
    e0 = ledger.acquire_lease("w0", 1, ttl_s=5).epoch
    e1 = ledger.acquire_lease("w1", 2, ttl_s=5).epoch
    ledger.grant("w0", e0, 3)
    ledger.seal("w0", e0, [(0, b"h0")])
    ledger.grant("w1", e1, 2)
    ledger.checkpoint("w1", e1, [RequestCheckpoint("r", [1, 2], "{}", [3], 1, "decode", [3, 4])])
    ledger.arena_replaced()  # a device arena died with its daemon: none of those bytes exist any more
    leases = {lease.worker: lease for lease in ledger.leases()}
    assert leases["w0"].epoch > e1 and leases["w1"].epoch > leases["w0"].epoch
    assert {lease.state for lease in leases.values()} == {LeaseState.FENCED}
    assert all(b.state == BlockState.FREE and b.owner is None and b.hash is None for b in ledger.blocks())
    with pytest.raises(FencedError):
        ledger.grant("w0", e0, 1)
    assert ledger.request("r") is not None  # the token ids stay: enough to rebuild, never to adopt
    assert ledger.check_integrity() == []


def test_a_move_is_decided_once_and_a_retried_call_hears_the_same_answer(ledger, clock):
    """The decision record behind every KV move session: the first proposal wins (compare-and-set), a later
    or retried one gets the recorded outcome; a fenced writer records nothing; a handoff records its move
    COMMITTED in the same transaction that changes the owner, and one decided ABORTED moves no block."""
    C, A = MoveOutcome.COMMITTED, MoveOutcome.ABORTED
    w0 = ledger.acquire_lease("w0", pid=1, ttl_s=5)
    w1 = ledger.acquire_lease("w1", pid=2, ttl_s=5)
    assert ledger.move_decision("r/0") is None
    assert ledger.decide_move("w1", w1.epoch, "r/0", C) is C
    assert ledger.decide_move("w1", w1.epoch, "r/0", A) is C  # the watchdog comes too late: committed stands
    assert ledger.decide_move("w1", w1.epoch, "r/1", A) is A
    assert ledger.decide_move("w1", w1.epoch, "r/1", C) is A
    assert ledger.move_decision("r/0") is C and ledger.move_decision("r/1") is A
    ledger.fence("w1")
    with pytest.raises(FencedError):
        ledger.decide_move("w1", w1.epoch, "r/2", C)
    assert ledger.move_decision("r/2") is None
    blocks = ledger.grant("w0", w0.epoch, 2)
    w2 = ledger.acquire_lease("w2", pid=3, ttl_s=5)
    ledger.hand_over("w0", w0.epoch, blocks, "w2", move="h/0")
    assert ledger.move_decision("h/0") is C
    assert {b.owner for b in ledger.blocks() if b.block_id in blocks} == {"w2"}
    more = ledger.grant("w0", w0.epoch, 1)
    assert ledger.decide_move("w2", w2.epoch, "h/1", A) is A
    with pytest.raises(LedgerError):
        ledger.hand_over("w0", w0.epoch, more, "w2", move="h/1")
    assert {b.owner for b in ledger.blocks() if b.block_id in more} == {"w0"}


def test_grant_returns_what_is_free(ledger):
    e = ledger.acquire_lease("w0", 1, 5).epoch
    assert ledger.grant("w0", e, 6) == list(range(6))
    assert ledger.grant("w0", e, 6) == [6, 7]
    assert ledger.grant("w0", e, 6) == []


def test_checkpoints_round_trip_and_are_owned(ledger):
    e0 = ledger.acquire_lease("w0", 1, 5).epoch
    e1 = ledger.acquire_lease("w1", 2, 5).epoch
    rec = RequestCheckpoint("r1", [1, 2, 3], '{"seed": 7}', [9, 8], delivered=2, phase="decode", block_table=[4, 5])
    ledger.checkpoint("w0", e0, [rec])
    got = ledger.request("r1")
    assert (got.prompt_ids, got.generated_ids, got.delivered, got.block_table) == ([1, 2, 3], [9, 8], 2, [4, 5])
    assert (got.owner, got.epoch, got.phase) == ("w0", e0, "decode")
    moved = RequestCheckpoint("r1", [1, 2, 3], '{"seed": 7}', [9, 8, 7], delivered=3, phase="decode")
    ledger.checkpoint("w1", e1, [moved])  # not w1's: w0 runs it, live
    assert ledger.request("r1").owner == "w0"
    ledger.hand_over("w0", e0, [], "w1", request_id="r1")  # now it is w1's
    ledger.checkpoint("w1", e1, [moved])
    ledger.checkpoint("w0", e0, [rec])  # the old owner's stale view is skipped, not written over it
    got = ledger.request("r1")
    assert (got.owner, got.epoch, got.generated_ids) == ("w1", e1, [9, 8, 7])
    assert [r.request_id for r in ledger.requests("w1")] == ["r1"] and ledger.requests("w0") == []


def test_a_standby_with_an_older_epoch_takes_over_the_checkpoints_of_a_dead_owner(ledger, clock):
    """The standby registered before the worker it replaces, so its epoch is lower than the dead owner's:
    its checkpoints must still land (the router resumes from them after a restart)."""
    standby = ledger.acquire_lease("standby", 1, 5).epoch
    owner = ledger.acquire_lease("w0", 2, 5).epoch
    assert standby < owner
    ledger.checkpoint("w0", owner, [RequestCheckpoint("r", [1, 2], "{}", [3], 1, "decode")])
    ledger.fence("w0")
    ledger.reclaim("w0")
    ledger.checkpoint("standby", standby, [RequestCheckpoint("r", [1, 2], "{}", [3, 4, 5], 3, "decode")])
    got = ledger.request("r")
    assert (got.owner, got.epoch, got.generated_ids) == ("standby", standby, [3, 4, 5])
    with pytest.raises(FencedError):  # the dead owner's own stale epoch stays refused
        ledger.checkpoint("w0", owner, [RequestCheckpoint("r", [1, 2], "{}", [3], 1, "finished")])
    # Its name registered again (a new incarnation, a new epoch): the standby's row is not its to write.
    again = ledger.acquire_lease("w0", 3, 5).epoch
    ledger.checkpoint("w0", again, [RequestCheckpoint("r", [1, 2], "{}", [3], 1, "decode")])
    assert ledger.request("r").owner == "standby"


def test_a_row_its_live_owner_finished_or_wrote_under_an_expired_lease_is_taken_by_the_new_runner(ledger, clock):
    """A reconnecting client's request resumed on another live worker: the old one aborted it (its row
    says finished), the new one runs it, whichever epoch is older; and a row of an expired lease."""
    new = ledger.acquire_lease("w1", 1, 5).epoch
    old = ledger.acquire_lease("w0", 2, 5).epoch
    ledger.checkpoint("w0", old, [RequestCheckpoint("r", [1], "{}", [2, 3], 2, "finished")])
    ledger.checkpoint("w1", new, [RequestCheckpoint("r", [1], "{}", [2, 3, 4], 3, "decode")])
    assert (ledger.request("r").owner, ledger.request("r").generated_ids) == ("w1", [2, 3, 4])
    ledger.checkpoint("w0", old, [RequestCheckpoint("r2", [1], "{}", [2], 1, "decode")])
    clock.now += 4
    ledger.renew_lease("w1", new, 5)
    lapse(ledger, "w0", clock)  # nobody fenced it yet
    ledger.checkpoint("w1", new, [RequestCheckpoint("r2", [1], "{}", [2, 5], 2, "decode")])
    assert ledger.request("r2").owner == "w1"


def test_finished_rows_and_rows_of_gone_owners_are_pruned_after_the_window(tmp_path, clock):
    wall = Clock()
    led = SqliteLedger(str(tmp_path / "prune.db"), clock=clock, wall_clock=wall)
    try:
        led.format(2)
        e0 = led.acquire_lease("w0", 1, 5).epoch
        e1 = led.acquire_lease("w1", 2, 5).epoch
        led.checkpoint("w0", e0, [RequestCheckpoint("done", [1], "{}", [2], 1, "finished")])
        led.checkpoint("w0", e0, [RequestCheckpoint("running", [1], "{}", [2], 1, "decode")])
        led.checkpoint("w1", e1, [RequestCheckpoint("orphan", [1], "{}", [2], 1, "decode")])
        assert led.request("done").updated_at == wall.now
        led.fence("w1")  # died; nobody took its request over
        wall.now += 30
        led.checkpoint("w0", e0, [RequestCheckpoint("fresh", [1], "{}", [2], 1, "finished")])
        assert led.prune_requests(60) == 0
        wall.now += 31
        assert led.prune_requests(60) == 2
        assert [r.request_id for r in led.requests()] == ["fresh", "running"]  # a live owner's, and young
        wall.now += 60
        assert led.prune_requests(60) == 1 and led.request("fresh") is None
    finally:
        led.close()


def test_reopened_ledger_keeps_everything(ledger_factory, clock):
    led = ledger_factory("l", clock=clock)
    led.format(4)
    e = led.acquire_lease("w0", 1, 5).epoch
    led.grant("w0", e, 2)
    led.close()
    again = ledger_factory("l", clock=clock)
    again.format(4)
    assert [b.owner for b in again.blocks()] == ["w0", "w0", None, None]
    with pytest.raises(LedgerError):
        again.format(5)
    again.close()


def test_a_database_busy_past_the_timeout_is_the_ledgers_own_error(tmp_path):
    path = str(tmp_path / "busy.db")
    led = SqliteLedger(path, timeout_s=0.05)
    led.format(2)
    e = led.acquire_lease("w0", 1, 60).epoch
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another process holds the write lock
    try:
        with pytest.raises(LedgerUnavailableError, match="locked"):
            led.renew_lease("w0", e, 60)
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert led.renew_lease("w0", e, 60).epoch == e  # the failed transaction left the connection usable
    led.close()


def test_one_ledger_object_serves_many_threads(ledger_factory):
    # The lease keeper, the engine and the KV receiver of a worker may all use one ledger object.
    ledger = ledger_factory()  # real clock: the leases must stay live while the threads run
    ledger.format(32)
    workers = [f"w{i}" for i in range(4)]
    epochs = {w: ledger.acquire_lease(w, pid=i + 1, ttl_s=60).epoch for i, w in enumerate(workers)}
    rounds = 40
    start = threading.Barrier(len(workers))
    errors: list[Exception] = []

    def hammer(worker: str) -> None:
        epoch = epochs[worker]
        try:
            start.wait()
            for i in range(rounds):
                ledger.renew_lease(worker, epoch, 60)
                held = ledger.grant(worker, epoch, 2)
                record = RequestCheckpoint(f"{worker}-r", [1, 2], "{}", list(range(i + 1)), i + 1, "decode", held)
                ledger.checkpoint(worker, epoch, [record])
                ledger.free(worker, epoch, held)
                assert ledger.lease(worker).epoch == epoch
                ledger.leases()
                ledger.blocks()
                ledger.request(f"{worker}-r")
        except Exception as exc:  # failed in the main thread below, where pytest sees it
            errors.append(exc)

    threads = [threading.Thread(target=hammer, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    assert [ledger.request(f"{w}-r").delivered for w in workers] == [rounds] * len(workers)
    assert all(b.state == BlockState.FREE for b in ledger.blocks())
    assert ledger.check_integrity() == []


def test_integrity_check_reports_a_tampered_block(ledger, ledger_backend, clock):
    if ledger_backend != "sqlite":
        pytest.skip("tampers with the SQLite rows directly")
    e = ledger.acquire_lease("w0", 1, 5).epoch
    ledger.grant("w0", e, 1)
    ledger.db.execute("UPDATE blocks SET epoch = 999 WHERE id = 0")
    assert any("epoch 999" in p for p in ledger.check_integrity())


def test_history_checker_flags_each_broken_invariant():
    bad = [
        Op(0, "acquire_lease", ("w0", 1, 5), True, result=type("L", (), {"epoch": 5})()),
        Op(1, "grant", ("w0", 5, 1), True, result=[0]),
        Op(2, "fence", ("w0",), True, result=6),
        Op(3, "seal", ("w0", 5, [(0, b"h")]), True),  # stale epoch accepted
        Op(4, "acquire_lease", ("w1", 2, 5), True, result=type("L", (), {"epoch": 7})()),
        Op(5, "grant", ("w1", 7, 1), True, result=[0]),  # second owner
        Op(6, "authorize_write", ("w1", 7, 0), True),  # sealed block changed
        Op(7, "reclaim", ("w1",), True, result=([], [])),  # unfenced
    ]
    problems = check_history(bad)
    assert any("stale epoch" in p for p in problems)
    assert any("while owned by w0" in p for p in problems)
    assert any("sealed block 0 changed" in p for p in problems)
    assert any("reclaimed while its lease is active" in p for p in problems)


def test_recorded_history_of_a_real_run_is_clean(ledger, clock):
    rec = RecordingLedger(ledger)
    e = rec.acquire_lease("w0", 1, 5).epoch
    rec.grant("w0", e, 2)
    rec.fence("w0")
    with pytest.raises(FencedError):
        rec.seal("w0", e, [(0, b"h")])
    rec.reclaim("w0")
    assert [op.ok for op in rec.history] == [True, True, True, False, True]
    assert check_history(rec.history) == []


def test_node_check_verifies_sealed_bytes_and_tables(ledger_factory):
    import os
    import uuid

    from steadfast.kv.arena.arena import ArenaSpec, KVArena
    from steadfast.kv.integrity import check_node

    arena = KVArena.create(
        f"/dev/shm/steadfast-integrity-{os.getpid()}-{uuid.uuid4().hex[:6]}.kv", ArenaSpec(4, 2, 4, 1, 8, "float32")
    )
    led = ledger_factory("n")  # real clock: check_node uses time.monotonic
    try:
        led.format(4)
        e = led.acquire_lease("w0", 1, 60).epoch
        led.grant("w0", e, 2)
        arena.tensor[:, :, :, 0] = 1.5
        led.seal("w0", e, [(0, arena.digest(0))])
        assert check_node(led, arena, {"w0": {"r": [0, 1]}}) == []
        arena.tensor[1, 0, 0, 0, 2, 3] = -1.0  # one value of a sealed block flips
        assert any("no longer match" in p for p in check_node(led, arena))
        assert any("does not give it" in p for p in check_node(led, arena, {"w1": {"r": [1]}}))
    finally:
        led.close()
        arena.unlink()


def test_journals_of_several_ledger_objects_merge_in_the_stores_order(ledger_backend, tmp_path, monkeypatch):
    """Each ledger object (each process) records its calls in its own file; merged by the store's order
    they replay as one history: a fence by one object lands between another's accepted and refused writes."""
    journal = tmp_path / "journal"
    journal.mkdir()
    monkeypatch.setenv("STEADFAST_LEDGER_JOURNAL", str(journal))
    url = ledger_url_in(ledger_backend, tmp_path, "journal")
    worker, supervisor = open_ledger(url), open_ledger(url)
    try:
        worker.format(4)
        e = worker.acquire_lease("w0", 1, 30).epoch
        worker.grant("w0", e, 2)
        worker.seal("w0", e, [(0, b"h0", b"n0")])
        supervisor.fence("w0")
        with pytest.raises(FencedError):
            worker.seal("w0", e, [(1, b"h1", b"n1")])
        supervisor.reclaim("w0")
        e1 = supervisor.acquire_lease("w1", 2, 30).epoch
        supervisor.adopt("w1", e1, [(0, b"h0")])
    finally:
        worker.close()
        supervisor.close()
    history = load_journal(journal)
    assert [op.name for op in history if op.name != "close"] == [
        "format", "acquire_lease", "grant", "seal", "fence", "seal", "reclaim", "acquire_lease", "adopt",
    ]  # fmt: skip
    assert [op.ok for op in history if op.name == "seal"] == [True, False]
    assert check_history(history) == []
    # A call its process died in (no outcome line) counts as accepted: here a seal of a block the fenced
    # worker no longer owns, which the checker then flags.
    died = {"n": 0, "name": "seal", "args": ["w0", e, [[1, "aDE=", "bjE="]]]}
    (journal / "99999-0.jsonl").write_text(json.dumps(died) + "\n")
    assert any("stale epoch" in p for p in check_history(load_journal(journal)))


def test_an_adoption_its_worker_died_in_that_never_committed_is_no_second_owner(ledger_backend, tmp_path, monkeypatch):
    """The soak's seed 7: a worker stopped inside an adoption (its call journaled, no outcome) was fenced
    and reclaimed; the store had not committed the adoption (the reclaim gave none of those blocks back),
    and another worker adopted them. The checker counts an unfinished call as accepted (it may have been)
    and so saw two owners; the reclaim's answer settles it. A block the store did lose is still flagged."""
    journal = tmp_path / "journal"
    journal.mkdir()
    monkeypatch.setenv("STEADFAST_LEDGER_JOURNAL", str(journal))
    url = ledger_url_in(ledger_backend, tmp_path, "died")
    pool, dying, heir = open_ledger(url), open_ledger(url), open_ledger(url)
    try:
        pool.format(4)
        e0 = pool.acquire_lease("w0", 1, 30).epoch
        pool.grant("w0", e0, 1)
        pool.seal("w0", e0, [(0, b"h0", b"n0")])
        pool.fence("w0")
        pool.reclaim("w0")  # block 0: sealed, nobody's
        e1 = dying.acquire_lease("w1", 2, 30).epoch
        mine = next(p for p in journal.glob("*.jsonl") if b'"acquire_lease","args":["w1"' in p.read_bytes())
        # w1 is killed inside its adoption of block 0: the call journaled, never committed, no outcome.
        with open(mine, "a") as f:
            f.write(json.dumps({"n": 99, "name": "adopt", "args": ["w1", e1, [[0, "aDA="]]]}) + "\n")
        pool.fence("w1")
        pool.reclaim("w1")
        e2 = heir.acquire_lease("w2", 3, 30).epoch
        heir.adopt("w2", e2, [(0, b"h0")])
    finally:
        pool.close()
        dying.close()
        heir.close()
    history = load_journal(journal)
    assert [(op.args[0], op.error) for op in history if op.name == "adopt"] == [("w1", DIED), ("w2", None)]
    assert check_history(history) == []
    # A finished grant the reclaim does not give back: the store lost it.
    lost = [*history, Op(len(history), "fence", ("w2",), True, result=99)]
    lost.append(Op(len(lost), "reclaim", ("w2",), True, result=([], [])))
    assert any("block 0 of w2 not given back by its reclaim" in p for p in check_history(lost))
