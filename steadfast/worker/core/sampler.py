"""Token sampling: greedy, temperature, top-k, top-p.

Token i of a request is drawn with noise from a generator seeded by (request seed, i), never from a
process-wide RNG stream, so the same request yields the same tokens whatever batch it shares, after a
preemption, or in another process. Sampling is the exponential race: argmax(p / E) with E ~ Exp(1)
picks index j with probability p_j, and needs one draw per row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from steadfast.wire.worker import SamplingParams

_MASK64 = (1 << 64) - 1


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
        noise = torch.empty_like(probs)
        gen = torch.Generator()
        for i, r in enumerate(random_rows):
            gen.manual_seed(step_seed(params[r].seed, indices[r]))
            noise[i].exponential_(generator=gen)
        chosen[rows] = (probs / noise).argmax(dim=-1)
    return chosen.tolist()
