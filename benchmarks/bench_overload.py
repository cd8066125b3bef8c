"""Overload: the degradation ladder on vs off, open-loop Poisson arrivals at 1x, 2x and 3x the measured
capacity, in one run.

Two servers of the default deployment (`make serve`: one mixed worker, one standby, ledger on, the
default model and dtype), one with the ladder as shipped and one with it off (`degradation.enabled:
false` and the per-priority queue bounds lifted: a server with no ladder, only `max_pending_requests`).
First the capacity: a closed loop of `--capacity-concurrency` clients on the ladder-off server, completed
requests per second. Then per load, each mode in turn (which goes first alternates; this machine's speed
drifts by tens of percent over a minute), `--seconds` of Poisson arrivals: priorities 20 % high, 50 %
normal, 30 % low; prompts of 32, 128 or 256 tokens (50/35/15 %, distinct so that no prefix is cached);
`--max-tokens` output tokens, EOS ignored, greedy. Every request is waited for to its end.

Per mode, load and priority: goodput (requests per second of the arrival window that completed with
TTFT within their priority's TTFT p99 target and a mean time per output token within the TPOT p99
target), TTFT p99 of the admitted, refused (429/503 at admission) and failed (admitted, then an error or
fewer tokens than asked). The ladder-on runs also record the level twice a second: a PNG timeline of the
level against the requests in flight.

    python benchmarks/bench_overload.py --seconds 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import pct, prompt_of, run_info  # noqa: E402
from steadfast.config import SloConfig, default_model_path  # noqa: E402
from steadfast.model.tokenizer import GGUFTokenizer  # noqa: E402
from steadfast.ops.loadgen import pick  # noqa: E402
from steadfast.protocol import Priority  # noqa: E402
from tests.integration.server import ServerProcess  # noqa: E402

PRIORITY_MIX = ((Priority.HIGH, 0.2), (Priority.NORMAL, 0.5), (Priority.LOW, 0.3))
PROMPT_MIX = ((32, 0.5), (128, 0.35), (256, 0.15))
MODES = {
    "on": "",
    "off": "degradation: {enabled: false, max_queued_high: 100000, max_queued_normal: 100000, "
    "max_queued_low: 100000}\n",
}


@dataclass
class Result:
    priority: str
    status: int  # HTTP status at admission
    sent: float  # seconds since the run's start
    ttft: float | None = None
    tpot: float | None = None  # mean seconds per output token after the first
    tokens: int = 0
    error: str = ""


async def one(client: httpx.AsyncClient, url: str, body: dict, t0: float, priority: str) -> Result:
    start = time.perf_counter()
    res = Result(priority, 0, start - t0)
    first = last = 0.0
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            res.status = r.status_code
            if r.status_code != 200:
                await r.aread()
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"]["message"][:200]
                    break
                n = sum(len(c.get("token_ids") or []) for c in chunk["choices"])
                if n:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    res.tokens += n
    except httpx.HTTPError as exc:
        res.error = repr(exc)[:200]
    if first:
        res.ttft = first - start
        if res.tokens > 1:
            res.tpot = (last - first) / (res.tokens - 1)
    return res


class Workload:
    def __init__(self, tokenizer: GGUFTokenizer, model: str, max_tokens: int, seed: int) -> None:
        self.tok, self.model, self.max_tokens = tokenizer, model, max_tokens
        self.rng = random.Random(seed)
        self.n = 0

    def next(self) -> tuple[dict, str]:
        self.n += 1
        priority = pick(PRIORITY_MIX, self.rng)
        length = pick(PROMPT_MIX, self.rng)
        body = {
            "model": self.model,
            "prompt": prompt_of(self.tok, length, f"r{self.n}-{self.rng.random():.6f}"),
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
            "priority": priority.label,
        }
        return body, priority.label


def client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=900, limits=httpx.Limits(max_connections=2000, max_keepalive_connections=64))


async def capacity(url: str, work: Workload, concurrency: int, seconds: float) -> float:
    """Completed requests per second of a closed loop of `concurrency` clients."""
    done = 0
    t0 = time.perf_counter()
    async with client() as c:

        async def loop() -> None:
            nonlocal done
            while time.perf_counter() - t0 < seconds:
                body, label = work.next()
                r = await one(c, url, body, t0, label)
                done += r.status == 200 and r.tokens == work.max_tokens
            return None

        await asyncio.gather(*(loop() for _ in range(concurrency)))
    return done / (time.perf_counter() - t0)


async def open_loop(url: str, work: Workload, rate: float, seconds: float, record: bool) -> tuple[list, list]:
    """Poisson arrivals at `rate` per second for `seconds`; every request waited for. With `record`, the
    ladder's level and the requests in flight twice a second: [(t, level, in flight)]."""
    rng = random.Random(int(rate * 1000))
    tasks: list[asyncio.Task[Result]] = []
    timeline: list[tuple[float, int, int]] = []
    t0 = time.perf_counter()
    async with client() as c:

        async def watch() -> None:
            while True:
                try:
                    r = await c.get(url + "/admin/degradation")
                    level = r.json()["level"]
                except (httpx.HTTPError, KeyError, ValueError):
                    level = -1
                timeline.append((time.perf_counter() - t0, level, sum(1 for t in tasks if not t.done())))
                await asyncio.sleep(0.5)

        watcher = asyncio.create_task(watch()) if record else None
        next_at = 0.0
        while next_at < seconds:
            await asyncio.sleep(max(0.0, next_at - (time.perf_counter() - t0)))
            body, label = work.next()
            tasks.append(asyncio.create_task(one(c, url, body, t0, label)))
            next_at += rng.expovariate(rate)
        results = await asyncio.gather(*tasks)
        if watcher is not None:
            await asyncio.sleep(1.0)
            watcher.cancel()
    return list(results), timeline


