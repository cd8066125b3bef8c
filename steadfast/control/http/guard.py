"""The router's door: who may call which route, how many calls at once, how large a body, how slowly.

An ASGI middleware in front of every route, so a refused call costs no parsing and no engine time:
a Host the router is not (DNS rebinding) is a 400; keys are compared in constant time and name the
caller (`Identity`, in `scope["state"]`), whose priority and concurrency they bound; an admin write from
a page of another site is a 403; a body is cut off at its limit while it arrives (a client that lies in
Content-Length, or sends none, gets the same 413) and must arrive within `body_timeout` (408); a call
over the connection limits (all, one client address's, one key's) is answered 429 with Retry-After
before anything else runs. /health and /admin are outside the connection limits, so a flood of /v1
calls never hides the router's state from its operator. While the router stops (`Shutdown`), every new
/v1 call is answered 503 and /health says not ready; the calls let through before go on.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import time
from collections import Counter
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from steadfast.config.access import AccessConfig
from steadfast.control.http.access import Access, Identity
from steadfast.control.http.errors import APIError
from steadfast.control.http.shutdown import Shutdown

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = ("/health", "/metrics")
# The dashboard's page, script and style: code only, no data (that is /admin/dashboard, behind the admin
# check), so a browser, which cannot send a key with a page it opens, may load them.
STATIC_PATHS = ("/dashboard", "/dashboard/dashboard.js", "/dashboard/dashboard.css")


@dataclass(frozen=True)
class GuardConfig:
    api_key: str = ""
    admin_api_key: str = ""
    open_metrics: bool = True
    max_body_bytes: int = 4 * 2**20
    max_connections: int = 2048
    shutdown: Shutdown = field(default_factory=Shutdown)  # the router's own, changed by its stop
    access_cfg: AccessConfig = field(default_factory=AccessConfig)
    listen_hosts: tuple[str, ...] = ("127.0.0.1",)
    machine_names: frozenset[str] = frozenset()

    @property
    def access(self) -> Access:
        return Access(self.access_cfg, self.api_key, self.admin_api_key, self.listen_hosts, self.machine_names)


# Where a call's Identity is kept for its route (Starlette's `request.state.identity`).
STATE_KEY = "identity"
# Paths outside the connection limits: cheap, and what an operator needs while the service is flooded.
UNCOUNTED = ("/health", "/admin")


class BodyTooLarge(Exception):
    pass


class BodyTimeout(Exception):
    pass


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


def _bearer(scope: Scope) -> str:
    scheme, _, token = (_header(scope, b"authorization") or "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def _is_loopback(scope: Scope) -> bool:
    client = scope.get("client")
    if not client:
        return False
    try:
        return ipaddress.ip_address(client[0]).is_loopback
    except ValueError:
        return False


def _same(given: str, want: str) -> bool:
    return hmac.compare_digest(given.encode(), want.encode())


def _admin_refusal(scope: Scope, cfg: GuardConfig, access: Access) -> APIError | None:
    token = _bearer(scope)
    forbidden = "permission_error"
    if cfg.admin_api_key:
        if not _same(token, cfg.admin_api_key):
            return APIError("Admin routes need the admin key.", 401, code="invalid_api_key")
    elif not access.admin_by_address():
        return APIError(
            "Behind a proxy (access.trusted_proxies) admin routes need server.admin_api_key.",
            403,
            type_=forbidden,
            code="admin_forbidden",
        )
    elif not _is_loopback(scope):
        return APIError(
            "Admin routes are served to loopback clients only unless server.admin_api_key is set.",
            403,
            type_=forbidden,
            code="admin_forbidden",
        )
    why = access.cross_site_write(
        scope.get("method", "GET"),
        _header(scope, b"host"),
        _header(scope, b"origin"),
        # With the admin key a page cannot send the Authorization header unasked either.
        "application/json" if cfg.admin_api_key else _header(scope, b"content-type") or "",
    )
    if why:
        return APIError(f"Refused: {why}.", 403, type_=forbidden, code="cross_site")
    return None


def refusal(scope: Scope, cfg: GuardConfig, access: Access | None = None) -> APIError | None:
    """Why this call may not reach its route, or None if it may. A /v1 call let through carries its
    caller's Identity in `scope["state"]`."""
    access = access or cfg.access
    path: str = scope.get("path", "")
    admin = path.startswith("/admin")
    host = _header(scope, b"host")
    # (/health and /metrics hold no secret, and a balancer probes them by whatever name it knows)
    if path not in OPEN_PATHS and not access.host_allowed(host, admin):
        return APIError(
            f"Host {host!r} is not a name of this server; add it to access.allowed_hosts.",
            400,
            code="host_not_allowed",
        )
    if admin:
        return _admin_refusal(scope, cfg, access)
    if path in OPEN_PATHS and cfg.open_metrics or path in STATIC_PATHS:
        return None
    token = _bearer(scope)
    identity = access.identify(token)
    if identity is None:
        message = "Incorrect API key provided." if token else "You didn't provide an API key (Authorization: Bearer)."
        return APIError(message, 401, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    scope.setdefault("state", {})[STATE_KEY] = identity
    if path.startswith("/v1") and cfg.shutdown.refusing:
        return APIError(
            "the server is shutting down",
            503,
            type_="service_unavailable",
            code="shutting_down",
            headers={"Retry-After": "1"},
        )
    return None


def identity_of(state: Any) -> Identity | None:
    """The caller the guard named for this call (None where no guard ran: tests of routes alone)."""
    return getattr(state, STATE_KEY, None)


def _busy(message: str, code: str) -> APIError:
    return APIError(message, 429, type_="rate_limit_error", code=code, headers={"Retry-After": "1"})


class Guard:
    def __init__(self, app: ASGIApp, cfg: GuardConfig) -> None:
        self.app = app
        self.cfg = cfg
        self.access = cfg.access
        self.active = 0  # calls under max_connections
        self.per_client: Counter[str] = Counter()
        self.per_key: Counter[str] = Counter()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refused = refusal(scope, self.cfg, self.access)
        path: str = scope.get("path", "")
        counted = not path.startswith(UNCOUNTED)
        identity: Identity | None = scope.get("state", {}).get(STATE_KEY)
        client = (scope.get("client") or ("", 0))[0]
        key = identity.name if identity is not None and identity.max_concurrent else ""
        if refused is None and counted:
            refused = self._over_limit(client, identity)
        if refused is None:
            refused = self._declared_too_large(scope)
        if refused is not None:
            await _answer(send, refused)
            return
        if path == "/health" and self.cfg.shutdown.refusing:
            # Not ready any more: a balancer stops sending here (the body is /health's own shape).
            await _answer_json(send, 503, {"status": "unavailable", "workers": []})
            return
        v1 = int(path.startswith("/v1"))
        self.active += counted
        self.per_client[client] += counted
        self.per_key[key] += counted and bool(key)
        self.cfg.shutdown.calls += v1
        try:
            await self._serve(scope, receive, send)
        finally:
            self.active -= counted
            self.cfg.shutdown.calls -= v1
            _release(self.per_client, client, counted)
            _release(self.per_key, key, counted and bool(key))

    def _over_limit(self, client: str, identity: Identity | None) -> APIError | None:
        if self.active >= self.cfg.max_connections:
            return _busy(
                f"The server is serving its limit of {self.cfg.max_connections} connections; retry shortly.",
                "too_many_connections",
            )
        per_client = self.access.cfg.max_connections_per_client
        if self.per_client[client] >= per_client:
            return _busy(
                f"Your address has {per_client} calls open, its limit (access.max_connections_per_client); "
                "retry when one ends.",
                "too_many_connections",
            )
        if identity is not None and identity.max_concurrent and self.per_key[identity.name] >= identity.max_concurrent:
            return _busy(
                f"Key {identity.name!r} has {identity.max_concurrent} calls running, its quota; retry when one ends.",
                "key_quota",
            )
        return None

    def _too_large(self) -> APIError:
        return APIError(
            f"The request body is larger than the limit of {self.cfg.max_body_bytes} bytes.",
            413,
            code="request_too_large",
        )

    def _declared_too_large(self, scope: Scope) -> APIError | None:
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    return APIError("Content-Length is not a number.", 400)
                return self._too_large() if declared > self.cfg.max_body_bytes else None
        return None

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The route, with its body counted as it arrives: past the limit the route's reading fails and
        whatever it answers to that is replaced by a 413."""
        seen = 0
        overflow = started = timed_out = False
        body_done = False
        deadline = time.monotonic() + self.access.cfg.body_timeout

        async def counted() -> Message:
            nonlocal seen, overflow, body_done, timed_out
            if body_done:  # (after the body, receive() waits for the client to leave: no bound)
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                timed_out = True
                raise BodyTimeout from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if seen > self.cfg.max_body_bytes:
                    overflow = True
                    raise BodyTooLarge
            else:
                body_done = True
            return message

        async def tracked(message: Message) -> None:
            nonlocal started
            if (overflow or timed_out) and not started:
                return  # the route's own answer to a body it could not read
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, tracked)
        except (BodyTooLarge, BodyTimeout):
            pass
        except Exception:
            if not (overflow or timed_out):
                raise
        if overflow and not started:
            await _answer(send, self._too_large())
        elif timed_out and not started:
            limit = self.access.cfg.body_timeout
            await _answer(send, APIError(f"The request body did not arrive within {limit:g} s.", 408, code="timeout"))


def _release(counts: Counter[str], name: str, n: int) -> None:
    counts[name] -= n
    if counts[name] <= 0:
        del counts[name]  # (a client address seen once is not kept for ever)


async def _answer(send: Send, error: APIError) -> None:
    await _answer_json(send, error.status, error.body(), error.headers)


async def _answer_json(send: Send, status: int, content: Any, extra: dict[str, str] | None = None) -> None:
    body = msgspec.json.encode(content)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (extra or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
