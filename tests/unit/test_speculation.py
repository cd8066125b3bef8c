"""Speculative decoding's parts (worker/core/speculation.py) and the engine's rollback of rejected drafts:
block tables, refcounts, seals and the ledger's rows stay what they would be without speculation."""

from __future__ import annotations

import os

import pytest

from steadfast.config import SpeculativeConfig
from steadfast.kv.arena.arena import map_arena
from steadfast.kv.integrity import check_node
from steadfast.kv.ledger.interface import BlockState
from steadfast.kv.pool.client import PoolClient
from steadfast.wire.worker import AddRequest, SamplingParams
from steadfast.worker.core.request import Request
from steadfast.worker.core.speculation import PAUSE_TOKENS, NgramIndex, Speculator, accepted_prefix, best_length
from steadfast.worker.engine import Engine
from steadfast.worker.kv.ledger_sync import LedgerSync
from tests.chaos.node import Node

pytestmark = pytest.mark.unit


def test_the_longest_suffix_match_proposes_what_followed_its_latest_occurrence():
    index = NgramIndex(1, 3)
    ids = [5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7]
    # "6 7" ended twice before; the latest was followed by 9, 2, 6
    assert index.propose(ids, 3) == [9, 2, 6]
    ids += [9]  # now "6 7 9" matches (n = 3) once, at its only earlier occurrence
    assert index.propose(ids, 2) == [2, 6]
    assert index.propose([1, 2, 3], 4) == []  # nothing repeats
    assert NgramIndex(2, 2).propose([4, 4], 3) == []  # the suffix is never its own match
    assert NgramIndex(1, 1).propose([4, 4], 3) == [4]  # ...but an earlier "4" is, with one token after it


def test_accepted_prefix_stops_at_the_first_mismatch():
    assert accepted_prefix([1, 2, 3], [1, 2, 3, 4]) == 3
    assert accepted_prefix([1, 2, 3], [1, 5, 3, 4]) == 1
    assert accepted_prefix([1], [2, 3]) == 0
    assert accepted_prefix([], [7]) == 0


def test_the_draft_length_follows_acceptance_and_cost():
    assert best_length(0.9, 8, 0.05) == 8  # cheap positions, mostly right: all of them
    assert 1 <= best_length(0.6, 8, 0.15) <= 3
    assert best_length(0.1, 8, 0.15) == 0  # a plain step buys more
    assert best_length(0.9, 8, 2.0) == 0  # a position costs two steps: never worth it
    assert best_length(0.6, 8, 0.05) > best_length(0.6, 8, 0.3)


def test_a_request_whose_drafts_keep_failing_pauses_and_probes_with_one_draft():
    spec = Speculator(SpeculativeConfig(method="ngram", num_draft_tokens=4, ngram_min=1, ngram_max=2))
    ids = [1, 2, 3, 1, 2, 3, 1, 2]
    first = spec.drafts("r", ids, 4, room=8)
    assert 1 <= len(first) <= 3 and first == [3, 1, 2][: len(first)]
    for _ in range(6):
        spec.verified("r", 2, 0)
    assert spec.drafts("r", ids, 4, room=8) == []  # not worth it: paused...
    assert spec.drafts("r", ids, 4 + PAUSE_TOKENS - 1, room=8) == []
    assert spec.drafts("r", ids, 4 + PAUSE_TOKENS, room=8) == [3]  # ...then one draft, a probe
    spec.verified("r", 1, 0)
    assert spec.drafts("r", ids, 5 + PAUSE_TOKENS, room=8) == []  # wrong again: a pause twice as long
    assert spec.drafts("r", ids, 5 + 3 * PAUSE_TOKENS - 1, room=8) == []
    assert spec.drafts("r", ids, 5 + 3 * PAUSE_TOKENS, room=8) == [3]
    # Right drafts make it draft more; the worker's switch and no room stop all drafts.
    spec.drafts("s", ids, 10, room=8)
    for _ in range(10):
        spec.verified("s", 4, 4)
    assert spec.drafts("s", ids, 10, room=8) == [3, 1, 2]
    assert spec.drafts("s", ids, 10, room=0) == []
    spec.enabled = False
    assert spec.drafts("s", ids, 10, room=8) == []


def test_the_cost_of_a_verified_position_is_learned_from_the_workers_steps():
    spec = Speculator(SpeculativeConfig(method="ngram"))
    for _ in range(50):
        spec.timed(0, 0.100)
        spec.timed(4, 0.300)  # four positions doubled the step: each costs half a step
    assert spec.row_cost == pytest.approx(0.5, abs=0.02)


