"""Grammars for structured outputs, held by llguidance: the model's vocabulary as llguidance sees it,
a grammar checked (with bounded work) before any worker runs it, and a matcher per request built from
a cache of compiled ones. No torch here: the router checks grammars too, and never imports torch.

The grammar travels as llguidance's own JSON form (what `grammar_from_json_schema`, `_regex` and
`_lark` return), so the worker never re-reads a schema and every owner of a request builds the same
matcher from the same string.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import llguidance

from steadfast.model.tokenizer import GGUFTokenizer

log = logging.getLogger(__name__)

# Bounds on the work one grammar may cost, a fifth to a half of llguidance's defaults (whose own figures:
# 200 k lexer fuel per mask step at ~14 k/ms is ~14 ms; 1 M to build at ~50 k/ms is ~20 ms). What honest
# grammars take here (2026-12-07, this 2-core machine): a 60-property schema with patterns compiles in
# 5 ms; a mask step of the regexes and schemas in the tests takes under 2 ms.
LIMITS = dict(
    max_items_in_row=500,
    initial_lexer_fuel=200_000,
    step_lexer_fuel=100_000,
    step_max_items=20_000,
    max_lexer_states=50_000,
    max_grammar_size=100_000,
    verbose_errors=False,  # (an error would otherwise quote the parser's state into a client's 400)
)
# JSON as the model writes it: compact, so a small model cannot spend its tokens on whitespace.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A grammar llguidance refuses, or one over the bounds above: the message says which and why."""


def limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**LIMITS)


class _Vocabulary:
    """The attributes llguidance's tokenizer wrapper reads: every token's bytes and the special ids."""

    is_tokenizer_wrapper = True

    def __init__(self, tok: GGUFTokenizer) -> None:
        self.eos_token_id = tok.info.eos_token_ids[0] if tok.info.eos_token_ids else None
        self.bos_token_id = tok.info.bos_token_id
        self.tokens = [tok.token_bytes(i) for i in range(tok.vocab_size)]
        self.special_token_ids = sorted(tok.control_ids)
        self._tok = tok

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tok.encode(text, add_special=False)


def ll_tokenizer(tok: GGUFTokenizer) -> llguidance.LLTokenizer:
    """The vocabulary of `tok` for llguidance (~0.2 s for 49 k tokens: build once per process)."""
    return llguidance.LLTokenizer(
        _Vocabulary(tok), n_vocab=tok.vocab_size, eos_token=list(tok.info.eos_token_ids) or None
    )


def from_json_schema(schema: dict[str, Any] | bool) -> str:
    """A grammar for JSON valid against `schema` (`True`/`{}`: any JSON object or value)."""
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as exc:
        raise GrammarError(str(exc)) from exc


def from_regex(pattern: str) -> str:
    return llguidance.LLMatcher.grammar_from_regex(pattern)


def from_lark(lark: str) -> str:
    return llguidance.LLMatcher.grammar_from_lark(lark)


def from_grammar(text: str) -> str:
    """A context-free grammar in Lark's syntax (llguidance's) or llama.cpp's GBNF, told apart by
    llguidance's own translation."""
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return from_lark(any_to_lark(text))
    except Exception as exc:  # (the translator raises its own kinds on bad input)
        raise GrammarError(f"not a Lark or GBNF grammar: {exc}") from exc


def from_choice(choices: Sequence[str]) -> str:
    """Exactly one of `choices`."""
    return from_lark("start: " + " | ".join(json.dumps(c) for c in choices))


def check(grammar: str, vocabulary: llguidance.LLTokenizer | None) -> None:
    """GrammarError if `grammar` is invalid or over the bounds. Drops the GIL while it compiles."""
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, vocabulary, limits=limits())
    if failed:
        raise GrammarError(messages[0] if messages else "the grammar is invalid")


class Matchers:
    """A matcher per request, each a copy of a compiled one kept by grammar (least recently used out):
    compiling is the cost, copying is not. A request's matcher is brought to its state by the tokens it
    already produced, so a new owner (takeover, migration, resume) continues the same grammar."""

    def __init__(self, vocabulary: llguidance.LLTokenizer, capacity: int = 64) -> None:
        self.vocabulary = vocabulary
        self.capacity = capacity
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def matcher(self, grammar: str, produced: Sequence[int] = ()) -> llguidance.LLMatcher:
        with self._lock:
            base = self._compiled.get(grammar)
            if base is not None:
                self._compiled.move_to_end(grammar)
        if base is None:
            base = llguidance.LLMatcher(self.vocabulary, grammar, log_level=0, limits=limits())
            if base.is_error():
                raise GrammarError(base.get_error())
            with self._lock:
                self._compiled[grammar] = base
                while len(self._compiled) > self.capacity:
                    self._compiled.popitem(last=False)
        matcher = base.deep_copy()
        if produced:
            # Tokens this grammar's masks allowed always fit it; a matcher they break stays in its error
            # state (it then allows EOS alone), said here, rather than failing a takeover's whole batch.
            if not matcher.consume_tokens(list(produced)):
                log.error("tokens produced under a grammar do not fit it again: %s", matcher.get_error())
        return matcher
