"""What the ladder decides for one new request: a `Plan` (admitted, perhaps shortened) or a `Refusal`
(429 or 503 with Retry-After, turned into the client's error by the HTTP layer), and what a shortened
request's client is told (`Notice`)."""

from __future__ import annotations

from dataclasses import dataclass

from steadfast.control.ladder.ladder import Level


@dataclass(frozen=True)
class Refusal:
    """A new request the ladder refuses: 429 (shed by prediction or a full queue) or 503 (the breaker),
    with the seconds to wait before retrying. The HTTP layer turns it into the client's error."""

    status: int
    message: str
    retry_after: int

    @property
    def code(self) -> str:
        return "overloaded" if self.status == 429 else "circuit_open"


class _Refused(Exception):  # noqa: N818 - carries a Refusal out of the checks to plan(), never further
    def __init__(self, refusal: Refusal) -> None:
        self.refusal = refusal


@dataclass
class Plan:
    """What the ladder does to one new request it admits."""

    level: Level
    max_tokens_cap: int = 0  # 0: none
    context_cap: int = 0  # 0: none
    predicted_ttft_ms: float = 0.0

    @property
    def shortened(self) -> bool:
        return bool(self.max_tokens_cap or self.context_cap)


@dataclass
class Notice:
    """What a shortened request's client is told (header and first chunk)."""

    level: int
    max_tokens: int = 0  # the cap it was given
    truncated_tokens: int = 0  # prompt tokens dropped
    dropped_messages: int = 0

    def header(self) -> str:
        parts = [f"level={self.level}"]
        if self.max_tokens:
            parts.append(f"max_tokens={self.max_tokens}")
        if self.truncated_tokens:
            parts.append(f"truncated_tokens={self.truncated_tokens}")
        if self.dropped_messages:
            parts.append(f"dropped_messages={self.dropped_messages}")
        return "; ".join(parts)

    def as_dict(self) -> dict[str, int]:
        return {k: v for k, v in self.__dict__.items() if v or k == "level"}
