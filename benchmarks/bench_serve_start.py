"""`steadfast serve` start and stop, this checkout against another (`--code NAME=DIR`), in alternating
rounds: from the command's start to `/health` answering 200 (what `make serve` and every test's server
wait for), and from SIGTERM to the launcher's exit with nothing in flight. The default model and config
unless given; ratios per round, as these machines are noisy.

    python benchmarks/bench_serve_start.py --code before=/tmp/before --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import run_info  # noqa: E402
from tests.integration.server import ServerProcess  # noqa: E402


def once(config: str, model: str, code_dir: str) -> tuple[float, float]:
    """Seconds to ready and to stopped, for one start of the server in `code_dir` ('' = this one)."""
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.monotonic()
        server = ServerProcess(Path(tmp), config, model=model, code_dir=code_dir)
        try:
            server.wait_ready(timeout=300)
            ready = time.monotonic() - t0
        finally:
            t1 = time.monotonic()
            server.stop()
            stopped = time.monotonic() - t1
    return ready, stopped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--code", required=True, help="NAME=DIR: the other checkout to compare with")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--model", default="", help="a GGUF (default: the default model)")
    ap.add_argument("--config", default="", help="YAML text of the config (default: the defaults)")
    ap.add_argument("--out", default="benchmarks/results/serve_start.json")
    args = ap.parse_args()
    name, _, where = args.code.partition("=")
    config = args.config or "# the defaults\n"
    rows: dict[str, list[tuple[float, float]]] = {"this": [], name: []}
    for r in range(args.rounds):
        # Alternating which goes first: a warm page cache or a drifting machine favours neither.
        order = [("this", ""), (name, where)] if r % 2 == 0 else [(name, where), ("this", "")]
        for label, code_dir in order:
            rows[label].append(once(config, args.model, code_dir))
            print(f"round {r + 1} {label}: ready {rows[label][-1][0]:.2f} s, stopped {rows[label][-1][1]:.2f} s")
    result = {"run": run_info(args), "rounds": rows}
    for i, what in enumerate(("ready_s", "stop_s")):
        ratios = [a[i] / b[i] for a, b in zip(rows["this"], rows[name], strict=True)]
        summary = {
            "this_median": statistics.median(x[i] for x in rows["this"]),
            f"{name}_median": statistics.median(x[i] for x in rows[name]),
            "ratio_per_round": [round(x, 3) for x in ratios],
            "ratio_median": statistics.median(ratios),
        }
        result[what] = summary
        print(what, json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in summary.items()}))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
