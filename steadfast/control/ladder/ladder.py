"""The degradation ladder's controller: which level the service runs at, from its signals.

Pure (a clock is passed in): `Ladder.step(snapshot)` moves the level and returns the change, if any.
Levels rise at once when a signal crosses its enter threshold (at admission too: a burst must meet
the level it causes, not the one of half a second ago), and fall one level at a time, only after the
level has been held `min_dwell_s` and every signal is below its exit threshold. L4 and L5 are reached
by escalation: an SLO still broken after `escalate_after_s` at a level — by the requests that level
admitted — takes it one up (L1 → L4), and L4 becomes L5 when the breakage is severe (`breaker_factor`
x the target). So one noisy signal moves the level at most twice per dwell time.

Only overload moves the level by latency: the load, queue and latency signals count while the service is
crowded (more requests in flight than serving workers: one more would queue or share a step), and the
targets are those the hardware can meet (control/ladder/attainable.py). A slow machine serving one request at
a time stays at L0 whatever its latencies; once the crowd is gone the level falls to what the remaining
signals hold in one move (after its dwell), not one level per dwell.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass

from steadfast.config import DegradationConfig


class Level(enum.IntEnum):
    L0 = 0
    L1 = 1
    L2 = 2
    L3 = 3
    L4 = 4
    L5 = 5

    @property
    def action(self) -> str:
        return ACTIONS[self]


ACTIONS = {
    Level.L0: "full service",
    Level.L1: "admission control: new requests whose predicted TTFT breaks their target are refused (429), low "
    "priority first",
    Level.L2: "speculative decoding off",
    Level.L3: "KV of low-priority requests swapped out to the offload tier",
    Level.L4: "new normal and low requests get a capped max_tokens and a truncated context; normal ones are held "
    "to their TPOT target too",
    Level.L5: "circuit breaker: new normal and low requests refused (503); high only within its reserve",
}


@dataclass(frozen=True)
class Snapshot:
    """The signals one decision is made on. Latencies in ms; `*_slo_ms` the protected priorities'
    p99 targets they are measured against."""

    kv_use: float  # service-wide KV blocks used / total
    queued: int  # requests admitted and without a first token
    load: float  # the busiest worker's expected decode step over the TPOT p99 target
    predicted_ttft_ms: float  # a typical new normal request on the best worker
    ttft_p99_ms: float  # observed, high and normal priority, over the window
    tpot_p99_ms: float
    # The targets judged against: the SLO's, or what the hardware can do where it misses them alone.
    ttft_slo_ms: float
    tpot_slo_ms: float
    # The same p99s over only what the current level admitted (TTFT) or saw finish (TPOT): whether
    # the SLO is still broken *at this level*, which escalation asks (a burst before the level was
    # entered stays in the window for `window_s` and would otherwise climb the ladder on its own).
    # None: as the window's.
    level_ttft_p99_ms: float | None = None
    level_tpot_p99_ms: float | None = None
    in_flight: int = 0  # requests admitted and not finished (queued or running)
    workers: int = 1  # serving workers

    @property
    def crowded(self) -> bool:
        """More in flight than the workers serve one each: a new request would queue or share a step, so
        its latency is load's doing, which the ladder can shed, not the hardware's."""
        return self.in_flight > max(1, self.workers)

    @property
    def alone(self) -> bool:
        """Fewer in flight than serving workers: a new request would run alone (at admission)."""
        return self.in_flight < max(1, self.workers)

    @property
    def level_ttft_ms(self) -> float:
        return self.ttft_p99_ms if self.level_ttft_p99_ms is None else self.level_ttft_p99_ms

    @property
    def level_tpot_ms(self) -> float:
        return self.tpot_p99_ms if self.level_tpot_p99_ms is None else self.level_tpot_p99_ms

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class LevelChange:
    at: float  # wall-clock time (Unix seconds)
    old: Level
    new: Level
    reason: str
    signals: dict[str, float]
    manual: bool = False

    def as_dict(self) -> dict[str, object]:
        return {
            "at": self.at,
            "old": int(self.old),
            "new": int(self.new),
            "reason": self.reason,
            "signals": self.signals,
            "manual": self.manual,
        }


class Ladder:
    def __init__(
        self,
        cfg: DegradationConfig,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.cfg = cfg
        self.clock = clock
        self.wall = wall
        self.level = Level.L0
        self.since = clock()
        self.override: Level | None = None  # an operator's level, held until set back to auto
        self.reason = "start"
        self.history: deque[LevelChange] = deque(maxlen=cfg.history)
        self._broken_since: float | None = None  # an SLO observed broken since then
        self._severe_since: float | None = None

    # --- the rules -----------------------------------------------------------------------------
    def _entered(self, s: Snapshot) -> tuple[Level, str]:
        """The highest level a signal over its enter threshold asks for, and why."""
        c = self.cfg
        if s.kv_use >= c.offload_enter:
            return Level.L3, f"KV use {s.kv_use:.0%} >= {c.offload_enter:.0%}"
        if s.kv_use >= c.kv_enter:
            return Level.L2, f"KV use {s.kv_use:.0%} >= {c.kv_enter:.0%}"
        if not s.crowded:
            return Level.L0, ""
        if s.queued >= c.queue_enter:
            return Level.L2, f"{s.queued} requests queued >= {c.queue_enter}"
        if s.load >= c.load_enter:
            return Level.L2, f"load {s.load:.2f} >= {c.load_enter}"
        bar = c.ttft_enter * s.ttft_slo_ms
        if s.predicted_ttft_ms >= bar:
            return Level.L1, f"predicted TTFT {s.predicted_ttft_ms:.0f} ms >= {bar:.0f} ms"
        if s.ttft_p99_ms >= bar:
            return Level.L1, f"observed TTFT p99 {s.ttft_p99_ms:.0f} ms >= {bar:.0f} ms"
        return Level.L0, ""

    def _held(self, s: Snapshot) -> Level:
        """The highest level some signal still holds (exit thresholds): the level falls only below it."""
        c = self.cfg
        if s.crowded and self._severe(s):
            return Level.L5
        if s.crowded and self._broken(s):
            return Level.L4
        if s.kv_use >= c.offload_exit:
            return Level.L3
        if s.kv_use >= c.kv_exit:
            return Level.L2
        if not s.crowded:
            return Level.L0
        if s.queued >= c.queue_exit or s.load >= c.load_exit:
            return Level.L2
        bar = c.ttft_exit * s.ttft_slo_ms
        if s.predicted_ttft_ms >= bar or s.ttft_p99_ms >= bar:
            return Level.L1
        return Level.L0

    @staticmethod
    def _broken(s: Snapshot) -> bool:
        return s.level_ttft_ms > s.ttft_slo_ms or s.level_tpot_ms > s.tpot_slo_ms

    def _severe(self, s: Snapshot) -> bool:
        f = self.cfg.breaker_factor
        return s.level_ttft_ms >= f * s.ttft_slo_ms or s.level_tpot_ms >= f * s.tpot_slo_ms

    # --- moving --------------------------------------------------------------------------------
    def step(self, s: Snapshot, rise_only: bool = False) -> LevelChange | None:
        """Look at `s`; move the level if the rules say so. `rise_only` (at admission): only a rise."""
        now = self.clock()
        # Broken by load: a target missed while nothing crowds the service is the hardware's, not load's.
        self._broken_since = (self._broken_since or now) if s.crowded and self._broken(s) else None
        self._severe_since = (self._severe_since or now) if s.crowded and self._severe(s) else None
        if self.override is not None or not self.cfg.enabled:
            return None
        wanted, why = self._entered(s)
        if wanted > self.level:
            return self._move(wanted, why, s)
        if rise_only:
            return None
        held_for = now - self.since
        after = self.cfg.escalate_after_s
        if Level.L1 <= self.level < Level.L4 and self._broken_since is not None:
            if min(held_for, now - self._broken_since) >= after:
                return self._move(Level(self.level + 1), f"SLO still broken at {self.level.name}: {self._slo(s)}", s)
        if self.level == Level.L4 and self._severe_since is not None:
            if min(held_for, now - self._severe_since) >= after:
                return self._move(Level.L5, f"SLO broken {self.cfg.breaker_factor}x at L4: {self._slo(s)}", s)
        held = self._held(s)
        if self.level > Level.L0 and held_for >= self.cfg.min_dwell_s and held < self.level:
            if not s.crowded:  # the load is gone: down to what KV still holds, in one move
                return self._move(held, f"nothing queued or shared: {s.in_flight} in flight on {s.workers}", s)
            return self._move(Level(self.level - 1), f"signals below the exit thresholds of {self.level.name}", s)
        return None

    @staticmethod
    def _slo(s: Snapshot) -> str:
        ttft, tpot = f"{s.level_ttft_ms:.0f}/{s.ttft_slo_ms:.0f}", f"{s.level_tpot_ms:.0f}/{s.tpot_slo_ms:.0f}"
        return f"TTFT p99 {ttft} ms, TPOT p99 {tpot} ms"

    def set(self, level: Level | None, s: Snapshot) -> LevelChange | None:
        """An operator's level (held until set back to None: the controller resumes from it)."""
        self.override = level
        if level is None:
            # The operator's level was not the signals': resume from what they ask for now, not from it.
            self._broken_since = self._severe_since = None
            wanted, why = self._entered(s)
            if wanted < self.level and self.cfg.enabled:
                return self._move(wanted, f"automatic control resumed{': ' + why if why else ''}", s)
            self.reason = "automatic control resumed"
            return None
        return self._move(level, "set by an operator", s, manual=True) if level != self.level else None

    def _move(self, new: Level, reason: str, s: Snapshot, manual: bool = False) -> LevelChange:
        change = LevelChange(self.wall(), self.level, new, reason, s.as_dict(), manual)
        self.level = new
        self.since = self.clock()
        self.reason = reason
        self.history.append(change)
        return change

    def changes_within(self, seconds: float) -> int:
        """Level changes in the last `seconds` (wall clock)."""
        since = self.wall() - seconds
        return sum(1 for c in self.history if c.at >= since)
