"""Speculative decoding by prompt lookup: draft tokens are what followed the latest earlier occurrence of
the request's last n tokens (in its prompt or its own output); the engine verifies them all in one
forward pass and keeps the longest prefix the model itself would have produced.

Exactness: position i's token is sampled from the logits at i with the generator seeded by (request
seed, i), exactly as without speculation; a draft is accepted only where it equals that token. So
greedy and seeded outputs are the same with speculation on or off, and a rejected draft costs only the
verification position it took.

How many drafts to verify is a bet: each verified position costs a fraction of a step (how much the
hardware says: measured from the worker's own steps) and pays off only while the drafts keep being
right (each request's own acceptance rate). A request drafts k tokens where the expected tokens per
step, divided by the step's cost, is best, and not at all when one plain token is the better buy; it
then tries again after a while (longer each time), so that free text pays next to nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from steadfast.config import SpeculativeConfig
from steadfast.worker.core.request import Request
from steadfast.worker.core.scheduler import ScheduledStep

PRIOR_ACCEPTANCE = 0.6  # a new request's chance that a draft is right, until its own drafts say
SMOOTHING = 0.3  # weight of the latest verification in a request's acceptance rate
ROW_COST = 0.15  # a verified position's cost in plain steps, until the worker has measured its own
MIN_GAIN = 1.05  # drafting must promise this many tokens per plain step's cost
PAUSE_TOKENS = 16  # output tokens a request goes without drafting once it is not worth it; doubles
MAX_PAUSE_TOKENS = 512


class NgramIndex:
    """Where each n-gram of a growing token list last ended, for n in [n_min, n_max].

    Kept one token behind the list: the suffix being looked up is never its own match. Appending is
    O(n_max - n_min + 1) per token; a lookup is O(1) per n.
    """

    def __init__(self, n_min: int, n_max: int) -> None:
        self.sizes = range(n_max, n_min - 1, -1)  # longest first
        self._ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self._indexed = 0  # n-grams ending at positions <= this are in the index

    def propose(self, ids: list[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest matching suffix."""
        last = len(ids) - 1  # n-grams ending before the last token: every match has a token after it
        for end in range(self._indexed + 1, last + 1):
            for n, ends in self._ends.items():
                if end >= n:
                    ends[tuple(ids[end - n : end])] = end
        self._indexed = max(self._indexed, last)
        for n in self.sizes:
            if len(ids) > n:
                end = self._ends[n].get(tuple(ids[-n:]))
                if end is not None:
                    return ids[end : end + k]
        return []


@dataclass
class DraftState:
    """One request's drafting: its n-gram index and how often its drafts have been right."""

    index: NgramIndex
    acceptance: float = PRIOR_ACCEPTANCE  # the chance that a draft is right, given the ones before were
    resume_at: int = 0  # output length from which it drafts again
    pause: int = PAUSE_TOKENS
    probe: bool = False  # after a pause: one draft, to learn whether drafting pays again


def accepted_prefix(drafts: list[int], sampled: list[int]) -> int:
    """How many drafts the model confirmed: the longest prefix where draft i equals sampled token i."""
    n = 0
    while n < len(drafts) and drafts[n] == sampled[n]:
        n += 1
    return n


def best_length(acceptance: float, most: int, row_cost: float) -> int:
    """The draft length with the most expected tokens per unit of step cost (1 + row_cost per draft);
    0 when no length beats a plain step by MIN_GAIN. With acceptance a, k drafts yield
    1 + a + ... + a^k tokens (a draft counts only if all before it did)."""
    best, value, expected = 0, MIN_GAIN, 1.0
    for k in range(1, most + 1):
        expected += acceptance**k
        if expected / (1 + row_cost * k) > value:
            best, value = k, expected / (1 + row_cost * k)
    return best


