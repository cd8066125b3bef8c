"""The KV arena in device memory: owned by one process, mapped by others through CUDA IPC handles.

Skipped without a CUDA device (CI has none); run on a GPU machine as README.md's "GPU checks" say.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import msgspec
import pytest
import torch

from steadfast.config import Config
from steadfast.kv.arena.arena import ArenaSpec, KVArena, map_arena
from steadfast.kv.ledger.interface import LeaseState
from steadfast.kv.ledger.open import open_ledger, sqlite_url
from steadfast.kv.pool.client import LeaseLostError, PoolClient

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SPEC = ArenaSpec(num_blocks=32, num_layers=3, block_size=16, num_kv_heads=2, head_dim=8, dtype="bfloat16")

CHILD = """
import sys, msgspec, torch
from steadfast.kv.arena.arena import KVArena
from steadfast.wire.worker import CudaIpcHandle
a = KVArena.attach_ipc(msgspec.msgpack.decode(sys.stdin.buffer.read(), type=CudaIpcHandle))
k, v = a.layer(2)
print(a.device.type, k[:, 6, 3].float().flatten().tolist())
print(a.digest(6).hex())
v[1, 1, 15] = -7.5
torch.cuda.synchronize()
"""


def test_second_process_maps_the_device_arena_without_a_copy():
    arena = KVArena.create_device(SPEC, "cuda")
    assert arena.path == "" and arena.device.type == "cuda"
    k, _ = arena.layer(2)
    k[:, 6, 3] = torch.arange(16, dtype=torch.bfloat16, device="cuda").view(2, 8)
    torch.cuda.synchronize()
    handle = msgspec.msgpack.encode(arena.export_ipc())  # what travels: msgpack, no pickle
    out = subprocess.run([sys.executable, "-c", CHILD], input=handle, capture_output=True)
    assert out.returncode == 0, out.stderr.decode()
    lines = out.stdout.decode().strip().splitlines()
    assert lines[0] == "cuda " + str([float(i) for i in range(16)])
    assert lines[1] == arena.digest(6).hex()
    # The child's write landed in this process's memory: one allocation, two mappings.
    assert arena.layer(2)[1][1, 1, 15].tolist() == [-7.5] * 8


def test_a_handle_for_a_larger_arena_is_refused():
    arena = KVArena.create_device(SPEC, "cuda")
    h = arena.export_ipc()
    bigger = ArenaSpec(**{**asdict(SPEC), "num_blocks": SPEC.num_blocks * 1000})
    forged = msgspec.structs.replace(h, spec_json=json.dumps(asdict(bigger)))
    with pytest.raises(ValueError, match="cannot hold"):
        KVArena.attach_ipc(forged)


WRITER = """
import os, sys, time, torch
from steadfast.kv.arena.arena import map_arena
from steadfast.kv.pool.client import PoolClient
pool = PoolClient(sys.argv[1], "writer")
arena = map_arena(pool.register(os.getpid()))
block = pool.grant(4)[0]
arena.tensor[:, :, :, block] = 3.25
torch.cuda.synchronize()
print(block, arena.digest(block).hex(), flush=True)
time.sleep(600)
"""


class DevicePool:
    """A kvpool daemon holding its arena in device memory."""

    def __init__(self, tmp: Path, lease_timeout_ms: int) -> None:
        self.tmp = tmp
        self.address = f"ipc://{tmp}/kvpool"
        self.ledger_url = sqlite_url(tmp / "ledger.db")
        lease = {"renew_interval_ms": lease_timeout_ms // 4, "lease_timeout_ms": lease_timeout_ms}
        cfg = Config().replace(fault_recovery={"lease": lease})
        self.args = [
            sys.executable,
            "-m",
            "steadfast.kv.pool.daemon",
            "--config-json",
            json.dumps(cfg.to_dict()),
            "--address",
            self.address,
            "--arena",
            str(tmp / "unused.kv"),
            "--ledger",
            self.ledger_url,
            "--spec-json",
            json.dumps(asdict(SPEC)),
            "--ready-file",
            str(tmp / "ready"),
            "--device",
            "cuda",
        ]
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        (self.tmp / "ready").unlink(missing_ok=True)
        self.proc = subprocess.Popen(self.args)
        deadline = time.monotonic() + 60
        while not (self.tmp / "ready").exists():
            assert self.proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()


def test_pool_owned_device_arena_outlives_a_killed_engine(tmp_path):
    pool = DevicePool(tmp_path, lease_timeout_ms=600)  # the writer renews nothing: fenced soon after
    pool.start()
    writer = subprocess.Popen([sys.executable, "-c", WRITER, pool.address], stdout=subprocess.PIPE, text=True)
    try:
        block, digest = writer.stdout.readline().split()
        block = int(block)
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait()
        assert writer.returncode == -signal.SIGKILL
        # A third process (a standby, an inspector) maps the same device memory: the bytes are there.
        arena = map_arena(PoolClient(pool.address, "inspector").attach(os.getpid()))
        assert arena.device.type == "cuda" and not (Path(tmp_path) / "unused.kv").exists()
        assert arena.digest(block).hex() == digest
        assert bool((arena.tensor[:, :, :, block] == 3.25).all())
        # The pool noticed the writer is gone: its lease is fenced and its blocks reclaimed.
        ledger = open_ledger(pool.ledger_url)
        deadline = time.monotonic() + 10
        while ledger.lease("writer").state == LeaseState.ACTIVE and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ledger.lease("writer").state != LeaseState.ACTIVE
        assert ledger.check_integrity() == []
    finally:
        if writer.poll() is None:
            writer.kill()
        pool.kill()


def test_a_restarted_pool_fences_everyone_its_old_device_arena_served(tmp_path):
    pool = DevicePool(tmp_path, lease_timeout_ms=30_000)
    pool.start()
    client = PoolClient(pool.address, "engine", timeout_s=1.0)
    map_arena(client.register(os.getpid()))
    held = client.grant(8)
    assert len(held) == 8
    pool.kill()  # device memory dies with its owner
    pool.start()
    ledger = open_ledger(pool.ledger_url)
    assert ledger.lease("engine").state == LeaseState.FENCED
    assert all(b.owner is None for b in ledger.blocks())
    with pytest.raises(LeaseLostError):
        client.grant(1)  # the old epoch can no longer do anything
    fresh = map_arena(PoolClient(pool.address, "engine2").register(os.getpid()))
    assert not bool(fresh.tensor.any())  # a new, zeroed arena
    pool.kill()
