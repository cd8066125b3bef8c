"""The degradation ladder's controller on injected signals and a fake clock: each level's trigger,
escalation to L4 and L5, the way back down to L0, hysteresis against noisy signals, manual override."""

from __future__ import annotations

import random

import pytest

from steadfast.config import DegradationConfig
from steadfast.control.fleet.signals import Window
from steadfast.control.ladder.ladder import Ladder, Level, Snapshot

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def snap(**kw: float) -> Snapshot:
    base = dict(
        kv_use=0.1,
        queued=0,
        load=0.1,
        predicted_ttft_ms=20.0,
        ttft_p99_ms=50.0,
        tpot_p99_ms=20.0,
        ttft_slo_ms=500.0,
        tpot_slo_ms=80.0,
        in_flight=6,  # crowded: more in flight than the one worker serves alone
        workers=1,
    )
    base.update(kw)
    return Snapshot(**base)  # type: ignore[arg-type]


def ladder(**cfg: float) -> tuple[Ladder, Clock]:
    clock = Clock()
    return Ladder(DegradationConfig(**cfg), clock=clock, wall=clock), clock  # type: ignore[arg-type]


def run(lad: Ladder, clock: Clock, s: Snapshot, seconds: float, tick: float = 0.5) -> None:
    end = clock.t + seconds
    while clock.t < end:
        clock.t += tick
        lad.step(s)


@pytest.mark.parametrize(
    ("signals", "level", "why"),
    [
        (dict(predicted_ttft_ms=450), Level.L1, "predicted TTFT"),
        (dict(ttft_p99_ms=420), Level.L1, "observed TTFT"),
        (dict(kv_use=0.86), Level.L2, "KV use"),
        (dict(queued=40), Level.L2, "queued"),
        (dict(load=0.75), Level.L2, "load"),
        (dict(kv_use=0.93), Level.L3, "KV use"),
    ],
)
def test_each_trigger_raises_its_level_at_once_and_says_why(signals, level, why):
    lad, _ = ladder()
    change = lad.step(snap(**signals), rise_only=True)
    assert change is not None and change.new == level and why in change.reason
    assert lad.level == level and change.signals["kv_use"] == snap(**signals).kv_use


def test_an_idle_servers_predicted_ttft_neither_raises_nor_holds_l1():
    # Nothing queued or running: the prediction is the floor, which admission control cannot lower.
    lad, clock = ladder(min_dwell_s=1)
    idle = snap(queued=0, load=0.0, predicted_ttft_ms=450, ttft_p99_ms=0.0, in_flight=0)
    assert lad.step(idle, rise_only=True) is None and lad.level == Level.L0
    run(lad, clock, snap(predicted_ttft_ms=450), 2)  # busy: the same prediction enters L1
    assert lad.level == Level.L1
    run(lad, clock, idle, 3)
    assert lad.level == Level.L0


def test_a_broken_slo_escalates_one_level_per_interval_up_to_l4_and_severe_to_l5():
    lad, clock = ladder(escalate_after_s=2, min_dwell_s=2)
    broken = snap(predicted_ttft_ms=600, ttft_p99_ms=700)  # over the 500 ms target, not 3x
    lad.step(broken)
    assert lad.level == Level.L1
    run(lad, clock, broken, 2.0)
    assert lad.level == Level.L2
    run(lad, clock, broken, 4.0)
    assert lad.level == Level.L4  # and no further: not severe
    run(lad, clock, broken, 10.0)
    assert lad.level == Level.L4
    severe = snap(predicted_ttft_ms=2000, ttft_p99_ms=1600)
    run(lad, clock, severe, 1.5)
    assert lad.level == Level.L4  # severe only for 1.5 s
    run(lad, clock, severe, 1.0)
    assert lad.level == Level.L5
    assert "SLO broken 3.0x" in lad.history[-1].reason


def test_escalation_counts_only_what_the_current_level_admitted():
    """A burst's slow first tokens stay in the window for `window_s`; the level they caused must not
    climb on them while the requests it admitted meet the SLO (at c = 32 a cold start climbed L1 → L4
    in 15 s this way, capping and refusing with every new request served in time)."""
    lad, clock = ladder(escalate_after_s=2, min_dwell_s=2)
    burst = snap(predicted_ttft_ms=600, ttft_p99_ms=760, level_ttft_p99_ms=760)
    lad.step(burst)
    assert lad.level == Level.L1
    since_then = snap(predicted_ttft_ms=300, ttft_p99_ms=760, level_ttft_p99_ms=350)  # window still broken
    run(lad, clock, since_then, 10.0)
    assert lad.level == Level.L1  # held (observed p99 over its exit bar), never escalated
    still = snap(predicted_ttft_ms=300, ttft_p99_ms=760, level_ttft_p99_ms=620)  # broken by its own
    run(lad, clock, still, 2.5)
    assert lad.level == Level.L2 and "TTFT p99 620/500" in lad.history[-1].reason


def test_a_window_percentile_over_what_began_since_a_moment():
    w = Window(10.0)
    w.add(0.9, now=100.0, origin=99.1)  # admitted before 99.5
    w.add(0.2, now=100.2, origin=100.0)
    w.add(0.3, now=100.4, origin=100.1)
    assert w.percentile(0.99, 100.5) == 0.9
    assert w.percentile(0.99, 100.5, since=99.5) == 0.3
    assert w.percentile(0.99, 100.5, since=101.0) == 0.0


