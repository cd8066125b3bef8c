"""The workers of this host's launcher: their command lines (arena, node, KV wire side and keys), a start
forked by the zygote or exec'd, a death handled (fenced through its node's pool, announced, replaced by
a standby on that node a little later), a lease fenced while its worker lives ended, a rollout's
replacement started like the worker it replaces. Never the router or the pools."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from steadfast.cluster.members import MembershipError
from steadfast.cluster.node import ClusterPart
from steadfast.config import Config
from steadfast.kv.arena.files import make_arena
from steadfast.kv.arena.spec import ArenaSpec
from steadfast.kv.pool.client import PoolClient
from steadfast.ops.supervisor.children import ArenaSource, Child, ChildSpec, PoolNode, worker_spec
from steadfast.ops.supervisor.lease_watch import LeaseWatch
from steadfast.ops.supervisor.zygote_client import Zygote
from steadfast.wire.curve import TransferSide
from steadfast.wire.worker import WorkerDied, WorkerJoined, WorkerRole

log = logging.getLogger("steadfast.launcher")

STANDBY_RESPAWN_DELAY_S = 2.0  # a replacement that loads its own model copy (`model.shared_weights: false`)


@dataclass(frozen=True)
class WorkerLaunch:
    """What every worker of a launcher starts with."""

    cfg_json: str
    output: str  # the router's output address (or a node part's route to it)
    spec: ArenaSpec
    run_dir: Path
    arena_dir: str = ""  # the launcher's arena folder ("": none)
    wire_keys: dict[TransferSide, Path] | None = None  # the KV wire's key files by side (decode_node: separate)


class Workers:
    def __init__(
        self,
        cfg: Config,
        launch: WorkerLaunch,
        nodes: list[PoolNode],
        children: list[Child],
        spawn: Callable[[ChildSpec], Child],
        notify: Callable[[WorkerDied | WorkerJoined], None],
        zygote: Zygote | None = None,
        cluster: ClusterPart | None = None,
    ) -> None:
        self.cfg, self.launch, self.nodes, self.children = cfg, launch, nodes, children
        self.spawn, self.notify, self.zygote, self.cluster = spawn, notify, zygote, cluster
        self.node_of: dict[int, int] = {}  # worker id → index into nodes
        self.role_of: dict[int, WorkerRole] = {}  # worker id → the role it started with
        self.next_id = 0
        self.leases = LeaseWatch()  # fences what a stopped pool does not
        self._respawn_at: list[tuple[float, int]] = []  # (when, node index)

    def address(self, worker_id: int) -> str:
        if self.cluster is not None:
            return self.cluster.worker_address()
        return f"ipc://{self.launch.run_dir}/worker{worker_id}"

    def take_id(self) -> int:
        if self.cluster is not None:
            return self.cluster.take_worker_id()
        return self.next_id

    def start(self, worker_id: int, role: WorkerRole, node: int = 0, fresh: bool = False) -> str:
        """Start worker `worker_id` (its lease is named after it) on `node`; return its input address.
        Forked by the zygote when there is one ready, unless `fresh` (exec'd: it runs the code on disk)."""
        launch, cfg = self.launch, self.cfg
        if self.nodes:
            source = ArenaSource(pool=self.nodes[node].address)
        elif cfg.model.resolved_device != "cpu":
            source = ArenaSource(device=True)  # device memory cannot be made here and handed over
        else:
            path = os.path.join(launch.arena_dir, f"worker{worker_id}.kv")
            os.close(make_arena(path, launch.spec.nbytes, json.dumps(asdict(launch.spec))))  # the worker maps it
            source = ArenaSource(arena_file=path)
        address = self.address(worker_id)
        self.node_of[worker_id] = node
        self.role_of[worker_id] = role
        self.next_id = max(self.next_id, worker_id + 1)
        side = TransferSide.NONE  # one node: no KV wire at all
        if cfg.server.decode_node == "separate":
            # A prefill worker only sends; every worker that may decode (standbys too: one may be promoted)
            # receives (a prefill's KV, a migration's) and sends (a migration away).
            side = TransferSide.SEND if role == WorkerRole.PREFILL else TransferSide.BOTH
        sides = (TransferSide.SEND, TransferSide.RECEIVE) if side is TransferSide.BOTH else (side,)
        wire_keys = launch.wire_keys or {}
        keys = tuple(str(wire_keys[s]) for s in sides if s in wire_keys)
        weights = launch.arena_dir if cfg.model.shared_weights else ""  # the weight store lives beside the arenas
        cluster_keys = self.cluster.keys_path if self.cluster is not None else ""
        spec = worker_spec(
            launch.cfg_json, worker_id, address, launch.output, role, source, node, side, keys, weights, cluster_keys
        )
        forked = None if fresh or self.zygote is None else self.zygote.fork(list(spec.argv[1:]))
        if forked is not None:
            self.children.append(Child(spec, forked))
        else:
            self.spawn(spec)
        return address

    def kill_fenced(self) -> None:
        """End every worker fenced while alive (by its pool, or here: `LeaseWatch`)."""
        fenced = self.leases.fenced({node.name: node.ledger_url for node in self.nodes}, time.monotonic())
        for c in self.children:
            if c.name in fenced and c.proc.poll() is None:
                log.error("%s (pid %d) was fenced while alive; killing it", c.name, c.proc.pid)
                c.proc.kill()

    def died(self, c: Child, replace: bool) -> None:
        """Reaped worker: fence it through its node's pool (pid confirmed gone), tell the router; with
        `replace`, a standby replaces it on that node soon."""
        worker_id = c.spec.worker_id
        node = self.node_of.pop(worker_id, 0)
        code = c.proc.returncode
        if code == 0:
            # Retired (drained: the router moved its requests away) or stopped by SIGTERM: it released its
            # lease and blocks itself. A planned stop: nothing to fence, no replacement until told.
            log.info("%s (pid %d) retired", c.name, c.proc.pid)
            self.notify(WorkerDied(worker_id, c.proc.pid, 0))
            return
        log.error("%s (pid %d) exited with code %s; its requests move to another worker", c.name, c.proc.pid, code)
        if self.nodes and c.name in self.leases.fenced_here:
            # Fenced here because its pool did not: the pool reclaims its blocks when it runs again.
            self.leases.fenced_here.discard(c.name)
        elif self.nodes:
            try:
                kept = PoolClient(self.nodes[node].address, "supervisor", timeout_s=1.0, attempts=3).fence_dead(
                    c.name, c.proc.pid
                )
                log.info("%s fenced; %d sealed blocks kept for adoption", c.name, len(kept))
            except Exception as exc:  # the pool fences on lease expiry anyway; adoption then waits for it
                log.warning("could not fence %s at once: %s", c.name, exc)
        self.notify(WorkerDied(worker_id, c.proc.pid, code if code is not None else -1))
        # At once when the replacement maps the node's weight store (imports and a warm-up, no model to
        # load); else a little later: loading a model takes both cores for seconds, and the takeover
        # needs them now.
        if replace:
            delay = 0.0 if self.cfg.model.shared_weights else STANDBY_RESPAWN_DELAY_S
            self._respawn_at.append((time.monotonic() + delay, node))

    def next_respawn(self) -> float | None:
        """When the next standby replacement is due (monotonic), if one is."""
        return min((t for t, _ in self._respawn_at), default=None)

    def cancel_respawns(self) -> None:
        self._respawn_at.clear()

    def respawn_due(self) -> list[Child]:
        """Start the standbys whose replacement time has come; return them."""
        started = []
        now = time.monotonic()
        for due in [d for d in self._respawn_at if d[0] <= now]:
            self._respawn_at.remove(due)
            try:
                new_id = self.take_id()
            except MembershipError as exc:  # etcd unreachable: the replacement waits for it
                log.warning("standby replacement postponed: %s", exc)
                self._respawn_at.append((now + 1.0, due[1]))
                continue
            address = self.start(new_id, WorkerRole.STANDBY, due[1])
            self.notify(WorkerJoined(new_id, address, WorkerRole.STANDBY))
            started.append(self.children[-1])
        return started

    def replace_like(self, like: int) -> Child | None:
        """A rollout's replacement for worker `like`, exec'd (it runs the code on disk), with its role and
        node, announced with WorkerJoined; None when `like` is not running."""
        if like not in self.node_of:
            log.warning("asked for a worker like worker %d, which is not running", like)
            return None
        new_id, role = self.take_id(), self.role_of[like]
        address = self.start(new_id, role, self.node_of[like], fresh=True)
        log.info("started worker %d (%s) to replace worker %d", new_id, role, like)
        self.notify(WorkerJoined(new_id, address, role, like))
        return self.children[-1]
