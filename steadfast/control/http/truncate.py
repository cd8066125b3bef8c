"""Shortening a new request's context to a token cap (the ladder's L4): a chat keeps its system
messages and as many of its latest turns as fit; a plain prompt keeps its most recent tokens (and its
BOS). Runs on the tokenize pool: each try renders and encodes the chat again."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def cut_prompt(ids: list[int], cap: int, bos: int | None) -> list[int]:
    """The last `cap` tokens of a prompt, its leading BOS kept."""
    if len(ids) <= cap:
        return ids
    if bos is not None and ids and ids[0] == bos:
        return [bos, *ids[len(ids) - cap + 1 :]]
    return ids[len(ids) - cap :]


def cut_chat(
    messages: list[dict[str, Any]], cap: int, encode: Callable[[list[dict[str, Any]]], list[int]]
) -> tuple[list[int], int]:
    """Token ids of the chat with its oldest non-system messages dropped until it fits in `cap`, and
    how many were dropped. The last message always stays (with the system messages, even when they
    alone exceed the cap: one message is never cut in the middle); the kept turns do not start with an
    assistant reply."""
    system = [m for m in messages if m["role"] == "system"]
    turns = [m for m in messages if m["role"] != "system"]

    def kept(drop: int) -> list[dict[str, Any]]:
        rest = turns[drop:]
        while len(rest) > 1 and rest[0]["role"] == "assistant":
            rest = rest[1:]
        return system + rest

    lo, hi = 0, max(0, len(turns) - 1)  # the fewest dropped that fits: in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if len(encode(kept(mid))) <= cap:
            hi = mid
        else:
            lo = mid + 1
    chosen = kept(lo)
    return encode(chosen), len(messages) - len(chosen)
