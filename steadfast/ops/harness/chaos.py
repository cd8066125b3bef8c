"""Fault rehearsals (`steadfast chaos SCENARIO`): greedy streams run twice against one server, once
undisturbed and once while a named fault strikes mid-stream; every stream of the second run must equal
its first-run twin token for token. The figures of the recovery: the longest wait a client saw between
two tokens, tokens recomputed by takeovers, failed streams.

Streams resume with `Last-Event-ID` when their connection breaks (a killed router), as a client should.
The faults (ops/harness/chaos_faults.py) act on the server's processes by signal, so the rehearsal runs on the
server's host; the server is started by the command (ops/harness/chaos_cli.py), which knows its process tree.
"""

from __future__ import annotations

import enum
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

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
REFUSED = (429, 503)  # admission refusals that say when to come back (Retry-After)
MAX_RETRY_AFTER_S = 5.0


class Scenario(enum.StrEnum):
    KILL_WORKER = "kill-worker"  # SIGKILL the busiest worker: a standby takes its requests over
    STOP_WORKER = "stop-worker"  # SIGSTOP it past its lease: fenced, killed, taken over
    KILL_ROUTER = "kill-router"  # SIGKILL the router: restarted, clients resume with Last-Event-ID
    KILL_POOL = "kill-pool"  # SIGKILL the kvpool daemon: restarted, it re-attaches arena and ledger
    DRAIN = "drain"  # an operator drains the busiest worker: its requests migrate live
    SLOW_WORKER = "slow-worker"  # the busiest worker stopped for a growing share of its time
    BREAK_TRANSFER = "break-transfer"  # the KV wire's primary path drops every frame
    OVERLOAD = "overload"  # a burst of low-priority streams far beyond capacity
    ROLLOUT = "rollout"  # every worker replaced in turn, its requests migrated first


@dataclass
class Stream:
    """One greedy stream as its client saw it."""

    prompt: str
    client: int = 0  # which of the rehearsal's clients sent it (its twin in the other run)
    tokens: list[int] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # monotonic, one per token
    finish: str | None = None
    error: str = ""
    reconnects: int = 0
    refusals: int = 0  # 429/503 at admission, each waited out (Retry-After) and sent again
    accepted: bool = False  # a 200 came: the service took it
    request_id: str = ""  # the service's id for it (its chunks'), once accepted
    logprobs: list[float] = field(default_factory=list)  # each token's, where the request asked
    choices: int = 1  # `n` of the request: `tokens` are choice 0's, `others` the rest's
    others: dict[int, list[int]] = field(default_factory=dict)
    ended: dict[int, str] = field(default_factory=dict)  # each choice's finish reason, as it came

    @property
    def all_tokens(self) -> list[int]:
        """Every choice's tokens, choice after choice."""
        return self.tokens + [t for k in range(1, self.choices) for t in self.others.get(k, [])]

    @property
    def longest_gap(self) -> float:
        return max((b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)), default=0.0)


def stream(url: str, model: str, prompt: str, tokens: int, priority: str = "normal", client: int = 0) -> Stream:
    """A greedy chat completion of `prompt` streamed to its end (`stream_body`)."""
    body = {
        "priority": priority,
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    return stream_body(url, body, Stream(prompt, client))


def stream_body(url: str, body: dict[str, Any], s: Stream, deadline_s: float = STREAM_DEADLINE_S) -> Stream:
    """The chat completion `body` streamed to its end into `s`, reconnecting with Last-Event-ID whenever
    it breaks and waiting out admission refusals (Retry-After)."""
    body = body | {"stream": True, "return_token_ids": True}
    last, deadline = None, time.monotonic() + deadline_s
    while s.finish is None and not s.error and time.monotonic() < deadline:
        headers = {"Last-Event-ID": last} if last else {}
        pending = None
        try:
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=30) as r:
                if r.status_code != 200:
                    r.read()
                    if r.status_code in REFUSED and "retry-after" in r.headers:
                        # Not accepted (the ladder or a queue bound): a polite client waits and asks again.
                        s.refusals += 1
                        time.sleep(min(MAX_RETRY_AFTER_S, max(0.1, float(r.headers["retry-after"]))))
                        continue
                    if r.status_code < 500:
                        s.error = f"{r.status_code}: {r.text[:200]}"
                        break
                    raise httpx.TransportError(f"status {r.status_code}")
                s.accepted = True
                for line in r.iter_lines():
                    if line.startswith("id: "):
                        pending = line[4:]
                    elif line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        s.request_id = s.request_id or chunk.get("id", "")
                        if "error" in chunk:
                            s.error = str(chunk["error"].get("message"))[:200]
                            break
                        for choice in chunk["choices"]:
                            ids = choice.get("token_ids") or []
                            k = choice.get("index", 0)
                            if k:
                                s.others.setdefault(k, []).extend(ids)
                            else:
                                s.tokens += ids
                                if choice.get("logprobs"):  # (a chunk's are its text's tokens': in order)
                                    s.logprobs += [c["logprob"] for c in choice["logprobs"]["content"]]
                                s.arrivals += [time.monotonic()] * len(ids)
                            if choice.get("finish_reason"):
                                s.ended[k] = choice["finish_reason"]
                        if len(s.ended) == s.choices:  # (every choice ended: choice 0's reason stands)
                            s.finish = s.ended[0]
                        last, pending = pending or last, None
        except httpx.TransportError:
            time.sleep(0.2)  # the router is gone or not back yet
        if s.finish is None and not s.error:
            s.reconnects += 1
    if s.finish is None and not s.error:
        s.error = f"no end within {deadline_s:.0f}s"
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


