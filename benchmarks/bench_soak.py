"""The nemesis soak with the default model (`steadfast chaos soak`'s library): a deployment of two nodes on
this host (a prefill and a mixed worker on node 0, a decode worker on node 1, a standby on each), bf16
with `model.deterministic` (token identity whatever the batch) or fp32, open-loop traffic at `--rate`,
a fault every `--fault-every` seconds on average from the seed's schedule, every kind unless `--kinds`.
Writes the report as JSON (with how it was made) and the timeline of faults against gaps as a PNG.

    python benchmarks/bench_soak.py --seconds 3600 --seed 1 [--dtype bfloat16] [--rate 2] [--fault-every 10]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import run_info  # noqa: E402
from steadfast.config import load_config  # noqa: E402
from steadfast.ops.harness.soak import SoakPlan  # noqa: E402
from steadfast.ops.harness.soak_cli import show  # noqa: E402
from steadfast.ops.harness.soak_run import plot, run_soak  # noqa: E402

CONFIG = (
    "model: {{dtype: {dtype}, deterministic: {deterministic}}}\n"
    "server: {{workers: 1, prefill_workers: 1, decode_workers: 1, decode_node: separate, standby_workers: 1}}\n"
)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--rate", type=float, default=2.0)
    p.add_argument("--fault-every", type=float, default=10.0)
    p.add_argument("--kinds", default="")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "soak.json"))
    args = p.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="bench-soak-"))
    path = folder / "soak.yaml"
    deterministic = "true" if args.dtype == "bfloat16" else "false"
    path.write_text(CONFIG.format(dtype=args.dtype, deterministic=deterministic))
    cfg = load_config(str(path))
    kinds = tuple(k for k in args.kinds.split(",") if k)
    plan = SoakPlan(args.seed, args.seconds, args.rate, fault_every_s=args.fault_every, kinds=kinds)
    result = run_soak(cfg, plan, folder, str(path), log=lambda m: print(m, file=sys.stderr))
    plot(result, str(Path(args.out).with_suffix(".png")))
    show(result)
    report = {k: v for k, v in result.items() if k != "_plot"} | {"run": run_info(args)}
    Path(args.out).write_text(json.dumps(report, indent=2))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
