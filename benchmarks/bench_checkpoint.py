"""Cost of the external ledger: decode throughput with request checkpoints every 1, 16, 128 steps,
with the ledger but no checkpoints, and with no ledger at all — interleaved rounds in one run; with
`--stores sqlite etcd`, each ledger mode on both stores (etcd: a 3-member cluster on loopback).

The engine runs in-process against a real ledger and a kvpool (also in-process, so the measurement is
the ledger work, not IPC noise): seals with content hashes of full blocks, unseals on prefix-cache
eviction, lease checks, and checkpoints of every running request in one transaction.

    python benchmarks/bench_checkpoint.py --batch 16 --max-tokens 96 --rounds 3 [--stores sqlite etcd]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import run_info  # noqa: E402
from steadfast.config import Config  # noqa: E402
from steadfast.kv.arena.arena import KVArena  # noqa: E402
from steadfast.kv.arena.spec import arena_spec  # noqa: E402
from steadfast.kv.ledger.open import sqlite_url  # noqa: E402
from steadfast.kv.pool.daemon import KVPool  # noqa: E402
from steadfast.wire.pool import PoolGrant, PoolRegister, PoolRelease  # noqa: E402
from steadfast.wire.worker import AddRequest, SamplingParams  # noqa: E402
from steadfast.worker.engine import Engine  # noqa: E402
from steadfast.worker.kv.ledger_sync import LedgerSync  # noqa: E402
from steadfast.worker.loaded import load_model  # noqa: E402
from tests.etcd_cluster import EtcdCluster  # noqa: E402

OFF = "no ledger"
SEALS_ONLY = "ledger, no checkpoints"


@dataclass
class LocalPool:
    """The worker side of the pool protocol, calling an in-process KVPool."""

    pool: KVPool
    worker: str
    epoch: int = 0

    def register(self) -> None:
        self.epoch = self.pool.handle(PoolRegister(self.worker, os.getpid())).epoch

    def grant(self, count: int) -> list[int]:
        return self.pool.handle(PoolGrant(self.worker, self.epoch, count)).block_ids

    def release(self, block_ids: list[int]) -> None:
        self.pool.handle(PoolRelease(self.worker, self.epoch, block_ids))


def run(
    mode: str, cfg: Config, loaded, pool: KVPool, arena: KVArena, n: int, args: argparse.Namespace, prompts
) -> dict:
    interval = {SEALS_ONLY: 10**9, OFF: 1}.get(mode, mode)
    cfg = cfg.replace(fault_recovery={"kv_cache": {"snapshot_interval_steps": int(interval)}})
    if mode == OFF:
        engine = Engine(cfg, loaded, arena)
        sync = None
    else:
        client = LocalPool(pool, f"bench{n}")
        client.register()
        sync = LedgerSync(cfg, client, pool.ledger_url, arena)
        engine = Engine(cfg, loaded, arena, source=client, sync=sync)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(AddRequest(f"r{n}-{i}", ids, params))
    engine.step()  # prefill all
    t0, c0 = time.perf_counter(), time.process_time()
    tokens = 0
    while engine.has_work:
        tokens += sum(len(o.token_ids) for o in engine.step())
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    # CPU time per token is steadier than wall time on a shared machine (it leaves out stolen time).
    out = {"mode": str(mode), "tok_s": tokens / wall, "cpu_ms_per_token": 1000 * cpu / tokens, "steps": engine.steps}
    if sync is not None:
        out.update(
            checkpoints=sync.checkpoints,
            checkpoint_ms=1000 * sync.checkpoint_seconds / max(1, sync.checkpoints),
            seal_ms_per_step=1000 * sync.seal_seconds / engine.steps,
        )
        sync.close()
        # Give the blocks back so the next round starts from the same pool.
        client.release(engine.blocks.held_blocks)
        pool.ledger.release_lease(client.worker, client.epoch)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--stores", nargs="+", default=["sqlite"], choices=["sqlite", "etcd"])
    p.add_argument("--modes", nargs="+", default=["seals", "128", "16", "1"], help="ledger modes: seals or an interval")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "checkpoint.json"))
    args = p.parse_args()

    # kv_ahead_mb 0: the arena reserved whole at start, so mapping it here touches only reserved pages.
    cfg = Config().replace(
        model={"dtype": args.dtype}, cache={"kv_memory_mb": 512, "enable_prefix_caching": False, "kv_ahead_mb": 0}
    )
    loaded = load_model(cfg)
    tmp = Path(tempfile.mkdtemp(prefix="bench-ckpt-"))
    spec = arena_spec(cfg, loaded.model_cfg)
    cluster = None
    urls = {"sqlite": sqlite_url(tmp / "ledger.db")}
    if "etcd" in args.stores:
        (tmp / "etcd").mkdir()
        cluster = EtcdCluster(tmp / "etcd").start()
        urls["etcd"] = cluster.ledger_url("/bench-checkpoint")
    pools = {
        store: KVPool(cfg, f"/dev/shm/steadfast-bench-ckpt-{os.getpid()}-{store}.kv", urls[store], spec)
        for store in args.stores
    }
    arenas = {store: KVArena.attach(pool.arena_path) for store, pool in pools.items()}  # a worker's mapping
    tok = loaded.tokenizer
    prompts = [
        tok.encode_chat([{"role": "user", "content": f"Write a story about a robot, part {i}."}])
        for i in range(args.batch)
    ]
    ledger_modes = [SEALS_ONLY if m == "seals" else int(m) for m in args.modes]
    modes = [(args.stores[0], OFF)] + [(store, m) for store in args.stores for m in ledger_modes]
    multi = len(args.stores) > 1

    def label(store: str, mode: object) -> str:
        return f"{store}: {mode}" if multi and mode not in (OFF, str(OFF)) else str(mode)

    results: dict[str, list[dict]] = {label(*m): [] for m in modes}
    n = 0
    try:
        for _ in range(args.rounds):
            for store, mode in modes:
                n += 1
                r = run(mode, cfg, loaded, pools[store], arenas[store], n, args, prompts)
                results[label(store, mode)].append(r)
                print(label(store, mode), r, flush=True)
    finally:
        for store, pool in pools.items():
            pool.close()
            arenas[store].unlink()
        if cluster is not None:
            cluster.stop()
    base = statistics.median(r["tok_s"] for r in results[OFF])
    step_ms = statistics.median(1000 * args.batch / r["tok_s"] for r in results[OFF])
    lines = [
        "| checkpointing | decode tok/s (median) | vs no ledger | checkpoint txn | seal work per step | "
        "ledger work per step (share of a step) |",
        "|---|---|---|---|---|---|",
    ]
    for store, mode in modes:
        rs = results[label(store, mode)]
        tok_s = statistics.median(r["tok_s"] for r in rs)
        ck = statistics.median(r.get("checkpoint_ms", 0.0) for r in rs)
        seal = statistics.median(r.get("seal_ms_per_step", 0.0) for r in rs)
        per_step = seal + (ck / mode if isinstance(mode, int) else 0.0)
        name = f"every {mode} steps" if isinstance(mode, int) else mode
        lines.append(
            f"| {label(store, name)} | {tok_s:.1f} | {100 * (tok_s / base - 1):+.1f} % | {ck:.2f} ms | {seal:.3f} ms | "
            f"{per_step:.3f} ms ({100 * per_step / step_ms:.2f} %) |"
        )
    table = "\n".join(lines)
    print(table)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({**run_info(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
