"""The KV sender as a move session source, against a hand-driven destination (a test ROUTER socket): the
messages it sends in order, a lost decision answer asked for again, a destination that acks but never
decides (the source gives up in doubt and says so), and a destination that refuses for want of room."""

from __future__ import annotations

import pytest
import zmq

from steadfast.kv.moves.messages import (
    Abort,
    AbortReason,
    Commit,
    CommitAck,
    Committed,
    Copy,
    MoveOutcome,
    Prealloc,
    Reserved,
)
from steadfast.kv.moves.sender import KVSender
from steadfast.kv.moves.sender_jobs import TransferOutcome
from steadfast.kv.moves.wire import AskDecision, Decision, KVFrame, Probe, Progress, decode_to_destination, encode
from tests.unit.test_transfer import wait_result

pytestmark = pytest.mark.unit


class Destination:
    def __init__(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.peer = b""

    def next(self, timeout_s: float = 5.0):
        assert self.sock.poll(int(timeout_s * 1000)), "the source sent nothing"
        self.peer, data = self.sock.recv_multipart()
        return decode_to_destination(data)

    def until(self, kind: type, timeout_s: float = 5.0):
        """Messages up to and including the first of `kind`."""
        got = []
        while not got or not isinstance(got[-1], kind):
            got.append(self.next(timeout_s))
        return got

    def send(self, msg) -> None:  # noqa: ANN001 - any message a destination sends
        self.sock.send_multipart([self.peer, encode(msg)])


@pytest.fixture
def pair():
    dst = Destination()
    tx = KVSender(num_layers=2, timeout_s=0.2, retries=1, backoff_s=0.01, block_size=4)
    yield dst, tx
    tx.close()
    dst.sock.close()


def start(tx: KVSender, dst: Destination) -> None:
    tx.begin("r", [("primary", dst.address)], 6)  # 6 tokens: 2 blocks of 4
    for layer in range(2):
        tx.layer("r", layer, 0, 6, bytes([layer]) * 48, True)
    tx.commit("r")


def test_the_source_speaks_the_protocol_and_asks_again_for_a_lost_decision(pair):
    dst, tx = pair
    start(tx, dst)
    assert dst.next() == Prealloc("r/0", 2)  # nothing is sent before the reservation
    dst.send(Reserved("r/0", (7, 9)))
    got = dst.until(Commit)
    frames = [m for m in got if isinstance(m, KVFrame)]
    assert sorted((f.part, f.layer) for f in frames) == [(0, 0), (1, 1)]
    assert got[-2:] == [Copy("r/0", 0, (0, 1), True, parts=2), Commit("r/0", 0, 1)]
    dst.send(CommitAck("r/0", 0))
    assert dst.next() == AskDecision("r/0", MoveOutcome.COMMITTED)
    # The answer is lost: the source asks again after its timeout, and then hears it.
    assert dst.next() == AskDecision("r/0", MoveOutcome.COMMITTED)
    dst.send(Decision("r/0", MoveOutcome.COMMITTED))
    r = wait_result(tx)
    assert r.outcome is TransferOutcome.OK and r.block_ids == [7, 9] and r.retries == 1
    assert dst.next() == Committed("r/0")  # and the destination is told


def test_acked_but_never_decided_the_source_gives_up_in_doubt(pair):
    dst, tx = pair
    start(tx, dst)
    dst.next()
    dst.send(Reserved("r/0", (1, 2)))
    dst.until(Commit)
    dst.send(CommitAck("r/0", 0))
    asks = dst.until(AskDecision)
    r = wait_result(tx)
    assert asks and r.outcome is TransferOutcome.FAILED and "no decision from the destination" in r.error
    assert r.block_ids == []  # the caller falls back: the decode side claims nothing it was not told of


def test_no_room_at_the_destination_fails_the_path_with_a_clear_error(pair):
    dst, tx = pair
    start(tx, dst)
    dst.next()
    dst.send(Abort("r/0", AbortReason.NO_ROOM))
    r = wait_result(tx)
    assert r.outcome is TransferOutcome.FAILED and r.fallbacks == 1
    assert "no room for 2 KV blocks" in r.error


def test_late_answers_to_an_ended_session_leave_the_sender_working(pair):
    """A migration given up while its probe's answer was on the way (the request ended first): the late
    PROGRESS once killed the sender's thread, and every later move from that worker hung."""
    dst, tx = pair
    tx.begin("r", [("primary", dst.address)], 6, probe=True)
    tx.layer("r", 0, 0, 4, bytes(32), True)
    assert dst.next() == Prealloc("r/0", 2)
    dst.send(Reserved("r/0", (1, 2)))
    assert isinstance(dst.until(Probe)[-1], Probe)
    tx.abort("r")
    assert wait_result(tx).outcome is TransferOutcome.ABORTED
    assert dst.until(Abort)[-1] == Abort("r/0", AbortReason.SOURCE_ABORT)
    dst.send(Progress("r/0", 1))  # late: the session has ended
    dst.send(Reserved("r/0", (1, 2)))  # a late grant of a resent PREALLOC is still released
    assert dst.next() == Abort("r/0", AbortReason.SOURCE_ABORT)
    tx.begin("q", [("primary", dst.address)], 6)  # and the next move goes through
    tx.layer("q", 0, 0, 4, bytes(32), True)
    assert dst.next() == Prealloc("q/0", 2)
