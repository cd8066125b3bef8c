"""`steadfast status`: the dashboard's picture in a terminal (`GET /admin/dashboard`, drawn with `rich`),
once or, with `--watch`, redrawn every interval until Ctrl-C."""

from __future__ import annotations

import argparse
import time
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from steadfast.ops.admin_cli import admin_options, call

LEVEL_STYLE = {0: "bold white on green", 1: "bold black on yellow", 2: "bold black on yellow"}


def _ms(seen: float, target: float) -> Text:
    return Text(f"{seen:.0f} / {target:g}", style="bold red" if seen > target else "")


def render(s: dict[str, Any], events: int = 12) -> Group:
    """One picture of a `GET /admin/dashboard` answer."""
    lv = s["level"]
    head = Text.assemble(
        ("Steadfast ", "bold"),
        (f"{s['model']}  ", "dim"),
        (f" L{lv['level']} ", LEVEL_STYLE.get(lv["level"], "bold white on red")),
        f"  {lv['action']} ({lv['mode']}, {lv['since_s']:g} s)",
        (f": {lv['reason']}" if lv["reason"] else "", "dim"),
    )
    slo = Table(title="Latency, ms: observed / target", title_justify="left", expand=False)
    for col in ("priority", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99"):
        slo.add_column(col, justify="right" if col != "priority" else "left")
    for name, p in s["slo"].items():
        t, o = p["target_ms"], p["observed_ms"]
        if not t:
            continue
        cells = [_ms(o[f"{w}_{q}"], t[w][q]) for w in ("ttft", "tpot") for q in ("p50", "p99")]
        slo.add_row(name, *cells)
    last = s["series"][-1] if s["series"] else None
    flow = Text(
        f"output {last['tokens_per_s']:.1f} tokens/s   KV transfer {last['kv_mb_per_s']:.2f} MB/s   "
        f"running {last['running']}   queued {last['queued']}"
        if last
        else "no sample yet"
    )
    workers = Table(title="Workers", title_justify="left")
    for col in ("id", "role", "state", "liveness", "KV use", "running", "queued", "score", "standing"):
        workers.add_column(col)
    for w in s["workers"]:
        standing = Text(w["standing"], style="" if w["standing"] == "healthy" else "bold red")
        state = w["state"] + (" (draining)" if w["draining"] else "")
        workers.add_row(
            str(w["id"]),
            w["role"],
            state,
            w["liveness"],
            f"{100 * w['kv_use']:.0f} %",
            str(w["running"]),
            str(w["queued"]),
            f"{w['score']:.2f}",
            standing,
        )
    m = s["moves"]
    moves = Text(
        f"migrations: {m['migrations_running']} running, {m['migrations_committed']} committed, "
        f"{m['migrations_failed']} failed   takeovers: {m['takeovers_running']} running, {m['takeovers_done']} done"
    )
    timeline = Table(title=f"Timeline (last {events})", title_justify="left")
    for col in ("time", "kind", "worker", "what", "why"):
        timeline.add_column(col, overflow="fold")
    for e in s["events"][-events:][::-1]:
        when = time.strftime("%H:%M:%S", time.localtime(e["at"]))
        style = "bold red" if e["kind"] in ("crash", "takeover") else ""
        worker = "" if e["worker"] is None else str(e["worker"])
        timeline.add_row(when, Text(e["kind"], style=style), worker, e["what"], e["reason"])
    return Group(head, slo, flow, workers, moves, timeline)


def cmd_status(args: argparse.Namespace) -> int:
    console = Console()
    if not args.watch:
        console.print(render(call(args, "GET", "/admin/dashboard"), args.events))
        return 0
    try:
        with Live(console=console, auto_refresh=False, screen=False) as live:
            while True:
                live.update(render(call(args, "GET", "/admin/dashboard"), args.events), refresh=True)
                time.sleep(args.watch)
    except KeyboardInterrupt:  # Ctrl-C is how a watch ends
        return 0


def add_command(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    status = sub.add_parser("status", help="the service at a glance: SLO, level, workers, moves, timeline")
    admin_options(status)
    status.add_argument(
        "--watch", type=float, nargs="?", const=1.0, default=0.0, metavar="SECONDS", help="redraw every SECONDS"
    )
    status.add_argument("--events", type=int, default=12, help="timeline events to show (default %(default)s)")
    status.set_defaults(func=cmd_status)
