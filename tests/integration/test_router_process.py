"""The router process never imports torch (ARCHITECTURE.md §10): it starts fast, stays small, and a
change that drags the model code into it fails here."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from steadfast.config import Config, cpu_only_torch

pytestmark = pytest.mark.integration


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_router_process_does_not_load_torch(tmp_path: Path):
    port = _free_port()
    cfg = Config().replace(server={"port": port})
    tag = uuid.uuid4().hex[:8]
    # No worker answers at these addresses: the router serves anyway (503 until one is ready).
    argv = [sys.executable, "-m", "steadfast.control.main", "--config-json", json.dumps(cfg.to_dict())]
    argv += ["--output", f"ipc://{tmp_path}/out-{tag}", "--worker", f"0=ipc://{tmp_path}/w0-{tag}"]
    proc = subprocess.Popen(argv)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, "the router exited"
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the router never answered"
                time.sleep(0.2)
        assert health.status_code == 503  # serving, and honest that no worker is ready
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        assert "libtorch" not in maps and "libc10" not in maps
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    # The same import graph in a fresh interpreter, checked by name.
    probe = "import sys, steadfast.control.main; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout == "False\n"


def test_the_launcher_does_not_import_torch():
    """The supervisor outlives every other process and only starts, watches and fences them, so its
    modules must not pull torch in (a worker's private arena is made without mapping it: the worker maps
    it), and with a CPU-only torch it knows `model.device: auto` is the CPU without asking torch."""
    probe = "import sys, steadfast.ops.cli, steadfast.ops.supervisor.launcher; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout == "False\n"
    # Nor the kvpool daemon on the CPU (it makes and reserves its arena's pages, never maps them).
    probe = "import sys, steadfast.kv.pool.daemon; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout == "False\n"

    if cpu_only_torch():
        probe = "import sys, steadfast.config as c; print(c.ModelConfig().resolved_device, 'torch' in sys.modules)"
        got = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
        assert got == "cpu False\n"
