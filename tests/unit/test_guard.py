"""The router's door: keys per route family, admin from loopback only without an admin key, and the
tokenizer kept off the event loop."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from steadfast.control.http.chat import tokenized
from steadfast.control.http.errors import APIError
from steadfast.control.http.guard import GuardConfig, refusal
from steadfast.control.http.serving import ServingContext

pytestmark = pytest.mark.unit


def scope(path: str, host: str = "127.0.0.1", token: str = "", **headers: str) -> dict:
    sent = [(b"authorization", f"Bearer {token}".encode())] if token else []
    sent += [(name.replace("_", "-").encode(), value.encode()) for name, value in headers.items()]
    if "host" not in headers:
        sent.append((b"host", b"127.0.0.1:8000"))
    return {"type": "http", "method": "GET", "path": path, "client": (host, 5555), "headers": sent}


def status(s: dict, cfg: GuardConfig) -> int:
    refused = refusal(s, cfg)
    return 0 if refused is None else refused.status


def test_admin_routes_are_loopback_only_without_an_admin_key():
    cfg = GuardConfig()
    assert status(scope("/admin/workers"), cfg) == 0
    assert status(scope("/admin/workers", "::1"), cfg) == 0
    assert status(scope("/admin/takeovers", "10.1.2.3"), cfg) == 403
    assert status(scope("/v1/models", "10.1.2.3"), cfg) == 0  # no api key set: /v1 is open


def test_keys_guard_their_routes():
    cfg = GuardConfig(api_key="user-key", admin_api_key="admin-key")
    assert status(scope("/v1/models", "10.1.2.3"), cfg) == 401
    assert status(scope("/v1/models", "10.1.2.3", "admin-key"), cfg) == 401
    assert status(scope("/v1/models", "10.1.2.3", "user-key"), cfg) == 0
    assert status(scope("/admin/workers"), cfg) == 401  # with an admin key, loopback is no pass
    assert status(scope("/admin/workers", "10.1.2.3", "user-key"), cfg) == 401
    assert status(scope("/admin/workers", "10.1.2.3", "admin-key"), cfg) == 0
    assert status(scope("/health", "10.1.2.3"), cfg) == 0 and status(scope("/metrics", "10.1.2.3"), cfg) == 0
    closed = GuardConfig(api_key="user-key", open_metrics=False)
    assert status(scope("/metrics", "10.1.2.3"), closed) == 401
    assert status(scope("/metrics", "10.1.2.3", "user-key"), closed) == 0


def test_the_dashboard_page_is_open_and_its_data_is_admin_only():
    cfg = GuardConfig(api_key="user-key", admin_api_key="admin-key", open_metrics=False)
    for path in ("/dashboard", "/dashboard/dashboard.js", "/dashboard/dashboard.css"):
        assert status(scope(path, "10.1.2.3"), cfg) == 0  # code only: a browser cannot send a key for a page
    assert status(scope("/dashboard/../admin/workers", "10.1.2.3"), cfg) == 401  # only those three paths
    assert status(scope("/dashboard/other.js", "10.1.2.3"), cfg) == 401
    assert status(scope("/admin/dashboard", "10.1.2.3", "user-key"), cfg) == 401
    assert status(scope("/admin/dashboard", "10.1.2.3", "admin-key"), cfg) == 0
    assert status(scope("/admin/dashboard", "10.1.2.3"), GuardConfig()) == 403


def test_tokenizing_runs_off_the_event_loop():
    ctx = ServingContext(None, None, "m", 10, 16, None)  # type: ignore[arg-type]
    seen = []

    def encode(text: str) -> list[int]:
        seen.append(threading.get_ident())
        if "\ud800" in text:
            raise ValueError("lone surrogate")
        return [len(text)]

    async def run() -> int:
        assert await tokenized(ctx, "prompt", encode, "hello") == [5]
        with pytest.raises(APIError) as refused:
            await tokenized(ctx, "prompt", encode, "a \ud800")
        assert refused.value.status == 400 and refused.value.param == "prompt"
        return threading.get_ident()

    loop_thread = asyncio.run(run())
    assert seen and loop_thread not in seen


def test_calls_over_the_connection_limit_get_429_and_bodies_over_the_limit_413():
    from steadfast.control.http.guard import Guard

    release = asyncio.Event()

    async def app(scope, receive, send):  # a route that reads its body, then holds its call open
        while (await receive()).get("more_body"):
            pass
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    guard = Guard(app, GuardConfig(max_connections=1, max_body_bytes=10))

    async def call(chunks: list[bytes], headers: list | None = None) -> list[dict]:
        sent: list[dict] = []
        parts = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]

        async def receive():
            return parts.pop(0) if parts else {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        await guard({**scope("/v1/completions"), "headers": [*(headers or []), (b"host", b"localhost")]}, receive, send)
        return sent

    async def run() -> None:
        first = asyncio.ensure_future(call([b"{}"]))
        await asyncio.sleep(0.01)
        (start, _) = await call([b"{}"])  # the one slot is taken
        assert start["status"] == 429 and (b"retry-after", b"1") in start["headers"]
        release.set()
        assert (await first)[0]["status"] == 200
        # Over the limit, whether Content-Length says so or the body only shows it as it arrives.
        (start, _) = await call([b"x" * 11], [(b"content-length", b"11")])
        assert start["status"] == 413
        (start, _) = await call([b"x" * 6, b"x" * 6])
        assert start["status"] == 413

    asyncio.run(run())


def test_a_stopping_router_refuses_new_v1_calls_with_503_and_says_it_is_not_ready():
    from steadfast.control.http.guard import Guard
    from steadfast.control.http.shutdown import Shutdown

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    shutdown = Shutdown()
    guard = Guard(app, GuardConfig(shutdown=shutdown))

    async def call(path: str) -> tuple[int, dict]:
        sent: list[dict] = []

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            sent.append(message)

        await guard(scope(path), receive, send)
        body = sent[1]["body"]
        return sent[0]["status"], (json.loads(body) if body != b"ok" else {})

    async def run() -> None:
        assert (await call("/v1/models"))[0] == 200 and (await call("/health"))[0] == 200
        shutdown.ask()
        status, body = await call("/v1/chat/completions")
        assert status == 503
        assert body["error"]["message"] == "the server is shutting down"
        assert body["error"]["type"] == "service_unavailable" and body["error"]["code"] == "shutting_down"
        assert await call("/health") == (503, {"status": "unavailable", "workers": []})
        assert (await call("/admin/workers"))[0] == 200  # still there to watch the stop
        assert (await call("/metrics"))[0] == 200

    asyncio.run(run())


class FakeWorker:
    def __init__(self) -> None:
        self.in_flight: set[str] = set()


class FakeClient:
    """What `Shutdown.drain` uses of the engine client: requests that finish after `steps` polls, or never."""

    def __init__(self, requests: int, steps: int | None) -> None:
        self.worker = FakeWorker()
        self.worker.in_flight = {f"r{i}" for i in range(requests)}
        self.steps = steps
        self.ended: list[str] = []
        self.aborted: list[str] = []

    @property
    def workers(self) -> list[FakeWorker]:
        return [self.worker]

    @property
    def pending(self) -> int:
        if self.steps is not None:
            self.steps -= 1
            if self.steps <= 0:
                self.worker.in_flight.clear()
        return len(self.worker.in_flight)

    def end_all(self, why: str) -> int:
        self.ended.append(why)
        return len(self.worker.in_flight)

    async def abort(self, worker: FakeWorker, rid: str) -> None:
        self.aborted.append(rid)
        worker.in_flight.discard(rid)  # as a stream closing on its error event


class FakeServer:
    should_exit = False


def drained(client: FakeClient, timeout_s: float, signals: int = 1) -> tuple[float, FakeServer]:
    from steadfast.control.http.shutdown import Phase, Shutdown

    async def run() -> tuple[float, FakeServer]:
        shutdown, server = Shutdown(), FakeServer()
        task = asyncio.ensure_future(shutdown.drain(client, server, timeout_s))  # type: ignore[arg-type]
        await asyncio.sleep(0.05)
        assert not server.should_exit and shutdown.phase is Phase.SERVING  # not asked yet
        t0 = time.monotonic()
        for _ in range(signals):
            shutdown.ask()
        await task
        assert shutdown.refusing
        return time.monotonic() - t0, server

    return asyncio.run(run())


def test_a_stopping_router_waits_for_its_requests_then_exits():
    client = FakeClient(requests=3, steps=5)
    took, server = drained(client, timeout_s=30)
    assert server.should_exit and took < 5
    assert client.ended == [] and client.aborted == []  # they finished on their own


def test_requests_past_the_shutdown_timeout_end_with_an_error_and_are_aborted_on_their_workers():
    from steadfast.control.http.shutdown import ENDED

    client = FakeClient(requests=2, steps=None)
    took, server = drained(client, timeout_s=0.3)
    assert server.should_exit and 0.3 <= took < 3
    assert client.ended == [ENDED] and sorted(client.aborted) == ["r0", "r1"]
    assert "shut down" in ENDED
    # Told twice (a second Ctrl-C): ended at once, not after the timeout.
    client = FakeClient(requests=1, steps=None)
    took, server = drained(client, timeout_s=30, signals=2)
    assert server.should_exit and took < 3 and client.aborted == ["r0"]
