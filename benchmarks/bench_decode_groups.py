"""Decode attention grouped by context length vs one padded group, in-process, same run.

A batch of requests with spread-out contexts decodes; each step's decode attention pads every request's
KV to the longest context of its group. With one group (the old way) short contexts pay for long ones;
with `decode_attention_groups: 4` requests sorted by length are cut into up to 4 groups (see
`runner.split_by_width`). Both engines run the same requests, rounds interleaved; the figure is the
median decode step time.

    python benchmarks/bench_decode_groups.py --batch 64 --min-context 32 --max-context 1024
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import run_info  # noqa: E402
from steadfast.config import Config  # noqa: E402
from steadfast.protocol import AddRequest, SamplingParams  # noqa: E402
from steadfast.worker.engine import Engine, load_model, private_arena  # noqa: E402


def run(engine: Engine, batch: int, lo: int, hi: int, steps: int) -> list[float]:
    """Admit `batch` requests with contexts spread from lo to hi, prefill them, time `steps` decodes."""
    for i in range(batch):
        n = lo + (hi - lo) * i // max(1, batch - 1)
        ids = [(7 * i + j) % 5000 + 100 for j in range(n)]
        engine.add_request(AddRequest(f"r{i}", ids, SamplingParams(steps + 4, 0.0, ignore_eos=True)))
    while any(r.num_pending > 1 for r in engine.requests.values()) or engine.scheduler.num_waiting:
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    for rid in list(engine.requests):
        engine.abort(rid)
    engine.step()
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--min-context", type=int, default=32)
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--groups", type=int, nargs="+", default=[1, 4])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "decode_groups.json"))
    args = p.parse_args()
    base = Config().replace(
        model={"dtype": args.dtype, "device": "cpu"},
        cache={"kv_memory_mb": 2048},
        scheduler={"max_num_batched_tokens": 2048, "max_prefill_chunk": 2048},
    )
    loaded = load_model(base)
    engines = {}
    tmp = tempfile.mkdtemp(prefix="bench-groups-")
    for g in args.groups:
        cfg = base.replace(scheduler={"decode_attention_groups": g})
        engines[g] = Engine(cfg, loaded, private_arena(cfg, loaded.model_cfg, f"/dev/shm/{Path(tmp).name}-{g}.kv"))
    medians: dict[int, list[float]] = {g: [] for g in args.groups}
    try:
        for _ in range(args.rounds):
            for g, engine in engines.items():
                times = run(engine, args.batch, args.min_context, args.max_context, args.steps)
                medians[g].append(statistics.median(times))
    finally:
        for e in engines.values():
            e.arena.unlink()
    report = {
        **run_info(args),
        "decode_step_ms_median_per_round": {g: [1000 * m for m in ms] for g, ms in medians.items()},
    }
    Path(args.out).write_text(json.dumps(report, indent=2))
    first = args.groups[0]
    for g, ms in medians.items():
        best = 1000 * statistics.median(ms)
        ratio = statistics.median(medians[first]) / statistics.median(ms)
        print(f"groups={g}: decode step {best:.1f} ms (median of {args.rounds} round medians), {ratio:.2f}x vs {first}")


if __name__ == "__main__":
    main()
