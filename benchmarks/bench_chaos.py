"""Fault rehearsals with their recovery figures, one `steadfast chaos` run per scenario and dtype (each
starts its own server: the default model, two mixed workers and a hot standby on one node — for
break-transfer a prefill worker and a decode worker on nodes of their own — default leases: 500 ms
renewal, 5 s timeout; `--stop-seconds 8` for stop-worker and slow-worker, a burst of 200 low-priority
streams for overload), 6 greedy streams of 80 tokens, the fault striking at 30 % of the tokens (rollout:
the clients keep sending until it is done; break-transfer: the wire breaks before the streams start).
A row: every stream identical to its undisturbed twin or not, failed streams, the longest wait a client
saw between two tokens (and the same in the undisturbed run), client reconnects, takeovers with the
tokens they adopted and recomputed, live migrations, the scenario's own figures.

    python benchmarks/bench_chaos.py [--dtype bfloat16 float32] [--scenarios kill-worker ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from steadfast.ops.harness.chaos import Scenario

ROOT = Path(__file__).resolve().parent.parent
SERVER = "server: {workers: 2, standby_workers: 1}\n"
SEPARATE = "server: {workers: 0, prefill_workers: 1, decode_workers: 1, decode_node: separate, standby_workers: 1}\n"


def config(scenario: Scenario, dtype: str) -> str:
    return f"model: {{dtype: {dtype}}}\n" + (SEPARATE if scenario is Scenario.BREAK_TRANSFER else SERVER)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--scenarios", nargs="+", default=[s.value for s in Scenario])
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-chaos-"))
    rows: dict[str, dict[str, object]] = {}
    for dtype in args.dtype:
        for scenario in map(Scenario, args.scenarios):
            cfg, out = tmp / f"{dtype}-{scenario}.yaml", tmp / f"{dtype}-{scenario}.json"
            cfg.write_text(config(scenario, dtype))
            cmd = [sys.executable, "-m", "steadfast.ops.cli", "chaos", scenario.value, "--config", str(cfg)]
            run = subprocess.run([*cmd, "--json", str(out)], capture_output=True, text=True, cwd=ROOT)
            got = json.loads(out.read_text()) if out.exists() else {"error": run.stdout[-500:] + run.stderr[-500:]}
            rows[f"{dtype} {scenario}"] = got
            print(dtype, scenario, got, flush=True)
    report = {"command": " ".join(["python", *sys.argv]), "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    report |= {"configs": {"server": SERVER, "break-transfer": SEPARATE}}
    (ROOT / "benchmarks" / "results" / "chaos.json").write_text(json.dumps(report | {"scenarios": rows}, indent=2))


if __name__ == "__main__":
    main()
