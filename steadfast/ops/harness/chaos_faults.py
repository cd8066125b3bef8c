"""The faults `steadfast chaos` injects, one class each: how it strikes a served deployment, how it is
undone once the streams have ended, and the evidence that it really happened (a rehearsal whose fault
did not happen fails, whatever its streams did).

They act on the server's processes by signal, on its admin API, on its KV wire's fault drill (a file
the server's senders read at the start of every transfer) and with load of their own.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from steadfast.ops.harness.chaos import Rehearsal, Scenario, children_named
from steadfast.ops.harness.loadgen import LoadGenerator, Sample, Workload

ROLLOUT_WAIT_S = 900.0


class Fault(abc.ABC):
    """One named fault. `strike` acts (when the streams are `at` of their way, or before they start
    when `before_streams`) and says what it did; `settle` runs after the streams ended."""

    before_streams = False
    closed_loop = False  # clients send their prompts again until the strike is over
    priority = "normal"  # the checked streams' priority, in both runs

    def __init__(self, r: Rehearsal) -> None:
        self.r = r

    @abc.abstractmethod
    def strike(self) -> str: ...

    def settle(self) -> None:  # noqa: B027 - most faults leave nothing to undo
        """Undo what is left of the fault, wait for its own load."""

    @abc.abstractmethod
    def happened(self, report: dict[str, Any], migrations: list[dict[str, Any]]) -> bool:
        """Whether the fault really struck, from the rehearsal's report and the migrations it saw."""

    def figures(self) -> dict[str, Any]:
        """Figures of its own for the report."""
        return {}

    def harmless(self) -> bool:
        """No request of its own load was broken (accepted, then failed)."""
        return True


class KillWorker(Fault):
    """SIGKILL the busiest worker: a standby takes its requests over from the KV it left."""

    def strike(self) -> str:
        w = self.r.busiest()
        os.kill(w["pid"], signal.SIGKILL)
        return f"worker {w['id']} (pid {w['pid']}, {w['in_flight']} requests) killed"

    def happened(self, report: dict[str, Any], migrations: list[dict[str, Any]]) -> bool:
        return report["takeovers"] > 0


class StopWorker(KillWorker):
    """SIGSTOP the busiest worker past its lease: it is fenced, killed and taken over."""

    def strike(self) -> str:
        w = self.r.busiest()
        os.kill(w["pid"], signal.SIGSTOP)
        time.sleep(self.r.stop_s)
        with contextlib.suppress(ProcessLookupError):  # fenced and killed meanwhile, as it should be
            os.kill(w["pid"], signal.SIGCONT)
        return f"worker {w['id']} (pid {w['pid']}, {w['in_flight']} requests) stopped {self.r.stop_s:g}s"


class KillChild(Fault):
    """SIGKILL one of the launcher's own processes (the router, the kvpool): the launcher restarts it."""

    module, name = "", ""

    def __init__(self, r: Rehearsal) -> None:
        super().__init__(r)
        self.before = children_named(r.launcher_pid, self.module)

    def strike(self) -> str:
        pids = children_named(self.r.launcher_pid, self.module)
        if not pids:
            raise RuntimeError(f"no {self.name} process under the launcher {self.r.launcher_pid}")
        os.kill(pids[0], signal.SIGKILL)
        return f"{self.name} (pid {pids[0]}) killed"


class KillRouter(KillChild):
    module, name = "steadfast.control.main", "router"

    def happened(self, report: dict[str, Any], migrations: list[dict[str, Any]]) -> bool:
        return report["reconnects"] > 0  # clients resumed with Last-Event-ID


class KillPool(KillChild):
    module, name = "steadfast.kv.pool.daemon", "kvpool"

    def happened(self, report: dict[str, Any], migrations: list[dict[str, Any]]) -> bool:
        return children_named(self.r.launcher_pid, self.module) != self.before  # a new daemon


class Drain(Fault):
    """An operator drains the busiest worker: its requests migrate live to the others."""

    def strike(self) -> str:
        w = self.r.busiest()
        r = httpx.post(f"{self.r.url}/admin/workers/{w['id']}/drain", json={}, timeout=10)
        if r.status_code == 409:  # the last worker of its role: nothing to drain to, and the report says so
            return f"drain of worker {w['id']} refused: {r.json()['error']['message']}"
        r.raise_for_status()
        return f"worker {w['id']} drained ({w['in_flight']} requests)"

    def happened(self, report: dict[str, Any], migrations: list[dict[str, Any]]) -> bool:
        return any(m["reason"] == "drain" and m["outcome"] == "committed" for m in migrations)


