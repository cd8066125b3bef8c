"""The block manager's side of the offload tier's copies (a part of `BlockManager`, kept apart so each
module has one job): which cached blocks are next in line to be reused, pins that hold blocks while
their bytes are copied out, free blocks taken for bytes coming back, and those blocks joining the
prefix cache once they are back. It works on the manager's own tables (`block_manager.py`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from steadfast.kv.block_types import BlockEvent

if TYPE_CHECKING:
    from steadfast.kv.block_manager import BlockManager


class TierCopies:
    """Mixed into `BlockManager`."""

    def eviction_candidates(self: BlockManager, window: int, skip: Callable[[bytes], bool]) -> list[tuple[int, bytes]]:
        """Cached free blocks whose content is about to leave this manager, with their names: those
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

    def pin(self: BlockManager, block_ids: Sequence[int]) -> None:
        """Hold blocks while their bytes are copied out: a free one leaves the free queue, keeping its name."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
                if block.hash is not None:
                    self._free_cached -= 1
            block.ref_count += 1
            self._pins[block_id] = self._pins.get(block_id, 0) + 1

    def unpin(self: BlockManager, block_ids: Sequence[int]) -> None:
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
        self._release_surplus()

    def take_free(self: BlockManager, count: int) -> list[int] | None:
        """`count` free blocks, pinned and unnamed, for bytes coming back from the tier; None if short.
        Cached ones among them are in `evicted`: the caller flushes it before it writes them."""
        if not self._ensure_free(count):
            return None
        taken = self._take(count)
        self._pins.update((block_id, 1) for block_id in taken)
        return taken

    def install(self: BlockManager, token_ids: Sequence[int], placed: Sequence[tuple[int, int]]) -> None:
        """Blocks `take_free` gave, now holding the KV of full blocks of `token_ids` ((position, block)
        each, brought back from the tier): they join the prefix cache, announced to be sealed, so the
        request's admission finds them as a prefix hit. One whose name is cached meanwhile stays unnamed."""
        names = self.chain(token_ids, max((pos for pos, _ in placed), default=-1) + 1)
        for pos, block_id in placed:
            block = self.blocks[block_id]
            if names[pos] not in self._cached:
                block.hash = names[pos]
                block.tokens = tuple(token_ids[pos * self.block_size : (pos + 1) * self.block_size])
                self._cached[block.hash] = block_id
                self.events.append(BlockEvent("stored", block_id, block.hash))
            self._pins.pop(block_id)
            block.ref_count = 0
            self._free[block_id] = None  # the most recently used end: its request is admitted next
            if block.hash is not None:
                self._free_cached += 1
            else:
                self._free.move_to_end(block_id, last=False)
