"""A machine slower than the SLO (another process on its cores, a slow CPU): the ladder sheds load, not
requests the hardware would serve alone. Targets missed by one request alone are said once and judged
by what the hardware does; one request at a time is admitted at any automatic level; a crowd is still
refused; an operator's breaker still holds."""

from __future__ import annotations

import asyncio

import pytest

from steadfast.config import DegradationConfig, SloConfig
from steadfast.control.fleet.signals import Calibration
from steadfast.control.fleet.workers import WorkerRegistry
from steadfast.control.ladder.attainable import Attainability, Latency
from steadfast.control.ladder.degrade import Degradation, Sources
from steadfast.control.ladder.ladder import Level
from steadfast.control.ladder.plan import Plan, Refusal
from steadfast.control.ladder.view import ladder_view
from steadfast.wire.worker import Degrade, Priority, WorkerRole, WorkerState, WorkerStatus
from tests.unit.test_admission import SCHED, flight

pytestmark = pytest.mark.unit


class SlowService:
    """One mixed worker whose decode step alone takes 101 ms (the 80 ms TPOT target is out of reach)."""

    def __init__(self, base_ms: float = 95.0, decode_ms: float = 6.0, **cfg: object) -> None:
        self.registry = WorkerRegistry()
        self.registry.add(0, "ipc://w0", WorkerRole.MIXED)
        cost = {"step_base_ms": base_ms, "step_decode_ms": decode_ms, "step_prefill_ms": 2.0}
        self.registry.observe(WorkerStatus(0, 1, WorkerRole.MIXED, WorkerState.READY, 1000, 0, **cost))
        self.flights: list = []
        self.d = Degradation(
            DegradationConfig(**cfg),  # type: ignore[arg-type]
            SloConfig(),
            SCHED,
            16,
            Sources(self.registry, lambda: self.flights, self._send),
        )
        self.d.ttft_model = Calibration(min_samples=0)
        self.d.tpot_model = Calibration(min_samples=0)

    async def _send(self, orders: Degrade) -> None:
        pass

    def tick(self, n: int = 1) -> None:
        for _ in range(n):
            asyncio.run(self.d.tick())


def test_a_target_missed_alone_is_said_once_and_judged_by_the_hardware():
    a = Attainability(headroom=2.0)
    assert a.observe(Latency.TPOT, 0.0, 80) is None  # not measured: nothing said
    verdict = a.observe(Latency.TPOT, 101.0, 80)
    assert verdict is not None and not verdict.attainable
    assert verdict.message().startswith("SLO unattainable on this hardware: TPOT alone 101 ms vs target 80 ms")
    assert a.judged_ms(Latency.TPOT, 80) == pytest.approx(202)
    # Noise around the figure is not said again, nor is a dip just under the target.
    for solo in (120, 95, 110, 78, 90, 79):
        assert a.observe(Latency.TPOT, solo, 80) is None
    # Attainable again once the smoothed figure is well under it.
    said = [a.observe(Latency.TPOT, 20.0, 80) for _ in range(40)]
    changes = [v for v in said if v is not None]
    assert len(changes) == 1 and changes[0].attainable and a.judged_ms(Latency.TPOT, 80) == 80
    assert a.judged_ms(Latency.TTFT, 500) == 500  # the other latency untouched


def test_one_request_at_a_time_is_admitted_at_any_automatic_level_on_slow_hardware():
    s = SlowService()
    s.tick(3)
    view = ladder_view(s.d)
    assert not view["hardware"]["tpot"]["attainable"], view["hardware"]
    assert "TPOT alone 101 ms vs target 80 ms" in view["hardware"]["tpot"]["message"]
    assert view["hardware"]["ttft"]["attainable"]  # a 64-token prompt's ~220 ms is within 500
    assert s.d.judged_ms(Latency.TPOT, Priority.NORMAL) == pytest.approx(202)
    for level in Level:
        s.d.ladder.level = level  # as if a burst left it there (automatic control)
        for p in Priority:
            plan = s.d.plan(f"{level}-{p}", p, [1] * 64, 128)  # nothing in flight: never refused, never cut
            assert isinstance(plan, Plan) and not plan.shortened
            s.d.ended(f"{level}-{p}")


def test_on_slow_hardware_a_request_is_refused_by_the_sharing_it_adds_not_its_own_speed():
    """At L4 (normal held to its TPOT), one request running beside the new one is no reason to refuse
    it; eight are (each token past 2 x what the hardware does alone)."""
    s = SlowService()
    s.tick(3)
    s.d.ladder.level = Level.L4
    s.flights = [flight("a", Priority.NORMAL, 64, 0, delivered=3, max_tokens=128)]
    assert isinstance(s.d.plan("one-beside", Priority.NORMAL, [1] * 64, 128), Plan)
    s.d.ended("one-beside")
    s.flights = [flight(f"r{i}", Priority.NORMAL, 64, 0, delivered=3, max_tokens=128) for i in range(40)]
    refused = s.d.plan("crowd", Priority.NORMAL, [1] * 64, 128)
    assert isinstance(refused, Refusal) and refused.status == 429 and refused.retry_after >= 1


def test_the_breaker_an_operator_sets_holds_and_auto_admits_at_once_after_it():
    s = SlowService()
    s.tick(3)
    s.d.set_level(Level.L5)
    refused = s.d.plan("held", Priority.NORMAL, [1] * 64, 64)
    assert isinstance(refused, Refusal) and refused.status == 503
    s.d.set_level(None)
    assert s.d.ladder.level == Level.L0
    assert isinstance(s.d.plan("after", Priority.NORMAL, [1] * 64, 64), Plan)


def test_slow_solo_figures_do_not_move_the_level_while_one_request_runs():
    s = SlowService()
    for i in range(200):  # one request running at a time, its TPOT at the hardware's 110 ms, over 80
        s.flights = [flight(f"r{i}", Priority.NORMAL, 64, 0, delivered=5, max_tokens=128)]
        s.d.first_token(f"r{i}", Priority.NORMAL, 0.3)
        s.d.finished(f"r{i}", Priority.NORMAL, 0.110, 127)
        s.tick()
        assert s.d.ladder.level == Level.L0, s.d.ladder.reason


def test_what_requests_measured_bounds_a_step_line_lifted_by_preempted_steps():
    s = SlowService(base_ms=540.0)  # the line says 546 ms a token alone
    for i in range(20):
        s.d.finished(f"r{i}", Priority.NORMAL, 0.040, 64)  # streams measured 40 ms a token
    s.tick(3)
    assert s.d.attainable.figures[Latency.TPOT].attainable
    assert s.d.judged_ms(Latency.TPOT, Priority.NORMAL) == 80
