"""Fault rehearsals with their recovery figures, one `steadfast chaos` run per scenario (each starts its
own server: the default model and dtype, two mixed workers and a hot standby on one node, default leases
— 500 ms renewal, 5 s timeout — and `--stop-seconds 8` for stop-worker), 6 greedy streams of 80 tokens,
the fault striking at 30 % of the tokens. A row: every stream identical to its undisturbed twin or not,
failed streams, the longest wait a client saw between two tokens (and the same in the undisturbed run),
client reconnects, takeovers with the tokens they adopted and recomputed, live migrations.

    python benchmarks/bench_chaos.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "server: {workers: 2, standby_workers: 1}\n"
SCENARIOS = ["kill-worker", "stop-worker", "kill-router", "kill-pool", "drain"]


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bench-chaos-"))
    cfg = tmp / "chaos.yaml"
    cfg.write_text(CONFIG)
    rows = {}
    for scenario in SCENARIOS:
        out = tmp / f"{scenario}.json"
        cmd = [sys.executable, "-m", "steadfast.ops.cli", "chaos", scenario, "--config", str(cfg), "--json", str(out)]
        run = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        rows[scenario] = (
            json.loads(out.read_text()) if out.exists() else {"error": run.stdout[-500:] + run.stderr[-500:]}
        )
        print(scenario, rows[scenario], flush=True)
    report = {"command": " ".join(["python", *sys.argv]), "when": time.strftime("%Y-%m-%d %H:%M:%S"), "config": CONFIG}
    (ROOT / "benchmarks" / "results" / "chaos.json").write_text(json.dumps(report | {"scenarios": rows}, indent=2))


if __name__ == "__main__":
    main()
