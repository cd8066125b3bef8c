"""The retry policy of KV moves: how many times an attempt is repeated on one path and how long to wait
before each repeat (exponential backoff: `backoff_s`, then twice that, ...).

This module owns the timing only: it must never decide what counts as a failure or what is resent.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class RetryPolicy:
    retries: int  # repeats after the first try
    backoff_s: float  # the wait before the first repeat; each later one doubles

    def __post_init__(self) -> None:
        if self.retries < 0 or self.backoff_s < 0:
            raise ValueError(f"retries and backoff_s must be >= 0, got {self.retries}, {self.backoff_s}")

    def wait(self, attempt: int) -> float:
        """The wait that follows try `attempt` (0 = the first): `backoff_s * 2**attempt`."""
        return self.backoff_s * 2**attempt

    def delays(self) -> list[float]:
        """The wait before each repeat, in order."""
        return [self.wait(attempt) for attempt in range(self.retries)]

    def sleep(self, attempt: int) -> None:
        """Back off after failed try `attempt` (0 = the first), before the next one."""
        time.sleep(self.delays()[attempt])

    def tries(self) -> Iterator[int]:
        """0, 1, ... `retries`, backing off before each repeat; a caller done early just stops iterating
        (no wait after the last try, nor after one that settled it)."""
        for attempt in range(self.retries + 1):
            if attempt:
                self.sleep(attempt - 1)
            yield attempt
