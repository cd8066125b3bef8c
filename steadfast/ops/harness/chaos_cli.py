"""`steadfast chaos SCENARIO`: start a server (your config and model), run greedy streams through it
undisturbed, run them again while the fault strikes, check every stream token by token against its
undisturbed twin, print the recovery figures, stop the server. Exit 0 only when the fault happened and
every stream came through identical."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from steadfast.ops.harness.chaos import Rehearsal, Scenario, compare
from steadfast.ops.harness.chaos_faults import FAULTS
from steadfast.ops.harness.served import Served

COMMON = (
    "streams",
    "identical",
    "failed",
    "longest_gap_ms",
    "clean_longest_gap_ms",
    "reconnects",
    "refusals",
    "takeovers",
    "adopted_tokens",
    "recomputed_tokens",
    "migrations",
)
VERDICT = ("fault_happened", "passed")
SOAK = "soak"


def _records(url: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    return httpx.get(url + "/admin/takeovers", timeout=10).json(), httpx.get(
        url + "/admin/migrations", timeout=10
    ).json()


def rehearse(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    scenario = Scenario(args.scenario)
    server = Served(folder, args.config, args.model, args.port)
    try:
        server.wait_ready()
        print(f"steadfast chaos: serving at {server.url} (its dashboard: {server.url}/dashboard)", file=sys.stderr)
        r = Rehearsal(server.url, server.proc.pid, args.streams, args.tokens, args.stop_seconds)
        r.drill, r.burst = server.drill, args.burst
        kind = FAULTS[scenario]
        clean, _ = r.run(priority=kind.priority)
        takeovers0, migrations0 = _records(server.url)
        fault = kind(r)
        faulted, did = r.run(fault, args.at, kind.priority)
        takeovers, migrations = _records(server.url)
        takeovers, migrations = takeovers[len(takeovers0) :], migrations[len(migrations0) :]
        report = {"scenario": scenario.value, "fault": did} | compare(clean, faulted)
        report |= {
            "takeovers": len(takeovers),
            "adopted_tokens": sum(t["adopted_tokens"] for t in takeovers),
            "recomputed_tokens": sum(t["recomputed_tokens"] for t in takeovers),
            "migrations": sum(1 for m in migrations if m["outcome"] == "committed"),
        }
        report |= fault.figures()
        report["fault_happened"] = fault.happened(report, migrations)
        same = report["identical"] == report["streams"] and not report["failed"]
        report["passed"] = report["fault_happened"] and same and fault.harmless()
        show(report, args.json)
        linger(server, args.linger)
        return report
    finally:
        server.stop()


def linger(server: Served, seconds: float) -> None:
    """Keep the server up `seconds` after the report (to read its dashboard); SIGINT or SIGTERM ends it
    sooner, and the server is still stopped."""
    if seconds <= 0:
        return
    print(f"steadfast chaos: the server stays up {seconds:g}s at {server.url}/dashboard", file=sys.stderr)
    ended = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: ended.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        ended.wait(seconds)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def cmd_chaos(args: argparse.Namespace) -> int:
    folder = Path(args.folder) if args.folder else Path(tempfile.mkdtemp(prefix="steadfast-chaos-"))
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)  # (its log holds prompts: this user's alone)
    signal.signal(signal.SIGTERM, _interrupt)  # as Ctrl-C: the server (its own session) is stopped too
    try:
        if args.scenario == SOAK:
            from steadfast.ops.harness.soak_cli import soak  # (torch: the expected outputs are computed here)

            return soak(args, folder)
        report = rehearse(args, folder)
    except (RuntimeError, httpx.HTTPError) as exc:
        print(f"steadfast chaos: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("steadfast chaos: interrupted", file=sys.stderr)
        return 130
    finally:
        # Kept for the post-mortem: every process's log of the run, in one file.
        print(f"steadfast chaos: the server's log is {folder / 'server.log'}", file=sys.stderr)
    return 0 if report["passed"] else 1


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def show(report: dict[str, Any], json_path: str | None) -> None:
    """The figures as a table on stdout, and as JSON in `json_path` when given."""
    console = Console()
    console.print(f"steadfast chaos {report['scenario']}: {report['fault']}", soft_wrap=True)
    t = Table()
    t.add_column("figure")
    t.add_column("value", justify="right")
    own = [k for k in report if k not in (*COMMON, *VERDICT, "scenario", "fault", "errors")]
    for key in (*COMMON, *own, *VERDICT):  # the fault's own figures between the common ones and the verdict
        t.add_row(key.replace("_", " "), str(report[key]))
    for error in report["errors"]:
        t.add_row("error", error)
    console.print(t)
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2))


def add_command(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("chaos", help="rehearse a fault under load and check every stream token by token")
    p.add_argument("scenario", choices=[s.value for s in Scenario] + [SOAK], help="a fault, or soak: all of them")
    p.add_argument("--config", default="", help="the server's YAML config (default: the defaults)")
    p.add_argument("--model", default="", help="a GGUF to serve (default: SmolLM2-135M-Instruct)")
    p.add_argument("--streams", type=int, default=6, help="greedy streams at once (default %(default)s)")
    p.add_argument("--tokens", type=int, default=80, help="tokens a stream (default %(default)s)")
    p.add_argument(
        "--at", type=float, default=0.3, help="strike when this share of tokens is out (default %(default)s)"
    )
    p.add_argument(
        "--stop-seconds", type=float, default=8.0, help="stop-worker: how long; slow-worker: how long it slows down"
    )
    p.add_argument("--burst", type=int, default=200, help="overload: low-priority streams at once")
    p.add_argument("--port", type=int, default=0, help="the server's port (default: a free one)")
    p.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    p.add_argument(
        "--folder", default="", help="where the run keeps its server's log (default: a new steadfast-chaos-* folder)"
    )
    p.add_argument(
        "--linger", type=float, default=0.0, help="keep the server up this long after the report (its dashboard)"
    )
    soak = p.add_argument_group("soak", "hours of mixed traffic under a seeded random schedule of faults")
    soak.add_argument("--seconds", type=float, default=600.0, help="how long (default %(default)s)")
    soak.add_argument("--seed", type=int, default=1, help="the schedule's seed: the same seed, the same faults")
    soak.add_argument("--rate", type=float, default=2.0, help="requests a second, on average (default %(default)s)")
    soak.add_argument("--fault-every", type=float, default=6.0, help="mean seconds between faults")
    soak.add_argument("--kinds", default="", help="fault kinds, comma-separated (default: all the deployment has)")
    soak.add_argument("--png", metavar="FILE", help="write the timeline of faults and gaps as a PNG")
    p.set_defaults(func=cmd_chaos)
