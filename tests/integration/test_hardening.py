"""What one client sends never harms another, and nobody reads a stream that is not theirs: each finding
of the hardening review, tried against a real server the way a hostile client would, with a victim
stream beside it that must stay token-exact.

One server (the small model, fp32, an API key, tight limits) is shared by the module.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.integration.server import ServerProcess, serving

pytestmark = pytest.mark.integration


def post(url: str, **kwargs) -> httpx.Response:
    return httpx.post(url, timeout=120, **kwargs)


def get(url: str, **kwargs) -> httpx.Response:
    return httpx.get(url, timeout=30, **kwargs)


KEY = "sk-test-" + "k" * 24
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMITS = {"max_body_bytes": 65536, "max_messages": 16, "max_prompt_chars": 20000, "max_pending_requests": 24}
KEEPALIVE_S = 0.25  # (a stream this quiet gets a comment: short, so a test sees several in a second)


@pytest.fixture(scope="module")
def server(tmp_path_factory, small_model_path):
    limits = ", ".join(f"{k}: {v}" for k, v in LIMITS.items())
    # No degradation ladder: these tests drive the server past the default SLOs on two cores (24 streams at
    # once, a fuzz beside eight streams), where the ladder rightly refuses new requests (429), which is not
    # what they test; tests/integration/test_degradation.py does.
    cfg = (
        "model: {dtype: float32, max_model_len: 512}\ncache: {kv_memory_mb: 64}\n"
        f"server: {{api_key: {KEY}, standby_workers: 0, sse_keepalive: {KEEPALIVE_S}, {limits}}}\n"
        "degradation: {enabled: false}\n"
    )
    with serving(tmp_path_factory.mktemp("hardening"), cfg, small_model_path) as s:
        yield s


@pytest.fixture(scope="module")
def model(server):
    return get(server.url + "/v1/models", headers=AUTH).json()["data"][0]["id"]


def body(model: str, prompt: str, max_tokens: int = 48, **extra) -> dict:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }


class Stream(threading.Thread):
    """A streamed completion read event by event: its token ids, event ids and how it ended."""

    def __init__(self, url: str, payload: dict, headers: dict | None = None) -> None:
        super().__init__(daemon=True)
        self.url, self.payload, self.headers = url, {**payload, "stream": True}, {**AUTH, **(headers or {})}
        self.tokens: list[int] = []
        self.event_ids: list[str] = []
        self.errors: list[str] = []
        self.done = False
        self.status = 0
        self.keepalives = 0  # SSE comment lines
        self.answered = 0.0  # when its first data came (time.monotonic())

    def run(self) -> None:
        with httpx.stream(
            "POST", self.url + "/v1/completions", json=self.payload, headers=self.headers, timeout=120
        ) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: ") and not self.answered:
                    self.answered = time.monotonic()
                if line.startswith(":"):
                    self.keepalives += 1
                elif line.startswith("id: "):
                    self.event_ids.append(line[4:])
                elif line == "data: [DONE]":
                    self.done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        self.errors.append(chunk["error"]["message"])
                    else:
                        self.tokens += chunk["choices"][0].get("token_ids", [])

    def wait_events(self, n: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while len(self.event_ids) < n:
            assert time.monotonic() < deadline and self.is_alive(), "stream made no progress"
            time.sleep(0.01)


class Victim(Stream):
    """A stream started beside an attack, with the tokens a clean run of it gives."""

    def __init__(self, server: ServerProcess, payload: dict, events: int) -> None:
        super().__init__(server.url, payload)
        self.want = clean_tokens(server, payload)
        self.start()
        self.wait_events(events)

    def assert_exact(self) -> None:
        self.join(120)
        assert self.done and not self.errors and self.tokens == self.want


def clean_tokens(server, payload: dict) -> list[int]:
    r = post(server.url + "/v1/completions", json=payload, headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_numbers_the_engine_cannot_hold_are_refused_and_the_stream_beside_them_is_exact(server, model):
    victim_body = body(model, "Once upon a time", 96)
    victim = Victim(server, victim_body, events=3)
    hostile = {
        "top_k": 2**63,  # on the old main: passed validation and killed every stream of the worker
        "seed": 2**70,
        "stop_token_ids": [2**40],
        "max_tokens": 2**40,
        "n": 2**63,
        "presence_penalty": 1e308,
    }
    for field, value in hostile.items():
        r = post(server.url + "/v1/completions", json={**body(model, "Hi"), field: value}, headers=AUTH)
        assert r.status_code == 400, (field, r.text)
        assert r.json()["error"]["param"].split(".")[0] == field
    # In range but past the vocabulary: a top_k that keeps every token, a stop id the model has not.
    assert post(server.url + "/v1/completions", json=body(model, "Hi", top_k=10**6), headers=AUTH).status_code == 200
    r = post(server.url + "/v1/completions", json=body(model, "Hi", stop_token_ids=[10**6]), headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids"
    victim.assert_exact()


def test_a_request_id_alone_cannot_resume_or_stall_another_clients_stream(server, model):
    victim_body = body(model, "The history of the printing press", 96)
    victim = Victim(server, victim_body, events=4)
    event = victim.event_ids[1]
    request_id = event.split(":")[0].rsplit(".", 1)[0]
    attacks = {
        f"{request_id}:0:0": 400,  # the old form: a request id was enough
        f"{request_id}.{'0' * 32}:0:0": 403,  # a guessed token
        event: 403,  # the victim's real event id, with another body
    }
    for last_event, status in attacks.items():
        thief = Stream(server.url, body(model, "something else", 96), {"Last-Event-ID": last_event})
        thief.run()
        assert thief.status == status and not thief.tokens, last_event
    # Nothing the server lists names the request: no route hands out resumable ids.
    for path in ("/admin/workers", "/admin/takeovers", "/metrics", "/health", "/v1/models"):
        assert request_id not in get(server.url + path, headers=AUTH).text, path
    victim.assert_exact()


def stream_under_way(server, payload: dict) -> tuple[list[int], Stream, str, int]:
    """The tokens `payload` should give, its stream started and 10 events in, the event id to resume
    from (the 6th) and how many tokens the client holds there."""
    want = clean_tokens(server, payload)
    first = Stream(server.url, payload)
    first.start()
    first.wait_events(10)
    at = first.event_ids[5]
    return want, first, at, int(at.rsplit(":", 2)[1])


def test_the_rightful_client_resumes_while_its_old_connection_is_still_open(server, model):
    payload = body(model, "A recipe for bread", 120)
    want, first, at, held = stream_under_way(server, payload)
    second = Stream(server.url, payload, {"Last-Event-ID": at})
    second.run()
    first.join(60)
    # The old stream ends with an error event saying where it went, never stalls; the new one carries on.
    assert not first.is_alive() and any("resumed on another connection" in e for e in first.errors)
    assert second.done and not second.errors
    assert first.tokens[:held] + second.tokens == want


def test_ten_resumes_of_one_stream_at_once_each_get_an_answer_and_one_carries_it_on_exactly(server, model):
    """On the old main the resumes raced past each other: one carried on, one got "already in flight" and
    eight heard nothing until their clients gave up."""
    payload = body(model, "A letter to an old friend", 120)
    want, first, at, held = stream_under_way(server, payload)
    resumes = [Stream(server.url, payload, {"Last-Event-ID": at}) for _ in range(10)]
    t0 = time.monotonic()
    for r in resumes:
        r.start()
    for r in resumes:  # (the one that carries on streams ~115 tokens: a few seconds)
        r.join(max(0.0, t0 + 30 - time.monotonic()))
    first.join(10)
    assert not first.is_alive() and any("resumed on another connection" in e for e in first.errors)
    assert not [r for r in resumes if r.is_alive()], "a resume still waits"
    answered = [r.answered - t0 if r.answered else None for r in resumes]
    assert all(r.status == 200 for r in resumes) and all(a is not None and a < 10 for a in answered), answered
    carried = [r for r in resumes if r.done and not r.errors]
    told = [r for r in resumes if r.errors]
    assert len(carried) == 1 and len(told) == 9, [(r.done, r.errors) for r in resumes]
    assert all(r.errors == ["this stream was resumed on another connection"] for r in told)
    assert first.tokens[:held] + carried[0].tokens == want


def test_a_waiting_stream_gets_keep_alive_comments_then_its_tokens_exactly(server, model):
    victim = Victim(server, body(model, "The tide came in over the sand", 64), events=3)
    pid = next(w["pid"] for w in get(server.url + "/admin/workers").json() if w["role"] == "mixed")
    before = victim.keepalives
    os.kill(pid, signal.SIGSTOP)  # its worker stops: the stream waits (well within the lease and stall limits)
    try:
        time.sleep(1.0)
        waiting = victim.keepalives - before
        events = len(victim.event_ids)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert waiting >= 2, waiting  # a comment each KEEPALIVE_S while nothing came
    victim.assert_exact()
    assert len(victim.event_ids) > events  # and it carried on after the wait


def test_api_key_guards_every_v1_route_and_only_those(server, model):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        assert get(server.url + "/v1/models", headers=headers).status_code == 401
        r = post(server.url + "/v1/completions", json=body(model, "Hi"), headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert get(server.url + "/health").status_code == 200
    assert get(server.url + "/metrics").status_code == 200
    assert get(server.url + "/admin/workers").status_code == 200  # loopback, no admin key set


def test_limits_answer_before_any_engine_time(server, model):
    big = "word " * (LIMITS["max_body_bytes"] // 5 + 10)
    r = post(server.url + "/v1/completions", json=body(model, big), headers=AUTH)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the body is counted as it arrives
        for _ in range(40):
            yield b"x" * 4096

    r = post(server.url + "/v1/completions", content=chunks(), headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 413
    messages = [{"role": "user", "content": "hi"}] * (LIMITS["max_messages"] + 1)
    r = post(server.url + "/v1/chat/completions", json={"model": model, "messages": messages}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_messages"
    r = post(server.url + "/v1/completions", json=body(model, "é" * 20001), headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["code"] == "prompt_too_long"
    raw = json.dumps(body(model, "a \ud800 lone surrogate"))  # (escaped: httpx would not encode it)
    r = post(server.url + "/v1/completions", content=raw, headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_stop_strings_count_against_the_prompt_limit_and_the_stream_beside_them_is_exact(server, model):
    """On the old main stop strings had no bound: four of 990,000 characters went into every checkpoint of
    the request, past etcd's request limit, and the worker failed all its requests (issue 47 §2.5)."""
    victim = Victim(server, body(model, "In a small village by the sea", 96), events=3)
    limit = LIMITS["max_prompt_chars"]
    r = post(server.url + "/v1/completions", json=body(model, "Hi", stop=["z" * (limit // 4)] * 4), headers=AUTH)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == ("stop", "stop_too_long") and str(limit) in error["message"]
    within = body(model, "Hi", 8, stop=["z" * (limit // 4 - 1)] * 4)  # with the prompt: just within
    r = post(server.url + "/v1/completions", json=within, headers=AUTH)
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 8, r.text
    victim.assert_exact()


def test_pending_requests_over_the_limit_get_429_with_retry_after(server, model):
    streams = [Stream(server.url, body(model, f"Count to {i}", 64)) for i in range(LIMITS["max_pending_requests"])]
    for s in streams:
        s.start()
    for s in streams:
        s.wait_events(1)
    r = post(server.url + "/v1/completions", json=body(model, "one too many"), headers=AUTH)
    assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
    for s in streams:
        s.join(180)
        assert s.done and len(s.tokens) == 64
    assert post(server.url + "/v1/completions", json=body(model, "now there is room"), headers=AUTH).status_code == 200


def _rss_kib(sid: int) -> int:
    """Private resident memory (`RssAnon`: where a leak lives) of every process of session `sid` (the
    server and its children, each of which has a process group of its own). Not `VmRSS`: that counts the
    KV arena's shared pages too, which each worker populates in the background as the arena is made
    (`kv/arena/grants.py`), so it grows with the arena's use with nothing leaked."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[3]) != sid:
                continue
            status = Path(f"/proc/{pid}/status").read_text()
        except (OSError, IndexError, ValueError):
            continue
        total += next((int(line.split()[1]) for line in status.splitlines() if line.startswith("RssAnon:")), 0)
    return total


def hostile_requests(model: str, rng: random.Random) -> list[tuple[str, dict, bytes | None]]:
    """(path, headers, raw body) of a few hundred malformed or hostile calls."""
    ok = {**body(model, "Hi", 4), "ignore_eos": False}
    fields = ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "n"]
    odd = [None, True, -1, 0, 2**31, 2**63, -(2**64), 1e308, float("nan"), "x" * 5000, "\ud800", [], {}, [[]], [2**40]]
    calls: list[tuple[str, dict, bytes | None]] = []
    for _ in range(180):
        payload = dict(ok)
        for field in rng.sample(fields, rng.randint(1, 3)):
            # (max_tokens: None lets a request run to the end of the context: valid, only slow)
            payload[field] = rng.choice([v for v in odd if v is not None or field != "max_tokens"])
        raw = json.dumps(payload, allow_nan=True).encode()
        calls.append(("/v1/completions", AUTH, raw))
    for _ in range(40):
        messages = [{"role": rng.choice(["user", "system", "tool", "robot", 7]), "content": rng.choice(odd)}]
        chat = {"model": model, "messages": messages, "max_tokens": 4}
        calls.append(("/v1/chat/completions", AUTH, json.dumps(chat).encode()))
    garbage = [b"", b"{", b"[]", b"null", b'{"model": ', b"\xff\xfe\x00", b'{"prompt": "' + b"a" * 70000 + b'"}']
    calls += [("/v1/completions", AUTH, rng.choice(garbage)) for _ in range(30)]
    calls += [("/v1/completions", {}, json.dumps(ok).encode()) for _ in range(10)]  # no key
    for _ in range(30):  # resumes with made-up event ids
        fake = rng.choice(["x", "a:b:c", f"cmpl-{'0' * 32}.{'f' * 32}:3:9", "::", "-1:-1:-1", "\xe9" * 300])
        headers = {**AUTH, "Last-Event-ID": fake.encode("latin-1")}  # (bytes: httpx sends them as they are)
        calls.append(("/v1/completions", headers, json.dumps({**ok, "stream": True}).encode()))
    rng.shuffle(calls)
    return calls


def test_fuzz_leaves_eight_greedy_streams_exact_and_memory_flat(server, model):
    prompts = [f"Story number {i}: once there was" for i in range(8)]
    payloads = [body(model, p, 64) for p in prompts]
    want = [clean_tokens(server, p) for p in payloads]
    before = _rss_kib(server.proc.pid)
    streams = [Stream(server.url, p) for p in payloads]
    for s in streams:
        s.start()
    rng = random.Random(13)
    statuses: dict[int, int] = {}
    with httpx.Client(base_url=server.url, timeout=180) as client:
        for i, (path, headers, raw) in enumerate(hostile_requests(model, rng)):
            if i % 25 == 0:  # a client that sends a stream request and vanishes
                with client.stream("POST", path, content=json.dumps({**payloads[0], "stream": True}), headers=AUTH):
                    pass
                continue
            r = client.post(path, content=raw, headers={**headers, "content-type": "application/json"})
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
    assert not [s for s in statuses if s >= 500], statuses
    for s, tokens in zip(streams, want, strict=True):
        s.join(180)
        assert s.done and not s.errors and s.tokens == tokens
    for p, tokens in zip(payloads, want, strict=True):  # and the server still serves them, exactly
        assert clean_tokens(server, p) == tokens
    after = _rss_kib(server.proc.pid)
    assert after <= before * 1.10, (before, after)
