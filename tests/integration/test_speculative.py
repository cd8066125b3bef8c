"""Speculative decoding (prompt lookup) changes no output: fp32 greedy and seeded requests give the same
tokens with it on and off, batched with requests that draft nothing (the full model: these are the
outputs checked against `transformers` elsewhere)."""

from __future__ import annotations

import pytest

from steadfast.wire.worker import AddRequest, SamplingParams
from tests.conftest import deterministic, load_deterministic

pytestmark = pytest.mark.integration

# Work where the answer repeats the question: copying, editing, extracting, code.
REPETITIVE = [
    "Repeat the following sentence exactly three times: The quick brown fox jumps over the lazy dog.",
    "Copy this list back to me, one per line: apples, bananas, cherries, dates, elderberries, figs, grapes.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "Rewrite the function above with a docstring.",
    "Fix the spelling in this text and return it: Teh weather was beautful and the chidren played all afternon.",
    "Extract the names from this sentence: Alice met Bob and Carol at the station, then Dave and Eve joined.",
    "Write this in capital letters: the lighthouse keeper logged the weather every hour of the long night.",
    "Write the numbers from one to twenty in words, separated by commas.",
    "Repeat after me, twice: to be or not to be, that is the question.",
]
FREE = ["Tell me a story about a dragon.", "Why is the sky blue?"]


def run(cfg, loaded, make_engine, params_of):
    engine = make_engine(cfg, loaded)
    texts = REPETITIVE + FREE
    reqs = [
        AddRequest(f"r{i}", loaded.tokenizer.encode_chat([{"role": "user", "content": t}]), params_of(i))
        for i, t in enumerate(texts)
    ]
    out = engine.generate(reqs)
    engine.blocks.check_integrity()
    return {rid: [t for o in outs for t in o.token_ids] for rid, outs in out.items()}, engine


GREEDY = lambda i: SamplingParams(36, 0.0, ignore_eos=True)  # noqa: E731
SEEDED = lambda i: SamplingParams(36, 0.8, top_p=0.95, seed=100 + i, ignore_eos=True)  # noqa: E731


@pytest.mark.parametrize(
    ("params_of", "attention"),
    [
        pytest.param(GREEDY, "kernel", id="greedy"),
        pytest.param(SEEDED, "kernel", id="seeded"),
        pytest.param(GREEDY, "torch", id="greedy-torch-attention"),
    ],
)
def test_outputs_are_the_same_with_speculation_on_and_off(
    fp32_config, fp32_model, make_engine, params_of, attention, monkeypatch
):
    """Verification rows go through the decode kernel where it runs (each row a decode of its own
    position), else through torch's batched verification group: both checked."""
    if attention == "torch":
        monkeypatch.setattr(fp32_model.model, "paged", None)
    elif fp32_model.model.paged is None:
        pytest.skip("the paged-attention kernel does not run here (no AVX-512 or no C compiler)")
    off, plain = run(fp32_config, fp32_model, make_engine, params_of)
    on_cfg = fp32_config.replace(speculative={"method": "ngram", "num_draft_tokens": 4})
    on, spec = run(on_cfg, fp32_model, make_engine, params_of)
    assert on == off
    # It really speculated: drafts verified and accepted, fewer request-steps for the same tokens.
    assert spec.spec.verify_steps >= 16 and spec.spec.accepted >= 16, vars(spec.spec)
    assert spec.spec.tokens_per_step > 1.1 and spec.spec.decode_steps < plain.spec.decode_steps


def test_speculation_changes_no_token_in_bf16_with_the_deterministic_mode(fp32_config, make_engine):
    """Issue 21: in the default dtype, with `model.deterministic`, a verified draft's row is computed as
    the same token decoded alone would be, so greedy and seeded outputs are the same bits with
    speculation on and off (without the mode, verification's rows go through other kernels)."""
    cfg = deterministic(fp32_config)
    loaded = load_deterministic(cfg)
    mixed = lambda i: GREEDY(i) if i % 2 == 0 else SEEDED(i)  # noqa: E731
    off, _ = run(cfg, loaded, make_engine, mixed)
    on, spec = run(cfg.replace(speculative={"method": "ngram", "num_draft_tokens": 4}), loaded, make_engine, mixed)
    assert on == off
    assert spec.spec.verify_steps >= 16 and spec.spec.accepted >= 16, vars(spec.spec)
