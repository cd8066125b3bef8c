"""Ledger operation latency, SQLite (WAL, one file) against etcd (a 3-member cluster on loopback), in
one run with the rounds interleaved: what a worker's ledger calls cost on each store.

Both stores keep their data on the same disk (the temp dir; SQLite with synchronous=NORMAL, etcd with
its fsync per commit); the etcd members are three processes on this host, so a call crosses loopback
HTTP to one member and Raft to the two others, without a network's latency between hosts.

    python benchmarks/bench_ledger.py --rounds 3 --calls 200
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import run_info  # noqa: E402
from steadfast.kv.ledger.interface import Ledger, RequestCheckpoint  # noqa: E402
from steadfast.kv.ledger.open import open_ledger, sqlite_url  # noqa: E402
from tests.etcd_cluster import EtcdCluster  # noqa: E402

BLOCKS = 4096  # the default model's arena at 512 MB holds about this many 16-token blocks


def operations(ledger: Ledger, worker: str, batch: int) -> dict[str, Callable[[], object]]:
    """One call of each kind a worker makes, on a ledger with a live lease for `worker`."""
    epoch = ledger.acquire_lease(worker, 1, 60).epoch
    held = ledger.grant(worker, epoch, batch)
    state = {"n": 0}
    records = [
        RequestCheckpoint(f"{worker}-r{i}", list(range(300)), '{"seed": 1}', list(range(100)), 100, "decode", held[:8])
        for i in range(batch)
    ]

    def seal_unseal() -> None:  # a block fills (seal), a cached one is refilled (unseal): a decode step's writes
        state["n"] += 1
        block = held[state["n"] % len(held)]
        ledger.seal(worker, epoch, [(block, b"h" * 16, b"n" * 16)])
        ledger.unseal(worker, epoch, [block])

    def grant_free() -> None:
        ledger.free(worker, epoch, ledger.grant(worker, epoch, 64))  # a pool's grant batch

    return {
        "renew lease": lambda: ledger.renew_lease(worker, epoch, 60),
        "authorize write": lambda: ledger.authorize_write(worker, epoch, held[0]),
        "seal + unseal": seal_unseal,
        f"checkpoint {batch} requests": lambda: ledger.checkpoint(worker, epoch, records),
        "grant 64 + free": grant_free,
        "read a lease": lambda: ledger.lease(worker),
        f"read {BLOCKS} blocks": ledger.blocks,
    }


def time_calls(fn: Callable[[], object], calls: int) -> list[float]:
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        out.append(1000 * (time.perf_counter() - t0))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=200, help="calls of each operation per round (reads: a tenth)")
    p.add_argument("--batch", type=int, default=16, help="requests per checkpoint (a worker's running batch)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "ledger_ops.json"))
    args = p.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="bench-ledger-"))
    (tmp / "etcd").mkdir()
    cluster = EtcdCluster(tmp / "etcd").start()
    stores = {"sqlite": sqlite_url(tmp / "ledger.db"), "etcd": cluster.ledger_url("/bench")}
    ledgers = {name: open_ledger(url) for name, url in stores.items()}
    samples: dict[str, dict[str, list[float]]] = {name: {} for name in stores}
    try:
        ops = {}
        for name, ledger in ledgers.items():
            ledger.format(BLOCKS)
            ops[name] = operations(ledger, "w0", args.batch)
        for r in range(args.rounds):
            for name in stores:  # interleaved: both stores see the same machine, round by round
                for op, fn in ops[name].items():
                    calls = args.calls // 10 if op.startswith("read") else args.calls
                    samples[name].setdefault(op, []).extend(time_calls(fn, calls))
            print(f"round {r + 1} done", flush=True)
    finally:
        for ledger in ledgers.values():
            ledger.close()
        cluster.stop()

    lines = ["| operation | SQLite p50 / p99 ms | etcd p50 / p99 ms | etcd ÷ SQLite (p50) |", "|---|---|---|---|"]
    summary = {}
    for op in samples["sqlite"]:
        row = {}
        for name in stores:
            xs = sorted(samples[name][op])
            row[name] = (statistics.median(xs), xs[min(len(xs) - 1, int(0.99 * len(xs)))])
        summary[op] = row
        s, e = row["sqlite"], row["etcd"]
        lines.append(f"| {op} | {s[0]:.2f} / {s[1]:.2f} | {e[0]:.2f} / {e[1]:.2f} | {e[0] / s[0]:.1f}x |")
    table = "\n".join(lines)
    print(table)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({**run_info(args), "p50_p99_ms": summary}, indent=2))


if __name__ == "__main__":
    main()
