"""`steadfast serve`: start the kvpool daemon, the workers and the router; wait until healthy; watch.

The kvpool daemon creates the node's KV arena and ledger, so that memory belongs to no engine process
(with `external_ledger: false`, the launcher makes one private arena per worker instead). Nothing is
reported as serving before /health says every worker is ready.
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

from steadfast.config import Config
from steadfast.kv.arena import ArenaSpec, KVArena
from steadfast.model.gguf_loader import open_gguf, read_config
from steadfast.worker.engine import arena_spec

log = logging.getLogger("steadfast.launcher")


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
            where = ["--pool", self.pool_address]
        else:
            memory = None
        inputs = []
        on_device = cfg.model.resolved_device != "cpu"
        for i in range(cfg.server.workers):
            if memory is None and on_device:
                where = ["--device-arena"]  # device memory cannot be made here and handed over
            elif memory is None:
                arena = KVArena.create(str(Path(cfg.cache.arena_dir) / f"{tag}-w{i}.kv"), spec)
                self.arenas.append(arena)
                where = ["--arena", arena.path]
            address = f"ipc://{self.run_dir}/worker{i}"
            inputs.append(address)
            self._spawn(
                f"worker{i}",
                [
                    "steadfast.worker.main",
                    "--config-json",
                    cfg_json,
                    "--worker-id",
                    str(i),
                    "--input",
                    address,
                    "--output",
                    output,
                    *where,
                ],
            )
        router_args = ["steadfast.control.main", "--config-json", cfg_json, "--output", output]
        for address in inputs:
            router_args += ["--worker", address]
        self._spawn("router", router_args)
        log.info(
            "KV arena: %d blocks x %d tokens (%.0f MiB)%s",
            spec.num_blocks,
            spec.block_size,
            spec.nbytes / 2**20,
            " shared by the workers" if memory else " per worker",
        )
        self._wait_healthy()

    @property
    def pool_address(self) -> str:
        return f"ipc://{self.run_dir}/kvpool"

    def _start_pool(self, cfg_json: str, spec: ArenaSpec, arena_path: str) -> str:
        ledger = self.cfg.fault_recovery.kv_cache.ledger_path or str(self.run_dir / "ledger.db")
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
                for fd in wait_sentinels(list(pidfds), timeout=0.5):
                    c = pidfds.pop(fd)  # type: ignore[call-overload]
                    os.close(fd)  # type: ignore[arg-type]
                    c.proc.wait()
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
