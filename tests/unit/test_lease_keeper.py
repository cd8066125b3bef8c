"""The lease lives only while the engine loop goes round."""

from __future__ import annotations

import time

import pytest

from steadfast.kv.ledger.sqlite import SqliteLedger
from steadfast.kv.pool.client import LeaseKeeper
from tests.conftest import wait_until

pytestmark = pytest.mark.unit


def test_renewals_stop_when_the_loop_stops_beating(tmp_path):
    path = str(tmp_path / "ledger.db")
    ledger = SqliteLedger(path)
    ledger.format(4)
    epoch = ledger.acquire_lease("w0", 1, ttl_s=0.6).epoch
    keeper = LeaseKeeper(f"sqlite:///{path}", "w0", epoch, renew_s=0.05, ttl_s=0.6, stall_s=0.3)
    keeper.start()
    try:
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:  # a loop going round: renewed past its first term
            keeper.beat()
            time.sleep(0.02)
        assert ledger.lease("w0").expires > time.monotonic() and not keeper.stalled
        # The loop hangs: no more beats, so no more renewals, and the lease runs out.
        wait_until(lambda: ledger.lease("w0").expires < time.monotonic(), 5, "the lease to lapse")
        assert keeper.stalled and keeper.lost is None  # lapsed, not fenced: the pool fences it next
        keeper.beat()  # a loop that comes back too late cannot renew its way back: the lease is gone
        wait_until(lambda: keeper.lost, 5, "the renewal to be refused")
    finally:
        keeper.stop()
        ledger.close()
