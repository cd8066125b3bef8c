"""A real `steadfast serve` process on a free port, for tests that go through HTTP."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(
        self, tmp: Path, config_yaml: str = "", extra_args: tuple[str, ...] = (), code_dir: str = "", model: str = ""
    ) -> None:
        """`code_dir`: serve the Steadfast checkout there instead of this one (benchmarks: before vs after).
        `model`: a GGUF to serve instead of the default (`--model`), e.g. the tests' small model."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = tmp / "server.yaml"
        cfg.write_text(config_yaml or "cache: {kv_memory_mb: 256}\n")
        self.log = open(tmp / "server.log", "w+b")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "steadfast.ops.cli",
                "serve",
                "--port",
                str(self.port),
                "--config",
                str(cfg),
                *(("--model", model) if model else ()),
                *extra_args,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            # The checkout first on the path: its `steadfast` package wins over the installed one.
            env=dict(os.environ, PYTHONPATH=code_dir) if code_dir else None,
            cwd=code_dir or None,
        )

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"server not ready in {timeout}s:\n{self.output()}")

    def pool_addresses(self) -> list[str]:
        """The kvpool daemons' sockets (one per node), in the launcher's run directory."""
        runs = Path(tempfile.gettempdir()).glob(f"steadfast-{os.geteuid()}-{self.proc.pid}-*")
        return sorted(f"ipc://{p}" for run in runs for p in run.glob("kvpool*") if stat.S_ISSOCK(p.stat().st_mode))

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


@contextmanager
def serving(tmp: Path, config_yaml: str = "", model: str = "") -> Iterator[ServerProcess]:
    """A ready server for the `with` block (a module fixture's body), stopped after it."""
    server = ServerProcess(tmp, config_yaml, model=model)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()
