"""Which arena blocks each request holds: per-request block tables over the worker's `BlockCache`
(block_cache.py: the free queue, the prefix cache, refcounts, pins, pool grants).

Full blocks are named by a chained hash (kv/names.py) over (parent name, the block's token ids), so two
requests with the same prefix share blocks. "No room" is a `None` return, never an exception: the
scheduler decides whom to preempt.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence

from steadfast.kv.names import ROOT_HASH, block_hash, chain
from steadfast.worker.core.block_cache import BlockCache, BlockSource, OnEvict
from steadfast.worker.core.block_types import BlockEvent


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        source: BlockSource | None = None,
        grant_batch: int = 64,
        on_evict: OnEvict | None = None,
    ) -> None:
        """`on_evict`: with an offload tier, what copies cached blocks out before the pool takes them."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.cache = BlockCache(num_blocks, block_size, source, grant_batch, on_evict)
        self.blocks = self.cache.blocks
        self.events = self.cache.events
        self._tables: dict[str, list[int]] = {}
        # request -> (how many of its leading blocks are named, the last one's name)
        self._hashed: dict[str, tuple[int, bytes]] = {}

    # --- queries -------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self.cache.num_free

    @property
    def held_blocks(self) -> list[int]:
        """Every block this manager may use (granted by the pool, or the whole arena)."""
        return self.cache.held_blocks

    @property
    def num_used(self) -> int:
        return self.cache.num_used

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, token_ids: Sequence[int], own: bool = False) -> list[int]:
        """Cached blocks holding a prefix of `token_ids`; at least one token is always left to compute.
        `own`: the request had this KV itself (preempted, taken over): found even with prefix caching off."""
        if not self.enable_prefix_caching and not own:
            return []
        return self.cache.match(token_ids)

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
        return self.cache.is_cached(name)

    def cached_names(self) -> Collection[bytes]:
        """The chained names of every block findable by a prefix lookup now (held or free)."""
        return self.cache.cached_names()

    # --- changes -------------------------------------------------------------------------------
    def adopt(self, token_ids: Sequence[int], adopted: Sequence[tuple[int, int]]) -> None:
        """Blocks another worker filled, verified, into the prefix cache (`BlockCache.adopt`)."""
        self.cache.adopt(token_ids, adopted)

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
        if shared and not self.cache.ensure_free(len(shared)):
            return None
        handed = list(table)
        copies = []
        for i in shared:
            dst = self.cache.take_unnamed()
            src = self.blocks[table[i]]
            assert src.hash is not None, "a shared block is always a full, named one"
            copy(src.block_id, dst)
            handed[i] = dst
            copies.append((dst, src.hash))
        try:
            transfer(handed, copies)
        except BaseException:
            for dst, _ in copies:  # unnamed again: first out of the free queue
                self.cache.put_back(dst)
            raise
        for i in shared:
            self.blocks[table[i]].ref_count -= 1  # still used by the request that shares it
        for block_id in handed:
            self.cache.give_away(block_id)
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
            if self.cache.holds(block_id):
                raise ValueError(f"block {block_id} is already held here")
        for pos, block_id in enumerate(block_ids):
            self.cache.hold_given(block_id)
            if pos >= full:
                continue
            tokens = tuple(token_ids[pos * self.block_size : (pos + 1) * self.block_size])
            if (
                not self.cache.name(block_id, names[pos], tokens, announce=block_id not in sealed)
                and block_id in sealed
            ):
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
        if new_count > 0 and not self.cache.ensure_free(new_count + reused_free):
            return None
        if request_id not in self._tables:
            self._tables[request_id] = table
            self._hashed[request_id] = (0, ROOT_HASH)
        for block_id in prefix:
            self.cache.share(block_id)
            table.append(block_id)
        if prefix:
            last = self.blocks[prefix[-1]].hash
            assert last is not None, "a prefix block without a hash"
            self._hashed[request_id] = (len(prefix), last)
        taken = self.cache.take(max(0, new_count))
        table.extend(taken)
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
            if block.hash is None:
                self.cache.name(block.block_id, h, tokens)
            parent = h
        self._hashed[request_id] = (full, parent)

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Shrink the request's table to the blocks `num_tokens` slots need (rejected draft tokens'
        blocks go back). The blocks dropped are its own, never named: only full blocks of computed
        tokens are. They stay in this worker's free queue, first to be handed out again."""
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
            self.cache.unref(block_id)
        del table[keep:]

    def free(self, request_id: str) -> None:
        """Drop the request's references, tail first, so its least shareable blocks are evicted first."""
        table = self._tables.pop(request_id, None)
        self._hashed.pop(request_id, None)
        if table is None:
            return
        for block_id in reversed(table):
            self.cache.unref(block_id)
        self.cache.release_surplus()

    def check_integrity(self) -> None:
        """Raise AssertionError if refcounts, tables, the free queue and the cache disagree."""
        refs = [0] * self.num_blocks
        for table in self._tables.values():
            assert len(set(table)) == len(table), "a block appears twice in one table"
            for block_id in table:
                refs[block_id] += 1
        self.cache.check(refs)
