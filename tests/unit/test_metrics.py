"""The KV transfer metrics: what each kind of handoff report counts, per path."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from steadfast.control.http.metrics import Metrics
from steadfast.wire.worker import Handoff

pytestmark = pytest.mark.unit


def test_handoff_reports_are_counted_per_path_and_outcome():
    m = Metrics()
    m.handoff(Handoff(1, [4, 5, 6], copied=1, seconds=0.002, path="same_node"))
    m.handoff(Handoff(1, error="lease gone", path="same_node"))  # refused: decoded where it was
    mib = 2**20
    m.handoff(Handoff(2, [7], seconds=0.01, path="alternate", retries=3, fallbacks=1, bytes=mib, stream_seconds=0.5))
    m.handoff(Handoff(2, error="every path failed", retries=4, fallbacks=2, bytes=mib, fallback="recompute"))
    m.handoff(Handoff(2, error="every path failed", fallbacks=2, fallback="error"))
    text = generate_latest(m.registry).decode()
    for line in [
        'steadfast_kv_transfers_total{outcome="done",path="same_node"} 1.0',
        'steadfast_kv_transfers_total{outcome="refused",path="same_node"} 1.0',
        'steadfast_kv_transfer_blocks_total{kind="handed",path="same_node"} 2.0',
        'steadfast_kv_transfer_blocks_total{kind="copied",path="same_node"} 1.0',
        'steadfast_kv_transfers_total{outcome="done",path="alternate"} 1.0',
        'steadfast_kv_transfer_retries_total{path="alternate"} 3.0',
        'steadfast_kv_transfer_fallbacks_total{path="alternate"} 1.0',
        'steadfast_kv_transfer_bandwidth_bytes_per_second_sum{path="alternate"} 2.097152e+06',  # 1 MiB in 0.5 s
        'steadfast_kv_transfers_total{outcome="recompute",path="failed"} 1.0',
        'steadfast_kv_transfers_total{outcome="failed",path="failed"} 1.0',
        'steadfast_kv_transfer_fallbacks_total{path="failed"} 4.0',
        'steadfast_kv_transfer_bytes_total{path="failed"} 1.048576e+06',
    ]:
        assert line in text, line
    assert 'steadfast_kv_transfer_seconds_count{path="failed"}' not in text  # no latency for a failure
