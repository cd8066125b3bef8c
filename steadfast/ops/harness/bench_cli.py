"""`steadfast bench`: measure any OpenAI-compatible server with the load generator (ops/harness/loadgen.py) — a
progress bar while it runs, a table and a JSON file of the figures, a PNG of the latency distributions;
`--compare URL2` measures a second server in the same invocation, in alternating rounds (A B, B A, …: a
machine that gets slower or faster during the run weighs on both alike), and prints B/A ratios. Each
server gets its own key: the first server's is never sent to the second."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from steadfast.config import env
from steadfast.ops.harness.loadgen import Arrivals, LoadGenerator, Sample, Workload, parse_mix, summarize

# The figures compared between two servers: (label, path in a summary, higher is better).
COMPARED = [
    ("output tokens/s", ("output_tokens_per_s",), True),
    ("requests/s", ("requests_per_s",), True),
    ("TTFT p50 ms", ("ttft_ms", "p50"), False),
    ("TTFT p99 ms", ("ttft_ms", "p99"), False),
    ("TPOT p50 ms", ("tpot_ms", "p50"), False),
    ("TPOT p99 ms", ("tpot_ms", "p99"), False),
    ("ITL p99 ms", ("itl_ms", "p99"), False),
]


def workload(args: argparse.Namespace) -> Workload:
    return Workload(
        arrivals=Arrivals(args.arrivals),
        concurrency=args.concurrency,
        rate=args.rate,
        requests=args.requests,
        seconds=args.seconds,
        prompt_words=parse_mix(args.prompt_words),
        output_tokens=parse_mix(args.output_tokens),
        priorities=parse_mix(args.priorities, str) if args.priorities else [],
        turns=args.turns,
        system_words=args.system_words,
        chat=args.chat,
        temperature=args.temperature,
        ignore_eos=not args.no_ignore_eos,
        seed=args.seed,
        retry_refused=args.retry_refused,
    )


def _get(summary: dict[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = summary
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value if isinstance(value, int | float) else None


def server_keys(args: argparse.Namespace) -> dict[str, str]:
    """The Bearer key for each server: A's from --api-key or STEADFAST_API_KEY, B's (--compare) from
    --compare-api-key or STEADFAST_COMPARE_API_KEY, else none."""
    keys = {"A": args.api_key or env.api_key()}
    if args.compare:
        keys["B"] = args.compare_api_key or env.compare_api_key()
    return keys


def measure(url: str, w: Workload, key: str, model: str, label: str, console: Console) -> tuple[list[Sample], float]:
    total = w.requests * w.turns
    with Progress(
        TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    ) as bar:
        task = bar.add_task("requests", total=total)
        gen = LoadGenerator(url, w, key, model, on_sample=lambda _: bar.advance(task))
        samples = asyncio.run(gen.run())
    return samples, gen.wall_s


def table(results: dict[str, dict[str, Any]]) -> Table:
    t = Table(title="steadfast bench")
    t.add_column("figure")
    names = list(results)
    for name in names:
        t.add_column(name, justify="right")
    if len(names) == 2:
        t.add_column(f"{names[1]} / {names[0]}", justify="right")
    for label, path, _ in [("requests ok", ("ok",), True), ("failed", ("failed",), False), *COMPARED]:
        values = [_get(results[n]["total"], path) for n in names]
        row = ["-" if v is None else f"{v:g}" for v in values]
        if len(names) == 2:
            a, b = values
            row.append(f"{b / a:.2f}x" if a and b is not None else "-")
        t.add_row(label, *row)
    return t


def plot(results: dict[str, dict[str, Any]], samples: dict[str, list[Sample]], path: Path) -> None:
    """Cumulative distributions of TTFT and TPOT per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, rows in samples.items():
        ok = [s for s in rows if s.ok]
        for ax, values in (
            (axes[0], sorted(1000 * s.ttft for s in ok if s.ttft is not None)),
            (axes[1], sorted(1000 * t for s in ok if (t := s.tpot) is not None)),
        ):
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=name)
    for ax, title in zip(axes, ("TTFT (ms)", "TPOT (ms)"), strict=True):
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.set_ylabel("share of requests at or below")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cmd_bench(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    w = workload(args)
    servers = {"A": args.url.rstrip("/")}
    if args.compare:
        servers["B"] = args.compare.rstrip("/")
    keys = server_keys(args)
    rounds: dict[str, list[dict[str, Any]]] = {n: [] for n in servers}
    samples: dict[str, list[Sample]] = {n: [] for n in servers}
    for r in range(args.rounds):
        order = list(servers) if r % 2 == 0 else list(servers)[::-1]
        for name in order:
            try:
                label = f"round {r + 1} {name} {servers[name]}"
                got, wall = measure(servers[name], w, keys[name], args.model, label, console)
            except httpx.HTTPError as exc:  # before any request: no model list (nobody there, a wrong key)
                print(f"steadfast bench: cannot reach {servers[name]}: {exc}", file=sys.stderr)
                return 1
            rounds[name].append(summarize(got, wall))
            samples[name] += got
    results = {}
    for name, url in servers.items():
        wall = sum(x["wall_s"] for x in rounds[name])
        results[name] = {"url": url, "rounds": rounds[name], "total": summarize(samples[name], wall)}
    Console().print(table(results))
    report: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "workload": {k: v.value if hasattr(v, "value") else v for k, v in vars(w).items()},
        "rounds": args.rounds,
        "servers": results,
    }
    if args.compare:
        a, b = results["A"]["total"], results["B"]["total"]
        report["ratios_b_over_a"] = {
            label: round(vb / va, 3) if (va := _get(a, p)) and (vb := _get(b, p)) is not None else None
            for label, p, _ in COMPARED
        }
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    if args.plot:
        try:
            plot(results, samples, Path(args.plot))
        except ImportError:
            console.print("steadfast bench: matplotlib is not installed: no plot (pip install matplotlib)")
    failed = sum(results[n]["total"]["failed"] for n in results)
    return 1 if failed and args.fail_on_error else 0


