"""`steadfast chaos`: each rehearsal starts its server, runs greedy streams undisturbed and again under
its fault, and passes only when the fault happened and every stream is token-identical to its twin.
(kill-worker runs in test_dashboard_browser.py, under the browser; the router's restart with resuming
clients is tested in more detail — seeded streams, a client dropping its own connection, event ids — by
test_router_restart.py, so its rehearsal runs in benchmarks/bench_chaos.py only.)"""

from __future__ import annotations

import json

import pytest

from tests.chaos.test_dashboard_browser import CONFIG, chaos

pytestmark = pytest.mark.chaos

TWO_WORKERS = CONFIG.replace("workers: 1, standby_workers: 1", "workers: 2, standby_workers: 0")
# Prefill on one node, decode on another: every prompt's KV crosses the wire.
SEPARATE = (
    "model: {dtype: float32, device: cpu}\n"
    "cache: {kv_memory_mb: 128}\n"
    "server: {workers: 0, prefill_workers: 1, decode_workers: 1, decode_node: separate, standby_workers: 0}\n"
    "transfer: {timeout: 500ms}\n"
)


@pytest.mark.parametrize(
    ("scenario", "config", "extra", "proof"),
    [
        ("drain", TWO_WORKERS, (), lambda r: r["migrations"] > 0),  # requests migrated live
        # The kvpool daemon killed and restarted; small grant batches make the worker need it again soon.
        (
            "kill-pool",
            CONFIG.replace("kv_memory_mb: 128", "kv_memory_mb: 128, pool_grant_batch: 2"),
            (),
            lambda r: r["takeovers"] == 0,
        ),
        # `steadfast rollout` replaced every worker while the clients kept sending (closed loop), requests
        # migrated first.
        (
            "rollout",
            TWO_WORKERS,
            ("--tokens", "60"),
            lambda r: "rollout done" in r["fault"] and r["workers_replaced"] == 2 and r["migrations"] > 0,
        ),
        # Part of the burst refused at admission, part served; no accepted request broke. (Whether the
        # level climbs too depends on the machine: with two CPU hogs beside it the ladder refused 193 of
        # 200 by their predicted TTFT at L0, and what it admitted met the targets the hardware allows.)
        ("overload", CONFIG, ("--burst", "200"), lambda r: r["burst_refused"] > 0 and r["burst_served"] > 0),
        ("slow-worker", TWO_WORKERS, ("--stop-seconds", "2"), lambda r: r["stopped_s"] > 0),
        # Every transfer resent on the primary path, then carried by the alternate one.
        (
            "break-transfer",
            SEPARATE,
            ("--tokens", "40"),
            lambda r: r["transfers_alternate"] == 4 and r["transfers_retries"] > 0 and r["transfers_primary"] == 0,
        ),
    ],
)
def test_a_rehearsal_passes_with_every_stream_identical(tmp_path, small_model_path, scenario, config, extra, proof):
    # 64 tokens a stream unless the case says otherwise (the last --tokens wins).
    proc, _, report = chaos(tmp_path, scenario, config, small_model_path, "--streams", "4", "--tokens", "64", *extra)
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, out
    got = json.loads(report.read_text())
    assert got["passed"] and got["fault_happened"] and proof(got), got
    assert got["identical"] == got["streams"] >= 4 and got["failed"] == 0
    assert "identical" in out and "recomputed tokens" in out  # the figures printed


def test_a_rehearsal_whose_fault_moves_nothing_fails(tmp_path, small_model_path):
    # One worker and no other to take its requests: a drain migrates nothing, and the rehearsal says so.
    one = CONFIG.replace("standby_workers: 1", "standby_workers: 0")
    proc, _, report = chaos(tmp_path, "drain", one, small_model_path, "--streams", "2", "--tokens", "40")
    proc.communicate(timeout=400)
    got = json.loads(report.read_text())
    assert proc.returncode == 1 and not got["fault_happened"] and not got["passed"], got
