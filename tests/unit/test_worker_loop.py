"""The worker's loop takes the messages that arrive while it handles a batch into the same step: a
takeover's requests reach it one by one, and before, the first got a step of its own while the rest
waited a whole step for their first token. A flood of messages still cannot keep it from stepping."""

from __future__ import annotations

import pytest

from steadfast.wire.worker import AddRequest, SamplingParams, StepOutputs, WorkerRole
from steadfast.worker import loop as worker_loop

pytestmark = pytest.mark.unit


class ScriptedInbox:
    """An inbox whose reads return prepared batches: what "arrives" while the previous one is handled."""

    def __init__(self, batches: list[list]) -> None:
        self.batches = batches
        self.reads = 0

    def poll(self, timeout_ms: int) -> bool:
        return bool(self.batches)

    def drain(self) -> list:
        self.reads += 1
        return self.batches.pop(0) if self.batches else []


class Outbox:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, message) -> None:
        self.sent.append(message)


def add(i: int) -> AddRequest:
    return AddRequest(f"r{i}", [1, 2, 3 + i], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))


def run_loop(small_config, small_model, make_engine, batches: list[list]) -> list[int]:
    """Run the loop until its requests are done; returns how many requests each step held."""
    engine = make_engine(small_config, small_model)
    loop = worker_loop.WorkerLoop(small_config, 0, ScriptedInbox(batches), Outbox(), WorkerRole.MIXED)
    held: list[int] = []
    step = engine.step

    def counted():
        held.append(len(engine.requests))
        loop.leave()  # it ends once its requests are done
        return step()

    engine.step = counted
    loop.run(engine)
    assert {o.request_id for m in loop.outbox.sent if isinstance(m, StepOutputs) for o in m.outputs} >= {
        r.request_id for batch in batches for r in batch
    }
    return held


def test_messages_arriving_while_a_batch_is_handled_join_its_step(small_config, small_model, make_engine):
    held = run_loop(small_config, small_model, make_engine, [[add(0)], [add(1), add(2)], [add(3)]])
    assert held[0] == 4  # all four in the first step, not one and then three


def test_a_flood_of_messages_cannot_keep_the_loop_from_stepping(small_config, small_model, make_engine):
    batches = [[add(i)] for i in range(worker_loop.DRAIN_ROUNDS + 3)]
    held = run_loop(small_config, small_model, make_engine, batches)
    assert held[0] == worker_loop.DRAIN_ROUNDS  # it stepped after a bounded number of reads


class Lease:
    """A lease whose `check` raises what it is told to, once each."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)

    def check(self) -> None:
        if self.errors:
            raise self.errors.pop(0)


def test_step_outputs_go_only_under_a_lease_confirmed_held(small_config):
    """A store that cannot answer holds a step's outputs (in order) to the next round; a lease found
    fenced lets nothing out: a worker continued after SIGSTOP past its lease finishes the step it was in,
    and that step's tokens must not reach the router."""
    from types import SimpleNamespace

    from steadfast.kv.ledger.interface import LedgerUnavailableError
    from steadfast.kv.pool.client import LeaseLostError
    from steadfast.wire.worker import RequestOutput

    loop = worker_loop.WorkerLoop(small_config, 0, ScriptedInbox([]), Outbox(), WorkerRole.MIXED)
    first, second = RequestOutput("r0", [5]), RequestOutput("r0", [6])
    engine = SimpleNamespace(sync=SimpleNamespace(lease=Lease(LedgerUnavailableError("etcd busy"))))
    loop._send(engine, [first])
    assert loop.outbox.sent == []  # not confirmed: held
    loop._send(engine, [second])
    (sent,) = loop.outbox.sent
    assert [o.token_ids for o in sent.outputs] == [[5], [6]]  # confirmed: both, in order
    engine.sync.lease = Lease(LeaseLostError("fenced"))
    with pytest.raises(LeaseLostError):
        loop._send(engine, [RequestOutput("r0", [7])])
    assert len(loop.outbox.sent) == 1  # nothing more went out
