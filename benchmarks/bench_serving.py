"""Serving benchmark: Steadfast through its HTTP API vs `transformers` batched generate, in one run.

For each concurrency level, `concurrency` closed-loop clients of the load generator (`steadfast bench`'s,
`steadfast/ops/harness/loadgen.py`) stream chat completions (fixed output length, EOS ignored, temperature 0)
until `requests` are done; we record TTFT and TPOT per request and
output tokens/s overall. The baseline runs the same prompts through `transformers` `generate` in
batches of `concurrency` (left-padded, same dtype, same output length), timing its first token with a
logits-processor hook. Results are printed as a markdown table and written as JSON.

    python benchmarks/bench_serving.py --concurrency 1 16 64 --max-tokens 128 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import pct, run_info  # noqa: E402
from steadfast.config import default_model_path  # noqa: E402
from steadfast.ops.harness.loadgen import LoadGenerator, Workload  # noqa: E402
from tests.integration.server import ServerProcess  # noqa: E402

TOPICS = [
    "a lighthouse keeper",
    "the history of bread",
    "how rainbows form",
    "a robot learning to paint",
    "the rules of chess",
    "a trip to the mountains",
    "why the sky is blue",
    "a cat who loves jazz",
    "the water cycle",
    "a city under the sea",
    "how vaccines work",
    "an old map",
    "the first computer",
    "a friendly dragon",
    "the moon landing",
    "a garden in winter",
]


def prompts(n: int) -> list[str]:
    return [f"Write a short story about {TOPICS[i % len(TOPICS)]} (number {i})." for i in range(n)]


async def load(
    url: str, model: str, concurrency: int, n_requests: int, max_tokens: int, retry_refused: bool = False
) -> dict:
    """`concurrency` closed-loop clients of the project's load generator (`steadfast bench`'s) stream
    greedy chat completions of exactly `max_tokens` tokens (EOS ignored) until `n_requests` are done;
    `retry_refused`: a request refused for load is sent again after its Retry-After (counted)."""
    work = Workload(
        concurrency=concurrency,
        requests=n_requests,
        output_tokens=[(max_tokens, 1.0)],
        chat=True,
        prompts=tuple(prompts(n_requests)),
        retry_refused=retry_refused,
    )
    gen = LoadGenerator(url, work, model=model)
    samples = await gen.run()
    failed = [s.error or f"HTTP {s.status}" for s in samples if not s.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(samples)} requests failed: {failed[:3]}")
    short = [s.tokens for s in samples if s.tokens != max_tokens]
    if short:
        raise RuntimeError(f"{len(short)} requests did not get {max_tokens} tokens (EOS not ignored?): {short[:5]}")
    results = [
        {"ttft": s.ttft or 0.0, "tpot": s.tpot or 0.0, "tokens": s.tokens, "e2e": s.end - s.sent} for s in samples
    ]
    return summarize(results, gen.wall_s) | {"refusals": sum(s.refusals for s in samples)}


def summarize(results: list[dict], wall: float) -> dict:
    tokens = sum(r["tokens"] for r in results)
    return {
        "requests": len(results),
        "output_tokens": tokens,
        "wall_s": wall,
        "out_tok_s": tokens / wall,
        "ttft_p50_ms": 1000 * pct([r["ttft"] for r in results], 50),
        "ttft_p99_ms": 1000 * pct([r["ttft"] for r in results], 99),
        "tpot_p50_ms": 1000 * pct([r["tpot"] for r in results], 50),
        "tpot_p99_ms": 1000 * pct([r["tpot"] for r in results], 99),
    }


def bench_steadfast(args: argparse.Namespace, extra_yaml: str = "", code_dir: str = "") -> dict[int, dict]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-"))
    cfg = f"model: {{dtype: {args.dtype}}}\ncache: {{kv_memory_mb: 2048}}\n{args.config}\n{extra_yaml}"
    server = ServerProcess(tmp, cfg, code_dir=code_dir)
    out: dict[int, dict] = {}
    try:
        server.wait_ready()
        model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        for c in args.concurrency:
            # Warm-up at this concurrency (kernels for these batch shapes), untimed, like the baseline's.
            asyncio.run(load(server.url, model, c, c, 16))
            n = max(args.min_requests, args.waves * c)
            out[c] = asyncio.run(load(server.url, model, c, n, args.max_tokens))
            print(f"steadfast c={c}: {out[c]}", flush=True)
    finally:
        server.stop()
    return out


def bench_transformers(args: argparse.Namespace) -> dict[int, dict]:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

    path = Path(default_model_path())
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok.padding_side = "left"

    class FirstToken(LogitsProcessor):
        def __init__(self) -> None:
            self.at: float | None = None

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            if self.at is None:
                self.at = time.perf_counter()
            return scores

    out: dict[int, dict] = {}
    for c in args.concurrency:
        n = max(args.baseline_min_requests, c * args.baseline_waves)
        texts = [
            tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in prompts(n)
        ]
        results = []
        warm = tok(texts[:c], return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.inference_mode():  # untimed warm-up at this batch size, like Steadfast's
            model.generate(**warm, max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=tok.pad_token_id)
        t0 = time.perf_counter()
        for i in range(0, n, c):
            batch = tok(texts[i : i + c], return_tensors="pt", padding=True, add_special_tokens=False)
            hook = FirstToken()
            start = time.perf_counter()
            with torch.inference_mode():
                model.generate(
                    **batch,
                    max_new_tokens=args.max_tokens,
                    min_new_tokens=args.max_tokens,
                    do_sample=False,
                    pad_token_id=tok.pad_token_id,
                    logits_processor=LogitsProcessorList([hook]),
                )
            end = time.perf_counter()
            first = hook.at or end
            for _ in range(len(texts[i : i + c])):
                results.append(
                    {
                        "ttft": first - start,
                        "tpot": (end - first) / (args.max_tokens - 1),
                        "tokens": args.max_tokens,
                        "e2e": end - start,
                    }
                )
        out[c] = summarize(results, time.perf_counter() - t0)
        print(f"transformers c={c}: {out[c]}", flush=True)
    return out


def table(variants: dict[str, dict[int, dict]], base: dict[int, dict]) -> str:
    lines = [
        "| concurrency | engine | out tok/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | tok/s vs baseline |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in next(iter(variants.values())):
        rows = [
            (f"steadfast{'' if name == 'default' else f' [{name}]'} (HTTP, streamed)", v[c])
            for name, v in variants.items()
        ]
        if c in base:
            rows.append(("transformers generate (batched)", base[c]))
        for name, r in rows:
            ratio = f"{r['out_tok_s'] / base[c]['out_tok_s']:.2f}x" if c in base else "n/a"
            lines.append(
                f"| {c} | {name} | {r['out_tok_s']:.1f} | {r['ttft_p50_ms']:.0f} ms | {r['ttft_p99_ms']:.0f} ms | "
                f"{r['tpot_p50_ms']:.1f} ms | {r['tpot_p99_ms']:.1f} ms | {ratio} |"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--waves", type=int, default=2, help="requests per level = waves x concurrency")
    p.add_argument("--min-requests", type=int, default=8)
    p.add_argument("--baseline-waves", type=int, default=1)
    p.add_argument("--baseline-min-requests", type=int, default=4)
    p.add_argument("--skip-baseline", action="store_true")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=YAML",
        help="also serve with this config added (flow-style YAML), e.g. 'nice=server: {router_nice: 10}'",
    )
    p.add_argument(
        "--code",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="also serve the Steadfast checkout in DIR (e.g. a git worktree of an older commit), alternating",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="alternate Steadfast and the baseline this many times; the ratios of each round and their median",
    )
    p.add_argument(
        "--config",
        default="",
        metavar="YAML",
        help="config added to every Steadfast served (flow-style YAML), e.g. 'degradation: {enabled: false}' "
        "to measure throughput where the ladder would shed a closed loop's load",
    )
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "serving.json"))
    args = p.parse_args()

    rounds = []
    for i in range(args.rounds):
        runs = [("default", lambda: bench_steadfast(args))]
        for spec in args.variant:
            name, _, extra = spec.partition("=")
            runs.append((name, lambda extra=extra: bench_steadfast(args, extra + "\n")))
        for spec in args.code:
            name, _, where = spec.partition("=")
            runs.append((name, lambda where=where: bench_steadfast(args, code_dir=where)))
        # Every other round in reverse order, so no server always runs first (or last) on a drifting machine.
        measured = dict((name, run()) for name, run in (runs if i % 2 == 0 else runs[::-1]))
        variants = {name: measured[name] for name, _ in runs}
        base = {} if args.skip_baseline else bench_transformers(args)
        rounds.append((variants, base))
        print(table(variants, base), flush=True)
    ratios = {
        c: [v["default"][c]["out_tok_s"] / b[c]["out_tok_s"] for v, b in rounds if c in b] for c in args.concurrency
    }
    # This checkout against each other one served in the same rounds (before vs after a change).
    vs_code = {
        name: {c: [v["default"][c]["out_tok_s"] / v[name][c]["out_tok_s"] for v, _ in rounds] for c in args.concurrency}
        for name in (spec.partition("=")[0] for spec in args.code)
    }
    report = {
        **run_info(args),
        "steadfast": variants["default"],
        "variants": {name: v for name, v in variants.items() if name != "default"},
        "transformers": base,
        "rounds": [{"steadfast": v["default"], "variants": v, "transformers": b} for v, b in rounds],
        "ratio_per_round": ratios,
        "ratio_vs_code_per_round": vs_code,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    if args.rounds > 1:
        for c, rs in ratios.items():
            if rs:
                each = ", ".join(f"{r:.2f}x" for r in rs)
                print(f"c={c}: out tok/s vs baseline per round {each}; median {statistics.median(rs):.2f}x")
    for name, per_c in vs_code.items():
        for c, rs in per_c.items():
            each = ", ".join(f"{r:.2f}x" for r in rs)
            print(f"c={c}: out tok/s vs {name} per round {each}; median {statistics.median(rs):.2f}x")


if __name__ == "__main__":
    main()
