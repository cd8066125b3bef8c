"""A worker stopped by SIGTERM, through a real `steadfast serve` (two workers of one node, the small
model, fp32) under steady load: closed-loop clients start a new request as soon as the last ended. No
request may fail, every stream must equal the in-process engine's, token for token, and the stopped
worker is drained onto the other first. (The rolling restart, `steadfast rollout`, is rehearsed under
the same kind of load by `steadfast chaos rollout` in tests/chaos/test_chaos_cli.py.)
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from steadfast.wire.worker import AddRequest, SamplingParams
from tests.conftest import PROMPTS, wait_until
from tests.integration.server import serving

pytestmark = pytest.mark.integration

TOKENS = 40
CLIENTS = 4
CONFIG = (
    "model: {dtype: float32, device: cpu}\n"
    "cache: {kv_memory_mb: 64}\n"
    "server: {workers: 2, standby_workers: 0, threads_per_worker: 1}\n"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory, small_model_path):
    with serving(tmp_path_factory.mktemp("rollout"), CONFIG, model=small_model_path) as s:
        yield s


@pytest.fixture(scope="module")
def want(small_config, small_model) -> dict[int, list[int]]:
    from steadfast.worker.engine import Engine
    from steadfast.worker.loaded import private_arena

    path = f"/dev/shm/steadfast-test-rollout-{os.getpid()}.kv"
    engine = Engine(small_config, small_model, private_arena(small_config, small_model.model_cfg, path))
    try:
        params = SamplingParams(TOKENS, 0.0, ignore_eos=True)
        reqs = [AddRequest(f"r{i}", small_model.tokenizer.encode(PROMPTS[i]), params) for i in range(CLIENTS)]
        out = engine.generate(reqs)
    finally:
        engine.arena.unlink()  # the file and its spec
    return {i: [t for o in out[f"r{i}"] for t in o.token_ids] for i in range(CLIENTS)}


class Load:
    """Closed-loop clients: each streams PROMPTS[i] again and again until stopped, recording every
    stream's tokens, finish and error, and the longest pause between two of its chunks."""

    def __init__(self, url: str) -> None:
        self.url, self.stop = url, threading.Event()
        self.results: list[tuple[int, list[int], str | None, str | None]] = []
        self.longest_gap = 0.0
        self.threads = [threading.Thread(target=self._client, args=(i,)) for i in range(CLIENTS)]

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()

    def _client(self, i: int) -> None:
        import json

        body = {"model": "m", "prompt": PROMPTS[i], "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
        body |= {"stream": True, "return_token_ids": True}
        body["model"] = httpx.get(self.url + "/v1/models").json()["data"][0]["id"]
        while not self.stop.is_set():
            ids, finish, error, last = [], None, None, time.monotonic()
            try:
                with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=60) as r:
                    if r.status_code != 200:
                        error = f"{r.status_code}: {r.read().decode()}"
                    for line in r.iter_lines():
                        if not line.startswith("data: {"):
                            continue
                        now = time.monotonic()
                        self.longest_gap, last = max(self.longest_gap, now - last), now
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            error = chunk["error"]["message"]
                            continue
                        ids += chunk["choices"][0].get("token_ids", [])
                        finish = chunk["choices"][0]["finish_reason"] or finish
            except httpx.HTTPError as exc:
                error = f"{type(exc).__name__}: {exc}"
            self.results.append((i, ids, finish, error))


def workers(server) -> dict[int, dict]:
    return {w["id"]: w for w in httpx.get(server.url + "/admin/workers").json()}


def check(load: Load, want: dict[int, list[int]]) -> None:
    failed = [(i, finish, error) for i, _, finish, error in load.results if error or finish != "length"]
    assert not failed, failed
    wrong = [i for i, ids, _, _ in load.results if ids != want[i]]
    assert not wrong, wrong


def test_a_worker_sent_sigterm_is_drained_onto_the_other_first(server, want):
    rows = workers(server)
    victim = min(rows)
    with Load(server.url) as load:
        time.sleep(1.0)
        os.kill(rows[victim]["pid"], signal.SIGTERM)
        wait_until(lambda: victim not in workers(server), 60, "the stopped worker to retire")
        time.sleep(0.5)
    check(load, want)
    assert len(workers(server)) == len(rows) - 1  # not replaced: a planned stop
    assert "retired" in server.output()
