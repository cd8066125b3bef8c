"""Resume tokens: the secret in every SSE event id that lets only a request's own client resume it.

An event id is `<request id>.<token>:<tokens held>:<characters held>`; with `n` > 1 choices each count is
a comma-separated list, a choice per item, and a choice whose last event was sent ends with `+`
(`<id>.<token>:12,40+,7:51,160,30`). The token is an HMAC, keyed per
deployment, over the request id and a digest of the request body as the client sent it: a request id
alone (seen in a log, guessed) is not enough, and neither is a valid event id sent with another body.
The key is the launcher's, so a restarted router checks the tokens its predecessor issued; nothing
is stored per request.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

from pydantic import BaseModel

TOKEN_HEX = 32  # 128 bits
# The counts in an event id: plain decimal, as this server writes them, and at most this, far above any
# context (tokens) or its text (characters) and within every integer the protocol and ledgers hold: a
# larger one would fail in the stream after its 200 was sent, not here.
MAX_HELD = 2**31 - 1
_COUNT = re.compile(r"[0-9]{1,10}")


MAX_CHOICES = 64  # items in one event id's lists (the server's n cap is lower)


@dataclass(frozen=True)
class Held:
    """What a client holds of one choice: tokens, characters, and whether that choice ended."""

    tokens: int
    chars: int
    finished: bool = False


@dataclass(frozen=True)
class ResumePoint:
    request_id: str
    token: str
    choices: tuple[Held, ...]

    @property
    def have_tokens(self) -> int:
        return self.choices[0].tokens

    @property
    def have_chars(self) -> int:
        return self.choices[0].chars


def body_digest(body: BaseModel) -> bytes:
    """The request as parsed, canonically: the same JSON sent twice (keys in any order) digests alike."""
    return hashlib.sha256(body.model_dump_json().encode()).digest()


def parse_event_id(event_id: str) -> ResumePoint:
    """ValueError unless `event_id` has the shape this server sends."""
    head, tokens, chars = event_id.rsplit(":", 2)
    request_id, _, token = head.rpartition(".")
    token_items, char_items = tokens.split(","), chars.split(",")
    if not request_id or len(token) != TOKEN_HEX or len(token_items) != len(char_items):
        raise ValueError(event_id)
    if len(token_items) > MAX_CHOICES:
        raise ValueError(event_id)
    many = len(token_items) > 1
    held = []
    for t, c in zip(token_items, char_items, strict=True):
        finished = many and t.endswith("+")
        held.append(Held(count(t[:-1] if finished else t), count(c), finished))
    return ResumePoint(request_id, token, tuple(held))


def count(text: str) -> int:
    """A count of an event id; ValueError unless plain digits up to MAX_HELD (`int` would take a sign,
    spaces, underscores, other scripts' digits and any size)."""
    if _COUNT.fullmatch(text) is None or int(text) > MAX_HELD:
        raise ValueError(text)
    return int(text)


class ResumeSigner:
    def __init__(self, key: bytes = b"") -> None:
        """`key`: the deployment's; a router started on its own (tests, tools) makes a fresh one."""
        self._key = key or secrets.token_bytes(32)

    def token(self, request_id: str, digest: bytes) -> str:
        mac = hmac.new(self._key, request_id.encode() + b"\0" + digest, hashlib.sha256)
        return mac.hexdigest()[:TOKEN_HEX]

    def event_id(self, request_id: str, token: str, have_tokens: int, have_chars: int) -> str:
        return f"{request_id}.{token}:{have_tokens}:{have_chars}"

    def choices_event_id(self, request_id: str, token: str, held: list[Held]) -> str:
        """The event id of a stream of several choices: what the client holds of each."""
        tokens = ",".join(f"{h.tokens}{'+' if h.finished else ''}" for h in held)
        return f"{request_id}.{token}:{tokens}:{','.join(str(h.chars) for h in held)}"

    def valid(self, point: ResumePoint, digest: bytes) -> bool:
        return hmac.compare_digest(point.token, self.token(point.request_id, digest))
