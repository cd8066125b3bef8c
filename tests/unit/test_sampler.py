"""Sampler: greedy, filters, and noise that depends only on (seed, token index)."""

from __future__ import annotations

import pytest
import torch

from steadfast.wire.worker import SamplingParams
from steadfast.worker.core.sampler import adjust, logprobs_of, sample, step_seed

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


def test_adjust_applies_each_rule_to_its_row_alone():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0], [2.0, -1.0, 0.5, 1.0]])
    plain = SamplingParams(temperature=0.0)
    rep = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    out = adjust(logits, [plain, rep], [[0], [0, 1]], [[], [2]], eos=[3])
    assert out[0].tolist() == [2.0, -1.0, 0.5, 1.0] and logits[1, 0] == 2.0  # (no row changed in place)
    assert out[1].tolist() == [1.0, -2.0, 0.25, 1.0]  # prompt and output tokens: positive halved, negative doubled
    pf = SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25, logit_bias=((1, 3.0),))
    out = adjust(logits[:1], [pf], [[0, 0, 0]], [[2, 2, 3]], eos=[3])
    assert out[0].tolist() == [2.0, 2.0, 0.5 - 0.5 - 0.5, 1.0 - 0.5 - 0.25]  # output tokens only; bias added
    floor = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(1,))
    assert adjust(logits[:1], [floor], [[0]], [[0]], eos=[0])[0].tolist() == [float("-inf")] * 2 + [0.5, 1.0]
    assert adjust(logits[:1], [floor], [[0]], [[0, 2]], eos=[0])[0].tolist() == [2.0, -1.0, 0.5, 1.0]
    assert adjust(logits, [plain, plain], [[0], [0]], [[], []], eos=[3]) is logits  # (nothing asked: no copy)


def test_min_p_drops_what_is_far_below_the_likeliest():
    logits = logits_of(0.5, 0.3, 0.15, 0.05)
    drawn = {sample(logits, [SamplingParams(temperature=1.0, min_p=0.2, seed=s)], [0])[0] for s in range(200)}
    assert drawn == {0, 1, 2}  # 0.05 < 0.2 x 0.5: never; the others all drawn
    drawn = {sample(logits, [SamplingParams(temperature=1.0, seed=s)], [0])[0] for s in range(200)}
    assert drawn == {0, 1, 2, 3}


def test_logprobs_are_of_the_raw_row_and_only_where_asked():
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 3.0]])
    asked = SamplingParams(temperature=0.0, logprobs=2, logit_bias=((1, 50.0),))
    got = logprobs_of(logits, [SamplingParams(temperature=0.0), asked], [0, 1])
    ref = torch.log_softmax(logits[1], -1)
    assert got[0] is None
    assert got[1].logprob == float(ref[1])  # the token drawn (biased to it), at its raw probability
    assert got[1].top_ids == [2, 0] and got[1].top_logprobs == ref[[2, 0]].tolist()
    assert logprobs_of(logits[:1], [SamplingParams(logprobs=0)], [1])[0].top_ids == []
