"""The soak's nemesis: a schedule of faults drawn from a seed alone (times exponential, kinds uniform
among those the deployment has), each struck on a thread of its own so that faults overlap — a kill
during a takeover, a migration while a router restarts — and each leaving the proof that it landed,
judged once the run is over.

Faults act as an outage would: by signal on the server's processes, on its KV wire's fault drill file,
through the admin API (a live migration), and with load of their own (a burst). This module never
judges the traffic; `soak_check.py` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from steadfast.ops.harness.chaos import children_named
from steadfast.ops.harness.chaos_faults import metric_samples
from steadfast.ops.harness.loadgen import LoadGenerator, Sample, Workload
from steadfast.ops.harness.soak import Traffic
from steadfast.util.proc import process_gone

KINDS = (
    "kill-worker",  # SIGKILL a serving worker: its requests are taken over from its KV
    "stop-worker",  # SIGSTOP a serving worker past its lease: fenced, killed, taken over
    "kill-router",  # SIGKILL the router: restarted, clients resume with Last-Event-ID
    "freeze-router",  # SIGSTOP the router for a while: its streams stall, then carry on with nothing lost
    "kill-pool",  # SIGKILL a kvpool daemon: restarted, it re-attaches arena and ledger
    "kv-link",  # the KV wire's primary path drops every frame for a while (nodes of their own)
    "migrate",  # a live migration of a running request, chosen by the policy's destination
    "slow-worker",  # a worker stopped half of every 100 ms for a few seconds
    "overload",  # a burst of low-priority requests beyond what the service admits
    "rollout",  # every worker replaced in turn: each drained onto the others under load, then retired
)
KV_LINK_S = 3.0
KV_LINK_MAX_S = 12.0
MIGRATE_TRY_S = 10.0
SLOW_S = 3.0
BURST = 40
ROLLOUT_MAX_S = 180.0  # a rollout's end waited for (one worker: its replacement's start, then its drain)
ROUTER_FREEZE_S = 4.0
ROUTER_BACK_S = 30.0  # how long an admin call waits for a router another fault killed


def _state(pid: int) -> str:
    """A process' state letter (T: stopped), or "" when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


@dataclass
class Struck:
    """One fault of the schedule, as it went."""

    kind: str
    at: float  # monotonic, when it struck
    what: str = ""
    proof: Callable[[], bool] | None = None  # judged after the run: did it really land?
    proven: bool = False
    error: str = ""
    done: threading.Event = field(default_factory=threading.Event)


def schedule(seed: int, duration_s: float, every_s: float, kinds: tuple[str, ...]) -> list[tuple[float, str]]:
    """(seconds from the start, kind) of every fault: the same seed, duration and kinds, the same list."""
    rng = random.Random(seed)
    out, t = [], rng.expovariate(1 / every_s)
    while t < duration_s:
        out.append((t, kinds[rng.randrange(len(kinds))]))
        t += rng.expovariate(1 / every_s)
    return out


