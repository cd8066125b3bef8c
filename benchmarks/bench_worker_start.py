"""Worker start-up benchmark: how soon a replacement standby is ready after a worker dies, when it loads
its own copy of the model (`model.shared_weights: false`, what every worker did before the weight store),
when it maps the node's weight store from a fresh interpreter (`fork_workers: false`), and when the
zygote forks it (the default); and the idle memory of each process of the default deployment (one mixed
worker, one standby, bf16), in every mode, in one run.

Per mode one server; `--kills` times the mixed worker is `kill -9`ed once a standby is ready (the standby
takes over, the supervisor starts a replacement); the replacement's own log line gives its start to ready
by phase (interpreter and imports or the fork, model, kv, warm-up), and the benchmark's clock the time from the kill
to the replacement's report of ready. Memory of every process of the deployment, idle, before the first
kill: RSS (which counts every shared page a process maps, the KV arena and the weight store in each) and
PSS (shared pages divided among their mappers: the sum is what the deployment holds).

Then the chaos case: `--streams` closed-loop greedy clients while the mixed worker is `kill -9`ed every
`--every` seconds, `--rounds` times (a kill may find the replacement still starting: a second failure
within seconds of the first); each round's client stall, and failed requests. `--modes forked-unpaced`
is the default deployment with prefill chunks not paced beside decodes (`scheduler.decode_step_target_ms:
0`): a takeover's recomputed prefills then share one long step with the streams that were decoding.

    python benchmarks/bench_worker_start.py --kills 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import Stream, prompt_of, run_info, wait_until  # noqa: E402
from steadfast.config import default_model_path  # noqa: E402
from steadfast.model.tokenizer import GGUFTokenizer  # noqa: E402
from tests.integration.server import ServerProcess  # noqa: E402

MODES = {  # model keys, other config
    "load": ("shared_weights: false, fork_workers: false", ""),
    "mapped": ("shared_weights: true, fork_workers: false", ""),
    "forked": ("shared_weights: true, fork_workers: true", ""),
    # The default, but prefill chunks not paced beside decodes (what every mode did before 2026-12-03).
    "forked-unpaced": ("shared_weights: true, fork_workers: true", "scheduler: {decode_step_target_ms: 0}\n"),
}
READY = re.compile(r"worker(\d+)\[\d+\] INFO steadfast\.worker: ready in ([\d.]+)s .*\((.*)\)")


def processes(sid: int) -> dict[str, dict[str, float]]:
    """RSS and PSS (MiB) of every process of session `sid`, named by what it runs."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[3]) != sid:
                continue
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except (OSError, IndexError, ValueError):
            continue
        args = [a.decode() for a in argv if a]
        module = next((a for a in args if a.startswith("steadfast.")), "?")
        name = module.removeprefix("steadfast.")
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        if "--worker-id" in args:
            name = f"worker{args[args.index('--worker-id') + 1]}"
        elif comm.startswith("sf-worker"):  # forked by the zygote: its command line is the zygote's
            name = comm.removeprefix("sf-")
        fields = {line.split(":")[0]: int(line.split()[1]) for line in rollup.splitlines()[1:] if line.endswith("kB")}
        out[name] = {k.lower() + "_mib": fields.get(k, 0) / 1024 for k in ("Rss", "Pss", "Pss_Shmem")}
    return out


def shm_files(launcher_pid: int) -> dict[str, float]:
    """Memory (MiB allocated) of each file the deployment keeps in shared memory: its node's KV arena and
    weight store, in the launcher's arena folder. A tmpfs page is memory whether or not a process maps
    it, and PSS counts only mapped pages: an arena made ahead of use holds pages nobody maps yet."""
    out = {}
    for folder in Path("/dev/shm").glob(f"steadfast-{os.geteuid()}-{launcher_pid}-*"):
        for f in folder.iterdir():
            if f.is_file():
                out[f.name] = f.stat().st_blocks * 512 / 2**20
    return out


def workers(url: str) -> list[dict]:
    return httpx.get(f"{url}/admin/workers", timeout=10).json()


def standby_ready(url: str) -> dict | None:
    return next((w for w in workers(url) if w["role"] == "standby" and w["state"] == "ready"), None)


