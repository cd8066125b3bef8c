"""The router's door: keys per route family, admin from loopback only without an admin key, and the
tokenizer kept off the event loop."""

from __future__ import annotations

import asyncio
import threading

import pytest

from steadfast.control.api import tokenized
from steadfast.control.errors import APIError
from steadfast.control.guard import GuardConfig, refusal
from steadfast.control.serving import ServingContext

pytestmark = pytest.mark.unit


def scope(path: str, host: str = "127.0.0.1", token: str = "") -> dict:
    headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
    return {"type": "http", "path": path, "client": (host, 5555), "headers": headers}


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
