"""A deployment over test hosts (tests/hosts.py): a 3-member etcd cluster on the hosts' bridge, a router
part on host "router" and node parts on the others, each a real `steadfast serve --role ... --join` run
inside its host. For the node-loss tests and benchmark: stop a whole host (`stop_host`, SIGSTOP to every
process it runs) and let it go on (`continue_host`)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from steadfast.wire.curve import write_cluster_keys
from tests.etcd_cluster import EtcdCluster
from tests.hosts import Hosts
from tests.integration.server import free_port

PREFIX = "/deployment"
ADMIN_KEY = "deployment-admin-key"  # the router is not on the tests' loopback: its admin routes want a key


@dataclass
class Deployment:
    tmp: Path
    model: str
    config_yaml: str
    nodes: list[str] = field(default_factory=lambda: ["a", "b"])
    env: dict[str, str] = field(default_factory=dict)  # for every part (e.g. STEADFAST_LEDGER_JOURNAL)
    hosts: Hosts | None = None
    etcd: EtcdCluster | None = None
    parts: dict[str, subprocess.Popen] = field(default_factory=dict)
    url: str = ""
    journal: Path | None = None  # where env's STEADFAST_LEDGER_JOURNAL points, when it does

    def start(self, timeout_s: float = 120.0) -> Deployment:
        self.hosts = Hosts(["router", *self.nodes]).start()
        if self.hosts.why_not:
            print(f"test hosts share loopback: {self.hosts.why_not}")
        folder = Path(tempfile.mkdtemp(prefix="steadfast-etcd-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
        self.etcd = EtcdCluster(folder, host=self.hosts.gateway).start()
        keys = self.tmp / "keys"
        write_cluster_keys(keys)
        (self.tmp / "serve.yaml").write_text(self.config_yaml)
        router = self.hosts.address["router"]
        port, outputs = (free_port(), free_port()) if self.hosts.why_not else (8000, 8001)
        self.url = f"http://{router}:{port}"
        where = ["--advertise", router, "--host", router, "--port", str(port), "--outputs-port", str(outputs)]
        self._spawn("router", self._argv("--role", "router", *where))
        self.wait(self._answers, 60, "the router to answer")
        for node in self.nodes:
            self._spawn(node, self._argv("--role", "node", "--node", node, "--advertise", self.hosts.address[node]))
        self.wait(lambda: len(self.workers()) == 2 * len(self.nodes) and self.ready(), timeout_s, "every worker ready")
        return self

    def _argv(self, *args: str) -> list[str]:
        argv = [sys.executable, "-m", "steadfast.ops.cli", "serve", "--model", self.model]
        argv += ["--config", str(self.tmp / "serve.yaml"), "--join", self.join_url]
        return [*argv, "--cluster-keys", str(self.tmp / "keys"), *args]

    def _spawn(self, host: str, argv: list[str]) -> None:
        assert self.hosts is not None
        log = open(self.tmp / f"{host}.log", "ab")  # noqa: SIM115 - the process keeps it
        self.parts[host] = subprocess.Popen(
            self.hosts.command(host, argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "STEADFAST_ADMIN_KEY": ADMIN_KEY, **self.env},
            start_new_session=True,
        )

    @property
    def join_url(self) -> str:
        assert self.etcd is not None
        return self.etcd.ledger_url(PREFIX)

    def node_ledger_url(self, node: str) -> str:
        return f"{self.join_url}/nodes/{node}"

    def log(self, host: str) -> str:
        return (self.tmp / f"{host}.log").read_text(errors="replace")

    def _answers(self) -> bool:
        try:
            httpx.get(self.url + "/health", timeout=1.0)
            return True
        except httpx.HTTPError:
            return False

    def wait(self, predicate, timeout_s: float, what: str):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for host, proc in self.parts.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{host} exited with {proc.returncode}:\n{self.log(host)[-4000:]}")
            try:
                value = predicate()
            except httpx.HTTPError:
                value = None
            if value:
                return value
            time.sleep(0.1)
        logs = "\n".join(f"--- {h}\n{self.log(h)[-3000:]}" for h in self.parts)
        raise AssertionError(f"timed out waiting for {what}\n{logs}")

    def admin(self, route: str):
        """GET an admin route of the router."""
        return httpx.get(self.url + route, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=5).json()

    def workers(self) -> list[dict]:
        return self.admin("/admin/workers")

    def ready(self) -> bool:
        return httpx.get(self.url + "/health", timeout=5).status_code == 200

    def host_of(self, pid: int) -> str:
        """The node host running process `pid`."""
        for node in self.nodes:
            if pid in self.pids(node):
                return node
        raise LookupError(f"no node runs pid {pid}")

    def pids(self, host: str) -> list[int]:
        """Every process of host `host`: its namespace's, or on shared loopback its part's process tree."""
        assert self.hosts is not None
        if not self.hosts.why_not:
            return self.hosts.pids(host)
        out, todo = [], [self.parts[host].pid]
        while todo:
            pid = todo.pop()
            out.append(pid)
            found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
            todo += [int(p) for p in found.split()]
        return out

    def stop_host(self, host: str) -> list[int]:
        """SIGSTOP every process of `host` (a whole node frozen: its supervisor, pool and workers)."""
        pids = self.pids(host)
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        return pids

    def continue_host(self, pids: list[int]) -> None:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        for proc in self.parts.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.parts.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if self.hosts is not None:
            self.hosts.stop()
        if self.etcd is not None:
            self.etcd.stop()
            shutil.rmtree(self.etcd.folder, ignore_errors=True)
