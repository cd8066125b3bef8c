"""What `GET /admin/degradation` shows of the ladder at work (`degrade.Degradation`): the level, what it
does to each priority, why, the signals service-wide and per worker, the calibration, the history."""

from __future__ import annotations

import time
from typing import Any

from steadfast.control.fleet.signals import WorkerLoad, predict_ttft
from steadfast.control.ladder.degrade import TYPICAL_OUTPUT, TYPICAL_PROMPT, Degradation, refused_by_prediction
from steadfast.control.ladder.ladder import Level
from steadfast.wire.worker import Priority


def worker_signals(d: Degradation, loads: list[WorkerLoad]) -> list[dict[str, float]]:
    """Each serving worker's own signals: KV use, requests, a typical new normal request's predicted TTFT
    and time per token there (calibrated)."""
    target = d.step_target_ms(d.ladder.level)
    rows = []
    for w in loads:
        ttft = predict_ttft(w, TYPICAL_PROMPT, Priority.NORMAL, d.sched, d.block_size, target)
        tpot = w.tpot_s(TYPICAL_PROMPT, TYPICAL_OUTPUT) if w.measured else 0.0
        rows.append(
            {
                "worker": w.worker_id,
                "kv_use": round(w.kv_use, 3),
                "running": len(w.running),
                "queued": len(w.queued),
                "predicted_ttft_ms": round(1000 * d.ttft_model.factor * ttft, 1),
                "predicted_tpot_ms": round(1000 * d.tpot_model.factor * tpot, 1),
            }
        )
    return rows


def admission(level: Level, priority: Priority, high_reserve: int) -> str:
    if level >= Level.L5 and priority != Priority.HIGH:
        return "refused (503)"
    if level >= Level.L5:
        return f"within the reserve of {high_reserve} per worker"
    if refused_by_prediction(priority, level):
        return "refused (429) when its predicted TTFT (or TPOT) breaks its bar for this level"
    return "open"


def hardware(d: Degradation) -> dict[str, dict[str, object]]:
    """Each latency target against what the hardware does alone, and what the ladder judges against."""
    return d.attainable.view(d.slo_ms())


def hardware_message(d: Degradation) -> str:
    """The unattainable targets, said in one line ("" when every target is within the hardware's reach)."""
    return "; ".join(str(v["message"]) for v in hardware(d).values() if v["message"])


def ladder_view(d: Degradation) -> dict[str, Any]:
    loads = d.loads()
    snap = d.snapshot(loads)
    level = d.ladder.level
    orders = d.orders(snap)
    now = time.monotonic()
    per_priority = {}
    for p in Priority:
        targets = d.slo.targets(p)
        lat = d.latencies[p]
        per_priority[p.label] = {
            "admission": admission(level, p, d.cfg.high_reserve),
            "speculative": int(p) < orders.speculate_below,
            "offloaded": int(p) >= orders.offload_from,
            "shortened": level >= Level.L4 and p != Priority.HIGH,
            "slo_ms": {"ttft": vars(targets.ttft_ms), "tpot": vars(targets.tpot_ms)},
            "observed_ms": {
                "ttft_p50": 1000 * lat.ttft.percentile(0.5, now),
                "ttft_p99": 1000 * lat.ttft.percentile(0.99, now),
                "tpot_p50": 1000 * lat.tpot.percentile(0.5, now),
                "tpot_p99": 1000 * lat.tpot.percentile(0.99, now),
            },
        }
    return {
        "level": int(level),
        "action": level.action,
        "mode": "manual" if d.ladder.override is not None else ("auto" if d.cfg.enabled else "off"),
        "since_s": round(now - d.ladder.since, 3),
        "reason": d.ladder.reason,
        "signals": snap.as_dict(),
        # Latency signals count only while crowded (more in flight than serving workers).
        "crowded": snap.crowded,
        "hardware": hardware(d),
        "workers": worker_signals(d, loads),
        # measured / predicted, learnt from finished requests
        "calibration": {"ttft": round(d.ttft_model.factor, 3), "tpot": round(d.tpot_model.factor, 3)},
        # L1's capacity signal: TPOT p99 of the protected requests of CAPACITY_MIN_TOKENS tokens or more.
        "capacity_tpot_p99_ms": round(d.capacity_tpot_p99_ms, 1),
        "priorities": per_priority,
        "history": [c.as_dict() for c in d.ladder.history],
    }