class Speculator:
    """A worker's drafting: which requests draft how many tokens, and the counts its metrics report."""

    def __init__(self, cfg: SpeculativeConfig) -> None:
        self.cfg = cfg
        self.enabled = cfg.method == "ngram"  # the worker's switch (the degradation ladder turns it off)
        self.row_cost = ROW_COST
        self._plain_step = 0.0  # seconds of a step of one plain decode alone (moving average)
        self._states: dict[str, DraftState] = {}
        self.drafted = 0
        self.accepted = 0
        self.verify_steps = 0  # request-steps that verified drafts
        self.decode_steps = 0  # request-steps that produced output (plain decodes and verifications)
        self.decoded = 0  # tokens those steps produced

    def drafts(self, request_id: str, ids: list[int], output_len: int, room: int) -> list[int]:
        """Draft tokens for a decoding request (`ids`: prompt and output), at most `room`: what its
        step budget, `max_tokens` and the context leave beyond the one token it samples anyway."""
        if not self.enabled or room < 1:
            return []
        state = self._states.get(request_id)
        if state is None:
            cfg = self.cfg
            state = self._states[request_id] = DraftState(NgramIndex(cfg.ngram_min, cfg.ngram_max))
        if output_len < state.resume_at:
            return []
        proposal = state.index.propose(ids, min(room, self.cfg.num_draft_tokens))
        if not proposal:
            return []
        if state.probe:
            state.probe = False
            return proposal[:1]
        k = best_length(state.acceptance, len(proposal), self.row_cost)
        if k == 0:  # not worth it now: try again later, with one draft
            state.resume_at, state.probe = output_len + state.pause, True
            state.pause = min(2 * state.pause, MAX_PAUSE_TOKENS)
        return proposal[:k]

    def drafts_for(self, request: Request, budget: int, max_model_len: int) -> list[int]:
        """Draft tokens for a decoding request to verify this step; none for one whose client asked for
        plain decoding, one under a grammar, or whose first token is a prompt's (a prefill worker hands
        it on right after)."""
        if (
            not request.params.speculative
            or not request.output_ids
            or request.decode_worker >= 0
            or request.kv_paths
            or request.matcher is not None  # (one grammar mask per step: grammar.py)
        ):
            return []
        room = min(
            budget - 1,
            request.params.max_tokens - len(request.output_ids) - 1,
            max_model_len - request.num_tokens - 1,
        )
        return self.drafts(request.request_id, request.all_ids, len(request.output_ids), room)

    def accept(
        self, verifies: list[tuple[Request, list[int]]], samplers: list[Request], tokens: list[int]
    ) -> list[tuple[Request, list[int]]]:
        """Each sampling request of a step and its new tokens, in row order: one, or for a verifying
        request the drafts the model confirmed and the token it sampled after them."""
        rows: dict[str, tuple[Request, list[int]]] = {}
        for request, token in zip(samplers, tokens, strict=True):
            rows.setdefault(request.request_id, (request, []))[1].append(token)
        for request, drafts in verifies:
            if request.request_id in rows:
                sampled = rows[request.request_id][1]
                n = accepted_prefix(drafts, sampled)
                del sampled[n + 1 :]
                self.verified(request.request_id, len(drafts), n)
        decoding = [r for r in rows.values() if r[0].output_ids]
        self.produced(len(decoding), sum(len(t) for _, t in decoding))
        return list(rows.values())

    def time_step(self, step: ScheduledStep, seconds: float) -> None:
        """A step of one decoding request alone tells what a verified draft costs on this worker."""
        if not step.prefills and len(step.decodes) + len(step.verifies) == 1:
            self.timed(len(step.verifies[0][1]) if step.verifies else 0, seconds)

    def verified(self, request_id: str, drafted: int, accepted: int) -> None:
        """Record one verification in the request's acceptance rate (a right draft is a success, the
        first wrong one a failure; those after it were never tried)."""
        self.drafted += drafted
        self.accepted += accepted
        self.verify_steps += 1
        state = self._states.get(request_id)
        if state is None:
            return
        seen = accepted / (accepted + (accepted < drafted))
        state.acceptance += SMOOTHING * (seen - state.acceptance)
        if accepted:
            state.pause = PAUSE_TOKENS

    def timed(self, drafts: int, seconds: float) -> None:
        """A step that computed one decoding request alone, with `drafts` verified positions: what a
        verified position costs on this worker, in plain steps (moving averages)."""
        if drafts == 0:
            self._plain_step = seconds if not self._plain_step else 0.9 * self._plain_step + 0.1 * seconds
        elif self._plain_step:
            cost = max(0.0, (seconds / self._plain_step - 1) / drafts)
            self.row_cost = 0.9 * self.row_cost + 0.1 * cost

    def produced(self, steps: int, tokens: int) -> None:
        self.decode_steps += steps
        self.decoded += tokens

    def forget(self, request_id: str) -> None:
        """The request ended here or left: its index goes (a preempted one keeps it: its ids only grow)."""
        self._states.pop(request_id, None)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.decoded / self.decode_steps if self.decode_steps else 0.0
