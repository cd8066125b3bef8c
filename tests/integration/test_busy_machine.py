"""The default server on a busy machine (two CPU-bound processes beside it from a minute before and
throughout): one request at a time is never refused and the ladder stays at L0, however slow the
hardware is against the SLO; a real burst is still shed at admission, with Retry-After, while what it
admits is served in full and so is a high-priority request sent during it; the level is back at L0
soon after; and an operator's breaker released to auto lets the next request in."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.integration.server import ServerProcess

pytestmark = pytest.mark.integration

# Issue 47's acceptance: the hogs run at least a minute before the first measured request (the server
# boots under them meanwhile), then 100 requests one after another.
HOG_LEAD_S = 60.0
SEQUENTIAL = 100
BURST = 300
TTFT_TARGET_MS = 500.0  # the default slo.ttft_ms.p99
MODEL: list[str] = []  # the served model's id, asked once
CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]


@pytest.fixture(scope="module")
def hogs() -> Iterator[float]:
    """Two busy loops, one a core; yields when they started."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        yield time.monotonic()
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.fixture(scope="module")
def server(hogs, tmp_path_factory) -> Iterator[ServerProcess]:
    s = ServerProcess(tmp_path_factory.mktemp("busy"), config_yaml="# the defaults\n")
    try:
        s.wait_ready(timeout=300)
        time.sleep(max(0.0, HOG_LEAD_S - (time.monotonic() - hogs)))
        yield s
    finally:
        s.stop()


class Sampler:
    """/admin/degradation's level, read once a second while it runs."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.levels: list[tuple[float, int]] = []
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=10) as c:
            while True:
                r = await c.get(self.url + "/admin/degradation")
                self.levels.append((time.monotonic(), r.json()["level"]))
                await asyncio.sleep(1.0)

    def __enter__(self) -> Sampler:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


async def stream(c: httpx.AsyncClient, url: str, priority: str, max_tokens: int) -> dict:
    """One streamed chat request: its status, Retry-After, text and TTFT (s), from when the request was
    sent (`ttft`) and from when the client began it (`ttft_client`: with its wait for a connection, which
    300 coroutines in one process on a hogged core spend most of)."""
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"] if not MODEL else MODEL[0]
    MODEL[:] = [model]
    body = {
        "model": model,
        "messages": CHAT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "priority": priority,
    }
    start = sent = time.monotonic()

    async def trace(event: str, info: dict) -> None:
        nonlocal sent
        if event == "http11.send_request_body.complete":
            sent = time.monotonic()

    out: dict = {"status": 0, "ttft": math.nan, "ttft_client": math.nan, "text": "", "retry_after": None}
    async with c.stream("POST", url + "/v1/chat/completions", json=body, extensions={"trace": trace}) as r:
        out["status"] = r.status_code
        out["retry_after"] = r.headers.get("retry-after")
        if r.status_code != 200:
            out["error"] = json.loads(await r.aread())["error"]
            return out
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            delta = chunk["choices"][0]["delta"].get("content") if chunk.get("choices") else None
            if delta and math.isnan(out["ttft"]):
                now = time.monotonic()
                out["ttft"], out["ttft_client"] = now - sent, now - start
            out["text"] += delta or ""
    return out


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


def test_one_at_a_time_is_always_served_and_a_burst_is_shed_then_forgotten(server):
    async def scenario() -> None:
        url = server.url
        # No keep-alive: a pooled connection that the server closes after its 5 s keep-alive timeout while
        # the client (300 coroutines on a hogged machine) is slow to reuse it races the next request.
        limits = httpx.Limits(max_connections=BURST + 20, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=180, limits=limits) as c:
            # One after another: never more than one in flight.
            with Sampler(url) as sampler:
                results = [await stream(c, url, "normal", 8) for _ in range(SEQUENTIAL)]
            print(f"{SEQUENTIAL} sequential requests done", flush=True)
            refused = [r for r in results if r["status"] != 200]
            assert not refused, refused[:3]
            assert all(r["text"] for r in results)
            levels = [lv for _, lv in sampler.levels]
            assert len(levels) >= 5 and set(levels) == {0}, levels
            view = (await c.get(url + "/admin/degradation")).json()
            print("hardware:", json.dumps(view["hardware"]), "calibration:", view["calibration"])

            # A burst of low-priority streams, and a high-priority one in the middle of it.
            async def high_later() -> dict:
                await asyncio.sleep(1.0)
                return await stream(c, url, "high", 16)

            with Sampler(url) as sampler:
                burst = [stream(c, url, "low", 8) for _ in range(BURST)]
                *lows, high = await asyncio.gather(*burst, high_later())
                ended = time.monotonic()
                deadline = ended + 30
                while time.monotonic() < deadline:
                    if (await c.get(url + "/admin/degradation")).json()["level"] == 0:
                        break
                    await asyncio.sleep(0.5)
                back = time.monotonic() - ended
            shed = [r for r in lows if r["status"] != 200]
            served = [r for r in lows if r["status"] == 200]
            print(
                f"burst: {len(served)} served, {len(shed)} refused "
                f"({sorted({r['status'] for r in shed})}), admitted TTFT p99 "
                f"{1000 * p99([r['ttft'] for r in served]):.0f} ms from sent "
                f"({1000 * p99([r['ttft_client'] for r in served]):.0f} ms from begun; target "
                f"{TTFT_TARGET_MS:.0f} ms), high TTFT {1000 * high['ttft']:.0f} ms, "
                f"levels {sorted({lv for _, lv in sampler.levels})}, L0 again after {back:.1f} s"
            )
            assert shed, "a burst of 300 at once was not shed at all"
            assert all(r["status"] in (429, 503) and r["retry_after"] for r in shed), shed[:3]
            assert served and all(r["text"] for r in served)
            # Latency is printed, not asserted (no timing in tests): the figures of repeated runs are in
            # BENCHMARKS.md.
            assert high["status"] == 200 and high["text"], high
            assert (await c.get(url + "/admin/degradation")).json()["level"] == 0, f"not at L0 {back:.0f} s after"

            # An operator's breaker, released to auto: the next request (nothing queued) is admitted.
            r = await c.post(url + "/admin/degradation", json={"level": 5})
            assert r.status_code == 200, r.text
            held = await stream(c, url, "normal", 4)
            assert held["status"] == 503 and held["retry_after"]
            r = await c.post(url + "/admin/degradation", json={"level": "auto"})
            assert r.status_code == 200, r.text
            after = await stream(c, url, "normal", 4)
            assert after["status"] == 200 and after["text"], after

    asyncio.run(scenario())
