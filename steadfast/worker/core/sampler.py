"""Token sampling: logits adjusted (min_tokens, logit_bias, penalties, a grammar's mask), then greedy or temperature,
top-k, top-p, min-p.

Token i of a request is drawn with noise from a generator seeded by (request seed, i), never from a
process-wide RNG stream, so the same request yields the same tokens whatever batch it shares, after a
preemption, or in another process. Sampling is the exponential race: argmax(p / E) with E ~ Exp(1)
picks index j with probability p_j, and needs one draw per row. Every adjustment reads one row and the
request's own tokens, so a takeover rebuilds it from the delivered tokens and no batch changes it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from steadfast.wire.worker import SamplingParams, TokenLogprob
from steadfast.worker.core.grammar import StepMasks
from steadfast.worker.core.request import Request

_MASK64 = (1 << 64) - 1
MAX_TOP = 20  # the most alternatives a token's logprobs carry (OpenAI's bound)
NEVER = -9999.0  # the logprob of a token that cannot be drawn (JSON has no -inf; OpenAI's own figure)


def step_seed(seed: int, index: int) -> int:
    """A well-mixed 63-bit seed for token `index` of a request seeded with `seed` (splitmix64)."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def _filter(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    # logits: [rows, vocab], already divided by temperature
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    ranks = torch.arange(vocab).unsqueeze(0)
    drop = ranks >= k.unsqueeze(1)
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the mass before it already reaches top_p. The top token always stays, named
    # rather than left to the sum: a top_p under float32's range (1e-50) is 0, which the mass before
    # the top token (0) reaches, and a row with every token dropped samples token 0.
    drop |= ((probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(1)) & (ranks > 0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def adjust(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
    eos: Sequence[int],
) -> torch.Tensor:
    """The logits each row samples from, as vLLM orders it: EOS and stop ids barred before `min_tokens`,
    `logit_bias` added, then the repetition penalty (prompt and output tokens) and the presence and
    frequency penalties (output tokens). Rows that ask for none are left as they are (no copy at all)."""
    rows = [r for r, p in enumerate(params) if p.adjusts]
    if not rows:
        return logits
    logits = logits.clone()
    vocab = logits.shape[-1]
    for r in rows:
        p, row, out = params[r], logits[r], outputs[r]
        if len(out) < p.min_tokens:
            barred = [t for t in (*(() if p.ignore_eos else eos), *p.stop_token_ids) if t < vocab]
            row[barred] = float("-inf")
        if p.logit_bias:
            ids, bias = zip(*p.logit_bias, strict=True)
            row[list(ids)] += torch.tensor(bias, dtype=row.dtype)
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted({*prompts[r], *out}), dtype=torch.long)
            values = row[seen]
            row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and out:
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=vocab)[:vocab].to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return logits


@dataclass
class Sampled:
    """A step's rows (requests, a verifying one once per position), the token each drew, and its
    logprobs where the request asked."""

    rows: list[Request]
    tokens: list[int]
    logprobs: list[TokenLogprob | None]
    scores: list[tuple[Request, int, TokenLogprob]] = field(default_factory=list)  # prompt tokens' (scored_prompts)

    def __post_init__(self) -> None:
        self._rows_of: dict[str, list[int]] = {}  # (only where a row has logprobs: a step without costs nothing)
        for i, lp in enumerate(self.logprobs):
            if lp is not None:
                self._rows_of.setdefault(self.rows[i].request_id, []).append(i)

    def logprob(self, request_id: str, k: int) -> TokenLogprob | None:
        """The logprobs of the k-th token a request produced this step (its k-th row's: a verifying
        request's produced tokens are the ones its rows drew, up to the first draft not kept)."""
        rows = self._rows_of.get(request_id)
        return None if rows is None else self.logprobs[rows[k]]


def logprobs_of(
    logits: torch.Tensor, params: Sequence[SamplingParams], tokens: Sequence[int]
) -> list[TokenLogprob | None]:
    """The raw log-softmax (the model's, before any adjustment: vLLM's default) at each drawn token and
    the likeliest `logprobs` alternatives, for the rows that ask. The rows that ask are computed in one
    batch (16 rows one at a time cost a bf16 step ~14 % of its throughput); each row's figures are its
    own (a softmax and a top-k read one row), whatever rows share the batch."""
    out: list[TokenLogprob | None] = [None] * len(params)
    rows = [r for r, p in enumerate(params) if p.logprobs >= 0]
    if not rows:
        return out
    lp = torch.log_softmax(logits[rows].float(), dim=-1)
    chosen = lp.gather(1, torch.tensor([tokens[r] for r in rows], device=lp.device).unsqueeze(1)).squeeze(1).tolist()
    # Always the top MAX_TOP cut to each row's count: a row's alternatives (ties' order too) never
    # depend on what the rows beside it asked for.
    top_values, top_ids = (t.tolist() for t in lp.topk(min(MAX_TOP, lp.shape[-1])))
    for i, r in enumerate(rows):
        k = params[r].logprobs
        values = [max(v, NEVER) for v in top_values[i][:k]]  # (a processed row's barred tokens: -inf)
        out[r] = TokenLogprob(max(chosen[i], NEVER), top_ids[i][:k], values)
    return out


