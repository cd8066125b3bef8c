"""Overload: the degradation ladder on vs off, open-loop Poisson arrivals at 1x, 2x and 3x the measured
capacity, in one run.

Two servers of the default deployment (`make serve`: one mixed worker, one standby, ledger on, the
default model and dtype), one with the ladder as shipped and one with it off (`degradation.enabled:
false` and the per-priority queue bounds lifted: a server with no ladder, only `max_pending_requests`).
First the capacity: a closed loop of `--capacity-concurrency` clients on the ladder-off server, completed
requests per second. Then per load, each mode in turn (which goes first alternates; this machine's speed
drifts by tens of percent over a minute), `--seconds` of Poisson arrivals: priorities 20 % high, 50 %
normal, 30 % low; prompts of about 32, 128 or 256 tokens (50/35/15 %, distinct so that no prefix is
cached); `--max-tokens` output tokens, EOS ignored, greedy. Every request is waited for to its end. The
clients are the project's load generator (`steadfast bench`'s, `steadfast/ops/harness/loadgen.py`).

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
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import pct, run_info  # noqa: E402
from steadfast.config import SloConfig  # noqa: E402
from steadfast.ops.harness.loadgen import Arrivals, LoadGenerator, Sample, Workload  # noqa: E402
from steadfast.wire.worker import Priority  # noqa: E402
from tests.integration.server import ServerProcess  # noqa: E402

PRIORITIES = [("high", 0.2), ("normal", 0.5), ("low", 0.3)]
# Prompt lengths in words of the load generator's text (about 1.3 tokens a word): ~32, 128 and 256 tokens.
PROMPT_WORDS = [(24, 0.5), (96, 0.35), (192, 0.15)]
MODES = {
    "on": "",
    "off": "degradation: {enabled: false, max_queued_high: 100000, max_queued_normal: 100000, "
    "max_queued_low: 100000}\n",
}
UNBOUNDED = 10**6  # sessions: the run is bounded by its seconds


def workload(max_tokens: int, seed: int, **how: object) -> Workload:
    """This benchmark's requests (priority and prompt mixes, `max_tokens` out, greedy, EOS ignored)."""
    return Workload(
        requests=UNBOUNDED,
        prompt_words=PROMPT_WORDS,
        output_tokens=[(max_tokens, 1.0)],
        priorities=PRIORITIES,
        seed=seed,
        timeout_s=900.0,
        **how,  # type: ignore[arg-type]
    )


async def capacity(url: str, model: str, max_tokens: int, concurrency: int, seconds: float) -> float:
    """Completed requests per second of a closed loop of `concurrency` clients for `seconds`."""
    gen = LoadGenerator(url, workload(max_tokens, 1, concurrency=concurrency, seconds=seconds), model=model)
    samples = await gen.run()
    return sum(1 for s in samples if s.ok and s.tokens == max_tokens) / gen.wall_s


async def open_loop(
    url: str, model: str, max_tokens: int, rate: float, seconds: float, seed: int, record: bool
) -> tuple[list[Sample], list[tuple[float, int, int]]]:
    """Poisson arrivals at `rate` per second for `seconds`; every request waited for. With `record`, the
    ladder's level and the requests in flight twice a second: [(t, level, in flight)]."""
    how = {"arrivals": Arrivals.POISSON, "rate": rate, "seconds": seconds}
    gen = LoadGenerator(url, workload(max_tokens, seed, **how), model=model)
    timeline: list[tuple[float, int, int]] = []
    t0 = time.perf_counter()

    async def watch() -> None:
        async with httpx.AsyncClient(timeout=10) as c:
            while True:
                try:
                    level = (await c.get(url + "/admin/degradation")).json()["level"]
                except (httpx.HTTPError, KeyError, ValueError):
                    level = -1
                timeline.append((time.perf_counter() - t0, level, gen.in_flight))
                await asyncio.sleep(0.5)

    watcher = asyncio.create_task(watch()) if record else None
    samples = await gen.run()
    if watcher is not None:
        await asyncio.sleep(1.0)
        watcher.cancel()
    return samples, timeline


def summarize(results: list[Sample], seconds: float, max_tokens: int, slo: SloConfig) -> dict:
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
        cap = asyncio.run(
            capacity(servers["off"].url, model, args.max_tokens, args.capacity_concurrency, args.capacity_seconds)
        )
        print(f"capacity: {cap:.2f} requests/s (closed loop, c={args.capacity_concurrency})", flush=True)
        report: dict = {"run": run_info(args), "capacity_rps": round(cap, 3), "runs": {}}
        timelines = {}
        for i, mult in enumerate(float(x) for x in args.loads.split(",")):
            order = list(MODES) if i % 2 == 0 else list(reversed(MODES))
            for mode in order:
                rate = mult * cap
                t0 = time.perf_counter()
                results, timeline = asyncio.run(  # seed 100 + i: the same arrivals for both modes
                    open_loop(servers[mode].url, model, args.max_tokens, rate, args.seconds, 100 + i, mode == "on")
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
