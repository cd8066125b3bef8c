"""A load generator for any OpenAI-compatible server (`steadfast bench`): closed loop (N clients, each
sending its next request when the last one ends) or open loop (Poisson arrivals at a rate), prompt and
output length mixes, priorities, multi-turn chat sessions; every request streamed, every token's arrival
timed. Pure asyncio + httpx; no part of the server is imported, so it measures Steadfast and its peers
alike.

Prompt lengths are in words of a fixed English text (about 1.3 tokens a word for the usual BPE
vocabularies); output lengths are exact when the server honours `ignore_eos` (Steadfast, vLLM,
llama.cpp do), else at most that.
"""

from __future__ import annotations

import asyncio
import enum
import json
import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

TEXT = (
    "The history of the lighthouse is a history of light, glass, oil and patience. Keepers trimmed wicks, "
    "wound clockwork and logged the weather through long nights, while ships passed safely in the dark. "
    "Every coast had its own signal: a colour, a rhythm of flashes, a horn in the fog, so that a captain "
    "could name the rock ahead before he could see it. "
).split()
MAX_MIX = 16  # entries of a length or priority mix
OPEN_LOOP_CONNECTIONS = 4096


class Arrivals(enum.StrEnum):
    CLOSED = "closed"  # `concurrency` clients, back to back
    POISSON = "poisson"  # open loop at `rate` per second, whatever the server's speed


def parse_mix(text: str, kind: Callable[[str], Any] = int) -> list[tuple[Any, float]]:
    """'64:0.5,256:0.4,1024:0.1' (value:share, shares normalised) or a single value."""
    mix: list[tuple[Any, float]] = []
    for part in text.split(","):
        value, _, share = part.strip().partition(":")
        mix.append((kind(value), float(share) if share else 1.0))
    total = sum(s for _, s in mix)
    if not mix or len(mix) > MAX_MIX or total <= 0 or any(s < 0 for _, s in mix):
        raise ValueError(f"bad mix {text!r}: value[:share],… with shares >= 0, at most {MAX_MIX}")
    return [(v, s / total) for v, s in mix]


def pick(mix: Sequence[tuple[Any, float]], rng: random.Random) -> Any:
    """One of the mix's values, drawn by its shares."""
    r, acc = rng.random(), 0.0
    for value, share in mix:
        acc += share
        if r < acc:
            return value
    return mix[-1][0]


@dataclass(frozen=True)
class Workload:
    arrivals: Arrivals = Arrivals.CLOSED
    concurrency: int = 8  # closed loop: clients
    rate: float = 4.0  # open loop: arrivals per second
    requests: int = 64  # sessions to run (a session is one request, or `turns` of a chat)
    # > 0: no session starts after this many seconds (closed loop: clients stop; open loop: arrivals
    # end), `requests` being then at most; every session started is waited for.
    seconds: float = 0.0
    prompt_words: list[tuple[int, float]] = field(default_factory=lambda: [(64, 1.0)])
    output_tokens: list[tuple[int, float]] = field(default_factory=lambda: [(128, 1.0)])
    priorities: list[tuple[str, float]] = field(default_factory=list)  # Steadfast's `priority`; empty: none sent
    turns: int = 1  # >1: chat sessions, each turn sending the whole history
    # Fixed prompt texts instead of `prompt_words` of the built-in text: session k's turns send
    # prompts[k % len(prompts)] (a benchmark's own prompts, the same for every server it compares).
    prompts: tuple[str, ...] = ()
    system_words: int = 0  # > 0: each chat session opens with a system message of its own, this many words
    chat: bool = False  # /v1/chat/completions (always for turns > 1) rather than /v1/completions
    temperature: float = 0.0
    ignore_eos: bool = True
    seed: int = 0
    timeout_s: float = 600.0
    # A request refused for load (429 or 503 with Retry-After: Steadfast's admission control) is sent again
    # after that delay, as a patient client would, up to REFUSALS times; its TTFT counts from the first send.
    retry_refused: bool = False
    extra: dict[str, Any] = field(default_factory=dict)  # fields every request body carries (response_format...)

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.requests < 1 or self.turns < 1 or not self.rate > 0 or self.seconds < 0:
            raise ValueError("concurrency, requests and turns must be >= 1, rate > 0 and seconds >= 0")


