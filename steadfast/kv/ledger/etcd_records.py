"""The etcd ledger's keys and values: where each record lives under a ledger's prefix, and its encoding.

    {prefix}/epoch                  the epoch counter (decimal)
    {prefix}/format                 how many blocks the arena has (decimal), written once
    {prefix}/blocks/{group:08d}     GROUP blocks' records, one msgpack list (a handful of keys, not one per block:
                                    a grant of 64 blocks is one or two writes, within etcd's 128 per transaction)
    {prefix}/lease/{worker}         a worker's lease: epoch, pid, state, TTL, the etcd lease behind it
    {prefix}/alive/{worker}         the epoch it holds live, attached to that etcd lease: gone when etcd's clock
                                    says it expired, and deleted by a fence or a release
    {prefix}/req/{request id}       a request's checkpoint: what changes as it runs (tokens, owner, phase)
    {prefix}/body/{request id}/{k:06d}  part k of its body (prompt ids, sampling parameters), written once and
                                    cut into BODY_PART bytes: no value nears etcd's request limit, however
                                    long the prompt or the stop strings, and no checkpoint writes it again
    {prefix}/move/{session}         a KV move's decision, attached to an hour-long etcd lease
    {prefix}/tier/{tier}            how many slots the offload tier has
    {prefix}/slots/{tier}/{group}   GROUP slots' records

Values are msgspec msgpack, array-like (fields by position): compact, and no pickle anywhere.
"""

from __future__ import annotations

from urllib.parse import quote, unquote

import msgspec

GROUP = 64  # blocks (or slots) per key
BODY_PART = 256 * 1024  # bytes of a request's body per key


class LeaseRec(msgspec.Struct, array_like=True):
    epoch: int
    pid: int
    state: str  # LeaseState's value
    ttl: int  # seconds, as etcd granted them
    etcd_lease: int  # the etcd lease `alive/{worker}` is attached to (0: none)


class BlockRec(msgspec.Struct, array_like=True, omit_defaults=True):
    state: str  # BlockState's value
    owner: str | None = None
    epoch: int | None = None
    request: str | None = None
    refs: int = 0
    hash: bytes | None = None
    tier: str | None = None
    content: bytes | None = None


class SlotRec(msgspec.Struct, array_like=True, omit_defaults=True):
    state: str
    owner: str | None = None
    epoch: int | None = None
    origin: str | None = None
    hash: bytes | None = None
    content: bytes | None = None


class RequestRec(msgspec.Struct, array_like=True):
    prompt: list[int]  # empty: in the body's keys (inline only in rows written before bodies were kept apart)
    params: str
    generated: list[int]
    delivered: int
    owner: str | None
    epoch: int | None
    phase: str
    blocks: list[int]
    updated: float  # wall clock
    body: int = 0  # parts of its body under body/{request id}/; 0: none written yet (or inline, as above)


class BodyRec(msgspec.Struct, array_like=True):
    """What a request was asked with, the same at every checkpoint: kept once, apart from its row."""

    prompt: list[int]
    params: str


class MoveRec(msgspec.Struct, array_like=True):
    outcome: str  # MoveOutcome's value
    worker: str


_encoder = msgspec.msgpack.Encoder()
_block_group = msgspec.msgpack.Decoder(list[BlockRec])
_slot_group = msgspec.msgpack.Decoder(list[SlotRec])
_lease = msgspec.msgpack.Decoder(LeaseRec)
_request = msgspec.msgpack.Decoder(RequestRec)
_move = msgspec.msgpack.Decoder(MoveRec)
_body = msgspec.msgpack.Decoder(BodyRec)


def encode(value: object) -> bytes:
    return _encoder.encode(value)


def blocks_of(raw: bytes) -> list[BlockRec]:
    return _block_group.decode(raw)


def slots_of(raw: bytes) -> list[SlotRec]:
    return _slot_group.decode(raw)


def lease_of(raw: bytes) -> LeaseRec:
    return _lease.decode(raw)


def request_of(raw: bytes) -> RequestRec:
    return _request.decode(raw)


def move_of(raw: bytes) -> MoveRec:
    return _move.decode(raw)


def body_parts(body: BodyRec) -> list[bytes]:
    """`body` encoded and cut into values of at most BODY_PART bytes."""
    raw = encode(body)
    return [raw[i : i + BODY_PART] for i in range(0, len(raw), BODY_PART)]


def body_of(parts: list[bytes]) -> BodyRec:
    return _body.decode(b"".join(parts))


class Keys:
    """The keys of one ledger, all under `prefix` (a node's namespace in a shared cluster)."""

    def __init__(self, prefix: str) -> None:
        self.root = prefix.rstrip("/").encode() + b"/"
        self.epoch = self.root + b"epoch"
        self.format = self.root + b"format"
        self.blocks = self.root + b"blocks/"
        self.lease_dir = self.root + b"lease/"
        self.alive_dir = self.root + b"alive/"
        self.req_dir = self.root + b"req/"
        self.body_dir = self.root + b"body/"
        self.move_dir = self.root + b"move/"
        self.tier_dir = self.root + b"tier/"

    def group(self, index: int) -> bytes:
        return self.blocks + b"%08d" % index

    def lease(self, worker: str) -> bytes:
        return self.lease_dir + _name(worker)

    def alive(self, worker: str) -> bytes:
        return self.alive_dir + _name(worker)

    def request(self, request_id: str) -> bytes:
        return self.req_dir + _name(request_id)

    def body(self, request_id: str) -> bytes:
        """The prefix of a request's body parts."""
        return self.body_dir + _name(request_id) + b"/"

    def body_part(self, request_id: str, index: int) -> bytes:
        return self.body(request_id) + b"%06d" % index

    def move(self, session: str) -> bytes:
        return self.move_dir + _name(session)

    def tier(self, tier: str) -> bytes:
        return self.tier_dir + _name(tier)

    def slots(self, tier: str) -> bytes:
        return self.root + b"slots/" + _name(tier) + b"/"

    def slot_group(self, tier: str, index: int) -> bytes:
        return self.slots(tier) + b"%08d" % index

    def name_in(self, directory: bytes, key: bytes) -> str:
        """The worker, request or tier name a key of `directory` was made from."""
        return unquote(key[len(directory) :].decode())


def _name(name: str) -> bytes:
    # Percent-quoted, '/' included: a name never reaches into another record's keys.
    return quote(name, safe="").encode()
