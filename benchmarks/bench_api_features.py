"""What the API's features cost, each against plain requests on the same server in the same run (issue 50):
output tok/s of chat streams under a JSON schema and with logprobs, against unconstrained ones, at each
concurrency. Arms alternate within every round (reversed every other round) so no arm always runs on a
warmer or a quieter machine; the ratios of each round and their median are reported.

The schema is one no output finishes within `--max-tokens` (an array of at least 60 records), so every
token of every request is sampled under a live grammar mask, never under the EOS-only mask of a finished one.

Then `n`: one request of `n` = 4 choices on a long prompt against four concurrent requests of the same prompt
(seeds s..s+3, what the choices are), wall time until all four are done, each pair on a prompt of its own (a
fresh tag first: no arm finds the other's prompt in the prefix cache).

    python benchmarks/bench_api_features.py --concurrency 1 16 --max-tokens 128 --rounds 3
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_serving import prompts  # noqa: E402
from benchmarks.common import run_info  # noqa: E402
from steadfast.ops.harness.loadgen import LoadGenerator, Workload, summarize  # noqa: E402
from tests.integration.server import ServerProcess  # noqa: E402

SCHEMA = {
    "type": "array",
    "minItems": 60,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["keeper", "sailor", "baker", "painter"]},
        },
        "required": ["name", "age", "role"],
        "additionalProperties": False,
    },
}
ARMS = {
    "plain": {},
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "crew", "schema": SCHEMA}}},
    "logprobs": {"logprobs": True, "top_logprobs": 5},
}


async def arm(url: str, model: str, extra: dict, concurrency: int, requests: int, max_tokens: int) -> dict:
    work = Workload(
        concurrency=concurrency,
        requests=requests,
        output_tokens=[(max_tokens, 1.0)],
        chat=True,
        prompts=tuple(f"{p} Answer as JSON." for p in prompts(requests)),
        extra=extra,
    )
    gen = LoadGenerator(url, work, model=model)
    samples = await gen.run()
    bad = [s.error or f"HTTP {s.status}" for s in samples if not s.ok or s.tokens != max_tokens]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(samples)} requests failed or were short: {bad[:3]}")
    return summarize(samples, gen.wall_s) | {"out_tok_s": sum(s.tokens for s in samples) / gen.wall_s}


def filler(tokens: int, tag: str) -> str:
    words = ("the harbour kept its habits through every season and the boats came in at dusk " * 400).split()
    return f"[{tag}] " + " ".join(words[:tokens])  # (one token a word for this text: 1,200 words were 1,206)


def n_round(url: str, model: str, n: int, prompt_tokens: int, max_tokens: int, tag: str) -> dict[str, float]:
    """Seconds until all `n` completions are done: as one request of `n` choices, and as `n` requests."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.8, "ignore_eos": True}
    out = {}
    with httpx.Client(timeout=600) as c:
        t0 = time.perf_counter()
        r = c.post(
            url + "/v1/completions", json=body | {"prompt": filler(prompt_tokens, f"{tag}-n"), "n": n, "seed": 7}
        )
        r.raise_for_status()
        out["one_request_s"] = time.perf_counter() - t0
        out["prompt_tokens"] = r.json()["usage"]["prompt_tokens"]
        # One choice alone on a new prompt of that length: the floor of `n` choices (extra choices for free),
        # so separate_s / this is the most any way of serving `n` could gain over the separate requests.
        t0 = time.perf_counter()
        c.post(url + "/v1/completions", json=body | {"prompt": filler(prompt_tokens, f"{tag}-one")}).raise_for_status()
        out["one_choice_s"] = time.perf_counter() - t0
    prompt = filler(prompt_tokens, f"{tag}-separate")

    async def separate() -> int:
        """The prompt tokens the separate requests computed (the rest came from the prefix cache)."""
        async with httpx.AsyncClient(timeout=600) as c:
            answers = await asyncio.gather(
                *(c.post(url + "/v1/completions", json=body | {"prompt": prompt, "seed": 7 + i}) for i in range(n))
            )
            computed = 0
            for a in answers:
                a.raise_for_status()
                used = a.json()["usage"]
                computed += used["prompt_tokens"] - used["prompt_tokens_details"]["cached_tokens"]
            return computed

    t0 = time.perf_counter()
    out["separate_computed_prompt_tokens"] = asyncio.run(separate())
    out["separate_s"] = time.perf_counter() - t0
    out["speedup"] = out["separate_s"] / out["one_request_s"]
    out["speedup_bound"] = out["separate_s"] / out["one_choice_s"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--waves", type=int, default=2, help="requests per arm and level = waves x concurrency")
    p.add_argument("--min-requests", type=int, default=6)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--n-prompt-tokens", type=int, default=1500)
    p.add_argument("--n-max-tokens", type=int, default=32)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "api_features.json"))
    args = p.parse_args()

    # The ladder off: a closed loop of 16 on this machine is overload it would shed (not what is measured).
    cfg = f"model: {{dtype: {args.dtype}}}\ncache: {{kv_memory_mb: 2048}}\ndegradation: {{enabled: false}}\n"
    server = ServerProcess(Path(tempfile.mkdtemp(prefix="bench-api-")), cfg)
    rounds: list[dict[int, dict[str, dict]]] = []
    try:
        server.wait_ready()
        model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        for c in args.concurrency:  # warm-up: kernels for these batch shapes, the grammar compiled once
            for extra in ARMS.values():
                asyncio.run(arm(server.url, model, extra, c, c, 8))
        for i in range(args.rounds):
            names = list(ARMS) if i % 2 == 0 else list(ARMS)[::-1]
            measured: dict[int, dict[str, dict]] = {}
            for c in args.concurrency:
                n = max(args.min_requests, args.waves * c)
                measured[c] = {
                    name: asyncio.run(arm(server.url, model, ARMS[name], c, n, args.max_tokens)) for name in names
                }
                line = ", ".join(f"{name} {measured[c][name]['out_tok_s']:.1f}" for name in ARMS)
                print(f"round {i + 1} c={c}: out tok/s {line}", flush=True)
            rounds.append(measured)
        n_rounds = []
        for i in range(args.rounds):
            one = n_round(server.url, model, args.n, args.n_prompt_tokens, args.n_max_tokens, f"round{i}")
            print(f"round {i + 1} n={args.n}: {one}", flush=True)
            n_rounds.append(one)
    finally:
        server.stop()
    ratios = {
        c: {
            name: [r[c][name]["out_tok_s"] / r[c]["plain"]["out_tok_s"] for r in rounds]
            for name in ARMS
            if name != "plain"
        }
        for c in args.concurrency
    }
    for c, per in ratios.items():
        for name, rs in per.items():
            each = ", ".join(f"{r:.3f}x" for r in rs)
            print(f"c={c}: {name} vs plain out tok/s per round {each}; median {statistics.median(rs):.3f}x")
    speedups = [r["speedup"] for r in n_rounds]
    each = ", ".join(f"{x:.2f}x" for x in speedups)
    median = statistics.median(speedups)
    print(f"n={args.n}: one request vs {args.n} separate, faster per round {each}; median {median:.2f}x")
    bounds = ", ".join(f"{r['speedup_bound']:.2f}x" for r in n_rounds)
    print(f"n={args.n}: the bound (one choice alone vs {args.n} separate) per round {bounds}")
    report = {
        **run_info(args),
        "arms": ARMS,
        "rounds": rounds,
        "ratio_vs_plain_per_round": ratios,
        "n_rounds": n_rounds,
        "n_speedup_per_round": speedups,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
