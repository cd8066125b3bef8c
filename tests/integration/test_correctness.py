"""fp32 greedy tokens are identical to transformers (same GGUF), however the engine batches them.

The reference runs one prompt at a time through `transformers` generate. The engine must produce the
same 32 tokens for each prompt alone, all eight together (different lengths in one batch), with
prefill cut into small chunks, and with so few KV blocks that requests get preempted and recomputed.
"""

from __future__ import annotations

import pytest
import torch

from steadfast.wire.worker import AddRequest, SamplingParams
from steadfast.worker.engine import Engine
from tests.conftest import PROMPTS

pytestmark = pytest.mark.integration

NEW_TOKENS = 32
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompt_ids(fp32_model):
    return [fp32_model.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(hf_model, prompt_ids):
    out = []
    for ids in prompt_ids:
        x = torch.tensor([ids])
        # An explicit mask: without one, generate treats the pad id (<|im_end|>) inside the prompt as padding.
        gen = hf_model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        out.append(gen[0, len(ids) :].tolist())
    return out


def run(engine, prompt_ids, params=GREEDY):
    results = engine.generate([AddRequest(str(i), ids, params) for i, ids in enumerate(prompt_ids)])
    return [[t for o in results[str(i)] for t in o.token_ids] for i in range(len(prompt_ids))]


def test_reference_is_not_degenerate(reference):
    assert len({tuple(r) for r in reference}) == len(PROMPTS)
    assert all(len(r) == NEW_TOKENS for r in reference)


def test_one_at_a_time_matches_transformers(fp32_config, fp32_model, make_engine, prompt_ids, reference):
    for i, ids in enumerate(prompt_ids):
        engine = make_engine(fp32_config, fp32_model)
        assert run(engine, [ids]) == [reference[i]], f"prompt {i}"


@pytest.mark.parametrize("attention", ["kernel", "torch"])
def test_all_batched_together_match_transformers(
    attention, fp32_config, fp32_model, make_engine, prompt_ids, reference, monkeypatch
):
    """Both decode attention paths: the in-place kernel (the default where it builds) and torch's gather."""
    if attention == "torch":
        monkeypatch.setattr(fp32_model.model, "paged", None)
    elif fp32_model.model.paged is None:
        pytest.skip("the paged-attention kernel does not run here (no AVX-512 or no C compiler)")
    engine = make_engine(fp32_config, fp32_model)
    assert run(engine, prompt_ids) == reference
    engine.blocks.check_integrity()
    assert engine.blocks.num_used == 0


def test_chunked_prefill_matches(fp32_config, fp32_model, make_engine, prompt_ids, reference):
    cfg = fp32_config.replace(scheduler={"max_num_batched_tokens": 24, "max_prefill_chunk": 7})
    engine = make_engine(cfg, fp32_model)
    assert run(engine, prompt_ids) == reference
    assert engine.steps > NEW_TOKENS + max(len(p) for p in prompt_ids) // 24


def test_preemption_and_recompute_match(fp32_config, fp32_model, make_engine, prompt_ids, reference):
    # Room for roughly three requests at once: the rest must wait or be preempted and recomputed.
    cfg = fp32_config.replace(cache={"num_blocks": 16, "enable_prefix_caching": False})
    engine = make_engine(cfg, fp32_model)
    preempted = []
    original = engine.scheduler._preempt

    def spy(request):
        preempted.append(request.request_id)
        original(request)

    engine.scheduler._preempt = spy
    assert run(engine, prompt_ids) == reference
    assert preempted, "the test must actually preempt something"
    engine.blocks.check_integrity()


def test_swap_preemption_matches(fp32_config, fp32_model, make_arena, make_tier_file, prompt_ids, reference):
    """The arena as small as above, with a host offload tier: preempted requests are swapped out and
    fetched back instead of recomputed, and every output is still the reference's."""
    cfg = fp32_config.replace(cache={"num_blocks": 16, "enable_prefix_caching": False, "offload_tier": "host"})
    arena = make_arena(cfg, fp32_model)
    engine = Engine(cfg, fp32_model, arena, tier=make_tier_file("host", arena, 32))
    assert run(engine, prompt_ids) == reference
    assert engine.scheduler.swap_preemptions > 0 and engine.offload.fetched > 0
    engine.blocks.check_integrity()
    engine.offload.close()


def test_prefix_cache_hit_gives_same_tokens(fp32_config, fp32_model, make_engine, prompt_ids, reference):
    engine = make_engine(fp32_config, fp32_model)
    assert run(engine, prompt_ids[:1]) == reference[:1]
    results = engine.generate([AddRequest("again", prompt_ids[0], GREEDY)])
    assert [t for o in results["again"] for t in o.token_ids] == reference[0]
    assert results["again"][0].num_cached_tokens >= 16  # the shared system prompt came from the cache
