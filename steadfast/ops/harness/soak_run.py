"""One soak from start to verdict: the expected outputs computed, the server started (its ledger calls
journaled), traffic and nemesis run for the plan's duration, the streams drained, every fault judged,
the nodes checked, the server stopped, its leftovers looked for, the history checked, the report made
(a dict for the terminal and JSON, and a PNG timeline of faults against the clients' gaps)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import httpx

from steadfast.config import Config
from steadfast.kv.ledger.history import check_history, journal_stores, load_journal
from steadfast.ops.harness.served import Served
from steadfast.ops.harness.soak import Sent, SoakPlan, Traffic, catalogue, model_name
from steadfast.ops.harness.soak_check import longest_gaps, node_problems, report
from steadfast.ops.harness.soak_faults import Nemesis, Struck, schedule
from steadfast.ops.harness.soak_reference import reference
from steadfast.worker.loaded import LoadedModel

DRAIN_S = 120.0  # after the traffic stops: for the streams in flight to end, and the workers to go idle


def _files(folder: str) -> set[str]:
    with contextlib.suppress(OSError):
        return {e.name for e in os.scandir(folder)}
    return set()


def _idle(url: str, headers: dict[str, str], deadline: float) -> bool:
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            rows = httpx.get(url + "/admin/workers", headers=headers, timeout=10).json()
            ready = [w for w in rows if w["state"] == "ready"]
            if ready and all(not w["in_flight"] and not w["kv_blocks_used"] for w in ready):
                return True
        time.sleep(0.5)
    return False


class Deployed(Protocol):
    """What the soak strikes and reads: one `steadfast serve` (`Served`), or parts over several hosts (the
    multi-host benchmark's deployment, with etcd)."""

    url: str
    headers: dict[str, str]  # for the admin routes (a router off loopback wants its admin key)
    drill: Path | None  # the KV wire's fault drill file, where the deployment has one

    def wait_ready(self) -> None: ...

    def launchers(self) -> list[int]: ...  # the pids whose children are routers and kvpools

    def faults(self, lease_s: float, seed: int) -> Mapping[str, Callable[[Struck], None]]:
        """Kinds of fault this deployment adds to the nemesis' own (a host frozen, an etcd member killed)."""
        ...

    def stop(self) -> None: ...


def run_soak(
    cfg: Config,
    plan: SoakPlan,
    folder: Path,
    config_path: str = "",
    model_path: str = "",
    loaded: LoadedModel | None = None,
    log: Any = print,
    deploy: Callable[[dict[str, str]], Deployed] | None = None,
) -> dict[str, Any]:
    """`cfg`: the served deployment's config (its model and dtype compute the expected outputs);
    `config_path`, `model_path`: what `steadfast serve` is started with, unless `deploy(env)` starts
    the deployment instead (several hosts, with faults of their own)."""
    asks = catalogue(plan.seed, plan.catalogue)
    journal = folder / "journal"
    journal.mkdir(exist_ok=True)
    shm, arenas = _files("/dev/shm"), _files(cfg.cache.arena_dir)
    env = {"STEADFAST_LEDGER_JOURNAL": str(journal)}
    served: Deployed = deploy(env) if deploy is not None else Served(folder, config_path, model_path, env=env)
    sent: list[Sent] = []
    struck: list[Struck] = []
    try:
        # While the deployment starts (its processes load the model): the suite's soak took 10 s less.
        log(f"soak: computing the expected outputs of {len(asks)} requests in-process")
        expected = reference(cfg, asks, loaded)
        served.wait_ready()
        url = served.url
        traffic = Traffic(url, model_name(url), asks, plan)
        lease_s = cfg.fault_recovery.lease.lease_timeout_ms / 1000
        faults = served.faults(lease_s, plan.seed)
        nemesis = Nemesis(url, served.launchers, traffic, served.drill, lease_s, plan.seed, served.headers, faults)
        kinds = plan.kinds or nemesis.kinds_here()
        plan_faults = schedule(plan.seed, plan.duration_s, plan.fault_every_s, kinds)
        log(f"soak: seed {plan.seed}, {plan.duration_s:g}s, {len(plan_faults)} faults of {', '.join(kinds)}")
        t0 = time.monotonic()
        stop = threading.Event()
        strikes = threading.Thread(target=nemesis.run, args=(plan_faults, t0, stop), daemon=True)
        strikes.start()
        traffic.run(until=t0 + plan.duration_s)
        stop.set()
        strikes.join()
        nemesis.join(60)
        traffic.join(plan.stream_deadline_s)
        sent, struck = traffic.sent, nemesis.struck
        idle = _idle(url, served.headers, time.monotonic() + DRAIN_S)
        time.sleep(3)  # a dead worker's lease, fenced and reclaimed, before the nodes are read
        nemesis.judge()
        rows = httpx.get(url + "/admin/workers", headers=served.headers, timeout=10).json()
        pools = sorted({w["node"] for w in rows if w["node"]})
        node = node_problems(pools) if idle else ["the workers did not go idle after the traffic stopped"]
        launchers = served.launchers()
    finally:
        served.stop()
    leaks = []
    for pid in launchers:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, 0)
            leaks.append(f"processes of a server's session are still running (group {pid})")
    leaks += [f"/dev/shm/{n}" for n in sorted(_files("/dev/shm") - shm) if n.startswith("steadfast")]
    leaks += [f"{cfg.cache.arena_dir}/{n}" for n in sorted(_files(cfg.cache.arena_dir) - arenas)]
    stores = journal_stores(journal)
    history = [f"{store}: {p}" for store in stores for p in check_history(load_journal(journal, store))]
    out = {"seed": plan.seed, "duration_s": plan.duration_s, "late_arrivals": traffic.late}
    out |= report(sent, expected.tokens, struck, history, node, leaks, expected.logprobs, expected.tolerance)
    out["timeline"] = [
        {"at_s": round(f.at - t0, 2), "kind": f.kind, "what": f.what, "proven": f.proven, "error": f.error}
        for f in struck
    ]
    out["longest_gaps"] = longest_gaps(sent, struck, t0)
    out["burst"] = {"sent": len(nemesis.burst), "broken": sum(1 for x in nemesis.burst if x.status == 200 and not x.ok)}
    out["_plot"] = (t0, sent, struck)
    return out


def plot(result: dict[str, Any], path: str) -> None:
    """Faults (vertical lines, by kind) against each stream's longest gap (a dot at its time), PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0, sent, struck = result["_plot"]
    fig, ax = plt.subplots(figsize=(12, 4.5))
    xs, ys = [], []
    for x in sent:
        a = x.stream.arrivals
        if len(a) > 1:
            gap, end = max((b - p, b) for p, b in zip(a, a[1:], strict=False))
            xs.append(end - t0)
            ys.append(1000 * gap)
    ax.scatter(xs, ys, s=8, color="black", label="a stream's longest gap (at its end)")
    colours = plt.get_cmap("tab10")
    kinds = sorted({f.kind for f in struck})
    for f in struck:
        ax.axvline(f.at - t0, color=colours(kinds.index(f.kind) % 10), alpha=0.6, linewidth=1)
    for i, kind in enumerate(kinds):
        ax.plot([], [], color=colours(i % 10), label=kind)
    ax.set_yscale("log")
    ax.set_xlabel("seconds into the soak")
    ax.set_ylabel("gap between two tokens, ms")
    ax.set_title(
        f"steadfast chaos soak, seed {result['seed']}: {result['requests']} requests, {result['faults']} faults"
    )
    ax.legend(fontsize=7, loc="upper right", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
