"""A second failure before the first one's replacement is ready: the mixed worker is killed, its standby
takes over, and the standby is killed in turn while the supervisor's replacement (forked at once by the
zygote) is still starting. Six greedy fp32 streams must come out token-exact against a fault-free run,
each exactly once; the longest time a client waited for a token is printed (no assertion on time).

A forked replacement is ready within a few hundred milliseconds, too soon for a test to be sure of
killing inside that window, so a failpoint holds the replacement in its start for `SLOW_START_S`: the
printed stall includes that wait (benchmarks/bench_worker_start.py measures the unslowed case)."""

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

STREAMS = 6
MAX_TOKENS = 160  # long enough that both kills land mid-stream on the small model

CONFIG = small_server_config("{workers: 1, standby_workers: 1}")
REPLACEMENT = 2  # worker 0 mixed, worker 1 its standby: the first replacement gets the next id
SLOW_START_S = 1.5


def specs() -> list[dict]:
    return greedy_specs(STREAMS, "second failure", 9100)


def kill(worker: dict) -> None:
    os.kill(worker["pid"], signal.SIGKILL)
    wait_until(lambda: process_gone(worker["pid"]), 10, f"worker {worker['id']} to be gone")


def test_a_second_failure_while_the_replacement_starts_loses_no_token(
    tmp_path, small_model, make_engine, small_config, small_model_path, monkeypatch
):
    want = reference(small_model, make_engine, small_config, specs(), MAX_TOKENS)
    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setenv("STEADFAST_FAILPOINTS", f"worker{REPLACEMENT}_start={SLOW_START_S}")
    monkeypatch.setenv("STEADFAST_FAILPOINT_DIR", str(marks))
    server = ServerProcess(tmp_path, CONFIG, model=small_model_path)
    try:
        server.wait_ready()
        standby = wait_until(
            lambda: next(
                (w for w in admin(server, "workers") if w["role"] == "standby" and w["state"] == "ready"), None
            ),
            60,
            "a ready standby",
        )
        model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        streams = [Stream(server.url, model, s, MAX_TOKENS) for s in specs()]
        for s in streams:
            s.start()
        wait_until(lambda: min(len(s.tokens) for s in streams) >= 8, 120, "every stream at 8 tokens")
        (first,) = [w for w in admin(server, "workers") if w["role"] == "mixed"]
        kill(first)
        # The standby took over (it answered for the moved requests) and its replacement is starting.
        wait_until(
            lambda: any(
                t["from_worker"] == first["id"] and t["first_token_ms"] is not None for t in admin(server, "takeovers")
            ),
            60,
            "the first takeover",
        )
        wait_until(lambda: list(marks.glob(f"worker{REPLACEMENT}_start.*")), 30, "the replacement in its start")
        workers = admin(server, "workers")
        (second,) = [w for w in workers if w["id"] == standby["id"]]
        starting = [w for w in workers if w["role"] == "standby"]
        assert second["role"] == "mixed" and [w["id"] for w in starting] == [REPLACEMENT], workers
        assert all(w["state"] != "ready" for w in starting), workers
        assert all(s.finish is None for s in streams), "the streams ended before the second kill"
        kill(second)
        for s in streams:
            s.join(timeout=300)

        assert_exact_once(streams, want)
        takeovers = admin(server, "takeovers")
        assert {t["from_worker"] for t in takeovers} >= {first["id"], second["id"]}, takeovers
        stall = max(b - a for s in streams for a, b in zip(s.arrivals, s.arrivals[1:], strict=False))
        print(f"second failure within the replacement's start: longest client stall {1000 * stall:.0f} ms")
    finally:
        print(server.output()[-4000:])  # shown when the test fails
        server.stop()
