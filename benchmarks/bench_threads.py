"""The worker's thread count chosen from the CPU others leave it (`server.threads_per_worker: 0`, the
default; worker/threads.py) vs a fixed team on every core (`threads_per_worker` = the cores), on a quiet
machine and with CPU-bound processes beside the server, in one run.

For each (hogs, variant) a fresh default server (bf16) serves `concurrency` closed-loop clients of the
project's load generator (greedy chats of `--max-tokens` tokens, EOS ignored); we record output tok/s,
TTFT and TPOT p99, and the threads the worker computed with at the end. The hogs are busy loops started
in a session of their own (as a compile from another terminal is) `--lead` seconds before the load.

    python benchmarks/bench_threads.py --hogs 0 2 --concurrency 1 16 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_serving import load  # noqa: E402
from benchmarks.common import run_info  # noqa: E402
from tests.integration.server import ServerProcess  # noqa: E402

SPIN = "while True: pass"


def run_variant(name: str, extra_yaml: str, hogs: int, args: argparse.Namespace) -> dict[int, dict]:
    procs = [subprocess.Popen([sys.executable, "-c", SPIN], start_new_session=True) for _ in range(hogs)]
    started = time.monotonic()
    server = ServerProcess(Path(tempfile.mkdtemp(prefix="bench-threads-")), f"model: {{dtype: bfloat16}}\n{extra_yaml}")
    out: dict[int, dict] = {}
    try:
        server.wait_ready()
        time.sleep(max(0.0, args.lead - (time.monotonic() - started)))
        model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        for c in args.concurrency:
            asyncio.run(load(server.url, model, c, c, 16, retry_refused=True))  # warm-up at this concurrency, untimed
            n = max(8, args.waves * c)
            out[c] = asyncio.run(load(server.url, model, c, n, args.max_tokens, retry_refused=True))
            workers = httpx.get(server.url + "/admin/workers").json()
            out[c]["threads"] = [w.get("threads", 0) for w in workers if w.get("role") != "standby"]
            print(f"hogs={hogs} {name} c={c}: {json.dumps(out[c])}", flush=True)
    finally:
        server.stop()
        for p in procs:
            p.kill()
            p.wait()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hogs", type=int, nargs="+", default=[0, 2])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 32])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--waves", type=int, default=2)
    p.add_argument("--lead", type=float, default=20.0, help="seconds the hogs run before the load")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "threads.json"))
    args = p.parse_args()
    cores = len(os.sched_getaffinity(0))
    variants = {"chosen (default)": "", f"fixed {cores}": f"server: {{threads_per_worker: {cores}}}\n"}
    results: dict[str, dict] = {}
    for hogs in args.hogs:
        for name, extra in variants.items():
            results[f"{hogs}|{name}"] = run_variant(name, extra, hogs, args)
    lines = [
        "| hogs | workers' threads | c | out tok/s | TTFT p99 | TPOT p99 | threads at the end | tok/s vs fixed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    fixed = f"fixed {cores}"
    for hogs in args.hogs:
        for name in variants:
            for c, r in results[f"{hogs}|{name}"].items():
                base = results[f"{hogs}|{fixed}"][c]["out_tok_s"]
                lines.append(
                    f"| {hogs} | {name} | {c} | {r['out_tok_s']:.1f} | {r['ttft_p99_ms']:.0f} ms | "
                    f"{r['tpot_p99_ms']:.1f} ms | {r['threads']} | {r['out_tok_s'] / base:.2f}x |"
                )
    print("\n".join(lines))
    Path(args.out).write_text(json.dumps({"info": run_info(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
