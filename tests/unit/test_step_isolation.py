"""One request whose numbers the engine cannot hold fails alone; the requests sharing its steps carry on
token-exactly (the second line of defence behind the router's range checks)."""

from __future__ import annotations

import pytest

from steadfast.wire.worker import AddRequest, FinishReason, Handoff, Resume, SamplingParams

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


def test_a_handoff_naming_blocks_held_here_is_computed_afresh_and_the_worker_goes_on(
    small_config, small_model, make_engine
):
    """A handoff whose blocks this worker holds already (the soak's seed 7: adopted for another request
    before the handoff's claim) cannot be trusted: that request is computed here from what its client
    holds, token-exactly, and the request holding the blocks goes on; nothing raises out of the loop."""
    tok = small_model.tokenizer
    first, second = tok.encode("The capital of France is"), tok.encode("Once upon a time, in a land far away,")
    reference = make_engine(small_config, small_model).generate([greedy("a", first), greedy("b", second)])
    want_b = [t for o in reference["b"] for t in o.token_ids]

    engine = make_engine(small_config, small_model)
    engine.add_request(greedy("a", first))
    got: dict[str, list[int]] = {"a": [], "b": []}
    for out in engine.step():
        got[out.request_id] += out.token_ids
    held = engine.blocks.block_table("a")
    assert held
    client_has = want_b[:3]
    handoff = Handoff(0, block_ids=list(held), num_computed=len(second) + len(client_has) - 1, path="same_node")
    engine.add_request(
        AddRequest("b", second, greedy("b", second).params, handoff=handoff, resume=Resume(client_has, 0))
    )
    while engine.has_work:
        for out in engine.step():
            got[out.request_id] += out.token_ids
    assert got["b"] == want_b[3:]
    assert got["a"] == [t for o in reference["a"] for t in o.token_ids]
    engine.blocks.check_integrity()


def test_a_resume_of_a_request_still_running_here_takes_it_over_token_exactly(small_config, small_model, make_engine):
    """The soak's seed 7: a restarted router stopped the run its ledger named (another worker's) and
    placed the resume where the request still ran. The resume must win (that client's stream goes on
    from what it holds), not fail with "already in flight"; a plain add of a live id stays refused."""
    tok = small_model.tokenizer
    prompt, other = tok.encode("The capital of France is"), tok.encode("Once upon a time")
    reference = make_engine(small_config, small_model).generate([greedy("a", prompt), greedy("b", other)])
    want = [t for o in reference["a"] for t in o.token_ids]

    engine = make_engine(small_config, small_model)
    engine.add_request(greedy("a", prompt))
    engine.add_request(greedy("b", other))
    got: dict[str, list[int]] = {"a": [], "b": []}
    for _ in range(6):  # the run goes past what the client will say it holds
        for out in engine.step():
            got[out.request_id] += out.token_ids
    assert len(got["a"]) > 3
    engine.add_request(greedy("a", prompt))  # (a new request reusing a live id: refused, the run untouched)
    (refused,) = engine.take_pending()
    assert refused.finish_reason is FinishReason.ERROR and "already in flight" in (refused.error or "")
    assert "a" in engine.requests

    resumed: list = []
    engine.add_request(AddRequest("a", prompt, greedy("a", prompt).params, resume=Resume(want[:3], 0)))
    assert not engine.take_pending()  # nothing refused
    while engine.has_work:
        for out in engine.step():
            if out.request_id == "a":
                resumed.append(out)
            else:
                got["b"] += out.token_ids
    assert resumed[0].index == 3
    assert [t for o in resumed for t in o.token_ids] == want[3:]
    assert resumed[-1].finish_reason is FinishReason.LENGTH
    assert got["b"] == [t for o in reference["b"] for t in o.token_ids]
    assert not engine.requests and engine.blocks.num_free == engine.blocks.num_blocks
