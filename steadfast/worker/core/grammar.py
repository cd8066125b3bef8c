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
import torch

from steadfast.model.grammar import Matchers, ll_tokenizer
from steadfast.model.tokenizer import GGUFTokenizer
from steadfast.worker.core.request import Request

log = logging.getLogger(__name__)
_BITS = torch.arange(32, dtype=torch.int32)
_NEG_INF = torch.tensor(float("-inf"), dtype=torch.float32).view(torch.int32)


class StepMasks:
    """The allowed tokens of each constrained request of one step, a row per request, made ready on the
    mask thread for the critical path: there a row's logits keep their bits where allowed and become
    -inf elsewhere in two integer operations (16 rows: 0.2 ms, where a bool `masked_fill` took 3 ms)."""

    def __init__(self, rows: dict[str, int], bits: torch.Tensor, vocab: int) -> None:
        self.rows = rows
        # keep: [requests, vocab] int32, all ones where allowed; barred: -inf's bits where not.
        self.keep = (-((bits.unsqueeze(-1) >> _BITS) & 1)).flatten(1)[:, :vocab].contiguous()
        self.barred = _NEG_INF & ~self.keep

    def apply(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """`logits` with every token a row's grammar forbids at -inf (a copy; the input is kept, the raw
        logprobs are read from it). A row the other adjustments (min_tokens' barred EOS) leave no token
        at all keeps the grammar's tokens alone: the grammar is the contract."""
        at = [(r, self.rows[q.request_id]) for r, q in enumerate(requests) if q.request_id in self.rows]
        if not at:
            return logits
        device = logits.device
        mine = [m for _, m in at]
        # Every row of the step constrained, in mask order, and every mask's request sampling (a prefill
        # chunk short of its prompt's end has a mask and no row): the masks apply as they are.
        whole = len(at) == logits.shape[0] == self.keep.shape[0] and all(r == m for r, m in at)
        keep, barred = (self.keep, self.barred) if whole else (self.keep[mine], self.barred[mine])
        keep, barred = keep.to(device, non_blocking=True), barred.to(device, non_blocking=True)
        if keep.shape[1] != logits.shape[1]:  # a model whose output rows outnumber the vocabulary's
            pad = logits.shape[1] - keep.shape[1]
            keep = torch.nn.functional.pad(keep, (0, max(0, pad)))[:, : logits.shape[1]]
            barred = torch.nn.functional.pad(barred, (0, max(0, pad)), value=int(_NEG_INF))[:, : logits.shape[1]]
        index = None if whole else torch.tensor([r for r, _ in at], device=device)
        rows = (logits if index is None else logits[index]).float()  # (fp32 already: the sampler's logits)
        masked = ((rows.view(torch.int32) & keep) | barred).view(torch.float32)
        for i, (r, _) in enumerate(at):
            q = requests[r]
            # min_tokens may bar the EOS a finished grammar allows alone: its allowed tokens come back.
            if len(q.output_ids) < q.params.min_tokens and bool(torch.isneginf(masked[i]).all()):
                masked[i] = ((rows[i].clamp(min=-1e30).view(torch.int32) & keep[i]) | barred[i]).view(torch.float32)
        if index is None:  # every row constrained: the masked rows are the step's logits
            return masked.to(logits.dtype)
        out = logits.clone()
        out[index] = masked.to(out.dtype)
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
        # bits: [requests, ceil(vocab / 32)] int32, filled by llguidance in place (its own torch helpers
        # are not used: importing them loads torch's compiler, 2.3 s of every worker's start measured).
        bits = torch.full((len(requests), (self.tokenizer.vocab_size + 31) // 32), -1, dtype=torch.int32)
        pairs = [(r.matcher, i) for i, r in enumerate(requests)]
        assert self._executor is not None
        self._executor.unsafe_compute_mask_ptr(pairs, bits.data_ptr(), bits.shape[1] * 4, bits.shape[0])
        return StepMasks({r.request_id: i for i, r in enumerate(requests)}, bits, self.tokenizer.vocab_size)

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
