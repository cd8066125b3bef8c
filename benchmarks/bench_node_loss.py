"""Recovery after a node loss across hosts, against the lease timeout: a router part and two node parts
in network namespaces (tests/hosts.py; loopback where they cannot be made), their ledgers and records in a
3-member etcd cluster. A greedy stream decodes on one node; at its 16th token that node's whole host is
frozen (SIGSTOP). Measured per round: how long until the router fenced the node and moved the stream
(detection: the node's etcd lease ends on etcd's clock), how long the other node took to its first token
(a rebuild of prompt and delivered tokens), and the client's gap: from the freeze to the first token the
new owner made. Each lease timeout in one invocation, rounds alternating between them.

    python benchmarks/bench_node_loss.py --ttls 2 4 8 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import run_info  # noqa: E402
from steadfast.config import default_model_path  # noqa: E402
from tests.deployment import Deployment  # noqa: E402
from tests.small_gguf import truncate  # noqa: E402

PROMPT = "Write a long story about a lighthouse keeper and the ships she guided home."


def config(ttl_s: int) -> str:
    return (
        "cache: {kv_memory_mb: 128}\n"
        "server: {workers: 1, standby_workers: 1, threads_per_worker: 1}\n"
        f"fault_recovery: {{lease: {{renew_interval_ms: 300, lease_timeout_ms: {ttl_s * 1000}}}}}\n"
    )


def one_loss(d: Deployment, tokens: int) -> dict[str, float]:
    """Stream, freeze the owner's host at the 16th token, let it go on once the stream ended; the figures."""
    model = httpx.get(d.url + "/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "stream": True}
    body |= {"ignore_eos": True, "return_token_ids": True}
    arrivals: list[float] = []
    frozen: list[int] = []
    owner: dict = {}
    stopped = 0.0
    try:
        with httpx.stream("POST", d.url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ids = json.loads(line[6:])["choices"][0].get("token_ids") or []
                arrivals += [time.time()] * len(ids)
                if len(arrivals) >= 16 and not frozen:
                    owner = next(w for w in d.workers() if w["in_flight"])
                    stopped = time.time()
                    frozen = d.stop_host(d.host_of(owner["pid"]))
    finally:
        d.continue_host(frozen)
    assert len(arrivals) == tokens, f"{len(arrivals)} of {tokens} tokens"
    move = next(t for t in reversed(d.admin("/admin/takeovers")) if t["from_worker"] == owner["id"])
    node = owner["node"]
    d.wait(lambda: d.ready() and len([w for w in d.workers() if w["node"] == node]) == 2, 60, "the node back")
    return {
        "detected_s": move["at"] - stopped,
        "first_token_s": move["first_token_ms"] / 1000,
        "client_gap_s": arrivals[move["at_token"]] - stopped,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ttls", type=int, nargs="+", default=[2, 4, 8], help="lease timeouts, seconds")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tokens", type=int, default=600, help="the stream's length (it must outlast the loss)")
    p.add_argument("--layers", type=int, default=0, help="cut the model to this many layers (0: the whole model)")
    p.add_argument("--model", default="")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "node_loss.json"))
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-node-loss-"))
    model = args.model or default_model_path()
    if args.layers:
        truncate(model, str(tmp / "model.gguf"), args.layers)
        model = str(tmp / "model.gguf")
    deployments = {}
    samples: dict[int, list[dict[str, float]]] = {ttl: [] for ttl in args.ttls}
    try:
        for ttl in args.ttls:
            (tmp / f"ttl{ttl}").mkdir()
            deployments[ttl] = Deployment(tmp / f"ttl{ttl}", model, config(ttl)).start()
        for r in range(args.rounds):
            for ttl in args.ttls:
                samples[ttl].append(one_loss(deployments[ttl], args.tokens))
                print(f"round {r + 1}, lease {ttl} s: {samples[ttl][-1]}", flush=True)
    finally:
        for d in deployments.values():
            d.stop()
    hosts = "network namespaces" if not next(iter(deployments.values())).hosts.why_not else "loopback"
    print(f"hosts: {hosts}")
    lines = [
        "| lease timeout | detected (fenced, moved) | new owner's first token | client's gap | gap ÷ timeout |",
        "|---|---|---|---|---|",
    ]
    summary = {}
    for ttl, rows in samples.items():
        med = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
        summary[ttl] = {"median": med, "rounds": rows}
        lines.append(
            f"| {ttl} s | {med['detected_s']:.2f} s | {1000 * med['first_token_s']:.0f} ms | "
            f"{med['client_gap_s']:.2f} s | {med['client_gap_s'] / ttl:.2f} |"
        )
    print("\n".join(lines))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({**run_info(args), "hosts": hosts, "by_ttl_s": summary}, indent=2))


if __name__ == "__main__":
    main()
