"""Scheduler: budgets, chunking, priorities and preemption victims (no model involved)."""

from __future__ import annotations

from dataclasses import astuple

import pytest

from steadfast.config import SchedulerConfig
from steadfast.wire.worker import SamplingParams
from steadfast.worker.core.block_manager import BlockManager
from steadfast.worker.core.request import Request
from steadfast.worker.core.scheduler import Scheduler
from steadfast.worker.core.step_cost import StepCost

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


def timed_cost(base_ms: float, decode_ms: float, prefill_ms: float | None = None, rounds: int = 5) -> StepCost:
    """A cost model that has seen steps of 1 to 32 decode rows beside 0 to 200 prompt tokens take
    base + decode × rows + prefill × tokens (prefill: the decode cost, unless given)."""
    cost = StepCost()
    prefill_ms = decode_ms if prefill_ms is None else prefill_ms
    for _ in range(rounds):
        for d, p in ((1, 0), (8, 50), (32, 0), (1, 200), (16, 100), (32, 20)):
            cost.observe(d, p, (base_ms + decode_ms * d + prefill_ms * p) / 1000)
    return cost


def test_step_cost_needs_steps_of_different_sizes():
    cost = StepCost()
    assert cost.line() is None and cost.prefill_room(4, 0.25) is None
    for _ in range(30):
        cost.observe(4, 0, 0.05)
    assert cost.line() is None  # steps of one size tell nothing of the slope
    cost = timed_cost(40, 2)
    assert astuple(cost.line()) == pytest.approx((0.040, 0.002, 0.002))
    assert cost.prefill_room(decodes=5, target_s=0.25) == 100  # (250 - 40 - 5 x 2) / 2


def test_step_cost_tells_a_decode_row_from_a_prompt_token_and_follows_a_change():
    cost = timed_cost(40, 3, 0.5, rounds=40)  # the first line has one slope; the next ones part them
    assert astuple(cost.line()) == pytest.approx((0.040, 0.003, 0.0005), rel=1e-3)
    assert cost.prefill_room(decodes=10, target_s=0.25) == 360  # (250 - 40 - 10 x 3) / 0.5
    steps = ((4, 0), (8, 100), (2, 300))
    for _ in range(40):  # prompts got twice as slow a token (and the rows vary too little to refit theirs)
        for d, p in steps:
            cost.observe(d, p, (40 + 3 * d + 1.0 * p) / 1000)
    line = cost.line()
    assert line.prefill_s == pytest.approx(0.001, rel=0.01)
    for d, p in steps:
        assert line.seconds(d, p) == pytest.approx((40 + 3 * d + 1.0 * p) / 1000, rel=0.01)


def test_steady_decoding_prices_its_prompts_and_keeps_the_step_it_runs():
    """Thirty-two streams decode every step, now and then beside a prompt: the steps tell what a prompt
    token costs and what the whole decode step costs, not what one row does (the rows never change)."""
    cost = timed_cost(40, 2)  # what the warm-up saw: one slope
    for i in range(200):  # really: 52 ms for the 32 rows, 0.8 ms a prompt token
        p = 80 if i % 4 == 0 else 0
        cost.observe(32, p, (52 + 0.8 * p) / 1000)
    line = cost.line()
    assert line.prefill_s == pytest.approx(0.0008, rel=0.02)
    assert line.seconds(32) == pytest.approx(0.052, rel=0.02) and line.base_s >= 0.0
    assert cost.prefill_room(32, 0.080) == pytest.approx(35, abs=1)  # (80 - 52) / 0.8


def test_a_prefill_burst_is_spread_over_steps_while_others_decode():
    cfg = SchedulerConfig(max_num_batched_tokens=512, decode_step_target_ms=250, prefill_floor_tokens=16)
    s = Scheduler(cfg, BlockManager(256, 4, False))
    s.cost = timed_cost(40, 2)  # 250 ms leaves room for 105 tokens, less the decodes'
    s.add(req("streaming", 8))
    finish_step(s.schedule())  # alone: its whole prompt, no stream waits on this step
    for i in range(3):
        s.add(req(f"new{i}", 60))
    step = s.schedule()
    assert [r.request_id for r in step.decodes] == ["streaming"]
    assert [(r.request_id, n) for r, n in step.prefills] == [("new0", 60), ("new1", 44)]
    finish_step(step)
    step = s.schedule()
    assert [(r.request_id, n) for r, n in step.prefills] == [("new1", 16), ("new2", 60)]
    s.cost = timed_cost(240, 2)  # decodes alone nearly take the target: prefills still get the floor
    finish_step(step)
    s.add(req("late", 40))
    step = s.schedule()
    assert [(r.request_id, n) for r, n in step.prefills] == [("late", 16)]
    assert len(step.decodes) == 4


def test_without_decodes_or_a_target_prefill_takes_the_whole_budget():
    for target in (250, 0):
        cfg = SchedulerConfig(max_num_batched_tokens=512, decode_step_target_ms=target)
        s = Scheduler(cfg, BlockManager(256, 4, False))
        s.cost = timed_cost(40, 2)
        for i in range(3):
            s.add(req(f"p{i}", 150))
        assert [n for _, n in s.schedule().prefills] == [150, 150, 150]


