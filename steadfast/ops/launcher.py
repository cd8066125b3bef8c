"""`steadfast serve`: start the kvpool daemon, the workers, hot standbys and the router; wait until
healthy; supervise.

The kvpool daemon creates the node's KV arena and ledger, so that memory belongs to no engine process
(with `external_ledger: false`, the launcher makes one private arena per worker instead). Nothing is
reported as serving before /health says every worker is ready. Each child is watched through a pidfd,
so a death is seen the instant it happens: a dead worker is reaped (its pid is then surely gone),
fenced through the pool, announced to the router, which moves its requests to a standby, and a new
standby is started in the background. A dead kvpool is restarted; it re-attaches arena and ledger.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import wait as wait_sentinels
from pathlib import Path

import httpx
import zmq

from steadfast import protocol
from steadfast.config import Config
from steadfast.kv.arena import ArenaSpec, KVArena
from steadfast.kv.ledger import LeaseState
from steadfast.kv.pool_client import PoolClient
from steadfast.kv.sqlite_ledger import SqliteLedger
from steadfast.model.gguf_loader import open_gguf, read_config
from steadfast.protocol import WorkerDied, WorkerJoined
from steadfast.worker.engine import arena_spec

log = logging.getLogger("steadfast.launcher")


STANDBY_RESPAWN_DELAY_S = 2.0


class StartupError(RuntimeError):
    pass


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]


@dataclass
class Launcher:
    cfg: Config
    run_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="steadfast-")))
    children: list[Child] = field(default_factory=list)
    arenas: list[KVArena] = field(default_factory=list)
    shared_files: list[str] = field(default_factory=list)
    pool_args: list[str] = field(default_factory=list)
    pool_restarts: int = 0
    ledger_path: str = ""
    next_worker_id: int = 0
    _ledger: SqliteLedger | None = None
    _respawn_at: list[float] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://{self.cfg.server.host}:{self.cfg.server.port}"

    def start(self) -> None:
        cfg = self.cfg
        model_cfg = read_config(open_gguf(cfg.model.resolved_path))
        spec = arena_spec(cfg, model_cfg)
        cfg_json = json.dumps(cfg.to_dict())
        output = f"ipc://{self.run_dir}/outputs"
        tag = f"steadfast-{os.getpid()}-{self.run_dir.name}"
        if cfg.fault_recovery.kv_cache.external_ledger:
            # One arena for the node, owned by the kvpool daemon, which grants blocks to every worker.
            memory = self._start_pool(cfg_json, spec, str(Path(cfg.cache.arena_dir) / f"{tag}.kv"))
        else:
            memory = None
        self._cfg_json, self._output, self._tag, self._spec = cfg_json, output, tag, spec
        self._shared_memory = memory is not None
        srv = cfg.server
        roles = ["mixed"] * srv.workers + ["prefill"] * srv.prefill_workers + ["decode"] * srv.decode_workers
        addresses = [self._spawn_worker(i, role) for i, role in enumerate(roles)]
        standbys = [self._spawn_worker(len(roles) + i, "standby") for i in range(srv.standby_workers)]
        self._spawn("router", self._router_args([*addresses, *standbys], len(addresses)))
        self._notices = zmq.Context.instance().socket(zmq.PUSH)  # supervisor → router: deaths, joins
        self._notices.setsockopt(zmq.LINGER, 0)
        self._notices.connect(output)
        log.info(
            "KV arena: %d blocks x %d tokens (%.0f MiB)%s",
            spec.num_blocks,
            spec.block_size,
            spec.nbytes / 2**20,
            " shared by the workers" if memory else " per worker",
        )
        self._wait_healthy()

    def _router_args(self, addresses: list[str], active: int) -> list[str]:
        """The router's command line: the first `active` addresses take traffic, the rest are standbys.
        A restarted router learns each worker's current role from its first status report."""
        args = ["steadfast.control.main", "--config-json", self._cfg_json, "--output", self._output]
        if self.ledger_path:
            args += ["--ledger", self.ledger_path]
        for i, address in enumerate(addresses):
            args += ["--worker" if i < active else "--standby", address]
        return args

    def _router_died(self, c: Child) -> Child:
        """Restart the router on the workers that live now; clients reconnect with Last-Event-ID."""
        log.error("router (pid %d) exited with code %s; restarting it", c.proc.pid, c.proc.returncode)
        workers = sorted(
            (int(x.name.removeprefix("worker")), f"ipc://{self.run_dir}/{x.name}")
            for x in self.children
            if x.name.startswith("worker") and x.proc.poll() is None
        )
        self._spawn("router", self._router_args([address for _, address in workers], len(workers)))
        return self.children[-1]

    def _spawn_worker(self, worker_id: int, role: str) -> str:
        """Start worker `worker_id` (its lease is named after it); return its input address."""
        if self._shared_memory:
            where = ["--pool", self.pool_address]
        elif self.cfg.model.resolved_device != "cpu":
            where = ["--device-arena"]  # device memory cannot be made here and handed over
        else:
            arena = KVArena.create(str(Path(self.cfg.cache.arena_dir) / f"{self._tag}-w{worker_id}.kv"), self._spec)
            self.arenas.append(arena)
            where = ["--arena", arena.path]
        address = f"ipc://{self.run_dir}/worker{worker_id}"
        self.next_worker_id = max(self.next_worker_id, worker_id + 1)
        self._spawn(
            f"worker{worker_id}",
            [
                "steadfast.worker.main",
                "--config-json",
                self._cfg_json,
                "--worker-id",
                str(worker_id),
                "--input",
                address,
                "--output",
                self._output,
                "--role",
                role,
                *where,
            ],
        )
        return address

    def _kill_fenced(self) -> None:
        """A worker the pool fenced (its lease expired: hung, stopped) can never write again; end it,
        so that its death is certain and its requests can move."""
        if not self.ledger_path:
            return
        if self._ledger is None:
            self._ledger = SqliteLedger(self.ledger_path)
        fenced = {lease.worker for lease in self._ledger.leases() if lease.state == LeaseState.FENCED}
        for c in self.children:
            if c.name in fenced and c.proc.poll() is None:
                log.error("%s (pid %d) was fenced while alive; killing it", c.name, c.proc.pid)
                c.proc.kill()

    def _worker_died(self, c: Child) -> None:
        """Reaped worker: fence it (pid confirmed gone), tell the router; a standby replaces it soon."""
        worker_id = int(c.name.removeprefix("worker"))
        code = c.proc.returncode
        log.error("%s (pid %d) exited with code %s; its requests move to another worker", c.name, c.proc.pid, code)
        if self._shared_memory:
            try:
                kept = PoolClient(self.pool_address, "supervisor", timeout_s=1.0, attempts=3).fence_dead(
                    c.name, c.proc.pid
                )
                log.info("%s fenced; %d sealed blocks kept for adoption", c.name, len(kept))
            except Exception as exc:  # the pool fences on lease expiry anyway; adoption then waits for it
                log.warning("could not fence %s at once: %s", c.name, exc)
        self._notices.send(protocol.encode(WorkerDied(worker_id, c.proc.pid, code if code is not None else -1)))
        # Not at once: loading a model takes both cores for seconds, and the takeover needs them now.
        self._respawn_at.append(time.monotonic() + STANDBY_RESPAWN_DELAY_S)

    def _respawn_due(self) -> list[Child]:
        """Start the standbys whose replacement time has come; return them."""
        started = []
        now = time.monotonic()
        for due in [t for t in self._respawn_at if t <= now]:
            self._respawn_at.remove(due)
            new_id = self.next_worker_id
            address = self._spawn_worker(new_id, "standby")
            self._notices.send(protocol.encode(WorkerJoined(new_id, address, "standby")))
            started.append(self.children[-1])
        return started

    @property
    def pool_address(self) -> str:
        return f"ipc://{self.run_dir}/kvpool"

    def _start_pool(self, cfg_json: str, spec: ArenaSpec, arena_path: str) -> str:
        ledger = self.cfg.fault_recovery.kv_cache.ledger_path or str(self.run_dir / "ledger.db")
        self.ledger_path = ledger
        ready = self.run_dir / "kvpool.ready"
        self.pool_args = [
            "steadfast.kv.pool",
            "--config-json",
            cfg_json,
            "--address",
            self.pool_address,
            "--arena",
            arena_path,
            "--ledger",
            ledger,
            "--spec-json",
            json.dumps(asdict(spec)),
            "--ready-file",
            str(ready),
            "--device",
            self.cfg.model.resolved_device,
        ]
        self.shared_files = [arena_path, arena_path + ".json"]
        if not self.cfg.fault_recovery.kv_cache.ledger_path:
            self.shared_files += [ledger, ledger + "-wal", ledger + "-shm"]
        self._spawn("kvpool", self.pool_args)
        deadline = time.monotonic() + 30
        while not ready.exists():
            if self.children[-1].proc.poll() is not None or time.monotonic() > deadline:
                raise StartupError("the kvpool daemon did not start")
            time.sleep(0.05)
        return arena_path

    def _spawn(self, name: str, args: list[str]) -> None:
        proc = subprocess.Popen([sys.executable, "-m", *args])
        self.children.append(Child(name, proc))

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.cfg.server.startup_timeout_s
        while time.monotonic() < deadline:
            for c in self.children:
                if c.proc.poll() is not None:
                    raise StartupError(f"{c.name} exited with code {c.proc.returncode} during start-up")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise StartupError(f"not healthy within {self.cfg.server.startup_timeout_s:.0f}s")

    def wait(self) -> int:
        """Block until a child dies or we are told to stop; return an exit code."""
        stop = {"signal": 0}

        def on_signal(signum: int, frame: object) -> None:
            stop["signal"] = signum

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        # A pidfd becomes readable the moment its process exits: death is noticed at once, not polled.
        pidfds = {os.pidfd_open(c.proc.pid): c for c in self.children}
        try:
            while not stop["signal"]:
                self._kill_fenced()
                for fresh in self._respawn_due():
                    pidfds[os.pidfd_open(fresh.proc.pid)] = fresh
                timeout = 0.5 if not self._respawn_at else max(0.0, min(0.5, min(self._respawn_at) - time.monotonic()))
                for fd in wait_sentinels(list(pidfds), timeout=timeout):
                    c = pidfds.pop(fd)  # type: ignore[call-overload]
                    os.close(fd)  # type: ignore[arg-type]
                    c.proc.wait()
                    if c.name.startswith("worker") and not stop["signal"]:
                        self.children.remove(c)
                        self._worker_died(c)
                        continue
                    if c.name == "router" and not stop["signal"]:
                        self.children.remove(c)
                        fresh = self._router_died(c)
                        pidfds[os.pidfd_open(fresh.proc.pid)] = fresh
                        continue
                    if c.name == "kvpool":
                        # The arena and ledger outlive the daemon: a new one re-attaches both and the
                        # workers, which retry their pool requests, carry on.
                        log.error("kvpool (pid %d) exited with code %s; restarting it", c.proc.pid, c.proc.returncode)
                        self.children.remove(c)
                        self._spawn("kvpool", self.pool_args)
                        self.pool_restarts += 1
                        pidfds[os.pidfd_open(self.children[-1].proc.pid)] = self.children[-1]
                        continue
                    log.error("%s (pid %d) exited with code %s; shutting down", c.name, c.proc.pid, c.proc.returncode)
                    return 1
            return 0
        finally:
            for fd in pidfds:
                os.close(fd)

    def stop(self) -> None:
        for c in self.children:
            if c.proc.poll() is None:
                c.proc.terminate()
        deadline = time.monotonic() + 10
        for c in self.children:
            try:
                c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()
        for arena in self.arenas:
            arena.unlink()
        for path in self.shared_files:
            Path(path).unlink(missing_ok=True)
        shutil.rmtree(self.run_dir, ignore_errors=True)
