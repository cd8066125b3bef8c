"""CPU cost of one KV move on the wire between nodes, in one process: the real `KVSender` and `KVReceiver`
over loopback TCP, without and with the deployment's encryption (CURVE, and what the code under test does
with it), for the steadfast package on the path (a git worktree on PYTHONPATH measures another version).

Each move is a 512-token request of SmolLM2-135M in fp32 (30 layers, 3 KV heads, 64 dims: 23.6 MB), its
every layer gathered out of the source arena at once and committed, as a migration's round and final stage
do. Reported: the process's CPU time per move (all threads: the gather, the sender's and receiver's threads,
libzmq's I/O threads, the idle polling of both), and the wall time. This is what a cross-node migration
takes from the forward passes of the workers on its two ends (`bench_migration.py`'s co-running part).

    python benchmarks/bench_move_cpu.py --moves 20 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from steadfast.kv.arena.arena import ArenaSpec, KVArena
from steadfast.kv.moves.packing import layer_spans, slots_for
from steadfast.kv.moves.receiver import KVReceiver
from steadfast.kv.moves.sender import KVSender
from steadfast.wire.curve import KeyFile, TransferSide, write_deployment_keys

SPEC = ArenaSpec(num_blocks=128, num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype="float32")
TOKENS = 512


class Pool:
    def __init__(self) -> None:
        self.free = list(range(SPEC.num_blocks))

    def grant(self, n: int) -> list[int]:
        got, self.free = self.free[:n], self.free[n:]
        return got

    def release(self, ids: list[int]) -> None:
        self.free.extend(ids)


def run(encrypted: bool, moves: int) -> dict:
    src, dst = KVArena.create_device(SPEC, "cpu"), KVArena.create_device(SPEC, "cpu")
    src.tensor.normal_()
    keys: dict[TransferSide, KeyFile] = {}
    if encrypted:
        paths = write_deployment_keys(Path(tempfile.mkdtemp(prefix="bench-move-keys-")))
        keys = {side: KeyFile.load(p) for side, p in paths.items()}
    pool = Pool()
    rx = KVReceiver(dst, 16, ["tcp://127.0.0.1:0"], pool.grant, pool.release, 5.0, keys=keys.get(TransferSide.RECEIVE))
    tx = KVSender(SPEC.num_layers, 5.0, 3, 0.05, block_size=16, keys=keys.get(TransferSide.SEND))
    slots = slots_for(list(range(40, 40 + TOKENS // 16)), 16, 0, TOKENS)

    def move(i: int) -> None:
        rid = f"r{i}"
        tx.begin(rid, [("primary", rx.addresses[0])], TOKENS)
        tx.layers(rid, 0, TOKENS, layer_spans(src, slots), stream=True, commit=True)
        while not (results := tx.results()):
            time.sleep(0.0005)
        if not results[0].ok:
            raise RuntimeError(f"move {i} failed: {results[0].error}")
        pool.release(rx.claim(rid) or [])

    try:
        for i in range(2):  # connections, key exchange, first allocations
            move(-1 - i)
        c0, t0 = time.process_time(), time.perf_counter()
        for i in range(moves):
            move(i)
        cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    finally:
        tx.close()
        rx.close()
    return {"cpu_ms_per_move": 1000 * cpu / moves, "wall_ms_per_move": 1000 * wall / moves}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--moves", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3, help="each round runs both modes, alternating which is first")
    p.add_argument("--out", default="")
    args = p.parse_args()
    torch.set_num_threads(1)  # as a worker runs
    rows: dict[str, list[dict]] = {"plain": [], "encrypted": []}
    for r in range(args.rounds):
        for mode in ("plain", "encrypted") if r % 2 == 0 else ("encrypted", "plain"):
            res = run(mode == "encrypted", args.moves)
            rows[mode].append(res)
            print(f"round {r + 1} {mode}: {res['cpu_ms_per_move']:.1f} ms CPU, {res['wall_ms_per_move']:.1f} ms wall")
    report = {"moves": args.moves, "mb_per_move": TOKENS * SPEC.num_layers * 2 * 3 * 64 * 4 / 1e6, "rounds": rows}
    for mode, rs in rows.items():
        cpu = statistics.median(x["cpu_ms_per_move"] for x in rs)
        wall = statistics.median(x["wall_ms_per_move"] for x in rs)
        report[f"{mode}_cpu_ms_p50"], report[f"{mode}_wall_ms_p50"] = cpu, wall
        print(f"{mode}: {cpu:.1f} ms CPU, {wall:.1f} ms wall per 23.6 MB move (median of {len(rs)} rounds)")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    sys.exit(main())
