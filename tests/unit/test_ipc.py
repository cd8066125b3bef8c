"""A malformed message on the router → worker socket is dropped; the worker's inbox keeps working."""

from __future__ import annotations

import time

import pytest
import zmq

from steadfast.wire.codec import encode
from steadfast.wire.queues import WorkerInbox
from steadfast.wire.worker import AbortRequest

pytestmark = pytest.mark.unit


def test_garbage_is_dropped_and_the_next_message_arrives(tmp_path):
    ctx = zmq.Context()
    address = f"ipc://{tmp_path}/worker"
    inbox = WorkerInbox(ctx, address)
    push = ctx.socket(zmq.PUSH)
    push.connect(address)
    try:
        for junk in (b"", b"\xff\x00garbage", encode(AbortRequest(["a"]))[:-1], b"[1, 2, 3]"):
            push.send(junk)
        push.send(encode(AbortRequest(["r1"])))
        got: list = []
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:
            if inbox.poll(100):
                got += inbox.drain()
        assert got == [AbortRequest(["r1"])]
    finally:
        push.close(linger=0)
        inbox.sock.close(linger=0)
        ctx.term()
