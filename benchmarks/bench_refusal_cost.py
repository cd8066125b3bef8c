"""The router's CPU per refused request, this checkout against another one (`--code NAME=DIR`), in
alternating rounds: a default server held at a manual L5 (the breaker), `--requests` normal-priority
streamed chat requests from `--concurrency` clients, every one refused 503 after its body was parsed,
its prompt tokenized and the ladder asked; the router's CPU time read from /proc around them.

A burst's refusals pass through the same event loop as every admitted stream's tokens, so on a busy
machine their cost is latency for the requests admitted (issue 47's burst).

    python benchmarks/bench_refusal_cost.py --code before=/tmp/before --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import run_info  # noqa: E402
from tests.integration.server import ServerProcess  # noqa: E402

CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def fire(url: str, model: str, n: int, concurrency: int) -> dict[int, int]:
    body = {"model": model, "messages": CHAT, "max_tokens": 8, "stream": True, "priority": "normal"}
    codes: dict[int, int] = {}
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=concurrency)) as c:

        async def one() -> None:
            async with gate:
                r = await c.post(url + "/v1/chat/completions", json=body)
                codes[r.status_code] = codes.get(r.status_code, 0) + 1

        await asyncio.gather(*(one() for _ in range(n)))
    return codes


def measure(args: argparse.Namespace, code_dir: str = "") -> dict:
    server = ServerProcess(Path(tempfile.mkdtemp(prefix="bench-")), "# the defaults\n", code_dir=code_dir)
    try:
        server.wait_ready()
        model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        r = httpx.post(server.url + "/admin/degradation", json={"level": 5})
        r.raise_for_status()
        routers = subprocess.check_output(["pgrep", "-f", "steadfast.control.main"]).split()
        if len(routers) != 1:
            raise RuntimeError(f"one router expected on this machine, found {len(routers)}")
        pid = int(routers[0])
        asyncio.run(fire(server.url, model, 200, args.concurrency))  # warm-up
        before, start = cpu_s(pid), time.monotonic()
        codes = asyncio.run(fire(server.url, model, args.requests, args.concurrency))
        used, wall = cpu_s(pid) - before, time.monotonic() - start
    finally:
        server.stop()
    if set(codes) != {503}:
        raise RuntimeError(f"not every request was refused by the breaker: {codes}")
    out = {
        "requests": args.requests,
        "router_cpu_s": used,
        "ms_per_refusal": 1000 * used / args.requests,
        "wall_s": wall,
    }
    print(f"{code_dir or 'this checkout'}: {out}", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--code", action="append", default=[], metavar="NAME=DIR", help="another checkout, alternating")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "refusal_cost.json"))
    args = p.parse_args()
    runs = [("default", "")] + [tuple(spec.split("=", 1)) for spec in args.code]
    rounds = []
    for i in range(args.rounds):
        order = runs if i % 2 == 0 else runs[::-1]  # no checkout always first on a drifting machine
        rounds.append({name: measure(args, where) for name, where in order})
    ratios = {
        name: [r["default"]["ms_per_refusal"] / r[name]["ms_per_refusal"] for r in rounds] for name, _ in runs[1:]
    }
    for name, rs in ratios.items():
        each = ", ".join(f"{x:.2f}x" for x in rs)
        print(f"router CPU per refusal, this checkout / {name}: {each}; median {statistics.median(rs):.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({**run_info(args), "rounds": rounds, "ratio_per_round": ratios}, indent=2))


if __name__ == "__main__":
    main()
