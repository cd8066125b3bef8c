"""The replicated ledger backend: the `Ledger` interface on an etcd cluster, for deployments across nodes.

Every operation is an optimistic etcd transaction (`etcd_tx.atomically`): it reads the records it
decides on, and commits its writes only if none of them changed meanwhile, so an epoch check and the
write it guards land together or not at all, judged by etcd itself. A worker's lease is an etcd lease:
`alive/{worker}` holds its epoch, attached to that lease, and vanishes when etcd's clock says the lease
expired; every write compares on it, so a worker whose lease lapsed, or that was fenced, is refused by
etcd whatever its own clock says. `clock` only dates the `expires` this backend reports (a live lease:
now + its TTL; a lapsed one: -inf), never decides liveness. Leases are whole seconds on etcd (its TTLs
are integers, raised to its minimum of 1.5 election timeouts), and a renewal restores the TTL granted.

Operations that may exceed one transaction's 128 operations (format, a replaced arena, reclaim) run in
parts, each safe alone: the records they change are ones no live worker may write. A checkpoint's rows
go in transactions of at most CHECKPOINT_ROWS rows and TXN_BYTES bytes (etcd refuses a request past its
`--max-request-bytes`, 1.5 MiB by default), each request's body (prompt, sampling parameters) once, in
parts of `etcd_records.BODY_PART` bytes: however long a prompt or its stop strings, and however many
rows, no transaction nears the limit. Nothing outside this module sees etcd's errors: they leave as
`LedgerUnavailableError` (no quorum in time) or `LedgerError`.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

from steadfast.kv.ledger.etcd_leases import EtcdLeases
from steadfast.kv.ledger.etcd_records import (
    GROUP,
    BlockRec,
    Keys,
    MoveRec,
    blocks_of,
    encode,
    lease_of,
    move_of,
    request_of,
)
from steadfast.kv.ledger.etcd_requests import EtcdRequests
from steadfast.kv.ledger.etcd_slots import EtcdSlots
from steadfast.kv.ledger.etcd_tx import ReadCache, Tx, atomically
from steadfast.kv.ledger.interface import (
    BlockRecord,
    BlockState,
    FencedError,
    LeaseState,
    Ledger,
    LedgerError,
    LedgerUnavailableError,
    ReceiverGoneError,
    Seal,
)
from steadfast.kv.moves.messages import MoveOutcome
from steadfast.util.etcd import EtcdClient, EtcdError, EtcdUnavailableError

T = TypeVar("T")

MOVE_RECORD_S = 3600  # a move's decision is kept at least this long (an etcd lease of twice it, renewed hourly)
PARTS = 100  # group keys per transaction where an operation runs in parts

_OWNED, _SEALED, _FREE = BlockState.OWNED.value, BlockState.SEALED.value, BlockState.FREE.value


class EtcdLedger(EtcdLeases, EtcdSlots, EtcdRequests, Ledger):
    def __init__(
        self,
        endpoints: Sequence[str],
        prefix: str,
        clock: Callable[[], float] = time.monotonic,
        timeout_s: float = 10.0,
        wall_clock: Callable[[], float] = time.time,
        user: str = "",
        password: str = "",
    ) -> None:
        self.where = f"etcd {','.join(endpoints)} {prefix}"
        self.client = EtcdClient(endpoints, timeout_s=timeout_s, user=user, password=password)
        self.keys = Keys(prefix)
        self.clock = clock
        self.wall_clock = wall_clock
        self.timeout_s = timeout_s
        self._moves_lease: tuple[int, float] = (0, -math.inf)  # (etcd lease, when granted on time.monotonic)
        self._lock = threading.Lock()
        self._cache = ReadCache()
        self._order = threading.local()  # each thread's last operation's place in etcd's order

    def _run(self, name: str, fn: Callable[[Tx], T]) -> T:
        return atomically(self.client, fn, self.timeout_s, name, self._cache, self._order)

    @contextlib.contextmanager
    def _etcd(self, what: str) -> Iterator[None]:
        """etcd's errors outside a transaction (lease calls) as the ledger's own."""
        try:
            yield
        except EtcdUnavailableError as exc:
            raise LedgerUnavailableError(f"{self.where}: {what}: {exc}") from exc
        except EtcdError as exc:
            raise LedgerError(f"{self.where}: {what}: {exc}") from exc

    def _revoke(self, etcd_lease: int) -> None:
        """End an etcd lease nobody holds any more; its keys were deleted already, so a failure costs
        only the lease's own lifetime."""
        if etcd_lease:
            with contextlib.suppress(EtcdError):
                self.client.lease_revoke(etcd_lease)

    def close(self) -> None:
        self.client.close()

    def commit_order(self) -> int:
        return getattr(self._order, "value", 0)

    # --- block groups -------------------------------------------------------------------------
    def _groups(self, tx: Tx, block_ids: Sequence[int]) -> dict[int, list[BlockRec]]:
        """The groups holding `block_ids`, tracked (their writes compare on them); LedgerError for an id
        the ledger does not have."""
        wanted = sorted({b // GROUP for b in block_ids if b >= 0})
        raws = tx.get_many(self.keys.group(g) for g in wanted)
        groups = {g: blocks_of(raw) for g, raw in zip(wanted, raws, strict=True) if raw is not None}
        for b in block_ids:
            if b < 0 or b // GROUP not in groups or b % GROUP >= len(groups[b // GROUP]):
                raise LedgerError(f"no block {b}")
        return groups

    def _all_groups(self, tx: Tx) -> dict[int, list[BlockRec]]:
        return {int(k[-8:]): blocks_of(v) for k, v in tx.scan(self.keys.blocks)}

    def _all_blocks(self, tx: Tx) -> dict[int, BlockRec]:
        return {g * GROUP + i: b for g, recs in self._all_groups(tx).items() for i, b in enumerate(recs)}

    def _put_groups(self, tx: Tx, groups: dict[int, list[BlockRec]], changed: set[int]) -> None:
        for g in sorted(changed):
            tx.put(self.keys.group(g), encode(groups[g]))

    @staticmethod
    def _owned(
        groups: dict[int, list[BlockRec]], worker: str, epoch: int, block_id: int, states: tuple[str, ...]
    ) -> BlockRec:
        b = groups[block_id // GROUP][block_id % GROUP]
        if b.owner != worker or b.epoch != epoch:
            raise FencedError(f"block {block_id} belongs to {b.owner} (epoch {b.epoch}), not {worker} ({epoch})")
        if b.state not in states:
            raise LedgerError(f"block {block_id} is {b.state}; expected one of {states}")
        return b

    def _in_parts(self, name: str, keys: list[bytes], fn: Callable[[Tx, list[bytes]], None]) -> None:
        for i in range(0, len(keys), PARTS):
            part = keys[i : i + PARTS]
            self._run(name, lambda tx, part=part: fn(tx, part))

    # --- blocks -------------------------------------------------------------------------------
    def format(self, num_blocks: int) -> None:
        self._format(self.keys.format, self.keys.group, num_blocks, lambda: BlockRec(_FREE), "blocks")

    def _format(
        self, size_key: bytes, group_key: Callable[[int], bytes], count: int, free: Callable, what: str
    ) -> None:
        """Create `count` FREE records in groups, each group only where it is missing (a format cut short
        by a crash is finished by the next), then the size; or check the size recorded."""
        have = self._run("format", lambda tx: tx.get(size_key, track=False))
        if have is not None:
            if int(have) != count:
                raise LedgerError(f"the ledger describes {int(have)} {what}, the arena has {count}")
            return

        def create(tx: Tx, keys: list[bytes]) -> None:
            for key, raw in zip(keys, tx.get_many(keys), strict=True):
                if raw is None:
                    g = int(key[-8:])
                    tx.put(key, encode([free() for _ in range(min(GROUP, count - g * GROUP))]))

        self._in_parts("format", [group_key(g) for g in range(math.ceil(count / GROUP))], create)

        def finish(tx: Tx) -> None:
            now = tx.get(size_key)
            if now is None:
                tx.put(size_key, b"%d" % count)
            elif int(now) != count:
                raise LedgerError(f"the ledger describes {int(now)} {what}, the arena has {count}")

        self._run("format", finish)

    def arena_replaced(self) -> None:
        def fence_all(tx: Tx) -> list[int]:
            revoked = []
            for key, raw in tx.scan(self.keys.lease_dir):
                rec = lease_of(raw)
                if rec.state == LeaseState.ACTIVE:
                    revoked.append(self._fence(tx, self.keys.name_in(self.keys.lease_dir, key), rec).etcd_lease)
            return revoked

        for etcd_lease in self._run("arena_replaced", fence_all):
            self._revoke(etcd_lease)

        # Nobody holds a live lease now, so nobody writes blocks: they are voided in parts.
        # Request checkpoints stay: their token ids still let a request be rebuilt, not adopted.
        def void(tx: Tx, keys: list[bytes]) -> None:
            for key, raw in zip(keys, tx.get_many(keys), strict=True):
                if raw is not None:
                    tx.put(key, encode([BlockRec(_FREE) for _ in blocks_of(raw)]))

        self._in_parts(
            "arena_replaced", [k for k, _ in self._run("blocks", lambda tx: tx.scan(self.keys.blocks))], void
        )

    def grant(self, worker: str, epoch: int, count: int, below: int | None = None) -> list[int]:
        if count < 0:
            raise LedgerError("cannot grant a negative number of blocks")

        def grant(tx: Tx) -> list[int]:
            self._check_lease(tx, worker, epoch)
            blocks = self._all_blocks(tx)  # untracked: only the blocks taken must still be as read
            rank = {_FREE: 0, BlockState.QUARANTINED.value: 1, _SEALED: 2}
            free = [
                (rank[b.state], i)
                for i, b in blocks.items()
                if b.owner is None and b.state in rank and (b.state != _FREE or below is None or i < below)
            ]
            ids = [i for _, i in sorted(free)[:count]]
            groups = self._groups(tx, ids)
            for i in ids:
                groups[i // GROUP][i % GROUP] = BlockRec(_OWNED, worker, epoch, refs=1)
            self._put_groups(tx, groups, {i // GROUP for i in ids})
            return ids

        return self._run("grant", grant)

    def adopt(self, worker: str, epoch: int, blocks: Sequence[tuple[int, bytes]]) -> None:
        def adopt(tx: Tx) -> None:
            self._check_lease(tx, worker, epoch)
            groups = self._groups(tx, [b for b, _ in blocks])
            changed = set()
            for block_id, digest in blocks:
                b = groups[block_id // GROUP][block_id % GROUP]
                if b.state != _SEALED or b.hash != digest:
                    raise LedgerError(f"block {block_id} is {b.state} with another hash: not adoptable")
                if b.owner == worker and b.epoch == epoch:
                    continue
                if b.owner is not None:
                    raise LedgerError(f"block {block_id} belongs to {b.owner}: not adoptable")
                b.owner, b.epoch, b.refs = worker, epoch, 1
                changed.add(block_id // GROUP)
            self._put_groups(tx, groups, changed)

        self._run("adopt", adopt)

    def hand_over(
        self,
        worker: str,
        epoch: int,
        block_ids: Sequence[int],
        to_worker: str,
        seals: Sequence[Seal] = (),
        request_id: str = "",
        move: str = "",
    ) -> int:
        def hand_over(tx: Tx) -> int:
            self._check_lease(tx, worker, epoch)
            if move and self._decide(tx, worker, move, MoveOutcome.COMMITTED) is not MoveOutcome.COMMITTED:
                raise LedgerError(f"move {move} was decided aborted: its blocks stay with {worker}")
            groups = self._groups(tx, [*block_ids, *(s[0] for s in seals)])
            self._seal(groups, worker, epoch, seals)
            rec, to_epoch = self._lease_parts(tx, to_worker)
            if rec is None or to_epoch is None or rec.state != LeaseState.ACTIVE:
                raise ReceiverGoneError(f"{to_worker} holds no live lease: nothing can be handed to it")
            for block_id in block_ids:
                b = self._owned(groups, worker, epoch, block_id, (_OWNED, _SEALED))
                b.owner, b.epoch = to_worker, to_epoch
            self._put_groups(tx, groups, {b // GROUP for b in [*block_ids, *(s[0] for s in seals)]})
            if request_id:
                raw = tx.get(self.keys.request(request_id))
                row = request_of(raw) if raw is not None else None
                if row is not None and row.owner == worker:
                    row.owner, row.epoch, row.phase, row.updated = to_worker, to_epoch, "transfer", self.wall_clock()
                    tx.put(self.keys.request(request_id), encode(row))
            return to_epoch

        return self._run("hand_over", hand_over)

    def _moves_etcd_lease(self) -> int:
        """The etcd lease move decisions are attached to: one for an hour's decisions, each kept one to two hours."""
        with self._lock:
            etcd_lease, since = self._moves_lease
            if time.monotonic() - since > MOVE_RECORD_S:
                with self._etcd("granting the moves' lease"):
                    etcd_lease = self.client.lease_grant(2 * MOVE_RECORD_S)[0]
                self._moves_lease = (etcd_lease, time.monotonic())
            return etcd_lease

    def _decide(self, tx: Tx, worker: str, session: str, proposal: MoveOutcome) -> MoveOutcome:
        raw = tx.get(self.keys.move(session))
        if raw is not None:
            return MoveOutcome(move_of(raw).outcome)
        tx.put(self.keys.move(session), encode(MoveRec(proposal.value, worker)), lease=self._moves_etcd_lease())
        return proposal

    def decide_move(self, worker: str, epoch: int, session: str, proposal: MoveOutcome) -> MoveOutcome:
        def decide(tx: Tx) -> MoveOutcome:
            self._check_lease(tx, worker, epoch)
            return self._decide(tx, worker, session, proposal)

        return self._run("decide_move", decide)

    def move_decision(self, session: str) -> MoveOutcome | None:
        raw = self._run("move_decision", lambda tx: tx.get(self.keys.move(session), track=False))
        return MoveOutcome(move_of(raw).outcome) if raw is not None else None

    def authorize_write(self, worker: str, epoch: int, block_id: int) -> None:
        def check(tx: Tx) -> None:
            tx.get_many([self.keys.lease(worker), self.keys.alive(worker), self.keys.group(block_id // GROUP)])
            self._check_lease(tx, worker, epoch)
            self._owned(self._groups(tx, [block_id]), worker, epoch, block_id, (_OWNED,))

        self._run("authorize_write", check)

    def seal_and_unseal(self, worker: str, epoch: int, seals: Sequence[Seal], unseals: Sequence[int]) -> None:
        def seal(tx: Tx) -> None:
            ids = [*unseals, *(s[0] for s in seals)]
            tx.get_many([self.keys.lease(worker), self.keys.alive(worker), *(self.keys.group(b // GROUP) for b in ids)])
            self._check_lease(tx, worker, epoch)
            groups = self._groups(tx, ids)
            for block_id in unseals:
                b = self._owned(groups, worker, epoch, block_id, (_SEALED,))
                b.state, b.hash, b.content = _OWNED, None, None
            self._seal(groups, worker, epoch, seals)
            self._put_groups(tx, groups, {b // GROUP for b in ids})

        self._run("seal", seal)

    def _seal(self, groups: dict[int, list[BlockRec]], worker: str, epoch: int, seals: Sequence[Seal]) -> None:
        for block_id, digest, *name in seals:
            if not digest:
                raise LedgerError(f"block {block_id}: a seal needs a content hash")
            b = self._owned(groups, worker, epoch, block_id, (_OWNED,))
            b.state, b.hash, b.content = _SEALED, digest, name[0] if name else None

    def free(self, worker: str, epoch: int, block_ids: Sequence[int]) -> None:
        def free(tx: Tx) -> None:
            tx.get_many(
                [self.keys.lease(worker), self.keys.alive(worker), *(self.keys.group(b // GROUP) for b in block_ids)]
            )
            self._check_lease(tx, worker, epoch)
            groups = self._groups(tx, block_ids)
            for block_id in block_ids:
                self._owned(groups, worker, epoch, block_id, (_OWNED, _SEALED))
                groups[block_id // GROUP][block_id % GROUP] = BlockRec(_FREE)
            self._put_groups(tx, groups, {b // GROUP for b in block_ids})

        self._run("free", free)

    def _fenced_record(self, tx: Tx, worker: str) -> None:
        rec, _ = self._lease_parts(tx, worker)
        if rec is None or rec.state == LeaseState.ACTIVE:
            # Invariant 2: nothing of a worker is reassigned on suspicion; fence it first.
            raise LedgerError(f"{worker} is not fenced; its blocks cannot be reclaimed")

    def reclaim(self, worker: str) -> tuple[list[int], list[int]]:
        self._run("reclaim", lambda tx: self._fenced_record(tx, worker))
        sealed: list[int] = []
        partial: list[int] = []
        # A fenced worker's blocks change only here, so the groups holding them are done in parts.
        held = self._run("reclaim", self._all_groups)
        keys = [self.keys.group(g) for g, recs in held.items() if any(b.owner == worker for b in recs)]

        def part(tx: Tx, keys: list[bytes]) -> None:
            self._fenced_record(tx, worker)
            for key, raw in zip(keys, tx.get_many(keys), strict=True):
                recs, base = blocks_of(raw or b"\x90"), int(key[-8:]) * GROUP
                for i, b in enumerate(recs):
                    if b.owner != worker or b.state not in (_OWNED, _SEALED):
                        continue
                    # Sealed blocks stay sealed, ownerless: adoptable by whoever verifies their hash.
                    # Partial blocks of a dead writer: nobody's, never adopted as they are.
                    (sealed if b.state == _SEALED else partial).append(base + i)
                    if b.state == _OWNED:
                        b.state = BlockState.QUARANTINED.value
                    b.owner, b.epoch, b.refs = None, None, 0
                tx.put(key, encode(recs))

        self._in_parts("reclaim", keys, part)
        self.release_slots_of(worker)
        return sorted(sealed), sorted(partial)

    def blocks(self) -> list[BlockRecord]:
        blocks = self._run("blocks", self._all_blocks)
        return [_block(i, b) for i, b in sorted(blocks.items())]

    def sealed_with_content(self, contents: Sequence[bytes]) -> list[BlockRecord]:
        names = set(contents)
        return [b for b in self.blocks() if b.state == BlockState.SEALED and b.content in names]


def _block(block_id: int, b: BlockRec) -> BlockRecord:
    return BlockRecord(block_id, BlockState(b.state), b.owner, b.epoch, b.request, b.refs, b.hash, b.tier, b.content)
