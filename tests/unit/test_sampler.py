"""Sampler: greedy, filters, and noise that depends only on (seed, token index)."""

from __future__ import annotations

import pytest
import torch

from steadfast.wire.worker import SamplingParams
from steadfast.worker.core.sampler import sample, step_seed

pytestmark = pytest.mark.unit


def logits_of(*probs: float) -> torch.Tensor:
    return torch.tensor([probs]).log()


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 2.0], [5.0, 1.0, 0.0]])
    assert sample(logits, [SamplingParams(temperature=0.0)] * 2, [0, 0]) == [1, 0]


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = logits_of(0.2, 0.5, 0.3)
    for seed in range(20):
        assert sample(logits, [SamplingParams(temperature=1.0, top_k=1, seed=seed)], [0]) == [1]
        assert sample(logits, [SamplingParams(temperature=1.0, top_p=0.01, seed=seed)], [0]) == [1]


def test_a_top_p_below_float32s_range_keeps_the_top_token():
    # 1e-50 is 0 in float32: the top token must stay all the same (it did not: token 0 every step).
    logits = logits_of(0.2, 0.5, 0.3)
    for seed in range(20):
        assert sample(logits, [SamplingParams(temperature=1.0, top_p=1e-50, seed=seed)], [0]) == [1]
    batch = torch.cat([logits_of(0.1, 0.2, 0.7), logits])  # with a row that filters nothing
    params = [SamplingParams(temperature=0.8, seed=3), SamplingParams(temperature=0.8, top_p=1e-50, seed=3)]
    assert sample(batch, params, [0, 0])[1] == 1


def test_top_k_excludes_the_tail():
    logits = logits_of(0.4, 0.35, 0.25)
    drawn = {sample(logits, [SamplingParams(top_k=2, seed=s)], [0])[0] for s in range(200)}
    assert drawn == {0, 1}


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = logits_of(0.5, 0.3, 0.15, 0.05)
    drawn = {sample(logits, [SamplingParams(top_p=0.75, seed=s)], [0])[0] for s in range(300)}
    assert drawn == {0, 1}


def test_frequencies_follow_the_distribution():
    probs = [0.6, 0.3, 0.1]
    n = 3000
    counts = [0, 0, 0]
    for s in range(n):
        counts[sample(logits_of(*probs), [SamplingParams(seed=s)], [0])[0]] += 1
    for c, p in zip(counts, probs, strict=True):
        sigma = (n * p * (1 - p)) ** 0.5
        assert abs(c - n * p) < 5 * sigma


def test_noise_depends_on_seed_and_index_only():
    logits = torch.randn(1, 1000)
    p = SamplingParams(temperature=1.5, seed=1234)
    alone = sample(logits, [p], [7])
    other = torch.randn(3, 1000)
    batched = sample(torch.cat([other, logits]), [SamplingParams(seed=9)] * 3 + [p], [0, 1, 2, 7])
    assert batched[3] == alone[0]
    draws = {sample(logits, [p], [i])[0] for i in range(30)}
    assert len(draws) > 5  # different token indices draw different noise


def test_step_seed_is_stable_and_spread():
    assert step_seed(0, 0) == step_seed(0, 0)
    seeds = {step_seed(s, i) for s in range(50) for i in range(50)}
    assert len(seeds) == 2500
    assert all(0 <= x < 2**63 for x in seeds)
