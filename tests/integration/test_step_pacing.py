"""Prefill chunks paced by measured step cost: while a stream decodes, a burst of prompts is spread over
steps of at most the target (never below the floor), and the tokens are the same as unpaced."""

from __future__ import annotations

import pytest

from steadfast.wire.worker import AddRequest, SamplingParams
from steadfast.worker.main import warm_up
from tests.conftest import PROMPTS

pytestmark = pytest.mark.integration

FLOOR = 16


def run(engine, prompts: list[list[int]]) -> tuple[dict[str, list[int]], list[int]]:
    """One stream first, then the burst joins while it decodes; every step's prefill tokens taken
    while some request decoded."""
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    schedule, paced = engine.scheduler.schedule, []

    def watched():
        step = schedule()
        if step.decodes:
            paced.append(sum(n for _, n in step.prefills))
        return step

    engine.scheduler.schedule = watched
    tokens: dict[str, list[int]] = {}

    def step() -> None:
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)

    engine.add_request(AddRequest("stream", prompts[0], params))
    for _ in range(3):
        step()
    for i, ids in enumerate(prompts[1:]):
        engine.add_request(AddRequest(f"burst{i}", ids, params))
    while engine.has_work:
        step()
    return tokens, paced


def test_a_burst_beside_a_stream_is_paced_and_changes_no_token(small_model, make_engine, small_config):
    tok = small_model.tokenizer
    prompts = [tok.encode(p * 3) for p in PROMPTS[:5]]
    unpaced = make_engine(small_config.replace(scheduler={"decode_step_target_ms": 0}), small_model)
    want, seen = run(unpaced, prompts)
    assert max(seen) > FLOOR * 2  # unpaced, the burst's prompts came in big chunks beside the stream

    # A target no step can meet: beside the decodes, prefills get the floor and no more.
    cfg = small_config.replace(scheduler={"decode_step_target_ms": 0.001, "prefill_floor_tokens": FLOOR})
    engine = make_engine(cfg, small_model)
    warm_up(engine)  # the scheduler knows what a step costs before the first request
    assert engine.scheduler.cost.line() is not None
    got, seen = run(engine, prompts)
    assert max(seen) == FLOOR
    assert got == want
