"""A block's bookkeeping record and the events that announce changes of its cached identity (the
hook the ledger consumes): shared by the block manager and its offload-tier part."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None
    tokens: tuple[int, ...] | None = None  # kept to check a hash hit token by token


@dataclass(frozen=True)
class BlockEvent:
    kind: Literal["stored", "removed", "released"]  # released: given back to the pool
    block_id: int
    hash: bytes
