"""The embedded ledger backend: one SQLite file in WAL mode, shared by the processes of a node.

Each operation is one `BEGIN IMMEDIATE` transaction: the epoch check and the write it guards commit
together or not at all, so a writer killed mid-transaction leaves the previous consistent state.
A request's body (prompt, sampling parameters) is a row of its own in `request_bodies`, written once:
a checkpoint rewrites only what changes (SQLite writes a whole row again on any update), so neither
the file nor its WAL grows with the prompt times the checkpoints. The `requests` table keeps its
`prompt` and `params` columns, empty in rows written since (they are read where a row written before
has no body row).
Nothing outside this module sees sqlite3: its errors leave as `LedgerUnavailableError`. One object may
serve several threads (lease keeper, engine, KV receiver): a lock keeps one thread's transaction, or
read, on the shared connection at a time.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from steadfast.kv.ledger.interface import (
    BlockRecord,
    BlockState,
    FencedError,
    Lease,
    LeaseHeldError,
    LeaseState,
    Ledger,
    LedgerError,
    LedgerUnavailableError,
    ReceiverGoneError,
    Seal,
)
from steadfast.kv.ledger.sqlite_requests import SqliteRequests
from steadfast.kv.ledger.sqlite_slots import SLOTS_SCHEMA, SqliteSlots
from steadfast.kv.moves.messages import MoveOutcome

MOVE_RECORD_S = 3600.0  # a move's decision is kept this long (seconds of the ledger's clock), then pruned
MAX_ID = 2**63 - 1  # `grant` without `below`: every FREE block qualifies
WAL_BYTES = 4 * 2**20

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS leases (
    worker TEXT PRIMARY KEY, epoch INTEGER NOT NULL, expires REAL NOT NULL, pid INTEGER NOT NULL,
    state TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS blocks (
    id INTEGER PRIMARY KEY, state TEXT NOT NULL, owner TEXT, epoch INTEGER, request TEXT,
    refs INTEGER NOT NULL DEFAULT 0, hash BLOB, tier TEXT, content BLOB);
CREATE INDEX IF NOT EXISTS blocks_by_owner ON blocks (owner, state);
CREATE TABLE IF NOT EXISTS requests (
    id TEXT PRIMARY KEY, prompt BLOB NOT NULL, params TEXT NOT NULL, generated BLOB NOT NULL,
    delivered INTEGER NOT NULL, owner TEXT, epoch INTEGER, phase TEXT NOT NULL, blocks BLOB NOT NULL,
    updated REAL NOT NULL);
CREATE TABLE IF NOT EXISTS request_bodies (id TEXT PRIMARY KEY, prompt BLOB NOT NULL, params TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS moves (
    session TEXT PRIMARY KEY, outcome TEXT NOT NULL, worker TEXT NOT NULL, decided REAL NOT NULL);
CREATE INDEX IF NOT EXISTS moves_by_time ON moves (decided);
INSERT OR IGNORE INTO meta (key, value) VALUES ('epoch', 0);
"""


