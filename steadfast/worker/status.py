"""What the worker reports besides its outputs: its status figures (memory, the KV wire, the offload
tier) and what the router's KV-aware routing knows of this worker's prefix cache: the chained names of the
blocks it holds cached, sent as differences with each status report and whole every `RESET_S` (a
restarted router, or one that dropped an index past its bound, learns the full set again)."""

from __future__ import annotations

import os
from collections.abc import Iterable

from steadfast.wire.worker import CacheEvents
from steadfast.worker.engine import Engine

RESET_S = 30.0


class CacheReporter:
    def __init__(self, worker_id: int) -> None:
        self.worker_id = worker_id
        self._known: set[bytes] = set()
        self._next_reset = 0.0

    def events(self, names: Iterable[bytes], now: float) -> CacheEvents | None:
        """What changed since the last call (None: nothing), or the whole set when a reset is due."""
        current = set(names)
        if now >= self._next_reset:
            self._next_reset = now + RESET_S
            self._known = current
            return CacheEvents(self.worker_id, list(current), reset=True)
        stored, removed = current - self._known, self._known - current
        if not stored and not removed:
            return None
        self._known = current
        return CacheEvents(self.worker_id, list(stored), list(removed))


def rss_mb() -> float:
    """This process's resident memory in MiB (0 where /proc is not there)."""
    try:
        with open("/proc/self/statm") as f:
            resident = int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return 0.0
    return resident * os.sysconf("SC_PAGE_SIZE") / 2**20


def transport_status(e: Engine) -> dict[str, int]:
    """The status report's counts of the KV wire's sending side (the health check's transport layer)."""
    sender = e.kv.sender
    if sender is None:
        return {}
    return {"kv_messages_sent": sender.sent, "kv_resends": sender.resent, "kv_move_timeouts": sender.timeouts}


def wire_status(e: Engine) -> dict[str, dict[str, int]]:
    """The status report's counts of what the KV wire's receiver dropped and refused."""
    if e.kv.receiver is None:
        return {}
    dropped, refused = e.kv.receiver.counts()
    return {"kv_wire_dropped": dropped, "kv_wire_refused": refused}


def offload_status(e: Engine) -> dict[str, int]:
    """The status report's offload-tier and preemption counts."""
    s = e.scheduler
    counts = {
        "swap_preemptions": s.swap_preemptions,
        "recompute_preemptions": s.recompute_preemptions,
        "recomputed_tokens": s.recomputed_tokens,
    }
    if e.offload is not None:
        o = e.offload
        counts.update(kv_blocks_offloaded=len(o.index), offload_written=o.written, offload_fetched=o.fetched)
    return counts
