"""The router's HTTP/1.1 connections, bounded before any route sees them: a client gets `header_timeout`
seconds to send a request's line and headers, and `max_header_bytes` of them.

uvicorn's httptools protocol times out only the idle gap between two requests of a keep-alive
connection: a connection that never finishes its headers is held for ever (1,000 such connections
were all open after 30 s), and headers are buffered without a bound (a 48 MB header took 44 s of the
event loop). This subclass adds both bounds and is otherwise uvicorn's own parser and request cycle.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


def _status(code: int, reason: str, why: str) -> bytes:
    body = f"{why}\n".encode()
    head = f"HTTP/1.1 {code} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\n"
    return f"{head}content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode() + body


TIMED_OUT = _status(408, "Request Timeout", "the request's headers did not arrive in time")
TOO_LARGE = _status(431, "Request Header Fields Too Large", "the request's headers are over the server's limit")


class BoundedHttpProtocol(HttpToolsProtocol):
    """Made by uvicorn once per connection; `header_timeout` and `max_header_bytes` are set on a
    subclass by `bounded_protocol`."""

    header_timeout: float = 10.0
    max_header_bytes: int = 65536

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._header_bytes = 0
        self._awaiting_headers = True  # from the connection's start, and from each request's first byte
        self._chunk = 0  # bytes of the chunk being parsed

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._chunk = len(data)
        if self._awaiting_headers:
            self._header_bytes += len(data)
        super().data_received(data)
        # Counted after the parser ran: the chunk that ends the headers may carry the body's first bytes.
        if self._awaiting_headers and self._header_bytes > self.max_header_bytes:
            self._refuse(TOO_LARGE)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if not self._awaiting_headers:  # the next request of a keep-alive connection
            self._awaiting_headers = True
            self._header_bytes = self._chunk  # (the chunk may hold the end of the last request too: a bound)
            self._arm()

    def on_headers_complete(self) -> None:
        self._awaiting_headers = False
        self._disarm()
        super().on_headers_complete()

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout, self._refuse, TIMED_OUT)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _refuse(self, answer: bytes) -> None:
        self._disarm()
        if self.transport.is_closing():
            return
        if self._header_bytes:  # a client that sent nothing gets nothing: it may not speak HTTP at all
            self.transport.write(answer)
        self.transport.close()


def bounded_protocol(header_timeout: float, max_header_bytes: int) -> type[BoundedHttpProtocol]:
    """The protocol class to hand uvicorn (`Config(http=...)`), with this router's bounds."""
    return type(
        "BoundedHttp",
        (BoundedHttpProtocol,),
        {"header_timeout": header_timeout, "max_header_bytes": max_header_bytes},
    )
