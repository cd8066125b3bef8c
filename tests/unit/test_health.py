"""Health detection and routing, pure: the delta-based score against a worker's own baseline, standings
(degraded, sick, probation), evictions in proportion to the excess, the second probe before a quiet worker
is silent, the cache index and KV-aware routing."""

from __future__ import annotations

import random

import pytest

from steadfast.config import HealthConfig, RoutingConfig, SchedulerConfig
from steadfast.control.fleet.health import HealthMonitor, Sample, Standing, delta_score, tpot_p99
from steadfast.control.fleet.routing import Router
from steadfast.control.fleet.signals import WorkerLoad
from steadfast.control.fleet.workers import Liveness, WorkerRegistry
from steadfast.kv.names import chain
from steadfast.wire.worker import CacheEvents, Priority, WorkerRole, WorkerState, WorkerStatus
from steadfast.worker.core.block_manager import BlockManager

pytestmark = pytest.mark.unit

CFG = HealthConfig(interval_s=1.0, recent_s=5.0, baseline_s=60.0, min_baseline=8)


def samples(tpots: list[float], queued: int = 0, kv: float = 0.3) -> list[Sample]:
    return [Sample(float(t), tpot, queued, kv, 0, 0) for t, tpot in enumerate(tpots)]


def test_no_score_without_a_baseline_and_none_for_a_steady_worker():
    assert not delta_score(samples([0.02] * 8), 8.0, CFG).known  # 3 baseline samples: not enough
    steady = delta_score(samples([0.02] * 40), 40.0, CFG)
    assert steady.known and steady.value == 0.0


def test_a_tpot_three_times_its_baseline_alone_crosses_the_threshold():
    """The seed's formula (no look ahead): the level alone."""
    s = samples([0.02] * 30 + [0.061] * 6)
    score = delta_score(s, 36.0, HealthConfig(min_baseline=8, horizon_s=0.0))
    assert score.terms["tpot"] == pytest.approx(0.30 * (0.061 - 0.02) / 0.02, rel=1e-3)
    assert score.value > CFG.threshold


def first_crossing(cfg: HealthConfig, tpots: list[float]) -> int | None:
    for t in range(len(tpots)):
        if delta_score(samples(tpots[: t + 1]), float(t), cfg).value > cfg.threshold:
            return t
    return None


def test_looking_ahead_catches_a_worker_that_keeps_getting_slower_before_its_level_alone_would():
    """20 ms for 30 s, then 2 ms worse every second: the level alone crosses at 3x its baseline (60 ms);
    with the trend 10 s ahead the score crosses while the level is still about 2x."""
    tpots = [0.02] * 30 + [0.02 + 0.002 * k for k in range(1, 40)]
    ahead = first_crossing(CFG, tpots)
    level = first_crossing(HealthConfig(min_baseline=8, horizon_s=0.0), tpots)
    assert ahead is not None and level is not None and ahead < level - 5, (ahead, level)
    assert tpots[ahead] < 0.05  # before 2.5x


def test_noise_of_a_steady_mean_is_no_trend():
    """A worker that has always been noisy (each sample anywhere from 1x to 4x the lowest, around one
    mean: far noisier than a request's mean token gap) is not judged by its noise: over 1000 independent
    minutes, its score is over the threshold in at most a few (then only an outlier among its peers is
    acted on), and its p99 is well under the threshold."""
    rng = random.Random(7)
    scores = sorted(
        delta_score(samples([0.02 + rng.uniform(0, 0.06) for _ in range(60)]), 60.0, CFG).value for _ in range(1000)
    )
    assert sum(v > CFG.threshold for v in scores) <= 3, scores[-5:]
    assert scores[990] < 0.8 * CFG.threshold, scores[990]


def test_a_step_is_judged_by_its_level_not_projected_as_a_trend():
    """20 ms, then 40 ms from t = 30 on and staying there (a neighbour started): 2x its baseline is
    under the threshold by the level; the rise between the two halves of the trend window is no
    trend within either, so nothing is projected ahead (the whole window's slope alone would be)."""
    tpots = [0.02] * 30 + [0.04] * 30
    assert first_crossing(CFG, tpots) is None
    for t in range(30, 60):
        assert delta_score(samples(tpots[: t + 1]), float(t), CFG).terms["tpot_slope_ms_per_s"] == 0.0


