"""The one msgpack encoder every wire shares (decoders are per channel: each knows its message union)."""

from __future__ import annotations

import msgspec

_encoder = msgspec.msgpack.Encoder()


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)
