"""Worker <-> kvpool daemon, request and reply: msgspec structs, tagged, array-like; never pickled."""

from __future__ import annotations

import msgspec


class PoolRegister(msgspec.Struct, tag="register", array_like=True):
    worker: str
    pid: int


class PoolAttach(msgspec.Struct, tag="attach", array_like=True):
    """Where the arena and ledger are, without taking a lease: for inspectors and standbys."""

    pid: int


class PoolFence(msgspec.Struct, tag="fence", array_like=True):
    """From the supervisor, which reaped `pid`: fence the worker now and reclaim its blocks."""

    worker: str
    pid: int


class PoolGrant(msgspec.Struct, tag="grant", array_like=True):
    worker: str
    epoch: int
    count: int


class PoolRelease(msgspec.Struct, tag="release", array_like=True):
    worker: str
    epoch: int
    block_ids: list[int]


class CudaIpcHandle(msgspec.Struct, array_like=True):
    """What a process needs to map a CUDA arena another process allocated (torch's IPC triple plus
    the arena's spec). Plain bytes and ints: it travels in msgpack, never pickled."""

    device: int
    handle: bytes
    size_bytes: int
    offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    spec_json: str


class PoolReply(msgspec.Struct, array_like=True, omit_defaults=True):
    ok: bool
    epoch: int = 0
    block_ids: list[int] = []
    arena_path: str = ""  # a file arena; empty when the arena is device memory (see cuda_ipc)
    ledger_url: str = ""  # the node's ledger (see steadfast.kv.ledger.open)
    error: str = ""
    fenced: bool = False
    cuda_ipc: CudaIpcHandle | None = None
    tier: str = ""  # the node's offload tier (cache.offload_tier), empty when there is none
    tier_path: str = ""  # its file, made by the pool
    made: int = 0  # a file arena made as it is used: blocks [0, made) have their memory (0: all of them)


ToPool = PoolRegister | PoolAttach | PoolFence | PoolGrant | PoolRelease
_to_pool = msgspec.msgpack.Decoder(ToPool)
_pool_reply = msgspec.msgpack.Decoder(PoolReply)


def decode_to_pool(data: bytes) -> ToPool:
    return _to_pool.decode(data)


def decode_pool_reply(data: bytes) -> PoolReply:
    return _pool_reply.decode(data)
