"""Prometheus metrics of the router: latency histograms, load gauges and token counters."""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from steadfast.control.fleet.migration import MigrationRecord
from steadfast.control.ladder.ladder import LevelChange
from steadfast.wire.worker import Handoff, Priority

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "steadfast_time_to_first_token_seconds",
            "Time from request arrival to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "steadfast_time_per_output_token_seconds",
            "Time between successive output tokens",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "steadfast_e2e_request_latency_seconds",
            "Request latency from arrival to last token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.requests = Counter("steadfast_requests", "Finished requests", ["finish_reason"], registry=r)
        self.rejected = Counter("steadfast_rejected_requests", "Requests refused with an error", ["status"], registry=r)
        self.prompt_tokens = Counter("steadfast_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("steadfast_generation_tokens", "Tokens generated", registry=r)
        self.tokens_per_second = Gauge(
            "steadfast_generation_tokens_per_second", "Output tokens per second over the last 10 s", registry=r
        )
        self.running = Gauge("steadfast_num_requests_running", "Requests being computed", ["worker"], registry=r)
        self.waiting = Gauge("steadfast_num_requests_waiting", "Requests queued in a worker", ["worker"], registry=r)
        self.queue_depth = Gauge(
            "steadfast_queue_depth", "Requests waiting for their first token (all workers)", registry=r
        )
        self.kv_used = Gauge("steadfast_kv_blocks_used", "KV blocks in use", ["worker"], registry=r)
        self.kv_free = Gauge("steadfast_kv_blocks_free", "KV blocks free", ["worker"], registry=r)
        self.spec_drafted = Gauge(
            "steadfast_spec_draft_tokens", "Draft tokens verified since the worker started", ["worker"], registry=r
        )
        self.spec_accepted = Gauge(
            "steadfast_spec_accepted_tokens", "Draft tokens accepted since the worker started", ["worker"], registry=r
        )
        self.spec_acceptance = Gauge(
            "steadfast_spec_acceptance_rate", "Accepted / verified draft tokens of the worker", ["worker"], registry=r
        )
        self.tokens_per_step = Gauge(
            "steadfast_tokens_per_step",
            "Output tokens per decoding request-step (above 1 with speculative decoding)",
            ["worker"],
            registry=r,
        )
        self.kv_offloaded = Gauge(
            "steadfast_kv_blocks_offloaded", "KV blocks the worker holds in the offload tier", ["worker"], registry=r
        )
        self.offload_blocks = Gauge(
            "steadfast_kv_offload_blocks",
            "KV blocks moved to (written) or from (fetched) the offload tier since the worker started",
            ["worker", "direction"],
            registry=r,
        )
        self.preemptions = Gauge(
            "steadfast_preemptions",
            "Requests preempted for KV room since the worker started, by what kept their KV",
            ["worker", "kind"],
            registry=r,
        )
        self.recomputed_tokens = Gauge(
            "steadfast_preemption_recomputed_tokens",
            "Tokens of KV preempted requests computed again since the worker started",
            ["worker"],
            registry=r,
        )
        self.wire_dropped = Gauge(
            "steadfast_kv_wire_dropped",
            "Messages the worker's KV receiver dropped since it started, by why (junk, out of session, unsealed...)",
            ["worker", "reason"],
            registry=r,
        )
        self.wire_refused = Gauge(
            "steadfast_kv_wire_refused",
            "KV moves the worker's receiver refused since it started, by why (busy, no_room...)",
            ["worker", "reason"],
            registry=r,
        )
        self.kv_made = Gauge(
            "steadfast_kv_blocks_made",
            "Blocks of the worker's KV arena that have memory (a node's arena takes memory as it is used)",
            ["worker"],
            registry=r,
        )
        self.worker_up = Gauge("steadfast_worker_up", "1 if the worker is ready", ["worker"], registry=r)
        self.health_score = Gauge(
            "steadfast_worker_health_score", "Delta-based health score, 0 healthy .. 1", ["worker"], registry=r
        )
        self.health_standing = Gauge(
            "steadfast_worker_health_standing", "1 for the worker's standing", ["worker", "standing"], registry=r
        )
        self.health_retries = Gauge(
            "steadfast_health_retried_requests", "Requests retried elsewhere after failing on a worker", registry=r
        )
        self.routing_hit_rate = Gauge(
            "steadfast_routing_prefix_hit_rate", "Routed prompt tokens found cached on the chosen worker", registry=r
        )
        self.kv_transfers = Counter(
            "steadfast_kv_transfers", "KV handoffs between workers", ["path", "outcome"], registry=r
        )
        self.kv_transfer_blocks = Counter(
            "steadfast_kv_transfer_blocks",
            "KV blocks given to another worker (handed or copied)",
            ["path", "kind"],
            registry=r,
        )
        self.kv_transfer_seconds = Histogram(
            "steadfast_kv_transfer_seconds",
            "Time to hand a request's KV over",
            ["path"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.kv_transfer_bytes = Counter(
            "steadfast_kv_transfer_bytes", "KV bytes streamed to other nodes", ["path"], registry=r
        )
        self.kv_transfer_bandwidth = Histogram(
            "steadfast_kv_transfer_bandwidth_bytes_per_second",
            "KV bytes per second, first chunk sent to acknowledged (layer-wise: paced by the prefill)",
            ["path"],
            buckets=(1e6, 1e7, 5e7, 1e8, 2.5e8, 5e8, 1e9, 2.5e9, 5e9, 1e10),
            registry=r,
        )
        self.kv_transfer_retries = Counter(
            "steadfast_kv_transfer_retries",
            "KV transfer attempts resent on the same path (by the path that ended it; failed: none did)",
            ["path"],
            registry=r,
        )
        self.kv_transfer_fallbacks = Counter(
            "steadfast_kv_transfer_fallbacks",
            "KV transfer paths given up for the next one (by the path that ended it; failed: none did)",
            ["path"],
            registry=r,
        )
        self.migrations = Counter(
            "steadfast_migrations", "Live migrations ended, by outcome and path", ["outcome", "path"], registry=r
        )
        self.migration_downtime = Histogram(
            "steadfast_migration_downtime_seconds",
            "A migrated request's time in no running batch (source's last step to the destination's first)",
            ["path"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=r,
        )
        self.migration_gap = Histogram(
            "steadfast_migration_gap_seconds",
            "The client's pause across a migration (last token from the source to the first from the destination)",
            ["path"],
            buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
            registry=r,
        )
        self.migration_bytes = Counter("steadfast_migration_bytes", "KV bytes copied by migrations", registry=r)
        self.migration_mismatches = Gauge(
            "steadfast_migration_token_mismatches",
            "Tokens both the old and the new owner of a migrated request produced, differently (should be 0)",
            registry=r,
        )
        self.degradation_level = Gauge(
            "steadfast_degradation_level",
            "The degradation ladder's level: 0 full service, 1 admission control, 2 speculation off, "
            "3 low-priority KV offloaded, 4 new requests shortened, 5 circuit breaker",
            registry=r,
        )
        self.degradation_changes = Counter(
            "steadfast_degradation_changes", "Degradation level changes, up or down", ["direction"], registry=r
        )
        self.degradation_refused = Counter(
            "steadfast_degradation_refused",
            "New requests refused by the degradation ladder or their priority's queue bound, by status",
            ["priority", "status"],
            registry=r,
        )
        self._window: deque[tuple[float, int]] = deque()
        self.queue_depth.set_function(lambda: self._awaiting_first)
        self.tokens_per_second.set_function(self._rate)
        self._awaiting_first = 0

    def handoff(self, h: Handoff) -> None:
        """A prefill worker's report of one KV handoff: on its node (zero copy, or refused: decoded in
        place) or streamed to another (by which path, resends, paths given up; or failed: recomputed)."""
        path = h.path or "failed"
        if h.error:
            outcome = {"recompute": "recompute", "error": "failed"}.get(h.fallback, "refused")
            self.kv_transfers.labels(path, outcome).inc()
        else:
            self.kv_transfers.labels(path, "done").inc()
            self.kv_transfer_seconds.labels(path).observe(h.seconds)
        if path == "same_node":
            self.kv_transfer_blocks.labels(path, "handed").inc(len(h.block_ids) - h.copied)
            self.kv_transfer_blocks.labels(path, "copied").inc(h.copied)
        else:
            self.kv_transfer_bytes.labels(path).inc(h.bytes)
            self.kv_transfer_retries.labels(path).inc(h.retries)
            self.kv_transfer_fallbacks.labels(path).inc(h.fallbacks)
            if not h.error and h.stream_seconds > 0:
                self.kv_transfer_bandwidth.labels(path).observe(h.bytes / h.stream_seconds)

    def migration(self, record: MigrationRecord) -> None:
        """One migration ended (committed, aborted, or lost to a death)."""
        path = record.path or "none"
        self.migrations.labels(record.outcome, path).inc()
        self.migration_bytes.inc(record.bytes)
        if record.downtime_s is not None:
            self.migration_downtime.labels(path).observe(record.downtime_s)
        if record.gap_s is not None:
            self.migration_gap.labels(path).observe(record.gap_s)

    def level_changed(self, change: LevelChange) -> None:
        self.degradation_level.set(int(change.new))
        self.degradation_changes.labels("up" if change.new > change.old else "down").inc()

    def refused(self, priority: Priority, status: int) -> None:
        self.degradation_refused.labels(priority.label, str(status)).inc()

    def request_started(self) -> None:
        self._awaiting_first += 1

    def first_token(self, seconds: float) -> None:
        self._awaiting_first -= 1
        self.ttft.observe(seconds)

    def request_ended_before_first_token(self) -> None:
        self._awaiting_first -= 1

    def tokens(self, count: int) -> None:
        self.generation_tokens.inc(count)
        now = time.monotonic()
        self._window.append((now, count))
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._window and now - self._window[0][0] > 10.0:
            self._window.popleft()

    def _rate(self) -> float:
        self._trim(time.monotonic())
        return sum(c for _, c in self._window) / 10.0
