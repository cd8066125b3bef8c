"""Config sections of health detection (`health`, control/fleet/health.py) and of routing (`routing`,
control/fleet/routing.py): how the router judges each worker, and where it sends a new request."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from steadfast.config.base import ConfigError


class RoutingPolicy(enum.StrEnum):
    KV_AWARE = "kv_aware"  # where the prompt's prefix is cached, weighed against each worker's queue
    LEAST_LOADED = "least_loaded"  # fewest requests in flight
    ROUND_ROBIN = "round_robin"  # in turn (the benchmark's baseline)


@dataclass(frozen=True)
class RoutingConfig:
    # kv_aware: where the prompt's prefix is cached, weighed against load (predicted TTFT); least_loaded:
    # fewest requests in flight; round_robin.
    policy: str = RoutingPolicy.KV_AWARE.value
    # Cached block names the router keeps per worker (from the workers' cache events); past it a
    # worker's index is rebuilt from its next full report.
    max_index_blocks: int = 65536
    # Routing decisions kept for GET /admin/routing.
    history: int = 200

    def __post_init__(self) -> None:
        if self.policy not in {p.value for p in RoutingPolicy}:
            raise ConfigError(f"routing.policy must be one of {', '.join(p.value for p in RoutingPolicy)}")
        if self.max_index_blocks < 1 or self.history < 1:
            raise ConfigError("routing.max_index_blocks and routing.history must be >= 1")

    @property
    def resolved_policy(self) -> RoutingPolicy:
        return RoutingPolicy(self.policy)


@dataclass(frozen=True)
class HealthConfig:
    """Four layers per worker (process, resource, request, transport) and a delta-based score: each
    signal's recent level against the worker's own baseline (the first seed article's §5).

    score = 0.30 x TPOT p99 trend (projected `horizon_s` ahead) + 0.25 x queue trend
            + 0.25 x KV-use rise / `kv_rise_full` + 0.20 x transfer resend rate / `resend_rate_full`,
    each term >= 0, the sum capped at 1.
    Over `threshold` the router migrates ceil(active x (score - threshold)) of the worker's requests
    away (lowest priority, least recently active first) and places nothing new there while another
    worker can take it."""

    # false: scores and layers are computed and shown, nothing is migrated or avoided for them.
    enabled: bool = True
    interval_s: float = 1.0  # one sample per worker per interval
    recent_s: float = 5.0  # the recent window (its median) ...
    baseline_s: float = 60.0  # ... against the worker's baseline: the median of the samples before it
    min_baseline: int = 8  # baseline samples needed before a score is given (else 0: "not known yet")
    # The TPOT term looks ahead: its recent level plus its trend (the median slope of the last `trend_s` of
    # samples) `horizon_s` ahead, so a worker that keeps getting slower is caught before it breaks its
    # SLO, while a noisy but steady one (slope ~0) is not (0: the level alone, as the seed's formula).
    trend_s: float = 10.0
    horizon_s: float = 10.0
    threshold: float = 0.6
    # A degraded worker is healthy again only once its score is at or under this (hysteresis: a score
    # hovering at the threshold does not flip the worker, and where new work goes, back and forth).
    recover_score: float = 0.45
    weight_tpot: float = 0.30
    weight_queue: float = 0.25
    weight_kv: float = 0.25
    weight_transport: float = 0.20
    kv_rise_full: float = 0.3  # a KV-use rise of 30 points counts as 1
    resend_rate_full: float = 0.05  # 5 % of transfer messages resent counts as 1
    # Floors of the baselines a trend divides by: a worker idling at 0 queued or a 2 ms step does not
    # turn a normal burst into a trend of 10.
    queue_floor: float = 4.0
    tpot_floor_ms: float = 10.0
    # A worker evicted from waits this long before the next eviction; a request moved for health is
    # not moved again for health within `request_cooldown_s` (one noisy metric cannot make work bounce).
    worker_cooldown_s: float = 3.0
    request_cooldown_s: float = 30.0
    # Request layer: a request failing on a worker (an engine error, non-finite logits) or stalling
    # (no token for `stall_s` from a worker that reports but gives nobody a token) is retried
    # elsewhere, a failure once; `sick_failures` of them within `failure_window_s` take the worker out
    # of rotation, its requests moved; after `sick_cooldown_s` it is given one request again (on
    # probation) and is healthy once that succeeds.
    stall_s: float = 10.0
    sick_failures: int = 3
    failure_window_s: float = 30.0
    sick_cooldown_s: float = 30.0
    # Resource layer: KV use at or over this (of the worker's blocks) is a warning; RSS over
    # `max_rss_mb` too (0: not checked).
    kv_warn: float = 0.95
    max_rss_mb: float = 0.0

    def __post_init__(self) -> None:
        for name in ("interval_s", "recent_s", "baseline_s", "kv_rise_full", "resend_rate_full", "stall_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"health.{name} must be positive")
        if self.baseline_s <= self.recent_s:
            raise ConfigError("health.baseline_s must be longer than health.recent_s")
        if not 0 < self.threshold < 1:
            raise ConfigError("health.threshold must be in (0, 1)")
        if not 0 <= self.recover_score <= self.threshold:
            raise ConfigError("health.recover_score must be in [0, health.threshold]")
        weights = (self.weight_tpot, self.weight_queue, self.weight_kv, self.weight_transport)
        if min(weights) < 0 or sum(weights) <= 0:
            raise ConfigError("health.weight_* must be >= 0, at least one positive")
        if self.min_baseline < 1 or self.sick_failures < 1:
            raise ConfigError("health.min_baseline and health.sick_failures must be >= 1")
        if self.trend_s <= 0 or self.horizon_s < 0:
            raise ConfigError("health.trend_s must be positive, health.horizon_s >= 0")
        for name in ("queue_floor", "tpot_floor_ms", "worker_cooldown_s", "request_cooldown_s", "max_rss_mb"):
            if getattr(self, name) < 0:
                raise ConfigError(f"health.{name} must be >= 0")
        if self.failure_window_s <= 0 or self.sick_cooldown_s < 0 or not 0 < self.kv_warn <= 1:
            raise ConfigError("health.failure_window_s must be positive, sick_cooldown_s >= 0, kv_warn in (0, 1]")
