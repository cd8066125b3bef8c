"""A nemesis soak (`steadfast chaos soak`): open-loop traffic of mixed requests against one served
deployment while a seeded random schedule of faults strikes it, overlapping; every completed stream is
then checked token by token against what the in-process engine computes for the same request.

The workload draws from a catalogue of distinct requests (greedy and seeded, long prompts, multi-turn
chats over one shared system prompt, three priorities), so each expected output is computed once. The
nemesis (`soak_faults.py`) draws each fault's time and kind from the seed alone: the same seed replays
the same schedule. The checker (`soak_check.py`) accounts for every request and every fault.

This module owns the plan, the catalogue and the run; it never judges a run (the checker does) and
never strikes a fault itself.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from steadfast.ops.harness.chaos import Stream, stream_body

PRIORITIES = [("high", 0.1), ("normal", 0.6), ("low", 0.3)]
SYSTEM = "You are a patient teacher. Answer in plain words, one idea at a time, and never use lists."
TOPICS = [
    "how a lighthouse keeper kept the lamp burning through a storm",
    "why copper suits electrical wiring",
    "a fox who learns to read the stars",
    "the water cycle, for a ten-year-old",
    "three principles of a good bridge",
    "the rules of chess",
    "why leaves change colour in autumn",
    "advice for a first-time cook",
    "how bees find their way home",
    "what makes bread rise",
    "how a sundial tells the time",
    "why the sea is salty",
]
FILLER = (
    "the harbour town kept its old habits through every season, the boats came in at dusk, the nets were "
    "mended on the quay, and the children counted the gulls on the roofs while the bells rang the hours"
).split()


@dataclass(frozen=True)
class Ask:
    """One request the workload can send: a chat and its sampling."""

    key: int
    kind: str  # greedy, seeded, long, chat
    messages: tuple[tuple[str, str], ...]  # (role, content)
    max_tokens: int
    temperature: float
    seed: int | None
    priority: str
    adjusted: bool = False  # with ADJUSTED's penalties: state the new owner rebuilds after a fault
    logprobs: bool = False  # with LOGPROBS: each token's logprob checked too
    structured: bool = False  # with STRUCTURED's JSON schema: the grammar's state the new owner rebuilds
    n: int = 1  # choices: each its own engine request, all checked
    tools: bool = False  # with TOOLS: a forced call of a tool whose parameters are SCHEMA

    def body(self, model: str) -> dict[str, Any]:
        b: dict[str, Any] = {
            "model": model,
            "messages": [{"role": r, "content": c} for r, c in self.messages],
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "ignore_eos": True,
            "priority": self.priority,
        }
        return (
            b
            | ({"seed": self.seed} if self.seed is not None else {})
            | (ADJUSTED if self.adjusted else {})
            | (LOGPROBS if self.logprobs else {})
            | (STRUCTURED if self.structured else {})
            | ({"n": self.n} if self.n > 1 else {})
            | (TOOLS if self.tools else {})
        )


# Sampling adjustments every fifth request carries (keys 4, 9, 14, 19: one of each kind).
ADJUSTED = {"presence_penalty": 0.3, "frequency_penalty": 0.4, "repetition_penalty": 1.1}
# Logprobs every fifth request asks for (keys 2, 7, 12, 17, 22).
LOGPROBS = {"logprobs": True, "top_logprobs": 2}
# A JSON schema every fifth request's output follows (keys 0, 5, 10, 15, 20). With `ignore_eos` (as every
# soak request) a finished object is followed by EOS tokens up to max_tokens: all compared token by token.
SCHEMA = {
    "type": "object",
    "properties": {
        "topic": {"type": "string", "maxLength": 40},
        "facts": {"type": "array", "items": {"type": "string", "maxLength": 80}, "minItems": 2, "maxItems": 5},
        "year": {"type": "integer"},
    },
    "required": ["topic", "facts", "year"],
    "additionalProperties": False,
}
STRUCTURED = {"response_format": {"type": "json_schema", "json_schema": {"name": "facts", "schema": SCHEMA}}}
# A forced tool call every fifth request makes (keys 3, 8, 13, 18, 23): the tools in its prompt, the call's
# grammar, and the stream's tool-call reader that a resumed stream primes with what its client holds.
TOOLS = {
    "tools": [{"type": "function", "function": {"name": "note_facts", "parameters": SCHEMA}}],
    "tool_choice": {"type": "function", "function": {"name": "note_facts"}},
}


def catalogue(seed: int, size: int = 24, long_words: int = 400) -> list[Ask]:
    """`size` distinct requests, the same for the same seed."""
    rng = random.Random(seed)
    kinds = ["greedy", "seeded", "long", "chat"]
    asks = []
    for key in range(size):
        kind = kinds[key % len(kinds)]
        topic = TOPICS[rng.randrange(len(TOPICS))]
        priority = rng.choices([p for p, _ in PRIORITIES], [w for _, w in PRIORITIES])[0]
        tokens = rng.choice([24, 48, 96, 160])
        messages: tuple[tuple[str, str], ...] = (("user", f"Tell me about {topic}. (request {key})"),)
        if kind == "long":
            words = " ".join(rng.choice(FILLER) for _ in range(long_words))
            messages = (("user", f"Read this and then tell me about {topic}: {words} (request {key})"),)
        elif kind == "chat":  # a second turn over the shared system prompt: a shared prefix across requests
            messages = (
                ("system", SYSTEM),
                ("user", f"Tell me about {topic}."),
                ("assistant", "Gladly. Where would you like me to begin?"),
                ("user", f"Begin with the part most people get wrong. (request {key})"),
            )
        seeded = kind == "seeded" or (kind == "chat" and key % 8 == 3)
        temperature, ask_seed = (0.8, 1000 + key) if seeded else (0.0, None)
        extras = (key % 5 == 4, key % 5 == 2, key % 5 == 0)  # adjusted, logprobs, structured
        n = 2 if key % 6 == 1 else 1  # (keys 1, 7, 13, 19: seeded, greedy and seeded chats)
        asks.append(Ask(key, kind, messages, tokens, temperature, ask_seed, priority, *extras, n, key % 5 == 3))
    return asks


@dataclass
class Sent:
    """One request of the soak as its client saw it."""

    ask: Ask
    at: float  # monotonic, when it was sent
    stream: Stream = field(default_factory=lambda: Stream(""))
    done: bool = False


@dataclass
class SoakPlan:
    seed: int = 1
    duration_s: float = 120.0
    rate_per_s: float = 2.0  # mean arrivals a second (Poisson)
    max_in_flight: int = 24  # the clients' own bound: an arrival past it waits (counted as late)
    fault_every_s: float = 6.0  # mean time between faults (exponential)
    kinds: tuple[str, ...] = ()  # the nemesis' fault kinds (soak_faults.KINDS); empty: all that apply
    catalogue: int = 24
    stream_deadline_s: float = 240.0


class Traffic:
    """The open-loop clients: a request every exponential interval, each streamed on a thread of its own
    (reconnecting with Last-Event-ID, waiting out refusals), until `stop`."""

    def __init__(self, url: str, model: str, asks: list[Ask], plan: SoakPlan) -> None:
        self.url, self.model, self.asks, self.plan = url, model, asks, plan
        self.rng = random.Random(plan.seed * 7919 + 1)  # the traffic's own draws, apart from the nemesis'
        self.sent: list[Sent] = []
        self.late = 0  # arrivals that waited for the clients' own in-flight bound
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._slots = threading.Semaphore(plan.max_in_flight)

    def running(self) -> list[Sent]:
        """Requests accepted and streaming now (the nemesis' migrations pick among them)."""
        with self._lock:
            return [s for s in self.sent if not s.done and s.stream.request_id and s.stream.tokens]

    def run(self, until: float) -> None:
        while not self._stop.is_set() and time.monotonic() < until:
            self._stop.wait(self.rng.expovariate(self.plan.rate_per_s))
            ask = self.asks[self.rng.randrange(len(self.asks))]
            if not self._slots.acquire(blocking=False):
                self.late += 1
                self._slots.acquire()
            sent = Sent(ask, time.monotonic(), Stream("", choices=ask.n))
            with self._lock:
                self.sent.append(sent)
            t = threading.Thread(target=self._one, args=(sent,), daemon=True)
            self._threads.append(t)
            t.start()

    def _one(self, sent: Sent) -> None:
        try:
            stream_body(self.url, sent.ask.body(self.model), sent.stream, self.plan.stream_deadline_s)
        except Exception as exc:  # noqa: BLE001 - a client's own bug is a failed request, never a hang
            sent.stream.error = sent.stream.error or f"client error: {exc!r}"
        finally:
            sent.done = True
            self._slots.release()

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))


def model_name(url: str) -> str:
    return httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
