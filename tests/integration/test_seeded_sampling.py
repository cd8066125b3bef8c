"""Seeded sampling: the same request gives the same tokens across runs and batch companions."""

from __future__ import annotations

import pytest

from steadfast.wire.worker import AddRequest, SamplingParams
from tests.conftest import PROMPTS

pytestmark = pytest.mark.integration


def tokens(engine, requests):
    out = engine.generate(requests)
    return {rid: [t for o in outs for t in o.token_ids] for rid, outs in out.items()}


def test_same_seed_same_tokens_across_runs_and_companions(small_config, small_model, make_engine):
    tok = small_model.tokenizer
    ids = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=20261129, ignore_eos=True)
    target = AddRequest("target", ids[1], params)

    alone = tokens(make_engine(small_config, small_model), [target])["target"]
    again = tokens(make_engine(small_config, small_model), [target])["target"]
    assert alone == again

    companions = [
        AddRequest(f"c{i}", p, SamplingParams(max_tokens=10 + 3 * i, temperature=1.0, seed=i))
        for i, p in enumerate(ids)
        if i != 1
    ]
    crowded = tokens(make_engine(small_config, small_model), [*companions[:3], target, *companions[3:]])["target"]
    assert crowded == alone

    # Chunked differently and with less KV, still the same.
    tight = small_config.replace(scheduler={"max_num_batched_tokens": 32, "max_prefill_chunk": 9})
    assert tokens(make_engine(tight, small_model), [*companions, target])["target"] == alone


def test_different_seeds_give_different_tokens(small_config, small_model, make_engine):
    tok = small_model.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": "Tell me a story about a dragon."}])
    runs = {
        s: tuple(
            tokens(
                make_engine(small_config, small_model),
                [AddRequest("r", ids, SamplingParams(max_tokens=16, temperature=1.0, seed=s))],
            )["r"]
        )
        for s in range(4)
    }
    assert len(set(runs.values())) > 1
