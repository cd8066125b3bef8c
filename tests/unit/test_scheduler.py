"""Scheduler: budgets, chunking, priorities and preemption victims (no model involved)."""

from __future__ import annotations

import pytest

from steadfast.config import SchedulerConfig
from steadfast.kv.block_manager import BlockManager
from steadfast.protocol import SamplingParams
from steadfast.worker.request import Request
from steadfast.worker.scheduler import Scheduler

pytestmark = pytest.mark.unit


def req(rid: str, n: int, priority: int = 1) -> Request:
    return Request(rid, list(range(1000, 1000 + n)), SamplingParams(), priority)


def finish_step(step):
    """Pretend the model ran: advance computed counts, and sample a token for complete prompts."""
    for r in step.decodes:
        r.num_computed += 1
        r.output_ids.append(1)
    for r, n in step.prefills:
        r.num_computed += n
        if r.num_computed == r.num_tokens:
            r.output_ids.append(1)


def test_budget_chunks_long_prompts_and_admits_by_priority():
    s = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=20, max_prefill_chunk=16), BlockManager(64, 4, False)
    )
    low, normal, high = req("low", 10, 2), req("normal", 30, 1), req("high", 5, 0)
    for r in (low, normal, high):
        s.add(r)
    step = s.schedule()
    assert [(r.request_id, n) for r, n in step.prefills] == [("high", 5), ("normal", 15)]
    finish_step(step)
    step = s.schedule()
    # high now decodes; normal continues its prefill; low gets what budget is left.
    assert [r.request_id for r in step.decodes] == ["high"]
    assert [(r.request_id, n) for r, n in step.prefills] == [("normal", 15), ("low", 4)]


def test_max_num_seqs_limits_running():
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=100), BlockManager(64, 4, False))
    for i in range(4):
        s.add(req(f"r{i}", 3))
    step = s.schedule()
    assert len(step.prefills) == 2 and s.num_waiting == 2


def test_preemption_takes_the_lowest_priority_latest_request():
    bm = BlockManager(6, 4, False)
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=100), bm)
    a, b, c = req("a", 8, 0), req("b", 7, 1), req("c", 7, 2)
    for r in (a, b, c):
        s.add(r)
    finish_step(s.schedule())  # a: 2 blocks, b: 2, c: 2 — arena full
    assert bm.num_free == 0
    step = s.schedule()  # a needs a third block (9 tokens): c is the victim
    assert [r.request_id for r in step.preempted] == ["c"]
    assert {r.request_id for r in step.decodes} == {"a", "b"}
    assert c.num_computed == 0 and s.num_waiting == 1 and c.output_ids == [1]
    bm.check_integrity()
