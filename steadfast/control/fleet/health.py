"""Health detection (ARCHITECTURE.md §7; the first seed article's §5): four layers per worker and a
delta-based score, judged by the router from what it sees itself (every token's arrival) and what the
worker reports.

- process: reports arriving (the registry's `Liveness`: SUSPECT after the silence limit, when the router
  sends a second probe, SILENT when that goes unanswered too; DEAD only from the supervisor);
- resource: KV use, resident memory;
- request: requests failing on the worker (an engine error, non-finite logits) or stalling (no token for
  `stall_s`): each is retried once elsewhere; `sick_failures` within the window make the worker SICK;
- transport: the KV wire's resend rate and timed-out sessions.

The score compares each signal's recent median with the worker's own baseline (the median of the
older half of the samples before the recent window), so a worker that has always been noisy is not
judged by its noise, only by getting worse. Pure: the engine client feeds it and acts on what it says.
"""

from __future__ import annotations

import enum
import math
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from steadfast.config.health import HealthConfig
from steadfast.control.fleet.delivery import Flight
from steadfast.control.fleet.migration import Migrations
from steadfast.control.fleet.workers import Liveness, WorkerHandle

SAMPLES = 600  # per worker: ten minutes at the default 1 s interval, bounding memory
GAPS = 50_000  # token gaps kept per worker (the recent window's; a bound on memory besides)
EVENTS = 500  # health events kept for /admin/health
TREND_TAU = 0.5  # how consistently TPOT must rise for its slope to count (Kendall's tau of the samples)
# ... and within each half of them (lower: five to ten noisy samples; in simulation a 2x step is then
# projected in 31 % of cases instead of 80 %, a 24 s ramp to 10x caught 0.5 s later).
HALF_TAU = 0.3
# A degraded worker is acted on only while its recent TPOT is this many times its peers' (their median):
# a load burst that slows every worker alike moves nothing, one worker worse than the rest does.
OUTLIER = 1.5


class LayerState(enum.StrEnum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"


class Standing(enum.StrEnum):
    """How the router treats a worker for its health."""

    HEALTHY = "healthy"
    DEGRADED = "degraded"  # score over the threshold: work migrates away, nothing new while others can take it
    SICK = "sick"  # its requests fail or stall: out of rotation, its requests moved
    PROBATION = "probation"  # sick, cooled down: one request may go there; healthy once it gets a token


@dataclass
class Sample:
    at: float
    tpot_s: float | None  # TPOT p99 over its requests in the last two intervals (None: no decoding)
    queued: int
    kv_use: float
    sent: int  # KV wire messages sent since start
    resent: int
    timeouts: int = 0  # KV move sessions given up for no answer since start


@dataclass
class Score:
    value: float = 0.0
    terms: dict[str, float] = field(default_factory=dict)  # each weighted term (and the TPOT figures), for people
    known: bool = False  # enough baseline to judge


@dataclass
class HealthEvent:
    at: float  # wall clock
    worker_id: int
    what: str  # standing or layer change, eviction
    reason: str


@dataclass
class WorkerHealth:
    worker_id: int
    samples: deque[Sample] = field(default_factory=lambda: deque(maxlen=SAMPLES))
    window: deque[tuple[float, str, float]] = field(default_factory=lambda: deque(maxlen=GAPS))  # (when, request, gap)
    failures: deque[float] = field(default_factory=deque)  # request-layer failures (monotonic times)
    standing: Standing = Standing.HEALTHY
    since: float = 0.0  # when the standing last changed
    probe_request: str = ""  # on probation: the one request sent there
    score: Score = field(default_factory=Score)
    layers: dict[str, tuple[LayerState, str]] = field(default_factory=dict)
    level: float | None = None  # its recent TPOT (median of the recent samples' gap p99s)
    outlier: bool = False  # worse than its peers (OUTLIER x their median), or no peer decodes
    last_eviction: float = -math.inf
    evicted: int = 0  # requests migrated away for its health, since it joined


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(0.99 * len(ordered)) - 1))]


