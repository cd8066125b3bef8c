"""The offload tier, a worker's side: which blocks go out to the tier, which come back, and when.

The tier is a victim cache behind the arena, indexed by the same chained token names as the prefix
cache (`index`: name → slot, least recently used first):

- **Write-out, in the background.** After each step, the cached free blocks next in line to be reused
  or given back (those of finished, idle or preempted sequences, least recently used first) are pinned
  and copied to the tier on this module's thread; when the copy is done the slots are recorded
  OFFLOADED in the ledger (the pool's from then on) and the blocks are let go. A cached block beyond the
  worker's cache cap is kept until it is written, so nothing the tier could hold is lost.
- **Swap preemption.** A request preempted for room has its named blocks written out at once, before
  the scheduler reuses them (on the engine's thread: the copy must land before the reuse, ~0.1 ms a
  block), instead of being left to be recomputed; with no slot to be had it is recomputed as before.
- **Fetch, in the background.** Before a waiting request is admitted, the blocks of its prefix the
  tier holds past what the arena caches are copied back into fresh blocks on the thread, each checked
  against its slot's hash; the request waits meanwhile and is admitted, as a prefix hit, once they land.
- **Takeover.** A successor adopts a dead worker's offloaded slots (`adopt`) as it adopts sealed blocks.

The worker's share of the tier is at most `cache.tier_slots` of its arena (`offload_max_fraction` of
its KV); past it, the least recently used slots are freed.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from steadfast.kv.arena.arena import KVArena
from steadfast.kv.arena.tier import TierFile
from steadfast.kv.ledger.interface import LedgerError, SlotRecord, SlotSeal
from steadfast.worker.core.block_manager import BlockManager
from steadfast.worker.core.request import Request

log = logging.getLogger(__name__)

WRITE_BATCH = 16  # blocks per background write job
WRITE_WINDOW = 32  # how far down the eviction line blocks are written ahead


class SlotBook(Protocol):
    """Who hands out the tier's slots and records what they hold: the node's ledger (`LedgerSlots` in
    ledger_sync.py) or, for an engine without a pool, a local list."""

    def reserve(self, count: int) -> list[int]: ...
    def store(self, seals: Sequence[SlotSeal]) -> None: ...
    def free(self, slots: Sequence[int]) -> None: ...
    def offloaded(self, names: Sequence[bytes]) -> list[SlotRecord]: ...
    def adopt(self, slots: Sequence[tuple[int, bytes]]) -> None: ...


class LocalSlots:
    """Slots of a tier no other process knows of (a test engine's)."""

    def __init__(self, num_slots: int) -> None:
        self._free = list(range(num_slots))

    def reserve(self, count: int) -> list[int]:
        taken, self._free = self._free[:count], self._free[count:]
        return taken

    def store(self, seals: Sequence[SlotSeal]) -> None:
        pass

    def free(self, slots: Sequence[int]) -> None:
        self._free.extend(slots)

    def offloaded(self, names: Sequence[bytes]) -> list[SlotRecord]:
        return []

    def adopt(self, slots: Sequence[tuple[int, bytes]]) -> None:
        pass


@dataclass
class _Write:
    pairs: list[tuple[int, int]]  # (block, slot)
    names: list[bytes]
    digests: list[bytes] = field(default_factory=list)


@dataclass
class _Fetch:
    request_id: str
    token_ids: list[int]
    pairs: list[tuple[int, int, bytes]]  # (slot, block, digest)
    positions: list[int]
    names: list[bytes]
    ok: list[bool] = field(default_factory=list)


class Offloader:
    def __init__(self, tier: TierFile, arena: KVArena, blocks: BlockManager, book: SlotBook, cap: int) -> None:
        self.tier = tier
        self.arena = arena
        self.blocks = blocks
        self.book = book
        self.cap = max(1, min(cap, tier.num_slots))
        self.index: OrderedDict[bytes, tuple[int, bytes]] = OrderedDict()  # name -> (slot, digest)
        self._busy: set[int] = set()  # slots a job in flight reads or writes
        self._writing: _Write | None = None
        self._fetching: dict[str, _Fetch] = {}
        self._jobs: queue.SimpleQueue[_Write | _Fetch | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[_Write | _Fetch] = queue.SimpleQueue()
        self.written = self.fetched = 0
        # A swapped-out (or taken-over) request's names: kept in the tier, never evicted for cached blocks,
        # until its blocks are back in the arena.
        self._swapped: dict[str, set[bytes]] = {}
        self._kept: dict[bytes, int] = {}  # name -> how many swapped requests hold it
        self._thread = threading.Thread(target=self._run, name="kv-offload", daemon=True)
        self._thread.start()

    # --- the copy thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                if isinstance(job, _Write):
                    job.digests = self.tier.write(self.arena, job.pairs)
                else:
                    job.ok = self.tier.read(self.arena, job.pairs)
            except Exception:  # a job that failed is reported as nothing done, never lost
                log.exception("offload tier copy failed")
                job.digests, job.ok = [], [False] * len(getattr(job, "pairs", []))
            self._done.put(job)

    # --- the engine's thread --------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return self._writing is not None or bool(self._fetching)

    def poll(self) -> None:
        """Take in the copies that finished: written slots recorded, fetched blocks cached."""
        while True:
            try:
                job = self._done.get_nowait()
            except queue.Empty:
                return
            if isinstance(job, _Write):
                self._written(job)
            else:
                self._fetched(job)

    def _written(self, job: _Write) -> None:
        self._writing = None
        blocks = [b for b, _ in job.pairs]
        slots = [s for _, s in job.pairs]
        self._busy.difference_update(slots)
        if len(job.digests) == len(slots):
            self._record(slots, job.digests, job.names)
        else:
            self.book.free(slots)
        self.blocks.cache.unpin(blocks)

    def _record(self, slots: list[int], digests: list[bytes], names: list[bytes]) -> None:
        self.book.store(list(zip(slots, digests, names, strict=True)))
        twice = []
        for slot, digest, name in zip(slots, digests, names, strict=True):
            if name in self.index:  # written meanwhile by another way (adopted): one slot per name
                twice.append(slot)
            else:
                self.index[name] = (slot, digest)
        if twice:
            self.book.free(twice)
        self.written += len(slots) - len(twice)

    def _fetched(self, job: _Fetch) -> None:
        self._fetching.pop(job.request_id, None)
        self._busy.difference_update(s for s, _, _ in job.pairs)
        placed, failed = [], []
        for (_, block, _), pos, name, ok in zip(job.pairs, job.positions, job.names, job.ok, strict=True):
            if ok:
                placed.append((pos, block))
                if name in self.index:
                    self.index.move_to_end(name, last=True)
            else:
                failed.append(block)
                self._drop(name)
        self.fetched += len(placed)
        if failed:
            log.error("%d offloaded blocks failed their hash check; their KV is recomputed", len(failed))
            self.blocks.cache.unpin(failed)
        self.blocks.cache.install(job.token_ids, placed)

    def _drop(self, name: bytes) -> None:
        found = self.index.pop(name, None)
        if found is not None:
            self.book.free([found[0]])

    def _slots(self, count: int, protect: frozenset[bytes] = frozenset()) -> list[int]:
        """Up to `count` slots to write into, the least recently used of ours freed to stay under the
        cap (never those named in `protect`, nor those a copy in flight uses)."""
        writing = len(self._writing.pairs) if self._writing is not None else 0
        over = len(self.index) + writing + count - self.cap
        if over > 0:
            spare = protect | self._kept.keys()
            victims = [n for n, (s, _) in self.index.items() if s not in self._busy and n not in spare][:over]
            if victims:
                self.book.free([self.index.pop(n)[0] for n in victims])
        room = self.cap - len(self.index) - writing
        return self.book.reserve(min(count, room)) if room > 0 else []

    def plan(self) -> None:
        """After a step: write the cached blocks next in line for reuse, in the background. The line
        looked at is at most half the worker's share of the tier, and what is written from it is never
        evicted for the rest of it: blocks that stay cached are written once, not over and over."""
        if self._writing is not None:
            return
        window = max(1, min(WRITE_WINDOW, self.cap // 2))
        line = self.blocks.cache.eviction_candidates(window, lambda _: False)
        todo = [(b, n) for b, n in line if n not in self.index][:WRITE_BATCH]
        if not todo:
            return
        slots = self._slots(len(todo), frozenset(n for _, n in line))
        if not slots:
            return
        todo = todo[: len(slots)]
        self.blocks.cache.pin([b for b, _ in todo])
        self._busy.update(slots)
        self._writing = _Write([(b, s) for (b, _), s in zip(todo, slots, strict=True)], [n for _, n in todo])
        self._jobs.put(self._writing)

    def flush(self) -> None:
        """Before the forward pass (or a fetch) writes blocks the scheduler took: the cached ones among
        them not written ahead yet are copied out now, so an eviction loses nothing the tier can hold."""
        evicted, self.blocks.cache.evicted = self.blocks.cache.evicted, []
        if evicted:
            self.write_now(evicted)

    def write_now(self, named: list[tuple[int, bytes]]) -> int:
        """Copy these (block, name) out on this thread, those the tier lacks; returns how many it holds."""
        writing = set(self._writing.names) if self._writing is not None else set()
        first = {n: b for b, n in reversed(named)}  # one copy per name
        todo = [(b, n) for n, b in first.items() if n not in self.index and n not in writing]
        if todo:
            slots = self._slots(len(todo))
            todo = todo[: len(slots)]
            if slots:
                digests = self.tier.write(self.arena, [(b, s) for (b, _), s in zip(todo, slots, strict=True)])
                self._record(slots, digests, [n for _, n in todo])
        return sum(1 for _, n in named if n in self.index or n in writing)

    def has_room(self, request: Request) -> bool:
        """Whether the tier can take every named block of `request` it lacks without dropping any kept
        for a swapped-out request (the ladder swaps out only what it can keep whole)."""
        table = self.blocks.block_table(request.request_id)
        missing = sum(1 for b in table if (h := self.blocks.blocks[b].hash) is not None and h not in self.index)
        writing = len(self._writing.pairs) if self._writing is not None else 0
        return missing > 0 and len(self._kept) + writing + missing <= self.cap

    def swap_out(self, request: Request) -> int:
        """A request about to be preempted: write its named blocks the tier lacks, now (the scheduler
        reuses them within this step). Returns how many of them the tier holds (the rest are recomputed)."""
        table = self.blocks.block_table(request.request_id)
        named = [(b, h) for b in table if (h := self.blocks.blocks[b].hash) is not None]
        held = self.write_now(named)
        if held:
            self._keep(request.request_id, {n for _, n in named})
        return held

    def _keep(self, request_id: str, names: set[bytes]) -> None:
        """Keep these entries in the tier (never evicted for cached blocks) until the request's blocks
        are back in the arena."""
        self._release(request_id)
        self._swapped[request_id] = names
        for n in names:
            self._kept[n] = self._kept.get(n, 0) + 1

    def _release(self, request_id: str) -> None:
        """Its blocks in the tier are ordinary entries again (least recently used goes first)."""
        for n in self._swapped.pop(request_id, ()):
            left = self._kept[n] - 1
            if left:
                self._kept[n] = left
            else:
                del self._kept[n]

    def forget(self, request_id: str) -> None:
        """A request that ended: nothing of it is kept in the tier on its behalf any more."""
        self._release(request_id)

    def ready(self, request: Request, hits: Sequence[int], others_run: bool) -> bool:
        """May `request` be admitted now (its arena prefix hits `hits`)? False while blocks of its prefix
        are coming back from the tier; a fetch is started here when the tier holds the blocks that follow.
        With no room to bring them back it waits while `others_run` (they free blocks as they end), else
        it is admitted as it is (recomputing)."""
        if request.request_id in self._fetching:
            return False
        self.flush()  # blocks an admission before it took from this request's prefix: in the tier now
        if not self.index:
            self._release(request.request_id)
            return True
        bs = self.blocks.block_size
        ids = request.all_ids
        full = (len(ids) - 1) // bs
        pos = len(hits)
        parent = self.blocks.blocks[hits[-1]].hash if hits else None
        found: list[tuple[int, bytes, tuple[int, bytes]]] = []
        for i, name in enumerate(self.blocks.chain_from(ids, pos, full, parent)):
            entry = self.index.get(name)
            if entry is None or entry[0] in self._busy:
                break
            found.append((pos + i, name, entry))
        if not found:
            self._release(request.request_id)  # all back in the arena: ordinary entries again
            return True
        fresh = self.blocks.cache.take_free(len(found))
        if fresh is None:
            return not others_run
        self.flush()  # what `fresh` held goes out before the copy overwrites it
        job = _Fetch(
            request.request_id,
            list(ids),
            [(slot, block, digest) for (_, _, (slot, digest)), block in zip(found, fresh, strict=True)],
            [p for p, _, _ in found],
            [n for _, n, _ in found],
        )
        self._busy.update(s for s, _, _ in job.pairs)
        self._fetching[request.request_id] = job
        self._jobs.put(job)
        return False

    def adopt(self, request_id: str, names: Sequence[bytes], skip: set[int]) -> list[int]:
        """A takeover: the dead worker's offloaded slots named by `names` (the request's leading full
        blocks) become ours, kept for it until it runs; `skip`: positions the arena covers. Returns the
        positions now in the index."""
        if len(self.index) >= self.cap:
            return []
        records = {r.content: r for r in self.book.offloaded(names) if r.content and r.hash}
        take: list[tuple[int, bytes, bytes]] = []
        positions = []
        for pos, name in enumerate(names):
            if pos in skip or name in self.index:
                continue
            record = records.get(name)
            if record is None or record.hash is None:
                break
            take.append((record.slot, record.hash, name))
            positions.append(pos)
        take = take[: self.cap - len(self.index)]
        if not take:
            return []
        try:
            self.book.adopt([(slot, digest) for slot, digest, _ in take])
        except LedgerError as exc:  # taken by someone else meanwhile: recomputed instead
            log.warning("offloaded blocks not adopted (%s)", exc)
            return []
        for slot, digest, name in take:
            self.index[name] = (slot, digest)
        self._keep(request_id, {name for _, _, name in take})
        return positions[: len(take)]

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5)