def run_mode(args: argparse.Namespace, mode: str) -> dict:
    model, other = MODES[mode]
    cfg = f"model: {{{model}, dtype: {args.dtype}}}\nserver: {{workers: 1, standby_workers: 1}}\n{other}"
    tmp = Path(tempfile.mkdtemp(prefix=f"bench-start-{mode}-"))
    server = ServerProcess(tmp, cfg)
    result: dict = {"config": cfg, "replacements": []}
    try:
        server.wait_ready(300)
        wait_until(lambda: standby_ready(server.url), 300)
        time.sleep(args.settle)  # idle: background page population done, nothing in flight
        result["memory"] = processes(os.getsid(server.proc.pid))
        result["shm_files_mib"] = shm_files(server.proc.pid)
        private = sum(m["pss_mib"] - m["pss_shmem_mib"] for m in result["memory"].values())
        result["held_mib"] = private + sum(result["shm_files_mib"].values())  # what the deployment holds
        for k in range(args.kills):
            victim = next(w for w in workers(server.url) if w["role"] == "mixed")
            before = {int(m.group(1)) for m in READY.finditer(server.output())}
            t0 = time.monotonic()
            os.kill(victim["pid"], signal.SIGKILL)
            # The replacement: a worker id not ready before, ready now.
            new = wait_until(
                lambda b=before: [m for m in READY.finditer(server.output()) if int(m.group(1)) not in b], 300
            )
            seen_ready = time.monotonic() - t0
            m = new[0]
            phases = {p.rsplit(" ", 1)[0]: float(p.rsplit(" ", 1)[1].rstrip("s")) for p in m.group(3).split(", ")}
            row = {"worker": int(m.group(1)), "ready_in_s": float(m.group(2)), "phases_s": phases}
            row["kill_to_ready_log_s"] = seen_ready
            result["replacements"].append(row)
            print(f"{mode} kill {k}: replacement worker{row['worker']} ready in {row['ready_in_s']:.1f}s {phases}")
            wait_until(lambda: standby_ready(server.url), 300)
            time.sleep(args.settle)
        result["chaos"] = chaos_part(args, server.url)
        c = result["chaos"]
        print(
            f"{mode} chaos: {c['kills']} kills, stall p50 {c['stall_s_p50']:.2f}s max {c['stall_s_max']:.2f}s, "
            f"{c['failed_requests']} of {c['requests']} requests failed"
        )
    finally:
        server.stop()
    return result


def chaos_part(args: argparse.Namespace, url: str) -> dict:
    """`--streams` closed-loop greedy clients; every `--every` s, `--rounds` times, `kill -9` of the
    mixed worker (none ready: that round kills nothing). A round's stall: the longest gap, among the
    requests streaming across the kill, that contains the kill."""
    tok = GGUFTokenizer.from_gguf(default_model_path())
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    requests: list[list[float]] = []
    errors: list[str] = []
    stop = threading.Event()

    def client(i: int) -> None:
        for k in range(10**6):
            if stop.is_set():
                return
            s = Stream(url, model, prompt_of(tok, args.chaos_prompt, f"client {i} request {k}"), args.chaos_tokens)
            s.start()
            s.join(600)
            requests.append(s.arrivals)
            if s.error:
                errors.append(s.error)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.streams)]
    for t in threads:
        t.start()
    time.sleep(args.every)
    kills: list[float | None] = []
    for _ in range(args.rounds):
        mixed = [w for w in workers(url) if w["role"] == "mixed" and w["state"] == "ready"]
        if mixed:
            os.kill(mixed[0]["pid"], signal.SIGKILL)
            kills.append(time.perf_counter())
        else:
            kills.append(None)
        time.sleep(args.every)
    wait_until(lambda: any(w["role"] == "mixed" and w["state"] == "ready" for w in workers(url)), 300)
    time.sleep(args.every)
    stop.set()
    for t in threads:
        t.join(600)
    stalls = []
    for at in kills:
        if at is None:
            continue
        gaps = [b - a for arr in requests for a, b in zip(arr, arr[1:], strict=False) if a <= at < b]
        stalls.append(max(gaps, default=0.0))
    return {
        "kills": len([k for k in kills if k is not None]),
        "rounds_without_a_worker_to_kill": len([k for k in kills if k is None]),
        "stall_s": stalls,
        "stall_s_p50": statistics.median(stalls) if stalls else None,
        "stall_s_max": max(stalls, default=None),
        "requests": len(requests),
        "failed_requests": len(errors),
        "errors": errors[:10],
    }