class Striking(Protocol):
    """What the rehearsal needs of a fault."""

    before_streams: bool
    closed_loop: bool

    def strike(self) -> str: ...

    def settle(self) -> None: ...


class Rehearsal:
    """The same greedy streams against one server, undisturbed or while a fault strikes. A fault is an
    object with `strike()` (ops/harness/chaos_faults.py): the rehearsal only times it."""

    def __init__(
        self,
        url: str,
        launcher_pid: int,
        streams: int = 6,
        tokens: int = 80,
        stop_s: float = 8.0,
        drill: Path | None = None,
        burst: int = 200,
    ) -> None:
        self.url, self.launcher_pid = url.rstrip("/"), launcher_pid
        self.streams, self.tokens, self.stop_s = streams, tokens, stop_s
        self.drill, self.burst = drill, burst  # the server's KV fault drill file; overload's burst size
        self.model = httpx.get(self.url + "/v1/models", timeout=10).json()["data"][0]["id"]

    def admin(self, path: str) -> Any:
        return httpx.get(self.url + path, timeout=10).json()

    def busiest(self) -> dict[str, Any]:
        """The serving worker with the most requests in flight."""
        rows = [w for w in self.admin("/admin/workers") if w["state"] != "dead" and w["role"] != "standby"]
        return max(rows, key=lambda w: w["in_flight"])

    def run(self, fault: Striking | None = None, at: float = 0.3, priority: str = "normal") -> tuple[list[Stream], str]:
        """Every client's stream at once; `fault` strikes once the streams have `at` of their tokens on
        average (or before they start, when its `before_streams`) and settles after they ended. When
        its `closed_loop`, each client sends its prompt again and again until the strike is over (a
        rollout outlasts any one stream). Returns the streams, in order of clients, and what the fault did."""
        results: list[list[Stream]] = [[] for _ in range(self.streams)]
        prompts = [f"{PROMPTS[i % len(PROMPTS)]} (stream {i})" for i in range(self.streams)]
        struck = threading.Event()
        again = fault is not None and fault.closed_loop

        def client(i: int) -> None:
            while True:
                results[i].append(stream(self.url, self.model, prompts[i], self.tokens, priority, i))
                if not again or struck.is_set() or results[i][-1].error:
                    return

        did = fault.strike() if fault is not None and fault.before_streams else ""
        base = self.tokens_out()
        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(self.streams)]
        for t in threads:
            t.start()
        try:
            if fault is not None and not fault.before_streams:
                want, deadline = at * self.tokens * self.streams, time.monotonic() + 120
                while time.monotonic() < deadline and self.tokens_out() - base < want:
                    time.sleep(0.05)
                did = fault.strike()
            struck.set()
            for t in threads:
                t.join(STREAM_DEADLINE_S + 30)
        finally:
            struck.set()
            if fault is not None:
                fault.settle()
        lost = "client thread did not end"
        for i, got in enumerate(results):
            if not got or threads[i].is_alive():
                got.append(Stream(prompts[i], i, error=lost))
        return [s for got in results for s in got], did

    def tokens_out(self) -> int:
        """Tokens the server has generated so far (its own counter; 0 while it cannot be reached)."""
        try:
            text = httpx.get(self.url + "/metrics", timeout=10).text
        except httpx.HTTPError:
            return 0
        total = (ln.split()[-1] for ln in text.splitlines() if ln.startswith("steadfast_generation_tokens_total"))
        return int(float(next(total, "0")))


def compare(clean: list[Stream], faulted: list[Stream]) -> dict[str, Any]:
    """Each faulted stream against its undisturbed twin (the clean run's stream of the same client)."""
    twin = {s.client: s for s in clean}
    same = [twin[b.client].tokens == b.tokens and b.finish == twin[b.client].finish for b in faulted]
    return {
        "streams": len(faulted),
        "identical": sum(same),
        "failed": sum(1 for s in faulted if s.error),
        "errors": sorted({s.error for s in faulted if s.error}),
        "longest_gap_ms": round(1000 * max(s.longest_gap for s in faulted), 1),
        "clean_longest_gap_ms": round(1000 * max(s.longest_gap for s in clean), 1),
        "reconnects": sum(s.reconnects for s in faulted),
        "refusals": sum(s.refusals for s in faulted),
    }
