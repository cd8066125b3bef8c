"""Live-migration benchmark: what moving a running request to another worker costs the request itself
and the requests around it, same-node KV migration (`mode: kv`, the blocks change owner in the ledger)
against the baseline without KV moves (`mode: recompute`, the destination computes prompt and generated
tokens again), in one run (fp32, one thread per worker, no standby): two mixed workers of one node for those two; the
cross-node path on a second server, below.

**Single stream**, per context length and mode, `--samples` times (the modes alternate sample by
sample): a greedy stream with a prompt of exactly that many tokens decodes; once its client has
`--at-token` tokens, `POST /admin/requests/{id}/migrate` moves it to the other worker, which answers once
the destination produced its next token. From the record: `downtime_ms` (the request in no running
batch; for recompute, the router's switch → first token) and `gap_ms` (the router's last source token →
first destination token). From the client's own clock: the pause before the destination's first token
and the longest pause between two tokens of the stream, against the same stream's median token interval
(one decode step); as a control, the stream's longest pause away from the switch (the one at the switch
and those on either side of it left out).

**Co-running streams**, per mode: `--streams` streams decode on both workers beside one more (the
mover); quiet and migrating phases of `--phase` seconds alternate for `--duration` seconds: the mover
stays put, or is migrated to the other worker every `--interval` seconds (back to back when a migration
takes longer). The co-running streams' time per token (TPOT, all of them together) in the migrating
phases over the quiet ones is the slowdown; also their token intervals during a migrate call against
those outside one, and the mover's own downtime and gap with the others beside it.

**Across nodes** (`kv-cross`, on a second server: node 0 a mixed and a prefill worker, node 1 a decode
worker, each node its own kvpool, arena and ledger): the same two parts, the request moved between the
decode worker and the mixed one, its KV copied in rounds while it decodes, then stopped and copied.

    python benchmarks/bench_migration.py --contexts 128 512 2048 --samples 4
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
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

# mode → (the server it runs on, the migrate call's mode)
MODES = {"kv": ("same", "kv"), "kv-cross": ("cross", "kv"), "recompute": ("same", "recompute")}
SERVERS = {
    "same": "server: {workers: 2, standby_workers: 0, threads_per_worker: 1}\n",
    # Node 0: a mixed worker and a prefill worker; node 1 (a second kvpool, arena and ledger): a decode
    # worker. A request is prefilled on node 0 and decodes on node 1; the mixed worker is node 0's decoder.
    "cross": (
        "server: {workers: 1, prefill_workers: 1, decode_workers: 1, decode_node: separate, standby_workers: 0,"
        " threads_per_worker: 1}\n"
    ),
}
DECODERS = ("mixed", "decode")  # the roles a running request can move to
CROSS_TARGET_MS = 30.0  # cross-node downtime
FLAT_TARGET = 1.2  # cross-node downtime at the longest context within this factor of the shortest
KEYS = (
    "downtime_ms",
    "gap_ms",
    "client_switch_gap_ms",
    "client_max_gap_ms",
    "client_max_gap_elsewhere_ms",
)  # summarised per context and mode
STEP_SLACK_MS = 5.0  # the same-node target: the client's longest gap ≤ one decode step + this
SLOWDOWN_TARGET = 0.05  # the co-running target: their TPOT at most 5 % higher with migrations


# The admin calls go through one `httpx.Client` made before any stream: a new client (what `httpx.get`
# makes) loads the CA bundle, 60-120 ms of CPU under the GIL, which delays the streams' reader threads
# and shows up as a token gap of the client's own making.


def workers(admin: httpx.Client) -> list[dict]:
    return admin.get("/admin/workers").json()


def busy_worker(admin: httpx.Client) -> int:
    """The one decoding worker with a request in flight (called while exactly one stream runs)."""
    (w,) = [w["id"] for w in workers(admin) if w["in_flight"] and w["role"] in DECODERS]
    return w


def destination(admin: httpx.Client, source: int, cross: bool) -> int:
    """The other decoder: of another node (`cross`) or of the source's."""
    rows = workers(admin)
    node = next(w["node"] for w in rows if w["id"] == source)
    (dest,) = [w["id"] for w in rows if w["id"] != source and w["role"] in DECODERS and (w["node"] != node) == cross]
    return dest


