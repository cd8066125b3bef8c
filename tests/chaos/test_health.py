"""Health detection through a real `steadfast serve` (two workers of one node, the small model, fp32).

- A worker whose logits turn non-finite (its process alive and reporting) fails its requests: each is
  retried once on the other worker and completes token-exactly; the worker is judged sick, shown so by
  `/health`, and takes no new request.
- A worker stopped and continued on a duty cycle that grows (SIGSTOP/SIGCONT from the test) is caught by
  its delta-based score and its low-priority streams migrate away before their token gaps break the TPOT
  SLO; the same worker stopped on a random duty cycle of the same mean from the start (a noisy worker,
  not a worsening one) has no request moved for its health.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time

import httpx
import pytest

from steadfast.protocol import AddRequest, SamplingParams
from tests.chaos.test_hung_engine import arm
from tests.conftest import PROMPTS, wait_until
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


HEALTH = "{interval_s: 0.5, recent_s: 3, baseline_s: 30, min_baseline: 6, worker_cooldown_s: 1, request_cooldown_s: 60}"
PERIOD_S = 0.1
SLO_TPOT_S = 0.080


class DutyCycle:
    """SIGSTOP/SIGCONT of one process every PERIOD_S for `stop(t)` seconds, t since start, on a thread."""

    def __init__(self, pid: int, stop) -> None:  # noqa: ANN001 - a function of seconds
        self.pid, self.stop_for = pid, stop
        self.done = threading.Event()
        self.longest = 0.0
        self.started = time.monotonic()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.is_set():
            d = max(0.0, min(PERIOD_S * 0.9, self.stop_for(time.monotonic() - self.started)))
            if d > 0:
                os.kill(self.pid, signal.SIGSTOP)
                time.sleep(d)
                os.kill(self.pid, signal.SIGCONT)
                self.longest = max(self.longest, d)
            time.sleep(PERIOD_S - d)

    def end(self) -> None:
        self.done.set()
        self.thread.join()
        os.kill(self.pid, signal.SIGCONT)


def worker_pid(url: str, worker_id: int) -> int:
    return next(w["pid"] for w in httpx.get(url + "/admin/workers").json() if w["id"] == worker_id)


def owners(url: str) -> dict[int, int]:
    return {w["id"]: w["in_flight"] for w in httpx.get(url + "/admin/workers").json()}


def gaps_p99(times: list[float]) -> float:
    gaps = sorted(b - a for a, b in zip(times, times[1:], strict=False))
    return gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] if gaps else 0.0


@pytest.mark.parametrize("profile", ["growing", "jitter"])
def test_a_worker_slowing_down_is_drained_of_low_priority_work_and_a_noisy_one_is_not(
    tmp_path, small_model_path, profile
):
    """Eight long streams, four low and four high priority, over two workers. Worker 1 is stopped on a
    duty cycle: `growing` from 0 to 90 % of each 100 ms over 24 s after an 8 s calm start; `jitter` a
    random share with the same mean over the same span, from the start."""
    server = ServerProcess(tmp_path, config(HEALTH), model=small_model_path)
    try:
        server.wait_ready()
        span, calm = 24.0, 8.0

        def growing(t: float) -> float:
            return 0.0 if t < calm else 0.09 * min(1.0, (t - calm) / span)

        mean = 0.09 / 2 * span / (span + calm)  # the growing profile's mean stop over its run

        def jitter(_: float) -> float:
            return random.uniform(0.0, 2 * mean)

        jobs = [(f"{PROMPTS[i % len(PROMPTS)]} (long {i})", 2000, "low" if i % 2 else "high") for i in range(8)]
        results: list = []
        runner = threading.Thread(target=lambda: results.extend(run_streams(server.url, jobs)))
        runner.start()
        wait_until(lambda: sum(owners(server.url).values()) == 8, 30, "eight streams in flight")
        on_one = owners(server.url)[1]
        assert on_one >= 2, "worker 1 got too few streams to judge"
        cycle = DutyCycle(worker_pid(server.url, 1), growing if profile == "growing" else jitter)
        try:
            runner.join(timeout=240)
        finally:
            cycle.end()
        assert not runner.is_alive()
        assert all(finish == "length" and len(ids) == 2000 for ids, finish, _ in results)
        assert cycle.longest >= 0.05, "the worker was hardly stopped: the fault did not happen"
        migrations = httpx.get(server.url + "/admin/migrations").json()
        for_health = [m for m in migrations if m["reason"] == "health"]
        if profile == "jitter":
            assert not for_health, for_health  # noise of a steady mean is no trend
            return
        assert for_health and all(m["from_worker"] == 1 and m["outcome"] == "committed" for m in for_health)
        # Every low-priority stream left worker 1 before its TPOT p99 broke the SLO: what each low client
        # saw stayed within it, though worker 1's own stops grew past it.
        assert cycle.longest > SLO_TPOT_S
        for (_, _, times), (_, _, priority) in zip(results, jobs, strict=False):
            if priority == "low":
                assert gaps_p99(times) <= SLO_TPOT_S, (priority, gaps_p99(times))
        events = httpx.get(server.url + "/admin/health").json()["events"]
        assert any(e["worker_id"] == 1 and e["what"].endswith("degraded") for e in events), events
    finally:
        server.stop()
