"""Speculative decoding by prompt lookup, on vs off, in-process, same run: output tokens per second,
acceptance rate and tokens per request-step, at concurrency 1 and 16, on repetitive work (editing,
renaming, reformatting a given text or code: the answer repeats much of the prompt) and on free text.

One loaded model; per round and concurrency a fresh engine per mode. Concurrency 1: the workload's
prompts one after another, each prompt run in both modes back to back (which goes first alternating):
this machine's speed drifts by 20-30 % over tens of seconds, and pairing each prompt's two runs in time
keeps the drift out of the ratio. 16: sixteen requests at once (the prompts repeated), the modes
alternating which goes first per round. Greedy, `--max-tokens` each, EOS honoured (both modes produce
the same tokens, which the benchmark checks). The figure is the ratio of the two modes' medians over the rounds.

    python benchmarks/bench_speculative.py --rounds 3
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import run_info  # noqa: E402
from steadfast.config import Config  # noqa: E402
from steadfast.wire.worker import AddRequest, SamplingParams  # noqa: E402
from steadfast.worker.engine import Engine  # noqa: E402
from steadfast.worker.loaded import LoadedModel, load_model, private_arena  # noqa: E402

CODE = """def merge_sorted(a, b):
    result = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            result.append(a[i])
            i += 1
        else:
            result.append(b[j])
            j += 1
    result.extend(a[i:])
    result.extend(b[j:])
    return result
"""
CONFIG = """server:
  host: 127.0.0.1
  port: 8000
  workers: 2
cache:
  block_size: 16
  kv_memory_mb: 1024
