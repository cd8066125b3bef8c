"""The KV ledger: what every block holds and who may write it, outside any engine process.

One interface, backends behind it (embedded SQLite for one machine; etcd across nodes), opened by URL with
`steadfast.kv.ledger.open.open_ledger`. The ledger records blocks (state, owner, epoch, refcount,
chained content hash, tier), request checkpoints, worker leases and each KV move's decision. A backend
raises only this module's errors, never its driver's, and one ledger object may be used from several threads.
Every write names the writer's lease epoch and is refused (`FencedError`) unless that epoch is the
worker's current one and its lease has not expired: a worker that was fenced cannot write its way back.

Epochs come from one counter for the whole ledger, so they strictly increase across every grant.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from steadfast.config.ledger_url import LedgerUrlError
from steadfast.kv.moves.messages import MoveOutcome

# A seal: (block id, hash of its bytes) or (block id, hash of its bytes, chained name of its tokens).
Seal = tuple[int, bytes] | tuple[int, bytes, bytes]


class BlockState(enum.StrEnum):
    FREE = "FREE"
    OWNED = "OWNED"  # being filled by its owner, under its owner's epoch
    SEALED = "SEALED"  # full and immutable, named by its chained hash
    OFFLOADED = "OFFLOADED"  # bytes live in a slower tier
    QUARANTINED = "QUARANTINED"  # partial block of a dead writer: never adopted as is


class LeaseState(enum.StrEnum):
    ACTIVE = "active"
    FENCED = "fenced"  # expired or declared dead; its epoch was bumped
    RELEASED = "released"  # the worker left cleanly


class LedgerError(RuntimeError):
    """A ledger operation that breaks a precondition (bad input, wrong state)."""


class FencedError(LedgerError):
    """A write carrying an epoch that is not (or no longer) the writer's current, live lease."""


class ReceiverGoneError(LedgerError):
    """A handoff's receiving worker holds no live lease: the blocks stay with their owner."""


class LeaseHeldError(LedgerError):
    """Another live process already holds this worker's lease."""


class LedgerUnavailableError(LedgerError):
    """The store itself failed the operation (busy or locked past its timeout, unreadable, closed):
    its transaction did not commit, and a caller may try again later. Backends raise this instead
    of their driver's own errors, so no caller needs to know which store is behind the interface."""


class UnopenableLedgerError(LedgerError, LedgerUrlError):
    """`open_ledger` given a URL naming no store: its callers catch `LedgerError` alone, config checks
    catch `LedgerUrlError`."""


@dataclass(frozen=True)
class Lease:
    worker: str
    epoch: int
    expires: float
    pid: int
    state: LeaseState


@dataclass(frozen=True)
class BlockRecord:
    block_id: int
    state: BlockState
    owner: str | None = None
    epoch: int | None = None
    request: str | None = None
    refs: int = 0
    hash: bytes | None = None
    tier: str | None = None
    content: bytes | None = None  # a sealed block's chained token name (kv/names.py)


@dataclass(frozen=True)
class SlotRecord:
    """One slot of an offload tier (a block's bytes outside the arena). FREE; OWNED by its writer while
    the bytes go in; OFFLOADED: written, hashed and the pool's (owner None), counted against `origin`'s
    share of the tier. Named by the same chained token name as the sealed block it copies."""

    tier: str
    slot: int
    state: BlockState
    owner: str | None = None
    epoch: int | None = None
    origin: str | None = None
    hash: bytes | None = None
    content: bytes | None = None


# An offloaded slot's record: (slot, hash of its bytes, chained name of its tokens).
SlotSeal = tuple[int, bytes, bytes]


@dataclass
class RequestCheckpoint:
    request_id: str
    # Its body, the same at every checkpoint: kept once per request, not with every row (on etcd in
    # parts, so no prompt or stop string is too long). Read empty while a body too big to go beside
    # its row is still being written.
    prompt_ids: list[int]
    params: str  # the sampling parameters, JSON (seed included)
    generated_ids: list[int]
    delivered: int
    phase: str  # queued | prefill | transfer | decode | migrating | finished
    block_table: list[int] = field(default_factory=list)
    owner: str | None = None
    epoch: int | None = None
    # Wall-clock seconds (time.time()) of the row's last write, set by the ledger and ignored when
    # writing: wall time, not `clock()`, because routers on other hosts compare it with their own.
    updated_at: float = 0.0


