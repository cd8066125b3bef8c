"""The router's delivery rules, without sockets: exactly once and in order, only from a request's current
owner, regenerated tokens a client holds are swallowed; and placement's KV reserve and a promoted
standby's warm-up ramp."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from steadfast.config import TakeoverConfig
from steadfast.control.fleet.delivery import Flight, Verdict, Watermark
from steadfast.control.fleet.placement import Placement
from steadfast.control.fleet.recovery import Recovery
from steadfast.control.fleet.workers import WorkerRegistry
from steadfast.wire.worker import (
    AddRequest,
    FinishReason,
    RequestOutput,
    SamplingParams,
    WorkerRole,
    WorkerState,
    WorkerStatus,
)

pytestmark = pytest.mark.unit


@pytest.fixture
def placement() -> Placement:
    registry = WorkerRegistry()
    registry.add(0, "ipc://w0", WorkerRole.MIXED)
    registry.add(1, "ipc://w1", WorkerRole.STANDBY)
    return Placement(registry, TakeoverConfig(warmup=10.0), max_in_flight=20)


def flight(owner: int, delivered: list[int], skip_until: int = 0) -> Flight:
    mark = Watermark(owner, list(delivered), skip_until=skip_until)
    return Flight(AddRequest("r", [1, 2, 3], SamplingParams()), asyncio.Queue(), mark)


def out(index: int, token: int, text: str = "x", finish: str | None = None) -> RequestOutput:
    return RequestOutput("r", [token], text, index=index, finish_reason=finish)


def deliver(f: Flight, worker: int, o: RequestOutput) -> Verdict:
    """What the engine client does with a verdict: forward to the client's queue."""
    verdict = f.mark.accept(o, worker)
    if verdict is Verdict.FORWARD:
        f.queue.put_nowait(o)
    return verdict


def forwarded(f: Flight) -> list[int]:
    got = []
    while not f.queue.empty():
        got.extend(f.queue.get_nowait().token_ids)
    return got


def test_each_token_index_is_forwarded_once_in_order_from_the_owner_only():
    f = flight(owner=0, delivered=[7, 8])
    assert deliver(f, 0, out(2, 9)) is Verdict.FORWARD
    assert deliver(f, 0, out(2, 9)) is Verdict.DUPLICATE  # the same index again
    assert deliver(f, 1, out(3, 10)) is Verdict.NOT_OWNER  # a worker that does not own it (a zombie)
    assert deliver(f, 0, out(4, 11)) is Verdict.GAP  # never forwarded out of order
    assert deliver(f, 0, out(3, 10)) is Verdict.FORWARD
    assert forwarded(f) == [9, 10]
    assert f.mark.delivered == [7, 8, 9, 10] and f.mark.text_chars == 2


def test_regenerated_tokens_the_client_holds_are_not_resent():
    # A reconnect after a router restart: the ledger knew 2 tokens, the client holds 4.
    f = flight(owner=0, delivered=[7, 8], skip_until=4)
    for i, token in enumerate([9, 10, 11, 12], start=2):
        deliver(f, 0, out(i, token, "" if i < 4 else "y"))
    assert forwarded(f) == [11, 12]
    assert f.mark.delivered == [7, 8, 9, 10, 11, 12]


def test_a_change_of_owner_switches_delivery_at_the_watermark():
    f = flight(owner=0, delivered=[7])
    f.mark.moving = True  # the owner died: nobody answers for it until a new owner is chosen
    assert deliver(f, 0, out(1, 8)) is Verdict.MOVING
    f.mark.hand_to(2)
    assert deliver(f, 0, out(1, 8)) is Verdict.NOT_OWNER  # the old owner, late
    assert deliver(f, 2, out(1, 8)) is Verdict.FORWARD
    assert deliver(f, 2, out(2, 9, finish="stop")) is Verdict.FORWARD
    assert forwarded(f) == [8, 9] and f.mark.delivered == [7, 8, 9]


def test_an_output_without_tokens_or_text_is_accepted_but_not_forwarded():
    f = flight(owner=0, delivered=[7])
    assert deliver(f, 0, RequestOutput("r", [], index=1)) is Verdict.EMPTY  # a transfer's outcome alone
    assert forwarded(f) == [] and f.mark.delivered == [7]


