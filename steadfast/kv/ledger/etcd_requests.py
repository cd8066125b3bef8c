"""The etcd ledger's request checkpoints (see `Ledger`'s "requests"): a row per request under the writer's
lease, its body (prompt, parameters) written once in parts of at most `BODY_PART` bytes, transactions
kept under etcd's limits by construction. A part of `EtcdLedger`, kept apart so that each module stays
one job; it uses the ledger's transaction runner and lease checks."""

from __future__ import annotations

from collections.abc import Sequence

from steadfast.kv.ledger.etcd_records import (
    BodyRec,
    RequestRec,
    body_of,
    body_parts,
    encode,
    request_of,
)
from steadfast.kv.ledger.etcd_tx import MAX_OPS, Tx
from steadfast.kv.ledger.interface import (
    RequestCheckpoint,
)
from steadfast.util.failpoints import stall

CHECKPOINT_ROWS = 40  # request rows per transaction: each may compare its row and its owner's lease
# Bytes of keys and values one checkpoint transaction writes: under etcd's default --max-request-bytes
# (1.5 MiB), with room for its comparisons and the reads that answer a failed commit.
TXN_BYTES = 2**20


class EtcdRequests:
    """Mixed into `EtcdLedger`, which provides `_run`, `_etcd`, `client`, `keys` and the lease checks."""

    def checkpoint(self, worker: str, epoch: int, records: Sequence[RequestCheckpoint]) -> None:
        # Rows are independent: a long batch goes in parts, each under the same lease check. A body too
        # big to go beside its row follows it, in transactions of its own.
        left, later = list(records), []
        while True:
            took, big = self._run("checkpoint", lambda tx, left=left: self._checkpoint(tx, worker, epoch, left))
            later += big
            left = left[took:]
            if not left:
                break
        for request_id, parts in later:
            self._put_body(worker, epoch, request_id, parts)

    def _checkpoint(
        self, tx: Tx, worker: str, epoch: int, records: Sequence[RequestCheckpoint]
    ) -> tuple[int, list[tuple[str, list[bytes]]]]:
        """The rows of the leading `records` that fit one transaction, each with its body where the
        ledger has none yet and it fits too. Returns how many records it took, and the bodies left for
        transactions of their own (their rows are written now, saying no body yet)."""
        records = records[:CHECKPOINT_ROWS]
        keys = [self.keys.request(r.request_id) for r in records]
        raws = tx.get_many([self.keys.lease(worker), self.keys.alive(worker), *keys])[2:]
        self._check_lease(tx, worker, epoch)
        rows = [request_of(raw) if raw is not None else None for raw in raws]
        owners = {row.owner for row in rows if row is not None and row.owner not in (None, worker)}
        tx.get_many(k for o in sorted(owners, key=str) for k in (self.keys.lease(o), self.keys.alive(o)))
        room, ops = TXN_BYTES, MAX_OPS - len(tx.tracked)  # each body part is one more comparison
        writes: list[tuple[bytes, bytes]] = []
        later: list[tuple[str, list[bytes]]] = []
        took = 0
        now = self.wall_clock()
        for key, r, row in zip(keys, records, rows, strict=True):
            if row is not None and self._runs_elsewhere(tx, worker, row):
                took += 1
                continue  # it was handed over: this writer's view is stale
            stored = row.body if row is not None else 0
            parts = [] if stored else body_parts(BodyRec(list(r.prompt_ids), r.params))
            body = [(self.keys.body_part(r.request_id, k), part) for k, part in enumerate(parts)]
            new = RequestRec(
                [], "", list(r.generated_ids), r.delivered, worker, epoch, r.phase, list(r.block_table), now, stored
            )
            size = len(key) + len(encode(new))
            body_size = sum(len(k) + len(v) for k, v in body)
            if body and size + body_size <= room and len(body) <= ops:
                new.body = len(body)  # the body goes in with its row
                writes += body
                room, ops = room - body_size, ops - len(body)
            elif writes and (size > room or (body and size + body_size <= TXN_BYTES)):
                break  # the rest go in the next transaction
            elif body:
                later.append((r.request_id, parts))  # too big to go beside its row: after it
            writes.append((key, encode(new)))
            room -= size
            took += 1
        tx.get_many(k for k, _ in writes)  # what each write replaces, in one read
        for k, v in writes:
            tx.put(k, v)
        stall("checkpoint_commit")  # a test's failpoint: rows decided, not committed yet
        return took, later

    def _put_body(self, worker: str, epoch: int, request_id: str, parts: list[bytes]) -> None:
        """A body too big to go beside its row: its parts in transactions of at most TXN_BYTES, then
        the row's count of them (unless the row is no longer this writer's: its new owner writes one)."""
        batches: list[list[tuple[bytes, bytes]]] = [[]]
        for k, part in enumerate(parts):
            key = self.keys.body_part(request_id, k)
            if batches[-1] and sum(len(a) + len(b) for a, b in batches[-1]) + len(key) + len(part) > TXN_BYTES:
                batches.append([])
            batches[-1].append((key, part))

        row_key = self.keys.request(request_id)

        def put(tx: Tx, batch: list[tuple[bytes, bytes]], last: bool) -> None:
            reads = [self.keys.lease(worker), self.keys.alive(worker), *(k for k, _ in batch)]
            got = tx.get_many([*reads, row_key] if last else reads)
            self._check_lease(tx, worker, epoch)
            for k, v in batch:
                tx.put(k, v)
            row = request_of(got[-1]) if last and got[-1] is not None else None
            if row is not None and (row.owner, row.epoch) == (worker, epoch) and not row.body:
                row.body = len(parts)
                tx.put(row_key, encode(row))

        for i, batch in enumerate(batches, 1):
            last = i == len(batches)
            self._run("checkpoint", lambda tx, b=batch, last=last: put(tx, b, last))

    def _runs_elsewhere(self, tx: Tx, worker: str, row: RequestRec) -> bool:
        """Whether a worker other than `worker` runs the request of this row: it wrote the row under
        the lease it still holds, live, and has not finished it."""
        return row.owner not in (None, worker) and row.phase != "finished" and self._live(tx, row.owner, row.epoch)

    def request(self, request_id: str) -> RequestCheckpoint | None:
        def read(tx: Tx) -> RequestCheckpoint | None:
            raw = tx.get(self.keys.request(request_id), track=False)
            if raw is None:
                return None
            row = request_of(raw)
            parts = [v for _, v in tx.scan(self.keys.body(request_id))] if row.body else []
            return _checkpoint(request_id, row, parts)

        return self._run("request", read)

    def requests(self, owner: str | None = None) -> list[RequestCheckpoint]:
        found, bodies = self._run("requests", lambda tx: tx.scan_many([self.keys.req_dir, self.keys.body_dir]))
        parts: dict[str, list[bytes]] = {}
        for key, value in bodies:  # in key order: each request's parts in turn
            parts.setdefault(self.keys.name_in(self.keys.body_dir, key.rpartition(b"/")[0]), []).append(value)
        rows = []
        for key, value in found:
            request_id = self.keys.name_in(self.keys.req_dir, key)
            rows.append(_checkpoint(request_id, request_of(value), parts.get(request_id, [])))
        return sorted((r for r in rows if owner is None or r.owner == owner), key=lambda r: r.request_id)

    def prune_requests(self, older_than_s: float) -> int:
        cutoff = self.wall_clock() - older_than_s
        found = self._run("prune_requests", lambda tx: tx.scan(self.keys.req_dir))
        old = [k for k, v in found if request_of(v).updated < cutoff]
        pruned = 0

        def prune(tx: Tx, keys: list[bytes]) -> int:
            gone = 0
            for key, raw in zip(keys, tx.get_many(keys), strict=True):
                row = request_of(raw) if raw is not None else None
                # A row of a live owner that is not finished is a request still running there (or an end
                # its worker has not written yet): kept, whatever its age.
                if (
                    row is not None
                    and row.updated < cutoff
                    and (row.phase == "finished" or not self._live(tx, row.owner, row.epoch))
                ):
                    tx.delete(key)
                    tx.delete_prefix(self.keys.body(self.keys.name_in(self.keys.req_dir, key)))
                    gone += 1
            return gone

        for i in range(0, len(old), CHECKPOINT_ROWS):
            part = old[i : i + CHECKPOINT_ROWS]
            pruned += self._run("prune_requests", lambda tx, part=part: prune(tx, part))
        return pruned


def _checkpoint(request_id: str, row: RequestRec, parts: list[bytes]) -> RequestCheckpoint:
    """A row as the interface reads it, with its body: from its parts, or inline in a row written before
    bodies were kept apart; none (an empty prompt) while its parts are still being written."""
    if not row.body:
        body = BodyRec(row.prompt, row.params)
    else:
        body = body_of(parts) if len(parts) == row.body else BodyRec([], "")
    return RequestCheckpoint(
        request_id,
        body.prompt,
        body.params,
        row.generated,
        row.delivered,
        row.phase,
        row.blocks,
        row.owner,
        row.epoch,
        row.updated,
    )


assert MAX_OPS >= 3 * CHECKPOINT_ROWS + 2  # a checkpoint's compares: rows, their owners' leases, its own lease
assert MAX_OPS >= 2 * CHECKPOINT_ROWS  # a prune's writes: each row and its body's parts
