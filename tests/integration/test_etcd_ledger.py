"""The etcd ledger on a real 3-member cluster: the leader killed in the middle of a checkpoint (its
transaction decided, not yet sent) leaves a consistent ledger; no acknowledged write is lost; a fenced
worker's writes are refused by etcd from any client. Every call is recorded and the history checked."""

from __future__ import annotations

import shutil

import pytest

from steadfast.kv.ledger.history import RecordingLedger, check_history
from steadfast.kv.ledger.interface import FencedError, LedgerError, RequestCheckpoint
from steadfast.kv.ledger.open import open_ledger
from steadfast.util.etcd import EtcdClient
from tests.etcd_cluster import EtcdCluster

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd (Debian etcd-server) is not installed"),
]

WORKERS = ("w0", "w1", "w2")


def test_the_leader_killed_mid_checkpoint_leaves_a_consistent_ledger(tmp_path):
    cluster = EtcdCluster(tmp_path).start()
    ledger = open_ledger(cluster.ledger_url("/fault"), timeout_s=20.0)
    killed: list = []

    # The fault, at a chosen point: the first checkpoint of round 5 has decided its rows; before its
    # transaction is sent, the leader is killed. The client must find the new leader and commit it once.
    run = ledger._run
    state = {"round": 0}

    def run_killing_the_leader(name, fn):
        def decide_then_kill(tx):
            result = fn(tx)
            if name == "checkpoint" and state["round"] == 5 and not killed:
                leader = cluster.leader()
                assert leader is not None
                cluster.kill(leader)
                killed.append(leader)
            return result

        return run(name, decide_then_kill)

    ledger._run = run_killing_the_leader
    rec = RecordingLedger(ledger)
    try:
        rec.format(64)
        epochs = {w: rec.acquire_lease(w, i + 1, 30).epoch for i, w in enumerate(WORKERS)}
        written: dict[str, list[int]] = {}  # request -> the generated ids of its last acknowledged checkpoint
        held: dict[str, list[int]] = {w: [] for w in WORKERS}
        for i in range(20):
            state["round"] = i
            for w in WORKERS:
                if w == "w2" and i >= 12:
                    continue  # fenced below
                e = epochs[w]
                rec.renew_lease(w, e, 30)
                got = rec.grant(w, e, 2)
                held[w] += got
                rec.seal(w, e, [(got[0], b"h%d" % got[0], b"n%d" % got[0])])
                generated = list(range(i + 1))
                request = f"{w}-r"
                rec.checkpoint(w, e, [RequestCheckpoint(request, [1, 2, 3], "{}", generated, i + 1, "decode", held[w])])
                written[request] = generated
                if len(held[w]) > 6:
                    rec.free(w, e, held[w][:2])
                    held[w] = held[w][2:]
            if i == 11:  # a worker declared dead: from any client, etcd refuses its epoch from now on
                rec.fence("w2")
                with pytest.raises(FencedError):
                    rec.checkpoint("w2", epochs["w2"], [RequestCheckpoint("w2-r", [1], "{}", [9], 1, "decode")])
                rec.reclaim("w2")
        assert killed and killed[0].proc.returncode == -9  # the kill landed, mid-checkpoint
        assert cluster.wait_leader(15.0) is not killed[0]
        # Read back through the two members left, by a client that saw none of it.
        fresh = open_ledger(cluster.ledger_url("/fault", [m for m in cluster.members if m is not killed[0]]))
        try:
            for request, generated in written.items():
                assert fresh.request(request).generated_ids == generated, request  # no acknowledged write lost
            assert fresh.check_integrity() == []
            with pytest.raises(LedgerError):
                fresh.grant("w2", epochs["w2"], 1)
            assert fresh.lease("w2").epoch > epochs["w2"]
        finally:
            fresh.close()
        assert [op for op in rec.history if not op.ok and op.name != "checkpoint"] == []
        assert check_history(rec.history) == []
    finally:
        ledger.close()
        cluster.stop()


def test_a_cluster_with_authentication_is_logged_in_to_with_the_password_from_the_environment(tmp_path, monkeypatch):
    cluster = EtcdCluster(tmp_path, size=1).start()
    try:
        admin = EtcdClient(cluster.endpoints)
        admin._send("/v3/auth/user/add", {"name": "root", "password": "s3cret"})
        admin._send("/v3/auth/role/add", {"name": "root"})
        admin._send("/v3/auth/user/grant", {"user": "root", "role": "root"})
        admin._send("/v3/auth/enable", {})
        admin.close()
        url = cluster.ledger_url("/auth").replace("etcd://", "etcd://root@")
        with pytest.raises(LedgerError, match="login of user 'root'"):
            monkeypatch.setenv("STEADFAST_ETCD_PASSWORD", "wrong")
            open_ledger(url).format(2)
        anonymous = open_ledger(cluster.ledger_url("/auth"))
        with pytest.raises(LedgerError):  # no user: etcd refuses every call
            anonymous.format(2)
        anonymous.close()
        monkeypatch.setenv("STEADFAST_ETCD_PASSWORD", "s3cret")
        ledger = open_ledger(url)
        ledger.format(2)
        e = ledger.acquire_lease("w0", 1, 30).epoch
        assert ledger.grant("w0", e, 1) == [0]
        ledger.client._token = "expired"  # etcd's tokens end after 5 minutes: it logs in again
        ledger.seal("w0", e, [(0, b"h")])
        assert ledger.check_integrity() == []
        ledger.close()
    finally:
        cluster.stop()
