"""The token masks of requests under a grammar (structured outputs): computed for a step's requests on
a thread of their own while the forward pass runs (llguidance drops the GIL), then applied to the
step's logits rows. A request's matcher advances only with the tokens it is given (`advance`), so the
masks never depend on the batch or the timing, and a new owner rebuilds it from the tokens produced.

A constrained request never verifies drafts (speculation.py): its tokens are the same either way,
and one mask per request and step keeps the matcher's state a function of its output alone.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import llguidance.torch
import torch

from steadfast.model.grammar import Matchers, ll_tokenizer
from steadfast.model.tokenizer import GGUFTokenizer
from steadfast.worker.core.request import Request

log = logging.getLogger(__name__)
_BITS = torch.arange(32, dtype=torch.int32)


class StepMasks:
    """The allowed tokens of each constrained request of one step: a bit per token, a row per request."""

    def __init__(self, rows: dict[str, int], bits: torch.Tensor) -> None:
        self.rows = rows
        self.bits = bits  # [requests, ceil(vocab / 32)] int32

    def apply(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """`logits` with every token a row's grammar forbids at -inf (a copy; the input is kept, the
        raw logprobs are read from it). A row whose other adjustments (min_tokens' barred EOS) leave
        it no token at all keeps the grammar's tokens alone: the grammar is the contract."""
        at = [(r, self.rows[q.request_id]) for r, q in enumerate(requests) if q.request_id in self.rows]
        if not at:
            return logits
        index = torch.tensor([r for r, _ in at])
        bits = self.bits[[m for _, m in at]]
        vocab = logits.shape[-1]
        # allowed: [rows, vocab]; a token past the grammar's vocabulary is never allowed.
        allowed = ((bits.unsqueeze(-1) >> _BITS) & 1).bool().flatten(1)
        if allowed.shape[1] < vocab:
            allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
        allowed = allowed[:, :vocab].to(logits.device)
        rows = logits[index.to(logits.device)]
        masked = rows.masked_fill(~allowed, float("-inf"))
        empty = torch.isneginf(masked).all(dim=1)
        if bool(empty.any()):  # the allowed tokens the adjustments barred come back, last of all
            masked[empty] = rows[empty].clamp(min=-1e30).masked_fill(~allowed[empty], float("-inf"))
        out = logits.clone()
        out[index.to(logits.device)] = masked
        return out


class Constraints:
    """The matchers of a worker's constrained requests, and their masks off the critical path."""

    def __init__(self, tokenizer: GGUFTokenizer, threads: int = 1) -> None:
        self.tokenizer = tokenizer
        self.threads = threads
        self._matchers: Matchers | None = None  # (the vocabulary takes ~0.2 s: built for the first grammar)
        self._executor: llguidance.LLExecutor | None = None
        self._pool: ThreadPoolExecutor | None = None

    def attach(self, request: Request) -> None:
        """Give a request its matcher, in the state its produced tokens leave it (GrammarError: a grammar
        that does not compile here)."""
        if not request.params.grammar:
            return
        if self._matchers is None:
            self._matchers = Matchers(ll_tokenizer(self.tokenizer))
            self._executor = llguidance.LLExecutor(self.threads)
            self._pool = ThreadPoolExecutor(1, "grammar-masks")
        request.matcher = self._matchers.matcher(request.params.grammar, request.output_ids)

    def start(self, requests: Sequence[Request]) -> Future[StepMasks] | None:
        """Begin the masks of a step's constrained requests (None: it has none)."""
        constrained = [r for r in dict.fromkeys(requests) if r.matcher is not None]
        if not constrained or self._pool is None:
            return None
        return self._pool.submit(self._masks, constrained)

    def _masks(self, requests: list[Request]) -> StepMasks:
        bits = llguidance.torch.allocate_token_bitmask(len(requests), self.tokenizer.vocab_size)
        pairs = [(r.matcher, i) for i, r in enumerate(requests)]
        llguidance.torch.fill_next_token_bitmask_par(self._executor, pairs, bits)
        return StepMasks({r.request_id: i for i, r in enumerate(requests)}, bits)

    @staticmethod
    def advance(request: Request, token: int) -> None:
        """The grammar takes the token the request produced (one its mask allowed). Once the grammar is
        complete its mask allows EOS alone: with `ignore_eos` those EOS tokens are not given to it."""
        matcher = request.matcher
        if matcher is None or matcher.is_stopped():
            return
        if not matcher.consume_token(token):  # (never raised: one request's grammar must not stop the loop)
            log.error(
                "request %s: token %d does not fit its grammar: %s", request.request_id, token, matcher.get_error()
            )

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
