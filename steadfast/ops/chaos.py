"""Fault rehearsals (`steadfast chaos SCENARIO`): greedy streams run twice against one server, once
undisturbed and once while a named fault strikes mid-stream; every stream of the second run must equal
its first-run twin token for token. The figures of the recovery: the longest wait a client saw between
two tokens, tokens recomputed by takeovers, failed streams.

Streams resume with `Last-Event-ID` when their connection breaks (a killed router), as a client should.
Faults act on the server's processes by signal, so the rehearsal runs on the server's host; the server
is started by the command (ops/chaos_cli.py), which knows its process tree.
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

PROMPTS = [
    "Explain how a lighthouse keeper kept the lamp burning through a storm.",
    "List five uses of copper in everyday life and say why copper suits each.",
    "Write a short story about a fox who learns to read the stars.",
    "Describe the water cycle to a ten-year-old.",
    "What makes a good bridge design? Give three principles.",
    "Summarise the rules of chess in a few sentences.",
    "Why do leaves change colour in autumn?",
    "Give advice to someone learning to cook for the first time.",
]
STREAM_DEADLINE_S = 300.0


class Scenario(enum.StrEnum):
    KILL_WORKER = "kill-worker"  # SIGKILL the busiest worker: a standby takes its requests over
    STOP_WORKER = "stop-worker"  # SIGSTOP it past its lease: fenced, killed, taken over
    KILL_ROUTER = "kill-router"  # SIGKILL the router: restarted, clients resume with Last-Event-ID
    KILL_POOL = "kill-pool"  # SIGKILL the kvpool daemon: restarted, it re-attaches arena and ledger
    DRAIN = "drain"  # an operator drains the busiest worker: its requests migrate live


@dataclass
class Stream:
    """One greedy stream as its client saw it."""

    prompt: str
    tokens: list[int] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # monotonic, one per token
    finish: str | None = None
    error: str = ""
    reconnects: int = 0

    @property
    def longest_gap(self) -> float:
        return max((b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)), default=0.0)


def stream(url: str, model: str, prompt: str, tokens: int) -> Stream:
    """A chat completion streamed to its end, reconnecting with Last-Event-ID whenever it breaks."""
    s = Stream(prompt)
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    last, deadline = None, time.monotonic() + STREAM_DEADLINE_S
    while s.finish is None and not s.error and time.monotonic() < deadline:
        headers = {"Last-Event-ID": last} if last else {}
        pending = None
        try:
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=30) as r:
                if r.status_code != 200:
                    r.read()
                    if r.status_code < 500:
                        s.error = f"{r.status_code}: {r.text[:200]}"
                        break
                    raise httpx.TransportError(f"status {r.status_code}")
                for line in r.iter_lines():
                    if line.startswith("id: "):
                        pending = line[4:]
                    elif line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            s.error = str(chunk["error"].get("message"))[:200]
                            break
                        for choice in chunk["choices"]:
                            ids = choice.get("token_ids") or []
                            s.tokens += ids
                            s.arrivals += [time.monotonic()] * len(ids)
                            s.finish = choice.get("finish_reason") or s.finish
                        last, pending = pending or last, None
        except httpx.TransportError:
            time.sleep(0.2)  # the router is gone or not back yet
        if s.finish is None and not s.error:
            s.reconnects += 1
    if s.finish is None and not s.error:
        s.error = f"no end within {STREAM_DEADLINE_S:.0f}s"
    return s


def children_named(parent: int, module: str) -> list[int]:
    """Pids of `parent`'s children whose command line names `module` (the launcher's processes)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent and module in cmdline:
            found.append(int(entry.name))
    return found


