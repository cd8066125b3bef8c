"""The router's half of live migration, without processes: the watermark across a switch, the
victim and target policy, and the records' outcomes."""

from __future__ import annotations

import asyncio
import time

import pytest

from steadfast.config import MigrationConfig
from steadfast.control.fleet.delivery import Flight, Verdict, Watermark
from steadfast.control.fleet.migration import MigrationOutcome, MigrationReason, Migrations
from steadfast.control.fleet.workers import WorkerRegistry
from steadfast.wire.worker import (
    AddRequest,
    Handoff,
    RequestOutput,
    SamplingParams,
    WorkerRole,
    WorkerState,
    WorkerStatus,
)

pytestmark = pytest.mark.unit


def out(index: int, token: int) -> RequestOutput:
    return RequestOutput("r", [token], index=index)


def test_the_old_owner_is_never_forwarded_after_the_switch_and_a_different_token_is_a_mismatch():
    mark = Watermark(0)
    for i, t in enumerate([5, 6, 7]):
        assert mark.accept(out(i, t), 0) is Verdict.FORWARD
    mark.hand_to(1)
    assert mark.accept(out(3, 8), 1) is Verdict.FORWARD
    assert mark.accept(out(3, 8), 0) is Verdict.LATE  # the old owner's copy of a token the client has
    assert mark.accept(out(3, 9), 0) is Verdict.MISMATCH  # ...and a different one: counted, never sent
    assert mark.accept(out(4, 1), 0) is Verdict.NOT_OWNER
    assert mark.delivered == [5, 6, 7, 8]


def registry(*free: int) -> WorkerRegistry:
    reg = WorkerRegistry()
    for i, f in enumerate(free):
        reg.add(i, f"ipc://w{i}", WorkerRole.MIXED)
        reg.observe(WorkerStatus(i, 100 + i, WorkerRole.MIXED, WorkerState.READY, 100, 100 - f, node="n"))
    return reg


def flight(tokens: int, priority: int = 1, progress: float = 0.0) -> Flight:
    add = AddRequest(f"r{tokens}-{priority}-{progress}", list(range(tokens)), SamplingParams(), priority)
    f = Flight(add, asyncio.Queue(), Watermark(0))
    f.progress = progress
    return f


def test_victims_are_lowest_priority_then_least_recently_active():
    a, b, c = flight(1, 0, 5.0), flight(1, 2, 9.0), flight(1, 2, 1.0)
    assert Migrations.victims([a, b, c]) == [c, b, a]


def test_the_target_has_1_2_times_the_victims_blocks_free_and_is_the_least_loaded():
    reg = registry(50, 10, 40, 30)
    m = Migrations(MigrationConfig(), reg, block_size=16)
    src = reg.get(0)
    victim = flight(16 * 25)  # 25 blocks: 30 free is enough (1.2 x 25), 10 is not
    reg.get(2).in_flight.add("x")
    assert m.target(victim, src).worker_id == 3
    reg.get(3).draining = True  # a draining worker takes nothing
    assert m.target(victim, src).worker_id == 2
    assert m.target(flight(16 * 40), src) is None


def test_a_migration_ends_exactly_once_and_the_cap_counts_the_running_ones():
    m = Migrations(MigrationConfig(max_concurrent=2), registry(50, 50), block_size=16)
    f = flight(20)
    record = m.begin(f, 0, 1, MigrationReason.OPERATOR)
    assert m.slots == 1 and m.active(f.add.request_id) is record
    assert m.answered(f.add.request_id, Handoff(1, migration="another/move"), 0.0) is None  # not its move
    now = time.monotonic()
    m.answered(f.add.request_id, Handoff(1, [3, 4], migration=record.move, paused_at=now - 0.01), now - 0.02)
    assert record.outcome is MigrationOutcome.SWITCHED
    m.resumed(f.add.request_id, now, now + 0.001)
    assert record.outcome is MigrationOutcome.COMMITTED and record.downtime_s == pytest.approx(0.01, abs=1e-6)
    assert m.slots == 2 and m.lost(1, "gone") == [] and record.outcome is MigrationOutcome.COMMITTED
    other = m.begin(flight(21), 0, 1, MigrationReason.DRAIN)
    assert [r.move for r in m.lost(1, "worker 1 died")] == [other.move]
    assert other.outcome is MigrationOutcome.ABORTED  # the destination died first: it stayed at its source
    fourth = m.begin(flight(23), 0, 1, MigrationReason.DRAIN)
    assert [r.move for r in m.lost(0, "worker 0 died")] == [fourth.move]
    assert fourth.outcome is MigrationOutcome.LOST  # the source died: the request was taken over
    switched = flight(22)
    third = m.begin(switched, 0, 1, MigrationReason.DRAIN)
    m.answered(switched.add.request_id, Handoff(1, [5], migration=third.move), 0.0)
    assert m.lost(0, "the source retired") == [] and third.outcome is MigrationOutcome.SWITCHED
