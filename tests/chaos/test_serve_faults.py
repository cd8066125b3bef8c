"""Faults against a whole `steadfast serve`: what a client streaming through the API sees."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from steadfast.ops.chaos import children_named
from tests.integration.server import ServerProcess

pytestmark = pytest.mark.chaos


def test_kvpool_killed_mid_stream_is_restarted_and_the_stream_completes(tmp_path, small_model_path):
    cfg = (
        "model: {dtype: float32, device: cpu}\n"
        "cache: {kv_memory_mb: 128, pool_grant_batch: 2}\n"
        "fault_recovery: {lease: {renew_interval_ms: 100, lease_timeout_ms: 1000}}\n"
    )
    server = ServerProcess(tmp_path, cfg, model=small_model_path)
    try:
        server.wait_ready()
        (pool,) = children_named(server.proc.pid, "steadfast.kv.pool")
        model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        body = {
            "model": model,
            "prompt": "Once upon a time",
            "max_tokens": 200,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        texts, usage, killed = [], None, False
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                elif chunk["choices"]:
                    texts.append(chunk["choices"][0]["text"])
                if len(texts) == 10 and not killed:
                    os.kill(pool, signal.SIGKILL)  # small grant batches: the worker needs the pool again soon
                    killed = True
        assert killed and usage["completion_tokens"] == 200
        deadline = time.monotonic() + 10
        while not (new := children_named(server.proc.pid, "steadfast.kv.pool")) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert new and new[0] != pool
        assert "restarting it" in server.output()
        # A generous timeout (httpx waits 5 s by default): a loaded 2-core machine is slow.
        again = httpx.post(
            server.url + "/v1/completions", json={**body, "stream": False, "max_tokens": 20}, timeout=120
        )
        again = again.json()
        assert again["usage"]["completion_tokens"] == 20
    finally:
        server.stop()
