"""The KV move wire between nodes: the move session's messages (`kv/moves/messages.py`) plus the frames that
carry a copy stage's bytes and the two messages that reach the destination node's ledger; their encoding
(msgspec msgpack, never pickle).

A source opens a session with PREALLOC; once RESERVED it sends `KVFrame`s (one layer's K and V for a span of
token positions, xxh3-64 checksummed; part `k` of copy stage `s`), each stage's `Copy` (how many parts it has),
then COMMIT. The destination acks with the stages and parts it still lacks, or prepared. The ledger that
records the decision is the destination node's (one ledger per node, whatever its store), so the source asks for it
with `AskDecision` and hears `Decision`, then tells the destination `Committed`. ABORT from either side. A
copy in rounds (a live migration) sends `Probe` after its frames and hears `Progress` once the destination
has handled every frame sent before it (one connection keeps order): it pauses the request for the last
round only when the earlier rounds have landed, so the pause never waits on them.

This module owns the message shapes only: it must never open a socket, touch an arena or decide a retry.
"""

from __future__ import annotations

import msgspec

from steadfast.kv.moves.messages import (
    Abort,
    Commit,
    CommitAck,
    Committed,
    Copy,
    MoveOutcome,
    Prealloc,
    Reserved,
)

MAX_MESSAGE_BYTES = 256 << 20  # a frame is one layer of one prefill chunk: far below this


class KVFrame(msgspec.Struct, frozen=True, tag=True, array_like=True):
    session: str
    stage: int
    part: int  # its index among the stage's parts (resends keep it)
    layer: int
    start: int  # first token position
    count: int
    checksum: int  # xxh3-64 of data
    # [2 (K, V), kv_heads, count, head_dim] in the arena dtype. A memoryview: a sender hands over a view of
    # its gathered array, and a decoded frame's is a view into the received message (no copy either way).
    data: memoryview


class AskDecision(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Record `proposal` for the session unless it is decided, and answer with what is recorded."""

    session: str
    proposal: MoveOutcome


class Decision(msgspec.Struct, frozen=True, tag=True, array_like=True):
    session: str
    outcome: MoveOutcome


class Probe(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Say when you have handled the `sent` frames I sent before this (answered with `Progress`)."""

    session: str
    sent: int


class Progress(msgspec.Struct, frozen=True, tag=True, array_like=True):
    session: str
    sent: int  # the probe's: frames before it were handled (written, or dropped as lost or corrupt)


ToDestination = Prealloc | KVFrame | Copy | Commit | Committed | Abort | AskDecision | Probe
ToSource = Reserved | CommitAck | Abort | Decision | Progress

_to_destination = msgspec.msgpack.Decoder(ToDestination)
_to_source = msgspec.msgpack.Decoder(ToSource)
_encoder = msgspec.msgpack.Encoder()


def encode(msg: ToDestination | ToSource) -> bytes:
    return _encoder.encode(msg)


def decode_to_destination(data: bytes) -> ToDestination:
    """A source's message; raises `msgspec.DecodeError` (or ValidationError) on bytes that are none."""
    return _to_destination.decode(data)


def decode_to_source(data: bytes) -> ToSource:
    return _to_source.decode(data)
