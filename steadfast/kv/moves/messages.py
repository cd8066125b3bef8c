"""The vocabulary of a KV move session (ARCHITECTURE.md §4): its kinds, states and outcomes, the messages a
source and a destination exchange, and the actions a session asks its caller to perform.

Messages are msgspec Structs, tagged by class name, so the same objects the state machine returns travel
on the wire (`kv/moves/wire.py` encodes them; never pickle). Actions stay in the process. This module owns
shapes only: no logic, no I/O.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import dataclass_transform

import msgspec


class MoveKind(enum.StrEnum):
    HANDOFF = "handoff"  # same node: the ledger owner changes, no byte moves (zero blocks, zero stages)
    TRANSFER = "transfer"  # prefill -> decode across nodes
    MIGRATION = "migration"  # decode -> decode: stages of sealed blocks, then stop-and-copy
    OFFLOAD = "offload"  # to or from a slower tier


class MoveOutcome(enum.StrEnum):
    COMMITTED = "committed"
    ABORTED = "aborted"


class AbortReason(enum.StrEnum):
    SOURCE_ABORT = "source_abort"
    DESTINATION_ABORT = "destination_abort"
    NO_ROOM = "no_room"
    BUSY = "busy"  # the destination holds as many incoming moves as it takes at once
    TIMEOUT = "timeout"
    SOURCE_VANISHED = "source_vanished"
    REQUEST_ENDED = "request_ended"
    PATH_FAILED = "path_failed"


class SourceState(enum.StrEnum):
    IDLE = "idle"
    PREALLOCATING = "preallocating"  # PREALLOC sent, waiting for RESERVED
    COPYING = "copying"  # copy stages; the request runs until the final copy pauses it
    COMMITTING = "committing"  # COMMIT sent, waiting for the ack
    DECIDING = "deciding"  # acked; the ledger's decision is being asked for
    COMMITTED = "committed"
    ABORTED = "aborted"


class DestinationState(enum.StrEnum):
    NEW = "new"
    RESERVING = "reserving"  # asked the pool for blocks
    RESERVED = "reserved"
    RECEIVING = "receiving"
    PREPARED = "prepared"  # verified and acked; holds the reservation, must not run the request
    COMMITTED = "committed"
    ABORTED = "aborted"


class MoveProtocolError(RuntimeError):
    """A call that is invalid in the session's state, or a message that contradicts the protocol."""


# --- messages (source <-> destination) ---------------------------------------------------------------
class _Message(msgspec.Struct, frozen=True, tag=True, array_like=True):
    session: str


class Prealloc(_Message, frozen=True):
    n_blocks: int
    # The session's data-channel key (`kv/moves/seal.py`), set by a CURVE transport; empty: no channel.
    seal_key: bytes = b""


class Reserved(_Message, frozen=True):
    block_ids: tuple[int, ...]
    # The port, on this connection's host, where the session's later messages go sealed (set by a
    # receiver that got a key); 0: they come here.
    data_port: int = 0


class Copy(_Message, frozen=True):
    stage: int
    positions: tuple[int, ...]  # indices into the request's block table; position i lands in block_ids[i]
    final: bool
    parts: int = 0  # data frames that carry the stage's bytes (0: none, or the transport does not split it)


class Commit(_Message, frozen=True):
    attempt: int
    stages: int  # copy stages sent: the destination checks it has every one


class CommitAck(_Message, frozen=True):
    attempt: int
    missing: tuple[int, ...] = ()  # stages to send again; empty: prepared
    parts: tuple[tuple[int, int], ...] = ()  # (stage, part) frames missing of those stages; none named: all


class Committed(_Message, frozen=True): ...  # the ledger recorded COMMITTED: the destination may run the request


class Abort(_Message, frozen=True):
    reason: AbortReason


Message = Prealloc | Reserved | Copy | Commit | CommitAck | Committed | Abort


# --- actions (what the caller must do) ---------------------------------------------------------------
@dataclass_transform(frozen_default=True)
class _Frozen:
    """Every subclass is a frozen dataclass."""

    def __init_subclass__(cls) -> None:
        dataclass(frozen=True)(cls)


class Send(_Frozen):
    message: Message


class Reserve(_Frozen):
    n_blocks: int  # grant blocks RESERVED(session, destination); answer with on_granted


class Release(_Frozen):
    block_ids: tuple[int, ...]  # give the reservation back to the pool


class Decide(_Frozen):
    """One idempotent ledger transaction, retried until it answers: if the session is undecided, record
    `proposal` (COMMITTED also records owner := destination). Answer with on_decided(the recorded decision)."""

    session: str
    proposal: MoveOutcome


class PauseRequest(_Frozen): ...  # stop generating tokens for the request (source side, final copy only)


class ResumeAtSource(_Frozen):
    reason: AbortReason  # the move failed: the source keeps (and, if paused, resumes) the request


class LetGo(_Frozen): ...  # the ledger owner is the destination: the source drops the request and frees its old blocks


class Adopt(_Frozen):
    block_ids: tuple[int, ...]  # the destination runs the request on these blocks from now on


Action = Send | Reserve | Release | Decide | PauseRequest | ResumeAtSource | LetGo | Adopt