class Rehearsal:
    def __init__(self, url: str, launcher_pid: int, streams: int = 6, tokens: int = 80, stop_s: float = 8.0) -> None:
        self.url, self.launcher_pid = url.rstrip("/"), launcher_pid
        self.streams, self.tokens, self.stop_s = streams, tokens, stop_s
        self.model = httpx.get(self.url + "/v1/models", timeout=10).json()["data"][0]["id"]

    def _admin(self, path: str) -> Any:
        return httpx.get(self.url + path, timeout=10).json()

    def _busiest(self) -> dict[str, Any]:
        rows = [w for w in self._admin("/admin/workers") if w["state"] != "dead" and w["role"] != "standby"]
        return max(rows, key=lambda w: w["in_flight"])

    def run(self, fault: Callable[[], str] | None = None, at: float = 0.3) -> tuple[list[Stream], str]:
        """Every stream at once; `fault` strikes once the streams have `at` of their tokens on average.
        Returns the streams and what the fault did."""
        results: list[Stream | None] = [None] * self.streams
        prompts = [f"{PROMPTS[i % len(PROMPTS)]} (stream {i})" for i in range(self.streams)]

        def one(i: int) -> None:
            results[i] = stream(self.url, self.model, prompts[i], self.tokens)

        base = self.tokens_out()
        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(self.streams)]
        for t in threads:
            t.start()
        did = ""
        if fault is not None:
            want, deadline = at * self.tokens * self.streams, time.monotonic() + 120
            while time.monotonic() < deadline and self.tokens_out() - base < want:
                time.sleep(0.05)
            did = fault()
        for t in threads:
            t.join(STREAM_DEADLINE_S + 30)
        lost = "client thread did not end"
        return [r or Stream(p, error=lost) for r, p in zip(results, prompts, strict=True)], did

    def tokens_out(self) -> int:
        """Tokens the server has generated so far (its own counter; 0 while it cannot be reached)."""
        try:
            text = httpx.get(self.url + "/metrics", timeout=10).text
        except httpx.HTTPError:
            return 0
        total = (ln.split()[-1] for ln in text.splitlines() if ln.startswith("steadfast_generation_tokens_total"))
        return int(float(next(total, "0")))

    # --- the faults ------------------------------------------------------------------------------
    def fault(self, scenario: Scenario) -> Callable[[], str]:
        return {
            Scenario.KILL_WORKER: self._kill_worker,
            Scenario.STOP_WORKER: self._stop_worker,
            Scenario.KILL_ROUTER: lambda: self._kill_child("steadfast.control.main", "router"),
            Scenario.KILL_POOL: lambda: self._kill_child("steadfast.kv.pool", "kvpool"),
            Scenario.DRAIN: self._drain,
        }[scenario]

    def _kill_worker(self) -> str:
        w = self._busiest()
        os.kill(w["pid"], signal.SIGKILL)
        return f"worker {w['id']} (pid {w['pid']}, {w['in_flight']} requests) killed"

    def _stop_worker(self) -> str:
        w = self._busiest()
        os.kill(w["pid"], signal.SIGSTOP)
        time.sleep(self.stop_s)
        with contextlib.suppress(ProcessLookupError):  # fenced and killed meanwhile, as it should be
            os.kill(w["pid"], signal.SIGCONT)
        return f"worker {w['id']} (pid {w['pid']}, {w['in_flight']} requests) stopped {self.stop_s:g}s"

    def _kill_child(self, module: str, name: str) -> str:
        pids = children_named(self.launcher_pid, module)
        if not pids:
            raise RuntimeError(f"no {name} process under the launcher {self.launcher_pid}")
        os.kill(pids[0], signal.SIGKILL)
        return f"{name} (pid {pids[0]}) killed"

    def _drain(self) -> str:
        w = self._busiest()
        r = httpx.post(f"{self.url}/admin/workers/{w['id']}/drain", timeout=10)
        r.raise_for_status()
        return f"worker {w['id']} drained ({w['in_flight']} requests)"


def compare(clean: list[Stream], faulted: list[Stream]) -> dict[str, Any]:
    """Each faulted stream against its undisturbed twin."""
    same = [a.tokens == b.tokens and b.finish == a.finish for a, b in zip(clean, faulted, strict=True)]
    return {
        "streams": len(faulted),
        "identical": sum(same),
        "failed": sum(1 for s in faulted if s.error),
        "errors": sorted({s.error for s in faulted if s.error}),
        "longest_gap_ms": round(1000 * max(s.longest_gap for s in faulted), 1),
        "clean_longest_gap_ms": round(1000 * max(s.longest_gap for s in clean), 1),
        "reconnects": sum(s.reconnects for s in faulted),
    }