def tpot_p99(gaps: Iterable[tuple[float, str, float]], since: float, waiting: dict[str, float]) -> float | None:
    """The p99 over requests of each one's time per output token since `since`: the gaps that ended
    then, plus the time it has been `waiting` for its next token now (time, not a token: a stopped
    worker sends none), over the tokens it got (at least one). A request's TPOT, as its SLO target is
    about, is a mean: steadier than single gaps (whose p99 is a prefill step's spike), and it grows
    with a slowdown in proportion. None when no request got or awaits a token."""
    time_of: dict[str, float] = dict(waiting)
    tokens: dict[str, int] = {}
    for at, rid, gap in gaps:
        if at > since:
            time_of[rid] = time_of.get(rid, 0.0) + gap
            tokens[rid] = tokens.get(rid, 0) + 1
    if not time_of:
        return None
    return p99([spent / max(1, tokens.get(rid, 0)) for rid, spent in time_of.items()])


def _pairs(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    return [(t2 - t1, y2 - y1) for i, (t1, y1) in enumerate(points) for t2, y2 in points[i + 1 :] if t2 > t1]


def _tau(pairs: list[tuple[float, float]]) -> float:
    """Kendall's tau: pairs rising minus pairs falling, over all pairs (0 without any)."""
    return sum((dy > 0) - (dy < 0) for _, dy in pairs) / len(pairs) if pairs else 0.0


def rising_slope(points: list[tuple[float, float]]) -> float:
    """The median of the slopes between every two points (Theil-Sen: a few outliers, a noisy worker's
    spikes, do not move it), counted only when the points rise consistently — Kendall's tau at least
    TREND_TAU over all of them and HALF_TAU over each half; else 0. Noise has no trend, and neither has
    a step: a worker that got slower once and stays so (a neighbour started, a noisy stretch) rises
    between the halves but not within them, and is judged by its level, not projected onwards."""
    pairs = _pairs(points)
    if _tau(pairs) < TREND_TAU:
        return 0.0
    half = len(points) // 2
    if any(_tau(_pairs(part)) < HALF_TAU for part in (points[:half], points[half:])):
        return 0.0
    return statistics.median(dy / dt for dt, dy in pairs)


def delta_score(samples: Iterable[Sample], now: float, cfg: HealthConfig) -> Score:
    """The worker's recent window against its baseline (see HealthConfig for the formula)."""
    items = list(samples)
    recent = [s for s in items if s.at > now - cfg.recent_s]
    window = [s for s in items if now - cfg.baseline_s <= s.at <= now - cfg.recent_s]
    if len(window) < cfg.min_baseline or not recent:
        return Score()
    # The baseline is the older half of that window (at least `min_baseline` samples): a slowdown that
    # began within the last baseline_s / 2 does not drag its own baseline up with it.
    base = window[: max(cfg.min_baseline, len(window) // 2)]
    terms = {}
    tpot_recent = [s.tpot_s for s in recent if s.tpot_s is not None]
    tpot_base = [s.tpot_s for s in base if s.tpot_s is not None]
    tpot, detail = 0.0, {}
    if tpot_recent and tpot_base:
        was, now_level = statistics.median(tpot_base), statistics.median(tpot_recent)
        # Where it is heading: the robust slope of the last `trend_s` of samples, `horizon_s` ahead (a
        # worker that keeps getting slower is caught before its level alone is three times its baseline).
        # Only over a whole window of TPOT history: a worker's (or a request's) first seconds of decoding
        # are a transient of their own, not a trend.
        points = [(s.at, s.tpot_s) for s in items if s.at > now - cfg.trend_s and s.tpot_s is not None]
        covered = any(s.tpot_s is not None and s.at <= now - cfg.trend_s + cfg.interval_s for s in items)
        slope = rising_slope(points) if len(points) >= 4 and covered else 0.0
        ahead = now_level + max(0.0, slope) * cfg.horizon_s
        tpot = (ahead - was) / max(was, cfg.tpot_floor_ms / 1000)
        detail = {
            "tpot_baseline_ms": 1000 * was,
            "tpot_recent_ms": 1000 * now_level,
            "tpot_slope_ms_per_s": 1000 * slope,
        }
    terms["tpot"] = cfg.weight_tpot * max(0.0, tpot)
    q_base = statistics.median(s.queued for s in base)
    queue = (statistics.median(s.queued for s in recent) - q_base) / max(q_base, cfg.queue_floor, 1e-9)
    terms["queue"] = cfg.weight_queue * max(0.0, queue)
    kv = statistics.median(s.kv_use for s in recent) - statistics.median(s.kv_use for s in base)
    terms["kv"] = cfg.weight_kv * max(0.0, kv / cfg.kv_rise_full)
    before = window[-1]
    sent, resent = recent[-1].sent - before.sent, recent[-1].resent - before.resent
    rate = resent / sent if sent > 0 else 0.0
    terms["transport"] = cfg.weight_transport * max(0.0, rate / cfg.resend_rate_full)
    rounded = {k: round(v, 3) for k, v in (terms | detail).items()}
    return Score(min(1.0, sum(terms.values())), rounded, True)


class HealthMonitor:
    def __init__(self, cfg: HealthConfig) -> None:
        self.cfg = cfg
        self._workers: dict[int, WorkerHealth] = {}
        self.events: deque[HealthEvent] = deque(maxlen=EVENTS)
        self.retried = 0  # requests retried elsewhere after failing or stalling on a worker

    def of(self, worker_id: int) -> WorkerHealth:
        h = self._workers.get(worker_id)
        if h is None:
            h = self._workers[worker_id] = WorkerHealth(worker_id)
        return h

    def forget(self, worker_id: int) -> None:
        self._workers.pop(worker_id, None)

    # --- what the router sees ------------------------------------------------------------------
    def token_gap(self, worker_id: int, request_id: str, seconds: float, now: float) -> None:
        """A request on `worker_id` got its next token `seconds` after its previous one."""
        self.of(worker_id).window.append((now, request_id, seconds))

    def failure(self, worker_id: int, request_id: str, why: str, now: float, wall: float) -> bool:
        """A request failed or stalled on `worker_id`; True when that makes the worker sick."""
        h = self.of(worker_id)
        h.failures.append(now)
        while h.failures and h.failures[0] < now - self.cfg.failure_window_s:
            h.failures.popleft()
        if h.standing is Standing.PROBATION or (
            h.standing is not Standing.SICK and len(h.failures) >= self.cfg.sick_failures
        ):
            reason = f"{len(h.failures)} request failure(s) in {self.cfg.failure_window_s:.0f}s, last: {why}"
            self._set(h, Standing.SICK, reason, now, wall)
            return True
        return False

    def answered(self, worker_id: int, request_id: str, now: float, wall: float) -> None:
        """A request produced a token on `worker_id`: the probe of a worker on probation passes."""
        h = self._workers.get(worker_id)
        if h is not None and h.standing is Standing.PROBATION and h.probe_request == request_id:
            h.failures.clear()
            self._set(h, Standing.HEALTHY, f"probe request {request_id} produced a token", now, wall)

    def placed(self, worker_id: int, request_id: str) -> None:
        h = self._workers.get(worker_id)
        if h is not None and h.standing is Standing.PROBATION and not h.probe_request:
            h.probe_request = request_id

    # --- judgement -----------------------------------------------------------------------------
    def tick(
        self, workers: Iterable[WorkerHandle], waiting: dict[int, dict[str, float]], now: float, wall: float
    ) -> None:
        """One sample per worker: its requests' TPOT p99 over the last two intervals (overlapping: a
        sample of a few dozen tokens is noisy), counting how long each has been `waiting` for its next
        token now (worker id -> request id -> seconds); its reported queue, KV use and wire counts; then
        its score, layers and standing."""
        for w in workers:
            if w.dead:
                self.forget(w.worker_id)
                continue
            h, s = self.of(w.worker_id), w.status
            keep = now - max(self.cfg.recent_s, 2 * self.cfg.interval_s)
            while h.window and h.window[0][0] <= keep:
                h.window.popleft()
            if s is not None:
                tpot = tpot_p99(h.window, now - 2 * self.cfg.interval_s, waiting.get(w.worker_id, {}))
                sent, resent, timeouts = s.kv_messages_sent, s.kv_resends, s.kv_move_timeouts
                h.samples.append(Sample(now, tpot, s.num_waiting, w.kv_use, sent, resent, timeouts))
            h.score = delta_score(h.samples, now, self.cfg)
            recent = [x.tpot_s for x in h.samples if x.at > now - self.cfg.recent_s and x.tpot_s is not None]
            h.level = statistics.median(recent) if recent else None
            self._layers(h, w, now, wall)
            self._judge(h, now, wall)
        for h in self._workers.values():
            peers = [o.level for o in self._workers.values() if o is not h and o.level is not None]
            h.outlier = h.level is not None and (not peers or h.level >= OUTLIER * statistics.median(peers))

    def _judge(self, h: WorkerHealth, now: float, wall: float) -> None:
        cfg = self.cfg
        if h.standing is Standing.SICK:
            if now - h.since >= cfg.sick_cooldown_s:
                h.probe_request = ""
                why = f"sick for {cfg.sick_cooldown_s:.0f}s: one request may try it"
                self._set(h, Standing.PROBATION, why, now, wall)
            return
        if h.standing is Standing.PROBATION:
            return
        over = h.score.value > cfg.threshold
        if over and h.standing is Standing.HEALTHY:
            self._set(h, Standing.DEGRADED, f"score {h.score.value:.2f} > {cfg.threshold} ({h.score.terms})", now, wall)
        elif h.score.value <= cfg.recover_score and h.standing is Standing.DEGRADED:
            # Healthy again once its own tokens say so, over a whole recent window since it was judged or
            # last evicted from (a few good samples of the one request left on it are not a recovery); a
            # worker emptied of work has none to say it with, and is given work again only after the
            # request cooldown (then measured afresh).
            # Its own tokens means tokens since then: a sample looks back two intervals, so the first
            # ones after an eviction still carry the gaps of the request it just lost.
            quiet_from = max(h.since, h.last_eviction)
            fresh = any(
                x.tpot_s is not None and x.at > quiet_from + 2 * cfg.interval_s
                for x in h.samples
                if x.at > now - cfg.recent_s
            )
            quiet = now - quiet_from
            if (fresh and quiet >= cfg.recent_s + 2 * cfg.interval_s) or quiet >= cfg.request_cooldown_s:
                self._set(h, Standing.HEALTHY, f"score {h.score.value:.2f} <= {cfg.recover_score}", now, wall)

    def _layers(self, h: WorkerHealth, w: WorkerHandle, now: float, wall: float) -> None:
        cfg, s = self.cfg, w.status
        process = {
            Liveness.ALIVE: (LayerState.OK, "reporting"),
            Liveness.SUSPECT: (LayerState.WARN, "reports stopped: probed"),
            Liveness.SILENT: (LayerState.FAIL, "no report, probe unanswered"),
        }.get(w.liveness, (LayerState.FAIL, "dead"))
        resource = (LayerState.OK, "")
        if w.kv_use >= cfg.kv_warn:
            resource = (LayerState.WARN, f"KV use {w.kv_use:.0%}")
        if s is not None and cfg.max_rss_mb and s.rss_mb > cfg.max_rss_mb:
            resource = (LayerState.WARN, f"RSS {s.rss_mb:.0f} MiB > {cfg.max_rss_mb:.0f}")
        recent = sum(1 for t in h.failures if t >= now - cfg.failure_window_s)
        request = (LayerState.OK, "")
        if h.standing in (Standing.SICK, Standing.PROBATION):
            request = (LayerState.FAIL, f"{recent} failure(s) in {cfg.failure_window_s:.0f}s")
        elif recent:
            request = (LayerState.WARN, f"{recent} failure(s) in {cfg.failure_window_s:.0f}s")
        transport = (LayerState.OK, "")
        if h.score.terms.get("transport", 0.0) > 0:
            transport = (LayerState.WARN, "KV messages resent")
        window = [x for x in h.samples if x.at >= now - cfg.recent_s]
        if len(window) >= 2 and window[-1].timeouts > window[0].timeouts:
            transport = (LayerState.WARN, f"{window[-1].timeouts - window[0].timeouts} KV move session(s) timed out")
        layers = {"process": process, "resource": resource, "request": request, "transport": transport}
        for name, (state, reason) in layers.items():
            old = h.layers.get(name)
            if old is not None and old[0] != state:
                self.events.append(HealthEvent(wall, h.worker_id, f"{name} {old[0]} -> {state}", reason))
        h.layers = layers

    def _set(self, h: WorkerHealth, standing: Standing, reason: str, now: float, wall: float) -> None:
        self.events.append(HealthEvent(wall, h.worker_id, f"{h.standing} -> {standing}", reason))
        h.standing, h.since = standing, now

    # --- what to do ----------------------------------------------------------------------------
    def avoid(self, worker_id: int) -> bool:
        """Whether a new request should go elsewhere when another worker can take it."""
        if not self.cfg.enabled:
            return False
        h = self._workers.get(worker_id)
        if h is None:
            return False
        if h.standing is Standing.PROBATION:
            return bool(h.probe_request)  # one request only, until it answers
        # A degraded worker with no tokens to judge it by now (emptied of work) stays avoided.
        return h.standing is Standing.SICK or (h.standing is Standing.DEGRADED and (h.outlier or h.level is None))

    def healthy(self, w: WorkerHandle) -> bool:
        """Whether `w` stands healthy (or is not judged yet): a place a health migration may go."""
        h = self._workers.get(w.worker_id)
        return h is None or h.standing is Standing.HEALTHY

    def link_ok(self, worker_id: int) -> bool:
        """Whether the worker's transport layer is OK (its KV moves to other nodes are not being resent)."""
        h = self._workers.get(worker_id)
        return h is None or h.layers.get("transport", (LayerState.OK, ""))[0] is LayerState.OK

    def excluded(self, worker_id: int) -> bool:
        """Whether the worker takes nothing at all (sick): not even when it is the only one."""
        h = self._workers.get(worker_id)
        return self.cfg.enabled and h is not None and h.standing is Standing.SICK

    def evictions(self, worker_id: int, active: int, now: float) -> int:
        """How many of the worker's `active` requests to migrate away now: ceil(active x (score -
        threshold)) while it is degraded and worse than its peers, once per `worker_cooldown_s` (a sick
        worker's requests are all moved by the engine client, not through this)."""
        h = self._workers.get(worker_id)
        if not self.cfg.enabled or h is None or active <= 0:
            return 0
        if h.standing is not Standing.DEGRADED or not h.outlier or now - h.last_eviction < self.cfg.worker_cooldown_s:
            return 0
        return min(active, math.ceil(active * (h.score.value - self.cfg.threshold)))

    def moves(
        self, w: WorkerHandle, decoding: list[Flight], migrations: Migrations, recent: dict[str, float], now: float
    ) -> list[tuple[Flight, WorkerHandle]]:
        """Which of a degraded worker's `decoding` requests go where now: `evictions` of them, lowest
        priority and least recently active first, each to the least loaded worker standing healthy with
        1.2x its KV free (`Migrations.target`) — not to another node while this worker's KV moves are being resent
        — within the concurrent-migration cap, none moved for health within `request_cooldown_s`
        (`recent`: request id → when)."""
        count = min(self.evictions(w.worker_id, len(decoding), now), migrations.slots)
        plan: list[tuple[Flight, WorkerHandle]] = []
        for flight in Migrations.victims(decoding):
            rid = flight.add.request_id
            if len(plan) >= count:
                break
            if rid in recent or migrations.active(rid) is not None:
                continue
            # Healthy targets only: a degraded worker that is not an outlier now (its peer slowed by the
            # work it took from it) is still no place to send work for its health.
            target = migrations.target(flight, w, self.healthy)
            if target is None:
                break  # nowhere healthy with room to go
            if target.node != w.node and not self.link_ok(w.worker_id):
                break  # its KV moves are being resent: not another node's way, over that link
            plan.append((flight, target))
        return plan

    def evicting(self, worker_id: int, count: int, now: float, wall: float, detail: str) -> None:
        h = self.of(worker_id)
        h.last_eviction = now
        h.evicted += count
        self.events.append(HealthEvent(wall, worker_id, f"migrating {count} away", detail))

    def recent_tpot_p99(self, worker_id: int) -> float:
        """Its requests' TPOT p99 over the recent window up to its last sample (finished tokens only);
        0 without any."""
        h = self.of(worker_id)
        if not h.samples:
            return 0.0
        last = h.samples[-1].at
        return tpot_p99((g for g in h.window if g[0] <= last), last - self.cfg.recent_s, {}) or 0.0

    def view(self, worker_id: int) -> dict[str, object]:
        h = self.of(worker_id)
        return {
            "tpot_p99_ms": round(1000 * self.recent_tpot_p99(worker_id), 1),
            "standing": h.standing.value,
            "score": round(h.score.value, 3),
            "score_known": h.score.known,
            "score_terms": h.score.terms,
            "outlier": h.outlier,
            "layers": {name: {"state": st.value, "reason": why} for name, (st, why) in h.layers.items()},
            "evicted": h.evicted,
            "recent_failures": len(h.failures),
        }