def add_command(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("bench", help="measure an OpenAI-compatible server (or two, side by side)")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default %(default)s)")
    p.add_argument("--compare", metavar="URL2", help="a second server, measured in alternating rounds")
    p.add_argument("--rounds", type=int, default=2, help="rounds per server (default %(default)s)")
    p.add_argument("--arrivals", choices=[a.value for a in Arrivals], default="closed")
    p.add_argument("--concurrency", type=int, default=8, help="closed loop: clients (default %(default)s)")
    p.add_argument("--rate", type=float, default=4.0, help="poisson: arrivals per second (default %(default)s)")
    p.add_argument("--requests", type=int, default=64, help="sessions per round (default %(default)s)")
    p.add_argument("--seconds", type=float, default=0.0, help="> 0: start no session after this long, a round")
    p.add_argument("--prompt-words", default="64", help="length mix, e.g. 32:0.5,256:0.5 (default %(default)s)")
    p.add_argument("--output-tokens", default="128", help="length mix (default %(default)s)")
    p.add_argument("--priorities", default="", help="Steadfast's priority mix, e.g. high:0.1,normal:0.7,low:0.2")
    p.add_argument("--turns", type=int, default=1, help=">1: multi-turn chat sessions (default %(default)s)")
    p.add_argument("--system-words", type=int, default=0, help="chats open with a system prompt this long")
    p.add_argument("--chat", action="store_true", help="use /v1/chat/completions")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", action="store_true", help="let requests end at EOS")
    p.add_argument(
        "--retry-refused", action="store_true", help="send a request refused for load (429/503) again after Retry-After"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="", help="the model name to send (default: the server's first)")
    p.add_argument("--api-key", default="", help="Bearer key (default: STEADFAST_API_KEY)")
    p.add_argument(
        "--compare-api-key",
        default="",
        help="Bearer key for the --compare server (default: STEADFAST_COMPARE_API_KEY; never the first's)",
    )
    p.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="draw the TTFT and TPOT distributions")
    p.add_argument("--fail-on-error", action="store_true", help="exit 1 when any request failed")
    p.set_defaults(func=cmd_bench)
