"""`steadfast serve` stopped by SIGTERM: new requests get a 503 while the streams in flight go on to their
end (or, past `server.shutdown_timeout`, end with an error event saying the server shut down); then the
router, the workers and the pools exit in that order, and the launcher exits 0 without logging an error.

One server serves every case (its start is most of the cost): the long stream keeps the refusal's window
open whatever the machine's speed.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass

import httpx
import pytest

from steadfast.control.http.shutdown import ENDED
from tests.conftest import wait_until
from tests.integration.server import ServerProcess

pytestmark = pytest.mark.integration

# Two streams short enough to finish within the timeout even on a busy machine, one far too long to.
SHORT, LONG = 16, 4000
MAX_TOKENS = [SHORT, SHORT, LONG]
SHUTDOWN_TIMEOUT_S = 8


class Stream(threading.Thread):
    """One streamed chat completion read to its end: its tokens, finish reason and error event."""

    def __init__(self, url: str, model: str, max_tokens: int, i: int) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.body = {
            "model": model,
            "messages": [{"role": "user", "content": f"Tell me a long story, number {i}."}],
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }
        self.tokens = 0
        self.finish: str | None = None
        self.error: str | None = None
        self.ended_at = 0.0
        self.done = False  # `data: [DONE]`: the stream was closed by the server, not broken
        self.broken: str | None = None

    @property
    def over(self) -> bool:
        return self.finish is not None or self.error is not None or self.broken is not None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url + "/v1/chat/completions", json=self.body, timeout=60) as r:
                if r.status_code != 200:
                    self.broken = f"status {r.status_code}: {r.read()!r}"
                    return
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            self.error = chunk["error"]["message"]
                            self.ended_at = time.monotonic()
                        for choice in chunk.get("choices", []):
                            self.tokens += len(choice.get("token_ids", []))
                            self.finish = choice.get("finish_reason") or self.finish
        except httpx.HTTPError as exc:
            self.broken = repr(exc)


@dataclass
class Stopped:
    streams: list[Stream]
    tokens_at_signal: list[int]
    signalled_at: float
    health: int  # what /health answered once it stopped saying 200 (0: nothing answered)
    refused: httpx.Response | None  # None: nothing answered
    running_when_refused: int
    exit_code: int
    output: str


def health(url: str) -> int:
    try:
        return httpx.get(url + "/health", timeout=2).status_code
    except httpx.TransportError:
        return 0


@pytest.fixture(scope="module")
def stopped(tmp_path_factory: pytest.TempPathFactory, small_model_path: str) -> Stopped:
    """One server (a start costs most of this test's time) with short and long streams under way, sent
    SIGTERM, asked for a new request while it stops, then gone."""
    config = (
        "model: {dtype: float32, device: cpu}\ncache: {kv_memory_mb: 64}\n"
        f"server: {{standby_workers: 0, shutdown_timeout: {SHUTDOWN_TIMEOUT_S}s}}\n"
    )
    server = ServerProcess(tmp_path_factory.mktemp("graceful"), config, model=small_model_path)
    try:
        server.wait_ready()
        model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        streams = [Stream(server.url, model, n, i) for i, n in enumerate(MAX_TOKENS)]
        for s in streams:
            s.start()
        wait_until(lambda: all(s.tokens >= 2 for s in streams), 60, "every stream under way")
        signalled_at = time.monotonic()
        os.kill(server.proc.pid, signal.SIGTERM)  # the launcher alone (it leads its own session)
        tokens_at_signal = [s.tokens for s in streams]
        deadline = time.monotonic() + 10
        while (answer := health(server.url)) == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        try:
            refused: httpx.Response | None = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=10)
        except httpx.TransportError:
            refused = None
        running_when_refused = sum(not s.over for s in streams)
        exit_code = server.proc.wait(timeout=SHUTDOWN_TIMEOUT_S + 60)
        for s in streams:
            s.join(timeout=10)
        return Stopped(
            streams, tokens_at_signal, signalled_at, answer, refused, running_when_refused, exit_code, server.output()
        )
    finally:
        print(server.output()[-6000:])  # shown when a test fails
        server.stop()


def test_a_new_request_while_stopping_gets_503_with_an_error_body(stopped: Stopped):
    assert stopped.health == 503  # not ready, and still there to say so
    refused = stopped.refused
    assert refused is not None and refused.status_code == 503 and refused.headers["content-type"] == "application/json"
    error = refused.json()["error"]
    assert error["message"] == "the server is shutting down" and error["code"] == "shutting_down"
    assert stopped.running_when_refused >= 1  # refused while streams were still in flight


def test_streams_that_finish_within_the_shutdown_timeout_end_normally(stopped: Stopped):
    for i, (s, n) in enumerate(zip(stopped.streams, MAX_TOKENS, strict=True)):
        if n != SHORT:
            continue
        assert stopped.tokens_at_signal[i] < n  # it was in flight at the signal
        assert (s.broken, s.error) == (None, None), i
        assert s.finish == "length" and s.tokens == n and s.done, (i, s.finish, s.tokens)


def test_streams_still_running_past_the_shutdown_timeout_end_with_an_error_event(stopped: Stopped):
    (s,) = [s for s, n in zip(stopped.streams, MAX_TOKENS, strict=True) if n == LONG]
    assert s.broken is None and s.error == ENDED and s.done, (s.broken, s.error)
    assert s.finish is None and s.tokens < LONG, (s.finish, s.tokens)
    assert SHUTDOWN_TIMEOUT_S <= s.ended_at - stopped.signalled_at < SHUTDOWN_TIMEOUT_S + 5  # at the timeout


def test_the_launcher_stops_every_child_in_order_and_exits_0_without_an_error(stopped: Stopped):
    assert stopped.exit_code == 0, stopped.exit_code
    errors = [line for line in stopped.output.splitlines() if "ERROR" in line or "Traceback" in line]
    assert errors == []
    assert "killing it" not in stopped.output  # each child exited on its SIGTERM, in its time
    assert "clean release failed" not in stopped.output  # the workers' pool was still there when they left


def test_a_sigterm_as_soon_as_the_router_answers_is_a_stop_in_order(tmp_path, small_model_path):
    """The router answers /health before the launcher has finished starting (it polls the same route);
    a SIGTERM in between, when clients may already stream, is a stop in order with exit code 0, not
    an abort of the start."""
    config = "model: {dtype: float32, device: cpu}\ncache: {kv_memory_mb: 64}\nserver: {standby_workers: 0}\n"
    server = ServerProcess(tmp_path, config, model=small_model_path)
    try:
        deadline = time.monotonic() + 120
        while health(server.url) != 200:
            assert server.proc.poll() is None and time.monotonic() < deadline, server.output()[-3000:]
            time.sleep(0.005)
        os.kill(server.proc.pid, signal.SIGTERM)
        assert server.proc.wait(timeout=60) == 0, server.output()[-3000:]
        assert "Traceback" not in server.output()
    finally:
        server.stop()
