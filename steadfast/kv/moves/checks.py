"""What an incoming KV move may ask of a receiver: the limits on moves held at once, the bounds every
message field must keep before the session state machine sees it, the check of each frame against its
session, and the completeness check before a session may prepare.

Pure functions and shapes: this module must never touch a socket, an arena or a session's state; the
receiver (`kv/moves/receiver.py`) acts on what it answers.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

from steadfast.config import TransferConfig
from steadfast.kv.arena.spec import ArenaSpec
from steadfast.kv.moves.messages import Commit, Copy, Prealloc
from steadfast.kv.moves.seal import KEY_BYTES
from steadfast.kv.moves.wire import MAX_MESSAGE_BYTES, KVFrame, Probe, ToDestination

MAX_STAGES = 64  # copy stages a session may have: far more than any move makes
MAX_PARTS = 1 << 16  # frames a stage may have: layers x chunks of the longest prompt, with room
ENVELOPE_BYTES = 64 << 10  # a frame's fields around its data (the session name is the only long one)


class Drop(enum.StrEnum):
    """Why a receiver dropped a message (counted in `KVReceiver.dropped`, logged rate-limited)."""

    UNDECODABLE = "undecodable"  # not a source's message at all
    OUT_OF_RANGE = "out_of_range"  # a field no session may have (stages, parts, no blocks)
    WRONG_PEER = "wrong_peer"  # for a session another connection opened: never written (the peer is told ABORT)
    LAYER = "layer"  # a layer the arena does not have
    SPAN = "span"  # tokens outside the session's reserved blocks
    SIZE = "size"  # data that is not `count` tokens of one layer
    PART = "part"  # a part index beyond the parts the stage announced
    CHECKSUM = "checksum"  # corrupt on the way: the ack names it, the source resends
    UNSEALED = "unsealed"  # on the data channel, and does not open under a live session's key (or replayed)
    PROTOCOL = "protocol"  # contradicts its session (the state machine refused it)
    INCOMPLETE = "incomplete"  # every part came, yet some layer lacks tokens: the session is aborted


@dataclass(frozen=True)
class IncomingLimits:
    """How much incoming moves may hold at once before they are committed."""

    sessions: int  # moves reserving or holding blocks here
    blocks: int  # blocks those hold together

    @classmethod
    def of(cls, t: TransferConfig, arena_blocks: int) -> IncomingLimits:
        return cls(t.max_incoming, max(1, int(arena_blocks * t.max_reserved_fraction)))


def token_bytes(spec: ArenaSpec) -> int:
    """One token's K and V in one layer: the bytes a frame carries per token."""
    return spec.block_bytes // (spec.num_layers * spec.block_size)


def max_message_bytes(spec: ArenaSpec) -> int:
    """No frame carries more than one layer of the whole arena; a bigger message is not a source's."""
    return min(MAX_MESSAGE_BYTES, spec.num_blocks * spec.block_size * token_bytes(spec) + ENVELOPE_BYTES)


def message_problem(msg: ToDestination) -> Drop | None:
    """A field outside what any session may have: such a message never reaches the state machine (a COMMIT
    naming 10^12 stages would have it count them). More blocks than the arena has is no room, not this."""
    match msg:
        case Prealloc(n_blocks=n, seal_key=key):
            return None if n > 0 and len(key) in (0, KEY_BYTES) else Drop.OUT_OF_RANGE
        case Copy(stage=stage, parts=parts):
            return None if 0 <= stage < MAX_STAGES and 0 <= parts <= MAX_PARTS else Drop.OUT_OF_RANGE
        case Commit(stages=stages):
            return None if 0 <= stages <= MAX_STAGES else Drop.OUT_OF_RANGE
        case KVFrame(stage=stage, part=part):
            return None if 0 <= stage < MAX_STAGES and 0 <= part < MAX_PARTS else Drop.OUT_OF_RANGE
        case Probe(sent=sent):
            return None if 0 <= sent <= MAX_PARTS else Drop.OUT_OF_RANGE
    return None


def frame_problem(f: KVFrame, spec: ArenaSpec, n_blocks: int, parts: int | None) -> Drop | None:
    """What is wrong with frame `f` of a session holding `n_blocks` blocks whose stage announced `parts`
    parts (None: its manifest has not come yet), checksum aside."""
    if not 0 <= f.layer < spec.num_layers:
        return Drop.LAYER
    if not (f.start >= 0 and 0 < f.count <= n_blocks * spec.block_size - f.start):
        return Drop.SPAN
    if len(f.data) != f.count * token_bytes(spec):
        return Drop.SIZE
    if parts is not None and f.part >= parts:
        return Drop.PART
    return None


def covers(spans: Iterable[tuple[int, int, int]], num_layers: int, n_blocks: int, block_size: int) -> bool:
    """Whether `spans` ((layer, start, count) of verified frames) give every layer every token from 0 to one
    common end that lies in the last reserved block: nothing a prepared session holds is stale bytes of
    whatever the blocks held before."""
    by_layer: dict[int, list[tuple[int, int]]] = {}
    for layer, start, count in spans:
        by_layer.setdefault(layer, []).append((start, start + count))
    ends = set()
    for layer in range(num_layers):
        end = 0
        for start, stop in sorted(by_layer.get(layer, ())):
            if start > end:
                break
            end = max(end, stop)
        ends.add(end)
    return len(ends) == 1 and (n_blocks - 1) * block_size < ends.pop() <= n_blocks * block_size


class RateLimitedLog:
    """At most one line per kind every `interval_s`; the next line says how many were held back. A peer
    sending junk must not fill the disk with tracebacks."""

    def __init__(self, logger: logging.Logger, interval_s: float = 5.0) -> None:
        self.logger, self.interval_s = logger, interval_s
        self._last: dict[enum.Enum, float] = {}
        self._held: dict[enum.Enum, int] = {}

    def warning(self, kind: enum.Enum, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last.get(kind, -float("inf")) < self.interval_s:
            self._held[kind] = self._held.get(kind, 0) + 1
            return
        self._last[kind] = now
        held = self._held.pop(kind, 0)
        self.logger.warning(msg + (f" ({held} more like it not logged)" if held else ""), *args, stacklevel=3)
