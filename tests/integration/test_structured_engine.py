"""Structured outputs in the engine (issue 50 §3, §6): every token a grammar's, the rows beside a
constrained one untouched, and a new owner that continues from delivered tokens (a takeover, a
migration) producing exactly the fault-free output — the grammar's state rebuilt from the tokens."""

from __future__ import annotations

import json

import jsonschema
import pytest

from steadfast.model.grammar import from_json_schema, from_regex
from steadfast.wire.worker import AddRequest, Resume, SamplingParams
from tests.conftest import PROMPTS

pytestmark = pytest.mark.integration

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "population": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"enum": ["big", "old", "coastal"]}, "minItems": 1, "maxItems": 2},
    },
    "required": ["city", "population", "tags"],
    "additionalProperties": False,
}


def run(engine, requests: list[AddRequest]) -> dict[str, tuple[list[int], str, str]]:
    """Each request's tokens, text and finish reason."""
    results = engine.generate(requests)
    return {
        rid: ([t for o in outs for t in o.token_ids], "".join(o.text for o in outs), str(outs[-1].finish_reason))
        for rid, outs in results.items()
    }


@pytest.fixture(scope="module")
def prompts(small_model):
    tok = small_model.tokenizer
    return [tok.encode_chat([{"role": "user", "content": f"{p} Answer in JSON."}]) for p in PROMPTS[:3]]


def test_a_json_schema_request_writes_valid_json_and_leaves_its_neighbours_alone(
    small_config, small_model, make_engine, prompts
):
    constrained = SamplingParams(max_tokens=80, temperature=0.0, grammar=from_json_schema(SCHEMA))
    sampled = SamplingParams(max_tokens=80, temperature=0.8, seed=3, grammar=from_json_schema(SCHEMA))
    plain = SamplingParams(max_tokens=24, temperature=0.0)
    alone = run(make_engine(small_config, small_model), [AddRequest("p", prompts[1], plain)])
    got = run(
        make_engine(small_config, small_model),
        [
            AddRequest("g", prompts[0], constrained),
            AddRequest("p", prompts[1], plain),
            AddRequest("s", prompts[2], sampled),
        ],
    )
    for rid in ("g", "s"):
        tokens, text, reason = got[rid]
        assert reason == "stop", (rid, text)
        jsonschema.validate(json.loads(text), SCHEMA)
    assert got["p"] == alone["p"]  # the plain request beside them: not one token changed


def test_a_regex_bounds_every_token(small_config, small_model, make_engine, prompts):
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=11, grammar=from_regex(r"(yes|no), [0-9]{1,3}"))
    _, text, reason = run(make_engine(small_config, small_model), [AddRequest("r", prompts[0], params)])["r"]
    assert reason == "stop"
    import re

    assert re.fullmatch(r"(yes|no), [0-9]{1,3}", text), text


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_new_owner_continues_the_grammar_from_the_delivered_tokens(
    small_config, small_model, make_engine, prompts, temperature
):
    """What a takeover, a migration or a `Last-Event-ID` resume does: the request continues on another
    engine from the tokens its client holds; the output is the fault-free one, token for token."""
    params = SamplingParams(max_tokens=60, temperature=temperature, seed=5, grammar=from_json_schema(SCHEMA))
    whole, text, _ = run(make_engine(small_config, small_model), [AddRequest("a", prompts[0], params)])["a"]
    jsonschema.validate(json.loads(text), SCHEMA)
    for cut in (1, len(whole) // 2, len(whole) - 2):
        resumed = AddRequest("a", prompts[0], params, resume=Resume(whole[:cut], 0))
        rest, _, _ = run(make_engine(small_config, small_model), [resumed])["a"]
        assert whole[:cut] + rest == whole, cut


def test_speculation_changes_nothing_under_a_grammar(small_config, small_model, make_engine, prompts):
    spec = small_config.replace(speculative={"method": "ngram", "num_draft_tokens": 4})
    params = SamplingParams(max_tokens=60, temperature=0.0, grammar=from_json_schema(SCHEMA))
    requests = [AddRequest(str(i), ids, params) for i, ids in enumerate(prompts)]
    assert run(make_engine(spec, small_model), requests) == run(make_engine(small_config, small_model), requests)