class SqliteLedger(SqliteSlots, SqliteRequests, Ledger):
    def __init__(
        self,
        path: str,
        clock: Callable[[], float] = time.monotonic,
        timeout_s: float = 10.0,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = path
        self.clock = clock
        self.wall_clock = wall_clock  # request rows' `updated` (see RequestCheckpoint.updated_at)
        self.timeout_s = timeout_s
        # Re-entrant: a transaction's helpers, and a subclass wrapping `_tx`, may take it again.
        self._lock = threading.RLock()
        self._order = threading.local()  # each thread's last commit's place in the host's order
        try:
            # isolation_level=None: transactions are opened explicitly, with BEGIN IMMEDIATE.
            # check_same_thread=False: threads share the connection, one at a time under `_lock`.
            self.db = sqlite3.connect(path, timeout=timeout_s, isolation_level=None, check_same_thread=False)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")  # durable across process crashes, cheap per commit
            # The WAL is cut back to this after a checkpoint of it, not kept at its largest ever.
            self.db.execute(f"PRAGMA journal_size_limit={WAL_BYTES}")
        except sqlite3.Error as exc:
            raise self._unavailable(exc) from exc
        with self._tx() as c:
            for statement in (_SCHEMA + SLOTS_SCHEMA).split(";"):
                if statement.strip():
                    c.execute(statement)
            if "content" not in {row[1] for row in c.execute("PRAGMA table_info(blocks)")}:
                c.execute("ALTER TABLE blocks ADD COLUMN content BLOB")  # a ledger file from before token names
            c.execute("CREATE INDEX IF NOT EXISTS blocks_by_content ON blocks (content)")
            c.execute("CREATE INDEX IF NOT EXISTS requests_by_time ON requests (updated)")

    def _unavailable(self, exc: sqlite3.Error) -> LedgerUnavailableError:
        return LedgerUnavailableError(f"SQLite ledger {self.path}: {exc}")

    def _acquire(self) -> None:
        # Bounded like SQLite's own busy wait: a thread stuck behind another's transaction (a stalled
        # checkpoint) gets the same "busy, try later" answer a second process would.
        if not self._lock.acquire(timeout=self.timeout_s):
            raise LedgerUnavailableError(f"SQLite ledger {self.path}: busy in another thread for {self.timeout_s}s")

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Cursor]:
        self._acquire()
        try:
            c = self.db.cursor()
            c.execute("BEGIN IMMEDIATE")
            # Inside the write lock, so the order of these stamps is the order of the transactions, also
            # between processes (CLOCK_MONOTONIC is the host's).
            self._order.value = time.monotonic_ns()
            try:
                yield c
                c.execute("COMMIT")
            except BaseException:
                # A failed COMMIT leaves the transaction open: end it, or the next BEGIN would fail too.
                if self.db.in_transaction:
                    c.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            raise self._unavailable(exc) from exc
        finally:
            self._lock.release()

    def _rows(self, sql: str, params: Sequence[object] = ()) -> list[tuple]:
        """A read outside any transaction, fetched whole while the connection is ours."""
        self._acquire()
        try:
            return self.db.execute(sql, params).fetchall()
        except sqlite3.Error as exc:
            raise self._unavailable(exc) from exc
        finally:
            self._lock.release()

    def close(self) -> None:
        with self._lock:
            self.db.close()

    def commit_order(self) -> int:
        return getattr(self._order, "value", 0)

    # --- leases -------------------------------------------------------------------------------
    @staticmethod
    def _lease_row(row: tuple) -> Lease:
        return Lease(row[0], row[1], row[2], row[3], LeaseState(row[4]))

    def _next_epoch(self, c: sqlite3.Cursor) -> int:
        c.execute("UPDATE meta SET value = value + 1 WHERE key = 'epoch'")
        return c.execute("SELECT value FROM meta WHERE key = 'epoch'").fetchone()[0]

    def _live(self, c: sqlite3.Cursor, worker: str | None, epoch: int | None) -> bool:
        """Whether `worker` still holds, live, the lease of `epoch` (that it wrote a row under)."""
        row = c.execute("SELECT epoch, expires, state FROM leases WHERE worker = ?", (worker,)).fetchone()
        return row is not None and row[0] == epoch and row[2] == LeaseState.ACTIVE and self.clock() <= row[1]

    def _runs_elsewhere(self, c: sqlite3.Cursor, worker: str, owner: str | None, epoch: int | None, phase: str) -> bool:
        """Whether a worker other than `worker` runs the request of this row: it wrote the row under
        the lease it still holds, live, and has not finished it."""
        return owner not in (None, worker) and phase != "finished" and self._live(c, owner, epoch)

    def _check_lease(self, c: sqlite3.Cursor, worker: str, epoch: int) -> None:
        row = c.execute("SELECT epoch, expires, state FROM leases WHERE worker = ?", (worker,)).fetchone()
        if row is None:
            raise FencedError(f"{worker} holds no lease")
        current, expires, state = row
        if epoch != current:
            raise FencedError(f"{worker} wrote with epoch {epoch}; its current epoch is {current}")
        if state != LeaseState.ACTIVE:
            raise FencedError(f"{worker}'s lease (epoch {epoch}) is {state}")
        if self.clock() > expires:
            raise FencedError(f"{worker}'s lease (epoch {epoch}) expired")

    def acquire_lease(self, worker: str, pid: int, ttl_s: float) -> Lease:
        now = self.clock()
        with self._tx() as c:
            row = c.execute("SELECT expires, state FROM leases WHERE worker = ?", (worker,)).fetchone()
            if row is not None and row[1] == LeaseState.ACTIVE and row[0] >= now:
                raise LeaseHeldError(f"{worker} already holds a live lease")
            left = c.execute(
                "SELECT COUNT(*) FROM blocks WHERE owner = ? AND state IN ('OWNED', 'SEALED')", (worker,)
            ).fetchone()[0]
            if left:
                # A new incarnation never inherits blocks by name: the old one is fenced and reclaimed first.
                raise LedgerError(f"{worker} still holds {left} blocks of an earlier epoch; fence and reclaim first")
            epoch = self._next_epoch(c)
            c.execute(
                "INSERT OR REPLACE INTO leases (worker, epoch, expires, pid, state) VALUES (?, ?, ?, ?, ?)",
                (worker, epoch, now + ttl_s, pid, LeaseState.ACTIVE.value),
            )
        return Lease(worker, epoch, now + ttl_s, pid, LeaseState.ACTIVE)

    def renew_lease(self, worker: str, epoch: int, ttl_s: float) -> Lease:
        with self._tx() as c:
            self._check_lease(c, worker, epoch)
            expires = self.clock() + ttl_s
            c.execute("UPDATE leases SET expires = ? WHERE worker = ?", (expires, worker))
            pid = c.execute("SELECT pid FROM leases WHERE worker = ?", (worker,)).fetchone()[0]
        return Lease(worker, epoch, expires, pid, LeaseState.ACTIVE)

    def release_lease(self, worker: str, epoch: int) -> None:
        with self._tx() as c:
            self._check_lease(c, worker, epoch)
            c.execute("UPDATE leases SET state = ? WHERE worker = ?", (LeaseState.RELEASED.value, worker))

    def fence(self, worker: str) -> int:
        with self._tx() as c:
            if c.execute("SELECT 1 FROM leases WHERE worker = ?", (worker,)).fetchone() is None:
                raise LedgerError(f"{worker} has no lease to fence")
            epoch = self._next_epoch(c)
            c.execute(
                "UPDATE leases SET epoch = ?, state = ? WHERE worker = ?", (epoch, LeaseState.FENCED.value, worker)
            )
        return epoch

    def lease(self, worker: str) -> Lease | None:
        rows = self._rows("SELECT worker, epoch, expires, pid, state FROM leases WHERE worker = ?", (worker,))
        return self._lease_row(rows[0]) if rows else None

    def leases(self) -> list[Lease]:
        rows = self._rows("SELECT worker, epoch, expires, pid, state FROM leases ORDER BY worker")
        return [self._lease_row(r) for r in rows]

    # --- blocks -------------------------------------------------------------------------------
    def format(self, num_blocks: int) -> None:
        with self._tx() as c:
            have = c.execute("SELECT COUNT(*) FROM blocks").fetchone()[0]
            if have == 0:
                c.executemany("INSERT INTO blocks (id, state) VALUES (?, 'FREE')", ((i,) for i in range(num_blocks)))
            elif have != num_blocks:
                raise LedgerError(f"the ledger describes {have} blocks, the arena has {num_blocks}")

    def arena_replaced(self) -> None:
        with self._tx() as c:
            live = c.execute("SELECT worker FROM leases WHERE state = ?", (LeaseState.ACTIVE.value,)).fetchall()
            for (worker,) in live:
                c.execute(
                    "UPDATE leases SET epoch = ?, state = ? WHERE worker = ?",
                    (self._next_epoch(c), LeaseState.FENCED.value, worker),
                )
            # Request checkpoints stay: their token ids still let a request be rebuilt, not adopted.
            c.execute(
                "UPDATE blocks SET state = 'FREE', owner = NULL, epoch = NULL, request = NULL, refs = 0, "
                "hash = NULL, tier = NULL, content = NULL"
            )

    def grant(self, worker: str, epoch: int, count: int, below: int | None = None) -> list[int]:
        if count < 0:
            raise LedgerError("cannot grant a negative number of blocks")
        with self._tx() as c:
            self._check_lease(c, worker, epoch)
            ids = [
                r[0]
                for r in c.execute(
                    "SELECT id FROM blocks WHERE owner IS NULL AND state IN ('FREE', 'QUARANTINED', 'SEALED') "
                    "AND (state != 'FREE' OR id < ?) "
                    "ORDER BY CASE state WHEN 'FREE' THEN 0 WHEN 'QUARANTINED' THEN 1 ELSE 2 END, id LIMIT ?",
                    (MAX_ID if below is None else below, count),
                )
            ]
            c.executemany(
                "UPDATE blocks SET state = 'OWNED', owner = ?, epoch = ?, refs = 1, request = NULL, hash = NULL, "
                "tier = NULL, content = NULL WHERE id = ?",
                ((worker, epoch, i) for i in ids),
            )
        return ids

    def adopt(self, worker: str, epoch: int, blocks: Sequence[tuple[int, bytes]]) -> None:
        with self._tx() as c:
            self._check_lease(c, worker, epoch)
            for block_id, digest in blocks:
                row = c.execute("SELECT state, owner, epoch, hash FROM blocks WHERE id = ?", (block_id,)).fetchone()
                if row is None:
                    raise LedgerError(f"no block {block_id}")
                state, owner, block_epoch, recorded = row
                if state != BlockState.SEALED.value or recorded != digest:
                    raise LedgerError(f"block {block_id} is {state} with another hash: not adoptable")
                if owner == worker and block_epoch == epoch:
                    continue
                if owner is not None:
                    raise LedgerError(f"block {block_id} belongs to {owner}: not adoptable")
                c.execute("UPDATE blocks SET owner = ?, epoch = ?, refs = 1 WHERE id = ?", (worker, epoch, block_id))

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
        with self._tx() as c:
            self._check_lease(c, worker, epoch)
            if move and self._decide(c, worker, move, MoveOutcome.COMMITTED) is not MoveOutcome.COMMITTED:
                raise LedgerError(f"move {move} was decided aborted: its blocks stay with {worker}")
            self._seal(c, worker, epoch, seals)
            row = c.execute("SELECT epoch, state, expires FROM leases WHERE worker = ?", (to_worker,)).fetchone()
            if row is None or row[1] != LeaseState.ACTIVE or self.clock() > row[2]:
                raise ReceiverGoneError(f"{to_worker} holds no live lease: nothing can be handed to it")
            to_epoch = row[0]
            for block_id in block_ids:
                self._owned(c, worker, epoch, block_id, (BlockState.OWNED.value, BlockState.SEALED.value))
            c.executemany(
                "UPDATE blocks SET owner = ?, epoch = ? WHERE id = ?", ((to_worker, to_epoch, b) for b in block_ids)
            )
            if request_id:
                c.execute(
                    "UPDATE requests SET owner = ?, epoch = ?, phase = 'transfer', updated = ? "
                    "WHERE id = ? AND owner = ?",
                    (to_worker, to_epoch, self.wall_clock(), request_id, worker),
                )
        return to_epoch

    def decide_move(self, worker: str, epoch: int, session: str, proposal: MoveOutcome) -> MoveOutcome:
        with self._tx() as c:
            self._check_lease(c, worker, epoch)
            return self._decide(c, worker, session, proposal)

    def _decide(self, c: sqlite3.Cursor, worker: str, session: str, proposal: MoveOutcome) -> MoveOutcome:
        now = self.clock()
        c.execute("DELETE FROM moves WHERE decided < ?", (now - MOVE_RECORD_S,))  # no move lives this long
        c.execute(
            "INSERT OR IGNORE INTO moves (session, outcome, worker, decided) VALUES (?, ?, ?, ?)",
            (session, proposal.value, worker, now),
        )
        return MoveOutcome(c.execute("SELECT outcome FROM moves WHERE session = ?", (session,)).fetchone()[0])

    def move_decision(self, session: str) -> MoveOutcome | None:
        rows = self._rows("SELECT outcome FROM moves WHERE session = ?", (session,))
        return MoveOutcome(rows[0][0]) if rows else None

    def _owned(self, c: sqlite3.Cursor, worker: str, epoch: int, block_id: int, states: tuple[str, ...]) -> str:
        row = c.execute("SELECT state, owner, epoch FROM blocks WHERE id = ?", (block_id,)).fetchone()
        if row is None:
            raise LedgerError(f"no block {block_id}")
        state, owner, block_epoch = row
        if owner != worker or block_epoch != epoch:
            raise FencedError(f"block {block_id} belongs to {owner} (epoch {block_epoch}), not {worker} ({epoch})")
        if state not in states:
            raise LedgerError(f"block {block_id} is {state}; expected one of {states}")
        return state

    def authorize_write(self, worker: str, epoch: int, block_id: int) -> None:
        with self._tx() as c:
            self._check_lease(c, worker, epoch)
            self._owned(c, worker, epoch, block_id, (BlockState.OWNED.value,))

    def seal_and_unseal(self, worker: str, epoch: int, seals: Sequence[Seal], unseals: Sequence[int]) -> None:
        with self._tx() as c:
            self._check_lease(c, worker, epoch)
            for block_id in unseals:
                self._owned(c, worker, epoch, block_id, (BlockState.SEALED.value,))
                c.execute("UPDATE blocks SET state = 'OWNED', hash = NULL, content = NULL WHERE id = ?", (block_id,))
            self._seal(c, worker, epoch, seals)

    def _seal(self, c: sqlite3.Cursor, worker: str, epoch: int, seals: Sequence[Seal]) -> None:
        for block_id, digest, *name in seals:
            if not digest:
                raise LedgerError(f"block {block_id}: a seal needs a content hash")
            self._owned(c, worker, epoch, block_id, (BlockState.OWNED.value,))
            c.execute(
                "UPDATE blocks SET state = 'SEALED', hash = ?, content = ? WHERE id = ?",
                (digest, name[0] if name else None, block_id),
            )

    def free(self, worker: str, epoch: int, block_ids: Sequence[int]) -> None:
        with self._tx() as c:
            self._check_lease(c, worker, epoch)
            for block_id in block_ids:
                self._owned(c, worker, epoch, block_id, (BlockState.OWNED.value, BlockState.SEALED.value))
                c.execute(
                    "UPDATE blocks SET state = 'FREE', owner = NULL, epoch = NULL, request = NULL, refs = 0, "
                    "hash = NULL, tier = NULL, content = NULL WHERE id = ?",
                    (block_id,),
                )

    def reclaim(self, worker: str) -> tuple[list[int], list[int]]:
        with self._tx() as c:
            row = c.execute("SELECT state FROM leases WHERE worker = ?", (worker,)).fetchone()
            if row is None or row[0] == LeaseState.ACTIVE:
                # Invariant 2: nothing of a worker is reassigned on suspicion; fence it first.
                raise LedgerError(f"{worker} is not fenced; its blocks cannot be reclaimed")
            sealed = [r[0] for r in c.execute("SELECT id FROM blocks WHERE owner = ? AND state = 'SEALED'", (worker,))]
            partial = [r[0] for r in c.execute("SELECT id FROM blocks WHERE owner = ? AND state = 'OWNED'", (worker,))]
            # Partial blocks of a dead writer: nobody's, never adopted as they are (the request column stays).
            c.executemany(
                "UPDATE blocks SET state = 'QUARANTINED', owner = NULL, epoch = NULL, refs = 0 WHERE id = ?",
                ((i,) for i in partial),
            )
            # Sealed blocks stay sealed, ownerless: adoptable by whoever verifies their hash.
            c.executemany("UPDATE blocks SET owner = NULL, epoch = NULL, refs = 0 WHERE id = ?", ((i,) for i in sealed))
            self.release_slots_of(c, worker)
        return sealed, partial

    _BLOCK_COLUMNS = "id, state, owner, epoch, request, refs, hash, tier, content"

    @staticmethod
    def _block_row(r: tuple) -> BlockRecord:
        return BlockRecord(r[0], BlockState(r[1]), r[2], r[3], r[4], r[5], r[6], r[7], r[8])

    def blocks(self) -> list[BlockRecord]:
        rows = self._rows(f"SELECT {self._BLOCK_COLUMNS} FROM blocks ORDER BY id")
        return [self._block_row(r) for r in rows]

    def sealed_with_content(self, contents: Sequence[bytes]) -> list[BlockRecord]:
        out: list[BlockRecord] = []
        names = list(dict.fromkeys(contents))
        for i in range(0, len(names), 500):  # well under SQLite's bound-parameter limit
            part = names[i : i + 500]
            rows = self._rows(
                f"SELECT {self._BLOCK_COLUMNS} FROM blocks WHERE content IN ({','.join('?' * len(part))}) "
                "AND state = 'SEALED' ORDER BY id",
                part,
            )
            out.extend(self._block_row(r) for r in rows)
        return out
