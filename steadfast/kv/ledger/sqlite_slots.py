"""The SQLite ledger's offload-tier slots (see `Ledger`'s "offload tiers"): one row per slot, written in
the same transactions and under the same lease checks as blocks. A part of `SqliteLedger`, kept apart
so that each module stays one job; it uses the ledger's transaction, read and lease helpers."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Sequence

from steadfast.kv.ledger.interface import BlockState, LedgerError, SlotRecord, SlotSeal

SLOTS_SCHEMA = """
CREATE TABLE IF NOT EXISTS slots (
    tier TEXT NOT NULL, slot INTEGER NOT NULL, state TEXT NOT NULL, owner TEXT, epoch INTEGER,
    origin TEXT, hash BLOB, content BLOB, PRIMARY KEY (tier, slot));
CREATE INDEX IF NOT EXISTS slots_by_content ON slots (tier, content);
"""

_COLUMNS = "tier, slot, state, owner, epoch, origin, hash, content"
_FREE = "state = 'FREE', owner = NULL, epoch = NULL, origin = NULL, hash = NULL, content = NULL"


class SqliteSlots:
    """Mixed into `SqliteLedger`, which provides `_tx`, `_rows`, `_check_lease` and `_live`."""

    def format_tier(self, tier: str, num_slots: int) -> None:
        with self._tx() as c:
            have = c.execute("SELECT COUNT(*) FROM slots WHERE tier = ?", (tier,)).fetchone()[0]
            if have == 0:
                c.executemany(
                    "INSERT INTO slots (tier, slot, state) VALUES (?, ?, 'FREE')", ((tier, i) for i in range(num_slots))
                )
            elif have != num_slots:
                raise LedgerError(f"the ledger describes {have} slots of tier {tier}, the tier has {num_slots}")

    def _origin_live(self, c: sqlite3.Cursor, origin: str | None) -> bool:
        row = c.execute("SELECT epoch FROM leases WHERE worker = ?", (origin,)).fetchone()
        return row is not None and self._live(c, origin, row[0])

    def reserve_slots(self, worker: str, epoch: int, tier: str, count: int) -> list[int]:
        if count < 0:
            raise LedgerError("cannot reserve a negative number of slots")
        with self._tx() as c:
            self._check_lease(c, worker, epoch)
            picked = [r[0] for r in c.execute(_SELECT_FREE, (tier, count))]
            if len(picked) < count:  # then the slots of origins that are gone, nobody having adopted them
                for slot, origin in c.execute(
                    "SELECT slot, origin FROM slots WHERE tier = ? AND state = 'OFFLOADED' ORDER BY slot", (tier,)
                ).fetchall():
                    if len(picked) == count:
                        break
                    if origin != worker and not self._origin_live(c, origin):
                        picked.append(slot)
            c.executemany(
                "UPDATE slots SET state = 'OWNED', owner = ?, epoch = ?, origin = NULL, hash = NULL, content = NULL "
                "WHERE tier = ? AND slot = ?",
                ((worker, epoch, tier, s) for s in picked),
            )
        return picked

    def _slot(self, c: sqlite3.Cursor, tier: str, slot: int) -> tuple:
        row = c.execute("SELECT state, owner, epoch, origin, hash FROM slots WHERE tier = ? AND slot = ?", (tier, slot))
        found = row.fetchone()
        if found is None:
            raise LedgerError(f"no slot {slot} in tier {tier}")
        return found

    def store_slots(self, worker: str, epoch: int, tier: str, seals: Sequence[SlotSeal]) -> None:
        with self._tx() as c:
            self._check_lease(c, worker, epoch)
            for slot, digest, name in seals:
                state, owner, slot_epoch, _, _ = self._slot(c, tier, slot)
                if state != BlockState.OWNED.value or owner != worker or slot_epoch != epoch:
                    raise LedgerError(f"{tier} slot {slot} is {state} by {owner}: {worker} did not reserve it")
                if not digest or not name:
                    raise LedgerError(f"{tier} slot {slot}: an offloaded slot needs a hash and a name")
                c.execute(
                    "UPDATE slots SET state = 'OFFLOADED', owner = NULL, epoch = NULL, origin = ?, hash = ?, "
                    "content = ? WHERE tier = ? AND slot = ?",
                    (worker, digest, name, tier, slot),
                )

    def free_slots(self, worker: str, epoch: int, tier: str, slots: Sequence[int]) -> None:
        with self._tx() as c:
            self._check_lease(c, worker, epoch)
            for slot in slots:
                state, owner, slot_epoch, origin, _ = self._slot(c, tier, slot)
                mine = (state == BlockState.OWNED.value and owner == worker and slot_epoch == epoch) or (
                    state == BlockState.OFFLOADED.value and origin == worker
                )
                if not mine:
                    raise LedgerError(f"{tier} slot {slot} is {state} (origin {origin}): not {worker}'s to free")
                c.execute(f"UPDATE slots SET {_FREE} WHERE tier = ? AND slot = ?", (tier, slot))

    def adopt_slots(self, worker: str, epoch: int, tier: str, slots: Sequence[tuple[int, bytes]]) -> None:
        with self._tx() as c:
            self._check_lease(c, worker, epoch)
            for slot, digest in slots:
                state, _, _, origin, recorded = self._slot(c, tier, slot)
                if state != BlockState.OFFLOADED.value or recorded != digest:
                    raise LedgerError(f"{tier} slot {slot} is {state} with another hash: not adoptable")
                if origin == worker:
                    continue
                if self._origin_live(c, origin):
                    raise LedgerError(f"{tier} slot {slot} is counted by {origin}, who is alive: not adoptable")
                c.execute("UPDATE slots SET origin = ? WHERE tier = ? AND slot = ?", (worker, tier, slot))

    def release_slots_of(self, c: sqlite3.Cursor, worker: str) -> list[tuple[str, int]]:
        """In a fenced worker's reclaim: the slots it was writing hold bytes nobody may trust, so they
        are freed; those it offloaded stay (adoptable)."""
        partial = c.execute("SELECT tier, slot FROM slots WHERE owner = ? AND state = 'OWNED'", (worker,)).fetchall()
        c.executemany(f"UPDATE slots SET {_FREE} WHERE tier = ? AND slot = ?", partial)
        return [(t, s) for t, s in partial]

    @staticmethod
    def _slot_row(r: tuple) -> SlotRecord:
        return SlotRecord(r[0], r[1], BlockState(r[2]), r[3], r[4], r[5], r[6], r[7])

    def offloaded_with_content(self, tier: str, contents: Sequence[bytes]) -> list[SlotRecord]:
        out: list[SlotRecord] = []
        names = list(dict.fromkeys(contents))
        for part in _chunks(names, 500):  # well under SQLite's bound-parameter limit
            rows = self._rows(
                f"SELECT {_COLUMNS} FROM slots WHERE tier = ? AND state = 'OFFLOADED' "
                f"AND content IN ({','.join('?' * len(part))}) ORDER BY slot",
                [tier, *part],
            )
            out.extend(self._slot_row(r) for r in rows)
        return out

    def slots(self, tier: str) -> list[SlotRecord]:
        rows = self._rows(f"SELECT {_COLUMNS} FROM slots WHERE tier = ? ORDER BY slot", (tier,))
        return [self._slot_row(r) for r in rows]

    def tiers(self) -> list[str]:
        return [r[0] for r in self._rows("SELECT DISTINCT tier FROM slots ORDER BY tier")]


_SELECT_FREE = "SELECT slot FROM slots WHERE tier = ? AND state = 'FREE' ORDER BY slot LIMIT ?"


def _chunks(items: list[bytes], size: int) -> Iterator[list[bytes]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]
