"""What the supervisor starts: one spec per child process — its kind, its command line, and what to do
when it exits — and the child once started. The launcher and the fault-test harness build command lines
only through these, so a flag changes in one place.
"""

from __future__ import annotations

import enum
import json
import logging
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

from steadfast.kv.arena.spec import ArenaSpec
from steadfast.ops.supervisor.zygote_client import Process
from steadfast.wire.curve import TransferSide
from steadfast.wire.worker import WorkerRole

log = logging.getLogger("steadfast.launcher")


class ChildKind(enum.Enum):
    POOL = "kvpool"
    WORKER = "worker"
    ROUTER = "router"
    ZYGOTE = "zygote"  # forks the workers (ops/supervisor/zygote_client.py)


class OnExit(enum.Enum):
    RESTART = "restart"  # start it again with the same command (a pool re-attaches arena and ledger)
    REPLACE = "replace"  # a worker: fence it, move its requests, start a standby in its place later
    RESTART_ROUTER = "restart_router"  # again, on the workers alive now; clients resume by Last-Event-ID
    RESTART_ZYGOTE = "restart_zygote"  # again if it had been ready; workers are exec'd meanwhile


@dataclass(frozen=True)
class ChildSpec:
    kind: ChildKind
    name: str  # unique among the children; a worker's is its lease name ("worker3")
    argv: tuple[str, ...]  # the module to run and its arguments
    on_exit: OnExit
    worker_id: int = -1
    node: int = 0  # the pool node a worker or pool belongs to

    def command(self) -> list[str]:
        return [sys.executable, "-m", *self.argv]


def pool_name(index: int) -> str:
    return "kvpool" if index == 0 else f"kvpool{index}"


def pool_spec(
    cfg_json: str,
    index: int,
    address: str,
    arena_path: str,
    ledger_url: str,
    spec: ArenaSpec,
    ready_file: str,
    device: str,
    tier_path: str = "",
) -> ChildSpec:
    argv = (
        "steadfast.kv.pool.daemon",
        "--config-json",
        cfg_json,
        "--address",
        address,
        "--arena",
        arena_path,
        "--ledger",
        ledger_url,
        "--spec-json",
        json.dumps(asdict(spec)),
        "--ready-file",
        ready_file,
        "--device",
        device,
        *(("--tier", tier_path) if tier_path else ()),
    )
    return ChildSpec(ChildKind.POOL, pool_name(index), argv, OnExit.RESTART, node=index)


@dataclass(frozen=True)
class ArenaSource:
    """Where a worker's KV arena comes from: its node's pool, a private file, or its own device memory."""

    pool: str = ""
    arena_file: str = ""
    device: bool = False

    def argv(self) -> tuple[str, ...]:
        if self.pool:
            return ("--pool", self.pool)
        if self.device:
            return ("--device-arena",)
        return ("--arena", self.arena_file)


def worker_spec(
    cfg_json: str,
    worker_id: int,
    input_address: str,
    output_address: str,
    role: WorkerRole,
    arena: ArenaSource,
    node: int = 0,
    transfer: TransferSide | None = None,
    transfer_keys: tuple[str, ...] = (),
    weights_dir: str = "",
    cluster_keys: str = "",
) -> ChildSpec:
    """`transfer`: the worker's side of the KV wire between nodes (None: it goes by its role);
    `transfer_keys`: the paths of its sides' key files (paths only: a key on a command line is public);
    `weights_dir`: the folder of the node's weight store (empty: the worker loads its own copy);
    `cluster_keys`: a node part's key file (its queues to the router are CURVE over TCP)."""
    wire = (
        *(("--transfer-side", str(transfer)) if transfer is not None else ()),
        *(arg for path in transfer_keys for arg in ("--transfer-keys", path)),
        *(("--weights-dir", weights_dir) if weights_dir else ()),
        *(("--cluster-keys", cluster_keys) if cluster_keys else ()),
    )
    argv = (
        "steadfast.worker.main",
        "--config-json",
        cfg_json,
        "--worker-id",
        str(worker_id),
        "--input",
        input_address,
        "--output",
        output_address,
        "--role",
        str(role),
        *arena.argv(),
        *wire,
    )
    return ChildSpec(ChildKind.WORKER, f"worker{worker_id}", argv, OnExit.REPLACE, worker_id, node)


def router_spec(
    cfg_json: str,
    output_address: str,
    ledger_urls: list[str],
    active: list[tuple[int, str]],
    standbys: list[tuple[int, str]],
    supervisor: str = "",
    join: tuple[str, str] = (),
) -> ChildSpec:
    """`active`, `standbys`: (worker id, input address). A restarted router learns each worker's
    current role from its first status report. `supervisor`: where it asks for new workers (a rollout).
    `join`: (etcd URL, key file) of a router part, which learns its workers from the nodes' records."""
    argv = ["steadfast.control.main", "--config-json", cfg_json, "--output", output_address]
    if join:
        argv += ["--join", join[0], "--cluster-keys", join[1]]
    if supervisor:
        argv += ["--supervisor", supervisor]
    for url in ledger_urls:
        argv += ["--ledger", url]
    for flag, workers in (("--worker", active), ("--standby", standbys)):
        for worker_id, address in workers:
            argv += [flag, f"{worker_id}={address}"]
    return ChildSpec(ChildKind.ROUTER, "router", tuple(argv), OnExit.RESTART_ROUTER)


@dataclass
class Child:
    spec: ChildSpec
    proc: Process  # a subprocess.Popen, or a worker the zygote forked
    stopping_since: float | None = None  # when it was sent SIGTERM by the launcher's stop

    @property
    def name(self) -> str:
        return self.spec.name

    def terminate(self) -> None:
        """SIGTERM, once: its time to exit counts from the first."""
        if self.stopping_since is None and self.proc.poll() is None:
            self.stopping_since = time.monotonic()
            self.proc.terminate()


def stop_all(children: list[Child], limit: float) -> None:
    """SIGTERM each (unless sent already), then wait for each up to `limit` seconds after its SIGTERM;
    kill those still running."""
    for c in children:
        c.terminate()
    for c in children:
        since = c.stopping_since if c.stopping_since is not None else time.monotonic()
        try:
            c.proc.wait(timeout=max(0.0, since + limit - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s (pid %d) did not stop within %.0fs; killing it", c.name, c.proc.pid, limit)
            c.proc.kill()
            c.proc.wait()


@dataclass
class PoolNode:
    """One node's KV memory: a kvpool daemon with its arena and ledger. A second one on this host
    stands in for another machine (its workers receive KV over TCP, never by handoff)."""

    index: int
    address: str
    ledger_url: str
    spec: ChildSpec

    @property
    def name(self) -> str:
        return self.spec.name