class SlowWorker(Fault):
    """The busiest worker slowed for real: SIGSTOP/SIGCONT every 100 ms, stopped for a share of each
    period that grows from 10 % to 80 % over `--stop-seconds` (the clients sending their prompts again
    meanwhile, so that the whole slowdown happens under load) and stays there until the streams end.
    The health check should see its trend and move low-priority work away (the figures say whether it
    did: it judges a trend against a baseline of `health.baseline_s`); every stream must stay exact."""

    PERIOD_S = 0.1
    closed_loop = True

    def __init__(self, r: Rehearsal) -> None:
        super().__init__(r)
        self.done = threading.Event()
        self.stopped_s = 0.0
        self.top_score = 0.0
        self.worker = -1
        self.thread: threading.Thread | None = None

    def _score(self) -> None:
        with contextlib.suppress(httpx.HTTPError, KeyError):
            w = self.r.admin("/admin/health")["workers"][str(self.worker)]
            self.top_score = max(self.top_score, float(w["score"]))

    def strike(self) -> str:
        w = self.r.busiest()
        self.worker = w["id"]
        self.thread = threading.Thread(target=self._cycle, args=(w["pid"],), daemon=True)
        self.thread.start()
        self.done.wait(self.r.stop_s)  # the ramp, under load
        return f"worker {w['id']} (pid {w['pid']}) stopped 10 % → 80 % of every 100 ms over {self.r.stop_s:g}s"

    def _cycle(self, pid: int) -> None:
        t0 = time.monotonic()
        try:
            for period in itertools.count():
                if self.done.is_set():
                    break
                if period % 5 == 0:
                    self._score()
                share = 0.1 + 0.7 * min(1.0, (time.monotonic() - t0) / max(self.r.stop_s, 1e-3))
                os.kill(pid, signal.SIGSTOP)
                time.sleep(share * self.PERIOD_S)
                os.kill(pid, signal.SIGCONT)
                self.stopped_s += share * self.PERIOD_S
                time.sleep((1 - share) * self.PERIOD_S)
        except ProcessLookupError:
            pass  # it died (fenced and replaced): the takeover's figures say so
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def settle(self) -> None:
        self.done.set()
        if self.thread is not None:
            self.thread.join()

    def happened(self, report: dict[str, Any], migrations: list[dict[str, Any]]) -> bool:
        return self.stopped_s > 0

    def figures(self) -> dict[str, Any]:
        return {"stopped_s": round(self.stopped_s, 1), "top_health_score": round(self.top_score, 2)}


