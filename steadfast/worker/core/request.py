"""One request's state inside a worker: its tokens, how many have KV, and how it ends."""

from __future__ import annotations

import enum
import itertools
from typing import Any

from steadfast.wire.worker import FinishReason, Route, SamplingParams, TokenLogprob

_arrival = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, priority: int = 1) -> None:
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.params = params
        self.priority = priority
        self.arrival = next(_arrival)  # FIFO order among equal priorities, kept across preemption
        self.status = Status.WAITING
        self.num_computed = 0  # tokens whose KV is in the arena
        self.num_cached = 0  # prompt tokens found in the prefix cache at first admission
        self.num_preemptions = 0
        self.kv_lost = 0  # tokens of KV it had when it was last preempted
        self.finish_reason: FinishReason | None = None
        # A taken-over request: (route, tokens of KV adopted) until its first new token reports them.
        self.recovery: tuple[Route, int] | None = None
        self.resume_tokens = 0  # tokens it had (prompt + delivered) when it was taken over
        self.client_has_text = False  # taken over from a client who had text (whatever the checkpoint held)
        self.decode_worker = -1  # a prefill worker hands its KV to this worker after the first token
        self.kv_paths: list[str] = []  # ...on another node, streamed to these addresses
        self.kv_given: list[tuple[int, int]] = []  # (start, count) spans given to the KV sender
        self.matcher: Any = None  # its grammar's state (an llguidance matcher; grammar.py) where it has one
        self.prompt_scores: list[TokenLogprob] = []  # prompt token i + 1's logprobs at i (prompt_logprobs)

    def first_scores(self) -> list[TokenLogprob] | None:
        """The prompt's logprobs, on the first output of a request that asked for them."""
        return self.prompt_scores if self.params.prompt_logprobs >= 0 and len(self.output_ids) == 1 else None

    def scores(self, pos: int) -> bool:
        """Whether the row of prompt position `pos` gives a prompt logprob not yet known (and still to send:
        a request taken over past its first token had them sent)."""
        wanted = self.params.prompt_logprobs >= 0 and not self.output_ids
        return wanted and len(self.prompt_scores) <= pos < len(self.prompt_ids) - 1

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def streaming(self) -> bool:
        """Its client has seen tokens of it: every step it waits for is a stall the client feels."""
        return bool(self.output_ids) or self.client_has_text

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """Tokens that need KV computed before the next token can be sampled."""
        return self.num_tokens - self.num_computed

    @property
    def sort_key(self) -> tuple[int, int]:
        return (self.priority, self.arrival)

    def __repr__(self) -> str:
        return f"Request({self.request_id}, {self.status.value}, computed={self.num_computed}/{self.num_tokens})"