def test_no_trend_is_projected_before_a_whole_window_of_tpot_history():
    """A worker's first seconds of decoding (warming up, its first requests' prefill) are a transient:
    the slope counts only once the TPOT samples cover `trend_s`."""
    cfg = HealthConfig(interval_s=0.5, recent_s=3.0, baseline_s=30.0, min_baseline=6)  # known after 6 s
    rising = [Sample(0.5 * k, 0.02 + 0.001 * k, 0, 0.3, 0, 0) for k in range(30)]
    slope = {
        x.at: delta_score(rising[: k + 1], x.at, cfg).terms.get("tpot_slope_ms_per_s") for k, x in enumerate(rising)
    }
    assert all(v == 0.0 for at, v in slope.items() if 6.0 <= at < 9.5), slope
    assert all(v and v > 0 for at, v in slope.items() if at >= 9.5), slope


def test_tpot_is_each_requests_time_per_token_and_its_p99_over_requests():
    # a: 10 tokens 20 ms apart, one gap a 200 ms spike (a prefill step): 38 ms a token, not 200.
    gaps = [(float(t), "a", 0.2 if t == 5 else 0.02) for t in range(10)]
    assert tpot_p99(gaps, -1.0, {}) == pytest.approx(0.038)
    assert tpot_p99(gaps, 4.5, {}) == pytest.approx((0.2 + 4 * 0.02) / 5)  # since 4.5: the last five
    # b waits on a stopped worker: 0.5 s with no token counts as time, not as a token.
    assert tpot_p99(gaps, -1.0, {"b": 0.5}) == pytest.approx(0.5)
    assert tpot_p99(gaps + [(9.5, "b", 0.02)], 9.0, {"b": 0.5}) == pytest.approx(0.52)
    assert tpot_p99([], 0.0, {}) is None


def test_kv_and_transport_terms():
    s = [Sample(float(t), 0.02, 0, 0.3 if t < 30 else 0.6, 100 * t, 0 if t < 30 else 10 * (t - 30)) for t in range(36)]
    score = delta_score(s, 36.0, CFG)
    assert score.terms["kv"] == pytest.approx(0.25, rel=1e-3)  # a 30-point rise counts as 1
    assert score.terms["transport"] == pytest.approx(0.4, rel=1e-3)  # 10 % of messages resent: 2 x 0.20
    assert score.value == pytest.approx(0.65, rel=1e-3)


def registry_with(n: int) -> WorkerRegistry:
    r = WorkerRegistry()
    for i in range(n):
        r.add(i, f"ipc://w{i}", WorkerRole.MIXED)
        r.observe(WorkerStatus(i, 100 + i, WorkerRole.MIXED, WorkerState.READY, 100, 10), now=0.0)
    return r


def test_degraded_then_evictions_in_proportion_to_the_excess_once_per_cooldown():
    cfg = HealthConfig(min_baseline=8, worker_cooldown_s=3.0)
    h = HealthMonitor(cfg)
    reg = registry_with(1)
    w = reg.get(0)
    for t in range(40):
        gap = 0.02 if t < 30 else 0.1
        h.token_gap(0, "a", gap, float(t))
        h.tick([w], {}, float(t), 0.0)
    assert h.of(0).standing is Standing.DEGRADED and h.avoid(0) and not h.excluded(0)
    assert h.evictions(0, 10, 40.0) == 4  # ceil(10 x (1.0 - 0.6))
    h.evicting(0, 4, 40.0, 0.0, "x")
    assert h.evictions(0, 10, 41.0) == 0  # cooldown
    assert any("degraded" in e.what for e in h.events)


def test_a_degraded_worker_recovers_only_under_the_recover_score():
    h = HealthMonitor(HealthConfig(min_baseline=8))
    reg = registry_with(1)
    standings, scores = {}, {}
    for t in range(70):
        # 20 ms a token, then 5x, then 2.7x (a score of ~0.51: between the two), then 20 ms again
        gap = 0.02 if t < 30 else 0.1 if t < 40 else 0.054 if t < 55 else 0.02
        h.token_gap(0, "a", gap, float(t))
        h.tick(reg, {}, float(t), 0.0)
        standings[t], scores[t] = h.of(0).standing, h.of(0).score.value
    assert standings[39] is Standing.DEGRADED
    assert any(0.45 < scores[t] <= 0.6 for t in range(45, 55)), scores  # under the threshold, not recovered
    assert all(standings[t] is Standing.DEGRADED for t in range(40, 55))  # hovering over 0.45: stays
    assert standings[69] is Standing.HEALTHY