def scored_prompts(
    logits: torch.Tensor, scorers: Sequence[tuple[Request, int]]
) -> list[tuple[Request, int, TokenLogprob]]:
    """The logprobs of the prompt token after each scoring row's position (the raw log-softmax, as for an
    output token), with the request's count of alternatives."""
    if not scorers:
        return []
    following = [request.prompt_ids[pos + 1] for request, pos in scorers]
    params = [request.params for request, _ in scorers]
    counted = [SamplingParams(logprobs=p.prompt_logprobs) for p in params]
    lps = logprobs_of(logits, counted, following)
    return [(request, pos, lp) for (request, pos), lp in zip(scorers, lps, strict=True) if lp is not None]


def keep_scores(scores: Sequence[tuple[Request, int, TokenLogprob]]) -> None:
    """A step's prompt logprobs, each kept once and in order (a recomputed step scores nothing twice)."""
    for request, pos, lp in scores:
        if pos == len(request.prompt_scores):
            request.prompt_scores.append(lp)


def sample_rows(
    logits: torch.Tensor,
    rows: Sequence[Request],
    drafts: Mapping[str, Sequence[int]],
    eos: Sequence[int],
    masks: StepMasks | None = None,
    scorers: Sequence[tuple[Request, int]] = (),
) -> Sampled:
    """One token per row of a step. A request verifying drafts has one row per position: row k draws its
    output token len(output) + k, as if drafts[:k] were its output (a draft is kept only where it equals
    the token drawn there, so that is the output the token follows). `masks`: the tokens each
    constrained request's grammar allows, applied after the other adjustments. `scorers`: rows after the
    sampled ones that score a prompt's next token (scored_prompts)."""
    scores = scored_prompts(logits[len(rows) :], scorers)
    logits = logits[: len(rows)]
    indices: list[int] = []
    outputs: list[Sequence[int]] = []
    seen: dict[str, int] = {}
    for r in rows:
        k = seen[r.request_id] = seen.get(r.request_id, -1) + 1
        indices.append(len(r.output_ids) + k)
        outputs.append([*r.output_ids, *drafts[r.request_id][:k]] if k and r.params.adjusts else r.output_ids)
    params = [r.params for r in rows]
    adjusted = adjust(logits, params, [r.prompt_ids for r in rows], outputs, eos)
    if masks is not None:
        adjusted = masks.apply(adjusted, rows)
    tokens = sample(adjusted, params, indices)
    return Sampled(list(rows), tokens, logprobs_of(processed(logits, adjusted, params), params, tokens), scores)


def processed(raw: torch.Tensor, adjusted: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The logits each row's logprobs are read from: the model's raw ones, or for a row asking for the
    processed distribution the one its token is drawn from (adjusted; then, sampled rows, scaled by the
    temperature and cut by top-k, top-p and min-p: a token never drawn has -inf)."""
    rows = [r for r, p in enumerate(params) if p.processed_logprobs and p.logprobs >= 0]
    if not rows:
        return raw
    out = raw.clone()
    for r in rows:
        p, row = params[r], adjusted[r : r + 1]
        if not p.greedy:
            row = row / p.temperature
            if p.top_k > 0 or p.top_p < 1.0:
                row = _filter(row, torch.tensor([p.top_k]), torch.tensor([p.top_p]))
            if p.min_p > 0:
                probs = row.softmax(dim=-1)
                row = row.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
        out[r] = row[0]
    return out


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], indices: Sequence[int]) -> list[int]:
    """One token per row. `indices[r]` is the position in its request's output of the token drawn."""
    # logits: [rows, vocab] fp32
    chosen = logits.argmax(dim=-1)
    random_rows = [r for r, p in enumerate(params) if not p.greedy]
    if random_rows:
        rows = torch.tensor(random_rows)
        temps = torch.tensor([params[r].temperature for r in random_rows]).unsqueeze(1)
        top_k = torch.tensor([params[r].top_k for r in random_rows])
        top_p = torch.tensor([params[r].top_p for r in random_rows])
        scaled = logits[rows] / temps
        if bool((top_k > 0).any()) or bool((top_p < 1.0).any()):
            scaled = _filter(scaled, top_k, top_p)
        probs = scaled.softmax(dim=-1)
        min_p = torch.tensor([params[r].min_p for r in random_rows])
        if bool((min_p > 0).any()):  # below min_p x the likeliest token's probability: never drawn
            probs = probs.masked_fill(probs < min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values, 0.0)
        noise = torch.empty_like(probs)
        gen = torch.Generator()
        for i, r in enumerate(random_rows):
            gen.manual_seed(step_seed(params[r].seed, indices[r]))
            noise[i].exponential_(generator=gen)
        chosen[rows] = (probs / noise).argmax(dim=-1)
    return chosen.tolist()
