"""A KV transfer's state on the sender's thread (`kv/moves/sender.py`), and the one result it ends in."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from steadfast.kv.moves.sender_jobs import Layer, TransferOutcome, TransferResult
from steadfast.kv.moves.session import SourceSession


@dataclass
class Outgoing:
    """One transfer on the sender's thread: its paths, the parts given so far, the current session, and
    what its result will say."""

    request_id: str
    addresses: list[tuple[str, str]]  # (path name, address), in fallback order
    num_tokens: int
    n_blocks: int
    parts: list[Layer] = field(default_factory=list)  # part k of the copy stage is parts[k]
    path: int = 0  # index into addresses
    session: SourceSession | None = None  # the current path's
    sent: set[int] = field(default_factory=set)  # parts sent in the current session
    commit_wanted: bool = False
    asks: int = 0  # decisions asked for in the current session
    problem: str = ""  # what the current path's last answer said was wrong
    heartbeat: float = 0.0  # when the current session last told the destination it is alive
    alive: float = 0.0  # when the engine last gave this transfer a job or a touch
    errors: list[str] = field(default_factory=list)
    retries: int = 0
    fallbacks: int = 0
    bytes: int = 0
    t_commit: float = 0.0
    t_first: float = 0.0  # when the first frame went out
    probe: bool = False  # track what has landed (a copy in rounds)
    probed: int = 0  # parts sent in this session when the last probe went
    probe_at: float = 0.0
    landed: int = 0  # parts sent before the last probe the destination answered, in this session

    def result(self, outcome: TransferOutcome, block_ids: list[int]) -> TransferResult:
        """What the engine hears: how it ended, where, with what it cost."""
        now = time.perf_counter()
        t_commit = self.t_commit or now
        result = TransferResult(self.request_id, outcome, block_ids, retries=self.retries, fallbacks=self.fallbacks)
        result.bytes, result.seconds = self.bytes, now - t_commit
        if outcome is TransferOutcome.OK:
            result.path, result.stream_seconds = self.addresses[self.path][0], now - (self.t_first or t_commit)
        elif outcome is TransferOutcome.ABORTED:
            result.error = "aborted"
        else:
            result.error = "every path failed: " + "; ".join(self.errors[-3:])
        return result
