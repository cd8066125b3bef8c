"""`steadfast serve` whose arena folder cannot hold the arena: a clear error within seconds, not a
SIGBUS once the arena fills (the sparse file of old mapped fine on any filesystem)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from tests.integration.server import free_port

pytestmark = pytest.mark.integration


def test_serve_refuses_an_arena_larger_than_its_folder_at_once(tmp_path):
    folder = tmp_path / "arenas"
    too_big_mb = 2 * shutil.disk_usage(tmp_path).free // 2**20 + 1024
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"model: {{device: cpu}}\ncache: {{kv_memory_mb: {too_big_mb}, arena_dir: {folder}}}\n")
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "steadfast.ops.cli", "serve", "--config", str(cfg), "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1, out.stderr
    assert time.monotonic() - t0 < 15
    assert "MiB needed" in out.stderr and "MiB free" in out.stderr and str(folder) in out.stderr
    assert "Traceback" not in out.stderr
    assert os.listdir(folder) == []  # its private folder went with it
