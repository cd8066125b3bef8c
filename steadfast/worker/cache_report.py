"""What the router's KV-aware routing knows of this worker's prefix cache: the chained names of the
blocks it holds cached, sent as differences with each status report and whole every `RESET_S` (a
restarted router, or one that dropped an index past its bound, learns the full set again)."""

from __future__ import annotations

from collections.abc import Iterable

from steadfast.protocol import CacheEvents

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
