"""Offload-tier benchmark: `steadfast serve` with a fixed arena, without and with the host tier, in one run.

1. **Idle chat sessions.** `--sessions` sessions each hold a long context of their own (a document they
   chat about, `--context` tokens, distinct from the first block on); `--concurrency` closed-loop clients
   each pick a session at random (seeded), send one more turn (the context and a short new question)
   and read `--turn-tokens` tokens. Between its turns a session is idle: whether its context is still
   cached (in the arena, or in the tier) decides whether the turn recomputes it. Reported per mode: the
   share of turns whose context came from cache, the sessions that amounts to (sessions × that share:
   those whose KV the server keeps), TPOT p50/p99 and TTFT p50/p99.
2. **Preemption under KV pressure.** `--pressure-requests` greedy requests at once, each needing
   `--pressure-context` + `--pressure-tokens` tokens of KV, in an arena of `--pressure-blocks`: requests
   are preempted. Without a tier they are recomputed; with it, swapped. Reported: preemptions by kind,
   tokens recomputed, output tokens/s; outputs must be identical in both modes.

Modes alternate order between rounds. Results are printed and written as JSON.

    python benchmarks/bench_offload.py --rounds 2
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import pct, prompt_of, run_info  # noqa: E402
from steadfast.config import default_model_path  # noqa: E402
from steadfast.model.tokenizer import GGUFTokenizer  # noqa: E402
from tests.integration.server import ServerProcess  # noqa: E402


def server_yaml(blocks: int, tier: str, tier_blocks: int = 0) -> str:
    cache = f"num_blocks: {blocks}, offload_tier: {tier}"
    if tier_blocks:
        cache += f", offload_blocks: {tier_blocks}"
    return f"cache: {{{cache}}}\nserver: {{standby_workers: 0}}\n"


def complete(url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed greedy completion: its tokens, TTFT, TPOT and the prompt tokens served from cache."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    arrivals: list[float] = []
    tokens: list[int] = []
    cached = 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            now = time.perf_counter()
            for choice in chunk.get("choices", []):
                got = choice.get("token_ids", [])
                arrivals.extend(now for _ in got)
                tokens.extend(got)
            usage = chunk.get("usage") or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", cached)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return {
        "tokens": tokens,
        "ttft": arrivals[0] - t0 if arrivals else float("nan"),
        "tpot": statistics.mean(gaps) if gaps else float("nan"),
        "cached": cached,
    }


def workers(url: str) -> list[dict]:
    return httpx.get(url + "/admin/workers", timeout=10).json()


def sessions_run(url: str, model: str, tok: GGUFTokenizer, args: argparse.Namespace, seed: int) -> dict:
    contexts = [prompt_of(tok, args.context, tag=f"session {i}") for i in range(args.sessions)]
    rng = random.Random(seed)
    plan = [rng.randrange(args.sessions) for _ in range(args.turns)]
    busy: set[int] = set()
    lock = threading.Lock()
    turns: list[dict] = []

    def client(k: int) -> None:
        while True:
            with lock:
                free = [i for i, s in enumerate(plan) if s not in busy and s >= 0]
                if not free:
                    if all(s < 0 for s in plan):
                        return
                    pick = None
                else:
                    pick = free[0]
                    session, plan[pick] = plan[pick], -1
                    busy.add(session)
            if pick is None:
                time.sleep(0.01)
                continue
            question = tok.encode(f" Question {pick} about it, from client {k}:")
            out = complete(url, model, contexts[session] + question, args.turn_tokens)
            out["hit"] = out["cached"] >= args.context - 16  # the context, but for its last partial block
            with lock:
                busy.discard(session)
                turns.append(out)

    # One turn per session first, so every context has been computed once before anything is counted.
    for i in range(args.sessions):
        complete(url, model, contexts[i] + tok.encode(" Warm-up:"), 2)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    hits = sum(t["hit"] for t in turns) / len(turns)
    return {
        "hit_rate": hits,
        "sessions_kept": hits * args.sessions,
        "tpot_p50_ms": 1000 * pct([t["tpot"] for t in turns], 50),
        "tpot_p99_ms": 1000 * pct([t["tpot"] for t in turns], 99),
        "ttft_p50_ms": 1000 * pct([t["ttft"] for t in turns], 50),
        "ttft_p99_ms": 1000 * pct([t["ttft"] for t in turns], 99),
        "tok_s": sum(len(t["tokens"]) for t in turns) / wall,
    }


def pressure_run(url: str, model: str, tok: GGUFTokenizer, args: argparse.Namespace) -> dict:
    prompts = [prompt_of(tok, args.pressure_context, tag=f"pressure {i}") for i in range(args.pressure_requests)]
    results: list[dict | None] = [None] * len(prompts)

    def one(i: int) -> None:
        results[i] = complete(url, model, prompts[i], args.pressure_tokens)

    before = workers(url)[0]
    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    after = workers(url)[0]
    delta = {k: after[k] - before[k] for k in ("swap_preemptions", "recompute_preemptions", "recomputed_tokens")}
    return delta | {
        "tok_s": sum(len(r["tokens"]) for r in results if r) / wall,
        "tokens": [r["tokens"] for r in results if r],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--blocks", type=int, default=192, help="arena blocks for the session load")
    p.add_argument("--sessions", type=int, default=24)
    p.add_argument("--context", type=int, default=160)
    p.add_argument("--turns", type=int, default=96)
    p.add_argument("--turn-tokens", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--pressure-blocks", type=int, default=96)
    p.add_argument("--pressure-requests", type=int, default=12)
    p.add_argument("--pressure-context", type=int, default=160)
    p.add_argument("--pressure-tokens", type=int, default=96)
    p.add_argument("--pressure-tier-blocks", type=int, default=0, help="the tier's size (0: the 25 %% share)")
    p.add_argument("--skip", nargs="*", default=[], choices=["sessions", "pressure"])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "offload.json"))
    args = p.parse_args()
    tok = GGUFTokenizer.from_gguf(default_model_path())
    modes = ["none", "host"]
    rows: dict[str, dict[str, list[dict]]] = {"sessions": {m: [] for m in modes}, "pressure": {m: [] for m in modes}}
    for rnd in range(args.rounds):
        for mode in modes if rnd % 2 == 0 else modes[::-1]:
            for part in ("sessions", "pressure"):
                if part in args.skip:
                    continue
                blocks = args.blocks if part == "sessions" else args.pressure_blocks
                tier_blocks = args.pressure_tier_blocks if part == "pressure" else 0
                with tempfile.TemporaryDirectory(prefix="steadfast-bench-offload-") as tmp:
                    server = ServerProcess(Path(tmp), server_yaml(blocks, mode, tier_blocks))
                    try:
                        server.wait_ready()
                        model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
                        if part == "sessions":
                            r = sessions_run(server.url, model, tok, args, seed=rnd)
                        else:
                            r = pressure_run(server.url, model, tok, args)
                        w = workers(server.url)[0]
                        r |= {"offload_written": w["offload_written"], "offload_fetched": w["offload_fetched"]}
                    finally:
                        server.stop()
                rows[part][mode].append(r)
                shown = {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items() if k != "tokens"}
                print(f"round {rnd} {part} {mode}: {shown}", flush=True)
    summary: dict[str, dict] = {}
    if rows["sessions"]["none"]:
        s = rows["sessions"]
        med = {m: {k: statistics.median(r[k] for r in s[m]) for k in s[m][0]} for m in modes}
        summary["sessions"] = med | {
            "sessions_ratio": med["host"]["sessions_kept"] / max(med["none"]["sessions_kept"], 1e-9),
            "tpot_p99_ratio": med["host"]["tpot_p99_ms"] / med["none"]["tpot_p99_ms"],
        }
    if rows["pressure"]["none"]:
        pr = rows["pressure"]
        identical = all(a["tokens"] == b["tokens"] for a, b in zip(pr["none"], pr["host"], strict=True))
        med = {m: {k: statistics.median(r[k] for r in pr[m]) for k in pr[m][0] if k != "tokens"} for m in modes}
        summary["pressure"] = med | {
            "outputs_identical": identical,
            "tok_s_ratio": med["host"]["tok_s"] / med["none"]["tok_s"],
        }
        for m in modes:
            for r in pr[m]:
                del r["tokens"]
    print(json.dumps(summary, indent=1))
    Path(args.out).write_text(json.dumps({"run": run_info(args), "summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
