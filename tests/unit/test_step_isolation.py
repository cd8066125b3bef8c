"""One request whose numbers the engine cannot hold fails alone; the requests sharing its steps carry on
token-exactly (the second line of defence behind the router's range checks)."""

from __future__ import annotations

import pytest

from steadfast.wire.worker import AddRequest, FinishReason, SamplingParams

pytestmark = pytest.mark.unit


def greedy(rid: str, ids: list[int]) -> AddRequest:
    return AddRequest(rid, ids, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))


def test_a_request_that_breaks_the_sampler_fails_alone(small_config, small_model, make_engine):
    tok = small_model.tokenizer
    prompts = [tok.encode(p) for p in ("The capital of France is", "def fibonacci(n):", "Once upon a time")]
    reference = make_engine(small_config, small_model).generate([greedy(f"r{i}", p) for i, p in enumerate(prompts)])

    engine = make_engine(small_config, small_model)
    # top_k past a C long: torch cannot build the step's top-k tensor (what the router now refuses).
    hostile = AddRequest("bad", prompts[0], SamplingParams(max_tokens=24, temperature=1.0, top_k=2**63, seed=1))
    got = engine.generate([greedy(f"r{i}", p) for i, p in enumerate(prompts)] + [hostile])

    (failed,) = got["bad"]
    assert failed.finish_reason == FinishReason.ERROR and "Overflow" in (failed.error or "")
    for rid, outs in reference.items():
        assert [t for o in got[rid] for t in o.token_ids] == [t for o in outs for t in o.token_ids]
        assert got[rid][-1].finish_reason == FinishReason.LENGTH
    assert not engine.requests and engine.blocks.num_free == engine.blocks.num_blocks


def test_a_failure_every_request_reproduces_is_raised(small_config, small_model, make_engine, monkeypatch):
    engine = make_engine(small_config, small_model)
    engine.add_request(greedy("r0", small_model.tokenizer.encode("Hi")))
    engine.add_request(greedy("r1", small_model.tokenizer.encode("Hello there")))
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "execute", broken)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    assert len(calls) == 3  # the step, then each request alone
    assert set(engine.requests) == {"r0", "r1"}  # (the worker's loop fails them all, as before)
