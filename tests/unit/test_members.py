"""The deployment's records in etcd (cluster/members.py), the router's reading of them (cluster/membership.py)
and the router <-> worker keys (wire/curve.py), on the shared single-member test etcd."""

from __future__ import annotations

import asyncio
import shutil
import threading
import time

import msgspec
import pytest
import zmq

from steadfast.cluster.members import (
    Gone,
    Members,
    MembershipError,
    NodeMembership,
    NodeRecord,
    WorkerEntry,
    check_node_name,
)
from steadfast.cluster.membership import Membership
from steadfast.kv.ledger.interface import LeaseState
from steadfast.kv.ledger.open import open_ledger
from steadfast.util.etcd import EtcdUnavailableError
from steadfast.wire.curve import ClusterSide, KeyFile, as_client, as_server, guard, write_cluster_keys
from steadfast.wire.worker import WorkerDied, WorkerJoined, WorkerRole
from tests.etcd_cluster import shared_etcd

pytestmark = pytest.mark.unit


@pytest.fixture
def members(tmp_path):
    if shutil.which("etcd") is None:
        pytest.skip("etcd (Debian etcd-server) is not installed")
    m = Members(shared_etcd().ledger_url(f"/members{tmp_path}"))
    yield m
    m.close()


def test_worker_ids_are_unique_across_parts(members):
    taken: list[int] = []

    def reserve() -> None:
        for _ in range(5):
            taken.append(members.reserve_worker_ids(10))

    threads = [threading.Thread(target=reserve) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(taken) == list(range(0, 150, 10))  # 15 blocks, none given twice


def test_a_node_name_is_taken_while_its_node_lives(members):
    first = NodeMembership(members, "gpu-1", ttl_s=2)
    first.join()
    try:
        with pytest.raises(MembershipError, match="registered and alive"):
            NodeMembership(members, "gpu-1", ttl_s=2).join()
        first.joined(WorkerEntry(7, "tcp://10.0.0.2:4000", WorkerRole.MIXED, 123))
        first.died(Gone(7, 123, 3))
        deadline = time.monotonic() + 5
        while not (record := members.nodes()["gpu-1"]).gone:  # (written by the node's keeper thread)
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert record.workers == [] and record.gone == [Gone(7, 123, 3)]
        assert record.ledger_url.endswith("/nodes/gpu-1")
    finally:
        first.leave()
    assert "gpu-1" not in members.nodes()  # left: its record removed at once
    again = NodeMembership(members, "gpu-1", ttl_s=2)
    again.join()
    again.leave()


def test_a_node_that_stops_renewing_disappears_and_registers_again(members, monkeypatch):
    """Cut off from etcd (its renewals fail) past its TTL: etcd removes the record; once it reaches etcd
    again the node registers anew. Meanwhile its supervisor's news never waits for etcd."""
    node = NodeMembership(members, "n1", ttl_s=2)
    node.join()
    keepalive = node.etcd.lease_keepalive

    def cut_off(lease: int) -> int:
        raise EtcdUnavailableError("cut off (test)")

    try:
        monkeypatch.setattr(node.etcd, "lease_keepalive", cut_off)
        deadline = time.monotonic() + 10
        while "n1" in members.nodes():
            assert time.monotonic() < deadline, "etcd did not end the lease"
            time.sleep(0.2)
        t0 = time.monotonic()
        node.joined(WorkerEntry(9, "tcp://h:9", WorkerRole.STANDBY))
        assert time.monotonic() - t0 < 0.1
        monkeypatch.setattr(node.etcd, "lease_keepalive", keepalive)
        deadline = time.monotonic() + 10
        while "n1" not in members.nodes():  # the keeper notices and registers again
            assert time.monotonic() < deadline, "the node did not register again"
            time.sleep(0.2)
        assert node.lapses == 1
        assert [w.worker_id for w in members.nodes()["n1"].workers] == [9]
    finally:
        node.leave()


@pytest.mark.parametrize("name", ["", "-x", "a/b", "a b", "x" * 64, "../x"])
def test_bad_node_names_are_refused(name):
    with pytest.raises(MembershipError):
        check_node_name(name)


def test_a_malformed_record_is_skipped(members):
    members.etcd.put(members.node_key("bad"), b"not json")
    members.etcd.put(members.node_key("other"), msgspec.json.encode(NodeRecord("someone-else", "")))
    assert members.nodes() == {}


def test_the_router_fences_a_lost_nodes_workers_before_declaring_them_dead(members):
    """Joins and deaths from the records; a node whose record is gone has every active lease fenced in
    its ledger (so etcd refuses its workers from then on) before its workers are declared dead, and a
    dead worker listed again (its node came back) is not taken back."""
    url = members.node_ledger_url("n1")
    ledger = open_ledger(url)
    ledger.format(64)
    lease = ledger.acquire_lease("worker5", 1, 30.0)
    news: list = []

    async def notice(msg) -> None:
        if msg == WorkerDied(5, 105, -1):  # declared dead only once its lease is fenced
            assert ledger.lease("worker5").state == LeaseState.FENCED
        news.append(msg)

    seen: list[str] = []
    membership = Membership(members, notice, seen.append)
    w5, w6 = (WorkerEntry(i, f"tcp://h:{i}", WorkerRole.MIXED, 100 + i) for i in (5, 6))

    async def scenario() -> None:
        # A record's ledger URL is not trusted (the node's ledger is named after it), nor an address that
        # is not TCP (the router would connect to a local socket).
        odd = WorkerEntry(8, "ipc:///tmp/elsewhere", WorkerRole.MIXED)
        await membership.apply({"n1": NodeRecord("n1", "sqlite:///tmp/x.db", [w5, w6, odd])})
        assert news == [WorkerJoined(5, "tcp://h:5", WorkerRole.MIXED), WorkerJoined(6, "tcp://h:6", WorkerRole.MIXED)]
        news.clear()
        await membership.apply({"n1": NodeRecord("n1", url, [w5, odd], [Gone(6, 106, 3)])})
        assert news == [WorkerDied(6, 106, 3)]  # its node reaped and fenced it
        news.clear()
        await membership.apply({})  # the record gone: lost
        assert news == [WorkerDied(5, 105, -1), WorkerDied(8, 0, -1)]  # (8 was never joined: ignored)
        assert ledger.lease("worker5").state == LeaseState.FENCED
        news.clear()
        await membership.apply({"n1": NodeRecord("n1", url, [w5])})  # back, listing its dead worker
        assert news == []
        # It lapsed and registered again between two readings (another generation): its earlier
        # workers are lost, its new ones join.
        w7 = WorkerEntry(7, "tcp://h:7", WorkerRole.STANDBY, 107)
        await membership.apply({"n1": NodeRecord("n1", url, [w7], generation=9)})
        assert news == [WorkerJoined(7, "tcp://h:7", WorkerRole.STANDBY)]

    asyncio.run(scenario())
    assert seen == [url, url, url]
    with pytest.raises(Exception, match="fenced|epoch"):
        ledger.renew_lease("worker5", lease.epoch, 30.0)
    ledger.close()


def test_cluster_keys_let_in_only_the_other_side(tmp_path):
    paths = write_cluster_keys(tmp_path / "keys")
    router = KeyFile.load(paths[ClusterSide.ROUTER], ClusterSide.ROUTER)
    node = KeyFile.load(paths[ClusterSide.NODE], ClusterSide.NODE)
    assert oct(paths[ClusterSide.NODE].stat().st_mode & 0o777) == "0o600"
    with pytest.raises(ValueError, match="router's keys"):
        KeyFile.load(paths[ClusterSide.ROUTER], ClusterSide.NODE)
    with pytest.raises(FileExistsError):
        write_cluster_keys(tmp_path / "keys")  # never overwritten

    ctx = zmq.Context()
    auth = guard(ctx, router.peers)
    try:
        inbox = ctx.socket(zmq.PULL)
        as_server(inbox, router)
        port = inbox.bind_to_random_port("tcp://127.0.0.1")
        client = zmq.Context()
        good, bad = client.socket(zmq.PUSH), client.socket(zmq.PUSH)
        as_client(good, node)
        # An impostor that knows the router's public key but holds no node key.
        impostor = KeyFile(ClusterSide.NODE, *zmq.curve_keypair(), peers=(router.public,))
        as_client(bad, impostor)
        for sock in (good, bad):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # writable only once a handshake has succeeded
            sock.connect(f"tcp://127.0.0.1:{port}")
        good.send(b"node")
        assert inbox.poll(5000) and inbox.recv() == b"node"
        # The impostor's handshake is refused: its socket never has a peer to send to.
        assert not bad.poll(500, zmq.POLLOUT)
        client.destroy(linger=0)
    finally:
        auth.stop()
        ctx.destroy(linger=0)


def test_an_asyncio_context_is_guarded_too(tmp_path):
    """The router's sockets live on an asyncio context, guarded through a plain shadow of it."""
    import zmq.asyncio

    paths = write_cluster_keys(tmp_path / "keys")
    router = KeyFile.load(paths[ClusterSide.ROUTER], ClusterSide.ROUTER)
    node = KeyFile.load(paths[ClusterSide.NODE], ClusterSide.NODE)
    assert router.secret.decode() not in repr(router)  # (a key in a traceback is a key in a log)

    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        auth = guard(ctx, router.peers)
        client = zmq.Context()
        try:
            outputs = ctx.socket(zmq.PULL)
            as_server(outputs, router)
            port = outputs.bind_to_random_port("tcp://127.0.0.1")
            good, bad = client.socket(zmq.PUSH), client.socket(zmq.PUSH)
            as_client(good, node)
            as_client(bad, KeyFile(ClusterSide.NODE, *zmq.curve_keypair(), peers=(router.public,)))
            for sock in (good, bad):
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.IMMEDIATE, 1)
                sock.connect(f"tcp://127.0.0.1:{port}")
            good.send(b"from a node")
            assert await asyncio.wait_for(outputs.recv(), 5) == b"from a node"
            assert not bad.poll(500, zmq.POLLOUT)
        finally:
            client.destroy(linger=0)
            auth.stop()
            ctx.destroy(linger=0)

    asyncio.run(scenario())
