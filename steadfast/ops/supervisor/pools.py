"""A node's kvpool daemon started: where its arena, ledger and offload tier live, and the wait for it to
say it is ready."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from steadfast.config import Config
from steadfast.kv.arena.spec import ArenaSpec
from steadfast.kv.ledger.open import sibling_ledger_url, sqlite_url
from steadfast.ops.supervisor.children import Child, ChildSpec, PoolNode, pool_spec

POOL_READY_S = 30.0


class PoolStartError(RuntimeError):
    pass


def tier_path(cfg: Config, run_dir: Path, suffix: str, arena_path: str, shared_files: list[str]) -> str:
    """The node's offload tier file: beside its arena (host, in the launcher's arena folder), or in
    `cache.offload_dir` (disk; the run folder when unset), added to `shared_files` (removed at stop)."""
    c = cfg.cache
    if c.offload_tier == "none":
        return ""
    if c.offload_tier == "host":
        return arena_path + ".tier"
    path = str(Path(c.offload_dir or run_dir) / f"kvpool{suffix}-{os.getpid()}.tier")
    shared_files += [path, path + ".json"]
    return path


def start_pool(
    cfg: Config,
    index: int,
    cfg_json: str,
    spec: ArenaSpec,
    run_dir: Path,
    arena_dir: str,
    shared_files: list[str],
    spawn: Callable[[ChildSpec], Child],
) -> PoolNode:
    """Pool `index` (0: this node; 1: the decode node of `decode_node: separate`) started with `spawn`,
    once its ready file exists; its files that the launcher removes at stop are added to `shared_files`."""
    configured = cfg.fault_recovery.kv_cache.resolved_ledger_url
    suffix = "" if index == 0 else f"-node{index}"
    arena_path = os.path.join(arena_dir, f"kvpool{suffix}.kv")
    if configured:
        ledger = sibling_ledger_url(configured, suffix)
    else:
        path = str(run_dir / f"ledger{suffix}.db")
        ledger = sqlite_url(path)
        shared_files += [path, path + "-wal", path + "-shm"]
    address = f"ipc://{run_dir}/kvpool{suffix}"
    ready = run_dir / f"kvpool{suffix}.ready"
    child = pool_spec(
        cfg_json,
        index,
        address,
        arena_path,
        ledger,
        spec,
        str(ready),
        cfg.model.resolved_device,
        tier_path(cfg, run_dir, suffix, arena_path, shared_files),
    )
    node = PoolNode(index, address, ledger, child)
    started = spawn(child)
    deadline = time.monotonic() + POOL_READY_S
    while not ready.exists():
        if started.proc.poll() is not None or time.monotonic() > deadline:
            raise PoolStartError(f"the {node.name} daemon did not start")
        time.sleep(0.05)
    return node
