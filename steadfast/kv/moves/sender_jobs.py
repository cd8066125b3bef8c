"""The interface between the engine thread and the KV sender's thread: the jobs the engine queues (begin,
a layer's bytes, commit, abort, give up, a touch) and the one `TransferResult` each transfer ends in.

Shapes only: the sender (`kv/moves/sender.py`) owns what is done with them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class TransferOutcome(enum.Enum):
    OK = "ok"
    ABORTED = "aborted"  # the caller gave it up (its request ended first): nothing to fall back from
    FAILED = "failed"  # every path failed, or the sender broke: the caller falls back


@dataclass
class TransferResult:
    request_id: str
    outcome: TransferOutcome
    block_ids: list[int] = field(default_factory=list)
    path: str = ""  # the path that delivered it
    retries: int = 0  # resends beyond the first try (PREALLOC, frames, COMMIT, decision)
    fallbacks: int = 0  # paths given up on
    bytes: int = 0
    seconds: float = 0.0  # commit → acknowledged
    error: str = ""
    stream_seconds: float = 0.0  # first frame sent → acknowledged

    @property
    def ok(self) -> bool:
        return self.outcome is TransferOutcome.OK


# --- jobs the engine thread queues for the sender thread ---------------------------------------------
@dataclass(frozen=True)
class Begin:
    request_id: str
    addresses: list[tuple[str, str]]
    num_tokens: int
    probe: bool = False  # ask the destination how much has landed (`KVSender.landed`)


@dataclass(frozen=True)
class Layer:
    request_id: str
    layer: int
    start: int
    count: int
    data: memoryview  # a view of the engine's copy (`kv/moves/packing.py`), never of the arena itself
    stream: bool


@dataclass(frozen=True)
class CommitJob:
    request_id: str


@dataclass(frozen=True)
class AbortJob:
    request_id: str


@dataclass(frozen=True)
class GiveUp:
    """The destination is known gone: end the transfer FAILED now, every path skipped (they all lead to it)."""

    request_id: str
    why: str


@dataclass(frozen=True)
class Touch:
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class Batch:
    """Several jobs of one move handed over at once: one wake-up of the sender's thread, not one each
    (each wake-up takes the GIL from the engine thread that queued it)."""

    jobs: tuple[Layer | CommitJob, ...]


Job = Begin | Layer | CommitJob | AbortJob | GiveUp | Touch | Stop | Batch