@given(
    st.lists(st.tuples(st.integers(0, 2), st.integers(0, 12)), max_size=60),
    st.integers(0, 2),
)
def test_whatever_arrives_the_client_gets_a_prefix_of_the_owners_tokens_once_each(events, owner):
    """Outputs from any worker at any index, duplicated and out of order: the client gets exactly
    the owner's tokens 0..n-1 in order, each once (token value = 100 * worker + index)."""
    f = flight(owner=owner, delivered=[])
    for worker, index in events:
        deliver(f, worker, out(index, 100 * worker + index))
    got = forwarded(f)
    assert got == [100 * owner + i for i in range(len(got))]
    assert f.mark.delivered == got


def test_new_requests_leave_the_kv_reserve_to_takeovers(placement):
    w = placement.registry.get(0)
    placement.registry.observe(WorkerStatus(0, 1, "mixed", "ready", kv_blocks_total=100, kv_blocks_used=89))
    assert placement.has_room(w)
    placement.registry.observe(WorkerStatus(0, 1, "mixed", "ready", kv_blocks_total=100, kv_blocks_used=90))
    assert not placement.has_room(w)  # the last 10 % waits for requests moved off a dead worker
    assert len(w.history) == 2  # the registry keeps the window, not only the last report


def test_a_promoted_standby_ramps_up_its_share_of_new_requests(placement):
    standby = placement.registry.get(1)
    assert placement.has_room(standby)  # never promoted: no ramp
    placement.registry.promote(standby, WorkerRole.MIXED)
    t0 = standby.promoted_at
    standby.in_flight = {"a"}
    assert not placement.has_room(standby, now=t0)  # at first, one request at a time
    assert placement.has_room(standby, now=t0 + 5.0)  # half-way: up to 10 of 20
    standby.in_flight = {str(i) for i in range(10)}
    assert not placement.has_room(standby, now=t0 + 5.0)
    assert placement.has_room(standby, now=t0 + 10.0)  # warm-up over: no limit from the ramp


def test_placement_prefers_the_dead_workers_node_then_load(placement):
    r = placement.registry
    r.add(2, "ipc://w2", WorkerRole.MIXED)
    for wid, node in ((0, "a"), (1, "a"), (2, "b")):
        role = "standby" if wid == 1 else "mixed"
        r.observe(WorkerStatus(wid, 1, role, "ready", node=node))
    r.get(0).in_flight = {"x", "y"}
    assert placement.pick().worker_id == 2  # least loaded
    assert placement.pick(node="a").worker_id == 0  # its KV is adoptable only on node a
    assert placement.pick(exclude=0, roles=(WorkerRole.DECODE,), node="a").worker_id == 1  # a standby


def test_a_router_behind_on_its_inbox_does_not_call_its_workers_silent(tmp_path):
    """Reports waiting unread mean the router is slow (niced on a loaded machine), not the worker."""
    import time

    import zmq

    from steadfast.control.fleet.client import EngineClient
    from steadfast.wire.codec import encode

    async def run() -> None:
        address = f"ipc://{tmp_path}/outputs"
        client = EngineClient([(0, f"ipc://{tmp_path}/worker0", WorkerRole.MIXED)], address, 0.5)
        w = client.registry.get(0)
        client.registry.observe(WorkerStatus(0, 1, WorkerRole.MIXED, WorkerState.READY), now=time.monotonic() - 60)
        assert not client.hub.behind()
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.connect(address)
        push.send(encode(WorkerStatus(0, 1, WorkerRole.MIXED, WorkerState.READY)))
        deadline = time.monotonic() + 5
        while not client.hub.behind() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert client.hub.behind()  # an unread report waits: a sweep now would blame the worker for our lag
        await client.start()  # the receive loop reads it; the watch loop's sweeps may run again
        deadline = time.monotonic() + 5
        while client.hub.behind() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert not client.hub.behind() and w.ready and time.monotonic() - w.last_seen < 5
        push.close(linger=0)
        await client.close()

    asyncio.run(run())


