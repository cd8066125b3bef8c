"""The soak across hosts (`bench_soak.py --hosts`): a router part and two node parts, each in a network
namespace of its own (tests/hosts.py), their ledgers and records in a 3-member etcd cluster
(tests/deployment.py), and the faults only such a deployment has — an etcd member or the etcd leader
killed (and started again on its data), a node host frozen past its lease (SIGSTOP to every process it
runs), a node host cut off the network (its link down) — added to the nemesis' own kinds.

What the claim covers, and so what overlaps: at most one etcd member is down at a time (the cluster keeps
its quorum; losing it stops every ledger, an outage nothing rides through), and at most one node host is
lost at a time, until its new workers are ready (with both lost, nothing is left to serve from). Every
other fault overlaps these freely.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from steadfast.ops.harness.soak_faults import Struck
from tests.deployment import ADMIN_KEY, Deployment
from tests.etcd_cluster import Member

HOST_FAULTS = ("etcd-member", "etcd-leader", "freeze-node", "partition")
ETCD_DOWN_S = 8.0  # a killed etcd member stays down this long, then starts again on its data
NODE_BACK_S = 180.0  # a lost node's new workers waited for this long at most (the node lock is held)


class HostDeployment:
    """`Deployment` as the soak reads it (`soak_run.Deployed`): started here, ready when made."""

    drill: Path | None = None  # (no KV wire between hosts yet: no drill to drop its frames)

    def __init__(self, tmp: Path, model: str, config_yaml: str, env: dict[str, str]) -> None:
        journal = Path(env["STEADFAST_LEDGER_JOURNAL"]) if "STEADFAST_LEDGER_JOURNAL" in env else None
        self.d = Deployment(tmp, model, config_yaml, env=env, journal=journal)
        try:
            self.d.start(timeout_s=600)
        except BaseException:
            self.d.stop()
            raise
        self.url = self.d.url
        self.headers = {"Authorization": f"Bearer {ADMIN_KEY}"}

    def wait_ready(self) -> None:
        self.d.wait(self.d.ready, 120, "the deployment ready")

    def launchers(self) -> list[int]:
        return [p.pid for p in self.d.parts.values()]

    def faults(self, lease_s: float, seed: int) -> dict[str, Callable[[Struck], None]]:
        return HostFaults(self, lease_s, seed).kinds()

    def stop(self) -> None:
        self.d.stop()


class HostFaults:
    """The faults of a deployment over hosts, each striking as the nemesis' own (`Struck` filled with
    what happened and how to prove it landed)."""

    def __init__(self, dep: HostDeployment, lease_s: float, seed: int) -> None:
        self.d = dep.d
        self.lease_s = lease_s
        self.rng = random.Random(seed * 131 + 3)
        self._etcd = threading.Lock()  # one member down at a time
        self._node = threading.Lock()  # one node host lost at a time

    def kinds(self) -> dict[str, Callable[[Struck], None]]:
        out = {"etcd-member": self._etcd_member, "etcd-leader": self._etcd_leader, "freeze-node": self._freeze}
        assert self.d.hosts is not None
        if not self.d.hosts.why_not:  # a partition needs a link of its own to take down
            out["partition"] = self._partition
        return out

    # --- etcd ------------------------------------------------------------------------------------------
    def _etcd_member(self, s: Struck) -> None:
        self._kill_member(s, leader=False)

    def _etcd_leader(self, s: Struck) -> None:
        self._kill_member(s, leader=True)

    def _kill_member(self, s: Struck, leader: bool) -> None:
        etcd = self.d.etcd
        assert etcd is not None
        with self._etcd:
            lead = etcd.wait_leader()
            others = [m for m in etcd.members if m is not lead]
            member: Member = lead if leader else others[self.rng.randrange(len(others))]
            assert member.proc is not None
            etcd.kill(member)
            code = member.proc.returncode
            killed = time.monotonic()
            new_leader = etcd.wait_leader()  # (the two left elect one at once when the leader went)
            elected_s = time.monotonic() - killed
            time.sleep(max(0.0, ETCD_DOWN_S - elected_s))
            etcd.restart(member)
        role = "the leader" if leader else "a follower"
        s.what = f"etcd member {member.name} ({role}) killed for {ETCD_DOWN_S:g}s"
        if leader:
            s.what += f"; {new_leader.name} led {elected_s * 1000:.0f} ms after"

        def proof() -> bool:
            back = member.proc is not None and member.proc.poll() is None and etcd.status(member) is not None
            return code == -9 and back and (not leader or new_leader is not member)

        s.proof = proof

    # --- a node host lost ------------------------------------------------------------------------------
    def _freeze(self, s: Struck) -> None:
        def lose(host: str) -> Callable[[], None]:
            pids = self.d.stop_host(host)
            return lambda: self.d.continue_host(pids)

        self._lose_node(s, "frozen (SIGSTOP to all it runs)", lose)

    def _partition(self, s: Struck) -> None:
        hosts = self.d.hosts
        assert hosts is not None

        def lose(host: str) -> Callable[[], None]:
            hosts.cut(host)
            return lambda: hosts.cut(host, off=False)

        self._lose_node(s, "cut off the network", lose)

    def _lose_node(self, s: Struck, how: str, lose: Callable[[str], Callable[[], None]]) -> None:
        """One node host lost past its lease, then back: its workers must be fenced and replaced."""
        with self._node:
            rows = self._workers()
            host = self.d.nodes[self.rng.randrange(len(self.d.nodes))]
            pids = set(self.d.pids(host))
            old = {w["id"] for w in rows if w["pid"] in pids and w["state"] != "dead"}
            busy = sum(w["in_flight"] for w in rows if w["id"] in old)
            held = self.lease_s + 2.0
            restore = lose(host)
            try:
                time.sleep(held)
            finally:
                restore()
            s.what = f"node host {host} {how} for {held:g}s ({len(old)} workers, {busy} requests)"
            with contextlib.suppress(TimeoutError):
                self._until(lambda: self._replaced(host, old), NODE_BACK_S)
        s.proof = lambda: self._replaced(host, old)

    def _replaced(self, host: str, old: set[int]) -> bool:
        """The host's old workers are gone from the router's view (fenced, dead) and new ones are ready."""
        rows = self._workers()
        pids = set(self.d.pids(host))
        gone = all(w["state"] == "dead" for w in rows if w["id"] in old)
        new = [w for w in rows if w["pid"] in pids and w["id"] not in old and w["state"] == "ready"]
        return gone and bool(old) and bool(new)

    def _workers(self) -> list[dict[str, Any]]:
        for _ in range(60):  # through a router restart (another fault's)
            with contextlib.suppress(Exception):
                return self.d.workers()
            time.sleep(0.5)
        return self.d.workers()

    @staticmethod
    def _until(predicate: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError
            time.sleep(1.0)
