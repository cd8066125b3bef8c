"""One part of a deployment over several hosts: `steadfast serve --role router|node --join etcd://...`.

A **router** part runs the router alone: it binds the workers' outputs on TCP (`--advertise` host,
`--outputs-port`), publishes that address in etcd and learns the nodes from their records there
(cluster/membership.py). A **node** part runs one kvpool (its ledger in the same etcd, under the node's
name), its zygote, workers and standbys, and a supervisor; it registers its workers under an etcd lease it
keeps alive, their inputs on TCP at the `--advertise` host. Both ends of every router <-> worker queue are
CURVE-authenticated with the deployment's cluster keys (`steadfast cluster-keys DIR`; wire/curve.py).
This module holds what the launcher does differently in either part; plain `steadfast serve` uses none of it.
"""

from __future__ import annotations

import enum
import logging
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from steadfast.cluster.members import Gone, Members, MembershipError, NodeMembership, WorkerEntry
from steadfast.config import Config, ConfigError
from steadfast.config.ledger_url import LedgerUrlError
from steadfast.util.etcd import EtcdError
from steadfast.wire.curve import ClusterSide, KeyFile
from steadfast.wire.worker import WorkerDied, WorkerJoined

log = logging.getLogger("steadfast.launcher")

ID_BLOCK = 1000  # worker ids a node reserves at a time


class PartRole(enum.StrEnum):
    ALL = "all"  # everything on this host (plain `steadfast serve`)
    ROUTER = "router"
    NODE = "node"


@dataclass
class ClusterPart:
    role: PartRole
    members: Members
    keys_path: str  # this side's key file (router.keys or node.keys)
    advertise: str  # the host address the other parts reach this one at
    outputs_port: int = 0  # the router's: where workers' outputs come in
    membership: NodeMembership | None = None  # a node's record
    _ids: list[int] = field(default_factory=lambda: [0, 0])  # a node's reserved worker ids: next, end

    @classmethod
    def create(
        cls,
        cfg: Config,
        role: PartRole,
        join: str,
        keys: str,
        advertise: str,
        node: str = "",
        outputs_port: int = 0,
    ) -> ClusterPart:
        """Check the part's arguments and config; ConfigError naming what is wrong."""
        if not (join and keys and advertise):
            raise ConfigError(f"--role {role} needs --join etcd://..., --cluster-keys DIR and --advertise HOST")
        if advertise in ("0.0.0.0", "::", "*"):
            raise ConfigError(f"--advertise {advertise}: give the address the other hosts reach this one at")
        side = ClusterSide.ROUTER if role is PartRole.ROUTER else ClusterSide.NODE
        path = Path(keys) / f"{side}.keys" if Path(keys).is_dir() else Path(keys)
        try:
            KeyFile.load(path, side)
            members = Members(join)
        except (ValueError, MembershipError, LedgerUrlError) as exc:
            raise ConfigError(str(exc)) from None
        part = cls(role, members, str(path), advertise, outputs_port or cfg.server.port + 1)
        if role is PartRole.NODE:
            srv = cfg.server
            if srv.prefill_workers or srv.decode_workers or srv.decode_node != "same":
                raise ConfigError("a node part runs mixed workers and standbys (prefill/decode roles are one host's)")
            if not cfg.fault_recovery.kv_cache.external_ledger:
                raise ConfigError("a node part needs fault_recovery.kv_cache.external_ledger (its kvpool)")
            ttl_s = max(1, -(-cfg.fault_recovery.lease.lease_timeout_ms // 1000))
            try:
                part.membership = NodeMembership(members, node or socket.gethostname(), ttl_s)
            except MembershipError as exc:
                raise ConfigError(str(exc)) from None
        return part

    def node_config(self, cfg: Config) -> Config:
        """A node's config: its pool's ledger is the node's own, in the deployment's etcd."""
        assert self.membership is not None
        return cfg.replace(fault_recovery={"kv_cache": {"ledger_url": self.membership.record.ledger_url}})

    @property
    def outputs(self) -> str:
        return f"tcp://{_host(self.advertise)}:{self.outputs_port}"

    def worker_address(self) -> str:
        """A free TCP port on the advertised host for a worker's input (the worker binds it at once)."""
        with socket.socket(socket.AF_INET6 if ":" in self.advertise else socket.AF_INET) as s:
            s.bind((self.advertise, 0))
            port = s.getsockname()[1]
        return f"tcp://{_host(self.advertise)}:{port}"

    def take_worker_id(self) -> int:
        """A worker id unique in the deployment: from a block this node reserved in etcd."""
        if self._ids[0] >= self._ids[1]:
            try:
                first = self.members.reserve_worker_ids(ID_BLOCK)
            except (EtcdError, ValueError) as exc:
                raise MembershipError(f"no worker id from etcd: {exc}") from None
            self._ids = [first, first + ID_BLOCK]
        self._ids[0] += 1
        return self._ids[0] - 1

    def wait_router(self, timeout_s: float) -> str:
        """The router's output address, once it has published one."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                record = self.members.router()
            except (EtcdError, msgspec.DecodeError) as exc:
                raise MembershipError(f"cannot read the router's record at {self.members.join_url}: {exc}") from None
            if record is not None:
                return record.outputs
            if time.monotonic() > deadline:
                raise MembershipError(f"no router registered at {self.members.join_url} within {timeout_s:.0f}s")
            time.sleep(0.5)

    def notify(self, msg: WorkerDied | WorkerJoined, pid: int) -> None:
        """A node's supervisor news, written into its record for the router to read."""
        assert self.membership is not None
        if isinstance(msg, WorkerJoined):
            self.membership.joined(WorkerEntry(msg.worker_id, msg.address, msg.role, pid, msg.like))
        else:
            self.membership.died(Gone(msg.worker_id, msg.pid, msg.exit_code))

    def close(self) -> None:
        if self.membership is not None:
            self.membership.leave()
        self.members.close()


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address
