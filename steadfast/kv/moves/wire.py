"""The KV transfer wire: the messages a prefill worker's sender and a decode worker's receiver exchange,
and their encoding (msgspec msgpack, never pickle).

A transfer is `KVChunk`s, each one layer's K and V for a span of token positions with an xxh3-64
checksum, then a `KVCommit` listing every span sent. The receiver answers `KVAck`: complete (with the
block ids that now hold the KV), or the chunks still missing or corrupt, which the sender resends.
`KVAbort` tells the receiver to free what it granted.

This module owns the message shapes only: it must never open a socket, touch an arena or decide a retry.
"""

from __future__ import annotations

import msgspec


class KVChunk(msgspec.Struct, tag="chunk", array_like=True):
    request_id: str
    attempt: int  # a new attempt (another path) starts clean: older chunks are ignored
    layer: int
    start: int  # first token position
    count: int
    num_tokens: int  # tokens of KV the whole transfer carries
    checksum: int  # xxh3-64 of data
    data: bytes  # [2 (K, V), kv_heads, count, head_dim] in the arena dtype


class KVCommit(msgspec.Struct, tag="commit", array_like=True):
    request_id: str
    attempt: int
    num_tokens: int
    num_layers: int
    spans: list[tuple[int, int]]  # (start, count) of every span, each sent for every layer


class KVAbort(msgspec.Struct, tag="abort", array_like=True):
    """The sender gives the transfer up: the receiver frees what it granted for it."""

    request_id: str


class KVAck(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    attempt: int
    ok: bool
    block_ids: list[int] = []
    missing: list[tuple[int, int]] = []  # (layer, start) to send again
    error: str = ""


ToReceiver = KVChunk | KVCommit | KVAbort

_to_receiver = msgspec.msgpack.Decoder(ToReceiver)
_ack = msgspec.msgpack.Decoder(KVAck)
_encoder = msgspec.msgpack.Encoder()


def encode(msg: KVChunk | KVCommit | KVAbort | KVAck) -> bytes:
    return _encoder.encode(msg)


def decode_to_receiver(data: bytes) -> ToReceiver:
    """A sender's message; raises `msgspec.DecodeError` on bytes that are none."""
    return _to_receiver.decode(data)


def decode_ack(data: bytes) -> KVAck:
    return _ack.decode(data)
