"""Routing and health, in one run: KV-aware routing vs round-robin on a multi-turn chat workload, and SLO
attainment with the health-driven scheduler vs without it while one worker degrades.

Servers of two mixed workers on one node (no standby, ledger on, the default model and dtype; the
degradation ladder off in every arm, so that no request is refused and the figures are the router's
placement alone). The arms run one after another, each on a fresh server. The clients are the project's
load generator (`steadfast bench`'s, `steadfast/ops/harness/loadgen.py`).

1. Multi-turn chat (`routing.policy: kv_aware` vs `round_robin`): `--sessions` concurrent chats, each a
   distinct system prompt of `--system-tokens` words (~1.3 tokens a word) and `--turns` turns (a short user message, an
   answer of `--answer-tokens`, greedy, EOS ignored), every turn sending the whole history. Per arm:
   TTFT mean and p99 over all turns and over turns after the first (the first finds nothing cached
   under either policy), and the router's prefix hit rate (prompt tokens found cached on the chosen
   worker, by its index of the workers' cache events).
2. One worker degrading, per arm: `on` the global scheduler as shipped (health checks, KV-aware
   routing); `routing_only` its routing half alone (`health.enabled: false`); `off` the placement before
   it (no health checks, fewest requests in flight); `blind` round-robin, no health checks. Poisson
   arrivals at `--rate` per second for `--seconds` (prompts of ~64 tokens, 96 output tokens, greedy);
   after `--calm` seconds worker 1 is stopped (SIGSTOP/SIGCONT) for a share of every 100 ms that grows
   over `--ramp` seconds to each of `--stops` (a run each: 75 % is a worker at a quarter of its speed,
   90 % at a tenth) and stays there. SLO attainment: the share of requests with TTFT within the TTFT p99
   target and mean time per output token within the TPOT p99 target (the seed's 500 ms and 80 ms).

    python benchmarks/bench_routing.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import pct, run_info  # noqa: E402
from steadfast.config import SloConfig, default_model_path  # noqa: E402
from steadfast.ops.harness.loadgen import Arrivals, LoadGenerator, Workload  # noqa: E402
from steadfast.wire.worker import Priority  # noqa: E402
from tests.chaos.test_health import DutyCycle, worker_pid  # noqa: E402
from tests.integration.server import ServerProcess  # noqa: E402

BASE = (
    "cache: {kv_memory_mb: 512}\n"
    "server: {workers: 2, standby_workers: 0}\n"
    "degradation: {enabled: false, max_queued_high: 100000, max_queued_normal: 100000, max_queued_low: 100000}\n"
)
# The global scheduler as shipped, its routing half alone, the placement before it, and none.
SCHEDULERS = {
    "on": "health: {enabled: true}\nrouting: {policy: kv_aware}\n",
    "routing_only": "health: {enabled: false}\nrouting: {policy: kv_aware}\n",  # the health half off
    "off": "health: {enabled: false}\nrouting: {policy: least_loaded}\n",
    "blind": "health: {enabled: false}\nrouting: {policy: round_robin}\n",  # blind to load and health alike
}


async def chats(url: str, model: str, args: argparse.Namespace) -> dict:
    """`--sessions` chats at once from the load generator, each a system prompt of its own and
    `--turns` turns sending the whole history."""
    work = Workload(
        concurrency=args.sessions,
        requests=args.sessions,
        turns=args.turns,
        system_words=args.system_tokens,
        prompt_words=[(24, 1.0)],
        output_tokens=[(args.answer_tokens, 1.0)],
        seed=1000,
    )
    gen = LoadGenerator(url, work, model=model)
    samples = await gen.run()
    failed = [s.error or f"HTTP {s.status}" for s in samples if not s.ok]
    if failed:
        raise RuntimeError(f"chat turns failed: {failed[:3]}")
    routing = httpx.get(url + "/admin/routing").json()
    every = [s.ttft or 0.0 for s in samples]
    later = [s.ttft or 0.0 for s in samples if s.turn > 0]
    return {
        "wall_s": round(gen.wall_s, 1),
        "turns": len(samples),
        "ttft_mean_ms": round(1000 * statistics.mean(every), 1),
        "ttft_p99_ms": round(1000 * pct(every, 99), 1),
        "later_turns_ttft_mean_ms": round(1000 * statistics.mean(later), 1),
        "later_turns_ttft_p99_ms": round(1000 * pct(later, 99), 1),
        "prefix_hit_rate": routing["prefix_hit_rate"],
    }


async def degrading(url: str, model: str, args: argparse.Namespace, slo: SloConfig, stop: float) -> dict:
    """Poisson arrivals at `--rate` per second for `--seconds` (open loop: a slow worker's requests do
    not hold the arrivals back), every request waited for, while worker 1 slows down until it is
    stopped `stop` of the time."""
    t = slo.targets(Priority.NORMAL)
    period = 0.1  # the duty cycle's (DutyCycle's PERIOD_S)
    cycle = DutyCycle(
        worker_pid(url, 1), lambda s: 0.0 if s < args.calm else stop * period * min(1.0, (s - args.calm) / args.ramp)
    )
    # ~64-token prompts (48 words), 96 tokens out, greedy, EOS ignored; Poisson arrivals for `--seconds`.
    how = {"arrivals": Arrivals.POISSON, "rate": args.rate, "seconds": args.seconds, "requests": 10**6}
    work = Workload(prompt_words=[(48, 1.0)], output_tokens=[(96, 1.0)], seed=7, timeout_s=900.0, **how)  # type: ignore[arg-type]
    wall0 = time.time()
    try:
        results = await LoadGenerator(url, work, model=model).run()
    finally:
        cycle.end()
    complete = [r for r in results if r.status == 200 and r.tokens == 96 and not r.error]
    good = [
        r
        for r in complete
        if r.ttft is not None and r.ttft * 1000 <= t.ttft_ms.p99 and (r.tpot or 0) * 1000 <= t.tpot_ms.p99
    ]
    migrations = httpx.get(url + "/admin/migrations").json()
    tpots = [r.tpot for r in complete if r.tpot is not None]
    late = [r for r in complete if r.ttft is None or r.ttft * 1000 > t.ttft_ms.p99]
    slow = [r for r in complete if (r.tpot or 0) * 1000 > t.tpot_ms.p99]
    events = httpx.get(url + "/admin/health").json()["events"]
    return {
        "requests": len(results),
        "complete": len(complete),
        "slo_attainment": round(len(good) / max(1, len(results)), 4),
        "ttft_misses": len(late),
        "tpot_misses": len(slow),
        "tpot_p99_ms": round(1000 * pct(tpots, 99), 1) if tpots else None,
        "migrated_for_health": sum(1 for m in migrations if m["reason"] == "health"),
        "longest_stop_ms": round(1000 * cycle.longest, 1),
        # What went wrong where, for people: each missed request (sent s, TTFT ms, TPOT ms) and the
        # health events (seconds from the run's start).
        "missed": [
            (round(r.sent, 1), round(1000 * (r.ttft or 0)), round(1000 * (r.tpot or 0)))
            for r in complete
            if id(r) in {id(x) for x in late + slow}
        ],
        "health_events": [(round(e["at"] - wall0, 1), e["worker_id"], e["what"], e["reason"][:160]) for e in events],
    }


def serve(tmp: Path, name: str, extra: str, model: str) -> ServerProcess:
    folder = tmp / name
    folder.mkdir()
    server = ServerProcess(folder, BASE + extra, model=model)
    server.wait_ready()
    return server


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--system-tokens", type=int, default=400, help="words of each session's system prompt")
    p.add_argument("--answer-tokens", type=int, default=32)
    # The healthy worker alone must be able to carry the load (with the ladder off nothing is refused:
    # past one worker's capacity no placement keeps the SLO, it is admission control's turn).
    p.add_argument("--rate", type=float, default=1.2, help="arrivals per second while a worker degrades")
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--calm", type=float, default=10.0)
    p.add_argument("--ramp", type=float, default=30.0)
    p.add_argument("--model", default="")
    p.add_argument("--skip", choices=["chat", "degrading"], default=None)
    p.add_argument("--arms", default=",".join(SCHEDULERS), help="which degrading-worker arms to run")
    p.add_argument(
        "--stops",
        default="0.75,0.9",
        help="how degraded worker 1 ends: the share of the time it is stopped, each a run",
    )
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "routing.json"))
    args = p.parse_args()
    model_path = args.model or default_model_path()
    report: dict = {**run_info(args), "chat": {}, "degrading": {}}
    tmp = Path(tempfile.mkdtemp(prefix="bench-routing-"))
    slo = SloConfig()
    if args.skip != "chat":
        for policy in ("kv_aware", "round_robin"):
            server = serve(tmp, f"chat-{policy}", f"routing: {{policy: {policy}}}\n", model_path)
            try:
                name = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
                report["chat"][policy] = asyncio.run(chats(server.url, name, args))
            finally:
                server.stop()
            print(policy, report["chat"][policy], flush=True)
        kv, rr = report["chat"]["kv_aware"], report["chat"]["round_robin"]
        report["chat"]["ttft_mean_cut"] = round(1 - kv["ttft_mean_ms"] / rr["ttft_mean_ms"], 3)
        report["chat"]["later_turns_ttft_mean_cut"] = round(
            1 - kv["later_turns_ttft_mean_ms"] / rr["later_turns_ttft_mean_ms"], 3
        )
    if args.skip != "degrading":
        for stop in (float(x) for x in args.stops.split(",")):
            runs = report["degrading"].setdefault(f"stopped {stop:.0%}", {})
            for mode in args.arms.split(","):
                server = serve(tmp, f"degrading-{stop}-{mode}", SCHEDULERS[mode], model_path)
                try:
                    name = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
                    runs[mode] = asyncio.run(degrading(server.url, name, args, slo, stop))
                finally:
                    server.stop()
                print(f"stopped {stop:.0%}", mode, {k: v for k, v in runs[mode].items() if k != "health_events"})
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps({k: report[k] for k in ("chat", "degrading")}, indent=2))


if __name__ == "__main__":
    main()