def test_rejected_drafts_across_a_block_boundary_leave_blocks_seals_and_ledger_as_without_them(
    tmp_path, small_config, small_model, make_engine
):
    """An oracle drafter proposes, each step, the true next tokens for some positions and then wrong
    ones, so that every verification rejects part of its drafts, often past a block boundary. After
    every step: the table covers exactly the computed tokens, nothing is named or sealed but full blocks
    of confirmed tokens, refcounts agree, and the ledger agrees with the arena. The output is the one
    without speculation."""
    cfg = small_config.replace(
        cache={"num_blocks": 64, "block_size": 4},
        speculative={"method": "ngram", "num_draft_tokens": 5},
        fault_recovery={"kv_cache": {"snapshot_interval_steps": 1}},  # a checkpoint row every step
    )
    ids = small_model.tokenizer.encode_chat([{"role": "user", "content": "Count from one to ten."}])
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    want = [t for o in make_engine(cfg, small_model).generate([AddRequest("r", ids, params)])["r"] for t in o.token_ids]

    node = Node(tmp_path, cfg)
    node.start_pool()
    try:
        pool = PoolClient(node.pool_address, "worker0")
        reply = pool.register(os.getpid())
        arena = map_arena(reply)
        sync = LedgerSync(cfg, pool, reply.ledger_url, arena)
        engine = Engine(cfg, small_model, arena, source=pool, sync=sync)
        drafted: list[int] = []

        def oracle(request: Request, budget: int) -> list[int]:
            done = len(request.output_ids)
            if not done or done + 1 >= params.max_tokens:
                return []
            right = len(drafted) % 4  # 0..3 right drafts, then wrong ones
            drafts = [*want[done : done + right], *[(t + 1) % 1000 for t in want[done + right : done + 5]]]
            drafts = drafts[: params.max_tokens - done - 1]
            drafted.append(len(drafts))
            return drafts

        engine.scheduler.drafter = oracle
        engine.add_request(AddRequest("r", ids, params))
        got: list[int] = []
        crossed = 0
        while engine.has_work:
            before, verifies = (engine.requests["r"].num_computed if "r" in engine.requests else 0), len(drafted)
            for out in engine.step():
                got += out.token_ids
            r = engine.requests.get("r")
            if r is None:
                break
            bs = engine.blocks.block_size
            table = engine.blocks.block_table("r")
            assert len(table) == engine.blocks.blocks_needed(r.num_computed), "rejected drafts' blocks kept"
            if len(drafted) > verifies:  # drafts written up to before + k: a block past the kept ones?
                crossed += (before + drafted[-1]) // bs > (r.num_computed - 1) // bs
            engine.blocks.check_integrity()
            for i, block_id in enumerate(table):
                block = engine.blocks.blocks[block_id]
                full = (i + 1) * bs <= r.num_computed
                assert (block.hash is not None) == full, f"block {i} named={block.hash is not None}, full={full}"
                if full:
                    assert block.tokens == tuple(r.all_ids[i * bs : (i + 1) * bs])
            ledger = node.ledger()
            sealed = {b.block_id for b in ledger.blocks() if b.state == BlockState.SEALED}
            assert sealed == set(table[: r.num_computed // bs]), "sealed: exactly the full blocks"
            assert check_node(ledger, node.arena(), {"worker0": {"r": table}}) == []
            assert ledger.request("r").generated_ids == r.output_ids[: len(ledger.request("r").generated_ids)]
        assert got == want
        assert engine.spec.verify_steps >= 8 and 0 < engine.spec.accepted < engine.spec.drafted
        assert crossed >= 3, "no rejected draft crossed a block boundary"
        sync.close(pool, engine.blocks.held_blocks)
    finally:
        node.stop()


def test_a_request_that_opts_out_never_drafts(small_config, small_model, make_engine):
    cfg = small_config.replace(speculative={"method": "ngram"})
    ids = small_model.tokenizer.encode("one two three four one two three four one two three four one two")
    for allowed in (False, True):
        engine = make_engine(cfg, small_model)
        engine.generate([AddRequest("r", ids, SamplingParams(24, 0.0, ignore_eos=True, speculative=allowed))])
        assert (engine.spec.verify_steps > 0) is allowed
