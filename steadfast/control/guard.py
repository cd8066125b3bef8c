"""The router's door: who may call which route, how many calls at once, how large a body.

An ASGI middleware in front of every route, so a refused call costs no parsing and no engine time:
keys are compared in constant time, a body is cut off at its limit while it arrives (a client that lies
in Content-Length, or sends none, gets the same 413), and a call over the connection limit is answered
429 with Retry-After before anything else runs. While the router stops (`Shutdown`), every new /v1 call
is answered 503 and /health says not ready; the calls let through before go on.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from steadfast.control.errors import APIError
from steadfast.control.shutdown import Shutdown

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


class BodyTooLarge(Exception):
    pass


def _bearer(scope: Scope) -> str:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return ""


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


def refusal(scope: Scope, cfg: GuardConfig) -> APIError | None:
    """Why this call may not reach its route, or None if it may."""
    path: str = scope.get("path", "")
    token = _bearer(scope)
    if path.startswith("/admin"):
        if cfg.admin_api_key:
            if not _same(token, cfg.admin_api_key):
                return APIError("Admin routes need the admin key.", 401, code="invalid_api_key")
        elif not _is_loopback(scope):
            return APIError(
                "Admin routes are served to loopback clients only unless server.admin_api_key is set.",
                403,
                type_="permission_error",
                code="admin_forbidden",
            )
        return None
    if path in OPEN_PATHS and cfg.open_metrics or path in STATIC_PATHS:
        return None
    if cfg.api_key and not _same(token, cfg.api_key):
        message = "Incorrect API key provided." if token else "You didn't provide an API key (Authorization: Bearer)."
        return APIError(message, 401, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    if path.startswith("/v1") and cfg.shutdown.refusing:
        return APIError(
            "the server is shutting down",
            503,
            type_="service_unavailable",
            code="shutting_down",
            headers={"Retry-After": "1"},
        )
    return None


class Guard:
    def __init__(self, app: ASGIApp, cfg: GuardConfig) -> None:
        self.app = app
        self.cfg = cfg
        self.active = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refused = refusal(scope, self.cfg)
        if refused is None and self.active >= self.cfg.max_connections:
            refused = APIError(
                f"The server is serving its limit of {self.cfg.max_connections} connections; retry shortly.",
                429,
                type_="rate_limit_error",
                code="too_many_connections",
                headers={"Retry-After": "1"},
            )
        if refused is None:
            refused = self._declared_too_large(scope)
        if refused is not None:
            await _answer(send, refused)
            return
        if scope.get("path") == "/health" and self.cfg.shutdown.refusing:
            # Not ready any more: a balancer stops sending here (the body is /health's own shape).
            await _answer_json(send, 503, {"status": "unavailable", "workers": []})
            return
        counted = int(scope.get("path", "").startswith("/v1"))
        self.active += 1
        self.cfg.shutdown.calls += counted
        try:
            await self._serve(scope, receive, send)
        finally:
            self.active -= 1
            self.cfg.shutdown.calls -= counted

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
        overflow = started = False

        async def counted() -> Message:
            nonlocal seen, overflow
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.cfg.max_body_bytes:
                    overflow = True
                    raise BodyTooLarge
            return message

        async def tracked(message: Message) -> None:
            nonlocal started
            if overflow and not started:
                return  # the route's own answer to a body it could not read
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, tracked)
        except BodyTooLarge:
            pass
        except Exception:
            if not overflow:
                raise
        if overflow and not started:
            await _answer(send, self._too_large())


async def _answer(send: Send, error: APIError) -> None:
    await _answer_json(send, error.status, error.body(), error.headers)


async def _answer_json(send: Send, status: int, content: Any, extra: dict[str, str] | None = None) -> None:
    body = msgspec.json.encode(content)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (extra or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
