"""Recovery benchmark: time from `kill -9` of the worker serving a stream to the next token its client
receives, per context length, `ledger_first` vs `rebuild` in one run, plus tokens recomputed per
recovery (from the router's takeover records).

For each mode a `steadfast serve` runs with hot standbys. Each kill, from steady state (every worker
ready, none loading): a greedy stream with a prompt of the given length decodes; once it has a random
number of tokens, the active worker is SIGKILLed; the client's clock gives kill → next token. The server
promotes a standby and starts a new one (whose load is then waited out before the next kill).

    python benchmarks/bench_recovery.py --contexts 128 512 2048 --kills 20
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import Stream, pct, prompt_of, run_info, wait_until  # noqa: E402
from steadfast.config import default_model_path  # noqa: E402
from steadfast.model.tokenizer import GGUFTokenizer  # noqa: E402
from tests.integration.server import ServerProcess  # noqa: E402


def workers(server: ServerProcess) -> list[dict]:
    return httpx.get(server.url + "/admin/workers", timeout=10).json()


def run_mode(args: argparse.Namespace, mode: str, tokenizer: GGUFTokenizer, rng: random.Random) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix=f"bench-recovery-{mode}-"))
    cfg = (
        f"model: {{dtype: {args.dtype}}}\n"
        "cache: {kv_memory_mb: 1024}\n"
        f"server: {{standby_workers: {args.standbys}}}\n"
        f"fault_recovery: {{kv_cache: {{recovery_mode: {mode}}}}}\n"
    )
    server = ServerProcess(tmp, cfg)
    results: dict[int, dict] = {}
    try:
        server.wait_ready()
        model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        for ctx in args.contexts:
            prompt = prompt_of(tokenizer, ctx)
            latencies, overheads, recomputed, adopted, routes = [], [], [], [], []
            for _ in range(args.kills):
                # Steady state: a ready standby and no replacement still loading (a load takes both
                # cores for seconds; a kill during the last kill's recovery measures something else).
                ws = wait_until(
                    lambda: (
                        (w := workers(server))
                        and any(x["role"] == "standby" for x in w)
                        and all(x["state"] == "ready" for x in w)
                        and w
                    ),
                    180,
                )
                (victim,) = [w for w in ws if w["role"] == "mixed"]
                stream = Stream(server.url, model, prompt, args.max_tokens)
                stream.start()
                at = rng.randint(4, args.max_tokens // 2)
                wait_until(lambda s=stream, a=at: len(s.arrivals) >= a or s.error, 300)
                have = len(stream.arrivals)
                t_kill = time.perf_counter()
                os.kill(victim["pid"], signal.SIGKILL)
                stream.join(timeout=600)
                if stream.error or len(stream.arrivals) != args.max_tokens:
                    raise RuntimeError(f"stream failed after the kill: {stream.error}, {len(stream.arrivals)} tokens")
                latencies.append(1000 * (stream.arrivals[have] - t_kill))
                # What the kill added: the wait minus this stream's usual token interval before it.
                gaps = sorted(b - a for a, b in zip(stream.arrivals[: have - 1], stream.arrivals[1:have], strict=True))
                overheads.append(latencies[-1] - 1000 * gaps[len(gaps) // 2])
                record = [
                    t for t in httpx.get(server.url + "/admin/takeovers").json() if t["from_worker"] == victim["id"]
                ]
                if record:
                    recomputed.append(record[-1]["recomputed_tokens"])
                    adopted.append(record[-1]["adopted_tokens"])
                    routes.append(record[-1]["route"])
            results[ctx] = {
                "kills": len(latencies),
                "kill_to_next_token_ms_p50": pct(latencies, 50),
                "kill_to_next_token_ms_p99": pct(latencies, 99),
                "added_by_kill_ms_p50": pct(overheads, 50),
                "added_by_kill_ms_p99": pct(overheads, 99),
                "recomputed_tokens_mean": sum(recomputed) / max(1, len(recomputed)),
                "adopted_tokens_mean": sum(adopted) / max(1, len(adopted)),
                "routes": {r: routes.count(r) for r in sorted(set(routes))},
                "latencies_ms": latencies,
            }
            print(f"{mode} ctx={ctx}: {results[ctx]}", flush=True)
    finally:
        server.stop()
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 2048])
    p.add_argument("--kills", type=int, default=20, help="kills per context length and mode")
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--standbys", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--modes", nargs="+", default=["ledger_first", "rebuild"])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "recovery.json"))
    args = p.parse_args()
    tokenizer = GGUFTokenizer.from_gguf(default_model_path())
    rng = random.Random(4)
    report = {
        **run_info(args),
        "modes": {mode: run_mode(args, mode, tokenizer, rng) for mode in args.modes},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(
        "| context | mode | kills | kill → next token p50 | p99 | added by the kill p50 | p99 | "
        "tokens recomputed (mean) | KV adopted (mean) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for ctx in args.contexts:
        for mode, res in report["modes"].items():
            r = res[ctx]
            print(
                f"| {ctx} | {mode} | {r['kills']} | {r['kill_to_next_token_ms_p50']:.0f} ms | "
                f"{r['kill_to_next_token_ms_p99']:.0f} ms | {r['added_by_kill_ms_p50']:.0f} ms | "
                f"{r['added_by_kill_ms_p99']:.0f} ms | {r['recomputed_tokens_mean']:.0f} | "
                f"{r['adopted_tokens_mean']:.0f} |"
            )


if __name__ == "__main__":
    main()
