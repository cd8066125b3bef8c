"""The KV receiver as a move session destination, driven message by message over a real ZeroMQ socket (a
test DEALER playing the source): PREALLOC reserves, the decision is recorded once in a real SQLite ledger
and a retried ask hears the same answer, a session never prepared cannot be recorded COMMITTED, a late
PREALLOC of an ended session reserves nothing, malformed or out-of-range messages harm nothing, and the
receiver's own fault drills (a lost COMMIT ack, a held stage) do what they say."""

from __future__ import annotations

import time

import pytest
import xxhash
import zmq

from steadfast.kv.arena.arena import ArenaSpec, KVArena
from steadfast.kv.ledger.open import open_ledger
from steadfast.kv.moves.checks import Drop
from steadfast.kv.moves.faults import TransportFaults
from steadfast.kv.moves.messages import Abort, AbortReason, Commit, CommitAck, Copy, MoveOutcome, Prealloc, Reserved
from steadfast.kv.moves.packing import layer_span, slots_for
from steadfast.kv.moves.receiver import KVReceiver
from steadfast.kv.moves.wire import AskDecision, Decision, KVFrame, decode_to_source, encode
from steadfast.wire.curve import KeyFile, as_client
from tests.unit.fake_pool import FakePool

pytestmark = pytest.mark.unit

