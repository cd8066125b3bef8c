"""`steadfast serve`: start the kvpool daemon(s), the workers, hot standbys and the router; wait until
healthy; supervise.

The kvpool daemon creates the node's KV arena and ledger, so that memory belongs to no engine process
(with `external_ledger: false`, the launcher makes one private arena per worker instead). With
`decode_node: separate` the decode workers get a second kvpool, arena and ledger: another node on this
host, reached over TCP like a real one. Nothing is reported as serving before /health says every
worker is ready. Each child is watched through a pidfd, so a death is seen the instant it happens: a
dead worker is reaped (its pid is then surely gone), fenced through its node's pool, announced to the
router, which moves its requests to a standby of that node, and a new standby is started there in the
background. A dead kvpool is restarted; it re-attaches arena and ledger.

SIGTERM or SIGINT stops the children in the order they need each other: the router first (it refuses new
requests and lets those in flight finish, for `server.shutdown_timeout`), then the workers (which release
their leases through their pools as they exit), then the pools. Those exits are expected: nothing is
restarted, fenced or logged as an error.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_sentinels
from pathlib import Path

import httpx
import zmq

from steadfast.cluster.members import MembershipError
from steadfast.cluster.node import ClusterPart, PartRole
from steadfast.config import Config
from steadfast.kv.arena.files import ArenaSpaceError, check_space
from steadfast.kv.arena.spec import ArenaSpec, arena_spec
from steadfast.model.gguf_meta import open_gguf, read_config
from steadfast.ops.supervisor.arena_dir import ArenaDir
from steadfast.ops.supervisor.children import Child, ChildKind, ChildSpec, OnExit, PoolNode, router_spec, stop_all
from steadfast.ops.supervisor.exposure import hand_keys_to_children, warn_exposure
from steadfast.ops.supervisor.pools import PoolStartError, start_pool
from steadfast.ops.supervisor.workers import WorkerLaunch, Workers
from steadfast.ops.supervisor.zygote_client import Zygote, become_subreaper, reap_orphans
from steadfast.util.etcd import EtcdError
from steadfast.wire.codec import encode
from steadfast.wire.curve import CurveUnavailableError, write_deployment_keys
from steadfast.wire.worker import WorkerDied, WorkerJoined, WorkerRole, decode_to_supervisor

log = logging.getLogger("steadfast.launcher")


# How long each kind of child gets to exit after its SIGTERM, before it is killed. The router's is on top
# of `server.shutdown_timeout`: to send the error events of the streams it ended, and close (uvicorn's 5 s).
ROUTER_STOP_GRACE_S = 10.0
ORPHAN_REAP_S = 5.0
WORKER_STOP_S = 10.0  # a worker with no request exits at once (it may be loading the model still)
POOL_STOP_S = 10.0


class Phase(enum.Enum):
    SERVING = "serving"
    DRAINING = "draining"  # told to stop: the router finishes its requests; its exit is expected
    STOPPING = "stopping"  # router gone: workers, then pools are stopped


class StartupError(RuntimeError):
    pass


@dataclass
class Launcher:
    cfg: Config
    # Sockets, ledgers, wire keys. Unset: a private folder in the temp dir, held like the arena folder
    # (ArenaDir), so the next start removes it when this launcher is gone, even after a kill -9.
    run_dir: Path = Path()
    run_folder: ArenaDir | None = None
    children: list[Child] = field(default_factory=list)
    arena_folder: ArenaDir | None = None
    shared_files: list[str] = field(default_factory=list)
    nodes: list[PoolNode] = field(default_factory=list)
    workers: Workers | None = None  # this host's workers (none in a router part)
    pool_restarts: int = 0
    phase: Phase = Phase.SERVING
    zygote: Zygote | None = None  # forks the workers (`model.fork_workers`)
    cluster: ClusterPart | None = None  # one part of a deployment over hosts (`serve --role router|node`)
    _next_reap: float = 0.0  # (a subreaper adopts every orphan below it: see reap_orphans)
    # Once the router runs, a SIGTERM or SIGINT is a stop in order (its clients' streams drain), even one
    # that comes before `wait`: kept here, acted on there.
    router_started: bool = False
    signals: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.run_dir == Path():
            self.run_folder = ArenaDir.create(tempfile.gettempdir())
            self.run_dir = Path(self.run_folder.path)

    @property
    def url(self) -> str:
        return f"http://{self.cfg.server.host}:{self.cfg.server.port}"

    @property
    def role(self) -> PartRole:
        return self.cluster.role if self.cluster is not None else PartRole.ALL

    def start(self) -> None:
        cfg = self.cfg
        model_cfg = read_config(open_gguf(cfg.model.resolved_path))
        spec = arena_spec(cfg, model_cfg)
        cfg_json = json.dumps(cfg.public().to_dict())
        hand_keys_to_children(cfg)
        warn_exposure(cfg, self.role, self.cluster.members.join_url if self.cluster is not None else "")
        output = f"ipc://{self.run_dir}/outputs"
        if self.cluster is not None and self.role is PartRole.ROUTER:
            self._cfg_json, self._output = cfg_json, self.cluster.outputs
            self._spawn(self._router_spec([], []))
            self.router_started = True
            self._wait_healthy()
            return
        if self.cluster is not None:  # a node: its workers send to the router, wherever it runs
            try:
                output = self.cluster.wait_router(cfg.server.startup_timeout_s)
            except MembershipError as exc:
                raise StartupError(str(exc)) from None
        srv = cfg.server
        # One arena per node, owned by its kvpool daemon, which grants blocks to the node's workers.
        pools = (2 if srv.decode_node == "separate" else 1) if cfg.fault_recovery.kv_cache.external_ledger else 0
        last = max(pools - 1, 0)  # decode workers' node: the second when separate
        placed = [(WorkerRole.MIXED, 0)] * srv.workers + [(WorkerRole.PREFILL, 0)] * srv.prefill_workers
        placed += [(WorkerRole.DECODE, last)] * srv.decode_workers
        placed += [(WorkerRole.STANDBY, node) for node in range(last + 1) for _ in range(srv.standby_workers)]
        try:
            self.arena_folder = ArenaDir.create(cfg.cache.arena_dir)  # and removes those of dead launchers
        except OSError as exc:
            raise StartupError(f"cannot keep KV arenas in cache.arena_dir {cfg.cache.arena_dir}: {exc}") from None
        if cfg.model.resolved_device == "cpu":  # else every arena is device memory
            self._check_arena_space(pools or len(placed), spec)
        self._cfg_json, self._output = cfg_json, output
        self._start_zygote()  # its ~2 s of torch import and the model's load overlap the pools' start
        for i in range(pools):
            try:
                node = start_pool(
                    cfg, i, cfg_json, spec, self.run_dir, self.arena_folder.path, self.shared_files, self._spawn
                )
            except PoolStartError as exc:
                raise StartupError(str(exc)) from None
            self.nodes.append(node)
        # The router asks here for new workers (a rollout); the run folder is 0700, so only this user can.
        self._supervisor_address = f"ipc://{self.run_dir}/supervisor"
        self._requests = zmq.Context.instance().socket(zmq.PULL)
        self._requests.setsockopt(zmq.LINGER, 0)
        self._requests.setsockopt(zmq.MAXMSGSIZE, 4096)
        self._requests.bind(self._supervisor_address)
        # The KV wire between nodes: one keypair per side, made once per deployment, handed over as files.
        wire_keys = srv.decode_node == "separate" and cfg.transfer.curve
        try:
            keys = write_deployment_keys(self.run_dir) if wire_keys else {}
        except CurveUnavailableError as exc:
            raise StartupError(str(exc)) from None
        launch = WorkerLaunch(cfg_json, output, spec, self.run_dir, self.arena_folder.path, keys)
        self.workers = workers = Workers(
            cfg, launch, self.nodes, self.children, self._spawn, self._notify, self.zygote, self.cluster
        )
        active = [i for i, (role, _) in enumerate(placed) if role != WorkerRole.STANDBY]
        if self.cluster is None:
            # Its workers' addresses are known before they start: the router's ~2 s of imports overlap
            # the zygote's model load (it places nothing until a worker reports).
            self._spawn(self._router_spec(active, [i for i in range(len(placed)) if i not in active]))
        if self.zygote is not None:  # (workers are exec'd if it fails)
            self.zygote.ready(timeout=self.cfg.server.startup_timeout_s)
        if self.cluster is not None:  # a node: its workers join the router through its record in etcd
            assert self.cluster.membership is not None
            try:
                self.cluster.membership.join()
                for role, node in placed:
                    worker_id = workers.take_id()
                    self._notify(WorkerJoined(worker_id, workers.start(worker_id, role, node), role))
            except (MembershipError, EtcdError) as exc:
                raise StartupError(f"node {self.cluster.membership.name} cannot join: {exc}") from None
            return
        for worker_id, (role, node) in enumerate(placed):
            workers.start(worker_id, role, node)
        self.router_started = True  # (a signal before this ends the start; the router is then stopped too)
        self._notices = zmq.Context.instance().socket(zmq.PUSH)  # supervisor → router: deaths, joins
        self._notices.setsockopt(zmq.LINGER, 0)
        self._notices.connect(output)
        log.info(
            "KV arena: %d blocks x %d tokens (%.0f MiB)%s",
            spec.num_blocks,
            spec.block_size,
            spec.nbytes / 2**20,
            f" per node, {len(self.nodes)} node(s)" if self.nodes else " per worker",
        )
        self._wait_healthy()

    def _start_zygote(self) -> None:
        """With `model.fork_workers`, the process every worker is forked from; it builds the node's weight
        store (or maps it) before the first worker starts (`start` waits for it). Without it, or if it fails,
        workers are exec'd."""
        model = self.cfg.model
        if not (model.shared_weights and model.fork_workers and self.arena_folder is not None):
            return
        if not become_subreaper():
            log.warning("cannot be a child subreaper here: workers start from a fresh interpreter")
            return
        self.zygote = Zygote(self._cfg_json, self.arena_folder.path)
        self._spawn_zygote()

    def _spawn_zygote(self) -> Child:
        assert self.zygote is not None
        proc = self.zygote.start()
        spec = ChildSpec(ChildKind.ZYGOTE, "zygote", ("steadfast.worker.zygote",), OnExit.RESTART_ZYGOTE)
        child = Child(spec, proc)
        self.children.append(child)
        return child

    def _zygote_died(self, c: Child) -> Child | None:
        """A zygote that had been ready is started again (its workers live on: they are not its
        children); one that died starting is not (workers are exec'd from then on)."""
        assert self.zygote is not None
        if self.zygote.proc is not c.proc:
            return None  # a zygote replaced already (a rollout's restart)
        self.zygote.close()
        if not self.zygote.was_ready or self.phase is not Phase.SERVING:
            if self.phase is Phase.SERVING:
                log.error("the worker zygote exited with code %s; workers are exec'd", c.proc.returncode)
            return None
        log.error("the worker zygote (pid %d) exited with code %s; restarting it", c.proc.pid, c.proc.returncode)
        return self._spawn_zygote()

    def _check_arena_space(self, count: int, spec: ArenaSpec) -> None:
        """Fail now, with the sizes, if the arena folder cannot hold the `count` arenas of this start
        (their creators reserve their space too, but a pool's failure would only say it did not start)."""
        what = "the KV arena" if count == 1 else f"{count} KV arenas of {spec.nbytes / 2**20:.0f} MiB"
        try:
            check_space(self.cfg.cache.arena_dir, count * spec.nbytes, what)
        except ArenaSpaceError as exc:
            raise StartupError(str(exc)) from None

    def _notify(self, msg: WorkerDied | WorkerJoined) -> None:
        """Tell the router: on this host through its output socket; from a node, in its record in etcd."""
        if self.cluster is not None:
            pids = [c.proc.pid for c in self.children if c.spec.worker_id == msg.worker_id]
            self.cluster.notify(msg, pids[-1] if pids else 0)
        else:
            self._notices.send(encode(msg))

    def _router_spec(self, active: list[int], standbys: list[int]) -> ChildSpec:
        """The router: workers (by id) that take traffic, then standbys."""
        if self.cluster is not None:  # the router part: nodes join through etcd
            joins = (self.cluster.members.join_url, self.cluster.keys_path)
            return router_spec(self._cfg_json, self._output, [], [], [], "", joins)
        assert self.workers is not None
        ledgers = [node.ledger_url for node in self.nodes]
        with_address = [[(i, self.workers.address(i)) for i in ids] for ids in (active, standbys)]
        return router_spec(self._cfg_json, self._output, ledgers, *with_address, self._supervisor_address)

    def _router_died(self, c: Child) -> Child:
        """Restart the router on the workers that live now; clients reconnect with Last-Event-ID."""
        log.error("router (pid %d) exited with code %s; restarting it", c.proc.pid, c.proc.returncode)
        alive = sorted(
            x.spec.worker_id for x in self.children if x.spec.kind is ChildKind.WORKER and x.proc.poll() is None
        )
        return self._spawn(self._router_spec(alive, []))

    def _requested(self) -> list[Child]:
        """Workers the router asked for (a rollout's replacements), each like the one named. A malformed
        request or one naming no live worker is dropped."""
        started: list[Child] = []
        if self.workers is None:
            return started  # a router part (its nodes' supervisors start workers)
        while True:
            try:
                data = self._requests.recv(zmq.NOBLOCK)
            except zmq.Again:
                return started
            try:
                ask = decode_to_supervisor(data)
            except Exception:  # noqa: BLE001 - msgspec's errors: nothing is started for it
                log.warning("dropped a malformed request on the supervisor socket")
                continue
            if not started and ask.like in self.workers.node_of:
                started += self._renew_zygote()
            fresh = self.workers.replace_like(ask.like)
            if fresh is not None:
                started.append(fresh)

    def _renew_zygote(self) -> list[Child]:
        """A rollout's workers are exec'd, so they run the code on disk now; the zygote is started again
        for the same reason (later replacements are forked from the new code once it is ready). The old
        one exits when its socket closes; its exit is ignored."""
        if self.zygote is None or self.zygote.proc is None:
            return []
        return [self._spawn_zygote()]

    def _spawn(self, spec: ChildSpec) -> Child:
        # A group of its own: a Ctrl-C at the terminal reaches the launcher alone, which stops the children
        # in order (and PR_SET_PDEATHSIG still ends them if the launcher dies).
        child = Child(spec, subprocess.Popen(spec.command(), process_group=0))
        self.children.append(child)
        return child

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.cfg.server.startup_timeout_s
        while time.monotonic() < deadline and not self.signals:  # told to stop: `wait` stops in order
            for c in self.children:
                if c.proc.poll() is not None and c.spec.kind is not ChildKind.ZYGOTE:  # (workers exec'd then)
                    raise StartupError(f"{c.name} exited with code {c.proc.returncode} during start-up")
            try:
                status = httpx.get(self.url + "/health", timeout=2.0).status_code
                if status == 200 or self.role is PartRole.ROUTER:  # (a router part's workers join later)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        if not self.signals:
            raise StartupError(f"not healthy within {self.cfg.server.startup_timeout_s:.0f}s")

    def wait(self) -> int:
        """Supervise until told to stop (SIGTERM, SIGINT), then until the router has finished its
        requests (or had its time for it); return an exit code. `stop` stops the rest."""
        signals = self.signals  # with any that came since the router started

        def on_signal(signum: int, frame: object) -> None:
            signals.append(signum)  # acted on by the loop below at once: the wake-up pipe ends its wait

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        # A pidfd becomes readable the moment its process exits: death is noticed at once, not polled.
        pidfds = {os.pidfd_open(c.proc.pid): c for c in self.children}
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        before = signal.set_wakeup_fd(wake_w)
        handled = 0
        try:
            while not (self.phase is Phase.DRAINING and self._router_drained()):
                if len(signals) > handled:
                    handled = len(signals)
                    self._drain_router(signals[-1])
                if self.workers is not None:
                    self.workers.kill_fenced()
                if self.zygote is not None:
                    self.zygote.ready()  # a restarted one's word, taken as soon as it comes
                if self.zygote is not None and time.monotonic() >= self._next_reap:
                    self._next_reap = time.monotonic() + ORPHAN_REAP_S
                    reap_orphans({c.proc.pid for c in self.children})
                if self.phase is Phase.SERVING and self.workers is not None:
                    for fresh in self.workers.respawn_due() + self._requested():
                        pidfds[os.pidfd_open(fresh.proc.pid)] = fresh
                due = self.workers.next_respawn() if self.workers is not None else None
                soonest = due if due is not None else time.monotonic() + 0.5
                timeout = max(0.0, min(0.5, soonest - time.monotonic()))
                for fd in wait_sentinels([*pidfds, wake_r], timeout=timeout):
                    if fd == wake_r:
                        with contextlib.suppress(BlockingIOError):
                            os.read(wake_r, 64)
                        continue
                    c = pidfds.pop(fd)  # type: ignore[call-overload]
                    os.close(fd)  # type: ignore[arg-type]
                    c.proc.wait()
                    self.children.remove(c)
                    fresh = self._exited(c)
                    if fresh is not None:
                        pidfds[os.pidfd_open(fresh.proc.pid)] = fresh
            return 0
        finally:
            signal.set_wakeup_fd(before)
            for fd in (*pidfds, wake_r, wake_w):
                os.close(fd)

    def _drain_router(self, signum: int) -> None:
        """Tell the router to stop: it refuses new requests and finishes those in flight. Told again
        (a second Ctrl-C), it ends them now. Workers and pools keep being supervised meanwhile."""
        timeout = self.cfg.server.shutdown_timeout
        if self.phase is Phase.SERVING:
            self.phase = Phase.DRAINING
            if self.workers is not None:
                self.workers.cancel_respawns()
            log.info("%s: stopping; requests in flight get %.0fs to finish", signal.Signals(signum).name, timeout)
        for c in self.children:
            if c.spec.kind is not ChildKind.ROUTER:
                continue
            if c.stopping_since is None:
                c.terminate()
            elif c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)  # its second: end what is left now

    def _router_drained(self) -> bool:
        """No router left, or the one left had its time (`stop` kills it)."""
        limit = self.cfg.server.shutdown_timeout + ROUTER_STOP_GRACE_S
        return not any(
            c.stopping_since is None or time.monotonic() < c.stopping_since + limit
            for c in self.children
            if c.spec.kind is ChildKind.ROUTER
        )

    def _exited(self, c: Child) -> Child | None:
        """Act on a child's exit as its spec says; return the child started in its place now, if any."""
        action = c.spec.on_exit
        if action is OnExit.RESTART_ROUTER and self.phase is not Phase.SERVING:
            if c.proc.returncode != 0:  # it had streams open, which are gone
                log.warning("router (pid %d) exited with code %s while stopping", c.proc.pid, c.proc.returncode)
            return None
        if action is OnExit.REPLACE:
            assert self.workers is not None
            self.workers.died(c, replace=self.phase is Phase.SERVING)  # (a standby replaces it later)
            return None
        if action is OnExit.RESTART_ROUTER:
            return self._router_died(c)
        if action is OnExit.RESTART_ZYGOTE:
            return self._zygote_died(c)
        # A pool: the arena and ledger outlive the daemon; a new one re-attaches both and the workers,
        # which retry their pool requests, carry on.
        log.error("%s (pid %d) exited with code %s; restarting it", c.name, c.proc.pid, c.proc.returncode)
        self.pool_restarts += 1
        return self._spawn(c.spec)

    def stop(self) -> None:
        """Stop every child, in the order they need each other: the router (which finishes its requests
        first), the workers (which release their leases through their pools), the pools; then remove
        this launcher's files."""
        self.phase = Phase.STOPPING
        if self.zygote is not None:
            self.zygote.close()  # (it exits when its socket closes; SIGTERM below otherwise)
        router_s = self.cfg.server.shutdown_timeout + ROUTER_STOP_GRACE_S
        for kind, limit in (
            (ChildKind.ROUTER, router_s),
            (ChildKind.ZYGOTE, WORKER_STOP_S),
            (ChildKind.WORKER, WORKER_STOP_S),
            (ChildKind.POOL, POOL_STOP_S),
        ):
            stopped = [c for c in self.children if c.spec.kind is kind]
            stop_all(stopped, limit)
            if kind is ChildKind.WORKER and self.cluster is not None:
                # A node leaves once its workers have (their leases released), saying how each ended.
                for c in stopped if self.cluster.membership is not None else ():
                    self._notify(WorkerDied(c.spec.worker_id, c.proc.pid, c.proc.returncode or 0))
                self.cluster.close()
        for path in self.shared_files:
            Path(path).unlink(missing_ok=True)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        if self.run_folder is not None:
            self.run_folder.release()
        if self.arena_folder is not None:
            self.arena_folder.release()  # every arena file of this launcher is in it
