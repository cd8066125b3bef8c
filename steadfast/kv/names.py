"""Chained content names of full KV blocks: a block's name depends on every token before it, so two
requests with the same prefix name the same blocks. The worker's prefix cache, the ledger's sealed
blocks and the router's cache-aware routing all name blocks this way; nothing here holds state."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

ROOT_HASH = b"steadfast-kv-root"


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Chained content name of a full block: depends on every token before it, not just its own."""
    return hashlib.blake2b(parent + np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()


def chain(token_ids: Sequence[int], block_size: int, count: int) -> list[bytes]:
    """The chained names of the first `count` full blocks of `token_ids` (what the router's KV-aware
    routing looks up in the workers' cache events)."""
    names, parent = [], ROOT_HASH
    for i in range(count):
        parent = block_hash(parent, token_ids[i * block_size : (i + 1) * block_size])
        names.append(parent)
    return names
