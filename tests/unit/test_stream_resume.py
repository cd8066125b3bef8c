"""Resumes of one request that overlap, and the bound on a stream's silence, through the router's engine
client with a socket standing in for its one worker: every resume gets a definite answer at once, one
carries the stream on, the worker is never sent the request twice without an abort between, and no
stream waits without end for a flight that never registers or outputs that never come."""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq

from steadfast.control.fleet.client import RESUMED_ELSEWHERE, EngineClient
from steadfast.control.fleet.delivery import Flight, Watermark
from steadfast.control.fleet.resume import Known, Resumption
from steadfast.wire.worker import (
    AbortRequest,
    AddRequest,
    FinishReason,
    RequestOutput,
    SamplingParams,
    StepOutputs,
    WorkerRole,
    WorkerState,
    WorkerStatus,
    decode_to_worker,
)

pytestmark = pytest.mark.unit


class Rig:
    """An engine client with one ready worker whose input the test reads."""

    def __init__(self, tmp_path) -> None:  # noqa: ANN001 - pytest's tmp_path
        worker = f"ipc://{tmp_path}/worker0"
        self.inbox = zmq.Context.instance().socket(zmq.PULL)
        self.inbox.bind(worker)
        self.client = EngineClient([(0, worker, WorkerRole.MIXED)], f"ipc://{tmp_path}/outputs", 0.5)
        self.client.registry.observe(WorkerStatus(0, 1, WorkerRole.MIXED, WorkerState.READY))

    def sent(self) -> list[tuple[str, str]]:
        """(kind, request id) of each message the worker received, in order."""
        got = []
        while self.inbox.poll(200):  # (sends are done when their await returns: 200 ms is plenty)
            msg = decode_to_worker(self.inbox.recv())
            if isinstance(msg, AddRequest):
                got.append(("add", msg.request_id))
            elif isinstance(msg, AbortRequest):
                got += [("abort", rid) for rid in msg.request_ids]
        return got

    async def close(self) -> None:
        self.inbox.close(linger=0)
        await self.client.close()


def retired(client: EngineClient, rid: str, delivered: list[int]) -> None:
    """A request whose stream stopped (its client's connection dropped), kept for a resume."""
    add = AddRequest(rid, [1, 2, 3], SamplingParams(max_tokens=32))
    client.resumption_records.retire(Flight(add, asyncio.Queue(), Watermark(-1, list(delivered))))


async def first(gen) -> RequestOutput | None:  # noqa: ANN001 - an async generator
    return await gen.__anext__()


async def answer(gen, ticks: int = 20) -> RequestOutput | None:  # noqa: ANN001 - an async generator
    """The first output of a stream, or None when it is still waiting after `ticks` keep-alive ticks."""
    for _ in range(ticks):
        out = await gen.__anext__()
        if out is not None:
            return out
    return None


@pytest.mark.parametrize("slow_placement", [False, True])
def test_ten_overlapping_resumes_of_one_request_one_carries_on_the_rest_are_told(tmp_path, slow_placement):
    async def run() -> None:
        rig = Rig(tmp_path)
        client = rig.client
        if slow_placement:  # the first resume holds the turn across an await: the others arrive meanwhile
            choose = client.roster.choose_with_room

            async def slow(request: AddRequest):  # noqa: ANN202
                await asyncio.sleep(0.2)
                return await choose(request)

            client.roster.choose_with_room = slow  # type: ignore[method-assign]
        retired(client, "r", [5, 6, 7, 8])
        known = client.known("r")
        add = Resumption.request(known, 3, 3)
        gens = [client.generate(add, 3, 0.05, known) for _ in range(10)]
        t0 = time.monotonic()
        answers = await asyncio.gather(*(answer(g) for g in gens))
        assert time.monotonic() - t0 < 3
        told = [a for a in answers if a is not None]
        assert len(told) == 9 and all(a.error == RESUMED_ELSEWHERE for a in told)
        assert all(a.finish_reason == FinishReason.ERROR for a in told)
        winner = gens[answers.index(None)]  # waiting for its tokens
        assert winner is gens[-1]  # the newest
        flight = client.find("r")
        assert flight is not None and flight.mark.delivered == [5, 6, 7] and flight.mark.skip_until == 3
        await client._deliver(StepOutputs(0, [RequestOutput("r", [9], "x", index=3, finish_reason="length")]))
        out = await first(winner)
        assert out is not None and out.token_ids == [9]
        for g in gens:
            await g.aclose()
        sent = rig.sent()
        # Never two runs of it at once: every add after the first follows an abort of the one before.
        adds = [i for i, (kind, _) in enumerate(sent) if kind == "add"]
        assert adds and all(("abort", "r") in sent[a:b] for a, b in zip(adds, adds[1:], strict=False))
        if slow_placement:
            assert len(adds) == 2  # the first and the newest: the eight between never reached the worker
        assert len(client.turns) == 0 and client.find("r") is None
        await rig.close()

    asyncio.run(run())