def test_a_move_no_worker_takes_ends_with_the_reason_it_was_moved():
    """A stalled request (server.request_timeout) that no other worker takes within the wait fails
    with an error saying so: never left waiting without a word."""

    async def nobody(*args):
        return None

    async def unreachable(*args):
        raise AssertionError("nothing may be sent")

    async def run():
        recovery = Recovery(TakeoverConfig(wait_timeout=0.2), None, nobody, unreachable)  # type: ignore[arg-type]
        f = flight(0, [5, 6])
        f.mark.moving = True
        why = "it received no token for 60s and no other worker could take it"
        await recovery.move(f, 0, lambda: True, why=why)
        out = f.queue.get_nowait()
        assert out.finish_reason == FinishReason.ERROR and out.error == why and not f.mark.moving

    asyncio.run(run())


def test_a_dead_decode_worker_s_sources_are_told_at_once(tmp_path):
    """A decode worker dies while a prefill worker's KV transfer to it is under way: the prefill worker
    is told (`DestinationLost`) when the router learns of the death, so the transfer fails to its
    fallback now, not after its session's retries (30 s a path at the default timeout). Workers not
    moving anything to it hear nothing."""
    import time

    import zmq

    from steadfast.control.fleet.client import EngineClient
    from steadfast.wire.worker import DestinationLost, decode_to_worker

    async def run() -> None:
        ctx = zmq.Context.instance()
        inboxes = {}
        for wid in (0, 1, 2):
            pull = ctx.socket(zmq.PULL)
            pull.bind(f"ipc://{tmp_path}/worker{wid}")
            inboxes[wid] = pull
        roles = {0: WorkerRole.PREFILL, 1: WorkerRole.DECODE, 2: WorkerRole.MIXED}
        client = EngineClient(
            [(w, f"ipc://{tmp_path}/worker{w}", r) for w, r in roles.items()], f"ipc://{tmp_path}/outputs", 0.5
        )
        try:
            for wid, role in roles.items():
                client.registry.observe(WorkerStatus(wid, 1, role, WorkerState.READY))
            add = AddRequest("r", [1, 2, 3], SamplingParams(), decode_worker=1, kv_paths=["tcp://10.0.0.2:1"])
            client._flights["r"] = Flight(add, asyncio.Queue(), Watermark(0))  # prefilling on worker 0
            client.registry.get(0).in_flight.add("r")
            await client.roster.lost(client.registry.get(1), client.recovery)
            deadline = time.monotonic() + 5
            while not inboxes[0].poll(0) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert decode_to_worker(inboxes[0].recv(zmq.NOBLOCK)) == DestinationLost(1)
            await asyncio.sleep(0.2)
            assert not inboxes[2].poll(0)  # nothing of its own was going to worker 1
        finally:
            await client.close()
            for pull in inboxes.values():
                pull.close(linger=0)

    asyncio.run(run())


def test_a_move_asked_twice_moves_once_and_restarts_the_stall_clock(placement):
    """The soak's seed 7: a request's worker stalled (a move asked) and died (another asked) while the
    storm-control slots were taken; each move, given a slot in turn, moved it again — off the owner the
    first had just given it, each time recomputing — and the stall watch, finding no progress since
    before the wait, moved it once more. One move happens; the others see it moved and stop."""
    sent: list[tuple[int, AddRequest]] = []
    live = placement.registry.get(1)

    async def choose(exclude, roles, node):  # noqa: ANN001, ANN202
        return live

    async def send(worker, add):  # noqa: ANN001, ANN202
        sent.append((worker.worker_id, add))
        return True

    async def run() -> None:
        recovery = Recovery(TakeoverConfig(max_concurrent=1, wait_timeout=0.2), placement, choose, send)
        f = flight(0, [5, 6])
        f.mark.moving = True
        f.progress = 0.0  # (stalled long ago)
        await asyncio.gather(*(recovery.move(f, 0, lambda: True) for _ in range(3)))
        assert [(w, add.resume.output_ids) for w, add in sent] == [(1, [5, 6])]
        assert f.mark.owner == 1 and not f.mark.moving
        assert f.progress > 0.0  # its stall clock restarted

    asyncio.run(run())