def summary(result: dict) -> dict:
    reps = result["replacements"]
    names = list(reps[0]["phases_s"]) if reps else []
    return {
        "ready_in_s_p50": statistics.median(r["ready_in_s"] for r in reps),
        "after_imports_s_p50": statistics.median(
            r["ready_in_s"] - r["phases_s"].get("interpreter and imports", 0) for r in reps
        ),
        **{f"{n}_s_p50": statistics.median(r["phases_s"][n] for r in reps) for n in names},
        "kill_to_ready_s_p50": statistics.median(r["kill_to_ready_log_s"] for r in reps),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--rounds", type=int, default=8, help="chaos part: kills of the mixed worker")
    p.add_argument("--every", type=float, default=3.0, help="chaos part: seconds between kills")
    p.add_argument("--streams", type=int, default=6, help="chaos part: closed-loop clients")
    p.add_argument("--chaos-tokens", type=int, default=64, help="chaos part: tokens per request")
    p.add_argument("--chaos-prompt", type=int, default=64, help="chaos part: prompt tokens per request")
    p.add_argument("--settle", type=float, default=8.0, help="idle seconds before measuring memory and killing")
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=["load", "mapped", "forked"])
    p.add_argument(
        "--dtype", default="auto", choices=["auto", "bfloat16", "float32"], help="model.dtype (auto: as shipped)"
    )
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "worker_start.json"))
    args = p.parse_args()
    report = {**run_info(args), "modes": {}}
    for mode in args.modes:
        r = run_mode(args, mode)
        r["summary"] = summary(r)
        report["modes"][mode] = r
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print("| mode | replacement ready in (p50) | of it after the imports | phases p50 | kill → ready log (p50) |")
    print("|---|---|---|---|---|")
    for mode, r in report["modes"].items():
        s = r["summary"]
        phases = ", ".join(
            f"{k.removesuffix('_s_p50')} {v:.2f}s"
            for k, v in s.items()
            if k.endswith("_s_p50") and not k.startswith(("ready", "after", "kill"))
        )
        ready, after, kill = s["ready_in_s_p50"], s["after_imports_s_p50"], s["kill_to_ready_s_p50"]
        print(f"| {mode} | {ready:.2f} s | {after:.2f} s | {phases} | {kill:.2f} s |")
    print()
    print("| mode | kills | stall p50 | stall max | failed requests |")
    print("|---|---|---|---|---|")
    for mode, r in report["modes"].items():
        c = r["chaos"]
        print(
            f"| {mode} | {c['kills']} | {c['stall_s_p50']:.2f} s | {c['stall_s_max']:.2f} s | "
            f"{c['failed_requests']} of {c['requests']} |"
        )
    print()
    print("| mode | process | RSS | PSS | of it shared memory (KV arena, weight store) |")
    print("|---|---|---|---|---|")
    for mode, r in report["modes"].items():
        for name, m in sorted(r["memory"].items()):
            mib = " | ".join(f"{m[k]:.0f} MiB" for k in ("rss_mib", "pss_mib", "pss_shmem_mib"))
            print(f"| {mode} | {name} | {mib} |")
        total = {k: sum(m[k] for m in r["memory"].values()) for k in ("rss_mib", "pss_mib", "pss_shmem_mib")}
        print(
            f"| {mode} | **all** | {total['rss_mib']:.0f} MiB | **{total['pss_mib']:.0f} MiB** | "
            f"{total['pss_shmem_mib']:.0f} MiB |"
        )
        files = r["shm_files_mib"]
        print(f"| {mode} | files in shared memory ({', '.join(sorted(files))}) | | | {sum(files.values()):.0f} MiB |")
        print(f"| {mode} | **held: private PSS + those files** | | **{r['held_mib']:.0f} MiB** | |")


if __name__ == "__main__":
    main()