class Ledger(abc.ABC):
    """What the pool daemon and the workers may ask of the ledger. Times are seconds on `clock()`,
    except a request row's `updated_at` (wall clock)."""

    # --- leases -------------------------------------------------------------------------------
    @abc.abstractmethod
    def acquire_lease(self, worker: str, pid: int, ttl_s: float) -> Lease: ...

    @abc.abstractmethod
    def renew_lease(self, worker: str, epoch: int, ttl_s: float) -> Lease: ...

    @abc.abstractmethod
    def release_lease(self, worker: str, epoch: int) -> None: ...

    @abc.abstractmethod
    def fence(self, worker: str) -> int:
        """Bump the worker's epoch and mark its lease fenced; return the new epoch."""

    @abc.abstractmethod
    def lease(self, worker: str) -> Lease | None: ...

    @abc.abstractmethod
    def leases(self) -> list[Lease]: ...

    # --- blocks -------------------------------------------------------------------------------
    @abc.abstractmethod
    def format(self, num_blocks: int) -> None:
        """Create `num_blocks` FREE blocks, or check an existing ledger has that many."""

    @abc.abstractmethod
    def arena_replaced(self) -> None:
        """The arena's bytes are gone (a device arena dies with its owning daemon): fence every live
        lease and free every block, sealed ones too, since nothing they describe exists any more."""

    @abc.abstractmethod
    def grant(self, worker: str, epoch: int, count: int, below: int | None = None) -> list[int]:
        """Up to `count` blocks become OWNED by the worker (fewer, maybe none, when short): FREE ones
        first, lowest id first, then QUARANTINED ones (their writer is gone), then ownerless SEALED ones
        nobody adopted. `below`: FREE blocks only under this id (the arena's memory made so far)."""

    @abc.abstractmethod
    def adopt(self, worker: str, epoch: int, blocks: Sequence[tuple[int, bytes]]) -> None:
        """Take ownerless SEALED blocks whose recorded hash is the one given (all or none); blocks the
        worker already owns sealed are left as they are."""

    @abc.abstractmethod
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
        """Zero-copy KV handoff (prefill → decode on one node), one transaction: `seals` are sealed
        first, then the worker's OWNED or SEALED blocks become `to_worker`'s under its current epoch,
        state, hash and name unchanged (all or none), and so does the request's checkpoint (phase
        `transfer`), so that only the receiver writes it from now on; the move session `move`, when
        named, is recorded COMMITTED (LedgerError, nothing changed, if it was decided ABORTED). Returns
        that epoch; ReceiverGoneError if `to_worker` holds no live lease."""

    @abc.abstractmethod
    def decide_move(self, worker: str, epoch: int, session: str, proposal: MoveOutcome) -> MoveOutcome:
        """A KV move session's decision, recorded once (a compare-and-set): `proposal` if the session is
        undecided, else nothing changes; returns the recorded outcome, so a retried call gets the same
        answer. The writer is the destination worker (its node's ledger holds the new owner's blocks)."""

    @abc.abstractmethod
    def move_decision(self, session: str) -> MoveOutcome | None: ...

    @abc.abstractmethod
    def authorize_write(self, worker: str, epoch: int, block_id: int) -> None:
        """Raise unless the worker may change this block's bytes now."""

    @abc.abstractmethod
    def seal_and_unseal(self, worker: str, epoch: int, seals: Sequence[Seal], unseals: Sequence[int]) -> None:
        """One transaction: `unseals` go SEALED → OWNED (their owner refills them), then `seals` go
        OWNED → SEALED with the hash of their bytes and, when given, the chained name of the tokens
        they hold. Unseals first, so no sealed byte is ever rewritten."""

    def seal(self, worker: str, epoch: int, hashes: Sequence[Seal]) -> None:
        self.seal_and_unseal(worker, epoch, hashes, ())

    def unseal(self, worker: str, epoch: int, block_ids: Sequence[int]) -> None:
        self.seal_and_unseal(worker, epoch, (), block_ids)

    @abc.abstractmethod
    def free(self, worker: str, epoch: int, block_ids: Sequence[int]) -> None: ...

    @abc.abstractmethod
    def reclaim(self, worker: str) -> tuple[list[int], list[int]]:
        """After a fenced worker's process is confirmed gone: its partial blocks become QUARANTINED and
        its sealed blocks ownerless (kept, adoptable after a hash check).

        Returns (sealed block ids kept for adoption, quarantined block ids).
        """

    @abc.abstractmethod
    def blocks(self) -> list[BlockRecord]: ...

    @abc.abstractmethod
    def sealed_with_content(self, contents: Sequence[bytes]) -> list[BlockRecord]:
        """SEALED blocks whose token name is one of `contents`, whoever owns them."""

    # --- offload tiers ------------------------------------------------------------------------
    # A tier's slots belong to the pool once written: a worker's death does not free them, and its
    # successor adopts them (`adopt_slots`) as it adopts sealed blocks. Only a slot's writer (OWNED) or
    # its origin (OFFLOADED) frees it; `reserve_slots` reuses a dead origin's slots after the free ones.
    @abc.abstractmethod
    def format_tier(self, tier: str, num_slots: int) -> None:
        """Create the tier's `num_slots` FREE slots, or check an existing ledger has that many."""

    @abc.abstractmethod
    def reserve_slots(self, worker: str, epoch: int, tier: str, count: int) -> list[int]:
        """Up to `count` slots become OWNED by the worker to write into: FREE ones first, then
        OFFLOADED ones whose origin holds no live lease (nobody adopted them)."""

    @abc.abstractmethod
    def store_slots(self, worker: str, epoch: int, tier: str, seals: Sequence[SlotSeal]) -> None:
        """Slots the worker wrote go OWNED → OFFLOADED with their hash and name: the pool's now, the
        worker their origin (all or none)."""

    @abc.abstractmethod
    def free_slots(self, worker: str, epoch: int, tier: str, slots: Sequence[int]) -> None:
        """The worker's OWNED slots, or OFFLOADED slots it is the origin of, become FREE (all or none)."""

    @abc.abstractmethod
    def adopt_slots(self, worker: str, epoch: int, tier: str, slots: Sequence[tuple[int, bytes]]) -> None:
        """OFFLOADED slots with the hash given whose origin holds no live lease become the worker's to
        count and free (all or none); those it is the origin of already are left as they are."""

    @abc.abstractmethod
    def offloaded_with_content(self, tier: str, contents: Sequence[bytes]) -> list[SlotRecord]:
        """OFFLOADED slots of the tier whose token name is one of `contents`."""

    @abc.abstractmethod
    def slots(self, tier: str) -> list[SlotRecord]: ...

    # --- requests -----------------------------------------------------------------------------
    @abc.abstractmethod
    def checkpoint(self, worker: str, epoch: int, records: Sequence[RequestCheckpoint]) -> None:
        """Record request progress, each row then the writer's: in one transaction, or in several that
        each stay within the store's limits (etcd's request size), each under the lease check. A request whose
        row another worker owns is skipped (this writer's view is stale: it handed the request over),
        unless that row is finished or its owner no longer holds the lease it wrote it under (fenced,
        expired, released, registered again): then the request was taken over and this writer runs it.
        Epochs of different workers are never compared: which was granted first says nothing of who
        runs the request now."""

    @abc.abstractmethod
    def request(self, request_id: str) -> RequestCheckpoint | None: ...

    @abc.abstractmethod
    def requests(self, owner: str | None = None) -> list[RequestCheckpoint]: ...

    @abc.abstractmethod
    def prune_requests(self, older_than_s: float) -> int:
        """Delete the rows nobody will write again (finished, or their owner's lease gone) last written
        more than `older_than_s` wall-clock seconds ago; returns how many."""

    @abc.abstractmethod
    def close(self) -> None: ...

    def commit_order(self) -> int:
        """Where this thread's last operation stands in the store's one order of operations, comparable
        between processes (a recorded history from several processes is replayed in this order):
        etcd's revision, or for SQLite the host's monotonic clock inside the write lock. 0: unknown."""
        return 0

    # --- integrity ----------------------------------------------------------------------------
    def check_integrity(self) -> list[str]:
        """Problems between blocks and leases; an empty list when the ledger is consistent."""
        problems = []
        leases = {lease.worker: lease for lease in self.leases()}
        for b in self.blocks():
            if b.state == BlockState.FREE:
                if b.owner is not None or b.refs or b.hash is not None:
                    problems.append(f"block {b.block_id} is FREE but has owner/refs/hash")
                continue
            if b.state == BlockState.OWNED or (b.state == BlockState.SEALED and b.owner is not None):
                lease = leases.get(b.owner or "")
                if lease is None:
                    problems.append(f"block {b.block_id} is {b.state} by {b.owner}, who has no lease")
                elif lease.state == LeaseState.ACTIVE and b.epoch != lease.epoch:
                    problems.append(f"block {b.block_id} has epoch {b.epoch}, its owner's lease {lease.epoch}")
                elif lease.state != LeaseState.ACTIVE and b.epoch is not None and b.epoch >= lease.epoch:
                    problems.append(f"block {b.block_id} carries epoch {b.epoch} not older than a fenced lease")
            if b.state == BlockState.SEALED and not b.hash:
                problems.append(f"block {b.block_id} is SEALED without a hash")
            if b.state == BlockState.OWNED and b.refs < 1:
                problems.append(f"block {b.block_id} is OWNED with refcount {b.refs}")
        for tier in self.tiers():
            for s in self.slots(tier):
                where = f"{tier} slot {s.slot}"
                if s.state == BlockState.OWNED:
                    lease = leases.get(s.owner or "")
                    if lease is None:
                        problems.append(f"{where} is OWNED by {s.owner}, who has no lease")
                    elif lease.state == LeaseState.ACTIVE and s.epoch != lease.epoch:
                        problems.append(f"{where} has epoch {s.epoch}, its owner's lease {lease.epoch}")
                elif s.state == BlockState.OFFLOADED:
                    if s.owner is not None or not s.hash or not s.content:
                        problems.append(f"{where} is OFFLOADED with an owner, or without a hash or name")
                elif s.state == BlockState.FREE:
                    if s.owner is not None or s.origin is not None or s.hash is not None:
                        problems.append(f"{where} is FREE but has owner/origin/hash")
                else:
                    problems.append(f"{where} is {s.state}")
        return problems

    @abc.abstractmethod
    def tiers(self) -> list[str]:
        """The offload tiers this ledger has slots of."""
