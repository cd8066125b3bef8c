"""Block manager: which arena blocks each request holds, refcounts, and the prefix cache.

Full blocks are named by a chained hash over (parent hash, the block's token ids), so two requests
with the same prefix share blocks. A freed block keeps its hash and stays findable until it is
reused; the free queue hands out unhashed blocks first, then the least recently freed cached ones.
"No room" is a `None` return, never an exception: the scheduler decides whom to preempt.

Every change of a block's cached identity is published as an event, the hook the ledger consumes.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Protocol

import numpy as np

from steadfast.kv.block_tier import TierCopies
from steadfast.kv.block_types import Block, BlockEvent

ROOT_HASH = b"steadfast-kv-root"


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Chained content name of a full block: depends on every token before it, not just its own."""
    return hashlib.blake2b(parent + np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()


def chain(token_ids: Sequence[int], block_size: int, count: int) -> list[bytes]:
    """The chained names of the first `count` full blocks of `token_ids` (what the router's KV-aware
    routing looks up in the workers' cache events)."""
    names, parent = [], ROOT_HASH
    for i in range(count):
        parent = block_hash(parent, token_ids[i * block_size : (i + 1) * block_size])
        names.append(parent)
    return names


class BlockSource(Protocol):
    """Where blocks come from when the arena is shared: the kvpool grants them in batches."""

    def grant(self, count: int) -> list[int]: ...

    def release(self, block_ids: list[int]) -> None: ...


class BlockManager(TierCopies):
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        source: BlockSource | None = None,
        grant_batch: int = 64,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.source = source
        self.grant_batch = grant_batch
        # Free blocks a pool-fed manager keeps (cached prefixes; spare unhashed ones), each at most an
        # eighth of the arena: the rest goes back, so that no worker hoards the node's memory.
        self.cache_cap = self.spare_cap = min(4 * grant_batch, max(1, num_blocks // 8))
        self._free_cached = 0  # free blocks that still hold a cached prefix
        # Blocks this manager may hand out: all of them, or those the pool granted.
        self._held: set[int] = set() if source else set(range(num_blocks))
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in sorted(self._held))
        self._cached: dict[bytes, int] = {}
        self._tables: dict[str, list[int]] = {}
        # request -> (how many of its leading blocks are named, the last one's hash)
        self._hashed: dict[str, tuple[int, bytes]] = {}
        self.events: deque[BlockEvent] = deque(maxlen=65536)
        self.prefix_queries = 0
        self.prefix_hits = 0
        # Blocks held outside any table: copies to or from the offload tier in flight (block -> count).
        self._pins: dict[int, int] = {}
        # With an offload tier: cached blocks about to be reused (block, name), for the tier to copy
        # before their bytes change (`evicted`, flushed by the engine before its forward pass), and the
        # call that copies the ones given back to the pool before they go.
        self.evicted: list[tuple[int, bytes]] = []
        self.on_evict: Callable[[list[tuple[int, bytes]]], None] | None = None

    # --- queries -------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def held_blocks(self) -> list[int]:
        """Every block this manager may use (granted by the pool, or the whole arena)."""
        return sorted(self._held)

    @property
    def num_used(self) -> int:
        return len(self._held) - len(self._free)

    def _ensure_free(self, count: int) -> bool:
        """Have `count` local free blocks. From the pool: when short, or to spare a small prefix cache;
        beyond `cache_cap` cached free blocks, the least recently used cached block is reused instead
        (warm memory, no round trip, and the worker does not hoard the node's arena)."""
        if self.source is not None:
            # Unhashed free blocks sit at the front of the queue: are the first `count` all unhashed?
            fresh = sum(1 for b in itertools.islice(self._free, count) if self.blocks[b].hash is None)
            if fresh < count and (self._free_cached < self.cache_cap or len(self._free) < count):
                # Reversed, so the queue front keeps the pool's order.
                for block_id in reversed(self.source.grant(max(count - fresh, self.grant_batch))):
                    self._held.add(block_id)
                    self._free[block_id] = None
                    self._free.move_to_end(block_id, last=False)  # fresh blocks carry no cache value
        return len(self._free) >= count

    def _release_surplus(self) -> None:
        """Give the pool back free blocks beyond the caps: unhashed ones first, then the least
        recently used cached ones. A decode worker collects cached blocks it never allocated (handed
        over, received): kept, they would starve the node's prefill workers of blocks."""
        if self.source is None:
            return
        # Unhashed free blocks are counted without a scan, and sit at the front of the queue.
        excess = len(self._free) - self._free_cached - self.spare_cap
        surplus = list(itertools.islice((b for b in self._free if self.blocks[b].hash is None), max(0, excess)))
        stale = self._free_cached - self.cache_cap
        if stale > 0:  # cached ones follow the unhashed in the queue, least recently freed first
            old = list(itertools.islice((b for b in self._free if self.blocks[b].hash is not None), stale))
            if self.on_evict is not None:  # the pool may hand them to another worker at once
                self.on_evict([(b, h) for b in old if (h := self.blocks[b].hash) is not None])
            for block_id in old:
                self._forget_hash(self.blocks[block_id])
            self._free_cached -= len(old)
            surplus += old
        for block_id in surplus:
            del self._free[block_id]
            self._held.discard(block_id)
            self.events.append(BlockEvent("released", block_id, b""))
        if surplus:
            self.source.release(surplus)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, token_ids: Sequence[int], own: bool = False) -> list[int]:
        """Cached blocks holding a prefix of `token_ids`; at least one token is always left to compute.
        `own`: the request had this KV itself (preempted, taken over): found even with prefix caching off."""
        if not self.enable_prefix_caching and not own:
            return []
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

    def chain(self, token_ids: Sequence[int], count: int) -> list[bytes]:
        """The chained names of the first `count` full blocks of `token_ids`."""
        return chain(token_ids, self.block_size, count)

    def chain_from(self, token_ids: Sequence[int], start: int, stop: int, parent: bytes | None) -> Iterator[bytes]:
        """The chained names of full blocks `start` .. `stop - 1`, lazily; `parent`: block `start - 1`'s."""
        parent = parent or ROOT_HASH
        for i in range(start, stop):
            parent = block_hash(parent, token_ids[i * self.block_size : (i + 1) * self.block_size])
            yield parent

    def is_cached(self, name: bytes) -> bool:
        return name in self._cached

    def cached_names(self) -> Collection[bytes]:
        """The chained names of every block findable by a prefix lookup now (held or free)."""
        return self._cached.keys()

    # --- changes -------------------------------------------------------------------------------
    def adopt(self, token_ids: Sequence[int], adopted: Sequence[tuple[int, int]]) -> None:
        """Take blocks another worker filled (granted to us by the ledger) into the prefix cache.

        `adopted`: (position in the sequence, block id) of full blocks whose K/V is verified to be that
        of `token_ids`. They become free cached blocks: the request's admission finds them as a prefix
        hit like any other, and only what follows them is computed.
        """
        names = self.chain(token_ids, max((pos for pos, _ in adopted), default=-1) + 1)
        for pos, block_id in adopted:
            block = self.blocks[block_id]
            if block_id in self._held or names[pos] in self._cached:
                raise ValueError(f"block {block_id} at position {pos} is already known here; adopt it once")
            block.hash = names[pos]
            block.tokens = tuple(token_ids[pos * self.block_size : (pos + 1) * self.block_size])
            self._cached[block.hash] = block_id
            self._held.add(block_id)
            self._free[block_id] = None  # the most recently used end: evicted last
            self._free_cached += 1

    def hand_over(
        self,
        request_id: str,
        copy: Callable[[int, int], None],
        transfer: Callable[[list[int], list[tuple[int, bytes]]], None],
    ) -> list[int] | None:
        """Give a request's blocks to another worker of this node (prefill → decode), zero copy.

        Blocks another request here shares are copied first (`copy(src, dst)`): they stay here.
        `transfer(block_ids, copies)` makes the blocks the other worker's in the ledger (`copies`:
        the fresh copies with their names, to seal first); if it raises, nothing here changed. Returns
        the block table handed over, or None when no free block was left for a copy.
        """
        table = self._tables[request_id]
        shared = [i for i, b in enumerate(table) if self.blocks[b].ref_count > 1]
        if shared and not self._ensure_free(len(shared)):
            return None
        handed = list(table)
        copies = []
        for i in shared:
            dst, _ = self._free.popitem(last=False)
            block = self.blocks[dst]
            if block.hash is not None:
                self._free_cached -= 1
            self._forget_hash(block)
            src = self.blocks[table[i]]
            assert src.hash is not None, "a shared block is always a full, named one"
            copy(src.block_id, dst)
            handed[i] = dst
            copies.append((dst, src.hash))
        try:
            transfer(handed, copies)
        except BaseException:
            for dst, _ in copies:  # unnamed again: first out of the free queue
                self._free[dst] = None
                self._free.move_to_end(dst, last=False)
            raise
        for i in shared:
            self.blocks[table[i]].ref_count -= 1  # still used by the request that shares it
        for block_id in handed:
            block = self.blocks[block_id]
            if block.hash is not None and self._cached.get(block.hash) == block_id:
                del self._cached[block.hash]
            block.hash = block.tokens = None
            block.ref_count = 0
            self._held.discard(block_id)
            self.events.append(BlockEvent("released", block_id, b""))  # no longer ours: nothing to unseal
        del self._tables[request_id]
        del self._hashed[request_id]
        return handed

    def receive(
        self,
        request_id: str,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        num_computed: int,
        sealed: Collection[int] = (),
    ) -> None:
        """Take a request's blocks handed over by another worker of this node, their KV covering the
        first `num_computed` of `token_ids`; `sealed`: those the giver sealed in the ledger.

        Full blocks enter the prefix cache under their names, announced (`stored`) to be sealed if
        they were not; one whose content this worker caches already stays the request's private
        block, announced `removed` if it was sealed, so it is unsealed before it is ever reused.
        """
        if request_id in self._tables:
            raise ValueError(f"request {request_id} already holds blocks here")
        full = num_computed // self.block_size
        names = self.chain(token_ids, full)
        for block_id in block_ids:
            if block_id in self._held:
                raise ValueError(f"block {block_id} is already held here")
        for pos, block_id in enumerate(block_ids):
            block = self.blocks[block_id]
            block.ref_count = 1
            self._held.add(block_id)
            if pos >= full:
                continue
            if names[pos] not in self._cached:
                block.hash = names[pos]
                block.tokens = tuple(token_ids[pos * self.block_size : (pos + 1) * self.block_size])
                self._cached[block.hash] = block_id
                if block_id not in sealed:
                    self.events.append(BlockEvent("stored", block_id, block.hash))
            elif block_id in sealed:
                self.events.append(BlockEvent("removed", block_id, names[pos]))
        self._tables[request_id] = list(block_ids)
        self._hashed[request_id] = (full, names[-1] if names else ROOT_HASH)

    def allocate(self, request_id: str, num_tokens: int, prefix: Sequence[int] = ()) -> list[int] | None:
        """Make the request's table cover `num_tokens` slots; `prefix` (first call only) is shared.

        Returns the newly taken block ids, or None (and changes nothing) when there is no room.
        """
        table = self._tables.get(request_id)
        if table is None:
            table = []
        elif prefix:
            raise ValueError(f"request {request_id} already holds blocks; a prefix is only taken on first allocation")
        reused_free = sum(1 for b in prefix if self.blocks[b].ref_count == 0)
        new_count = self.blocks_needed(num_tokens) - len(table) - len(prefix)
        if new_count > 0 and not self._ensure_free(new_count + reused_free):
            return None
        if request_id not in self._tables:
            self._tables[request_id] = table
            self._hashed[request_id] = (0, ROOT_HASH)
        for block_id in prefix:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
                self._free_cached -= 1
            block.ref_count += 1
            table.append(block_id)
        if prefix:
            last = self.blocks[prefix[-1]].hash
            assert last is not None, "a prefix block without a hash"
            self._hashed[request_id] = (len(prefix), last)
        taken = self._take(max(0, new_count))
        table.extend(taken)
        return taken

    def _take(self, count: int) -> list[int]:
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
            self._forget_hash(block)
            block.ref_count = 1
            taken.append(block_id)
        return taken

    def commit(self, request_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        """Name the request's blocks that became full once `num_computed` tokens have KV.

        Full blocks are named (and announced, so the ledger seals them) even with prefix caching off;
        only `match_prefix` is disabled then.
        """
        table = self._tables[request_id]
        done, parent = self._hashed[request_id]
        full = min(num_computed // self.block_size, len(table))
        if full <= done:
            return
        for i in range(done, full):
            block = self.blocks[table[i]]
            tokens = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
            h = block_hash(parent, tokens)
            if block.hash is None and h not in self._cached:
                block.hash, block.tokens = h, tokens
                self._cached[h] = block.block_id
                self.events.append(BlockEvent("stored", block.block_id, h))
            parent = h
        self._hashed[request_id] = (full, parent)

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Shrink the request's table to the blocks `num_tokens` slots need (rejected draft tokens'
        blocks go back). The blocks dropped are its own, never named: only full blocks of computed
        tokens are. They stay in this manager's free queue, first to be handed out again."""
        table = self._tables.get(request_id)
        keep = self.blocks_needed(num_tokens)
        if table is None or len(table) <= keep:
            return
        done, _ = self._hashed[request_id]
        if done > keep:
            raise ValueError(f"request {request_id}: {done} named blocks cannot be trimmed to {keep}")
        for block_id in reversed(table[keep:]):
            block = self.blocks[block_id]
            if block.ref_count != 1 or block.hash is not None:
                raise AssertionError(f"block {block_id} trimmed while shared or named")
            block.ref_count = 0
            self._free[block_id] = None
            self._free.move_to_end(block_id, last=False)
        del table[keep:]

    def free(self, request_id: str) -> None:
        """Drop the request's references, tail first, so its least shareable blocks are evicted first."""
        table = self._tables.pop(request_id, None)
        self._hashed.pop(request_id, None)
        if table is None:
            return
        for block_id in reversed(table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count < 0:
                raise AssertionError(f"block {block_id} freed more often than taken")
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.hash is None:
                    # Nothing to remember: hand it out before any cached block.
                    self._free.move_to_end(block_id, last=False)
                else:
                    self._free_cached += 1
        self._release_surplus()

    def _forget_hash(self, block: Block) -> None:
        if block.hash is not None:
            if self._cached.get(block.hash) == block.block_id:
                del self._cached[block.hash]
            self.events.append(BlockEvent("removed", block.block_id, block.hash))
            block.hash = block.tokens = None

    def check_integrity(self) -> None:
        """Raise AssertionError if refcounts, tables, the free queue and the cache disagree."""
        counts = [0] * self.num_blocks
        for block_id, pins in self._pins.items():
            counts[block_id] += pins
        for table in self._tables.values():
            assert len(set(table)) == len(table), "a block appears twice in one table"
            for block_id in table:
                counts[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == counts[block.block_id], f"block {block.block_id} refcount mismatch"
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
