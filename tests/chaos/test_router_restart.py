"""The router killed mid-stream (and a client dropping its own connection): clients reconnect with
`Last-Event-ID` and each stream ends token-identical to a fault-free run, no token twice, none missing.

The restarted router has none of the old one's memory: it finds each request in the ledger, stops it
where it still runs, and resumes it from the last checkpoint, regenerating (never resending) what the
client already holds.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from steadfast.ops.harness.chaos import children_named
from steadfast.util.proc import process_gone
from tests import sse
from tests.chaos.test_crash_recovery import chat_body, reference, request_specs
from tests.conftest import wait_until
from tests.integration.server import ServerProcess

pytestmark = pytest.mark.chaos

MAX_TOKENS = 64

CONFIG = """
model: {dtype: float32, device: cpu}
cache: {kv_memory_mb: 256}
server: {standby_workers: 0}
fault_recovery:
  kv_cache: {snapshot_interval_steps: 8}
degradation: {enabled: false}  # its streams must all start (the ladder may refuse new ones on a loaded machine)
"""


class ResumingStream(threading.Thread):
    """A client that reconnects with Last-Event-ID whenever its stream breaks (or it drops it)."""

    def __init__(self, url: str, model: str, spec: dict, drop_at: int = 0, max_tokens: int = MAX_TOKENS) -> None:
        super().__init__(daemon=True)
        self.url, self.model, self.spec, self.drop_at = url, model, spec, drop_at
        self.max_tokens = max_tokens
        self.tokens: list[int] = []
        self.counts: list[int] = []  # tokens held after each event, from the event ids
        self.finish: str | None = None
        self.error: str | None = None
        self.reconnects = 0

    def run(self) -> None:
        body = chat_body(self.model, self.spec, self.max_tokens)
        last = None
        deadline = time.monotonic() + 240
        while self.finish is None and time.monotonic() < deadline:
            try:
                for event_id, chunk in sse.events(self.url + "/v1/chat/completions", body, last):
                    if "error" in chunk:
                        self.error = chunk["error"]["message"]
                        return
                    for choice in chunk["choices"]:
                        self.tokens.extend(choice.get("token_ids", []))
                        self.finish = choice.get("finish_reason") or self.finish
                    if event_id:
                        last = event_id
                        self.counts.append(int(event_id.split(":")[1]))
                    if self.drop_at and len(self.tokens) >= self.drop_at:
                        self.drop_at = 0
                        break  # the client drops its own connection
            except sse.Refused as exc:
                self.error = str(exc)
                return
            except httpx.TransportError:
                time.sleep(0.2)  # the router is gone or not back yet
            if self.finish is None:
                self.reconnects += 1


def test_router_killed_mid_stream_clients_resume_with_last_event_id(
    tmp_path, small_model, make_engine, small_config, small_model_path
):
    specs = request_specs()
    want = reference(small_model, make_engine, small_config, specs, MAX_TOKENS)
    server = ServerProcess(tmp_path, CONFIG, model=small_model_path)
    try:
        server.wait_ready()
        model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        (router,) = children_named(server.proc.pid, "steadfast.control.main")
        streams = [ResumingStream(server.url, model, s, drop_at=10 if i == 3 else 0) for i, s in enumerate(specs)]
        for s in streams:
            s.start()
        wait_until(lambda: min(len(s.tokens) for s in streams) >= 16, 120, "every stream at 16 tokens")
        os.kill(router, signal.SIGKILL)
        wait_until(lambda: process_gone(router), 10, "the router to be gone")
        for s in streams:
            s.join(timeout=240)
        (restarted,) = children_named(server.proc.pid, "steadfast.control.main")
        assert restarted != router
        for i, s in enumerate(streams):
            assert s.error is None, (i, s.error)
            assert s.finish == "length", (i, s.finish, len(s.tokens))
            assert s.reconnects >= 1, i  # each stream really broke and came back
            assert s.counts == sorted(set(s.counts)) and s.counts[-1] == MAX_TOKENS, (i, s.counts)
            assert s.tokens == want[i], f"stream {i} differs from the fault-free run"
        assert streams[3].reconnects >= 2  # its own drop, then the router's death
    finally:
        print(server.output()[-6000:])  # shown when the test fails
        server.stop()
