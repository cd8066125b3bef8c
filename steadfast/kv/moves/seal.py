"""Sealed data channel of one KV move session: AES-256-GCM over the session's messages after RESERVED.

CURVE (libsodium's XSalsa20-Poly1305 inside libzmq) costs ~1.2 ms of CPU per MB moved, both ends together:
about half of a cross-node migration's CPU, taken from the forward passes of the workers on both ends.
With CURVE on, the source therefore draws a fresh 256-bit key per session and sends it inside its PREALLOC,
on the CURVE connection (so only the deployment's receiver learns it, and the source knows whom it told);
the receiver answers RESERVED with the port of a plain TCP socket beside its CURVE one, and the
session's later messages go there sealed with that key (AES-GCM through OpenSSL: ~6-9 GB/s per core
here). Answers stay on the CURVE connection.

What holds the guarantees: a key is never used by two sessions; the nonce is the sender's message counter
(never repeated under one key); the session's name is authenticated with every message (no message moves
to another session); the receiver accepts a counter only above the last one it opened (a replayed or
reordered copy is dropped; the protocol's resends recover a dropped message). Anyone may connect to the
plain socket; what does not open under a live session's key is dropped before it is decoded.

This module owns the sealing only: it must never open a socket or know a message's shape.
"""

from __future__ import annotations

import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

KEY_BYTES = 32
NONCE_BYTES = 12


class SealError(ValueError):
    """A sealed message that does not open: wrong key, changed on the way, or replayed."""


def new_key() -> bytes:
    return os.urandom(KEY_BYTES)


class _Channel:
    def __init__(self, key: bytes, session: str) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"a session key is {KEY_BYTES} bytes, not {len(key)}")
        self._aead, self._aad = AESGCM(key), session.encode()


class Sealer(_Channel):
    """The source's side of one session's channel."""

    _counter = 0  # the last message's

    def seal(self, plaintext: bytes | memoryview) -> tuple[bytes, bytes]:
        """(nonce, ciphertext with its tag) of the session's next message."""
        self._counter += 1
        nonce = self._counter.to_bytes(NONCE_BYTES, "big")
        return nonce, self._aead.encrypt(nonce, plaintext, self._aad)


class Opener(_Channel):
    """The destination's side of one session's channel."""

    _last = 0  # the highest counter opened

    def open(self, nonce: bytes | memoryview, ciphertext: bytes | memoryview) -> bytes:
        """The plaintext of a message sealed for this session after the last one opened; else SealError."""
        if len(nonce) != NONCE_BYTES:
            raise SealError(f"a nonce is {NONCE_BYTES} bytes, not {len(nonce)}")
        counter = int.from_bytes(nonce, "big")
        if counter <= self._last:
            raise SealError(f"message {counter} is not after {self._last}: replayed or reordered")
        try:
            plaintext = self._aead.decrypt(bytes(nonce), ciphertext, self._aad)
        except InvalidTag as exc:
            raise SealError("does not open under the session's key") from exc
        self._last = counter
        return plaintext
