"""`steadfast serve` and its arena folder: one that cannot hold the arena is a clear error within seconds,
not a SIGBUS once the arena fills (the sparse file of old mapped fine on any filesystem); one left by a
launcher killed with SIGKILL is removed by the next start."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import wait_until
from tests.integration.server import ServerProcess, free_port

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


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (pools, workers, router), read from /proc."""
    parent_of = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parent_of[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    below, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parent_of.items() if parent in frontier} - below
        below |= frontier
    return below


def alive(pid: int) -> bool:
    """Running, not merely a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def run_dir_of(pids: set[int]) -> Path | None:
    """The launcher's run folder (sockets, ledger), from the `--output ipc://<run dir>/outputs` its
    children were started with."""
    for pid in pids:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if "--output" in argv:
            return Path(argv[argv.index("--output") + 1].removeprefix("ipc://")).parent
    return None


def test_the_next_serve_removes_the_arena_folder_of_a_launcher_killed_with_sigkill(tmp_path, small_model_path):
    folder = tmp_path / "arenas"
    # On the CPU even where a GPU exists: there the arenas would be device memory, not files in the folder.
    config = (
        f"model: {{device: cpu}}\ncache: {{arena_dir: {folder}, kv_memory_mb: 32}}\nserver: {{standby_workers: 0}}\n"
    )
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    first = ServerProcess(tmp_path / "first", config, model=small_model_path)
    try:
        first.wait_ready()
        (stale,) = os.listdir(folder)
        assert stale.startswith(f"steadfast-{os.geteuid()}-{first.proc.pid}-")
        assert os.listdir(folder / stale)  # the kvpool's arena file
        children = descendants(first.proc.pid)
        assert len(children) >= 3  # its kvpool, worker and router
        run_dir = run_dir_of(children)
        os.kill(first.proc.pid, signal.SIGKILL)  # the launcher only: no handler runs, nothing is cleaned
        assert first.proc.wait(timeout=10) == -signal.SIGKILL
        # Its children follow it through PR_SET_PDEATHSIG; none may hold the arena when the next one starts.
        wait_until(lambda: not any(alive(pid) for pid in children), 30, "the killed launcher's children to exit")
    finally:
        first.stop()
        with contextlib.suppress(ProcessLookupError):  # a child that outlived the wait must not serve on
            os.killpg(first.proc.pid, signal.SIGKILL)
    assert os.listdir(folder) == [stale]  # the fault really left the folder behind
    assert run_dir is not None and run_dir.is_dir()  # and its run folder (sockets, ledger) in the temp dir

    second = ServerProcess(tmp_path / "second", config, model=small_model_path)
    try:
        # The sweep is the launcher's first act: no need to wait for its workers (stopped mid-start-up).
        ours = f"steadfast-{os.geteuid()}-{second.proc.pid}-"
        wait_until(lambda: "left by a launcher that is gone" in second.output(), 60, "the stale folder's removal")
        wait_until(lambda: [f for f in os.listdir(folder) if f.startswith(ours)], 60, "the second's own folder")
        (mine,) = os.listdir(folder)
        assert mine.startswith(ours)
        assert not run_dir.exists()  # swept at the start too
    finally:
        second.stop()
    assert os.listdir(folder) == []