def summarize(results: list[Result], seconds: float, max_tokens: int, slo: SloConfig) -> dict:
    out = {}
    for p in Priority:
        mine = [r for r in results if r.priority == p.label]
        t = slo.targets(p)
        admitted = [r for r in mine if r.status == 200]
        complete = [r for r in admitted if r.tokens == max_tokens and not r.error]
        good = [
            r
            for r in complete
            if r.ttft is not None
            and r.ttft * 1000 <= t.ttft_ms.p99
            and (r.tpot is None or r.tpot * 1000 <= t.tpot_ms.p99)
        ]
        ttfts = [r.ttft for r in admitted if r.ttft is not None]
        tpots = [r.tpot for r in complete if r.tpot is not None]
        out[p.label] = {
            "sent": len(mine),
            "goodput_rps": round(len(good) / seconds, 3),
            "ttft_p99_ms": round(1000 * pct(ttfts, 99), 1) if ttfts else None,
            "tpot_p99_ms": round(1000 * pct(tpots, 99), 1) if tpots else None,
            "refused": sum(1 for r in mine if r.status in (429, 503)),
            "failed": len(admitted) - len(complete),
            "other_status": sorted({r.status for r in mine} - {200, 429, 503}),
        }
    out["all"] = {"goodput_rps": round(sum(v["goodput_rps"] for v in out.values()), 3)}
    return out


def plot(timelines: dict[str, list], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(timelines), 1, figsize=(9, 2.6 * len(timelines)), sharex=True, squeeze=False)
    for ax, (name, line) in zip(axes[:, 0], timelines.items(), strict=True):
        t = [x[0] for x in line]
        ax.step(t, [x[1] for x in line], where="post", color="tab:red", label="level")
        ax.set_ylim(-0.2, 5.2)
        ax.set_ylabel("level")
        ax.set_title(f"ladder on, {name} load")
        twin = ax.twinx()
        twin.plot(t, [x[2] for x in line], color="tab:blue", alpha=0.6, label="in flight")
        twin.set_ylabel("requests in flight")
    axes[-1, 0].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=30.0, help="arrival window per run")
    p.add_argument("--loads", default="1,2,3", help="multiples of the measured capacity")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--capacity-concurrency", type=int, default=16)
    p.add_argument("--capacity-seconds", type=float, default=30.0)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "overload.json"))
    p.add_argument("--png", default=str(ROOT / "benchmarks" / "results" / "overload_timeline.png"))
    args = p.parse_args()
    tokenizer = GGUFTokenizer.from_gguf(default_model_path())
    slo = SloConfig()
    servers = {}
    tmp = Path(tempfile.mkdtemp(prefix="bench-overload-"))
    try:
        for mode, extra in MODES.items():
            folder = tmp / mode
            folder.mkdir()
            servers[mode] = ServerProcess(folder, extra or "degradation: {enabled: true}\n")
        for s in servers.values():
            s.wait_ready()
        model = httpx.get(servers["on"].url + "/v1/models").json()["data"][0]["id"]
        work = Workload(tokenizer, model, args.max_tokens, seed=1)
        cap = asyncio.run(capacity(servers["off"].url, work, args.capacity_concurrency, args.capacity_seconds))
        print(f"capacity: {cap:.2f} requests/s (closed loop, c={args.capacity_concurrency})", flush=True)
        report: dict = {"run": run_info(args), "capacity_rps": round(cap, 3), "runs": {}}
        timelines = {}
        for i, mult in enumerate(float(x) for x in args.loads.split(",")):
            order = list(MODES) if i % 2 == 0 else list(reversed(MODES))
            for mode in order:
                rate = mult * cap
                work = Workload(tokenizer, model, args.max_tokens, seed=100 + i)  # the same arrivals per mode
                t0 = time.perf_counter()
                results, timeline = asyncio.run(
                    open_loop(servers[mode].url, work, rate, args.seconds, record=mode == "on")
                )
                summary = summarize(results, args.seconds, args.max_tokens, slo)
                key = f"{mult:g}x/{mode}"
                report["runs"][key] = {"rate_rps": round(rate, 3), "wall_s": round(time.perf_counter() - t0, 1)}
                report["runs"][key].update(summary)
                report["runs"][key]["errors"] = sorted({r.error for r in results if r.error})[:5]
                if mode == "on":
                    timelines[f"{mult:g}x"] = timeline
                    report["runs"][key]["max_level"] = max((x[1] for x in timeline), default=0)
                print(key, json.dumps(summary), flush=True)
                # Let the server settle (the ladder back to L0, queues empty) before the next run.
                time.sleep(5 if mode == "off" else 15)
        for mult in args.loads.split(","):
            on, off = report["runs"][f"{float(mult):g}x/on"], report["runs"][f"{float(mult):g}x/off"]
            ratio = on["all"]["goodput_rps"] / off["all"]["goodput_rps"] if off["all"]["goodput_rps"] else None
            report["runs"][f"{float(mult):g}x/on"]["goodput_vs_off"] = None if ratio is None else round(ratio, 2)
            print(f"{mult}x: goodput on/off = {ratio}")
        plot(timelines, Path(args.png))
        report["timeline"] = {k: v for k, v in timelines.items()}
        Path(args.out).write_text(json.dumps(report, indent=1, default=lambda o: asdict(o)))
        print("wrote", args.out, args.png)
    finally:
        for s in servers.values():
            s.stop()


if __name__ == "__main__":
    main()