"""
PARAGRAPH = (
    "The lighthouse keeper have logged the weather every hour of the long night, and he write down the "
    "wind, the rain and the waves that was crashing on the rocks below his tower."
)
WORKLOADS = {
    "repetitive": [
        "Rename the function merge_sorted to merge_lists in this code and return the whole code:\n\n" + CODE,
        "Add a docstring to this function and return the whole function:\n\n" + CODE,
        "Change the port to 9000 in this YAML file and return the whole file:\n\n" + CONFIG,
        "Correct the grammar of this paragraph and return it in full: " + PARAGRAPH,
        "Return this text with every sentence on its own line: " + PARAGRAPH,
        "Rewrite this code with type hints and return it:\n\n" + CODE,
        "Copy this list back to me, one item per line: apples, bananas, cherries, dates, elderberries, figs, "
        "grapes, honeydew, kiwis, lemons, mangoes.",
        "Change workers to 4 in this YAML file and return the whole file:\n\n" + CONFIG,
    ],
    "free": [
        "Tell me a story about a dragon who learns to sing.",
        "Why is the sky blue? Explain it to a child.",
        "Write a short poem about autumn in the city.",
        "What are three good habits for staying healthy?",
        "Describe a day in the life of a lighthouse keeper.",
        "Give me some ideas for a birthday party in the garden.",
        "Explain how a bicycle stays upright.",
        "Write a letter to a friend who moved to another country.",
    ],
}


def run_paired(engines: dict[str, Engine], loaded: LoadedModel, prompts: list[str], max_tokens: int) -> dict:
    """Concurrency 1, each prompt in every mode back to back (which first alternating): per mode, what
    `run` returns."""
    out = {m: {"seconds": 0.0, "tokens": [], "output_tokens": 0} for m in engines}
    for i, prompt in enumerate(prompts):
        order = list(engines) if i % 2 == 0 else list(engines)[::-1]
        for mode in order:
            r = run(engines[mode], loaded, [prompt], 1, max_tokens)
            out[mode]["seconds"] += r["seconds"]
            out[mode]["tokens"] += r["tokens"]
            out[mode]["output_tokens"] += r["output_tokens"]
    return out


def run(engine: Engine, loaded: LoadedModel, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    reqs = [
        AddRequest(
            f"r{i}-{uuid.uuid4().hex[:6]}",
            loaded.tokenizer.encode_chat([{"role": "user", "content": prompts[i % len(prompts)]}]),
            SamplingParams(max_tokens, 0.0),
        )
        for i in range(len(prompts) if concurrency == 1 else concurrency)
    ]
    t0 = time.perf_counter()
    outputs = {}
    if concurrency == 1:
        for r in reqs:
            outputs |= engine.generate([r])
    else:
        outputs = engine.generate(reqs)
    seconds = time.perf_counter() - t0
    tokens = [[t for o in outputs[r.request_id] for t in o.token_ids] for r in reqs]
    return {"seconds": seconds, "tokens": tokens, "output_tokens": sum(map(len, tokens))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--draft-tokens", type=int, default=4)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "speculative.json"))
    args = p.parse_args()
    base = Config().replace(model={"dtype": args.dtype, "device": "cpu"}, cache={"kv_memory_mb": 1024})
    loaded = load_model(base)
    modes = {
        "off": base.replace(speculative={"method": "off"}),
        "ngram": base.replace(speculative={"method": "ngram", "num_draft_tokens": args.draft_tokens}),
    }
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="steadfast-bench-spec-") as shm:
        for workload in args.workloads:
            for c in args.concurrency:
                key = f"{workload} c={c}"
                rows[key] = {m: [] for m in modes}
                for rnd in range(args.rounds):
                    order = list(modes) if rnd % 2 == 0 else list(modes)[::-1]
                    engines = {}
                    for mode in order:
                        cfg = modes[mode]
                        engine = Engine(cfg, loaded, private_arena(cfg, loaded.model_cfg, f"{shm}/{mode}.kv"))
                        engine.generate([AddRequest("warm", [1, 2, 3, 4], SamplingParams(2, 0.0))])
                        engines[mode] = engine
                    if c == 1:
                        got = run_paired(engines, loaded, WORKLOADS[workload], args.max_tokens)
                    else:
                        got = {m: run(engines[m], loaded, WORKLOADS[workload], c, args.max_tokens) for m in order}
                    for mode, r in got.items():
                        s = engines[mode].spec
                        r |= {
                            "tok_s": r["output_tokens"] / r["seconds"],
                            "acceptance": s.acceptance_rate,
                            "tokens_per_step": s.tokens_per_step,
                            "drafted": s.drafted,
                            "row_cost": s.row_cost,
                        }
                        engines[mode].arena.unlink()
                    # The engines hold their arenas mapped until collected (they are in reference cycles):
                    # left to the collector, a run's arenas pile up in /dev/shm, up to most of the RAM.
                    del engines, engine
                    gc.collect()
                    if got["off"]["tokens"] != got["ngram"]["tokens"]:
                        raise SystemExit(f"{key}: outputs differ with speculation on and off")
                    for mode, r in got.items():
                        rows[key][mode].append({k: v for k, v in r.items() if k != "tokens"})
                    print(
                        f"{key} round {rnd}: off {got['off']['tok_s']:.1f} tok/s, ngram {got['ngram']['tok_s']:.1f} "
                        f"tok/s, acceptance {got['ngram']['acceptance']:.2f}, "
                        f"tokens/step {got['ngram']['tokens_per_step']:.2f}",
                        flush=True,
                    )
    print(f"\n{'workload':<16}{'off tok/s':>10}{'ngram tok/s':>12}{'ratio':>7}{'accept':>8}{'tok/step':>9}")
    summary = {}
    for key, by_mode in rows.items():
        med = {m: statistics.median(r["tok_s"] for r in runs) for m, runs in by_mode.items()}
        acc = statistics.median(r["acceptance"] for r in by_mode["ngram"])
        tps = statistics.median(r["tokens_per_step"] for r in by_mode["ngram"])
        ratios = [n["tok_s"] / o["tok_s"] for n, o in zip(by_mode["ngram"], by_mode["off"], strict=True)]
        summary[key] = {"off": med["off"], "ngram": med["ngram"], "ratio": med["ngram"] / med["off"]}
        summary[key] |= {"round_ratios": ratios, "acceptance": acc, "tokens_per_step": tps}
        ratio = med["ngram"] / med["off"]
        print(f"{key:<16}{med['off']:>10.1f}{med['ngram']:>12.1f}{ratio:>6.2f}x{acc:>8.2f}{tps:>9.2f}")
    Path(args.out).write_text(json.dumps({"run": run_info(args), "summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
