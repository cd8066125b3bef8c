"""No standby ready: a dead worker's requests go to a live worker of its node (the KV reserve the
takeover keeps gives them room) at once, not to the replacement the supervisor starts. Two mixed workers
and no standby; the busier one is killed mid-stream; every greedy fp32 stream comes out token-exact,
each token once, and every takeover went to the survivor."""

from __future__ import annotations

import os
import signal

import httpx
import pytest

from steadfast.util.proc import process_gone
from tests.chaos.test_crash_recovery import (
    Stream,
    admin,
    assert_exact_once,
    greedy_specs,
    reference,
    small_server_config,
)
from tests.conftest import wait_until
from tests.integration.server import ServerProcess

pytestmark = pytest.mark.chaos

STREAMS = 4
MAX_TOKENS = 96

CONFIG = small_server_config("{workers: 2, standby_workers: 0}")


def specs() -> list[dict]:
    return greedy_specs(STREAMS, "no standby", 9300)


def test_without_a_standby_a_live_worker_takes_the_dead_ones_requests(
    tmp_path, small_model, make_engine, small_config, small_model_path
):
    want = reference(small_model, make_engine, small_config, specs(), MAX_TOKENS)
    server = ServerProcess(tmp_path, CONFIG, model=small_model_path)
    try:
        server.wait_ready()
        model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        streams = [Stream(server.url, model, s, MAX_TOKENS) for s in specs()]
        for s in streams:
            s.start()
        wait_until(lambda: min(len(s.tokens) for s in streams) >= 8, 120, "every stream at 8 tokens")
        mixed = [w for w in admin(server, "workers") if w["role"] == "mixed"]
        assert len(mixed) == 2 and not [w for w in admin(server, "workers") if w["role"] == "standby"]
        victim, survivor = sorted(mixed, key=lambda w: -w["in_flight"])
        assert victim["in_flight"] > 0
        os.kill(victim["pid"], signal.SIGKILL)
        wait_until(lambda: process_gone(victim["pid"]), 10, "the killed worker to be gone")
        for s in streams:
            s.join(timeout=300)

        assert_exact_once(streams, want)
        moved = [t for t in admin(server, "takeovers") if t["from_worker"] == victim["id"]]
        assert len(moved) == victim["in_flight"], moved
        assert {t["to_worker"] for t in moved} == {survivor["id"]}, moved  # not the replacement
        assert all(t["first_token_ms"] is not None for t in moved)
    finally:
        print(server.output()[-4000:])  # shown when the test fails
        server.stop()
