"""The degradation ladder at work in the router: signals gathered, the level moved (ladder.py), each
new request admitted, refused or shortened by it, and running work told what to give up (`Degrade`
to every worker: speculation, low-priority KV to the offload tier).

High priority is touched last: it is never refused by a prediction, never shortened, and at L5 it
still gets in while fewer than `high_reserve` high requests per serving worker are in flight. No
accepted request is ever failed by the ladder: refusals happen at admission, before any token.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from steadfast.config import DegradationConfig, SchedulerConfig, SloConfig
from steadfast.control.fleet.delivery import Flight
from steadfast.control.fleet.signals import (
    TTFT_LEARN_FROM_S,
    Calibration,
    Latencies,
    Queued,
    Running,
    Window,
    WorkerLoad,
    predict_ttft,
)
from steadfast.control.fleet.workers import WorkerHandle, WorkerRegistry
from steadfast.control.ladder.attainable import Attainability, Latency
from steadfast.control.ladder.ladder import Ladder, Level, LevelChange, Snapshot
from steadfast.control.ladder.plan import Plan, Refusal, _Refused
from steadfast.wire.worker import Degrade, Priority, WorkerRole

log = logging.getLogger("steadfast.degradation")

PROTECTED = (Priority.HIGH, Priority.NORMAL)  # whose observed latencies say whether the SLO holds
# Whether decoding keeps up (L1's "no capacity to spare") is judged by the TPOT of requests that decoded
# at least this many tokens: a request of a few spends its whole life beside the prefills of the burst it
# came in (32 requests of 16 tokens arriving together: ~100 ms a token), which says how bursty arrivals
# were, not how fast the running streams decode once they are in.
CAPACITY_MIN_TOKENS = 32
LOW_TPOT_SHARE = 0.75  # low priority is refused when a token would take this share of its TPOT p99 target
TYPICAL_PROMPT = 64  # tokens of the new request the level's signals are predicted for (load, TTFT)
TYPICAL_OUTPUT = 128  # tokens of the "typical new request" the level's prediction is made for, until some are seen
UNPLACED_TTL_S = 30.0  # an admitted request whose stream never started is forgotten after this
RESEND_EVERY = 10  # ticks between re-sends of the orders to every worker (one that joined or was promoted)


def refused_by_prediction(priority: Priority, level: Level) -> bool:
    """Whether a new request may be refused for its predicted TTFT (TPOT: low from L1, normal from L4)."""
    return priority != Priority.HIGH and level >= Level.L1


@dataclass
class Sources:
    """What the ladder reads from the engine client (callables, so it holds no sockets)."""

    registry: WorkerRegistry
    flights: Callable[[], list[Flight]]
    broadcast: Callable[[Degrade], Awaitable[None]]
    # Tokens of a prompt a worker holds cached (the router's index of its cache events): not computed
    # again, so not in its predicted TTFT.
    cached: Callable[[int, Sequence[int]], int] = lambda worker_id, prompt: 0


@dataclass
class Degradation:
    cfg: DegradationConfig
    slo: SloConfig
    sched: SchedulerConfig
    block_size: int
    src: Sources
    on_change: Callable[[LevelChange], None] | None = None  # metrics
    on_refuse: Callable[[Priority, int], None] | None = None  # metrics: priority, status
    ladder: Ladder = field(init=False)
    latencies: dict[Priority, Latencies] = field(init=False)
    _unplaced: dict[str, Queued] = field(default_factory=dict)
    # TTFT, TPOT p99 (ms) of the protected priorities at the last tick: over the window, and over what
    # the current level admitted (TTFT) or saw finish (TPOT).
    _observed: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    _capacity: dict[Priority, Window] = field(init=False)  # TPOT of requests of >= CAPACITY_MIN_TOKENS tokens
    _capacity_p99_ms: float = 0.0  # ... its p99 at the last tick
    _orders: Degrade = field(default_factory=Degrade)
    # Predictions corrected by what was measured (the machine's other load, what arrives later).
    ttft_model: Calibration = field(default_factory=lambda: Calibration(floor=TTFT_LEARN_FROM_S))
    tpot_model: Calibration = field(default_factory=Calibration)
    _predicted: dict[str, tuple[float, float]] = field(default_factory=dict)  # own TTFT, TPOT figures, in flight
    _ticks: int = 0
    attainable: Attainability = field(init=False)

    def __post_init__(self) -> None:
        self.ladder = Ladder(self.cfg)
        self.attainable = Attainability(self.cfg.solo_headroom)
        self.latencies = {p: Latencies.over(self.cfg.window_s) for p in Priority}
        self._capacity = {p: Window(self.cfg.window_s) for p in PROTECTED}

    # --- signals -------------------------------------------------------------------------------
    def _serving(self) -> list[WorkerHandle]:
        live = self.src.registry.live()
        prefill = [w for w in live if w.role == WorkerRole.PREFILL]
        return prefill or [w for w in live if w.role in (WorkerRole.MIXED, WorkerRole.DECODE)]

    def loads(self, exclude: str = "") -> list[WorkerLoad]:
        """Every serving worker's load: its measured step cost, the requests placed on it (and those
        admitted, not placed yet, where the admission expected them — but `exclude`, the one being placed)."""
        loads = {}
        for w in self._serving():
            s = w.status
            loads[w.worker_id] = WorkerLoad(
                w.worker_id,
                (s.step_base_ms if s else 0.0) / 1000,
                (s.step_decode_ms if s else 0.0) / 1000,
                (s.step_prefill_ms if s else 0.0) / 1000,
                s.kv_blocks_total if s else 0,
                s.kv_blocks_used if s else 0,
            )
        for f in self.src.flights():
            self._unplaced.pop(f.add.request_id, None)
            load = loads.get(f.mark.owner)
            if load is None or f.mark.moving:
                continue
            add, done = f.add, len(f.mark.delivered)
            prompt, most = len(add.prompt_ids), add.params.max_tokens
            if done:
                load.running.append(Running(max(0, most - done), -(-(prompt + most) // self.block_size)))
            else:
                load.queued.append(Queued(Priority(add.priority), prompt - f.cached, f.mark.owner, f.progress))
        for rid, q in self._unplaced.items():
            if q.worker in loads and rid != exclude:
                loads[q.worker].queued.append(q)
        return list(loads.values())

    @property
    def capacity_tpot_p99_ms(self) -> float:
        """L1's capacity signal at the last tick: TPOT p99 of the protected requests of CAPACITY_MIN_TOKENS
        tokens or more."""
        return self._capacity_p99_ms

    def step_target_ms(self, level: Level) -> float:
        """From L1 on, a step beside streams is kept within the TPOT p99 target, as judged (0: the
        workers' own)."""
        return self.judged_ms(Latency.TPOT, Priority.NORMAL) if level >= Level.L1 else 0.0

    def judged_ms(self, latency: Latency, priority: Priority, p50: bool = False) -> float:
        """A priority's target as the ladder holds it: the SLO's, or what this hardware can do where it
        misses the SLO alone (control/ladder/attainable.py; the other targets scaled alike)."""
        normal = self.slo.targets(Priority.NORMAL)
        own = self.slo.targets(priority)
        base, mine = (normal.ttft_ms, own.ttft_ms) if latency is Latency.TTFT else (normal.tpot_ms, own.tpot_ms)
        target = mine.p50 if p50 else mine.p99
        return target * self.attainable.judged_ms(latency, base.p99) / base.p99

    def slo_ms(self) -> dict[Latency, float]:
        """The normal priority's p99 targets, which the hardware's solo figures are held against."""
        normal = self.slo.targets(Priority.NORMAL)
        return {Latency.TTFT: normal.ttft_ms.p99, Latency.TPOT: normal.tpot_ms.p99}

    def solo_ms(self, loads: list[WorkerLoad]) -> dict[Latency, float]:
        """The hardware's solo figures now, on the fastest measured serving worker (0: none measured): a
        typical prompt's TTFT and a decode step of one row."""
        alone = [w.alone() for w in loads if w.measured]
        if not alone:
            return {Latency.TTFT: 0.0, Latency.TPOT: 0.0}
        ttft = min(predict_ttft(w, TYPICAL_PROMPT, Priority.NORMAL, self.sched, self.block_size) for w in alone)
        return {Latency.TTFT: 1000 * ttft, Latency.TPOT: 1000 * min(w.decode_step_s(1) for w in alone)}

    def _predict(
        self, loads: list[WorkerLoad], prompt: int, priority: Priority, cached: dict[int, int] | None = None
    ) -> tuple[float, int]:
        """The shortest predicted TTFT (s) over the serving workers, and that worker's id (-1: none), of
        a prompt of `prompt` tokens, less what each worker holds cached (`cached`, by worker id)."""
        best = (0.0, -1)
        target = self.step_target_ms(self.ladder.level)
        for w in loads:
            new = max(1, prompt - (cached or {}).get(w.worker_id, 0))
            t = self.ttft_model.factor * predict_ttft(w, new, priority, self.sched, self.block_size, target)
            if best[1] < 0 or t < best[0]:
                best = (t, w.worker_id)
        return best

    def snapshot(self, loads: list[WorkerLoad] | None = None) -> Snapshot:
        loads = self.loads() if loads is None else loads
        total = sum(w.kv_total for w in loads)
        # Load: what a typical new request's tokens would take where work runs (an idle worker has none).
        tpot = self.tpot_model.factor
        busy = [w for w in loads if w.measured and (w.running or w.queued)]
        typical = [tpot * w.tpot_s(TYPICAL_PROMPT, TYPICAL_OUTPUT) for w in busy]
        tpot_slo = self.judged_ms(Latency.TPOT, Priority.NORMAL)
        return Snapshot(
            kv_use=sum(w.kv_used for w in loads) / total if total else 0.0,
            queued=sum(len(w.queued) for w in loads),
            load=1000 * max(typical, default=0.0) / tpot_slo,
            predicted_ttft_ms=1000 * self._predict(loads, TYPICAL_PROMPT, Priority.NORMAL)[0],
            ttft_p99_ms=self._observed[0],
            tpot_p99_ms=self._observed[1],
            ttft_slo_ms=self.judged_ms(Latency.TTFT, Priority.NORMAL),
            tpot_slo_ms=tpot_slo,
            level_ttft_p99_ms=self._observed[2],
            level_tpot_p99_ms=self._observed[3],
            in_flight=sum(len(w.running) + len(w.queued) for w in loads),
            workers=len(loads),
        )

    def _observe_windows(self) -> None:
        now, since = time.monotonic(), self.ladder.since

        def p99(kind: str, since: float) -> float:
            return 1000 * max(getattr(self.latencies[p], kind).percentile(0.99, now, since) for p in PROTECTED)

        self._observed = (p99("ttft", -math.inf), p99("tpot", -math.inf), p99("ttft", since), p99("tpot", since))
        self._capacity_p99_ms = 1000 * max(w.percentile(0.99, now) for w in self._capacity.values())

    # --- admission -----------------------------------------------------------------------------
    def plan(self, request_id: str, priority: Priority, prompt: Sequence[int], output_tokens: int) -> Plan | Refusal:
        """Admit a new request of `prompt` (token ids), or refuse it (a `Refusal`: 429/503 with Retry-After)
        as its priority and the level say. An admitted one is counted as queued until its first token."""
        try:
            return self._plan(request_id, priority, prompt, output_tokens)
        except _Refused as refused:
            if self.on_refuse is not None:
                self.on_refuse(priority, refused.refusal.status)
            return refused.refusal

    def _plan(self, request_id: str, priority: Priority, prompt: Sequence[int], output_tokens: int) -> Plan:
        prompt_tokens = len(prompt)
        loads = self.loads()
        snap = self.snapshot(loads)
        self._changed(self.ladder.step(snap, rise_only=True))
        level = self.ladder.level
        self._check_queue(loads, priority)
        if snap.alone and self.ladder.override is None:
            # Nothing queued or shared: this request is served as fast as the hardware goes whatever the
            # level says (it may still be falling from a burst); refusing or shortening it helps nobody.
            level = Level.L0
        shortened = level >= Level.L4 and priority != Priority.HIGH
        if shortened and prompt_tokens > self.cfg.max_context_tokens:  # predicted as it will be (cut)
            prompt, prompt_tokens = (), self.cfg.max_context_tokens
        if shortened:
            output_tokens = min(output_tokens, self.cfg.max_tokens_cap)
        if level >= Level.L5:  # (before any prediction: the breaker's refusals are the cheapest)
            self._check_breaker(loads, priority, level)
        # Each worker's cached part of the prompt, looked up once (a chain of block hashes).
        cached = {w.worker_id: self.src.cached(w.worker_id, prompt) for w in loads} if prompt else {}
        predicted, worker = self._predict(loads, prompt_tokens, priority, cached)
        # Refused by prediction, lowest priority first: by TTFT low against its p50 target, normal against
        # its p99; by TPOT low from L1, normal once its SLO stayed broken through L1-L3 (L4); high never.
        # TPOT predictions refuse only once checked against measurements; TTFT ones before, at their most
        # favourable correction (a burst's first wave came before any check: 52-58 admitted, p99 1.2 s).
        chosen = next((w for w in loads if w.worker_id == worker and w.measured), None)
        own_tpot = chosen.tpot_s(prompt_tokens, output_tokens) if chosen is not None else 0.0
        if refused_by_prediction(priority, level):
            judged = predicted / self.ttft_model.factor * self.ttft_model.refusing_factor
            self._check_ttft(loads, priority, level, prompt_tokens, cached, judged)
        tpot_from = Level.L1 if priority == Priority.LOW else Level.L4
        if refused_by_prediction(priority, level) and level >= tpot_from and self.tpot_model.trusted:
            solo = chosen.alone().tpot_s(prompt_tokens, output_tokens) if chosen is not None else 0.0
            factor = self.tpot_model.factor
            self._check_tpot(priority, level, factor * own_tpot, factor * solo)
        plan = Plan(level, predicted_ttft_ms=1000 * predicted)
        if shortened:
            plan.max_tokens_cap = self.cfg.max_tokens_cap
            plan.context_cap = self.cfg.max_context_tokens
        new = max(1, prompt_tokens - cached.get(worker, 0))
        self._unplaced[request_id] = Queued(priority, new, worker, time.monotonic())
        if chosen is not None:  # the models' own figures, to learn from
            self._predicted[request_id] = (predicted / self.ttft_model.factor, own_tpot)
        return plan

    def _check_queue(self, loads: list[WorkerLoad], priority: Priority) -> None:
        """The priority's bounded queue, at every level."""
        queued = sum(1 for w in loads for q in w.queued if q.priority == priority)
        if queued >= self.cfg.max_queued(priority) * max(1, len(loads)):
            self._refuse(
                priority,
                429,
                f"{queued} {priority.label}-priority requests are waiting for their first token, the limit; "
                "retry shortly.",
                self.cfg.retry_after_s,
            )

    def _check_breaker(self, loads: list[WorkerLoad], priority: Priority, level: Level) -> None:
        """L5: only high priority gets in, within its reserve."""
        high = sum(1 for f in self.src.flights() if f.add.priority == Priority.HIGH)
        high += sum(1 for q in self._unplaced.values() if q.priority == Priority.HIGH)
        if priority != Priority.HIGH or high >= self.cfg.high_reserve * max(1, len(loads)):
            self._refuse(
                priority,
                503,
                f"The service is overloaded (degradation level {int(level)}: circuit breaker) and refuses new "
                f"{priority.label}-priority requests; requests in flight continue. Retry later.",
                self.cfg.retry_after_s,
            )

    def _check_ttft(
        self,
        loads: list[WorkerLoad],
        priority: Priority,
        level: Level,
        prompt_tokens: int,
        cached: dict[int, int],
        predicted: float,
    ) -> None:
        """A request predicted to miss its TTFT target (low: its p50, giving way first; normal: its p99)
        while the TPOT SLO is broken (no capacity to spare); else only past `ttft_refuse` x it. A prompt
        that alone takes longer than the target is judged by what others add to it. Retry-After: until
        the queue ahead has drained to the target."""
        bar = self.judged_ms(Latency.TTFT, priority, p50=priority != Priority.NORMAL) / 1000
        idle = [w.alone() for w in loads]
        bar = max(bar, self.cfg.solo_headroom * self._predict(idle, prompt_tokens, priority, cached)[0])
        overloaded = self._capacity_p99_ms > self.judged_ms(Latency.TPOT, Priority.NORMAL)
        factor = 1.0 if overloaded else self.cfg.ttft_refuse
        if predicted > factor * bar:
            self._refuse(
                priority,
                429,
                f"The service is overloaded (degradation level {int(level)}): a {priority.label}-priority "
                f"request would wait about {predicted * 1000:.0f} ms for its first token, over "
                + (f"{factor:g} x " if factor != 1 else "")
                + f"its {bar * 1000:.0f} ms target. Retry later.",
                max(1, math.ceil(predicted - bar)),
            )

    def _check_tpot(self, priority: Priority, level: Level, predicted: float, alone: float) -> None:
        """A request that would slow every stream of its worker past the TPOT target once it decodes beside
        all that runs and waits there (low: a share of its p99 target). `alone`: its own time per token
        with nothing beside it, which no refusal lowers: sharing has to add `solo_headroom` x it first."""
        share = 1.0 if priority == Priority.NORMAL else LOW_TPOT_SHARE
        target = max(share * self.judged_ms(Latency.TPOT, priority), 1000 * self.cfg.solo_headroom * alone)
        if predicted * 1000 > target:
            self._refuse(
                priority,
                429,
                f"The service is overloaded (degradation level {int(level)}): with one more "
                f"{priority.label}-priority request each token would take about {predicted * 1000:.0f} ms, over "
                f"the {target:.0f} ms target. Retry later.",
                self.cfg.retry_after_s,
            )

    def _refuse(self, priority: Priority, status: int, message: str, retry_after: int) -> None:
        raise _Refused(Refusal(status, message, retry_after))

    # --- the request's life (serving.Generation) -----------------------------------------------
    def first_token(self, request_id: str, priority: Priority, seconds: float) -> None:
        now = time.monotonic()
        self.latencies[priority].ttft.add(seconds, now, origin=now - seconds)  # of the level it was admitted at
        if request_id in self._predicted:
            self.ttft_model.learn(self._predicted[request_id][0], seconds)

    def finished(self, request_id: str, priority: Priority, tpot: float, decoded: int) -> None:
        """A request's mean time per output token after its first (what its TPOT target is about), over
        its `decoded` tokens after the first."""
        now = time.monotonic()
        self.latencies[priority].tpot.add(tpot, now)
        if priority in PROTECTED and decoded >= CAPACITY_MIN_TOKENS:
            self._capacity[priority].add(tpot, now)
        if request_id in self._predicted:
            self.tpot_model.learn(self._predicted[request_id][1], tpot)

    def ended(self, request_id: str) -> None:
        self._unplaced.pop(request_id, None)
        self._predicted.pop(request_id, None)

    # --- the controller ------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.interval_s)
            try:
                await self.tick()
            except Exception:  # the ladder must not stop over one bad look at its signals
                log.exception("degradation controller tick failed")

    async def tick(self) -> None:
        now = time.monotonic()
        for rid, q in list(self._unplaced.items()):
            if now - q.admitted_at > UNPLACED_TTL_S:
                del self._unplaced[rid]
        self._observe_windows()
        self._judge_hardware()
        snap = self.snapshot()
        self._changed(self.ladder.step(snap))
        orders = self.orders(snap)
        self._ticks += 1
        if orders != self._orders or self._ticks % RESEND_EVERY == 0:
            self._orders = orders
            await self.src.broadcast(orders)

    def _judge_hardware(self) -> None:
        """The hardware's solo figures against the targets; a change said once (a log line)."""
        targets = self.slo_ms()
        now = time.monotonic()
        lat = self.latencies[Priority.NORMAL]
        # What requests measured bounds the step-cost line's figure: with other processes on the cores a
        # few preempted steps lifted the line to 543 ms a token alone while streams took ~40 ms.
        observed = {Latency.TTFT: lat.ttft.percentile(0.5, now), Latency.TPOT: lat.tpot.percentile(0.5, now)}
        for latency, solo in self.solo_ms(self.loads()).items():
            if observed[latency] > 0:
                solo = min(solo, 1000 * observed[latency])
            verdict = self.attainable.observe(latency, solo, targets[latency])
            if verdict is not None:
                (log.info if verdict.attainable else log.warning)("%s", verdict.message())

    def orders(self, s: Snapshot) -> Degrade:
        """What running work gives up at the current level (the seed's L2 rules: high priority keeps
        speculating unless KV or the queue is over its threshold)."""
        level = self.ladder.level
        c = self.cfg
        speculate = 3
        if level >= Level.L2:
            speculate = 0 if s.kv_use >= c.kv_enter or s.queued >= c.queue_enter else int(Priority.HIGH) + 1
        offload = int(Priority.LOW) if level >= Level.L3 else 3
        target = c.offload_target if offload < 3 else 1.0
        return Degrade(int(level), speculate, offload, target, self.step_target_ms(level))

    def set_level(self, level: Level | None) -> LevelChange | None:
        change = self.ladder.set(level, self.snapshot())
        self._changed(change)
        if level is None:
            log.warning("degradation level back under automatic control (now L%d)", self.ladder.level)
        return change

    def _changed(self, change: LevelChange | None) -> None:
        if change is None:
            return
        log.warning(
            "degradation level L%d -> L%d%s: %s; signals %s",
            change.old,
            change.new,
            " (operator)" if change.manual else "",
            change.reason,
            change.signals,
        )
        if self.on_change is not None:
            self.on_change(change)
