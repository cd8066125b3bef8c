"""`steadfast serve` started by a harness (`steadfast chaos`, the soak) as a child in its own session, its
output in a file, with the KV wire's fault drill file beside it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """`steadfast serve` as a child in its own session, its output in a file."""

    def __init__(self, folder: Path, config: str, model: str, port: int = 0, env: dict[str, str] | None = None) -> None:
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = folder / "server.log"
        # The KV wire's fault drill: its senders read this file at the start of every transfer (empty:
        # no fault); a config's own `transfer.faults_file` wins over it.
        drill = folder / "transfer-faults"
        drill.write_text("")
        self.drill: Path | None = drill
        self.headers: dict[str, str] = {}  # (on loopback: the admin routes want no key)
        cmd = [sys.executable, "-m", "steadfast.ops.cli", "serve", "--port", str(self.port)]
        cmd += ["--config", config] if config else []
        cmd += ["--model", model] if model else []
        env = os.environ | {"STEADFAST_TRANSFER_FAULTS_FILE": str(drill)} | (env or {})
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env
            )  # fmt: skip

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited (code {self.proc.returncode}); see {self.log}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"the server was not ready in {timeout_s:.0f}s; see {self.log}")

    def launchers(self) -> list[int]:
        return [self.proc.pid]

    def faults(self, lease_s: float, seed: int) -> dict:
        return {}  # (one host: the nemesis' own kinds are all it has)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