def test_a_resume_while_the_old_stream_is_open_ends_that_stream_with_where_it_went(tmp_path):
    async def run() -> None:
        rig = Rig(tmp_path)
        client = rig.client
        old = client.generate(AddRequest("r", [1, 2, 3], SamplingParams(max_tokens=32)), quiet_s=0.05)
        assert await first(old) is None  # sent, waiting
        outs = [RequestOutput("r", [token], "x", index=i) for i, token in enumerate([5, 6, 7])]
        await client._deliver(StepOutputs(0, outs))  # as the worker's outputs arrive
        assert [(await first(old)).token_ids for _ in range(3)] == [[5], [6], [7]]
        known = client.known("r")
        new = client.generate(Resumption.request(known, 2, 2), 2, 0.05, known)
        assert await first(new) is None
        ended = await first(old)
        assert ended.finish_reason == FinishReason.ERROR and ended.error == RESUMED_ELSEWHERE
        assert client.find("r").mark.delivered == [5, 6]
        await old.aclose()
        assert client.find("r") is not None  # the old stream's end leaves the new one's flight alone
        await new.aclose()
        assert rig.sent() == [("add", "r"), ("abort", "r"), ("add", "r"), ("abort", "r")]
        await rig.close()

    asyncio.run(run())


def test_a_stream_with_nothing_past_the_idle_limit_ends_with_an_error_and_keep_alive_ticks_before(tmp_path):
    async def run() -> None:
        rig = Rig(tmp_path)
        client = rig.client
        client.idle_limit_s = 0.5
        gen = client.generate(AddRequest("r", [1, 2, 3], SamplingParams(max_tokens=32)), quiet_s=0.1)
        t0 = time.monotonic()
        ticks = 0
        async for out in gen:
            if out is None:
                ticks += 1
                continue
            assert out.finish_reason == FinishReason.ERROR and "no output for" in out.error
        assert 3 <= ticks <= 6 and 0.5 <= time.monotonic() - t0 < 1.5
        assert rig.sent() == [("add", "r"), ("abort", "r")] and client.find("r") is None

        # A resume whose turn never comes (the holder stuck) is bounded the same way, never silent.
        retired(client, "s", [5, 6])
        known = client.known("s")
        turn, _ = client.turns.enter("s")
        await turn.lock.acquire()
        gen = client.generate(Resumption.request(known, 1, 1), 1, 0.1, known)
        outs = [out async for out in gen]
        assert outs[:3] == [None] * 3 and "no output for" in outs[-1].error
        assert rig.sent() == []  # it never took the request over
        await rig.close()

    asyncio.run(run())


def test_a_resume_the_router_never_saw_stops_the_request_on_every_worker_before_it_is_sent(tmp_path):
    """After a router restart the ledger's owner can be stale (the soak's seed 7: it named worker 1 while
    worker 0 still ran the request, and the resume placed on worker 0 failed as "already in flight"):
    every live worker is told to stop it before the resume goes out, so no run of it is left for nobody."""

    async def run() -> None:
        rig = Rig(tmp_path)
        client = rig.client
        other = zmq.Context.instance().socket(zmq.PULL)
        other.bind(f"ipc://{tmp_path}/worker1")
        client.hub.add(1, f"ipc://{tmp_path}/worker1", WorkerRole.MIXED)
        client.registry.observe(WorkerStatus(1, 1, WorkerRole.MIXED, WorkerState.READY))
        known = Known(AddRequest("r", [1, 2, 3], SamplingParams(max_tokens=32)), [5, 6, 7], owner=1)
        gen = client.generate(Resumption.request(known, 3, 3), 3, 0.05, known)
        assert await first(gen) is None  # sent, waiting for its tokens
        owner = client.find("r").mark.owner
        aborted = []
        while other.poll(200):
            msg = decode_to_worker(other.recv())
            aborted += [("abort", rid) for rid in msg.request_ids] if isinstance(msg, AbortRequest) else [("add", "r")]
        on_zero = rig.sent()
        assert aborted[0] == ("abort", "r") and on_zero[0] == ("abort", "r")
        assert ("add", "r") in (on_zero if owner == 0 else aborted)
        await gen.aclose()
        other.close(linger=0)
        await rig.close()

    asyncio.run(run())
