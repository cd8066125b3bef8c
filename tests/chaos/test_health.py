"""Health detection through a real `steadfast serve` (two workers of one node, the small model, fp32).

- A worker whose logits turn non-finite (its process alive and reporting) fails its requests: each is
  retried once on the other worker and completes token-exactly; the worker is judged sick, shown so by
  `/health`, and takes no new request.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from steadfast.protocol import AddRequest, SamplingParams
from tests.chaos.test_hung_engine import arm
from tests.conftest import PROMPTS
from tests.integration.server import ServerProcess

pytestmark = pytest.mark.chaos

TOKENS = 40


def config(health: str) -> str:
    return (
        "model: {dtype: float32, device: cpu}\n"
        "cache: {kv_memory_mb: 64}\n"
        "server: {workers: 2, standby_workers: 0, threads_per_worker: 1, status_interval_s: 0.25}\n"
        # The ladder is off: these tests judge the health check alone (a slowed worker breaks TPOT on purpose).
        "degradation: {enabled: false}\n"
        f"health: {health}\n"
    )


def stream(url: str, prompt: str, tokens: int, priority: str = "normal") -> tuple[list[int], str | None, list[float]]:
    """One greedy stream: its token ids, finish reason and the arrival time of each token."""
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    body |= {"stream": True, "return_token_ids": True, "priority": priority}
    got, finish, times = [], None, []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                ids = choice.get("token_ids") or []
                got += ids
                times += [time.monotonic()] * len(ids)
                finish = choice["finish_reason"] or finish
    return got, finish, times


def run_streams(url: str, jobs: list[tuple[str, int, str]]) -> list[tuple[list[int], str | None, list[float]]]:
    results: list = [None] * len(jobs)

    def one(i: int) -> None:
        results[i] = stream(url, *jobs[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join()
    return results


def reference(small_config, small_model, make_engine, prompts: list[str], tokens: int) -> list[list[int]]:
    engine = make_engine(small_config, small_model)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    reqs = [AddRequest(f"r{i}", small_model.tokenizer.encode(p), params) for i, p in enumerate(prompts)]
    out = engine.generate(reqs)
    return [[t for o in out[f"r{i}"] for t in o.token_ids] for i in range(len(prompts))]


def test_a_worker_whose_requests_fail_is_taken_out_and_they_complete_elsewhere(
    tmp_path, monkeypatch, small_model_path, small_config, small_model, make_engine
):
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} (stream {i})" for i in range(6)]
    want = reference(small_config, small_model, make_engine, prompts, TOKENS)
    # Worker 1's logits turn NaN from its 8th step on: its process lives and reports, its requests fail.
    marks = arm(monkeypatch, tmp_path, "worker1_nonfinite=0@8")
    server = ServerProcess(tmp_path, config("{sick_failures: 2, sick_cooldown_s: 600}"), model=small_model_path)
    try:
        server.wait_ready()
        got = run_streams(server.url, [(p, TOKENS, "normal") for p in prompts[:4]])
        assert list(marks.glob("worker1_nonfinite.*")), "worker 1's logits never broke: the fault did not happen"
        for (ids, finish, _), expected in zip(got, want, strict=False):
            assert ids == expected and finish == "length"
        health = httpx.get(server.url + "/admin/health").json()
        assert health["workers"]["1"]["standing"] == "sick", health
        assert health["workers"]["1"]["layers"]["request"]["state"] == "fail"
        assert health["workers"]["0"]["standing"] == "healthy"
        moved = httpx.get(server.url + "/admin/takeovers").json()
        assert moved and all(t["from_worker"] == 1 and t["to_worker"] == 0 for t in moved), moved
        assert health["retried_requests"] == len(moved)  # each failed request retried once, no more
        listed = {w["id"]: w for w in httpx.get(server.url + "/health").json()["workers"]}
        assert listed[1]["standing"] == "sick" and listed[0]["standing"] == "healthy"
        # Out of rotation: new requests all go to worker 0 and complete.
        before = len(moved)
        later = run_streams(server.url, [(p, TOKENS, "normal") for p in prompts[4:]])
        for (ids, finish, _), expected in zip(later, want[4:], strict=False):
            assert ids == expected and finish == "length"
        assert len(httpx.get(server.url + "/admin/takeovers").json()) == before  # none failed there again
        decisions = httpx.get(server.url + "/admin/routing").json()["decisions"]
        assert [d["chosen"] for d in decisions[-2:]] == [0, 0]
        assert all(c["worker_id"] == 0 for d in decisions[-2:] for c in d["candidates"])
        assert (
            'steadfast_worker_health_standing{standing="sick",worker="1"} 1.0'
            in httpx.get(server.url + "/metrics").text
        )
    finally:
        server.stop()
