"""Who may ask for what (issue 47 §2.1–2.4, rules and the door alone): priority as a key's privilege,
the Host names the router answers to, admin writes from pages of other sites, the connection limits
per client address and per key, and a body or headers that never finish."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import uvicorn

from steadfast.config import Config, ConfigError
from steadfast.config.access import AccessConfig, ApiKey
from steadfast.control.http.access import Access, host_name
from steadfast.control.http.guard import Guard, GuardConfig, refusal
from steadfast.control.http.limits import bounded_protocol
from steadfast.wire.worker import Priority

pytestmark = pytest.mark.unit

OPS, BATCH = "ops-" + "o" * 20, "batch-" + "b" * 20
KEYS = (ApiKey("ops", OPS, "high"), ApiKey("batch", BATCH, "low", max_concurrent=2))


def scope(path: str, peer: str = "127.0.0.1", method: str = "GET", **headers: str) -> dict:
    sent = [(name.replace("_", "-").encode(), value.encode()) for name, value in headers.items()]
    return {"type": "http", "method": method, "path": path, "client": (peer, 5555), "headers": sent, "state": {}}


def status(s: dict, cfg: GuardConfig) -> int:
    refused = refusal(s, cfg)
    return 0 if refused is None else refused.status


def test_a_key_bounds_the_priority_its_requests_get():
    access = Access(AccessConfig(keys=KEYS))
    ops, batch = access.identify(OPS), access.identify(BATCH)
    assert ops is not None and batch is not None
    assert [batch.priority(p) for p in ("high", "normal", "low")] == ["low", "low", "low"]
    assert [ops.priority(p) for p in ("high", "normal", "low")] == ["high", "normal", "low"]
    assert access.identify("") is None and access.identify(OPS + "x") is None
    # The one shared key of server.api_key may ask for anything, as before keys.
    legacy = Access(AccessConfig(), api_key="sk-" + "s" * 20).identify("sk-" + "s" * 20)
    assert legacy is not None and legacy.priority("high") == "high"


def test_without_keys_client_priority_is_honoured_only_on_loopback_unless_configured():
    def top(listen: str, switch: str = "auto") -> Priority:
        identity = Access(AccessConfig(client_priority=switch), listen_hosts=(listen,)).identify("")
        assert identity is not None
        return identity.max_priority

    assert top("127.0.0.1") is Priority.HIGH and top("::1") is Priority.HIGH and top("localhost") is Priority.HIGH
    assert top("0.0.0.0") is Priority.NORMAL and top("10.0.0.5") is Priority.NORMAL
    assert top("0.0.0.0", "on") is Priority.HIGH and top("127.0.0.1", "off") is Priority.NORMAL


def test_keys_come_from_the_environment_and_never_reach_a_child_command_line(monkeypatch):
    monkeypatch.setenv("STEADFAST_API_KEYS", f'[{{"name": "ops", "key": "{OPS}", "max_priority": "high"}}]')
    cfg = Config().with_env_keys()
    assert cfg.access.keys == (ApiKey("ops", OPS, "high"),)
    assert OPS not in str(cfg.public().to_dict()) and OPS not in repr(cfg)
    monkeypatch.setenv("STEADFAST_API_KEYS", '{"name": "x"}')
    with pytest.raises(ConfigError, match="JSON list"):
        Config().with_env_keys()
    with pytest.raises(ConfigError, match="max_priority"):
        Config().replace(access={"keys": [{"name": "a", "key": OPS, "max_priority": "urgent"}]})
    with pytest.raises(ConfigError, match="16..512"):
        Config().replace(access={"keys": [{"name": "a", "key": "short"}]})


def test_host_names_a_dns_rebinding_page_sends_are_refused():
    cfg = GuardConfig(machine_names=frozenset({"gpu-box"}))
    for host in ("127.0.0.1:8000", "localhost:8000", "[::1]:8000", "10.1.2.3", "gpu-box:8000", "app.localhost"):
        assert status(scope("/v1/models", host=host), cfg) == 0, host
        assert status(scope("/admin/workers", host=host), cfg) == 0, host
    for host in ("attacker.example:8000", "localhost.attacker.example", ""):
        assert status(scope("/v1/models", host=host), cfg) == 400, host
        assert status(scope("/admin/workers", host=host), cfg) == 400, host
    assert status(scope("/v1/models"), cfg) == 400  # no Host at all
    assert status(scope("/health", host="lb.internal"), cfg) == 0  # a balancer's probe, by any name
    wildcard = GuardConfig(access_cfg=AccessConfig(allowed_hosts=("*",)))
    assert status(scope("/v1/models", host="api.example"), wildcard) == 0
    assert status(scope("/admin/workers", host="api.example"), wildcard) == 400  # never for /admin
    named = GuardConfig(access_cfg=AccessConfig(allowed_hosts=("api.example",)))
    assert status(scope("/admin/workers", host="API.example:443"), named) == 0
    assert host_name("[::1]:80") == "::1" and host_name("Example.COM") == "example.com"


def test_an_admin_write_from_a_page_of_another_site_is_refused():
    cfg = GuardConfig()
    drain = "/admin/workers/0/drain"
    here = {"host": "127.0.0.1:8000"}
    # A form or a body-less fetch from another origin: "simple" requests a browser sends unasked.
    assert status(scope(drain, method="POST", origin="http://evil.example", **here), cfg) == 403
    assert status(scope(drain, method="POST", **here), cfg) == 403
    assert status(scope(drain, method="POST", content_type="text/plain", **here), cfg) == 403
    assert status(scope(drain, method="POST", content_type="application/json", **here), cfg) == 0
    json_elsewhere = scope(drain, method="POST", content_type="application/json", origin="http://evil.example", **here)
    assert status(json_elsewhere, cfg) == 403
    same = scope(drain, method="POST", content_type="application/json", origin="http://127.0.0.1:8000", **here)
    assert status(same, cfg) == 0  # the dashboard's own page
    assert status(scope("/admin/workers", **here), cfg) == 0  # reading is not a write
    keyed = GuardConfig(admin_api_key="adm-" + "a" * 20)
    with_key = scope(drain, method="POST", authorization="Bearer adm-" + "a" * 20, **here)
    assert status(with_key, keyed) == 0  # a page cannot send Authorization unasked either


def test_behind_a_configured_proxy_a_loopback_peer_is_not_admin():
    proxied = GuardConfig(access_cfg=AccessConfig(trusted_proxies=("127.0.0.1",)))
    assert status(scope("/admin/workers", host="localhost"), proxied) == 403
    keyed = GuardConfig(admin_api_key="adm-" + "a" * 20, access_cfg=AccessConfig(trusted_proxies=("10.0.0.0/8",)))
    assert status(scope("/admin/workers", host="localhost", authorization="Bearer adm-" + "a" * 20), keyed) == 0


def _held_calls(guard: Guard, calls: list[dict], release: asyncio.Event) -> list[int]:
    """Send each call to the guard at once; the route holds every call it gets until `release`."""

    async def run() -> list[int]:
        async def one(s: dict) -> int:
            sent: list[dict] = []

            async def receive():
                return {"type": "http.request", "body": b"", "more_body": False}

            async def send(message):
                sent.append(message)

            await guard(s, receive, send)
            return sent[0]["status"]

        tasks = [asyncio.ensure_future(one(s)) for s in calls]
        await asyncio.sleep(0.05)
        release.set()
        return list(await asyncio.gather(*tasks))

    return asyncio.run(run())


def test_one_address_and_one_key_cannot_take_every_connection_and_health_stays_answerable():
    release = asyncio.Event()

    async def app(s, receive, send):
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    cfg = GuardConfig(max_connections=8, access_cfg=AccessConfig(keys=KEYS, max_connections_per_client=3))
    here = {"host": "localhost"}
    ops, batch = {"authorization": f"Bearer {OPS}"}, {"authorization": f"Bearer {BATCH}"}
    calls = [scope("/v1/models", "10.0.0.1", **here, **ops) for _ in range(5)]  # one address, 5 calls
    calls += [scope("/v1/models", f"10.0.1.{i}", **here, **batch) for i in range(4)]  # one key, quota 2
    calls += [scope("/health", "10.0.0.1"), scope("/admin/workers", "127.0.0.1", **here)]
    got = _held_calls(Guard(app, cfg), calls, release)
    assert got[:5] == [200, 200, 200, 429, 429]
    assert got[5:9] == [200, 200, 429, 429]
    assert got[9:] == [200, 200]  # outside the limits


def test_a_body_that_never_finishes_gets_408_and_frees_its_slot():
    async def app(s, receive, send):
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    guard = Guard(app, GuardConfig(access_cfg=AccessConfig(body_timeout=0.2)))

    async def run() -> tuple[list[dict], int]:
        sent: list[dict] = []
        first = True

        async def receive():
            nonlocal first
            if first:
                first = False
                return {"type": "http.request", "body": b"{", "more_body": True}
            await asyncio.sleep(3600)  # the rest never comes

        async def send(message):
            sent.append(message)

        t0 = time.monotonic()
        await asyncio.wait_for(guard(scope("/v1/completions", host="localhost"), receive, send), 5)
        assert time.monotonic() - t0 < 2
        return sent, guard.active

    sent, active = asyncio.run(run())
    assert sent[0]["status"] == 408 and b"did not arrive within 0.2 s" in sent[1]["body"]
    assert active == 0


@pytest.fixture
def bounded_server():
    async def app(s, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", http=bounded_protocol(0.5, 4096))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.02)
    yield port
    server.should_exit = True
    thread.join(10)


def _read_all(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        data += b"<open>"
    return data


def test_headers_that_never_finish_or_never_end_are_cut_off(bounded_server):
    port = bounded_server
    idle, slow = socket.create_connection(("127.0.0.1", port)), socket.create_connection(("127.0.0.1", port))
    slow.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\nX-a: ")  # a slowloris: the rest never comes
    t0 = time.monotonic()
    assert _read_all(idle, 3) == b""  # closed, nothing said to a client that said nothing
    assert _read_all(slow, 3).startswith(b"HTTP/1.1 408")
    assert time.monotonic() - t0 < 2.5
    big = socket.create_connection(("127.0.0.1", port))
    big.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\nX-big: " + b"a" * 8192)
    assert _read_all(big, 3).startswith(b"HTTP/1.1 431")
    # A client that keeps to the bounds is served, twice on one connection (the bound is per request).
    ok = socket.create_connection(("127.0.0.1", port))
    for _ in range(2):
        ok.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n")
        ok.settimeout(3)
        assert ok.recv(4096).startswith(b"HTTP/1.1 200")
        time.sleep(0.3)
    time.sleep(0.4)  # past the header bound while idle between requests: uvicorn's keep-alive (5 s) rules
    ok.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n")
    assert ok.recv(4096).startswith(b"HTTP/1.1 200")
    for s in (idle, slow, big, ok):
        s.close()