def metric_samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """One counter's samples from a Prometheus text page, by their labels."""
    out: dict[tuple[tuple[str, str], ...], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


class BreakTransfer(Fault):
    """The KV wire's primary path drops every data frame, from before the streams start: each prompt's
    KV, streamed from its prefill worker to a decode worker on another node, must be resent, then carried
    by the alternate path (or, when every path fails, recomputed where it decodes). Needs a deployment
    whose KV crosses nodes (`server.decode_node: separate`)."""

    before_streams = True
    DRILL = "drop_every=1,path=primary"

    def __init__(self, r: Rehearsal) -> None:
        super().__init__(r)
        self.before: dict[str, float] = {}
        self.after: dict[str, float] = {}

    def _wire(self) -> dict[str, float]:
        text = httpx.get(self.r.url + "/metrics", timeout=10).text
        transfers = metric_samples(text, "steadfast_kv_transfers_total")
        done = lambda path: sum(v for k, v in transfers.items() if dict(k) == {"path": path, "outcome": "done"})  # noqa: E731
        return {
            "primary": done("primary"),
            "alternate": done("alternate"),
            "recomputed": sum(v for k, v in transfers.items() if dict(k).get("outcome") == "recompute"),
            "retries": sum(metric_samples(text, "steadfast_kv_transfer_retries_total").values()),
        }

    def strike(self) -> str:
        nodes = {w["node"] for w in self.r.admin("/admin/workers") if w["state"] != "dead"}
        if len(nodes) < 2:
            raise RuntimeError(
                "break-transfer needs KV that crosses nodes: serve with `server.decode_node: separate`"
                " (prefill and decode workers on nodes of their own)"
            )
        if self.r.drill is None:
            raise RuntimeError("break-transfer needs the server's KV fault drill file")
        self.before = self._wire()
        self.r.drill.write_text(self.DRILL)
        return "every KV data frame on the primary path dropped (resends, then the alternate path)"

    def settle(self) -> None:
        if self.r.drill is not None:
            self.r.drill.write_text("")
        self.after = self._wire()

    def _moved(self, key: str) -> float:
        return self.after.get(key, 0.0) - self.before.get(key, 0.0)

    def happened(self, report: dict[str, Any], migrations: list[dict[str, Any]]) -> bool:
        return self._moved("retries") > 0 and self._moved("alternate") + self._moved("recomputed") > 0

    def figures(self) -> dict[str, Any]:
        keys = ("primary", "alternate", "recomputed", "retries")
        return {f"transfers_{k}": int(self._moved(k)) for k in keys}


class Overload(Fault):
    """A burst of low-priority streams (`--burst`) arrives mid-run: more than the service admits, so part
    of it is refused at admission (by the ladder, or by the bound on queued low-priority requests), the
    checked streams (high priority) must go on exactly, and no request it accepted may break."""

    priority = "high"

    def __init__(self, r: Rehearsal) -> None:
        super().__init__(r)
        self.samples: list[Sample] = []
        self.thread: threading.Thread | None = None
        self.since = 0.0
        self.top = 0

    def strike(self) -> str:
        self.since = time.time()
        w = Workload(
            concurrency=self.r.burst,
            requests=self.r.burst,
            prompt_words=[(48, 1.0)],
            output_tokens=[(32, 1.0)],
            priorities=[("low", 1.0)],
            timeout_s=300.0,
        )
        gen = LoadGenerator(self.r.url, w, model=self.r.model)
        self.thread = threading.Thread(target=lambda: self.samples.extend(asyncio.run(gen.run())), daemon=True)
        self.thread.start()
        return f"{self.r.burst} low-priority streams at once"

    def settle(self) -> None:
        if self.thread is not None:
            self.thread.join(600)
        history = self.r.admin("/admin/degradation")["history"]
        self.top = max((c["new"] for c in history if c["at"] >= self.since), default=0)

    def happened(self, report: dict[str, Any], migrations: list[dict[str, Any]]) -> bool:
        return self.top >= 1 or self._counts()["refused"] > 0  # more came than the service admits

    def _counts(self) -> dict[str, int]:
        refused = sum(1 for s in self.samples if s.status in (429, 503))
        broken = sum(1 for s in self.samples if s.status == 200 and not s.ok)
        other = sum(1 for s in self.samples if s.status not in (200, 429, 503))
        return {"refused": refused, "broken": broken, "other": other, "served": sum(1 for s in self.samples if s.ok)}

    def harmless(self) -> bool:
        c = self._counts()
        return len(self.samples) == self.r.burst and c["broken"] == 0 and c["other"] == 0

    def figures(self) -> dict[str, Any]:
        c = self._counts()
        return {"top_level": self.top, "burst": self.r.burst} | {f"burst_{k}": v for k, v in c.items()}


class Rollout(Fault):
    """A rolling restart mid-run, by the operator's command (`steadfast rollout`): every worker replaced
    in turn, its requests migrated to the others first. The clients go on sending their prompts until it
    is done, and at least one request must have been migrated in flight."""

    closed_loop = True

    def __init__(self, r: Rehearsal) -> None:
        super().__init__(r)
        self.state: dict[str, Any] = {}
        self.replaced = False
        self.exit_code: int | None = None

    def _live(self) -> dict[int, int]:
        return {w["id"]: w["pid"] for w in self.r.admin("/admin/workers") if w["state"] != "dead"}

    def strike(self) -> str:
        before = self._live()
        cmd = [sys.executable, "-m", "steadfast.ops.cli", "rollout", "--url", self.r.url]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=ROLLOUT_WAIT_S)
        self.exit_code, self.state = done.returncode, self.r.admin("/admin/rollout")
        after = self._live()
        self.replaced = bool(before) and not set(after) & set(before) and not set(after.values()) & set(before.values())
        said = (done.stdout.strip().splitlines() or done.stderr.strip().splitlines() or ["(nothing)"])[-1]
        return f"steadfast rollout of {len(before)} workers: {said}"

    def happened(self, report: dict[str, Any], migrations: list[dict[str, Any]]) -> bool:
        moved = any(m["reason"] == "drain" and m["outcome"] == "committed" for m in migrations)
        return self.exit_code == 0 and self.state.get("state") == "done" and self.replaced and moved

    def figures(self) -> dict[str, Any]:
        return {"workers_replaced": len(self.state.get("steps", [])) if self.replaced else 0}


FAULTS: dict[Scenario, type[Fault]] = {
    Scenario.KILL_WORKER: KillWorker,
    Scenario.STOP_WORKER: StopWorker,
    Scenario.KILL_ROUTER: KillRouter,
    Scenario.KILL_POOL: KillPool,
    Scenario.DRAIN: Drain,
    Scenario.SLOW_WORKER: SlowWorker,
    Scenario.BREAK_TRANSFER: BreakTransfer,
    Scenario.OVERLOAD: Overload,
    Scenario.ROLLOUT: Rollout,
}
