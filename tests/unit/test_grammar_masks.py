"""Grammar masks applied to a step's logits rows (worker/core/grammar.py): the allowed tokens keep their
logits bit for bit, the rest are -inf, whatever rows of the step are constrained."""

from __future__ import annotations

import pytest
import torch

from steadfast.wire.worker import SamplingParams
from steadfast.worker.core.grammar import StepMasks
from steadfast.worker.core.request import Request

pytestmark = pytest.mark.unit

VOCAB = 70  # (not a multiple of 32: the last word's spare bits must not leak)


def bits_of(allowed: list[set[int]]) -> torch.Tensor:
    words = torch.zeros(len(allowed), (VOCAB + 31) // 32, dtype=torch.int64)
    for i, ids in enumerate(allowed):
        for t in ids:
            words[i, t // 32] |= 1 << (t % 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # (int32 words, as llguidance's)


def request(rid: str, **params) -> Request:
    return Request(rid, [1, 2], SamplingParams(**params))


@pytest.mark.parametrize("rows", [["a", "b", "c"], ["a", "b"], ["p", "a", "q", "c"], ["c", "a"]])
def test_only_allowed_tokens_survive_in_every_shape_of_step(rows):
    allowed = {"a": {0, 5, 31, 32, 69}, "b": {3}, "c": set(range(40, 70))}
    masks = StepMasks({"a": 0, "b": 1, "c": 2}, bits_of(list(allowed.values())), VOCAB)
    logits = torch.randn(len(rows), VOCAB)
    out = masks.apply(logits, [request(r) for r in rows])
    assert out.shape == logits.shape
    for i, rid in enumerate(rows):
        if rid not in allowed:
            assert torch.equal(out[i], logits[i])  # an unconstrained row: untouched
            continue
        keep = torch.tensor([t in allowed[rid] for t in range(VOCAB)])
        assert torch.equal(out[i][keep], logits[i][keep])
        assert bool(torch.isneginf(out[i][~keep]).all())


def test_a_row_min_tokens_left_without_a_token_gets_the_grammar_s_back():
    masks = StepMasks({"a": 0}, bits_of([{2}]), VOCAB)  # the grammar allows EOS (2) alone
    logits = torch.randn(1, VOCAB)
    logits[0, 2] = float("-inf")  # min_tokens barred it
    out = masks.apply(logits, [request("a", min_tokens=5)])
    assert int(out[0].argmax()) == 2 and not bool(torch.isneginf(out[0, 2]))
