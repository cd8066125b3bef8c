"""A 3-member etcd cluster on loopback for tests (Debian's `etcd-server`): members started with free
ports and their own data folders, waited for until one of them leads, killed or stopped one by one."""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class Member:
    name: str
    client_url: str
    peer_url: str
    data_dir: Path
    log: Path
    proc: subprocess.Popen | None = None
    args: list[str] = field(default_factory=list)  # how it was started (a restart runs it again on its data)


@dataclass
class EtcdCluster:
    folder: Path
    size: int = 3
    # etcd's own knobs beyond the defaults (e.g. --max-txn-ops), for every member
    extra: list[str] = field(default_factory=list)
    members: list[Member] = field(default_factory=list)
    host: str = "127.0.0.1"  # the address its members listen on (a test hosts' bridge, to be reached from them)

    def start(self, timeout_s: float = 30.0) -> EtcdCluster:
        etcd = shutil.which("etcd")
        if etcd is None:
            raise FileNotFoundError("etcd (Debian package etcd-server) is not installed")
        for i in range(self.size):
            name = f"m{i}"
            self.members.append(
                Member(
                    name,
                    f"http://{self.host}:{_free_port(self.host)}",
                    f"http://{self.host}:{_free_port(self.host)}",
                    self.folder / name,
                    self.folder / f"{name}.log",
                )
            )
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for m in self.members:
            args = [
                etcd,
                f"--name={m.name}",
                f"--data-dir={m.data_dir}",
                f"--listen-client-urls={m.client_url}",
                f"--advertise-client-urls={m.client_url}",
                f"--listen-peer-urls={m.peer_url}",
                f"--initial-advertise-peer-urls={m.peer_url}",
                f"--initial-cluster={initial}",
                "--initial-cluster-state=new",
                f"--initial-cluster-token={self.folder.name}",
                # Elections in ~0.5 s, and leases of 1 s allowed (the minimum is 1.5 election ticks).
                "--heartbeat-interval=50",
                "--election-timeout=500",
                *self.extra,
            ]
            m.args = args
            m.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=m.log.open("wb"))
        self.wait_leader(timeout_s)
        return self

    @property
    def endpoints(self) -> list[str]:
        return [m.client_url for m in self.members]

    def ledger_url(self, prefix: str, members: list[Member] | None = None) -> str:
        """An etcd ledger URL on these members (default: all) with keys under `prefix`."""
        chosen = self.members if members is None else members
        return "etcd://" + ",".join(m.client_url.removeprefix("http://") for m in chosen) + prefix

    def status(self, member: Member) -> dict | None:
        try:
            r = httpx.post(member.client_url + "/v3/maintenance/status", json={}, timeout=1.0)
            return r.json() if r.status_code == 200 else None
        except httpx.HTTPError:
            return None

    def leader(self) -> Member | None:
        for m in self.members:
            if m.proc is None or m.proc.poll() is not None:
                continue
            st = self.status(m)
            if st and st.get("leader") and st["leader"] == st["header"]["member_id"]:
                return m
        return None

    def wait_leader(self, timeout_s: float = 30.0) -> Member:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            leader = self.leader()
            if leader is not None:
                return leader
            time.sleep(0.1)
        logs = "\n".join(m.log.read_text(errors="replace")[-2000:] for m in self.members if m.log.exists())
        raise TimeoutError(f"no etcd leader within {timeout_s}s:\n{logs}")

    def kill(self, member: Member) -> None:
        if member.proc is not None and member.proc.poll() is None:
            member.proc.send_signal(signal.SIGKILL)
            member.proc.wait(10)

    def restart(self, member: Member) -> None:
        """A killed member started again on its data directory: it rejoins the cluster as it was."""
        if member.proc is not None and member.proc.poll() is None:
            return
        member.proc = subprocess.Popen(member.args, stdout=subprocess.DEVNULL, stderr=member.log.open("ab"))

    def stop(self) -> None:
        """Killed, not stopped in order: a test's cluster goes with its data, and etcd's orderly stop
        takes ~6 s a cluster."""
        for m in self.members:
            if m.proc is not None and m.proc.poll() is None:
                m.proc.kill()
        for m in self.members:
            if m.proc is not None:
                try:
                    m.proc.wait(10)
                except subprocess.TimeoutExpired:
                    m.proc.kill()


_shared: EtcdCluster | None = None


def shared_etcd() -> EtcdCluster:
    """One single-member etcd for the whole test run (started on first use, stopped at exit), for
    tests of the ledger's semantics rather than of replication: each test keeps to its own key prefix.
    Its data lives in /dev/shm where there is one, so that etcd's fsync per commit costs nothing."""
    global _shared
    if _shared is None:
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        folder = Path(tempfile.mkdtemp(prefix="steadfast-etcd-", dir=base))
        cluster = EtcdCluster(folder, size=1)
        atexit.register(shutil.rmtree, folder, True)
        atexit.register(cluster.stop)
        _shared = cluster.start()
    return _shared
