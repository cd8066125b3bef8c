"""Disaggregation benchmark, both parts in one run.

**Handoff**: three `steadfast serve`s side by side, each one prefill and one decode worker: `same_node`
(the KV changes owner in the ledger), `layerwise` (decode workers on a second node; KV streamed layer
by layer while the prompt computes) and `after_prefill` (second node; all KV sent once the prompt is
done). One request at a time, the modes taking turns, unique prompts of each length (no prefix-cache
hit). Per request: TTFT (the prefill worker's first token), time to the second token (the decode
worker's first: it includes the handoff), end-to-end, and the exposed transfer time (commit →
acknowledgement, from the server's own histogram).

**Long prompts vs running streams**: `mixed` (two mixed workers) and `disaggregated` (one prefill, one
decode worker) on the same cores (one thread per worker), taking turns. `streams` closed-loop clients
decode short prompts while `long_clients` closed-loop clients send long prompts; we record the streams'
inter-token gaps and per-request TPOT.

    python benchmarks/bench_disagg.py --lengths 128 512 2048 --reps 8 --duration 45
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import Stream, pct, prompt_of, run_info  # noqa: E402
from steadfast.config import default_model_path  # noqa: E402
from steadfast.model.tokenizer import GGUFTokenizer  # noqa: E402
from tests.integration.server import ServerProcess  # noqa: E402

HANDOFF_MODES = {
    "same_node": "server: {workers: 0, prefill_workers: 1, decode_workers: 1}",
    "layerwise": "server: {workers: 0, prefill_workers: 1, decode_workers: 1, decode_node: separate}\n"
    "transfer: {layerwise: true}",
    "after_prefill": "server: {workers: 0, prefill_workers: 1, decode_workers: 1, decode_node: separate}\n"
    "transfer: {layerwise: false}",
}
LOAD_MODES = {
    "mixed": "server: {workers: 2}",
    "disaggregated": "server: {workers: 0, prefill_workers: 1, decode_workers: 1}",
}


def start(mode_yaml: str, args: argparse.Namespace, tag: str) -> ServerProcess:
    # One intra-op thread per worker: each worker has a core of its own, as on a real host.
    base = (
        f"model: {{dtype: {args.dtype}}}\ncache: {{kv_memory_mb: {args.kv_mb}}}\n"
        "server: {threads_per_worker: 1, standby_workers: 0}\n"
    )
    cfg = _merge_server(base, mode_yaml)
    return ServerProcess(Path(tempfile.mkdtemp(prefix=f"bench-disagg-{tag}-")), cfg)


def _merge_server(base: str, mode_yaml: str) -> str:
    """The mode's `server:` keys added into the base's one line (YAML has no repeated keys)."""
    lines = base.splitlines()
    for line in mode_yaml.splitlines():
        if line.startswith("server: {"):
            i = next(k for k, x in enumerate(lines) if x.startswith("server: {"))
            lines[i] = lines[i][:-1] + ", " + line[len("server: {") :]
        else:
            lines.append(line)
    return "\n".join(lines) + "\n"


def transfer_seconds(url: str) -> tuple[float, int]:
    """Sum and count of the server's KV transfer histogram (every path)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    total = sum(float(v) for v in re.findall(r"^steadfast_kv_transfer_seconds_sum\{[^}]*\} (\S+)$", text, re.M))
    count = sum(float(v) for v in re.findall(r"^steadfast_kv_transfer_seconds_count\{[^}]*\} (\S+)$", text, re.M))
    return total, int(count)


