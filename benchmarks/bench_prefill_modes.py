"""One prompt's prefill with `model.deterministic` off and on, in process, same run, rounds alternated.

With the mode on every prompt token is a row of the in-place attention kernel (attending up to its own
position) and every linear layer runs the quantized row-wise kernel whatever the chunk's size; off, a
long chunk takes torch's attention and oneDNN's bf16 matmuls. Serving benchmarks use short chat
prompts, so this is where the mode's cost on long prompts shows: the time from admitting one prompt to
its first token, best of `--rounds`.

    python benchmarks/bench_prefill_modes.py --tokens 200 1000 3000 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import run_info  # noqa: E402
from steadfast.config import Config  # noqa: E402
from steadfast.wire.worker import AddRequest, SamplingParams  # noqa: E402
from steadfast.worker.engine import Engine  # noqa: E402
from steadfast.worker.loaded import load_model, private_arena  # noqa: E402


def first_token(engine: Engine, rid: str, seed: int, tokens: int) -> float:
    """Seconds from admitting a `tokens`-long prompt to its first sampled token (nothing else running).
    Each `seed` gives other tokens from the first on: nothing of a prompt is in the prefix cache."""
    ids = [100 + (31 * seed + 7 * j + j * j) % 5000 for j in range(tokens)]
    engine.add_request(AddRequest(rid, ids, SamplingParams(1, 0.0, ignore_eos=True)))
    start = time.perf_counter()
    while rid in engine.requests:
        engine.step()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[200, 1000, 3000])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "prefill_modes.json"))
    args = p.parse_args()
    base = Config().replace(model={"dtype": "bfloat16", "device": "cpu"}, cache={"kv_memory_mb": 1024})
    engines = {}
    with tempfile.TemporaryDirectory(dir="/dev/shm") as folder:
        for mode in ("off", "on"):
            cfg = base.replace(model={"deterministic": mode})
            loaded = load_model(cfg)
            engines[mode] = Engine(cfg, loaded, private_arena(cfg, loaded.model_cfg, f"{folder}/arena-{mode}"))
        for engine in engines.values():  # untimed: kernels' first calls, the arena's first touch
            first_token(engine, "warm-up", 0, max(args.tokens))
        results: dict[str, dict[str, float]] = {}
        for n in args.tokens:
            best = {mode: float("inf") for mode in engines}
            for r in range(args.rounds):
                for mode, engine in engines.items():
                    best[mode] = min(best[mode], first_token(engine, f"p{n}-{r}", 1 + r + 97 * n, n))
            results[str(n)] = {f"{mode}_ms": 1000 * t for mode, t in best.items()}
            print(f"{n} tokens: off {1000 * best['off']:.0f} ms, on {1000 * best['on']:.0f} ms", flush=True)
        for engine in engines.values():
            engine.arena.unlink()
    Path(args.out).write_text(json.dumps({"run": run_info(args), "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
