"""Config sections of the service's promises and of what it gives up to keep them: the SLOs per
priority (`slo`) and the degradation ladder (`degradation`, control/ladder/ladder.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from steadfast.config.base import ConfigError
from steadfast.wire.worker import Priority


@dataclass(frozen=True)
class Percentiles:
    """Targets in milliseconds for the median and the 99th percentile."""

    p50: float  # ms, the median's target
    p99: float  # ms, the 99th percentile's target

    def check(self, where: str) -> None:
        if not 0 < self.p50 <= self.p99:
            raise ConfigError(f"{where} must satisfy 0 < p50 <= p99, got p50={self.p50} p99={self.p99}")


@dataclass(frozen=True)
class TtftSlo(Percentiles):
    p50: float = 200.0  # time to first token, ms: median target
    p99: float = 500.0  # time to first token, ms: 99th percentile target


@dataclass(frozen=True)
class TpotSlo(Percentiles):
    p50: float = 30.0  # a request's mean time per output token, ms: median target
    p99: float = 80.0  # a request's mean time per output token, ms: 99th percentile target


@dataclass(frozen=True)
class PercentilesOverride:
    """A priority's own targets; 0 keeps the service-wide one."""

    p50: float = 0.0  # this priority's own median target, ms (0: the service-wide one)
    p99: float = 0.0  # this priority's own 99th percentile target, ms (0: the service-wide one)

    def over(self, base: Percentiles) -> Percentiles:
        return Percentiles(self.p50 or base.p50, self.p99 or base.p99)


@dataclass(frozen=True)
class SloOverride:
    ttft_ms: PercentilesOverride = field(default_factory=PercentilesOverride)
    tpot_ms: PercentilesOverride = field(default_factory=PercentilesOverride)


@dataclass(frozen=True)
class SloTargets:
    ttft_ms: Percentiles
    tpot_ms: Percentiles


@dataclass(frozen=True)
class SloConfig:
    """Latency targets: time to first token and time per output token, p50 and p99, in ms (the first
    seed article's values by default), each overridable per priority: `slo: {high: {ttft_ms: {p99: 300}}}`."""

    ttft_ms: TtftSlo = field(default_factory=TtftSlo)
    tpot_ms: TpotSlo = field(default_factory=TpotSlo)
    high: SloOverride = field(default_factory=SloOverride)
    normal: SloOverride = field(default_factory=SloOverride)
    low: SloOverride = field(default_factory=SloOverride)

    def __post_init__(self) -> None:
        for p in Priority:
            t = self.targets(p)
            t.ttft_ms.check(f"slo.{p.label}.ttft_ms")
            t.tpot_ms.check(f"slo.{p.label}.tpot_ms")

    def targets(self, priority: Priority) -> SloTargets:
        own: SloOverride = getattr(self, priority.label)
        return SloTargets(own.ttft_ms.over(self.ttft_ms), own.tpot_ms.over(self.tpot_ms))