@dataclass
class Sample:
    """One request as its client saw it."""

    sent: float  # seconds since the run began
    priority: str
    turn: int
    prompt_words: int
    status: int = 0
    error: str = ""
    ttft: float | None = None
    tokens: int = 0
    gaps: list[float] = field(default_factory=list)  # between consecutive chunks that carried text
    refusals: int = 0  # times it was refused for load and sent again (`Workload.retry_refused`)
    end: float = 0.0  # seconds since the run began

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error and self.tokens > 0

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first (a chunk may carry several tokens)."""
        return sum(self.gaps) / (self.tokens - 1) if self.gaps and self.tokens > 1 else None


def words(rng: random.Random, n: int, tag: str) -> str:
    start = rng.randrange(len(TEXT))
    body = [TEXT[(start + i) % len(TEXT)] for i in range(max(0, n - 1))]
    return " ".join([tag, *body])  # a distinct first word: no two prompts share a cached prefix


class LoadGenerator:
    def __init__(
        self,
        url: str,
        workload: Workload,
        api_key: str = "",
        model: str = "",
        on_sample: Callable[[Sample], None] | None = None,
    ) -> None:
        """`on_sample`: told of each request as it ends (progress)."""
        self.url, self.w, self.model = url.rstrip("/"), workload, model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.samples: list[Sample] = []
        self.on_sample = on_sample
        self.wall_s = 0.0
        self.in_flight = 0  # requests sent and not ended

    async def run(self) -> list[Sample]:
        # Open loop: requests in flight are not bounded by the clients, and one waiting for a connection
        # of the pool would be timed as the server's delay.
        most = max(self.w.concurrency, 64) * 2 if self.w.arrivals is Arrivals.CLOSED else OPEN_LOOP_CONNECTIONS
        limits = httpx.Limits(max_connections=most, max_keepalive_connections=64)
        timeout = httpx.Timeout(self.w.timeout_s, connect=30.0)
        async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=self.headers) as c:
            if not self.model:
                r = await c.get(self.url + "/v1/models")
                r.raise_for_status()
                self.model = r.json()["data"][0]["id"]
            rng = random.Random(self.w.seed)
            # Session k's own generator, drawn in order: the same sessions whatever the timing.
            plans = ((k, random.Random(rng.getrandbits(64))) for k in range(self.w.requests))
            t0 = time.perf_counter()
            open_ = lambda at: not self.w.seconds or at < self.w.seconds  # noqa: E731 - may a session start at `at`
            if self.w.arrivals is Arrivals.CLOSED:

                async def client() -> None:
                    for plan in plans:  # one shared iterator: each session goes to one client
                        if not open_(time.perf_counter() - t0):
                            return
                        await self._session(c, *plan, t0)

                await asyncio.gather(*(client() for _ in range(self.w.concurrency)))
            else:
                tasks, at = [], 0.0
                for plan in plans:
                    if not open_(at):
                        break
                    await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
                    tasks.append(asyncio.create_task(self._session(c, *plan, t0)))
                    at += rng.expovariate(self.w.rate)
                await asyncio.gather(*tasks)
            self.wall_s = time.perf_counter() - t0
        return self.samples

    async def _session(self, c: httpx.AsyncClient, k: int, rng: random.Random, t0: float) -> None:
        w = self.w
        priority = pick(w.priorities, rng) if w.priorities else ""
        chat = w.chat or w.turns > 1
        messages: list[dict[str, str]] = []
        if w.system_words:
            messages.append({"role": "system", "content": words(rng, w.system_words, f"system-{w.seed}-{k}")})
        for turn in range(w.turns):
            if w.prompts:
                text = w.prompts[k % len(w.prompts)]
                n = len(text.split())
            else:
                n = pick(w.prompt_words, rng)
                text = words(rng, n, f"s{w.seed}-{k}-{turn}")
            body: dict[str, Any] = {
                "model": self.model,
                "max_tokens": pick(w.output_tokens, rng),
                "temperature": w.temperature,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            body |= w.extra
            if w.ignore_eos:
                body["ignore_eos"] = True
            if priority:
                body["priority"] = priority
            if chat:
                messages.append({"role": "user", "content": text})
                body["messages"] = messages
            else:
                body["prompt"] = text
            sample = Sample(time.perf_counter() - t0, priority, turn, n)
            answer = await self._one(c, "/v1/chat/completions" if chat else "/v1/completions", body, sample, t0)
            self.samples.append(sample)
            if self.on_sample is not None:
                self.on_sample(sample)
            if not sample.ok:
                return  # a session whose turn failed ends there
            messages.append({"role": "assistant", "content": answer})

    async def _one(self, c: httpx.AsyncClient, path: str, body: dict[str, Any], s: Sample, t0: float) -> str:
        start = time.perf_counter()
        text: list[str] = []
        self.in_flight += 1
        stale = 0  # sends lost on a kept-alive connection the server had closed (no answer at all)
        try:
            while True:
                try:
                    r = await c.send(c.build_request("POST", self.url + path, json=body), stream=True)
                except httpx.RemoteProtocolError:
                    if stale:
                        raise
                    stale += 1  # the server closed an idle connection as it was reused: send once more
                    continue
                try:
                    s.status = r.status_code
                    if r.status_code == 200:
                        await self._read(r, s, start, text)
                        break
                    error = (await r.aread()).decode(errors="replace")[:300]
                    wait = retry_after(r) if self.w.retry_refused and s.refusals < REFUSALS else None
                    if wait is None:
                        s.error = error
                        return ""
                finally:
                    await r.aclose()
                s.refusals += 1
                await asyncio.sleep(wait)
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            s.error = repr(exc)[:300]
        finally:
            self.in_flight -= 1
        s.end = time.perf_counter() - t0
        return "".join(text)

    @staticmethod
    async def _read(r: httpx.Response, s: Sample, start: float, text: list[str]) -> None:
        """A 200 answer's stream: its text pieces into `text`, each one's arrival into `s`."""
        last, usage = 0.0, None
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                s.error = str(chunk["error"].get("message", chunk["error"]))[:300]
                break
            usage = chunk.get("usage") or usage
            piece = "".join(
                (ch.get("delta", {}).get("content") or "") if "delta" in ch else (ch.get("text") or "")
                for ch in chunk.get("choices") or []
            )
            if not piece:
                continue
            now = time.perf_counter()
            if s.ttft is None:
                s.ttft = now - start
            else:
                s.gaps.append(now - last)
            last = now
            s.tokens += 1
            text.append(piece)
        if usage and usage.get("completion_tokens"):
            s.tokens = int(usage["completion_tokens"])  # a chunk may carry several tokens


REFUSALS = 20  # times one request is sent again after a refusal for load (`Workload.retry_refused`)


def retry_after(r: httpx.Response) -> float | None:
    """Seconds to wait before sending a request refused for load again; None if it was not such a refusal."""
    if r.status_code not in (429, 503):
        return None
    try:
        return min(30.0, max(0.05, float(r.headers.get("retry-after", ""))))
    except ValueError:
        return None


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def summarize(samples: list[Sample], wall_s: float) -> dict[str, Any]:
    """The figures of one run: throughput, latency percentiles (ms), failures."""
    ok = [s for s in samples if s.ok]
    ttft = [1000 * s.ttft for s in ok if s.ttft is not None]
    tpot = [1000 * t for s in ok if (t := s.tpot) is not None]
    itl = [1000 * g for s in ok for g in s.gaps]
    tokens = sum(s.tokens for s in ok)
    ms = lambda v: round(v, 1) if not math.isnan(v) else None  # noqa: E731 - a local formatter
    return {
        "requests": len(samples),
        "ok": len(ok),
        "failed": len(samples) - len(ok),
        "wall_s": round(wall_s, 2),
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / wall_s, 1) if wall_s > 0 else 0.0,
        "requests_per_s": round(len(ok) / wall_s, 2) if wall_s > 0 else 0.0,
        "ttft_ms": {"mean": ms(statistics.fmean(ttft)) if ttft else None}
        | {f"p{q}": ms(percentile(ttft, q)) for q in (50, 90, 99)},
        "tpot_ms": {"mean": ms(statistics.fmean(tpot)) if tpot else None}
        | {f"p{q}": ms(percentile(tpot, q)) for q in (50, 90, 99)},
        "itl_ms": {f"p{q}": ms(percentile(itl, q)) for q in (50, 99)},
        "errors": sorted({s.error or f"HTTP {s.status}" for s in samples if not s.ok})[:5],
    }
