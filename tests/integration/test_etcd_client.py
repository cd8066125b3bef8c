"""`util/etcd.py` against a real 3-member etcd cluster on loopback: keys, prefixes, transactions that
reject a stale writer, leases on etcd's clock, and the leader killed under writes with nothing lost."""

from __future__ import annotations

import shutil
import threading
import time

import pytest

from steadfast.util.etcd import Compare, Delete, EtcdClient, EtcdError, Get, Put, Result, Target, kvs_of
from tests.etcd_cluster import EtcdCluster

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd (Debian etcd-server) is not installed"),
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = EtcdCluster(tmp_path_factory.mktemp("etcd")).start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def client(cluster):
    with EtcdClient(cluster.endpoints, timeout_s=10.0) as c:
        yield c


def test_keys_and_prefixes(client):
    client.delete(b"t1/", prefix=True)
    first = client.put(b"t1/a", b"1")
    second = client.put(b"t1/b", b"\x00\xff binary")
    assert second > first
    assert [(kv.key, kv.value) for kv in client.get(b"t1/", prefix=True)] == [
        (b"t1/a", b"1"),
        (b"t1/b", b"\x00\xff binary"),
    ]
    assert client.get(b"t1/absent") == []
    assert client.delete(b"t1/", prefix=True) == 2
    assert client.get(b"t1/", prefix=True) == []


def test_a_transaction_compared_on_a_revision_rejects_a_stale_writer(client):
    client.put(b"t2/owner", b"w1 epoch 1")
    seen = client.get(b"t2/owner")[0]
    # Another writer takes the key over (a fence), after the first one read it.
    client.put(b"t2/owner", b"w2 epoch 2")
    stale = client.txn(
        [Compare(b"t2/owner", Target.MOD, Result.EQUAL, seen.mod_revision)],
        [Put(b"t2/owner", b"w1 writes on")],
        [Get(b"t2/owner")],
    )
    assert not stale.succeeded
    assert kvs_of(stale.responses[0]["response_range"])[0].value == b"w2 epoch 2"
    assert client.get(b"t2/owner")[0].value == b"w2 epoch 2"
    current = client.get(b"t2/owner")[0]
    fresh = client.txn(
        [Compare(b"t2/owner", Target.MOD, Result.EQUAL, current.mod_revision)],
        [Put(b"t2/owner", b"w2 writes on"), Delete(b"t2/other")],
    )
    assert fresh.succeeded and fresh.revision > current.mod_revision
    # Create-if-absent: a key that does not exist has create revision 0.
    absent = Compare(b"t2/new", Target.CREATE, Result.EQUAL, 0)
    assert client.txn([absent], [Put(b"t2/new", b"x")]).succeeded
    assert not client.txn([absent], [Put(b"t2/new", b"y")]).succeeded
    assert client.txn([Compare(b"t2/new", Target.VALUE, Result.EQUAL, b"x")], [Delete(b"t2/new")]).succeeded


def test_too_many_operations_are_refused_not_retried(client):
    with pytest.raises(EtcdError, match="too many operations"):
        client.txn([], [Put(f"t3/{i}".encode(), b"v") for i in range(129)])  # etcd's default limit: 128


def test_a_lease_ends_on_etcds_clock_unless_kept_alive(client):
    kept, ttl = client.lease_grant(3)  # renewed every 0.3 s: a wide margin on a loaded machine
    dropped, _ = client.lease_grant(1)
    assert ttl >= 3
    client.put(b"t4/kept", b"k", lease=kept)
    client.put(b"t4/dropped", b"d", lease=dropped)
    deadline = time.monotonic() + 3.5
    while time.monotonic() < deadline:
        assert client.lease_keepalive(kept) >= 1
        time.sleep(0.3)
    assert client.get(b"t4/kept")[0].value == b"k"
    assert client.get(b"t4/dropped") == []  # its lease expired: etcd deleted the key
    assert client.lease_keepalive(dropped) == 0
    assert client.lease_ttl(dropped) == -1
    client.lease_revoke(kept)
    assert client.get(b"t4/kept") == []
    client.lease_revoke(kept)  # already gone: nothing to do


def test_killing_the_leader_under_writes_loses_no_acknowledged_write(tmp_path_factory):
    own = EtcdCluster(tmp_path_factory.mktemp("etcd-kill")).start()
    try:
        acknowledged: list[int] = []
        failures: list[str] = []
        stop = threading.Event()

        def write() -> None:
            with EtcdClient(own.endpoints, timeout_s=10.0) as c:
                i = 0
                while not stop.is_set():
                    try:
                        c.put(f"t5/{i:06d}".encode(), str(i).encode())
                    except EtcdError as exc:
                        failures.append(repr(exc))
                        return
                    acknowledged.append(i)
                    i += 1

        writer = threading.Thread(target=write)
        writer.start()
        time.sleep(0.5)
        leader = own.leader()
        assert leader is not None
        before = len(acknowledged)
        own.kill(leader)
        assert leader.proc is not None and leader.proc.returncode == -9  # the kill landed
        new_leader = own.wait_leader(15.0)
        assert new_leader is not leader
        deadline = time.monotonic() + 15.0  # writes go on through the two members left
        while len(acknowledged) < before + 20 and not failures and time.monotonic() < deadline:
            time.sleep(0.05)
        stop.set()
        writer.join(30)
        assert not failures, failures
        assert len(acknowledged) >= before + 20
        with EtcdClient([m.client_url for m in own.members if m is not leader]) as c:
            stored = {int(kv.value) for kv in c.get(b"t5/", prefix=True)}
        assert set(acknowledged) <= stored
    finally:
        own.stop()
