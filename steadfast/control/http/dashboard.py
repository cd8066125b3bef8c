"""The live picture an operator reads (`/dashboard`, `steadfast status`): latency against the SLO, output
tokens per second, KV transfer bandwidth, the degradation level and its history, migrations and takeovers
running and done, each worker's KV use, queue and health, and one timeline of what happened and why.

`Dashboard.sample()` runs once a second (a task of the router) and keeps the last `SERIES` points for the
charts; `state(since)` is what `GET /admin/dashboard` answers: the points and events after `since` (so a
page polling every second fetches only what is new) and the current figures.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from prometheus_client import Counter

from steadfast.control.fleet.migration import MigrationOutcome, MigrationReason
from steadfast.control.fleet.timeline import Event, EventKind
from steadfast.control.http.serving import ServingContext
from steadfast.control.http.tags import request_tag
from steadfast.control.ladder.ladder import Level
from steadfast.control.ladder.view import hardware_message
from steadfast.wire.worker import Priority

SERIES = 900  # points kept: fifteen minutes at one a second
EVENTS = 200  # at most this many events in one answer (the newest)
INTERVAL_S = 1.0
FAILED = (MigrationOutcome.ABORTED, MigrationOutcome.LOST)  # the source kept it; an owner died (taken over)


@dataclass
class Point:
    at: float  # wall clock
    tokens_per_s: float
    kv_mb_per_s: float  # KV bytes moved between workers (disaggregated prefill, migrations), MB/s
    level: int
    ttft_p50_ms: float  # the normal priority's, over the ladder's window
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    running: int
    queued: int


def counter_total(counter: Counter) -> float:
    """A counter's value summed over its labels (from its samples: the client's public interface)."""
    return sum(s.value for metric in counter.collect() for s in metric.samples if s.name.endswith("_total"))


class Dashboard:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        self.series: deque[Point] = deque(maxlen=SERIES)
        self._last: tuple[float, float, float] | None = None  # (monotonic, tokens, KV bytes) at the last sample

    async def run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(INTERVAL_S)

    def sample(self) -> None:
        m, now = self.ctx.metrics, time.monotonic()
        tokens = counter_total(m.generation_tokens)
        moved = counter_total(m.kv_transfer_bytes) + counter_total(m.migration_bytes)
        rate = kv_rate = 0.0
        if self._last is not None and now > self._last[0]:
            rate = (tokens - self._last[1]) / (now - self._last[0])
            kv_rate = (moved - self._last[2]) / (now - self._last[0]) / 1e6
        self._last = (now, tokens, moved)
        observed = self._observed(Priority.NORMAL, now)
        workers = [w for w in self.ctx.client.workers if not w.dead and w.status is not None]
        self.series.append(
            Point(
                time.time(),
                round(rate, 1),
                round(kv_rate, 3),
                int(self._level()),
                observed["ttft_p50"],
                observed["ttft_p99"],
                observed["tpot_p50"],
                observed["tpot_p99"],
                sum(w.status.num_running for w in workers if w.status is not None),
                sum(w.status.num_waiting for w in workers if w.status is not None),
            )
        )

    def _level(self) -> Level:
        d = self.ctx.degradation
        return d.ladder.level if d is not None else Level.L0

    def _observed(self, p: Priority, now: float) -> dict[str, float]:
        d = self.ctx.degradation
        if d is None:
            return {"ttft_p50": 0.0, "ttft_p99": 0.0, "tpot_p50": 0.0, "tpot_p99": 0.0}
        lat = d.latencies[p]
        return {
            "ttft_p50": round(1000 * lat.ttft.percentile(0.5, now), 1),
            "ttft_p99": round(1000 * lat.ttft.percentile(0.99, now), 1),
            "tpot_p50": round(1000 * lat.tpot.percentile(0.5, now), 1),
            "tpot_p99": round(1000 * lat.tpot.percentile(0.99, now), 1),
        }

    # --- the answer ----------------------------------------------------------------------------
    def state(self, since: float = 0.0) -> dict[str, Any]:
        ctx, now = self.ctx, time.monotonic()
        d = ctx.degradation
        slo = {}
        for p in Priority:
            targets = d.slo.targets(p) if d is not None else None
            slo[p.label] = {
                "target_ms": {"ttft": vars(targets.ttft_ms), "tpot": vars(targets.tpot_ms)} if targets else {},
                "observed_ms": self._observed(p, now),
            }
        level = self._level()
        return {
            "now": time.time(),
            "model": ctx.model_name,
            "slo": slo,
            "level": {
                "level": int(level),
                "action": level.action,
                "mode": ("manual" if d.ladder.override is not None else "auto" if d.cfg.enabled else "off")
                if d is not None
                else "off",
                "reason": d.ladder.reason if d is not None else "",
                "hardware": hardware_message(d) if d is not None else "",
                "since_s": round(now - d.ladder.since, 1) if d is not None else 0.0,
                "history": [c.as_dict() for c in d.ladder.history] if d is not None else [],
            },
            "series": [asdict(p) for p in self.series if p.at > since],
            "workers": self._workers(),
            "moves": self._moves(),
            "events": [e.as_dict() for e in self.events(since)],
        }

    def _workers(self) -> list[dict[str, Any]]:
        health = self.ctx.client.health
        rows = []
        for w in self.ctx.client.workers:
            if w.dead:
                continue
            s, h = w.status, health.of(w.worker_id)
            rows.append(
                {
                    "id": w.worker_id,
                    "role": w.role.value,
                    "state": s.state.value if s else "starting",
                    "liveness": w.liveness.value,
                    "draining": w.draining,
                    "kv_use": round(w.kv_use, 3),
                    "running": s.num_running if s else 0,
                    "queued": s.num_waiting if s else 0,
                    "score": round(h.score.value, 3),
                    "standing": h.standing.value,
                }
            )
        return rows

    def _moves(self) -> dict[str, Any]:
        client = self.ctx.client
        records = list(client.migrations.records)
        running = [r for r in records if not r.done]
        takeovers = list(client.takeovers)
        return {
            "migrations_running": len(running),
            "migrations_committed": sum(1 for r in records if r.outcome is MigrationOutcome.COMMITTED),
            "migrations_failed": sum(
                1 for r in records if r.outcome in (MigrationOutcome.ABORTED, MigrationOutcome.LOST)
            ),
            "takeovers_running": sum(1 for t in takeovers if t.first_token_s is None),
            "takeovers_done": sum(1 for t in takeovers if t.first_token_s is not None),
            "running": [
                {
                    "request": request_tag(r.request_id),
                    "from": r.from_worker,
                    "to": r.to_worker,
                    "reason": r.reason.value,
                }
                for r in running
            ],
        }

    def events(self, since: float = 0.0) -> list[Event]:
        """The timeline after `since` (wall clock), oldest first, the newest `EVENTS` of them: the engine
        client's own log merged with the records other parts keep."""
        client, d = self.ctx.client, self.ctx.degradation
        merged: list[Event] = list(client.timeline.events)
        if d is not None:
            for c in d.ladder.history:
                who = "an operator" if c.manual else "the ladder"
                merged.append(Event(c.at, EventKind.LEVEL, None, f"L{int(c.old)} -> L{int(c.new)} by {who}", c.reason))
        for h in client.health.events:
            merged.append(Event(h.at, EventKind.HEALTH, h.worker_id, h.what, h.reason))
        for r in client.migrations.records:
            kind = EventKind.DRAIN if r.reason is MigrationReason.DRAIN else EventKind.MIGRATION
            what = f"request {request_tag(r.request_id)} {r.from_worker} -> {r.to_worker}: {r.outcome.value}"
            merged.append(Event(r.started, kind, r.from_worker, what, f"{r.reason.value} {r.error}".strip()))
        for t in client.takeovers:
            what = f"request {request_tag(t.request_id)} {t.from_worker} -> {t.to_worker} at token {t.at_token}"
            why = f"{t.route.value}: {t.adopted_tokens} token(s) adopted, {t.recomputed_tokens} recomputed"
            merged.append(Event(t.wall, EventKind.TAKEOVER, t.from_worker, what, why))
        merged = sorted((e for e in merged if e.at > since), key=lambda e: e.at)
        return merged[-EVENTS:]
