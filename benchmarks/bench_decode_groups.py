"""Decode step by attention path, in-process, same run: torch's gather with one padded group or with
groups by context length, and the in-place kernel.

A batch of requests with spread-out contexts decodes. On the torch path each step's decode attention
pads every request's KV to the longest context of its group: with one group (the old way) short
contexts pay for long ones; with `decode_attention_groups: 4` requests sorted by length are cut into up
to 4 groups (see `runner.split_by_width`). The kernel (`model.decode_attention: auto`) reads each
request's blocks in place, no gather, no padding. Every engine runs the same requests, rounds
interleaved; the figure is the median decode step time.

    python benchmarks/bench_decode_groups.py --batch 64 --min-context 32 --max-context 1024 --kernel
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
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
from steadfast.wire.worker import AddRequest, SamplingParams  # noqa: E402
from steadfast.worker.engine import Engine  # noqa: E402
from steadfast.worker.loaded import load_model, private_arena  # noqa: E402


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
    p.add_argument("--groups", type=int, nargs="+", default=[1, 4], help="torch path, these group counts")
    p.add_argument("--kernel", action="store_true", help="also the in-place kernel")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "decode_groups.json"))
    args = p.parse_args()
    base = Config().replace(
        model={"dtype": args.dtype, "device": "cpu"},
        cache={"kv_memory_mb": 2048},
        scheduler={"max_num_batched_tokens": 2048, "max_prefill_chunk": 2048},
    )
    kernel = load_model(base)
    if args.kernel and kernel.model.paged is None:
        raise SystemExit("the in-place kernel does not run here (no AVX-512 or no C compiler)")
    # The torch path: the same weights, no kernel.
    torch_path = dataclasses.replace(kernel, model=copy.copy(kernel.model))
    torch_path.model.paged = None
    variants = {f"groups={g}": (torch_path, g) for g in args.groups}
    if args.kernel:
        variants["kernel"] = (kernel, 1)
    engines = {}
    tmp = tempfile.mkdtemp(prefix="bench-groups-")
    for i, (label, (loaded, g)) in enumerate(variants.items()):
        cfg = base.replace(scheduler={"decode_attention_groups": g})
        engines[label] = Engine(cfg, loaded, private_arena(cfg, loaded.model_cfg, f"/dev/shm/{Path(tmp).name}-{i}.kv"))
    medians: dict[str, list[float]] = {label: [] for label in engines}
    try:
        for _ in range(args.rounds):
            for label, engine in engines.items():
                times = run(engine, args.batch, args.min_context, args.max_context, args.steps)
                medians[label].append(statistics.median(times))
    finally:
        for e in engines.values():
            e.arena.unlink()
    report = {
        **run_info(args),
        "decode_step_ms_median_per_round": {label: [1000 * m for m in ms] for label, ms in medians.items()},
    }
    Path(args.out).write_text(json.dumps(report, indent=2))
    first = next(iter(medians))
    for label, ms in medians.items():
        best = 1000 * statistics.median(ms)
        ratio = statistics.median(medians[first]) / statistics.median(ms)
        print(f"{label}: decode step {best:.1f} ms (median of {args.rounds} round medians), {ratio:.2f}x vs {first}")


if __name__ == "__main__":
    main()
