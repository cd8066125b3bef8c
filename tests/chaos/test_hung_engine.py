"""A worker whose engine loop hangs (the process alive, its threads running) loses its lease, is fenced
and killed, and its client's stream carries on on the standby, token-exactly."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from steadfast.wire.worker import AddRequest, SamplingParams
from tests.conftest import wait_until
from tests.integration.server import ServerProcess

pytestmark = pytest.mark.chaos

TOKENS = 96
HANG_AT_STEP = 30


def greedy_reference(small_config, small_model, make_engine, prompt: str, max_tokens: int) -> list[int]:
    """The tokens the in-process engine gives for `prompt`, greedy: what the client must receive."""
    ids = small_model.tokenizer.encode(prompt)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    reference = make_engine(small_config, small_model).generate([AddRequest("ref", ids, params)])["ref"]
    return [t for out in reference for t in out.token_ids]


def arm(monkeypatch, tmp_path, spec: str):
    """Arm STEADFAST_FAILPOINTS for the server started next; the folder where a reached one leaves its mark."""
    marks = tmp_path / "failpoints"
    marks.mkdir()
    monkeypatch.setenv("STEADFAST_FAILPOINTS", spec)
    monkeypatch.setenv("STEADFAST_FAILPOINT_DIR", str(marks))
    return marks


def test_a_hung_engine_loop_lets_its_lease_lapse_and_the_stream_moves(
    tmp_path, monkeypatch, small_model_path, small_config, small_model, make_engine
):
    prompt = "The lighthouse keeper wrote in his log"
    want = greedy_reference(small_config, small_model, make_engine, prompt, TOKENS)
    # Worker 0's loop stops at its 30th step for two minutes: alive, lease thread and all, but stuck.
    marks = arm(monkeypatch, tmp_path, f"worker0_step=120@{HANG_AT_STEP}")
    cfg = (
        "model: {dtype: float32, device: cpu}\n"
        "cache: {kv_memory_mb: 64}\n"
        "fault_recovery: {lease: {renew_interval_ms: 200, lease_timeout_ms: 1000, engine_stall_ms: 1500}}\n"
    )
    server = ServerProcess(tmp_path, cfg, model=small_model_path)
    try:
        server.wait_ready()
        model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
        body |= {"stream": True, "return_token_ids": True}
        got, finish, started = [], None, time.monotonic()
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    got += choice.get("token_ids", [])
                    finish = choice["finish_reason"] or finish
        assert list(marks.glob("worker0_step.*")), "the engine never hung: the fault did not happen"
        assert got == want and finish == "length", (len(got), len(want))
        moved = wait_until(lambda: httpx.get(server.url + "/admin/takeovers").json(), 10, "the takeover record")
        assert moved[0]["from_worker"] == 0 and moved[0]["at_token"] >= HANG_AT_STEP - 2
        assert "made no progress" in server.output() and "fenced while alive" in server.output()
        assert time.monotonic() - started < 100  # well before the hang would have ended by itself
    finally:
        server.stop()


def test_a_request_without_a_token_for_request_timeout_moves_to_the_standby(
    tmp_path, monkeypatch, small_model_path, small_config, small_model, make_engine
):
    """The loop stalls for 6 s (its lease holds: engine_stall is a minute): after request_timeout
    the router moves the request to the standby. (With none, the error it ends with is
    `test_router_delivery.py`'s.)"""
    prompt = "A short history of clocks"
    want = greedy_reference(small_config, small_model, make_engine, prompt, 48)
    marks = arm(monkeypatch, tmp_path, "worker0_step=6@12")
    cfg = (
        "model: {dtype: float32, device: cpu}\n"
        "cache: {kv_memory_mb: 64}\n"
        "server: {request_timeout: 2s, standby_workers: 1}\n"
        "fault_recovery: {lease: {engine_stall_ms: 60000}, takeover: {wait_timeout: 2s}}\n"
    )
    server = ServerProcess(tmp_path, cfg, model=small_model_path)
    try:
        server.wait_ready()
        model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": prompt, "max_tokens": 48, "temperature": 0, "ignore_eos": True}
        body |= {"stream": True, "return_token_ids": True}
        got, finish, errors = [], None, []
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        errors.append(chunk["error"]["message"])
                        continue
                    got += chunk["choices"][0].get("token_ids", [])
                    finish = chunk["choices"][0]["finish_reason"] or finish
        assert list(marks.glob("worker0_step.*")), "the engine never stalled: the fault did not happen"
        assert "received no token for" in server.output()
        assert not errors and got == want and finish == "length"
        (moved,) = httpx.get(server.url + "/admin/takeovers").json()
        assert moved["from_worker"] == 0 and moved["to_worker"] != 0
    finally:
        server.stop()
