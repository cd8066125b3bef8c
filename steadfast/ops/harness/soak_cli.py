"""`steadfast chaos soak`: the soak run on a server this command starts, its report printed as tables
(and written as JSON and a PNG when asked). Exit 0 only when the soak passed."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from steadfast.config import load_config
from steadfast.ops.harness.soak import SoakPlan
from steadfast.ops.harness.soak_faults import KINDS
from steadfast.ops.harness.soak_run import plot, run_soak

SHOWN = 20  # problems and failed requests printed (the JSON report lists more)


def soak(args: argparse.Namespace, folder: Path) -> int:
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise RuntimeError(f"unknown fault kind(s) {', '.join(unknown)}: choose among {', '.join(KINDS)}")
    cfg = load_config(args.config or None, {"model": {"path": args.model}} if args.model else None)
    plan = SoakPlan(args.seed, args.seconds, args.rate, fault_every_s=args.fault_every, kinds=kinds)
    console = Console(stderr=True)
    result = run_soak(cfg, plan, folder, args.config, args.model, log=console.print)
    if args.png:
        plot(result, args.png)
    show(result)
    if args.json:
        Path(args.json).write_text(json.dumps({k: v for k, v in result.items() if k != "_plot"}, indent=2))
    return 0 if result["passed"] else 1


def show(r: dict[str, Any]) -> None:
    console = Console()
    t = Table(title=f"steadfast chaos soak — seed {r['seed']}, {r['duration_s']:g}s", title_justify="left")
    t.add_column("figure")
    t.add_column("value", justify="right")
    for key in ("requests", "exact", "refused", "failed", "refusals_waited_out", "reconnects", "late_arrivals"):
        t.add_row(key.replace("_", " "), str(r[key]))
    for key, value in r["tokens"].items():
        t.add_row(f"tokens {key}", str(value))
    t.add_row("faults (proven)", f"{r['faults']} ({r['faults_proven']})")
    for key in ("history_problems", "node_problems", "leaks"):
        t.add_row(key.replace("_", " "), str(len(r[key])))
    t.add_row("passed", str(r["passed"]))
    console.print(t)
    g = Table(title="gaps between two tokens by the fault striking, ms", title_justify="left")
    for col in ("fault", "struck", "proven", "streams", "p50", "p99", "max"):
        g.add_column(col, justify="left" if col == "fault" else "right")
    for kind in sorted(set(r["fault_kinds"]) | set(r["gaps"])):
        f, gap = r["fault_kinds"].get(kind, {}), r["gaps"].get(kind, {})
        g.add_row(
            kind,
            str(f.get("struck", "")),
            str(f.get("proven", "")),
            *(str(gap.get(k, "")) for k in ("streams", "p50_ms", "p99_ms", "max_ms")),
        )
    console.print(g)
    for x in r.get("longest_gaps", []):
        console.print(
            f"longest gap: {x['gap_ms']:.0f} ms at {x['at_s']:.2f}s, request {x['request']} ({x['kind']}) after"
            f" token {x['after_token']}; fault: {x['fault']}"
        )
    for problem in (r["history_problems"] + r["node_problems"] + r["leaks"])[:SHOWN]:
        console.print(f"[bold red]problem:[/] {problem}")
    for failure in r["failures"][:SHOWN]:
        console.print(f"[bold red]failed request:[/] {failure}")
    if not r["passed"]:
        console.print(f"[bold red]soak failed[/]: replay it with --seed {r['seed']}; the fault timeline:")
        for f in r["timeline"]:
            console.print(f"  {f['at_s']:8.2f}s {f['kind']:12} {f['what']} {'' if f['proven'] else '(unproven)'}")
