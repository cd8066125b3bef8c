"""No message crashes the kvpool daemon or the worker's pool client: junk sent to a real daemon process
gets an error reply and the next valid request is served; a junk reply is dropped by the client. And
the daemon's loop prunes request rows past the idempotency window."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path

import msgspec
import pytest
import zmq

from steadfast.config import Config, config_from_dict
from steadfast.kv.arena.spec import ArenaSpec
from steadfast.kv.ledger.interface import RequestCheckpoint
from steadfast.kv.ledger.open import sqlite_url
from steadfast.kv.pool.client import PoolClient
from steadfast.kv.pool.daemon import KVPool, serve
from steadfast.ops.supervisor.children import pool_spec
from steadfast.wire.codec import encode
from steadfast.wire.pool import PoolRegister, PoolRelease, PoolReply, decode_pool_reply

pytestmark = pytest.mark.unit

SPEC = ArenaSpec(4, 2, 4, 1, 8, "float32")


def arena_path() -> str:
    return f"/dev/shm/steadfast-pooltest-{os.getpid()}-{uuid.uuid4().hex[:8]}.kv"


@pytest.fixture(scope="module")
def daemon():
    """A real kvpool process (the command line the supervisor runs), its address and its arena."""
    folder = Path(tempfile.mkdtemp(prefix="sfpool-"))  # short: an ipc:// path has a length limit
    arena, address, ready = arena_path(), f"ipc://{folder}/kvpool", folder / "ready"
    spec = pool_spec(
        json.dumps(Config().to_dict()), 0, address, arena, sqlite_url(folder / "l.db"), SPEC, str(ready), "cpu"
    )
    log = open(folder / "kvpool.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(spec.command(), stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, (folder / "kvpool.log").read_text()
        time.sleep(0.05)
    yield proc, address, arena
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=10)
    log.close()
    for p in (arena, arena + ".json"):
        Path(p).unlink(missing_ok=True)
    shutil.rmtree(folder, ignore_errors=True)


def ask(address: str, frames: list[bytes]) -> PoolReply:
    """Send `frames` as one message from a fresh DEALER (what a worker is) and decode the reply."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send_multipart(frames)
        assert sock.poll(5000), "the kvpool did not answer"
        return decode_pool_reply(sock.recv())
    finally:
        sock.close()


JUNK = {
    "garbage bytes": [b"\xc1\xff\x00 not msgpack"],
    "empty frame": [b""],
    "wrong message type": [encode(PoolReply(True, epoch=3))],
    "wrong field type": [msgspec.msgpack.encode(["grant", "w0", "one", 2])],
    "unknown tag": [msgspec.msgpack.encode(["steal", "w0"])],
    "multi-frame junk": [b"a", b"\x00\x01", b"c" * 1000],
    "valid request plus junk frames": [encode(PoolRegister("w9", 1)), b"junk"],
}


@pytest.mark.parametrize("frames", list(JUNK.values()), ids=list(JUNK))
def test_a_malformed_request_is_answered_with_an_error_and_the_daemon_serves_on(daemon, frames):
    proc, address, arena = daemon
    reply = ask(address, frames)
    assert not reply.ok and "malformed" in reply.error
    assert proc.poll() is None
    assert PoolClient(address, "inspector", timeout_s=5, attempts=1).attach(os.getpid()).arena_path == arena


def test_a_value_past_sqlite_integers_is_answered_with_an_error(daemon):
    proc, address, _ = daemon
    client = PoolClient(address, f"w-{uuid.uuid4().hex[:6]}", timeout_s=5, attempts=1)
    epoch = client.register(os.getpid()).epoch
    reply = ask(address, [encode(PoolRelease(client.worker, epoch, [2**63]))])
    assert not reply.ok and "malformed" in reply.error
    assert proc.poll() is None
    assert len(client.grant(1)) <= 1  # still served (an error reply would raise)


def test_the_client_drops_malformed_replies_and_takes_the_good_one():
    folder = Path(tempfile.mkdtemp(prefix="sfcli-"))
    address = f"ipc://{folder}/pool"
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(address)

    def junk_then_answer() -> None:
        ident, _ = router.recv_multipart()
        for frames in ([b"\xc1junk"], [b"a", b"b"], [encode(PoolRegister("x", 1))], [b""]):
            router.send_multipart([ident, *frames])
        router.send_multipart([ident, encode(PoolReply(True, epoch=7))])

    fake = threading.Thread(target=junk_then_answer, daemon=True)
    fake.start()
    try:
        client = PoolClient(address, "w0", timeout_s=5, attempts=1)
        assert client.register(os.getpid()).epoch == 7 and client.epoch == 7
    finally:
        fake.join(timeout=5)
        router.close()
        shutil.rmtree(folder, ignore_errors=True)


def test_the_daemon_loop_prunes_request_rows_past_the_idempotency_window(tmp_path):
    cfg = config_from_dict({"fault_recovery": {"request": {"idempotency_window": 10}}})
    pool = KVPool(cfg, arena_path(), sqlite_url(tmp_path / "l.db"), SPEC)
    wall = [1000.0]
    pool.ledger.wall_clock = lambda: wall[0]  # (the SQLite backend's wall clock, for request rows)
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"ipc://{tmp_path}/p")
    try:
        epoch = pool.ledger.acquire_lease("w0", os.getpid(), 60).epoch
        pool.ledger.checkpoint("w0", epoch, [RequestCheckpoint("r", [1], "{}", [2], 1, "finished")])

        def one_pass() -> None:
            turns = iter([False, True])
            serve(pool, sock, lambda: next(turns))

        wall[0] += 9
        one_pass()
        assert pool.ledger.request("r") is not None
        wall[0] += 2
        one_pass()
        assert pool.ledger.request("r") is None
    finally:
        sock.close()
        pool.close()
        for path in (pool.arena_path, pool.arena_path + ".json"):
            os.unlink(path)