def test_request_failures_make_a_worker_sick_then_probation_then_healthy():
    h = HealthMonitor(HealthConfig(sick_failures=2, sick_cooldown_s=10.0))
    reg = registry_with(1)
    assert not h.failure(0, "a", "nan", 0.0, 0.0)
    assert h.failure(0, "b", "nan", 1.0, 0.0)
    assert h.excluded(0) and h.of(0).standing is Standing.SICK
    h.tick(reg, {}, 12.0, 0.0)
    assert h.of(0).standing is Standing.PROBATION and not h.excluded(0) and not h.avoid(0)
    h.placed(0, "probe")
    assert h.avoid(0)  # one request at a time on probation
    h.answered(0, "probe", 13.0, 0.0)
    assert h.of(0).standing is Standing.HEALTHY and not h.avoid(0)


def test_a_failure_on_probation_makes_it_sick_again():
    h = HealthMonitor(HealthConfig(sick_failures=1, sick_cooldown_s=0.0))
    reg = registry_with(1)
    h.failure(0, "a", "nan", 0.0, 0.0)
    h.tick(reg, {}, 1.0, 0.0)
    assert h.of(0).standing is Standing.PROBATION
    assert h.failure(0, "probe", "nan", 2.0, 0.0) and h.excluded(0)


def test_a_quiet_worker_is_probed_before_it_is_silent():
    reg = registry_with(2)
    reg.seen(1, now=10.0)
    suspect, silent = reg.sweep_silent(3.0, 1.0, now=3.5)
    assert [w.worker_id for w in suspect] == [0] and not silent
    assert reg.get(0).liveness is Liveness.SUSPECT and not reg.get(0).ready
    suspect, silent = reg.sweep_silent(3.0, 1.0, now=4.5)
    assert not suspect and [w.worker_id for w in silent] == [0]
    reg.seen(0, now=5.0)
    reg.sweep_silent(3.0, 1.0, now=5.0)
    assert reg.get(0).liveness is Liveness.ALIVE


def test_the_cache_index_follows_events_and_is_bounded():
    router = Router(RoutingConfig(max_index_blocks=4), SchedulerConfig(), 16)
    names = chain(list(range(64)), 16, 4)
    router.index.apply(CacheEvents(0, names[:2], reset=True))
    assert router.index.cached_blocks(0, names) == 2
    router.index.apply(CacheEvents(0, names[2:], [names[0]]))
    assert router.index.cached_blocks(0, names) == 0  # the chain breaks at its first block
    router.index.apply(CacheEvents(0, chain(list(range(200)), 16, 6), reset=True))
    assert router.index.size(0) == 0 and router.index.dropped == 1


def test_the_router_names_blocks_as_the_workers_do():
    tokens = list(range(100, 180))
    assert chain(tokens, 16, 5) == BlockManager(8, 16).chain(tokens, 5)


def test_kv_aware_routing_prefers_the_cached_prefix_until_the_queue_costs_more():
    reg = registry_with(2)
    workers = list(reg)
    router = Router(RoutingConfig(), SchedulerConfig(), 16)
    prompt = list(range(1000, 1000 + 512))
    router.index.apply(CacheEvents(1, chain(prompt, 16, 32), reset=True))
    loads = {i: WorkerLoad(i, 0.01, 0.001, 0.001, 100, 10) for i in range(2)}
    router.loads = lambda _rid: loads
    assert router.choose(workers, prompt, Priority.NORMAL, "a").worker_id == 1
    assert router.decisions[-1].candidates[1].cached_tokens == 511
    # A long queue of prompts ahead on worker 1 outweighs the cached prefix.
    from steadfast.control.fleet.signals import Queued

    loads[1].queued = [Queued(Priority.NORMAL, 2000, 1, 0.0)]
    assert router.choose(workers, prompt, Priority.NORMAL, "b").worker_id == 0
    # ... but not for a high-priority request, which is served before normal prompts.
    assert router.choose(workers, prompt, Priority.HIGH, "c").worker_id == 1