@dataclass(frozen=True)
class DegradationConfig:
    """The degradation ladder (L0 full service … L5 circuit breaker), run by the router.

    Levels rise as soon as a signal crosses its enter threshold and fall one at a time, each only after
    it has been held `min_dwell_s` and every signal is below its exit threshold: enter and exit apart,
    so a signal wavering around one threshold moves the level at most twice per dwell time."""

    # false: the level stays at L0 unless an operator sets one (POST /admin/degradation); signals are
    # still measured and shown. The bounded queues below hold at every level.
    enabled: bool = True
    interval_s: float = 0.5  # how often the controller looks at its signals (a rise also happens at admission)
    window_s: float = 10.0  # observed TTFT/TPOT percentiles over this sliding window
    min_dwell_s: float = 5.0  # a level is held at least this long before it falls
    # A level held this long with an SLO still broken goes one up (L1 → L4; L5 needs `breaker_factor`).
    escalate_after_s: float = 5.0
    # Bounded queues: requests of a priority admitted and without a first token, per serving worker;
    # beyond, 429 + Retry-After at any level.
    max_queued_high: int = 64
    max_queued_normal: int = 48
    max_queued_low: int = 32
    # L1 (admission by predicted TTFT): entered when a new normal request's predicted TTFT reaches
    # `ttft_enter` x its TTFT p99 target (or the observed p99 does), left below `ttft_exit` x it.
    ttft_enter: float = 0.8
    ttft_exit: float = 0.5
    # From L1 a new request predicted to miss its TTFT target (normal: p99, low: p50) is refused (429)
    # while the service is out of capacity (the observed TPOT p99 of the protected priorities' requests
    # of 32 tokens or more over its target); with capacity to spare, only one predicted past `ttft_refuse`
    # x it. A refused client waits Retry-After on top of the queue it would have waited behind, so
    # refusing a burst that the service drains just past the target makes TTFT worse; refusing in
    # overload keeps every stream's TPOT.
    ttft_refuse: float = 2.0
    # L2 (speculative decoding off), the seed's rules: KV use, requests queued (service-wide), load
    # (a decode step's expected time over the TPOT p99 target, on the busiest worker).
    kv_enter: float = 0.85
    kv_exit: float = 0.75
    queue_enter: int = 32
    queue_exit: int = 16
    load_enter: float = 0.7
    load_exit: float = 0.5
    # L3 (low-priority KV to the offload tier): entered at this KV use; workers swap low-priority
    # requests out down to `offload_target` (only with cache.offload_tier, up to its cap).
    offload_enter: float = 0.9
    offload_exit: float = 0.8
    offload_target: float = 0.8
    # L4 (new normal and low requests shortened): max_tokens capped, prompts cut to the most recent
    # tokens that fit (a chat keeps its system message and its latest turns).
    max_tokens_cap: int = 256
    max_context_tokens: int = 1024
    # L5 (circuit breaker): entered from L4 when the observed (or predicted) TTFT p99 of normal requests
    # passes `breaker_factor` x its target. High-priority requests still get in while fewer than
    # `high_reserve` per serving worker are in flight.
    breaker_factor: float = 3.0
    high_reserve: int = 8
    # A latency target the hardware misses with one request alone (its measured solo step, or a typical
    # prompt's prefill) is said once, and the ladder judges that latency against this many times the solo
    # figure instead: load can be shed, the hardware's speed cannot.
    solo_headroom: float = 2.0
    # Retry-After (seconds) on a 503 from the breaker; a 429's is the predicted wait, at least 1.
    retry_after_s: int = 2
    # Level changes kept for GET /admin/degradation.
    history: int = 200

    def __post_init__(self) -> None:
        for a, b in (
            ("ttft_enter", "ttft_exit"),
            ("kv_enter", "kv_exit"),
            ("queue_enter", "queue_exit"),
            ("load_enter", "load_exit"),
            ("offload_enter", "offload_exit"),
        ):
            enter, exit_ = getattr(self, a), getattr(self, b)
            if not 0 < exit_ < enter:
                raise ConfigError(f"degradation.{b} must be positive and below degradation.{a} (hysteresis)")
        for name in ("interval_s", "window_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"degradation.{name} must be positive")
        if self.ttft_refuse < 1:
            raise ConfigError("degradation.ttft_refuse must be >= 1 (a request within its target is never refused)")
        if self.min_dwell_s < 0 or self.escalate_after_s < 0:
            raise ConfigError("degradation.min_dwell_s and escalate_after_s must be >= 0")
        for name in ("max_queued_high", "max_queued_normal", "max_queued_low", "max_tokens_cap", "retry_after_s"):
            if getattr(self, name) < 1:
                raise ConfigError(f"degradation.{name} must be >= 1")
        if self.max_context_tokens < 16:
            raise ConfigError("degradation.max_context_tokens must be >= 16")
        if self.solo_headroom < 1:
            raise ConfigError("degradation.solo_headroom must be >= 1 (what the hardware does alone is attainable)")
        if not 0 < self.offload_target <= 1 or self.breaker_factor <= 1 or self.high_reserve < 0:
            raise ConfigError("degradation.offload_target must be in (0, 1], breaker_factor > 1, high_reserve >= 0")
        if self.history < 1:
            raise ConfigError("degradation.history must be >= 1")

    def max_queued(self, priority: Priority) -> int:
        return int(getattr(self, f"max_queued_{priority.label}"))