def migrate(admin: httpx.Client, rid: str, to: int, mode: str) -> dict:
    """One operator migration, retried while the source says the request is not decoding yet."""
    for _ in range(50):
        r = admin.post(f"/admin/requests/{rid}/migrate", json={"to": to, "mode": mode})
        if r.status_code == 200:
            return r.json()
        if r.status_code != 409 or "not decoding yet" not in r.text:
            raise RuntimeError(f"migrate {rid} to {to} ({mode}): {r.status_code} {r.text}")
        time.sleep(0.02)
    raise RuntimeError(f"migrate {rid}: never decoding")


def gaps_ms(arrivals: list[float]) -> list[float]:
    return [1000 * (b - a) for a, b in zip(arrivals, arrivals[1:], strict=False)]


def single_part(
    args: argparse.Namespace, admin: httpx.Client, model: str, tok: GGUFTokenizer, ids: itertools.count, modes: list
) -> dict:
    url = str(admin.base_url).rstrip("/")
    rows: dict[int, dict[str, list[dict]]] = {n: {m: [] for m in modes} for n in args.contexts}
    # Sample -1 of the first context is an untimed warm-up of every mode (first migration, first recompute).
    plan = [(args.contexts[0], -1)] + [(n, k) for n in args.contexts for k in range(args.samples)]
    for n, k in plan:
        for mode in modes if k % 2 == 0 else modes[::-1]:  # alternate which mode goes first
            s = Stream(url, model, prompt_of(tok, n, f"Sample {next(ids)}:"), args.max_tokens)
            s.start()
            # Asked well before the migration, not in the gaps measured; after a few tokens, when a
            # prefilled request is on its decode worker.
            wait_until(lambda s=s: len(s.arrivals) >= 3 or s.error, 300)
            source = busy_worker(admin)
            dest = destination(admin, source, cross=mode == "kv-cross")
            wait_until(lambda s=s: len(s.arrivals) >= args.at_token or s.error, 300)
            t0 = time.perf_counter()
            try:
                record = migrate(admin, s.request_id, dest, MODES[mode][1])
            except RuntimeError as exc:  # say what the stream itself saw, too
                s.join(5)
                raise RuntimeError(f"{exc}; the stream: {len(s.arrivals)} tokens, error {s.error!r}") from exc
            t1 = time.perf_counter()
            s.join(600)
            if s.error or len(s.arrivals) != args.max_tokens:
                raise RuntimeError(f"{mode} {n}: {s.error}, {len(s.arrivals)} tokens")
            if record["outcome"] != "committed" or record["to_worker"] != dest:
                raise RuntimeError(f"{mode} {n}: not migrated: {record}")
            if mode != "recompute" and (record["path"] == "same_node") == (mode == "kv-cross"):
                raise RuntimeError(f"{mode} {n}: took path {record['path']}")
            g = gaps_ms(s.arrivals)
            step = statistics.median(g)
            # The call returns once the router forwarded the destination's first token: the client's
            # arrival nearest to its return is that token, and the gap before it the switch's.
            first = min(range(1, len(s.arrivals)), key=lambda i: abs(s.arrivals[i] - t1))
            row = {
                "downtime_ms": record["downtime_ms"],
                "gap_ms": record["gap_ms"],
                "duration_ms": record["duration_ms"],
                "call_ms": 1000 * (t1 - t0),
                "client_switch_gap_ms": g[first - 1],
                "client_switch_at": first,
                "client_max_gap_ms": max(g),
                "client_max_gap_at": g.index(max(g)) + 1,  # the token that ended the longest gap
                # The control: the stream's longest gap away from the switch (the switch's gap and the
                # one on either side left out): what the machine's jitter alone gives a stream.
                "client_max_gap_elsewhere_ms": max(g[: max(0, first - 2)] + g[first + 1 :], default=0.0),
                "step_ms": step,
                # Diagnostics: the source's and the destination's own steps, and what the first step
                # at the destination took beyond the downtime (the switch gap less the downtime).
                "step_before_ms": statistics.median(g[: first - 1]),
                "step_after_ms": statistics.median(g[first:]),
                "switch_gap_less_downtime_ms": g[first - 1] - record["downtime_ms"],
                "gaps_ms": g,
                "record": record,
            }
            if k >= 0:
                rows[n][mode].append(row)
            print(
                f"ctx {n} {mode} sample {k}: downtime {row['downtime_ms']} ms, gap {row['gap_ms']} ms, "
                f"client gap at the switch {row['client_switch_gap_ms']:.1f} ms (token {first}, asked at "
                f"{record['at_token']}), client max gap {row['client_max_gap_ms']:.1f} ms (token "
                f"{row['client_max_gap_at']}), step {step:.1f} ms (before / after the switch "
                f"{row['step_before_ms']:.1f} / {row['step_after_ms']:.1f} ms)",
                flush=True,
            )
    out: dict = {}
    for n, by_mode in rows.items():
        out[n] = {}
        for mode, rs in by_mode.items():
            col = lambda key, rs=rs: [r[key] for r in rs]  # noqa: E731 - a local accessor
            out[n][mode] = {
                "samples": len(rs),
                **{f"{key}_p50": statistics.median(col(key)) for key in KEYS},
                **{f"{key}_max": max(col(key)) for key in KEYS},
                "step_ms_p50": statistics.median(col("step_ms")),
            }
            for which in ("switch", "max"):  # the client's gap at the switch, and its longest in the stream
                excess = [r[f"client_{which}_gap_ms"] - r["step_ms"] for r in rs]
                out[n][mode] |= {
                    f"{which}_gap_over_step_ms_p50": statistics.median(excess),
                    f"{which}_gap_over_step_ms_max": max(excess),
                    f"{which}_gap_within_step_plus_5ms": sum(e <= STEP_SLACK_MS for e in excess),
                }
            out[n][mode]["raw"] = rs
    return out


