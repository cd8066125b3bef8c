"""The router's delivery rules, in-process: exactly once and in order, only from a request's current
owner, regenerated tokens a client holds are swallowed; and a promoted standby's warm-up ramp."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from steadfast.config import TakeoverConfig
from steadfast.control.engine_client import EngineClient, Flight
from steadfast.protocol import AddRequest, RequestOutput, SamplingParams, StepOutputs, WorkerStatus

pytestmark = pytest.mark.unit


@pytest.fixture
def client(tmp_path):
    c = EngineClient(
        [(0, f"ipc://{tmp_path}/w0", "mixed"), (1, f"ipc://{tmp_path}/w1", "standby")],
        f"ipc://{tmp_path}/out-{uuid.uuid4().hex[:6]}",
        0.5,
        TakeoverConfig(warmup=10.0),
        max_in_flight=20,
    )
    yield c
    c.ctx.destroy(linger=0)


def flight(client: EngineClient, owner: int, delivered: list[int], skip_until: int = 0) -> Flight:
    f = Flight(AddRequest("r", [1, 2, 3], SamplingParams()), asyncio.Queue(), owner, list(delivered))
    f.skip_until = skip_until
    client._flights["r"] = f
    return f


def out(index: int, token: int, text: str = "x") -> RequestOutput:
    return RequestOutput("r", [token], text, index=index)


def forwarded(f: Flight) -> list[int]:
    got = []
    while not f.queue.empty():
        got.extend(f.queue.get_nowait().token_ids)
    return got


def test_each_token_index_is_forwarded_once_in_order_from_the_owner_only(client):
    f = flight(client, owner=0, delivered=[7, 8])
    client._deliver(StepOutputs(0, [out(2, 9)]))
    client._deliver(StepOutputs(0, [out(2, 9)]))  # the same index again: a duplicate
    client._deliver(StepOutputs(1, [out(3, 10)]))  # a worker that does not own it (a zombie)
    client._deliver(StepOutputs(0, [out(4, 11)]))  # a gap: never forwarded out of order
    client._deliver(StepOutputs(0, [out(3, 10)]))
    assert forwarded(f) == [9, 10]
    assert f.delivered == [7, 8, 9, 10] and f.text_chars == 2


def test_regenerated_tokens_the_client_holds_are_not_resent(client):
    # A reconnect after a router restart: the ledger knew 2 tokens, the client holds 4.
    f = flight(client, owner=0, delivered=[7, 8], skip_until=4)
    for i, token in enumerate([9, 10, 11, 12], start=2):
        client._deliver(StepOutputs(0, [out(i, token, "" if i < 4 else "y")]))
    assert forwarded(f) == [11, 12]
    assert f.delivered == [7, 8, 9, 10, 11, 12]


def test_new_requests_leave_the_kv_reserve_to_takeovers(client):
    w = client._workers[0]
    w.status = WorkerStatus(0, 1, "mixed", "ready", kv_blocks_total=100, kv_blocks_used=89)
    assert client.has_room(w)
    w.status = WorkerStatus(0, 1, "mixed", "ready", kv_blocks_total=100, kv_blocks_used=90)
    assert not client.has_room(w)  # the last 10 % waits for requests moved off a dead worker


def test_a_promoted_standby_ramps_up_its_share_of_new_requests(client):
    standby = client._workers[1]
    assert client.has_room(standby)  # never promoted: no ramp
    client._promote(standby)
    t0 = standby.promoted_at
    standby.in_flight = {"a"}
    assert not client.has_room(standby, now=t0)  # at first, one request at a time
    assert client.has_room(standby, now=t0 + 5.0)  # half-way: up to 10 of 20
    standby.in_flight = {str(i) for i in range(10)}
    assert not client.has_room(standby, now=t0 + 5.0)
    assert client.has_room(standby, now=t0 + 10.0)  # warm-up over: no limit from the ramp
