"""The offload tier at the engine level (no pool: the tier's slots are known to the engine alone):
a sequence's blocks written out, evicted from the arena and fetched back give the same tokens, on a
host (shared memory) and a disk tier; swap preemption keeps what recompute preemption throws away."""

from __future__ import annotations

import pytest

from steadfast.wire.worker import AddRequest, SamplingParams
from steadfast.worker.engine import Engine
from tests.conftest import PROMPTS

pytestmark = pytest.mark.unit

GREEDY = SamplingParams(24, 0.0, ignore_eos=True)


def tokens(results, rid):
    return [t for o in results[rid] for t in o.token_ids]


def drain(engine: Engine) -> None:
    while engine.has_work:
        engine.step()


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_a_sequence_written_out_evicted_and_fetched_back_continues_identically(
    kind, small_config, small_model, make_arena, make_tier_file
):
    cfg = small_config.replace(cache={"num_blocks": 24, "offload_tier": kind, "offload_blocks": 16})
    tok = small_model.tokenizer
    long_prompt = tok.encode_chat([{"role": "user", "content": PROMPTS[7] + " " + PROMPTS[5]}])
    other = tok.encode_chat([{"role": "user", "content": " ".join(PROMPTS[1:]) * 4}])[:320]
    assert 16 * 24 - len(other) < len(long_prompt)  # it cannot fit beside the first one's blocks
    first = AddRequest("a", long_prompt, GREEDY)
    reference = Engine(cfg.replace(cache={"offload_tier": "none"}), small_model, make_arena(cfg, small_model))
    want = tokens(reference.generate([first]), "a")

    arena = make_arena(cfg, small_model)
    engine = Engine(cfg, small_model, arena, tier=make_tier_file(kind, arena, 16))
    assert tokens(engine.generate([first]), "a") == want
    drain(engine)
    # Another long request needs every block: the first one's cached blocks are evicted from the arena,
    # into the tier.
    engine.generate([AddRequest("b", other, SamplingParams(8, 0.0, ignore_eos=True))])
    full = (len(long_prompt) - 1) // 16
    assert engine.offload.written >= full - 1
    in_arena = len(engine.blocks.match_prefix(long_prompt))  # (the shared system prompt's may stay)
    assert in_arena < full - 2, "the first prompt's blocks should be gone from the arena"
    again = engine.generate([AddRequest("a2", long_prompt, GREEDY)])
    assert tokens(again, "a2") == want
    assert engine.offload.fetched == full - in_arena
    assert again["a2"][0].num_cached_tokens == 16 * full  # the whole prompt came back; nothing recomputed
    engine.blocks.check_integrity()
    engine.offload.close()


@pytest.mark.parametrize("mode", ["fp32", "bf16-deterministic"])
def test_swap_preemption_keeps_the_kv_and_outputs_stay_exact(mode, request, make_arena, make_tier_file):
    """In fp32, and in bf16 with `model.deterministic` (issue 21: without it a recomputed tail's K/V
    differ from the decoded ones in their last bits, and tokens may follow)."""
    prefix = "small" if mode == "fp32" else "small_deterministic"
    small_config = request.getfixturevalue(f"{prefix}_config")
    small_model = request.getfixturevalue(f"{prefix}_model")
    tok = small_model.tokenizer
    reqs = [
        AddRequest(f"r{i}", tok.encode_chat([{"role": "user", "content": p}]), SamplingParams(40, 0.8, seed=7 + i))
        for i, p in enumerate(PROMPTS)
    ]
    big = small_config.replace(cache={"num_blocks": 256})
    reference = Engine(big, small_model, make_arena(big, small_model)).generate(reqs)

    small = small_config.replace(cache={"num_blocks": 20, "enable_prefix_caching": False})
    plain = Engine(small, small_model, make_arena(small, small_model))
    got = plain.generate(reqs)
    assert {r: tokens(got, r) for r in got} == {r: tokens(reference, r) for r in reference}
    assert plain.scheduler.recompute_preemptions > 0 and plain.scheduler.swap_preemptions == 0

    swap_cfg = small.replace(cache={"offload_tier": "host"})
    arena = make_arena(swap_cfg, small_model)
    engine = Engine(swap_cfg, small_model, arena, tier=make_tier_file("host", arena, 64))
    got = engine.generate(reqs)
    assert {r: tokens(got, r) for r in got} == {r: tokens(reference, r) for r in reference}
    s = engine.scheduler
    assert s.swap_preemptions > 0, "the arena is too small for the batch: something must be swapped"
    preemptions = s.swap_preemptions + s.recompute_preemptions
    # What a swap leaves to recompute is the tail of the last, partial block.
    assert s.recomputed_tokens <= preemptions * small.cache.block_size
    assert s.recomputed_tokens < plain.scheduler.recomputed_tokens / 2
    assert engine.offload.fetched > 0
    engine.blocks.check_integrity()
    engine.offload.close()
