"""A test client's view of a POSTed SSE stream: each JSON data event with the id sent with it."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx


class Refused(Exception):
    """A 4xx answer: the server refused the stream (not broken: reconnecting would not help)."""


def events(url: str, body: dict, last: str | None = None, timeout: float = 30) -> Iterator[tuple[str | None, dict]]:
    """Each JSON data event of the stream, with the event id sent with it (None: none), resuming after
    `last` (Last-Event-ID) where given. A 4xx raises Refused; a 5xx httpx.TransportError, as a broken
    connection does (the caller reconnects)."""
    headers = {"Last-Event-ID": last} if last else {}
    with httpx.stream("POST", url, json=body, headers=headers, timeout=timeout) as r:
        if r.status_code != 200:
            r.read()
            if r.status_code < 500:
                raise Refused(f"{r.status_code}: {r.text}")
            raise httpx.TransportError(f"status {r.status_code}")
        pending = None
        for line in r.iter_lines():
            if line.startswith("id: "):
                pending = line[4:]
            elif line.startswith("data: {"):
                yield pending, json.loads(line[6:])
                pending = None