def test_round_robin_and_least_loaded():
    reg = registry_with(3)
    workers = list(reg)
    rr = Router(RoutingConfig(policy="round_robin"), SchedulerConfig(), 16)
    assert [rr.choose(workers, [1] * 20).worker_id for _ in range(4)] == [0, 1, 2, 0]
    ll = Router(RoutingConfig(policy="least_loaded"), SchedulerConfig(), 16)
    workers[0].in_flight.update({"x", "y"})
    assert ll.choose(workers, [1] * 20).worker_id == 1


def test_a_burst_that_slows_every_worker_alike_moves_nothing_one_worse_than_its_peers_does():
    cfg = HealthConfig(min_baseline=8, worker_cooldown_s=0.0)
    for slow_both in (True, False):
        h = HealthMonitor(cfg)
        reg = registry_with(2)
        for t in range(40):
            for w in (0, 1):
                slowed = t >= 30 and (w == 1 or slow_both)
                h.token_gap(w, f"r{w}", 0.1 if slowed else 0.02, float(t))
            h.tick(reg, {}, float(t), 0.0)
        assert h.of(1).standing is Standing.DEGRADED
        if slow_both:  # a load burst: every worker alike
            assert not h.avoid(1) and h.evictions(1, 4, 40.0) == 0 and not h.of(1).outlier
        else:
            assert h.avoid(1) and h.evictions(1, 4, 40.0) > 0 and h.of(1).outlier


def test_moves_take_the_lowest_priority_first_and_skip_those_moved_lately():
    import asyncio

    from steadfast.config import MigrationConfig
    from steadfast.control.fleet.delivery import Flight, Watermark
    from steadfast.control.fleet.migration import Migrations
    from steadfast.wire.worker import AddRequest, SamplingParams

    cfg = HealthConfig(min_baseline=8, worker_cooldown_s=0.0)
    h = HealthMonitor(cfg)
    reg = registry_with(2)
    for t in range(40):
        h.token_gap(0, "a", 0.02, float(t))
        h.token_gap(1, "b", 0.02 if t < 30 else 0.2, float(t))
        h.tick(reg, {}, float(t), 0.0)
    flights = []
    for i, priority in enumerate([Priority.HIGH, Priority.LOW, Priority.NORMAL, Priority.LOW]):
        add = AddRequest(f"r{i}", [1] * 32, SamplingParams(), priority)
        flights.append(Flight(add, asyncio.Queue(), Watermark(1, [5, 6])))
    migrations = Migrations(MigrationConfig(), reg, 16)
    plan = h.moves(reg.get(1), flights, migrations, {"r3": 39.0}, 40.0)
    assert [f.add.request_id for f, _ in plan][:2] == ["r1", "r2"]  # low first; r3 was moved lately
    assert all(target.worker_id == 0 for _, target in plan)
    assert h.moves(reg.get(0), flights, migrations, {}, 40.0) == []  # a healthy worker keeps its work


def test_a_health_move_never_goes_to_a_degraded_worker_that_is_no_outlier():
    """Worker 1 is degraded but no outlier (worker 0 is far slower), so new requests may still go there;
    worker 0's health moves may not: they go to worker 2, healthy, or nowhere."""
    import asyncio

    from steadfast.config import MigrationConfig
    from steadfast.control.fleet.delivery import Flight, Watermark
    from steadfast.control.fleet.migration import Migrations
    from steadfast.wire.worker import AddRequest, SamplingParams

    h = HealthMonitor(HealthConfig(min_baseline=8, worker_cooldown_s=0.0))
    reg = registry_with(3)
    for t in range(50):
        h.token_gap(0, "a", 0.02 if t < 38 else 0.4, float(t))
        h.token_gap(1, "b", 0.02 if t < 30 else 0.1, float(t))
        h.token_gap(2, "c", 0.02, float(t))
        h.tick(reg, {}, float(t), 0.0)
    assert h.of(0).standing is Standing.DEGRADED and h.of(0).outlier
    assert h.of(1).standing is Standing.DEGRADED and not h.avoid(1)  # no outlier: new requests may go
    add = AddRequest("r", [1] * 32, SamplingParams(), Priority.LOW)
    flight = Flight(add, asyncio.Queue(), Watermark(1, [5, 6]))
    migrations = Migrations(MigrationConfig(), reg, 16)
    assert [target.worker_id for _, target in h.moves(reg.get(0), [flight], migrations, {}, 50.0)] == [2]
    reg.remove(2)
    assert h.moves(reg.get(0), [flight], migrations, {}, 50.0) == []  # not to worker 1
