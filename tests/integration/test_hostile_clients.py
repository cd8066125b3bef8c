"""Issue 47 §2.1–2.4 against a real router: priority is a key's privilege, a page of another site
cannot reach /admin, and connections that never finish their headers or bodies neither take the
router down nor touch a victim's stream, which stays token-exact beside every attack.

One server (the small model, fp32, two workers, two keys, tight connection bounds) for the module;
the drain test, which retires a worker, runs last.
"""

from __future__ import annotations

import random
import socket
import time

import httpx
import pytest

from tests.integration.server import ServerProcess, serving
from tests.integration.test_hardening import Stream

pytestmark = pytest.mark.integration

OPS, BATCH = "sk-ops-" + "o" * 24, "sk-batch-" + "b" * 24
AS_OPS, AS_BATCH = {"Authorization": f"Bearer {OPS}"}, {"Authorization": f"Bearer {BATCH}"}
PER_CLIENT = 12
BODY_TIMEOUT_S, HEADER_TIMEOUT_S = 3, 1


@pytest.fixture(scope="module")
def server(tmp_path_factory, small_model_path):
    cfg = (
        "model: {dtype: float32, max_model_len: 512}\ncache: {kv_memory_mb: 64}\n"
        "server: {workers: 2, standby_workers: 0}\n"
        "access:\n"
        f"  keys: [{{name: ops, key: {OPS}, max_priority: high}}, {{name: batch, key: {BATCH}, max_priority: low}}]\n"
        f"  max_connections_per_client: {PER_CLIENT}\n"
        f"  body_timeout: {BODY_TIMEOUT_S}\n  header_timeout: {HEADER_TIMEOUT_S}\n  max_header_bytes: 16384\n"
    )
    with serving(tmp_path_factory.mktemp("hostile"), cfg, small_model_path) as s:
        yield s


@pytest.fixture(scope="module")
def model(server):
    return httpx.get(server.url + "/v1/models", headers=AS_OPS, timeout=30).json()["data"][0]["id"]


def payload(model: str, prompt: str = "The lighthouse keeper wrote", max_tokens: int = 40, **extra) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, **extra}  # fmt: skip


class Victim(Stream):
    """An ops client's stream started before an attack, with the tokens a clean run of it gives."""

    def __init__(self, server: ServerProcess, body: dict) -> None:
        super().__init__(server.url, body, AS_OPS)
        r = httpx.post(server.url + "/v1/completions", json=body, headers=AS_OPS, timeout=120)
        assert r.status_code == 200, r.text
        self.want = r.json()["choices"][0]["token_ids"]
        self.start()
        self.wait_events(3)

    def assert_exact(self) -> None:
        self.join(120)
        assert self.done and not self.errors and self.tokens == self.want


def admin(server: ServerProcess, method: str, path: str, **kwargs) -> httpx.Response:
    return httpx.request(method, server.url + path, timeout=30, **kwargs)


def test_a_key_decides_the_priority_a_request_gets(server, model):
    assert admin(server, "POST", "/admin/degradation", json={"level": 5}).status_code == 200
    try:
        # At L5 only high-priority requests pass; the batch key asks for high and is served as low.
        asked = payload(model, max_tokens=4, priority="high")
        claimed = httpx.post(server.url + "/v1/completions", json=asked, headers=AS_BATCH, timeout=60)
        assert claimed.status_code == 503, claimed.text
        assert "circuit breaker" in claimed.json()["error"]["message"]
        entitled = httpx.post(server.url + "/v1/completions", json=asked, headers=AS_OPS, timeout=60)
        assert entitled.status_code == 200, entitled.text
        anonymous = httpx.post(server.url + "/v1/completions", json=asked, timeout=60)
        assert anonymous.status_code == 401
    finally:
        assert admin(server, "POST", "/admin/degradation", json={"level": "auto"}).status_code == 200


def test_a_page_of_another_site_cannot_drain_a_worker_or_read_admin(server, model):
    victim = Victim(server, payload(model, max_tokens=64))
    drain = "/admin/workers/0/drain"
    # What a page at evil.example makes a browser send: a body-less POST (no preflight), a form post,
    # and reads through a DNS name rebound to 127.0.0.1.
    page = {"Origin": "http://evil.example"}
    assert admin(server, "POST", drain, headers=page).status_code == 403
    form = {**page, "Content-Type": "application/x-www-form-urlencoded"}
    assert admin(server, "POST", drain, headers=form, content=b"force=true").status_code == 403
    assert admin(server, "POST", drain).status_code == 403  # no Origin, still a simple request
    rebound = {"Host": "evil.example:8000"}
    for path in ("/admin/workers", "/admin/dashboard", "/v1/models"):
        r = admin(server, "GET", path, headers={**rebound, **AS_OPS})
        assert r.status_code == 400 and "access.allowed_hosts" in r.json()["error"]["message"], path
    rows = admin(server, "GET", "/admin/workers").json()
    assert len([w for w in rows if w["state"] == "ready" and not w["draining"]]) == 2, rows
    victim.assert_exact()


