"""An arena's memory made as it is needed: blocks `[0, made)` backed, the rest a hole in the file.

A node's arena is as large as its operator allows (1 GiB by default), but an idle or lightly used
server needs a small part of it. The kvpool hands out never-used blocks in id order (the ledger's
`grant`, `below`), so the blocks in use form a prefix, and only that prefix and a margin ahead of it
(`cache.kv_ahead_mb`) need memory:

- `Reserved`, in the kvpool: the file's pages of blocks `[0, made)` allocated (`fallocate`, which on a
  tmpfs fails with ENOSPC rather than leaving a page that kills its toucher with SIGBUS later). The pool
  grants no block at or past `made`, so no process ever touches a page that is not reserved.
- `Populated`, in a worker mapping such an arena: its page tables filled as far as the pool has made the
  arena (`PoolReply.made`, in every grant's answer; `MADV_POPULATE_WRITE` in small calls, `pages.py`),
  so no step pays a first touch (`resident.py`), whoever of the node's workers was granted the block.

Both grow the prefix in the background (`want`) or at once (`ensure`), a chunk at a time under one lock.
A block's bytes are strided over every (layer, K/V, head) plane of the arena (`ArenaSpec.shape`), so
blocks `[lo, hi)` are one span per plane, merged where they touch.
"""

from __future__ import annotations

import abc
import errno
import logging
import mmap
import os
import threading
import time

from steadfast.kv.arena.pages import populate_range
from steadfast.kv.arena.spec import DTYPE_BYTES, ArenaSpec

log = logging.getLogger(__name__)

CHUNK_BYTES = 64 << 20  # made per step: bounds how long the lock is held
RETRY_S = 10.0  # after a failure (no memory), how long before the prefix tries to grow again


def spans(spec: ArenaSpec, lo: int, hi: int) -> list[tuple[int, int]]:
    """Byte ranges `(offset, length)` of the arena file holding blocks `[lo, hi)`, widened to whole
    pages and merged where they touch."""
    if hi <= lo:
        return []
    strip = spec.block_size * spec.head_dim * DTYPE_BYTES[spec.dtype]  # one block in one plane
    plane = strip * spec.num_blocks
    page = mmap.PAGESIZE
    out: list[tuple[int, int]] = []
    for p in range(spec.num_layers * 2 * spec.num_kv_heads):
        start = (p * plane + lo * strip) // page * page
        end = min(-(-(p * plane + hi * strip) // page) * page, spec.nbytes)
        if out and start <= out[-1][0] + out[-1][1]:
            out[-1] = (out[-1][0], end - out[-1][0])
        else:
            out.append((start, end - start))
    return out


class BlockPrefix(abc.ABC):
    """Blocks `[0, made)` of an arena made (whatever `_make` does), grown on request."""

    def __init__(self, spec: ArenaSpec, name: str) -> None:
        self.spec, self.name = spec, name
        self.made = 0
        self._target = 0
        self._failed_at = -RETRY_S
        self._lock = threading.Lock()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._step = max(1, CHUNK_BYTES // spec.block_bytes)

    @abc.abstractmethod
    def _make(self, lo: int, hi: int) -> None:
        """Make blocks `[lo, hi)`; OSError if they cannot be."""

    def want(self, blocks: int) -> None:
        """Grow to `blocks` (at most the arena) in the background."""
        blocks = min(blocks, self.spec.num_blocks)
        with self._wake:
            if blocks <= self._target:
                return
            self._target = blocks
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"arena-prefix-{self.name}", daemon=True)
                self._thread.start()
            self._wake.notify()

    def ensure(self, blocks: int) -> int:
        """Grow to `blocks` now (what the background has not made yet); returns `made`, which is less
        when the memory could not be had."""
        blocks = min(blocks, self.spec.num_blocks)
        while self.made < blocks and self._grow(blocks):
            pass
        return self.made

    def _grow(self, blocks: int) -> bool:
        """One chunk towards `blocks`; False when it cannot go on (done, or failed recently)."""
        with self._lock:
            lo = self.made
            if lo >= blocks or time.monotonic() - self._failed_at < RETRY_S:
                return False
            hi = min(blocks, lo + self._step)
            try:
                self._make(lo, hi)
            except OSError as exc:
                self._failed_at = time.monotonic()
                log.warning(
                    "KV arena %s: blocks %d-%d not made (%s); %d of %d usable for now",
                    self.name,
                    lo,
                    hi - 1,
                    exc,
                    lo,
                    self.spec.num_blocks,
                )
                return False
            self.made = hi
            return True

    def _run(self) -> None:
        # At normal priority: a thread starved while inside a populate call would hold the mmap_lock the
        # engine thread's allocations wait for (`pages.CHUNK_BYTES`).
        while True:
            with self._wake:
                while self.made >= self._target:
                    self._wake.wait()
                target = self._target
            if not self._grow(target) and self.made < target:
                time.sleep(1.0)  # failed: `_grow` refuses until RETRY_S has passed


class Reserved(BlockPrefix):
    """The kvpool's side: the arena file's pages of the prefix allocated (`fd` stays open for it)."""

    def __init__(self, fd: int, spec: ArenaSpec, name: str) -> None:
        super().__init__(spec, name)
        self.fd = fd

    def _make(self, lo: int, hi: int) -> None:
        for offset, length in spans(self.spec, lo, hi):
            os.posix_fallocate(self.fd, offset, length)


class Populated(BlockPrefix):
    """A worker's side: its mapping (at `address`) of the prefix populated. An old kernel without
    `MADV_POPULATE_WRITE` leaves the pages to fault in on first touch."""

    def __init__(self, address: int, spec: ArenaSpec, name: str) -> None:
        super().__init__(spec, name)
        self.address = address
        self._unsupported = False

    def _make(self, lo: int, hi: int) -> None:
        if self._unsupported:
            return
        try:
            for offset, length in spans(self.spec, lo, hi):
                populate_range(self.address + offset, length)
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # a kernel older than 5.14
                raise
            self._unsupported = True
            log.info("KV arena %s: pages fault in on first touch (no MADV_POPULATE_WRITE)", self.name)
