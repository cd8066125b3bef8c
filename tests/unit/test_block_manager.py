"""Block manager: exact block ids, refcounts, prefix-cache hits and eviction order."""

from __future__ import annotations

import pytest

from steadfast.worker.core.block_manager import BlockManager
from tests.unit.fake_pool import FakePool

pytestmark = pytest.mark.unit

BS = 4


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_allocate_takes_lowest_free_ids_in_order():
    bm = BlockManager(8, BS)
    assert bm.allocate("a", 9) == [0, 1, 2]
    assert bm.allocate("b", 4) == [3]
    assert bm.block_table("a") == [0, 1, 2]
    assert [b.ref_count for b in bm.blocks] == [1, 1, 1, 1, 0, 0, 0, 0]
    assert bm.allocate("a", 13) == [4]  # grows by one block
    assert bm.allocate("a", 13) == []  # already covered
    assert bm.num_free == 3
    bm.check_integrity()


def test_no_room_returns_none_and_changes_nothing():
    bm = BlockManager(4, BS)
    assert bm.allocate("a", 12) == [0, 1, 2]
    assert bm.allocate("b", 8) is None
    assert bm.block_table("b") == []
    assert bm.num_free == 1
    bm.check_integrity()


def test_prefix_hit_shares_blocks_and_counts_refs():
    bm = BlockManager(8, BS)
    prompt = toks(100, 10)  # two full blocks + 2 tokens
    bm.allocate("a", 10)
    bm.commit("a", prompt, 10)
    hits = bm.match_prefix(prompt + [7, 8])
    assert hits == [0, 1]
    assert bm.allocate("b", 12, prefix=hits) == [3]
    assert bm.block_table("b") == [0, 1, 3]
    assert [bm.blocks[i].ref_count for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    bm.check_integrity()


def test_prefix_match_leaves_last_token_and_checks_chain():
    bm = BlockManager(8, BS)
    prompt = toks(0, 8)
    bm.allocate("a", 8)
    bm.commit("a", prompt, 8)
    # Exactly two full blocks: the last one is not a hit, so one token is left to compute.
    assert bm.match_prefix(prompt) == [0]
    # Same second block after a different first block: the chained hash does not match.
    assert bm.match_prefix([9, 9, 9, 9] + prompt[4:] + [1]) == []


def test_freed_cached_blocks_stay_findable_until_reused():
    bm = BlockManager(4, BS)
    prompt = toks(0, 9)
    bm.allocate("a", 9)
    bm.commit("a", prompt, 9)
    bm.free("a")
    assert bm.num_free == 4
    assert bm.match_prefix(prompt) == [0, 1]
    # Unhashed block 2 goes first, then the never-used block 3, then cached blocks tail-first: 1, then 0.
    assert bm.allocate("x", 4) == [2]
    assert bm.allocate("y", 4) == [3]
    assert bm.allocate("z", 4) == [1]
    assert bm.match_prefix(prompt) == [0]  # block 1 was evicted, block 0 is still cached
    assert [e.kind for e in bm.events] == ["stored", "stored", "removed"]
    bm.check_integrity()


def test_free_is_tail_first_for_eviction():
    bm = BlockManager(6, BS)
    prompt = toks(0, 13)
    bm.allocate("a", 13)
    bm.commit("a", prompt, 13)  # blocks 0,1,2 hashed; 3 partial
    bm.free("a")
    # Free order: the partial block is handed out first, then the untouched 4,5, then 2, 1, 0.
    taken = [bm.allocate(f"r{i}", 4)[0] for i in range(6)]
    assert taken == [3, 4, 5, 2, 1, 0]


def test_shared_block_is_freed_only_when_last_reference_drops():
    bm = BlockManager(6, BS)
    prompt = toks(0, 9)
    bm.allocate("a", 9)
    bm.commit("a", prompt, 9)
    bm.allocate("b", 9, prefix=bm.match_prefix(prompt))
    bm.free("a")
    assert [bm.blocks[i].ref_count for i in (0, 1)] == [1, 1]
    assert bm.num_free == 6 - 3  # b holds 0, 1 and its own third block
    bm.free("b")
    assert bm.num_free == 6
    bm.check_integrity()


def test_prefix_caching_off_never_hits():
    bm = BlockManager(6, BS, enable_prefix_caching=False)
    prompt = toks(0, 9)
    bm.allocate("a", 9)
    bm.commit("a", prompt, 9)
    assert bm.match_prefix(prompt) == []


def test_integrity_check_catches_a_broken_refcount():
    bm = BlockManager(4, BS)
    bm.allocate("a", 4)
    bm.blocks[0].ref_count = 2
    with pytest.raises(AssertionError):
        bm.check_integrity()


def test_pool_backed_manager_grants_in_batches_and_returns_surplus():
    pool = FakePool(40)
    bm = BlockManager(40, BS, source=pool, grant_batch=3)
    assert bm.num_free == 0
    assert bm.allocate("a", 4 * BS) == [0, 1, 2, 3]  # ids come from the pool
    assert pool.calls[0] == ("grant", [0, 1, 2, 3])  # asked for what it needed (more than a batch)
    assert bm.allocate("b", BS) == [4]
    assert pool.calls[1] == ("grant", [4, 5, 6])  # then a whole batch
    bm.check_integrity()
    for i in range(5):
        bm.allocate(f"c{i}", 3 * BS)
    for rid in ["a", "b", *(f"c{i}" for i in range(5))]:
        bm.free(rid)
    released = [ids for kind, ids in pool.calls if kind == "release"]
    assert released and bm.num_free <= 4 * 3  # no more than four batches kept spare
    bm.check_integrity()


def test_pool_backed_manager_prefers_a_grant_over_evicting_the_cache():
    pool = FakePool(40)
    bm = BlockManager(40, BS, source=pool, grant_batch=2)
    prompt = toks(0, 9)
    bm.allocate("a", 9)
    bm.commit("a", prompt, 9)
    bm.free("a")
    grants_before = sum(1 for kind, _ in pool.calls if kind == "grant")
    bm.allocate("b", 2 * BS)
    assert sum(1 for kind, _ in pool.calls if kind == "grant") > grants_before
    assert len(bm.match_prefix(prompt)) == 2  # the cached blocks were not evicted


def sharing_prefix(pool: FakePool) -> tuple[BlockManager, list[int]]:
    """A pool-backed manager where request "b" shares request "a"'s two full prompt blocks."""
    bm = BlockManager(16, BS, source=pool, grant_batch=4)
    prompt = toks(100, 10)  # two full blocks + 2 tokens
    bm.allocate("a", 10)
    bm.commit("a", prompt, 10)
    bm.allocate("b", 10, prefix=bm.match_prefix(prompt))
    return bm, prompt


def test_hand_over_moves_a_request_and_copies_only_blocks_another_request_shares():
    pool = FakePool(16)
    p, prompt = sharing_prefix(pool)
    d = BlockManager(16, BS, source=pool, grant_batch=4)
    a_table = p.block_table("a")
    copies_made: list[tuple[int, int]] = []
    seen: list[tuple[list[int], list[tuple[int, bytes]]]] = []

    handed = p.hand_over("a", lambda s, t: copies_made.append((s, t)), lambda ids, c: seen.append((ids, c)))
    assert handed is not None and len(handed) == 3
    assert [s for s, _ in copies_made] == a_table[:2]  # the shared full blocks were copied...
    assert handed[:2] == [t for _, t in copies_made] and handed[2] == a_table[2]  # ...the partial one moved
    assert seen == [(handed, [(t, p.blocks[s].hash) for s, t in copies_made])]
    assert p.block_table("a") == [] and set(handed).isdisjoint(p.held_blocks)
    assert [p.blocks[b].ref_count for b in a_table[:2]] == [1, 1]  # still "b"'s
    assert [e.kind for e in p.events if e.block_id in handed] == ["released"] * 3
    p.check_integrity()

    d.receive("a", prompt, handed, 10, sealed=set(handed[:2]))
    assert d.block_table("a") == handed
    assert d.match_prefix(prompt + [1]) == handed[:2]  # full blocks are in the receiver's prefix cache
    assert not [e for e in d.events if e.kind == "stored"]  # sealed by the giver already: nothing to seal
    d.check_integrity()


def test_a_refused_hand_over_changes_nothing():
    p, _ = sharing_prefix(FakePool(16))
    before = (p.block_table("a"), [b.ref_count for b in p.blocks], [b.hash for b in p.blocks])

    def refuse(ids, copies):
        raise RuntimeError("the receiver is gone")

    with pytest.raises(RuntimeError):
        p.hand_over("a", lambda s, t: None, refuse)
    # (Blocks granted for the copies stay here, free.)
    assert (p.block_table("a"), [b.ref_count for b in p.blocks], [b.hash for b in p.blocks]) == before
    p.check_integrity()
    p.free("a")
    p.free("b")
    p.check_integrity()


def test_received_duplicate_content_stays_private_and_is_unsealed_for_reuse():
    pool = FakePool(16)
    d = BlockManager(16, BS, source=pool, grant_batch=4)
    prompt = toks(100, 10)
    d.allocate("mine", 10)
    d.commit("mine", prompt, 10)  # this worker caches the same two blocks already
    given = pool.grant(3)
    d.receive("a", prompt, given, 10, sealed={given[0]})
    removed = [e.block_id for e in d.events if e.kind == "removed"]
    assert removed == [given[0]]  # sealed elsewhere, unnamed here: to be unsealed before reuse
    assert d.match_prefix(prompt + [1]) == d.block_table("mine")[:2]
    d.free("a")
    d.check_integrity()


def test_a_receiving_manager_gives_cached_blocks_beyond_its_cap_back_to_the_pool():
    """A decode worker is handed blocks it never allocated; once their requests end they are cached
    here. Past the cap the least recently freed go back to the pool (unnamed), or the node's prefill
    workers would run out of blocks while this one hoards free ones."""
    pool = FakePool(64)
    d = BlockManager(64, BS, source=pool, grant_batch=4)  # caps: min(16, 64 // 8) = 8 blocks
    assert d.cache.cache_cap == d.cache.spare_cap == 8
    order = []
    for i in range(6):  # six requests of two full blocks each, received and finished in turn
        prompt = toks(1000 * i, 2 * BS)
        given = pool.grant(2)
        d.receive(f"r{i}", prompt, given, 2 * BS, sealed=set(given))
        d.free(f"r{i}")
        order.append((prompt, given))
    returned = [b for kind, ids in pool.calls if kind == "release" for b in ids]
    # The oldest four went back, in the order freed (a request's tail block first).
    assert returned == [*order[0][1][::-1], *order[1][1][::-1]]
    assert len(d.held_blocks) == 8 and d.num_free == 8
    assert d.match_prefix(order[0][0] + [1]) == [] and d.match_prefix(order[5][0] + [1]) == order[5][1]
    removed = [e.block_id for e in d.events if e.kind == "removed"]
    assert removed == returned  # their names dropped (so their seals are lifted) before they go
    d.check_integrity()