def _open(port: int, request: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(request)
    return s


def _answer(s: socket.socket, wait: float) -> bytes:
    """The status line the router sent on `s` within `wait` seconds (b"" if none; 0: what is there now)."""
    s.settimeout(wait) if wait else s.setblocking(False)
    try:
        return s.recv(4096).split(b"\r\n", 1)[0]
    except (TimeoutError, BlockingIOError):
        return b""


def test_slow_bodies_from_one_address_cannot_take_the_router(server, model):
    victim = Victim(server, payload(model, max_tokens=64))
    port = int(server.url.rsplit(":", 1)[1])
    rng = random.Random(7)
    # Each claims another address in X-Forwarded-For: believed, it would slip past the per-address bound.
    heads = [
        (
            f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {OPS}\r\n"
            f"Content-Type: application/json\r\nContent-Length: 4000\r\n"
            f"X-Forwarded-For: 10.{rng.randrange(256)}.{rng.randrange(256)}.7\r\n\r\n{{"
        ).encode()
        for _ in range(3 * PER_CLIENT)
    ]
    slow = []
    for head in heads:
        slow.append(_open(port, head))
        time.sleep(0.01)
    time.sleep(0.5)
    first = [_answer(s, 0) for s in slow]
    refused = [line for line in first if b" 429 " in line + b" "]
    # The victim's stream holds one of the address's calls: the rest of the bound is all the attack gets.
    assert len(refused) >= len(slow) - PER_CLIENT + 1, first
    assert all(line in (b"", b"HTTP/1.1 429 Too Many Requests") for line in first), first
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    assert admin(server, "GET", "/admin/workers").status_code == 200
    # The held ones are answered 408 once their body is overdue, and their slots are free again.
    late = [_answer(s, BODY_TIMEOUT_S + 5) for s, line in zip(slow, first, strict=True) if not line]
    assert late and all(line == b"HTTP/1.1 408 Request Timeout" for line in late), late
    for s in slow:
        s.close()
    ok = httpx.post(server.url + "/v1/completions", json=payload(model, max_tokens=2), headers=AS_OPS, timeout=60)
    assert ok.status_code == 200
    victim.assert_exact()


def test_headers_that_never_end_are_cut_off_and_the_router_keeps_serving(server, model):
    victim = Victim(server, payload(model, max_tokens=64))
    port = int(server.url.rsplit(":", 1)[1])
    t0 = time.monotonic()
    loris = [_open(port, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-a: ") for _ in range(200)]
    huge = _open(port, b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-big: ")
    try:
        huge.sendall(b"a" * 2**20)
    except OSError:
        pass  # the router closed it mid-send, as it should
    assert _answer(huge, 10) in (b"HTTP/1.1 431 Request Header Fields Too Large", b"")
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    answers = [_answer(s, HEADER_TIMEOUT_S + 10) for s in loris]
    assert all(line == b"HTTP/1.1 408 Request Timeout" for line in answers), set(answers)
    assert time.monotonic() - t0 < HEADER_TIMEOUT_S + 10
    for s in (*loris, huge):
        s.close()
    victim.assert_exact()


def test_the_last_serving_worker_is_drained_only_when_forced(server, model):
    rows = admin(server, "GET", "/admin/workers").json()
    first, second = (w["id"] for w in rows if w["state"] == "ready")
    r = admin(server, "POST", f"/admin/workers/{first}/drain", json={})
    assert r.status_code == 202, r.text
    deadline = time.monotonic() + 60
    while any(w["id"] == first and w["state"] != "dead" for w in admin(server, "GET", "/admin/workers").json()):
        assert time.monotonic() < deadline, "the drained worker did not retire"
        time.sleep(0.2)
    r = admin(server, "POST", f"/admin/workers/{second}/drain", json={})
    assert r.status_code == 409 and "last serving" in r.json()["error"]["message"], r.text
    ok = httpx.post(server.url + "/v1/completions", json=payload(model, max_tokens=2), headers=AS_OPS, timeout=60)
    assert ok.status_code == 200, ok.text
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
