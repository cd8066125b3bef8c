"""Incremental detokenization and stop strings for one request.

Text is released only once it is final: a trailing incomplete UTF-8 sequence waits for its next byte,
and text that could still become the start of a stop string is held back until it cannot. The text of
the first `min_tokens` tokens is never searched for a stop string (as vLLM's `min_tokens`).
"""

from __future__ import annotations

from steadfast.model.tokenizer import GGUFTokenizer

_CONTEXT = 6  # tokens before the new ones decoded with them, so merges at the join come out right


class Detokenizer:
    def __init__(
        self, tokenizer: GGUFTokenizer, prompt_ids: list[int], stop: tuple[str, ...], min_tokens: int = 0
    ) -> None:
        self.tok = tokenizer
        self.ids = list(prompt_ids[-_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # all final text so far
        self.sent = 0  # characters of self.text already released
        self.min_tokens = min_tokens
        self.added = 0  # output tokens added
        self.floor = 0  # a stop string is looked for from here (after the first min_tokens tokens' text)

    def add(self, token_id: int) -> bool:
        """Append a token; True if a stop string now ends the output (text cut before it)."""
        self.ids.append(token_id)
        self.added += 1
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tok.decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            before = len(self.text)
            self.text += full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            if self.added <= self.min_tokens:
                self.floor = len(self.text)
            if self.stop:
                start = max(self.floor, before - self.hold)
                hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
                if hits:
                    self.text = self.text[: min(hits)]
                    return True
        return False

    def restore(self, tokens: list[int], client_chars: int | None) -> None:
        """The state of a request taken over with these output tokens, its client holding `client_chars`
        characters of text (None: as the tokens spell): stop-string holdback included."""
        for token in tokens:
            self.add(token)
        if client_chars is not None:
            # Not clamped: a client holding more text than the tokens spell gets none of it again.
            self.sent = client_chars

    def take(self, final: bool) -> str:
        """Text not yet released; while not final, keep back what a stop string could still claim."""
        end = len(self.text) if final or not self.stop else len(self.text) - self.hold
        end = max(self.sent, end)  # never behind what was released (a resumed client may hold more)
        delta = self.text[self.sent : end]
        self.sent = end
        return delta
