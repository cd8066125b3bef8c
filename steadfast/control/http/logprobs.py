"""Token logprobs as OpenAI answers them: chat's `logprobs.content` (token, logprob, bytes, top_logprobs)
and legacy completions' parallel lists (tokens, token_logprobs, top_logprobs, text_offset). A stream's
chunk carries the entries of the tokens that released its text: one held back (a possible stop string,
an incomplete character) rides with the chunk that sends it. Formatting only: the figures are the worker's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from steadfast.model.tokenizer import GGUFTokenizer
from steadfast.wire.worker import TokenLogprob

Entry = tuple[int, TokenLogprob]  # (token id, its logprobs)


class TokenNames:
    """Each token's string and bytes, made once per id (a vocabulary is bounded)."""

    def __init__(self, tokenizer: GGUFTokenizer) -> None:
        self.tok = tokenizer
        self._known: dict[int, tuple[str, list[int]]] = {}

    def of(self, token_id: int) -> tuple[str, list[int]]:
        known = self._known.get(token_id)
        if known is None:
            raw = self.tok.token_bytes(token_id)
            known = self._known[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return known


def chat_logprobs(names: TokenNames, entries: Sequence[Entry]) -> dict[str, Any]:
    def one(token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = names.of(token_id)
        return {"token": text, "logprob": logprob, "bytes": raw}

    content = [
        {**one(t, lp.logprob), "top_logprobs": [one(i, v) for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)]}
        for t, lp in entries
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(names: TokenNames, entries: Sequence[Entry], offset: int) -> dict[str, Any]:
    """`offset`: characters of the completion's text before these tokens."""
    tokens, offsets = [], []
    for t, _ in entries:
        text = names.of(t)[0]
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for _, lp in entries],
        "top_logprobs": [
            {names.of(i)[0]: v for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)} for _, lp in entries
        ],
        "text_offset": offsets,
    }


def prompt_logprobs(names: TokenNames, prompt_ids: Sequence[int], scores: Sequence[TokenLogprob]) -> dict[str, Any]:
    """An echoed prompt's part of legacy completions' logprobs: its first token has none (nothing before
    it), each other token the logprobs the worker scored it with."""
    part = completion_logprobs(names, list(zip(prompt_ids[1:], scores, strict=True)), 0)
    first = names.of(prompt_ids[0])[0]
    return {
        "tokens": [first, *part["tokens"]],
        "token_logprobs": [None, *part["token_logprobs"]],
        "top_logprobs": [None, *part["top_logprobs"]],
        "text_offset": [0, *(o + len(first) for o in part["text_offset"])],
    }


def joined(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """Two parts of legacy completions' logprobs, one after the other."""
    return {key: first[key] + then[key] for key in first}
