"""The worker's blocks as a whole: which it holds (all of the arena, or what the pool granted), the free
queue, the prefix cache's index of named blocks, reference counts, pins for the offload tier's copies.
Per-request tables are `BlockManager`'s (block_manager.py), which works through this object.

The free queue hands out unnamed blocks first, then the least recently freed named ones; a freed block
keeps its name and stays findable until it is reused. Every change of a block's cached identity is
published as an event, the hook the ledger consumes. "No room" is a False or None return, never an
exception: the scheduler decides whom to preempt.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Sequence
from typing import Protocol

from steadfast.kv.names import ROOT_HASH, block_hash, chain
from steadfast.worker.core.block_types import Block, BlockEvent


class BlockSource(Protocol):
    """Where blocks come from when the arena is shared: the kvpool grants them in batches."""

    def grant(self, count: int) -> list[int]: ...

    def release(self, block_ids: list[int]) -> None: ...


# With an offload tier: the call that copies cached blocks (block, name) out before they go back to the pool.
OnEvict = Callable[[list[tuple[int, bytes]]], object]


class BlockCache:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        source: BlockSource | None = None,
        grant_batch: int = 64,
        on_evict: OnEvict | None = None,
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.source = source
        self.grant_batch = grant_batch
        # Free blocks a pool-fed worker keeps (cached prefixes; spare unnamed ones), each at most an
        # eighth of the arena: the rest goes back, so that no worker hoards the node's memory.
        self.cache_cap = self.spare_cap = min(4 * grant_batch, max(1, num_blocks // 8))
        self._free_cached = 0  # free blocks that still hold a cached prefix
        # Blocks this worker may hand out: all of them, or those the pool granted.
        self._held: set[int] = set() if source else set(range(num_blocks))
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in sorted(self._held))
        self._cached: dict[bytes, int] = {}
        self.events: deque[BlockEvent] = deque(maxlen=65536)
        self.prefix_queries = 0
        self.prefix_hits = 0
        # Blocks held outside any table: copies to or from the offload tier in flight (block -> count).
        self._pins: dict[int, int] = {}
        # With an offload tier: cached blocks about to be reused (block, name), for the tier to copy
        # before their bytes change (`evicted`, flushed by the engine before its forward pass); those given
        # back to the pool are copied at once (`on_evict`).
        self.evicted: list[tuple[int, bytes]] = []
        self.on_evict = on_evict

    # --- queries -------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def held_blocks(self) -> list[int]:
        """Every block this worker may use (granted by the pool, or the whole arena)."""
        return sorted(self._held)

    @property
    def num_used(self) -> int:
        return len(self._held) - len(self._free)

    def holds(self, block_id: int) -> bool:
        return block_id in self._held

    def is_cached(self, name: bytes) -> bool:
        return name in self._cached

    def cached_names(self) -> Collection[bytes]:
        """The chained names of every block findable by a prefix lookup now (held or free)."""
        return self._cached.keys()

    def match(self, token_ids: Sequence[int]) -> list[int]:
        """Cached blocks holding a prefix of `token_ids`; at least one token is always left to compute."""
        hits: list[int] = []
        parent = ROOT_HASH
        full = (len(token_ids) - 1) // self.block_size
        for i in range(full):
            tokens = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
            h = block_hash(parent, tokens)
            block_id = self._cached.get(h)
            if block_id is None or self.blocks[block_id].tokens != tokens:
                break
            hits.append(block_id)
            parent = h
        self.prefix_queries += full
        self.prefix_hits += len(hits)
        return hits

    # --- the free queue --------------------------------------------------------------------------
    def ensure_free(self, count: int) -> bool:
        """Have `count` local free blocks. From the pool: when short, or to spare a small prefix cache;
        beyond `cache_cap` cached free blocks, the least recently used cached block is reused instead
        (warm memory, no round trip, and the worker does not hoard the node's arena)."""
        if self.source is not None:
            # Unnamed free blocks sit at the front of the queue: are the first `count` all unnamed?
            fresh = sum(1 for b in itertools.islice(self._free, count) if self.blocks[b].hash is None)
            if fresh < count and (self._free_cached < self.cache_cap or len(self._free) < count):
                # Reversed, so the queue front keeps the pool's order.
                for block_id in reversed(self.source.grant(max(count - fresh, self.grant_batch))):
                    self._held.add(block_id)
                    self._free[block_id] = None
                    self._free.move_to_end(block_id, last=False)  # fresh blocks carry no cache value
        return len(self._free) >= count

    def release_surplus(self) -> None:
        """Give the pool back free blocks beyond the caps: unnamed ones first, then the least
        recently used cached ones. A decode worker collects cached blocks it never allocated (handed
        over, received): kept, they would starve the node's prefill workers of blocks."""
        if self.source is None:
            return
        # Unnamed free blocks are counted without a scan, and sit at the front of the queue.
        excess = len(self._free) - self._free_cached - self.spare_cap
        surplus = list(itertools.islice((b for b in self._free if self.blocks[b].hash is None), max(0, excess)))
        stale = self._free_cached - self.cache_cap
        if stale > 0:  # cached ones follow the unnamed in the queue, least recently freed first
            old = list(itertools.islice((b for b in self._free if self.blocks[b].hash is not None), stale))
            if self.on_evict is not None:  # the pool may hand them to another worker at once
                self.on_evict([(b, h) for b in old if (h := self.blocks[b].hash) is not None])
            for block_id in old:
                self.forget(self.blocks[block_id])
            self._free_cached -= len(old)
            surplus += old
        for block_id in surplus:
            del self._free[block_id]
            self._held.discard(block_id)
            self.events.append(BlockEvent("released", block_id, b""))
        if surplus:
            self.source.release(surplus)

    def take(self, count: int) -> list[int]:
        """The next `count` free blocks, each now held once and unnamed (a cached one is evicted: noted
        in `evicted` for the offload tier, announced `removed` for the ledger)."""
        taken = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None:
                self._free_cached -= 1
                if self.on_evict is not None:
                    self.evicted.append((block_id, block.hash))
            self.forget(block)
            block.ref_count = 1
            taken.append(block_id)
        return taken

    def take_unnamed(self) -> int:
        """The next free block, unnamed and held by nobody yet (a copy's destination)."""
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            self._free_cached -= 1
        self.forget(block)
        return block_id

    def share(self, block_id: int) -> None:
        """One more reference to a held block (a free cached one leaves the free queue)."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
            self._free_cached -= 1
        block.ref_count += 1

    def unref(self, block_id: int) -> None:
        """One reference fewer; a block nobody holds is free again (an unnamed one first in line)."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count < 0:
            raise AssertionError(f"block {block_id} freed more often than taken")
        if block.ref_count == 0:
            self.put_back(block_id)

    def put_back(self, block_id: int) -> None:
        """A block nobody holds into the free queue: a named one at the most recently used end, an
        unnamed one first (nothing to remember)."""
        self._free[block_id] = None
        if self.blocks[block_id].hash is None:
            self._free.move_to_end(block_id, last=False)
        else:
            self._free_cached += 1

    # --- names ----------------------------------------------------------------------------------
    def name(self, block_id: int, name: bytes, tokens: tuple[int, ...], announce: bool = True) -> bool:
        """Give a block the name of its full content unless another block has it; `announce`: tell the
        ledger (`stored`) to seal it. Whether it was named."""
        if name in self._cached:
            return False
        block = self.blocks[block_id]
        block.hash, block.tokens = name, tokens
        self._cached[name] = block_id
        if announce:
            self.events.append(BlockEvent("stored", block_id, name))
        return True

    def forget(self, block: Block) -> None:
        """A block's content is no longer what its name says (reused, given away): out of the index."""
        if block.hash is not None:
            if self._cached.get(block.hash) == block.block_id:
                del self._cached[block.hash]
            self.events.append(BlockEvent("removed", block.block_id, block.hash))
            block.hash = block.tokens = None

    # --- blocks that arrive or leave whole ------------------------------------------------------
    def adopt(self, token_ids: Sequence[int], adopted: Sequence[tuple[int, int]]) -> None:
        """Take blocks another worker filled (granted to us by the ledger) into the prefix cache.

        `adopted`: (position in the sequence, block id) of full blocks whose K/V is verified to be that
        of `token_ids`. They become free cached blocks: the request's admission finds them as a prefix
        hit like any other, and only what follows them is computed.
        """
        names = chain(token_ids, self.block_size, max((pos for pos, _ in adopted), default=-1) + 1)
        for pos, block_id in adopted:
            if block_id in self._held or names[pos] in self._cached:
                raise ValueError(f"block {block_id} at position {pos} is already known here; adopt it once")
            self.name(block_id, names[pos], self._tokens(token_ids, pos), announce=False)
            self._held.add(block_id)
            self._free[block_id] = None  # the most recently used end: evicted last
            self._free_cached += 1

    def give_away(self, block_id: int) -> None:
        """A held block that is another worker's now: unnamed, unreferenced, no longer held here."""
        block = self.blocks[block_id]
        if block.hash is not None and self._cached.get(block.hash) == block_id:
            del self._cached[block.hash]
        block.hash = block.tokens = None
        block.ref_count = 0
        self._held.discard(block_id)
        self.events.append(BlockEvent("released", block_id, b""))  # no longer ours: nothing to unseal

    def hold_given(self, block_id: int) -> None:
        """A block another worker of this node handed over, now held once here."""
        if block_id in self._held:
            raise ValueError(f"block {block_id} is already held here")
        self.blocks[block_id].ref_count = 1
        self._held.add(block_id)

    def _tokens(self, token_ids: Sequence[int], pos: int) -> tuple[int, ...]:
        return tuple(token_ids[pos * self.block_size : (pos + 1) * self.block_size])

    # --- the offload tier's copies ---------------------------------------------------------------
    def eviction_candidates(self, window: int, skip: Callable[[bytes], bool]) -> list[tuple[int, bytes]]:
        """Cached free blocks whose content is about to leave this worker, with their names: those
        among the next `window` blocks in line for reuse, and those beyond the cache cap (given back to
        the pool at the next free). `skip`: names not wanted (already in the tier)."""
        stale = max(0, self._free_cached - self.cache_cap) if self.source is not None else 0
        out = []
        for position, block_id in enumerate(self._free):
            if position >= window + stale:
                break
            h = self.blocks[block_id].hash
            if h is not None and not skip(h):
                out.append((block_id, h))
        return out

    def pin(self, block_ids: Sequence[int]) -> None:
        """Hold blocks while their bytes are copied out: a free one leaves the free queue, keeping its name."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
                if block.hash is not None:
                    self._free_cached -= 1
            block.ref_count += 1
            self._pins[block_id] = self._pins.get(block_id, 0) + 1

    def unpin(self, block_ids: Sequence[int]) -> None:
        """Let go of pinned blocks; one nobody else holds is free again, first in line (its content is
        in the tier now), and the surplus goes back to the pool."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            left = self._pins[block_id] - 1
            if left:
                self._pins[block_id] = left
            else:
                del self._pins[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                self._free.move_to_end(block_id, last=False)
                if block.hash is not None:
                    self._free_cached += 1
        self.release_surplus()

    def take_free(self, count: int) -> list[int] | None:
        """`count` free blocks, pinned and unnamed, for bytes coming back from the tier; None if short.
        Cached ones among them are in `evicted`: the caller flushes it before it writes them."""
        if not self.ensure_free(count):
            return None
        taken = self.take(count)
        self._pins.update((block_id, 1) for block_id in taken)
        return taken

    def install(self, token_ids: Sequence[int], placed: Sequence[tuple[int, int]]) -> None:
        """Blocks `take_free` gave, now holding the KV of full blocks of `token_ids` ((position, block)
        each, brought back from the tier): they join the prefix cache, announced to be sealed, so the
        request's admission finds them as a prefix hit. One whose name is cached meanwhile stays unnamed."""
        names = chain(token_ids, self.block_size, max((pos for pos, _ in placed), default=-1) + 1)
        for pos, block_id in placed:
            self.name(block_id, names[pos], self._tokens(token_ids, pos))
            self._pins.pop(block_id)
            self.blocks[block_id].ref_count = 0
            self._free[block_id] = None  # the most recently used end: its request is admitted next
            if self.blocks[block_id].hash is not None:
                self._free_cached += 1
            else:
                self._free.move_to_end(block_id, last=False)

    # --- checks -----------------------------------------------------------------------------------
    def check(self, table_refs: Sequence[int]) -> None:
        """Raise AssertionError if refcounts (`table_refs`: each block's references from request tables),
        pins, the free queue and the index disagree."""
        for block in self.blocks:
            want = table_refs[block.block_id] + self._pins.get(block.block_id, 0)
            assert block.ref_count == want, f"block {block.block_id} refcount mismatch"
            if block.block_id not in self._held:
                assert block.ref_count == 0 and block.block_id not in self._free, f"block {block.block_id} not held"
                continue
            assert (block.block_id in self._free) == (block.ref_count == 0), f"block {block.block_id} free-state"
            if block.hash is not None:
                assert self._cached.get(block.hash) == block.block_id, f"block {block.block_id} not in cache index"
        for h, block_id in self._cached.items():
            assert self.blocks[block_id].hash == h
        cached_free = sum(1 for b in self._free if self.blocks[b].hash is not None)
        assert cached_free == self._free_cached, f"{self._free_cached} cached free blocks counted, {cached_free} found"