def test_a_taken_over_stream_is_not_cut_nor_kept_waiting_behind_new_prompts():
    """A new owner's first step: nothing decodes yet, but a taken-over request's client is streaming.
    New prompts share the room; its recomputation takes what it needs, though it arrived last."""
    cfg = SchedulerConfig(max_num_batched_tokens=512, decode_step_target_ms=100, prefill_floor_tokens=16)
    s = Scheduler(cfg, BlockManager(256, 4, False))
    s.cost = timed_cost(40, 2)  # room for 30 tokens
    fresh = [req(f"fresh{i}", 60) for i in range(2)]
    resumed = req("resumed", 20)
    resumed.output_ids = [7, 8]
    for r in (*fresh, resumed):
        s.add(r)
    step = s.schedule()
    assert [(r.request_id, n) for r, n in step.prefills] == [("fresh0", 30), ("resumed", 22)]
    assert s.num_waiting == 1  # fresh1: next step
    # Without a streaming client anywhere, nothing is paced.
    s = Scheduler(cfg, BlockManager(256, 4, False))
    s.cost = timed_cost(40, 2)
    for r in [req(f"fresh{i}", 60) for i in range(2)]:
        s.add(r)
    assert [n for _, n in s.schedule().prefills] == [60, 60]


def test_the_line_outlives_a_quiet_spell_and_drafts_take_room():
    cost = timed_cost(40, 2)
    for _ in range(200):  # a long run of same-size decode steps: no spread left to fit on
        cost.observe(3, 0, 0.046)
    assert astuple(cost.line()) == pytest.approx((0.040, 0.002, 0.002))  # the burst after it is still paced
    cfg = SchedulerConfig(max_num_batched_tokens=512, decode_step_target_ms=250, prefill_floor_tokens=16)
    for drafts, room in (([], 104), ([9, 9, 9, 9], 100)):
        s = Scheduler(cfg, BlockManager(256, 4, False), drafter=lambda r, budget, d=drafts: list(d))
        s.cost = timed_cost(40, 2)
        s.add(req("streaming", 8))
        finish_step(s.schedule())
        s.add(req("new", 150))
        step = s.schedule()
        assert [len(d) for _, d in step.verifies] == ([4] if drafts else [])
        assert [(r.request_id, n) for r, n in step.prefills] == [("new", room)]  # 105 - 1 decode - drafts


def test_ladder_l3_swaps_low_priority_out_above_the_kv_target_and_holds_it_back():
    bm = BlockManager(20, 4, False)
    swapped: list[str] = []

    class Tier:
        def swap_out(self, r):
            swapped.append(r.request_id)
            return 1  # the tier took its blocks

        def has_room(self, r):
            return r.request_id != "low-full"  # this one the tier has no room for

        def ready(self, r, hits, others_run):
            return True

    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=200), bm, tier=Tier())
    reqs = [req("high", 16, 0), req("normal", 16, 1), req("low", 16, 2), req("low-full", 8, 2)]
    for r in reqs:
        s.add(r)
    finish_step(s.schedule())
    assert bm.num_used == 4 + 4 + 4 + 2  # every prompt's blocks
    s.offload_from, s.kv_target = 2, 0.65  # L3: low priority above 13 of 20 blocks
    step = s.schedule()
    # low-full cannot be swapped (no recomputing preemption for the ladder); low goes: 10 blocks, then
    # the decodes take one more each for high and normal, and low-full its third: 13.
    assert [r.request_id for r in step.preempted] == ["low"] and swapped == ["low"]
    assert s.ladder_swaps == 1 and s.swap_preemptions == 1 and s.recompute_preemptions == 0
    assert {r.request_id for r in step.decodes} == {"high", "normal", "low-full"}
    finish_step(step)
    assert s.num_waiting == 1 and not s.schedule().prefills  # held back while over the target
    s.remove("normal")
    step = s.schedule()
    assert [r.request_id for r, _ in step.prefills] == ["low"]  # room under the target again
    s.offload_from = 3  # back to L0: nothing is shed
    assert not s.schedule().preempted


def test_a_high_priority_prompt_is_not_paced_and_the_ladder_sets_the_step_target():
    cfg = SchedulerConfig(max_num_batched_tokens=512, decode_step_target_ms=250, prefill_floor_tokens=16)
    s = Scheduler(cfg, BlockManager(256, 4, False))
    s.cost = timed_cost(40, 2)  # 250 ms: room for 105 tokens less the decodes'
    s.add(req("streaming", 8))
    finish_step(s.schedule())
    s.add(req("high", 200, 0))
    s.add(req("normal", 200, 1))
    step = s.schedule()
    # high takes its whole prompt, more than the room and the floor: normal waits for the next step.
    assert [(r.request_id, n) for r, n in step.prefills] == [("high", 200)]
    finish_step(step)
    s.step_target_ms = 100  # the ladder's (L1+): room for 30 tokens less the decodes'
    step = s.schedule()
    assert [(r.request_id, n) for r, n in step.prefills] == [("normal", 28)]
