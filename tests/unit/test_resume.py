"""Resumption from the nodes' ledgers (a restarted router) honours the idempotency window too."""

from __future__ import annotations

import pytest

from steadfast.control.fleet.resume import Resumption, UnknownRequestError
from steadfast.kv.ledger.interface import RequestCheckpoint
from steadfast.kv.ledger.sqlite import SqliteLedger

pytestmark = pytest.mark.unit


def test_a_finished_request_past_the_window_is_not_resumed_from_the_ledger(tmp_path):
    path = str(tmp_path / "ledger.db")
    ledger = SqliteLedger(path, wall_clock=lambda: 1000.0)
    ledger.format(4)
    epoch = ledger.acquire_lease("worker0", 1, ttl_s=5).epoch
    ledger.checkpoint("worker0", epoch, [RequestCheckpoint("done", [1, 2], "[]", [3, 4], 2, "finished")])
    ledger.checkpoint("worker0", epoch, [RequestCheckpoint("running", [1, 2], "[]", [5], 1, "decode")])
    ledger.close()
    now = [1030.0]
    resumption = Resumption(60.0, [f"sqlite:///{path}"], wall_clock=lambda: now[0])
    assert resumption.lookup("done").tokens == [3, 4]
    now[0] = 1061.0  # a minute and a second after the request finished
    with pytest.raises(UnknownRequestError):
        resumption.lookup("done")
    assert resumption.lookup("running").tokens == [5]  # a request still running has no window yet