def handoff_part(args: argparse.Namespace, tok: GGUFTokenizer) -> dict:
    servers = {mode: start(y, args, mode) for mode, y in HANDOFF_MODES.items()}
    rows: dict[str, dict[int, list[dict]]] = {m: {n: [] for n in args.lengths} for m in servers}
    try:
        for s in servers.values():
            s.wait_ready(300)
        model = httpx.get(next(iter(servers.values())).url + "/v1/models").json()["data"][0]["id"]
        counter = itertools.count()
        modes = list(servers)
        for rep in range(-1, args.reps):  # rep -1: warm-up, not recorded
            for n in args.lengths:
                for mode in modes[rep % 3 :] + modes[: rep % 3]:  # each mode first in turn
                    url = servers[mode].url
                    before = transfer_seconds(url)
                    s = Stream(url, model, prompt_of(tok, n, f"Request {next(counter)}:"), args.max_tokens)
                    s.start()
                    s.join()
                    if s.error or len(s.arrivals) != args.max_tokens:
                        raise RuntimeError(f"{mode} {n}: {s.error}, {len(s.arrivals)} tokens")
                    after = transfer_seconds(url)
                    if rep >= 0:
                        a = s.arrivals
                        rows[mode][n].append(
                            {
                                "ttft": a[0] - s.started,
                                "second": a[1] - s.started,
                                "e2e": a[-1] - s.started,
                                "tpot": (a[-1] - a[1]) / (len(a) - 2),
                                "transfer": after[0] - before[0] if after[1] > before[1] else float("nan"),
                            }
                        )
            print(f"handoff rep {rep} done", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    out: dict = {}
    for mode, by_len in rows.items():
        out[mode] = {}
        for n, rs in by_len.items():
            e2e = [r["e2e"] for r in rs]
            out[mode][n] = {
                "requests": len(rs),
                "ttft_p50_ms": 1000 * pct([r["ttft"] for r in rs], 50),
                "second_token_p50_ms": 1000 * pct([r["second"] for r in rs], 50),
                "second_token_p99_ms": 1000 * pct([r["second"] for r in rs], 99),
                "e2e_p50_ms": 1000 * pct(e2e, 50),
                "tpot_p50_ms": 1000 * pct([r["tpot"] for r in rs], 50),
                "transfer_p50_ms": 1000 * pct([r["transfer"] for r in rs], 50),
                "transfer_share_of_e2e_p50": pct([r["transfer"] / r["e2e"] for r in rs], 50),
                "raw": rs,
            }
    for mode in out:
        for n in args.lengths:
            same = out["same_node"][n]
            r = out[mode][n]
            # What the mode adds before the decode worker's first token, over the same-node handoff,
            # as a share of the request's end-to-end latency.
            r["added_vs_same_node_share_of_e2e"] = (r["second_token_p50_ms"] - same["second_token_p50_ms"]) / r[
                "e2e_p50_ms"
            ]
    return out


def load_part(args: argparse.Namespace, tok: GGUFTokenizer) -> dict:
    servers = {mode: start(y, args, mode) for mode, y in LOAD_MODES.items()}
    gaps: dict[str, list[float]] = {m: [] for m in servers}
    tpots: dict[str, list[float]] = {m: [] for m in servers}
    long_ttft: dict[str, list[float]] = {m: [] for m in servers}
    counter = itertools.count()
    try:
        for s in servers.values():
            s.wait_ready(300)
        model = httpx.get(next(iter(servers.values())).url + "/v1/models").json()["data"][0]["id"]
        modes = list(servers)
        for rnd in range(-1, args.rounds):  # round -1: a short warm-up, not recorded
            for mode in modes[rnd % 2 :] + modes[: rnd % 2]:
                url = servers[mode].url
                stop_at = time.perf_counter() + (args.duration if rnd >= 0 else 8)
                done: list[Stream] = []
                long_done: list[Stream] = []

                def client(
                    max_tokens: int, length: int, sink: list[Stream], url: str = url, stop_at: float = stop_at
                ) -> None:
                    while time.perf_counter() < stop_at:
                        s = Stream(url, model, prompt_of(tok, length, f"Client {next(counter)}:"), max_tokens)
                        s.run()  # in this thread
                        if s.error:
                            raise RuntimeError(s.error)
                        sink.append(s)

                threads = [
                    threading.Thread(target=client, args=(args.stream_tokens, 40, done), daemon=True)
                    for _ in range(args.streams)
                ]
                threads += [
                    threading.Thread(target=client, args=(8, args.long_prompt, long_done), daemon=True)
                    for _ in range(args.long_clients)
                ]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                if rnd < 0:
                    continue
                for s in done:
                    a = s.arrivals
                    gaps[mode].extend(b - x for x, b in zip(a[1:-1], a[2:], strict=True))
                    tpots[mode].append((a[-1] - a[0]) / (len(a) - 1))
                long_ttft[mode].extend(s.arrivals[0] - s.started for s in long_done)
                print(f"load round {rnd} {mode}: {len(done)} streams, {len(long_done)} long prompts", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    return {
        mode: {
            "streams_done": len(tpots[mode]),
            "long_prompts_done": len(long_ttft[mode]),
            "gap_p50_ms": 1000 * pct(gaps[mode], 50),
            "gap_p99_ms": 1000 * pct(gaps[mode], 99),
            "tpot_p50_ms": 1000 * pct(tpots[mode], 50),
            "tpot_p99_ms": 1000 * pct(tpots[mode], 99),
            "long_ttft_p50_ms": 1000 * pct(long_ttft[mode], 50),
        }
        for mode in servers
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    p.add_argument("--reps", type=int, default=8, help="requests per length and mode")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds of the load part")
    p.add_argument("--duration", type=float, default=45.0, help="seconds per load round and mode")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--stream-tokens", type=int, default=128)
    p.add_argument("--long-clients", type=int, default=1)
    p.add_argument("--long-prompt", type=int, default=2048)
    p.add_argument("--parts", nargs="+", default=["handoff", "load"], choices=["handoff", "load"])
    p.add_argument("--kv-mb", type=int, default=512)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "disagg.json"))
    args = p.parse_args()
    tok = GGUFTokenizer.from_gguf(default_model_path())
    report = run_info(args)
    if "handoff" in args.parts:
        report["handoff"] = handoff_part(args, tok)
    if "load" in args.parts:
        report["load"] = load_part(args, tok)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    if "handoff" in report:
        print("| prompt | mode | TTFT p50 | 2nd token p50 | p99 | vs same node | e2e p50 | transfer p50 | share |")
        print("|---|---|---|---|---|---|---|---|---|")
        for n in args.lengths:
            same = report["handoff"]["same_node"][n]["second_token_p50_ms"]
            for mode, res in report["handoff"].items():
                r = res[n]
                print(
                    f"| {n} | {mode} | {r['ttft_p50_ms']:.0f} ms | {r['second_token_p50_ms']:.0f} ms | "
                    f"{r['second_token_p99_ms']:.0f} ms | {r['second_token_p50_ms'] / same:.3f}x | "
                    f"{r['e2e_p50_ms']:.0f} ms | {r['transfer_p50_ms']:.1f} ms | "
                    f"{100 * r['transfer_share_of_e2e_p50']:.2f} % |"
                )
    if "load" in report:
        print("| mode | streams | long prompts | gap p50 | gap p99 | TPOT p50 | TPOT p99 | long-prompt TTFT p50 |")
        print("|---|---|---|---|---|---|---|---|")
        for mode, r in report["load"].items():
            print(
                f"| {mode} | {r['streams_done']} | {r['long_prompts_done']} | {r['gap_p50_ms']:.1f} ms | "
                f"{r['gap_p99_ms']:.1f} ms | {r['tpot_p50_ms']:.1f} ms | {r['tpot_p99_ms']:.1f} ms | "
                f"{r['long_ttft_p50_ms']:.0f} ms |"
            )


if __name__ == "__main__":
    main()