def corun_part(
    args: argparse.Namespace, admin: httpx.Client, model: str, tok: GGUFTokenizer, ids: itertools.count, modes: list
) -> dict:
    url = str(admin.base_url).rstrip("/")
    out: dict = {}
    for mode in modes:
        wait_until(lambda: all(w["in_flight"] == 0 for w in workers(admin)), 60)
        mover = Stream(url, model, prompt_of(tok, args.corun_context, f"Mover {next(ids)}:"), args.corun_tokens)
        mover.start()
        wait_until(lambda m=mover: len(m.arrivals) >= 3 or m.error, 120)
        at = busy_worker(admin)
        dest = destination(admin, at, cross=mode == "kv-cross")
        others = [
            Stream(url, model, prompt_of(tok, args.stream_context, f"Stream {next(ids)}:"), args.corun_tokens)
            for _ in range(args.streams)
        ]
        for s in others:
            s.start()
        everyone = [mover, *others]
        wait_until(lambda e=everyone: all(len(s.arrivals) >= 2 or s.error for s in e), 120)
        placement = {w["id"]: w["in_flight"] for w in workers(admin) if w["role"] in DECODERS}
        crowded = [w for w, n in placement.items() if n >= len(others)]
        if crowded and len(placement) == 2:
            # Every co-running stream on one decoder (across nodes, the decode node's): half of them are
            # moved to the other first, as placement does on one node. Else where the mover sits decides
            # their batch (5 or 4 requests here: their TPOT differs by ~15 %), and a quiet phase's
            # baseline would depend on where the migrating phase before it happened to leave the mover.
            other = next(w for w in placement if w != crowded[0])
            for s in others[: len(others) // 2]:
                migrate(admin, s.request_id, other, MODES[mode][1])
            wait_until(lambda o=other: next(w["in_flight"] for w in workers(admin) if w["id"] == o) > 0, 60)
            placement = {w["id"]: w["in_flight"] for w in workers(admin) if w["role"] in DECODERS}
        time.sleep(1.0)  # the last prompt's step out of the way
        # Quiet and migrating phases alternate on the same streams, so that the machine's drift (and
        # whatever else runs on it) falls on both alike. Migrating: a migration every `--interval`
        # seconds, or as soon as the last one ended when it took longer.
        phases: list[tuple[str, float, float]] = []
        windows: list[tuple[float, float]] = []
        records: list[dict] = []
        t_stop = time.perf_counter() + args.duration
        while time.perf_counter() < t_stop:
            kind = "migrating" if len(phases) % 2 else "quiet"
            t0 = time.perf_counter()
            if kind == "quiet":
                time.sleep(args.phase)
            while kind == "migrating" and time.perf_counter() - t0 < args.phase:
                t_call = time.perf_counter()
                records.append(migrate(admin, mover.request_id, dest, MODES[mode][1]))
                windows.append((t_call, time.perf_counter()))
                at, dest = dest, at
                time.sleep(max(0.0, args.interval - (time.perf_counter() - t_call)))
            phases.append((kind, t0, time.perf_counter()))
        for s in everyone:
            s.stop.set()
        for s in everyone:
            s.join(30)
            if s.error:
                raise RuntimeError(f"co-running {mode}: {s.error}")
        # The co-running streams' time per token in each phase, all streams together: per stream, the
        # figures depend on whether the mover shares its worker (one request more in its batch).
        per_phase = []
        for kind, a, b in phases:
            tokens = sum(a < x <= b for s in others for x in s.arrivals)
            per_phase.append({"kind": kind, "seconds": b - a, "tokens": tokens})
        tpot = {}
        for kind in ("quiet", "migrating"):
            ps = [p for p in per_phase if p["kind"] == kind]
            tpot[kind] = 1000 * len(others) * sum(p["seconds"] for p in ps) / max(1, sum(p["tokens"] for p in ps))
        # Their token intervals that ended while a migrate call was in flight, and the others.
        inside, outside = [], []
        for s in others:
            for a, b in zip(s.arrivals, s.arrivals[1:], strict=False):
                if phases[0][1] < a and b <= phases[-1][2]:
                    (inside if any(w0 <= b <= w1 for w0, w1 in windows) else outside).append(1000 * (b - a))
        res = {
            "placement": placement,
            "migrations": len(records),
            "phases": per_phase,
            "tpot_quiet_ms": tpot["quiet"],
            "tpot_migrating_ms": tpot["migrating"],
            "tpot_ratio": tpot["migrating"] / tpot["quiet"],
            "gap_in_migration_ms_p50": pct(inside, 50),
            "gap_in_migration_ms_p99": pct(inside, 99),
            "gap_outside_migration_ms_p50": pct(outside, 50),
            "gap_outside_migration_ms_p99": pct(outside, 99),
            "gaps_in_migration": len(inside),
            "gaps_outside_migration": len(outside),
            "migration_call_ms": [1000 * (w1 - w0) for w0, w1 in windows],
            "records": records,
        }
        # The migrated stream itself, with the co-running streams beside it on both workers.
        for key in ("downtime_ms", "gap_ms"):
            values = [rec[key] for rec in records if rec[key] is not None]
            res[f"mover_{key}_p50"] = pct(values, 50)
            res[f"mover_{key}_max"] = max(values, default=float("nan"))
        out[mode] = res
        print(
            f"co-running {mode}: placement {placement}, {len(records)} migrations in {len(phases) // 2} migrating "
            f"phases, TPOT quiet / migrating {tpot['quiet']:.1f} / {tpot['migrating']:.1f} ms "
            f"({res['tpot_ratio']:.3f}x), gaps in / outside a migration p50 {res['gap_in_migration_ms_p50']:.1f} / "
            f"{res['gap_outside_migration_ms_p50']:.1f} ms ({len(inside)} / {len(outside)})",
            flush=True,
        )
    return out


def targets(report: dict, contexts: list[int]) -> dict:
    single, corun = report["single"], report["corun"]
    out: dict = {}
    ran = set(single[contexts[0]]) if contexts and contexts[0] in single else set()  # the modes measured
    if "kv" in ran:
        # At the median of the samples, on the longest gap of the stream (the counts per sample are in the table).
        out["same_node_client_gap_within_step_plus_5ms"] = {
            n: single[n]["kv"]["max_gap_over_step_ms_p50"] <= STEP_SLACK_MS for n in contexts
        }
    if "kv-cross" in ran:
        down = {n: single[n]["kv-cross"]["downtime_ms_p50"] for n in contexts}
        out["cross_node_downtime_within_30ms"] = {n: d <= CROSS_TARGET_MS for n, d in down.items()}
        out["cross_node_flat_ratio"] = down[contexts[-1]] / down[contexts[0]]
        out["cross_node_flat_met"] = out["cross_node_flat_ratio"] <= FLAT_TARGET
    for mode in ("kv", "kv-cross"):
        if mode in corun:
            out[f"corun_slowdown_{mode}"] = corun[mode]["tpot_ratio"] - 1
            out[f"corun_slowdown_{mode}_met"] = corun[mode]["tpot_ratio"] - 1 <= SLOWDOWN_TARGET
    if "recompute" in ran:
        recompute = [single[n]["recompute"]["downtime_ms_p50"] for n in contexts]
        out["recompute_grows_with_context"] = all(a < b for a, b in zip(recompute, recompute[1:], strict=False))
    return out


def print_tables(report: dict, contexts: list[int], modes: list[str]) -> None:
    single, corun, t = report["single"], report["corun"], report["targets"]
    print(
        "| context | mode | samples | downtime p50 (max) | server gap p50 (max) | client gap at the switch p50 (max) "
        "| client max gap p50 (max) | decode step p50 | client max gap − step p50 (max) | ≤ step + 5 ms "
        "| control: client max gap away from the switch p50 (max) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    cell = lambda r, key: f"{r[key + '_p50']:.1f} ({r[key + '_max']:.1f}) ms"  # noqa: E731 - a local formatter
    for n in contexts:
        for mode in modes:
            r = single[n][mode]
            print(
                f"| {n} | {mode} | {r['samples']} | {cell(r, 'downtime_ms')} | {cell(r, 'gap_ms')} | "
                f"{cell(r, 'client_switch_gap_ms')} | {cell(r, 'client_max_gap_ms')} | {r['step_ms_p50']:.1f} ms | "
                f"{cell(r, 'max_gap_over_step_ms')} | {r['max_gap_within_step_plus_5ms']} of {r['samples']} | "
                f"{cell(r, 'client_max_gap_elsewhere_ms')} |"
            )
    print()
    print(
        "| mode | migrations | co-running TPOT quiet / migrating | ratio "
        "| gap p50 in / outside a migration | gap p99 in / outside | migrated stream: downtime p50 (max) "
        "| its server gap p50 (max) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for mode in (m for m in modes if m in corun):  # none with --duration 0
        r = corun[mode]
        print(
            f"| {mode} | {r['migrations']} | {r['tpot_quiet_ms']:.1f} / {r['tpot_migrating_ms']:.1f} ms | "
            f"{r['tpot_ratio']:.3f}x | "
            f"{r['gap_in_migration_ms_p50']:.1f} / {r['gap_outside_migration_ms_p50']:.1f} ms | "
            f"{r['gap_in_migration_ms_p99']:.1f} / {r['gap_outside_migration_ms_p99']:.1f} ms | "
            f"{cell(r, 'mover_downtime_ms')} | {cell(r, 'mover_gap_ms')} |"
        )
    print()
    met = lambda ok: "met" if ok else "NOT met"  # noqa: E731 - a local formatter
    for n, ok in t.get("same_node_client_gap_within_step_plus_5ms", {}).items():
        r = single[n]["kv"]
        print(
            f"same-node client gap ≤ step + 5 ms at {n} tokens: {met(ok)} "
            f"(longest gap p50 {r['max_gap_over_step_ms_p50']:+.1f} ms over a step, "
            f"{r['max_gap_within_step_plus_5ms']} of {r['samples']} samples; "
            f"at the switch {r['switch_gap_over_step_ms_p50']:+.1f} ms, "
            f"{r['switch_gap_within_step_plus_5ms']} of {r['samples']})"
        )
    for n, ok in t.get("cross_node_downtime_within_30ms", {}).items():
        down = single[n]["kv-cross"]["downtime_ms_p50"]
        print(f"cross-node downtime ≤ 30 ms at {n} tokens: {met(ok)} ({down:.1f} ms)")
    if "cross_node_flat_ratio" in t:
        print(
            f"cross-node downtime flat ({contexts[-1]} within 1.2x of {contexts[0]}): {met(t['cross_node_flat_met'])} "
            f"({t['cross_node_flat_ratio']:.2f}x)"
        )
    for mode in ("kv", "kv-cross"):
        if f"corun_slowdown_{mode}" in t:
            slow = t[f"corun_slowdown_{mode}"]
            print(f"co-running slowdown ≤ 5 % ({mode}): {met(t[f'corun_slowdown_{mode}_met'])} ({100 * slow:+.1f} %)")
    if "recompute_grows_with_context" in t:
        print(f"recompute downtime grows with context: {met(t['recompute_grows_with_context'])}")


def serve(args: argparse.Namespace, which: str, modes: list[str], tok: GGUFTokenizer, report: dict) -> None:
    """One server of the run: its modes' single-stream and co-running parts."""
    cfg = (
        f"model: {{dtype: {args.dtype}, max_model_len: {max(args.contexts + [args.corun_context]) + 2048}}}\n"
        f"cache: {{kv_memory_mb: {args.kv_mb}}}\n"
        + SERVERS[which]
        # What the encryption of the KV wire costs: the cross-node server with CURVE off (a trusted network).
        + ("transfer: {curve: false}\n" if which == "cross" and args.no_curve else "")
        # The migrate call waits for the destination's first token: by recompute at 2048 tokens, longer
        # than the default 10 s.
        + "migration: {timeout: 120}\n"
    )
    tmp = Path(tempfile.mkdtemp(prefix=f"bench-migration-{which}-"))
    server = ServerProcess(tmp, cfg)
    report["config"][which] = cfg
    try:
        server.wait_ready(300)
        model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        ids = itertools.count()
        with httpx.Client(base_url=server.url, timeout=60) as admin:
            single = single_part(args, admin, model, tok, ids, modes)
            for n, by_mode in single.items():
                report["single"].setdefault(n, {}).update(by_mode)
            if args.duration > 0:  # 0: the single-stream part only
                report["corun"].update(corun_part(args, admin, model, tok, ids, modes))
            metrics = admin.get("/metrics").text
        report["token_mismatches"][which] = [
            x for x in metrics.splitlines() if x.startswith("steadfast_migration_token_mism")
        ]
    finally:
        server.stop()
        log = (tmp / "server.log").read_text(errors="replace")
        report["server_errors"][which] = [x for x in log.splitlines() if "ERROR" in x or "Traceback" in x]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 2048])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--samples", type=int, default=4, help="migrations per context and mode")
    p.add_argument("--at-token", type=int, default=8, help="the client's tokens when it asks for the migration")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--streams", type=int, default=4, help="co-running streams beside the migrated one")
    p.add_argument("--stream-context", type=int, default=128, help="the co-running streams' prompt length")
    p.add_argument("--corun-context", type=int, default=512, help="the migrated stream's prompt length")
    p.add_argument("--corun-tokens", type=int, default=1000, help="co-running part: max_tokens (stopped earlier)")
    p.add_argument(
        "--interval", type=float, default=0.5, help="co-running part: seconds from one migration to the next"
    )
    p.add_argument("--phase", type=float, default=3.0, help="co-running part: seconds per quiet or migrating phase")
    p.add_argument("--duration", type=float, default=48.0, help="co-running part: seconds of phases per mode")
    p.add_argument("--kv-mb", type=int, default=1024)
    p.add_argument("--no-curve", action="store_true", help="the cross-node server's KV wire unencrypted")
    p.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "migration.json"))
    args = p.parse_args()
    if args.samples < 1:
        p.error("--samples must be at least 1 (the figures are medians over them)")
    tok = GGUFTokenizer.from_gguf(default_model_path())
    modes = [m for m in MODES if m in args.modes]
    # The machine is shared: what else ran shows in the load before the servers started.
    report = {**run_info(args), "config": {}, "loadavg_before": os.getloadavg(), "single": {}, "corun": {}}
    report |= {"token_mismatches": {}, "server_errors": {}}
    for which in SERVERS:
        on_it = [m for m in modes if MODES[m][0] == which]
        if on_it:
            serve(args, which, on_it, tok, report)
    report["loadavg_after"] = os.getloadavg()
    report["targets"] = targets(report, args.contexts)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print_tables(report, args.contexts, modes)
    errors = sum(len(v) for v in report["server_errors"].values())
    if errors:
        print(f"server logs: {errors} error lines (in the JSON)")


if __name__ == "__main__":
    main()
