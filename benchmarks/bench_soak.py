"""The nemesis soak with the default model (`steadfast chaos soak`'s library): a deployment of two nodes on
this host (a prefill and a mixed worker on node 0, a decode worker on node 1, a standby on each), bf16
with `model.deterministic` (token identity whatever the batch) or fp32, open-loop traffic at `--rate`,
a fault every `--fault-every` seconds on average from the seed's schedule, every kind unless `--kinds`.
Writes the report as JSON (with how it was made) and the timeline of faults against gaps as a PNG.

    python benchmarks/bench_soak.py --seconds 3600 --seed 1 [--dtype bfloat16] [--rate 2] [--fault-every 10]

With `--hosts`: a router part and two node parts in network namespaces, their ledgers and records in a
3-member etcd cluster (benchmarks/soak_hosts.py), etcd member and leader kills, node freeze and partition
among the faults.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import run_info  # noqa: E402
from benchmarks.soak_hosts import HOST_FAULTS, HostDeployment  # noqa: E402
from steadfast.config import Config, default_model_path, load_config  # noqa: E402
from steadfast.ops.harness.soak import SoakPlan  # noqa: E402
from steadfast.ops.harness.soak_cli import show  # noqa: E402
from steadfast.ops.harness.soak_run import plot, run_soak  # noqa: E402

CONFIG = (
    "model: {{dtype: {dtype}, deterministic: {deterministic}}}\n"
    "server: {{workers: 1, prefill_workers: 1, decode_workers: 1, decode_node: separate, standby_workers: 1}}\n"
)
# Across hosts: each node part a serving worker and a standby; a node whose supervisor does not renew its
# etcd lease within 3 s is taken for lost (what freeze-node and partition must outlast).
HOSTS_CONFIG = (
    "model: {{dtype: {dtype}, deterministic: {deterministic}}}\n"
    "server: {{workers: 1, standby_workers: 1, threads_per_worker: 1}}\n"
    "fault_recovery: {{lease: {{renew_interval_ms: 300, lease_timeout_ms: 3000}}}}\n"
)
# Across hosts: no KV wire between them yet (issue 51), so no kv-link; a rollout of node parts' workers is
# the node's own (not the router's) to do.
HOSTS_KINDS = "kill-worker,stop-worker,kill-router,freeze-router,kill-pool,migrate,slow-worker,overload"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--rate", type=float, default=2.0)
    p.add_argument("--fault-every", type=float, default=10.0)
    p.add_argument("--kinds", default="")
    p.add_argument("--model", default="", help="a llama GGUF (default: the default model)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "soak.json"))
    p.add_argument(
        "--hosts",
        action="store_true",
        help="a router part and two node parts in network namespaces, with etcd; etcd and node faults added",
    )
    args = p.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="bench-soak-"))
    path = folder / "soak.yaml"
    deterministic = "true" if args.dtype == "bfloat16" else "false"
    path.write_text((HOSTS_CONFIG if args.hosts else CONFIG).format(dtype=args.dtype, deterministic=deterministic))
    cfg = load_config(str(path), {"model": {"path": args.model}} if args.model else None)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    plan = SoakPlan(args.seed, args.seconds, args.rate, fault_every_s=args.fault_every, kinds=kinds)

    def log(message: str) -> None:
        print(message, file=sys.stderr)

    if args.hosts:
        result = soak_across_hosts(cfg, plan, folder, path, log)
    else:
        result = run_soak(cfg, plan, folder, str(path), args.model, log=log)
    plot(result, str(Path(args.out).with_suffix(".png")))
    show(result)
    report = {k: v for k, v in result.items() if k != "_plot"} | {"run": run_info(args)}
    Path(args.out).write_text(json.dumps(report, indent=2))
    return 0 if result["passed"] else 1


def soak_across_hosts(cfg: Config, plan: SoakPlan, folder: Path, path: Path, log: Callable[[str], None]) -> dict:
    """The soak on a deployment over network-namespace hosts: its etcd and node faults beside the
    nemesis' own (all of both unless `--kinds`)."""
    if not plan.kinds:
        plan = replace(plan, kinds=(*HOSTS_KINDS.split(","), *HOST_FAULTS))
    model = cfg.model.path or default_model_path()

    def deploy(env: dict[str, str]) -> HostDeployment:
        return HostDeployment(folder, model, path.read_text(), env)

    return run_soak(cfg, plan, folder, log=log, deploy=deploy)


if __name__ == "__main__":
    sys.exit(main())