SPEC = ArenaSpec(num_blocks=16, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")


class Source:
    """A hand-driven source: one DEALER connected to the receiver (with `keys`, as a CURVE client)."""

    def __init__(self, address: str, keys: KeyFile | None = None, routing_id: bytes = b"") -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if routing_id:
            self.sock.setsockopt(zmq.ROUTING_ID, routing_id)
        if keys is not None:
            as_client(self.sock, keys)
        self.sock.connect(address)

    def send(self, msg) -> None:  # noqa: ANN001 - any message a source sends
        self.sock.send(encode(msg))

    def raw(self, data: bytes) -> None:
        self.sock.send(data)

    def answer(self, timeout_s: float = 5.0):
        assert self.sock.poll(int(timeout_s * 1000)), "no answer"
        return decode_to_source(self.sock.recv())

    def silent(self, timeout_s: float = 0.3) -> bool:
        return not self.sock.poll(int(timeout_s * 1000))


@pytest.fixture
def setup(tmp_path):
    ledger = open_ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    lease = ledger.acquire_lease("worker1", pid=1, ttl_s=60)
    arena = KVArena.create_device(SPEC, "cpu")
    pool = FakePool(SPEC.num_blocks)

    def decide(session: str, proposal: MoveOutcome) -> MoveOutcome:
        return ledger.decide_move("worker1", lease.epoch, session, proposal)

    rx = KVReceiver(arena, SPEC.block_size, ["tcp://127.0.0.1:0"], pool.grant, pool.release, 0.5, decide=decide)
    src = Source(rx.addresses[0])
    yield rx, src, pool, ledger, arena
    rx.close()
    src.sock.close()
    ledger.close()


def frames(session: str, data_arena: KVArena, blocks: list[int], num_tokens: int) -> list[KVFrame]:
    out = []
    for layer in range(SPEC.num_layers):
        data = layer_span(data_arena, layer, slots_for(blocks, SPEC.block_size, 0, num_tokens))
        out.append(KVFrame(session, 0, layer, layer, 0, num_tokens, xxhash.xxh3_64_intdigest(data), data))
    return out


def test_a_move_commits_once_and_a_retried_ask_hears_the_recorded_decision(setup):
    rx, src, pool, ledger, arena = setup
    source_arena = KVArena.create_device(SPEC, "cpu")
    source_arena.tensor.normal_()
    src.send(Prealloc("r/0", 2))
    reserved = src.answer()
    assert isinstance(reserved, Reserved) and len(reserved.block_ids) == 2
    src.send(Prealloc("r/0", 2))  # resent: the same blocks, nothing more reserved
    assert src.answer() == reserved and len(pool.free) == SPEC.num_blocks - 2
    sent = frames("r/0", source_arena, [3, 7], 6)
    src.send(sent[0])
    src.send(Copy("r/0", 0, (0, 1), True, parts=2))
    src.send(Commit("r/0", 0, 1))
    assert src.answer() == CommitAck("r/0", 0, missing=(0,), parts=((0, 1),))  # part 1 never came
    src.send(sent[1])
    src.send(Commit("r/0", 1, 1))
    assert src.answer() == CommitAck("r/0", 1)  # prepared
    assert rx.claim("r") is None  # not before the decision
    src.send(AskDecision("r/0", MoveOutcome.COMMITTED))
    assert src.answer() == Decision("r/0", MoveOutcome.COMMITTED)
    src.send(AskDecision("r/0", MoveOutcome.COMMITTED))  # the answer was lost: asked again
    assert src.answer() == Decision("r/0", MoveOutcome.COMMITTED)
    assert ledger.move_decision("r/0") is MoveOutcome.COMMITTED
    blocks = rx.claim("r")
    assert blocks == list(reserved.block_ids) and rx.claim("r") is None
    for layer in range(SPEC.num_layers):
        assert layer_span(arena, layer, slots_for(blocks, SPEC.block_size, 0, 6)) == sent[layer].data


def test_a_session_that_never_prepared_is_recorded_aborted_and_a_late_prealloc_reserves_nothing(setup):
    rx, src, pool, ledger, _ = setup
    src.send(Prealloc("q/0", 3))
    assert isinstance(src.answer(), Reserved)
    src.send(AskDecision("q/0", MoveOutcome.COMMITTED))  # no COMMIT was acked: it cannot commit here
    assert src.answer() == Decision("q/0", MoveOutcome.ABORTED)
    assert ledger.move_decision("q/0") is MoveOutcome.ABORTED
    assert src.answer() == Abort("q/0", AbortReason.DESTINATION_ABORT)  # its reservation goes back
    deadline = time.monotonic() + 5
    while len(pool.free) < SPEC.num_blocks and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(pool.free) == SPEC.num_blocks
    src.send(Prealloc("q/0", 3))  # a straggler of the ended session
    assert isinstance(src.answer(), Abort) and len(pool.free) == SPEC.num_blocks
    src.send(AskDecision("never/0", MoveOutcome.COMMITTED))  # a session never opened here
    assert src.answer() == Decision("never/0", MoveOutcome.ABORTED)
    assert rx.claim("q") is None and rx.claim("never") is None


def test_bad_messages_are_refused_and_harm_nothing(setup):
    rx, src, pool, _, _ = setup
    src.send(Prealloc("big/0", SPEC.num_blocks + 1))  # more than the whole arena
    assert src.answer() == Abort("big/0", AbortReason.NO_ROOM) and len(pool.free) == SPEC.num_blocks
    src.raw(b"\x93not a message")
    src.send(Prealloc("r/0", 1))
    assert isinstance(src.answer(), Reserved)
    src.send(Commit("r/0", 0, 1))
    ack = src.answer()  # still answering: the stage is missing
    assert isinstance(ack, CommitAck) and ack.missing == (0,)
    src.send(Commit("nobody/0", 0, 1))  # a session this receiver never had: told at once
    assert src.answer() == Abort("nobody/0", AbortReason.DESTINATION_ABORT)
    # Tokens 2..10 of a one-block (4-token) move: the source is broken, its reservation goes back at once.
    src.send(KVFrame("r/0", 0, 0, 0, 2, 8, 0, b"\0" * 64))
    assert src.answer() == Abort("r/0", AbortReason.DESTINATION_ABORT)
    assert len(pool.free) == SPEC.num_blocks and rx.reserved_blocks == 0
    assert rx.dropped[Drop.UNDECODABLE] == 1 and rx.dropped[Drop.SPAN] == 1


def send_all(src: Source, session: str, source_arena: KVArena) -> list[int]:
    """A whole two-block move of six tokens up to its COMMIT; returns the blocks reserved for it."""
    src.send(Prealloc(session, 2))
    blocks = list(src.answer().block_ids)
    for f in frames(session, source_arena, [0, 1], 6):
        src.send(f)
    src.send(Copy(session, 0, (0, 1), True, parts=2))
    src.send(Commit(session, 0, 1))
    return blocks


def test_the_receivers_drills_lose_a_commit_ack_and_hold_a_stage(tmp_path):
    """`drop_acks=1`: the first prepared ack of each session never leaves, the resent COMMIT's does.
    `hold_s`: a session's frames wait from its first one, while an ABORT still gets through at once."""
    spec = {"text": "drop_acks=1"}
    arena = KVArena.create_device(SPEC, "cpu")
    pool = FakePool(SPEC.num_blocks)
    rx = KVReceiver(
        arena, SPEC.block_size, ["tcp://127.0.0.1:0"], pool.grant, pool.release, 5.0,
        faults=lambda: TransportFaults.parse(spec["text"]),
    )  # fmt: skip
    src = Source(rx.addresses[0])
    try:
        source_arena = KVArena.create_device(SPEC, "cpu")
        source_arena.tensor.normal_()
        blocks = send_all(src, "a/0", source_arena)
        assert src.silent(0.5)  # prepared, but the ack was dropped
        src.send(Commit("a/0", 1, 1))
        assert src.answer() == CommitAck("a/0", 1)

        spec["text"] = "hold_s=1.0"
        held = send_all(src, "b/0", source_arena)
        assert src.silent(0.6)  # held: no ack yet
        assert src.answer(2.0) == CommitAck("b/0", 0)  # then handled, in order
        assert len(pool.free) == SPEC.num_blocks - len(blocks) - len(held)

        src.send(Prealloc("c/0", 2))
        assert isinstance(src.answer(), Reserved)
        src.send(frames("c/0", source_arena, [0, 1], 6)[0])  # its stage is held from here
        src.send(Abort("c/0", AbortReason.SOURCE_ABORT))  # the source gave up: its blocks come back now
        deadline = time.monotonic() + 0.5
        while len(pool.free) < SPEC.num_blocks - 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(pool.free) == SPEC.num_blocks - 4
    finally:
        rx.close()
        src.sock.close()
