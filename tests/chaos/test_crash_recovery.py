"""Crash recovery through a whole `steadfast serve`: the active worker is `kill -9`ed several times while
16 clients stream; every stream must carry on and end token-identical to a fault-free run.

What the clients received is checked token by token (`return_token_ids`), with the SSE event ids
proving no token came twice and none was skipped; each kill is checked to have landed (the pid is
gone) and to have been taken over (the router's takeover records name the killed worker).
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

from steadfast.util.proc import process_gone
from steadfast.wire.worker import AddRequest, SamplingParams
from tests.conftest import PROMPTS, wait_until
from tests.integration.server import ServerProcess

pytestmark = pytest.mark.chaos

STREAMS = 16
MAX_TOKENS = 96  # the small model decodes fast: long enough that the last kill still lands mid-stream
KILLS = 3

CONFIG = """
model: {dtype: float32, device: cpu}
cache: {kv_memory_mb: 256}
server: {standby_workers: 3}  # a reload can take longer than the streams: one ready per kill
fault_recovery:
  kv_cache: {snapshot_interval_steps: 4, recovery_mode: ledger_first}
"""


def request_specs() -> list[dict]:
    specs = []
    for i in range(STREAMS):
        prompt = f"{PROMPTS[i % len(PROMPTS)]} (variant {i})"
        temperature = 0.0 if i % 2 == 0 else 0.8  # greedy and seeded sampling
        specs.append({"prompt": prompt, "temperature": temperature, "seed": 7000 + i})
    return specs


def reference(model, make_engine, cfg, specs, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    tok = model.tokenizer
    reqs = [
        AddRequest(
            f"r{i}",
            tok.encode_chat([{"role": "user", "content": s["prompt"]}]),
            SamplingParams(max_tokens, s["temperature"], seed=s["seed"], ignore_eos=True),
        )
        for i, s in enumerate(specs)
    ]
    out = make_engine(cfg, model).generate(reqs)
    return [[t for o in out[f"r{i}"] for t in o.token_ids] for i in range(len(specs))]


def chat_body(model: str, spec: dict, max_tokens: int = MAX_TOKENS) -> dict:
    """A streamed chat request that returns each chunk's token ids."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": spec["prompt"]}],
        "max_tokens": max_tokens,
        "temperature": spec["temperature"],
        "seed": spec["seed"],
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }


class Stream(threading.Thread):
    def __init__(self, url: str, model: str, spec: dict, max_tokens: int = MAX_TOKENS) -> None:
        super().__init__(daemon=True)
        self.url, self.model, self.spec, self.max_tokens = url, model, spec, max_tokens
        self.tokens: list[int] = []
        self.arrivals: list[float] = []  # when each chunk with tokens came (monotonic)
        self.event_ids: list[str] = []
        self.finish: str | None = None
        self.error: str | None = None

    def run(self) -> None:
        body = chat_body(self.model, self.spec, self.max_tokens)
        try:
            with httpx.stream("POST", self.url + "/v1/chat/completions", json=body, timeout=300) as r:
                for line in r.iter_lines():
                    if line.startswith("id: "):
                        self.event_ids.append(line[4:])
                    elif line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            self.error = chunk["error"]["message"]
                            return
                        for choice in chunk["choices"]:
                            if choice.get("token_ids"):
                                self.arrivals.append(time.monotonic())
                            self.tokens.extend(choice.get("token_ids", []))
                            self.finish = choice.get("finish_reason") or self.finish
        except Exception as exc:  # noqa: BLE001 - any failure is this stream's result
            self.error = repr(exc)


def assert_exact_once(streams: list[Stream], want: list[list[int]]) -> None:
    """Every stream ended normally with the fault-free run's tokens, each exactly once."""
    for i, s in enumerate(streams):
        assert s.error is None, (i, s.error)
        assert s.finish == "length", (i, s.finish)
        # Event ids count the tokens the client holds: strictly increasing, ending at the total.
        counts = [int(e.rsplit(":", 2)[1]) for e in s.event_ids]
        assert counts == sorted(set(counts)) and counts[-1] == s.max_tokens, (i, counts)
        assert s.tokens == want[i], f"stream {i} differs from the fault-free run"


def small_server_config(server: str) -> str:
    """A fault test's server on the small model: fp32 on the CPU, a small arena, adoption first."""
    return (
        "model: {dtype: float32, device: cpu}\ncache: {kv_memory_mb: 256}\n"
        f"server: {server}\n"
        "fault_recovery:\n  kv_cache: {snapshot_interval_steps: 4, recovery_mode: ledger_first}\n"
    )


def greedy_specs(count: int, tag: str, seed: int) -> list[dict]:
    return [
        {"prompt": f"{PROMPTS[i % len(PROMPTS)]} ({tag} {i})", "temperature": 0.0, "seed": seed + i}
        for i in range(count)
    ]


def admin(server: ServerProcess, what: str) -> list[dict]:
    return httpx.get(f"{server.url}/admin/{what}", timeout=10).json()


def test_killed_workers_streams_resume_token_exactly(
    tmp_path, small_model, make_engine, small_config, small_model_path
):
    specs = request_specs()
    want = reference(small_model, make_engine, small_config, specs)
    server = ServerProcess(tmp_path, CONFIG, model=small_model_path)
    rng = random.Random(20261129)
    killed: list[tuple[int, int]] = []  # (worker id, pid)
    try:
        server.wait_ready()
        wait_until(
            lambda: any(w["role"] == "standby" and w["state"] == "ready" for w in admin(server, "workers")),
            60,
            "a ready standby",
        )
        model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        streams = [Stream(server.url, model, s) for s in specs]
        for s in streams:
            s.start()
        for _ in range(KILLS):
            # A random point mid-stream, once a hot standby is there to take over.
            floor = len(killed) * MAX_TOKENS // (KILLS + 1) + rng.randint(2, MAX_TOKENS // (KILLS + 1))
            wait_until(lambda f=floor: min(len(s.tokens) for s in streams) >= f, 120, f"every stream at {floor}")
            workers = wait_until(
                lambda: (
                    (ws := admin(server, "workers"))
                    and any(w["role"] == "standby" and w["state"] == "ready" for w in ws)
                    and ws
                ),
                120,
                "a ready standby",
            )
            (victim,) = [w for w in workers if w["role"] == "mixed"]
            assert all(s.finish is None for s in streams), "the streams ended before this kill"
            os.kill(victim["pid"], signal.SIGKILL)
            wait_until(lambda v=victim: process_gone(v["pid"]), 10, "the killed worker to be gone")
            killed.append((victim["id"], victim["pid"]))
            wait_until(
                lambda v=victim: any(t["from_worker"] == v["id"] for t in admin(server, "takeovers")),
                60,
                f"a takeover from worker {victim['id']}",
            )
        for s in streams:
            s.join(timeout=300)

        takeovers = admin(server, "takeovers")
        assert_exact_once(streams, want)
        assert len(killed) == KILLS and len({pid for _, pid in killed}) == KILLS
        for worker_id, _ in killed:
            moved = [t for t in takeovers if t["from_worker"] == worker_id]
            assert moved, f"no takeover recorded from worker {worker_id}"
            assert all(t["first_token_ms"] is not None for t in moved)
        routes = {t["route"] for t in takeovers}
        assert "ledger_first" in routes, takeovers  # sealed blocks were adopted, not all recomputed
    finally:
        print(server.output()[-6000:])  # shown when the test fails
        server.stop()
