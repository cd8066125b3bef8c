"""The SQLite ledger's request checkpoints (see `Ledger`'s "requests"): a row per request, its prompt and
parameters in a body row written once, under the writer's lease. A part of `SqliteLedger`, kept apart so
that each module stays one job; it uses the ledger's transaction, read and lease helpers."""

from __future__ import annotations

from collections.abc import Sequence

from steadfast.kv.ledger.interface import RequestCheckpoint
from steadfast.kv.ledger.sqlite_rows import ids_blob, ids_of
from steadfast.util.failpoints import stall


class SqliteRequests:
    """Mixed into `SqliteLedger`, which provides `_tx`, `_rows`, `_check_lease`, `_live`, `_runs_elsewhere`
    and `wall_clock`."""

    def checkpoint(self, worker: str, epoch: int, records: Sequence[RequestCheckpoint]) -> None:
        now = self.wall_clock()
        with self._tx() as c:
            self._check_lease(c, worker, epoch)
            for r in records:
                row = c.execute("SELECT owner, epoch, phase FROM requests WHERE id = ?", (r.request_id,)).fetchone()
                if row is not None and self._runs_elsewhere(c, worker, *row):
                    continue  # it was handed over: this writer's view is stale
                if c.execute("SELECT 1 FROM request_bodies WHERE id = ?", (r.request_id,)).fetchone() is None:
                    c.execute(
                        "INSERT INTO request_bodies (id, prompt, params) VALUES (?, ?, ?)",
                        (r.request_id, ids_blob(r.prompt_ids), r.params),
                    )
                c.execute(
                    "INSERT OR REPLACE INTO requests (id, prompt, params, generated, delivered, owner, epoch, phase, "
                    "blocks, updated) VALUES (?, X'', '', ?, ?, ?, ?, ?, ?, ?)",
                    (
                        r.request_id,
                        ids_blob(r.generated_ids),
                        r.delivered,
                        worker,
                        epoch,
                        r.phase,
                        ids_blob(r.block_table),
                        now,
                    ),
                )
            stall("checkpoint_commit")  # a test's failpoint: rows written, COMMIT not yet

    @staticmethod
    def _request_row(r: tuple) -> RequestCheckpoint:
        return RequestCheckpoint(r[0], ids_of(r[1]), r[2], ids_of(r[3]), r[4], r[7], ids_of(r[8]), r[5], r[6], r[9])

    _REQUESTS = (
        "SELECT r.id, coalesce(b.prompt, r.prompt), coalesce(b.params, r.params), r.generated, r.delivered, "
        "r.owner, r.epoch, r.phase, r.blocks, r.updated FROM requests r LEFT JOIN request_bodies b ON b.id = r.id"
    )

    def request(self, request_id: str) -> RequestCheckpoint | None:
        rows = self._rows(f"{self._REQUESTS} WHERE r.id = ?", (request_id,))
        return self._request_row(rows[0]) if rows else None

    def requests(self, owner: str | None = None) -> list[RequestCheckpoint]:
        if owner is None:
            rows = self._rows(f"{self._REQUESTS} ORDER BY r.id")
        else:
            rows = self._rows(f"{self._REQUESTS} WHERE r.owner = ? ORDER BY r.id", (owner,))
        return [self._request_row(r) for r in rows]

    def prune_requests(self, older_than_s: float) -> int:
        cutoff = self.wall_clock() - older_than_s
        with self._tx() as c:
            old = c.execute("SELECT id, owner, epoch, phase FROM requests WHERE updated < ?", (cutoff,)).fetchall()
            # A row of a live owner that is not finished is a request still running there (or an end
            # its worker has not written yet): kept, whatever its age.
            gone = [(r[0],) for r in old if r[3] == "finished" or not self._live(c, r[1], r[2])]
            c.executemany("DELETE FROM requests WHERE id = ?", gone)
            c.executemany("DELETE FROM request_bodies WHERE id = ?", gone)
        return len(gone)