def test_the_level_comes_back_to_l0_one_step_per_dwell_when_load_subsides():
    """While requests still crowd the service (calmer, but more in flight than workers) the level
    falls one step per dwell time."""
    lad, clock = ladder(escalate_after_s=1, min_dwell_s=3)
    run(lad, clock, snap(kv_use=0.95, ttft_p99_ms=2000, predicted_ttft_ms=2000), 6)
    assert lad.level == Level.L5
    calm = snap()
    levels = []
    for _ in range(40):
        clock.t += 0.5
        lad.step(calm)
        levels.append(lad.level)
    assert levels[-1] == Level.L0
    falls = [c for c in lad.history if c.new < c.old]
    assert [c.new for c in falls] == [Level.L4, Level.L3, Level.L2, Level.L1, Level.L0]
    gaps = [b.at - a.at for a, b in zip(falls, falls[1:], strict=False)]
    assert all(g >= 3 for g in gaps), gaps  # each level held its dwell time


def test_no_fall_while_a_signal_is_between_its_exit_and_enter_thresholds():
    lad, clock = ladder(min_dwell_s=1)
    lad.step(snap(kv_use=0.87))
    run(lad, clock, snap(kv_use=0.8), 30)  # below enter (0.85), above exit (0.75)
    assert lad.level == Level.L2 and len(lad.history) == 1
    run(lad, clock, snap(kv_use=0.7), 3)
    assert lad.level == Level.L0


def test_noisy_signals_around_a_threshold_do_not_flap():
    """KV use and predicted TTFT jitter around their enter thresholds for ten minutes: the level may
    rise once and then stays (the noise never reaches the exit thresholds); and a signal that swings
    across both thresholds every tick moves the level at most twice per dwell time."""
    rng = random.Random(7)
    lad, clock = ladder(min_dwell_s=5)
    for _ in range(1200):
        clock.t += 0.5
        lad.step(snap(kv_use=0.85 + rng.uniform(-0.05, 0.05), predicted_ttft_ms=400 + rng.uniform(-60, 60)))
    assert len(lad.history) <= 2, [(c.old, c.new, c.reason) for c in lad.history]

    lad, clock = ladder(min_dwell_s=5)
    for i in range(1200):
        clock.t += 0.5
        lad.step(snap(kv_use=0.9 if i % 2 else 0.5))
        assert lad.changes_within(60) <= 2 * 60 / 5 + 1
    assert len(lad.history) <= 2 * 600 / 5 + 1


def test_an_operator_level_holds_until_auto_and_the_controller_resumes_from_it():
    lad, clock = ladder(min_dwell_s=1)
    change = lad.set(Level.L5, snap())
    assert change is not None and change.manual and lad.level == Level.L5
    run(lad, clock, snap(), 10)
    assert lad.level == Level.L5  # held against calm signals
    lad.set(None, snap())
    run(lad, clock, snap(), 10)
    assert lad.level == Level.L0


def test_released_to_auto_the_level_is_what_the_signals_ask_for_at_once():
    """An operator's L5 given back to auto with nothing queued: L0 there and then, not after five dwell
    times (the next request got 503 from a level nothing had caused)."""
    lad, clock = ladder(min_dwell_s=5)
    lad.set(Level.L5, snap())
    clock.t += 1
    change = lad.set(None, snap(in_flight=0, queued=0, load=0.0))
    assert change is not None and change.new == Level.L0 and not change.manual
    assert "automatic control resumed" in change.reason
    lad.set(Level.L5, snap())
    change = lad.set(None, snap(kv_use=0.87))  # KV still over its bar: back to what it holds
    assert change is not None and change.new == Level.L2


def test_a_slow_machine_serving_one_request_at_a_time_stays_at_l0():
    """Every latency signal far over its target, but never more in flight than workers: no queue, no
    sharing, nothing for the ladder to shed, so for ten minutes of ticks it never leaves L0."""
    rng = random.Random(3)
    lad, clock = ladder()
    for i in range(1200):
        clock.t += 0.5
        slow = snap(
            in_flight=i % 2,  # one request at a time, or none between them
            workers=1,
            queued=i % 2,
            load=rng.uniform(1.0, 4.0),
            predicted_ttft_ms=rng.uniform(300, 2000),
            ttft_p99_ms=rng.uniform(400, 3000),
            tpot_p99_ms=rng.uniform(80, 300),
        )
        lad.step(slow, rise_only=i % 3 == 0)
    assert lad.level == Level.L0 and not lad.history
    # The same figures with a crowd: the ladder acts.
    run(lad, clock, snap(ttft_p99_ms=1600, tpot_p99_ms=300, predicted_ttft_ms=2000), 30)
    assert lad.level == Level.L5


def test_once_the_crowd_is_gone_the_level_falls_in_one_move_after_its_dwell():
    """A burst took the level to L5; it ended, its slow requests still in the window: the level falls to
    L0 in one move once held its dwell (25 s at one level a dwell, past a client's patience), and to L2
    where KV still holds it."""
    lad, clock = ladder(escalate_after_s=1, min_dwell_s=3)
    run(lad, clock, snap(ttft_p99_ms=2000, predicted_ttft_ms=2000), 6)
    assert lad.level == Level.L5
    gone = snap(in_flight=1, queued=0, ttft_p99_ms=2000, tpot_p99_ms=300, level_ttft_p99_ms=2000)
    run(lad, clock, gone, 3.5)
    assert lad.level == Level.L0 and "nothing queued or shared" in lad.history[-1].reason
    run(lad, clock, snap(ttft_p99_ms=2000, predicted_ttft_ms=2000), 6)
    assert lad.level == Level.L5
    run(lad, clock, snap(in_flight=0, kv_use=0.78), 3.5)
    assert lad.level == Level.L2


def test_a_disabled_ladder_never_moves_by_itself():
    lad, clock = ladder(enabled=False)
    run(lad, clock, snap(kv_use=0.99, ttft_p99_ms=5000, predicted_ttft_ms=5000), 30)
    assert lad.level == Level.L0 and not lad.history
