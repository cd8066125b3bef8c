"""One node's processes started by hand for fault tests: a kvpool daemon and real workers, with the
test itself acting as the router (it sends requests and reads outputs over the same ZeroMQ wires)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import zmq

from steadfast.config import Config
from steadfast.kv.arena.arena import KVArena, map_arena
from steadfast.kv.arena.spec import arena_spec
from steadfast.kv.ledger.interface import Ledger
from steadfast.kv.ledger.open import open_ledger, sqlite_url
from steadfast.kv.pool.client import PoolClient
from steadfast.model.gguf_meta import open_gguf, read_config
from steadfast.ops.supervisor.children import ArenaSource, pool_spec, worker_spec
from steadfast.wire.codec import encode
from steadfast.wire.worker import AddRequest, RequestOutput, StepOutputs, WorkerRole, WorkerStatus, decode_from_worker


class Node:
    def __init__(self, tmp: Path, cfg: Config, failpoints: str = "", ledger_url: str = "") -> None:
        """`ledger_url`: the node's ledger (default: a SQLite file in `tmp`)."""
        self.tmp = tmp
        self.cfg = cfg
        self.cfg_json = json.dumps(cfg.to_dict())
        self.arena_path = f"/dev/shm/steadfast-chaos-{os.getpid()}-{uuid.uuid4().hex[:8]}.kv"
        self.ledger_path = str(tmp / "ledger.db")  # the file itself, for tests that look inside it
        self.ledger_url = ledger_url or sqlite_url(self.ledger_path)
        self.pool_address = f"ipc://{tmp}/kvpool"
        self.output = f"ipc://{tmp}/outputs"
        self.failpoint_dir = tmp / "failpoints"
        self.failpoint_dir.mkdir(exist_ok=True)
        self.failpoints = failpoints
        self.spec = arena_spec(cfg, read_config(open_gguf(cfg.model.resolved_path)))
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(self.output)
        self.pushes: dict[int, zmq.Socket] = {}
        self.pool: subprocess.Popen | None = None
        self.workers: dict[int, subprocess.Popen] = {}
        self.logs: list = []
        self.received: list[RequestOutput] = []  # every output any call to outputs() saw
        self.origin: dict[tuple[str, int], int] = {}  # (request, output index) -> worker that sent it
        self.status: dict[int, WorkerStatus] = {}  # each worker's ready report

    def _log(self, name: str):
        f = open(self.tmp / f"{name}.log", "ab")  # noqa: SIM115 - closed in stop()
        self.logs.append(f)
        return f

    def log_text(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def start_pool(self) -> subprocess.Popen:
        ready = self.tmp / "kvpool.ready"
        ready.unlink(missing_ok=True)
        spec = pool_spec(
            self.cfg_json,
            0,
            self.pool_address,
            self.arena_path,
            self.ledger_url,
            self.spec,
            str(ready),
            self.cfg.model.resolved_device,
        )
        self.pool = subprocess.Popen(spec.command(), stdout=self._log("kvpool"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert self.pool.poll() is None and time.monotonic() < deadline, self.log_text("kvpool")
            time.sleep(0.05)
        return self.pool

    def start_worker(
        self, worker_id: int = 0, role: WorkerRole = WorkerRole.MIXED, output: str = "", wait: bool = True
    ) -> subprocess.Popen:
        """Start a worker on this node and wait until it is ready (unless not `wait`: workers started
        together load at once; `wait_ready` then); `output`: another node's output address to report to
        (one router for both), whose `wait_status` then sees its status."""
        env = dict(os.environ, STEADFAST_FAILPOINTS=self.failpoints, STEADFAST_FAILPOINT_DIR=str(self.failpoint_dir))
        address = f"ipc://{self.tmp}/worker{worker_id}"
        spec = worker_spec(
            self.cfg_json, worker_id, address, output or self.output, role, ArenaSource(pool=self.pool_address)
        )
        proc = subprocess.Popen(
            spec.command(), stdout=self._log(f"worker{worker_id}"), stderr=subprocess.STDOUT, env=env
        )
        push = self.ctx.socket(zmq.PUSH)
        push.connect(address)
        self.pushes[worker_id] = push
        self.workers[worker_id] = proc
        if not output and wait:
            self.wait_ready(worker_id)
        return proc

    def wait_ready(self, worker_id: int) -> None:
        """Its ready report (reports of others read meanwhile are dropped: each worker reports every
        status interval, its state with it)."""
        self.status[worker_id] = self.wait_status(worker_id, "ready", timeout=120)

    def wait_status(self, worker_id: int, state: str, timeout: float) -> WorkerStatus:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.pull.poll(200):
                msg = decode_from_worker(self.pull.recv())
                if isinstance(msg, WorkerStatus) and msg.worker_id == worker_id and msg.state == state:
                    return msg
            proc = self.workers.get(worker_id)  # (another node's worker reporting here: not ours to watch)
            assert proc is None or proc.poll() is None, self.log_text(f"worker{worker_id}")
        raise AssertionError(f"worker{worker_id} never reported {state}")

    def send(self, worker_id: int, request: AddRequest) -> None:
        self.pushes[worker_id].send(encode(request))

    def outputs(
        self,
        timeout: float,
        until_finished: set[str] | None = None,
        max_tokens: int | None = None,
        max_outputs: int | None = None,
    ):
        """Outputs received within `timeout`, stopping early once `until_finished` all finished, or
        `max_tokens` tokens or `max_outputs` outputs came."""
        got: list[RequestOutput] = []
        done: set[str] = set()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if until_finished is not None and until_finished <= done:
                break
            if max_tokens is not None and sum(len(o.token_ids) for o in got) >= max_tokens:
                break
            if max_outputs is not None and len(got) >= max_outputs:
                break
            if self.pull.poll(100):
                msg = decode_from_worker(self.pull.recv())
                if isinstance(msg, StepOutputs):
                    for o in msg.outputs:
                        self.origin[(o.request_id, o.index)] = msg.worker_id
                    got.extend(msg.outputs)
                    self.received.extend(msg.outputs)
                    done.update(o.request_id for o in msg.outputs if o.finish_reason)
        return got

    def ledger(self) -> Ledger:
        return open_ledger(self.ledger_url)

    def arena(self) -> KVArena:
        """The node's arena as the pool hands it out (a file, or device memory by CUDA IPC handle)."""
        return map_arena(PoolClient(self.pool_address, "inspector").attach(os.getpid()))

    def stop(self) -> None:
        for proc in [*self.workers.values(), self.pool]:
            if proc is not None and proc.poll() is None:
                if proc.returncode is None:
                    os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
                proc.wait()
        self.ctx.destroy(linger=0)
        for f in self.logs:
            f.close()
        for suffix in ("", ".json"):
            Path(self.arena_path + suffix).unlink(missing_ok=True)


def tokens_of(outputs: list[RequestOutput], request_id: str) -> list[int]:
    return [t for o in outputs if o.request_id == request_id for t in o.token_ids]