class Nemesis:
    def __init__(
        self,
        url: str,
        launchers: Callable[[], list[int]],
        traffic: Traffic,
        drill: Path | None,
        lease_s: float,
        seed: int,
        headers: dict[str, str] | None = None,
        faults: Mapping[str, Callable[[Struck], None]] | None = None,
    ) -> None:
        """`launchers()`: the processes whose children are the routers and kvpools; `headers`: for the
        admin routes; `faults`: kinds the deployment adds (each fills its `Struck` as these do)."""
        self.url, self.launchers, self.traffic, self.drill = url, launchers, traffic, drill
        self.lease_s = lease_s
        self.headers = headers or {}
        self.faults = dict(faults or {})
        self.rng = random.Random(seed * 31 + 7)  # which worker or request: drawn apart from the schedule
        self.struck: list[Struck] = []
        self.burst: list[Sample] = []
        self._threads: list[threading.Thread] = []
        self._drill_lock = threading.Lock()
        self._drills = 0  # kv-link faults holding the drill now (they overlap)

    def kinds_here(self) -> tuple[str, ...]:
        """The kinds this deployment has: kv-link needs KV that crosses nodes."""
        nodes = {w["node"] for w in self._workers()}
        own = tuple(k for k in KINDS if k != "kv-link" or (len(nodes) > 1 and self.drill is not None))
        return own + tuple(self.faults)

    def run(self, plan: list[tuple[float, str]], t0: float, stop: threading.Event) -> None:
        for offset, kind in plan:
            if stop.wait(max(0.0, t0 + offset - time.monotonic())):
                return
            s = Struck(kind, time.monotonic())
            self.struck.append(s)
            t = threading.Thread(target=self._strike, args=(s,), name=f"nemesis-{kind}", daemon=True)
            self._threads.append(t)
            t.start()

    def join(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def judge(self) -> None:
        for s in self.struck:
            try:
                s.proven = bool(s.proof is not None and s.proof())
            except Exception as exc:  # noqa: BLE001 - an unprovable fault is reported, never raised
                s.error = s.error or f"proof failed: {exc!r}"

    # --- striking --------------------------------------------------------------------------------------
    def _strike(self, s: Struck) -> None:
        try:
            strike = self.faults.get(s.kind) or getattr(self, "_" + s.kind.replace("-", "_"))
            strike(s)
        except Exception as exc:  # noqa: BLE001 - a fault that could not strike is reported as such
            s.error = f"{type(exc).__name__}: {exc}"
        finally:
            s.done.set()

    def _call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        """The admin API, through a router restart (another fault's): asked again for up to `ROUTER_BACK_S`."""
        deadline = time.monotonic() + ROUTER_BACK_S
        while True:
            try:
                return httpx.request(method, self.url + path, headers=self.headers, timeout=60, **kw)
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)

    def _workers(self) -> list[dict[str, Any]]:
        return [w for w in self._call("GET", "/admin/workers").json() if w["state"] == "ready"]

    def _serving(self) -> dict[str, Any]:
        rows = [w for w in self._workers() if w["role"] != "standby"]
        busy = [w for w in rows if w["in_flight"]] or rows
        if not busy:
            raise RuntimeError("no serving worker is ready")
        return busy[self.rng.randrange(len(busy))]

    def _gone_and_dropped(self, w: dict[str, Any]) -> Callable[[], bool]:
        def proof() -> bool:
            rows = self._call("GET", "/admin/workers").json()
            dropped = all(r["id"] != w["id"] or r["state"] == "dead" for r in rows)
            return process_gone(w["pid"]) and dropped

        return proof

    def _kill_worker(self, s: Struck) -> None:
        w = self._serving()
        os.kill(w["pid"], signal.SIGKILL)
        s.what = f"worker {w['id']} ({w['role']}, {w['in_flight']} requests) killed"
        s.proof = self._gone_and_dropped(w)

    def _stop_worker(self, s: Struck) -> None:
        w = self._serving()
        os.kill(w["pid"], signal.SIGSTOP)
        held = self.lease_s + 2.0
        s.what = f"worker {w['id']} ({w['role']}, {w['in_flight']} requests) stopped {held:g}s"
        s.proof = self._gone_and_dropped(w)  # fenced and killed while stopped
        time.sleep(held)
        with contextlib.suppress(ProcessLookupError):
            os.kill(w["pid"], signal.SIGCONT)

    def _children(self, module: str) -> list[int]:
        return [pid for launcher in self.launchers() for pid in children_named(launcher, module)]

    def _kill_child(self, s: Struck, module: str, name: str) -> None:
        pids = self._children(module)
        if not pids:
            raise RuntimeError(f"no {name} process under the launchers")
        pid = pids[self.rng.randrange(len(pids))]
        os.kill(pid, signal.SIGKILL)
        s.what = f"{name} (pid {pid}) killed"
        s.proof = lambda: process_gone(pid) and len(self._children(module)) == len(pids)

    def _kill_router(self, s: Struck) -> None:
        self._kill_child(s, "steadfast.control.main", "router")

    def _freeze_router(self, s: Struck) -> None:
        pids = self._children("steadfast.control.main")
        if not pids:
            raise RuntimeError("no router process under the launchers")
        pid = pids[self.rng.randrange(len(pids))]
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(0.2)
            stopped = _state(pid) == "T"
            time.sleep(ROUTER_FREEZE_S - 0.2)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        s.what = f"router (pid {pid}) stopped for {ROUTER_FREEZE_S:g}s"
        s.proof = lambda: stopped

    def _kill_pool(self, s: Struck) -> None:
        self._kill_child(s, "steadfast.kv.pool.daemon", "kvpool")

    def _wire_retries(self) -> float:
        text = self._call("GET", "/metrics").text
        return sum(metric_samples(text, "steadfast_kv_transfer_retries_total").values())

    def _kv_link(self, s: Struck) -> None:
        assert self.drill is not None
        before = self._wire_retries()
        with self._drill_lock:
            self._drills += 1
            self.drill.write_text("drop_every=1,path=primary")
        t0 = time.monotonic()
        try:
            # Down for KV_LINK_S, and on until a transfer has met it (none may be under way: a prefill
            # worker stopped by another fault), for KV_LINK_MAX_S at most.
            time.sleep(KV_LINK_S)
            while self._wire_retries() <= before and time.monotonic() - t0 < KV_LINK_MAX_S:
                time.sleep(0.5)
        finally:
            with self._drill_lock:
                self._drills -= 1
                if not self._drills:
                    self.drill.write_text("")
        s.what = f"every KV frame on the primary path dropped for {time.monotonic() - t0:.1f}s"
        after = self._wire_retries()
        s.proof = lambda: after > before

    def _migrate(self, s: Struck) -> None:
        tried: set[str] = set()
        deadline = time.monotonic() + MIGRATE_TRY_S
        # One may end, or have its KV on the move (a handoff, another migration): another is picked, and
        # once each was tried, each again a little later.
        while time.monotonic() < deadline:
            running = [x for x in self.traffic.running() if x.stream.request_id not in tried]
            if not running:
                tried.clear()
                time.sleep(0.5)
                continue
            sent = running[self.rng.randrange(len(running))]
            rid = sent.stream.request_id
            tried.add(rid)
            r = self._call("POST", f"/admin/requests/{rid}/migrate", json={})
            body = r.json()
            if r.status_code == 200:
                s.what = f"request {sent.ask.key} migrated: worker {body['from_worker']} → {body['to_worker']}"
                s.proof = lambda: True  # the move committed (its record says so)
                return
            s.what = f"migration not done ({r.status_code}): {body.get('error', {}).get('message', '')[:120]}"
            time.sleep(0.2)
        s.proof = lambda: False

    def _slow_worker(self, s: Struck) -> None:
        w = self._serving()
        stopped = 0.0
        t_end = time.monotonic() + SLOW_S
        try:
            while time.monotonic() < t_end:
                os.kill(w["pid"], signal.SIGSTOP)
                time.sleep(0.05)
                os.kill(w["pid"], signal.SIGCONT)
                stopped += 0.05
                time.sleep(0.05)
        except ProcessLookupError:
            pass  # it died meanwhile (another fault): what it was stopped counts
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(w["pid"], signal.SIGCONT)
        s.what = f"worker {w['id']} stopped half of every 100 ms for {SLOW_S:g}s"
        s.proof = lambda: stopped > 0

    def _overload(self, s: Struck) -> None:
        model = self.traffic.model
        w = Workload(
            concurrency=BURST,
            requests=BURST,
            prompt_words=[(48, 1.0)],
            output_tokens=[(16, 1.0)],
            priorities=[("low", 1.0)],
            timeout_s=300.0,
        )
        samples = asyncio.run(LoadGenerator(self.url, w, model=model).run())
        self.burst.extend(samples)
        refused = sum(1 for x in samples if x.status in (429, 503))
        s.what = f"{BURST} low-priority requests at once: {refused} refused"
        s.proof = lambda: len(samples) == BURST

    def _rollout(self, s: Struck) -> None:
        """A drain under load with the fleet kept whole: a drain alone retires its worker for good, and an
        hour's soak would run out of workers."""
        r = self._call("POST", "/admin/rollout", json={})
        if r.status_code not in (202, 409):  # 409: an earlier fault's rollout runs: this one follows it
            raise RuntimeError(f"rollout refused ({r.status_code}): {r.text[:200]}")
        deadline = time.monotonic() + ROLLOUT_MAX_S
        view = self._call("GET", "/admin/rollout").json()
        while view.get("state") == "running" and time.monotonic() < deadline:
            time.sleep(1.0)
            view = self._call("GET", "/admin/rollout").json()
        if "state" not in view:  # a restarted router knows no rollout: the one it ran stopped with it
            s.what = f"rollout cut short by a router restart ({view.get('error', {}).get('message', view)})"
            return
        retired = sum(1 for step in view["steps"] if step["step"] == "retired")
        why = f": {view['error']}" if view["error"] else ""
        joined = "" if r.status_code == 202 else " (one already running)"
        replaced = f"{retired} of {len(view['workers'])} workers drained and replaced"
        s.what = f"rollout{joined} {view['state']}: {replaced}{why}"
        s.proof = lambda: retired >= 1
