"""Test "hosts": network namespaces with addresses of their own on a bridge, so that a deployment over
hosts (a router and nodes) runs on one machine with real network boundaries: each part binds its own
address, a host can be cut off (its link taken down), and `pids` are every process it runs (to SIGSTOP a
whole host). Made with `ip netns` (root only); where namespaces cannot be made, every host is 127.0.0.1
and the reason is given (`Hosts.why_not`).

The bridge's own address (`gateway`) is the machine's side: services the hosts share (the etcd members)
listen there, and the tests' clients reach the hosts from there.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from dataclasses import dataclass, field

_made = itertools.count()  # several sets of hosts in one process: each its own names and subnet


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=False)


@dataclass
class Hosts:
    names: list[str]
    serial: int = field(default_factory=lambda: next(_made))
    address: dict[str, str] = field(default_factory=dict)
    why_not: str = ""  # why these hosts share loopback instead (empty: namespaces)
    gateway: str = "127.0.0.1"
    _made: list[str] = field(default_factory=list)

    @property
    def tag(self) -> str:
        return f"sf{os.getpid() % 100000}{chr(97 + self.serial % 26)}"

    @property
    def bridge(self) -> str:
        return f"{self.tag}br"[:15]

    def namespace(self, name: str) -> str:
        return f"{self.tag}-{name}"

    def start(self) -> Hosts:
        self.why_not = self._cannot()
        if self.why_not:
            self.address = dict.fromkeys(self.names, "127.0.0.1")
            return self
        pid = os.getpid()
        routes = _ip("-4", "route").stdout + _ip("-4", "addr").stdout
        for k in range(50):  # a /24 this machine does not route already
            net = f"10.{200 + (pid + self.serial + k) % 50}.{(pid // 50) % 250}"
            if f"{net}." not in routes:
                break
        self.gateway = f"{net}.1"
        try:
            self._run("link", "add", self.bridge, "type", "bridge")
            self._made.append("bridge")
            self._run("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            self._run("link", "set", self.bridge, "up")
            for i, name in enumerate(self.names):
                ns = self.namespace(name)
                self._run("netns", "add", ns)
                self._made.append(ns)
                outside, inside = f"{self.tag}h{i}"[:15], f"{self.tag}n{i}"[:15]
                self._run("link", "add", outside, "type", "veth", "peer", "name", inside)
                self._run("link", "set", inside, "netns", ns)
                self._run("link", "set", outside, "master", self.bridge, "up")
                self.address[name] = f"{net}.{i + 2}"
                self._run("-n", ns, "addr", "add", f"{self.address[name]}/24", "dev", inside)
                self._run("-n", ns, "link", "set", inside, "up")
                self._run("-n", ns, "link", "set", "lo", "up")
        except RuntimeError:
            self.stop()
            raise
        return self

    def _cannot(self) -> str:
        if shutil.which("ip") is None:
            return "no `ip` command (iproute2)"
        if os.geteuid() != 0:
            return "not root: `ip netns` needs CAP_SYS_ADMIN"
        probe = f"{self.tag}-probe"
        made = _ip("netns", "add", probe)
        if made.returncode != 0:
            return f"`ip netns add` failed: {made.stderr.strip()}"
        _ip("netns", "del", probe)
        return ""

    def _run(self, *args: str) -> None:
        done = _ip(*args)
        if done.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")

    def command(self, name: str, argv: list[str]) -> list[str]:
        """`argv` run on host `name`."""
        if self.why_not:
            return argv
        return ["ip", "netns", "exec", self.namespace(name), *argv]

    def pids(self, name: str) -> list[int]:
        """Every process running on host `name` (namespaces only)."""
        done = _ip("netns", "pids", self.namespace(name))
        return [int(p) for p in done.stdout.split()]

    def cut(self, name: str, off: bool = True) -> None:
        """Take host `name`'s link down (a partition), or up again."""
        i = self.names.index(name)
        self._run("link", "set", f"{self.tag}h{i}"[:15], "down" if off else "up")

    def stop(self) -> None:
        for made in reversed(self._made):
            if made == "bridge":
                _ip("link", "del", self.bridge)
            else:
                for pid in self.pids(made.removeprefix(f"{self.tag}-")):
                    os.kill(pid, 9)
                _ip("netns", "del", made)  # (its veth ends go with it)
        self._made.clear()
