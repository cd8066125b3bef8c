"""The offload tier's slots in the ledger (every backend): reserved under a lease, the pool's once
stored, freed only by their writer or origin, adopted from a dead origin, reclaimed when their writer
dies mid-copy, and checked by the integrity check and the history checker."""

from __future__ import annotations

import pytest

from steadfast.kv.ledger.history import Op, RecordingLedger, check_history
from steadfast.kv.ledger.interface import BlockState, FencedError, LedgerError
from tests.unit.test_ledger import Clock

pytestmark = pytest.mark.unit

TIER = "host"


@pytest.fixture
def ledger(ledger_factory):
    led = ledger_factory(clock=Clock())
    led.format(4)
    led.format_tier(TIER, 4)
    return led


def test_format_is_idempotent_and_checks_the_size(ledger):
    ledger.format_tier(TIER, 4)
    with pytest.raises(LedgerError):
        ledger.format_tier(TIER, 5)
    assert ledger.tiers() == [TIER]
    assert [s.state for s in ledger.slots(TIER)] == [BlockState.FREE] * 4


def test_reserve_store_free_and_who_may_do_what(ledger):
    a = ledger.acquire_lease("w0", 1, 5).epoch
    b = ledger.acquire_lease("w1", 2, 5).epoch
    assert ledger.reserve_slots("w0", a, TIER, 3) == [0, 1, 2]
    assert ledger.reserve_slots("w1", b, TIER, 3) == [3]  # what is left
    with pytest.raises(LedgerError):
        ledger.store_slots("w1", b, TIER, [(0, b"h0", b"n0")])  # not its reservation
    ledger.store_slots("w0", a, TIER, [(0, b"h0", b"n0"), (1, b"h1", b"n1")])
    rec = {s.slot: s for s in ledger.slots(TIER)}
    assert rec[0].state == BlockState.OFFLOADED and rec[0].owner is None and rec[0].origin == "w0"
    assert [r.slot for r in ledger.offloaded_with_content(TIER, [b"n1", b"nx"])] == [1]
    with pytest.raises(LedgerError):
        ledger.free_slots("w1", b, TIER, [0])  # w0's to count and free, not w1's
    ledger.free_slots("w0", a, TIER, [0, 2])  # an offloaded one and a reserved one
    assert {s.slot for s in ledger.slots(TIER) if s.state == BlockState.FREE} == {0, 2}
    assert ledger.check_integrity() == []


def test_a_fenced_writer_cannot_touch_slots_and_its_half_written_ones_are_freed(ledger):
    a = ledger.acquire_lease("w0", 1, 5).epoch
    ledger.reserve_slots("w0", a, TIER, 2)
    ledger.store_slots("w0", a, TIER, [(0, b"h0", b"n0")])
    ledger.fence("w0")
    for write in (
        lambda: ledger.reserve_slots("w0", a, TIER, 1),
        lambda: ledger.store_slots("w0", a, TIER, [(1, b"h1", b"n1")]),
        lambda: ledger.free_slots("w0", a, TIER, [0]),
    ):
        with pytest.raises(FencedError):
            write()
    ledger.reclaim("w0")
    rec = {s.slot: s for s in ledger.slots(TIER)}
    assert rec[0].state == BlockState.OFFLOADED  # written and hashed: kept for a successor
    assert rec[1].state == BlockState.FREE  # being written when its writer died: never trusted
    assert ledger.check_integrity() == []


def test_a_successor_adopts_a_dead_origins_slots_and_nobody_takes_a_live_ones(ledger):
    a = ledger.acquire_lease("w0", 1, 5).epoch
    b = ledger.acquire_lease("w1", 2, 5).epoch
    ledger.reserve_slots("w0", a, TIER, 2)
    ledger.store_slots("w0", a, TIER, [(0, b"h0", b"n0"), (1, b"h1", b"n1")])
    with pytest.raises(LedgerError):
        ledger.adopt_slots("w1", b, TIER, [(0, b"h0")])  # w0 is alive
    ledger.fence("w0")
    ledger.reclaim("w0")
    with pytest.raises(LedgerError):
        ledger.adopt_slots("w1", b, TIER, [(0, b"wrong")])
    ledger.adopt_slots("w1", b, TIER, [(0, b"h0")])
    assert {s.slot: s.origin for s in ledger.slots(TIER)}[0] == "w1"
    # Slot 1, nobody's now, is reused once the free ones run out; slot 0 (adopted) is not.
    assert ledger.reserve_slots("w1", b, TIER, 4) == [2, 3, 1]
    assert ledger.check_integrity() == []


def test_the_history_checker_sees_slot_writes(ledger):
    rec = RecordingLedger(ledger)
    a = rec.acquire_lease("w0", 1, 5).epoch
    rec.reserve_slots("w0", a, TIER, 2)
    rec.store_slots("w0", a, TIER, [(0, b"h0", b"n0")])
    rec.fence("w0")
    with pytest.raises(FencedError):
        rec.store_slots("w0", a, TIER, [(1, b"h1", b"n1")])
    rec.reclaim("w0")
    b = rec.acquire_lease("w1", 2, 5).epoch
    rec.reserve_slots("w1", b, TIER, 1)
    assert check_history(rec.history) == []
    # A history in which a slot is stored by a worker that never reserved it is reported.
    forged = [*rec.history, Op(len(rec.history), "store_slots", ("w1", b, TIER, [(2, b"h", b"n")]), ok=True)]
    assert any("did not reserve" in p for p in check_history(forged))
