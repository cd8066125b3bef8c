"""The etcd ledger's leases (see `Ledger`'s "leases"): a worker's lease is an etcd lease with
`alive/{worker}` = its epoch attached, so it ends on etcd's clock; its record (epoch, pid, state, TTL)
beside it; epochs from one counter. A part of `EtcdLedger`, kept apart so that each module stays one
job; it uses the ledger's transaction helpers (`_run`, `_etcd`, `_revoke`, `_all_blocks`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from steadfast.kv.ledger.etcd_records import Keys, LeaseRec, encode, lease_of
from steadfast.kv.ledger.interface import BlockState, FencedError, Lease, LeaseHeldError, LeaseState, LedgerError
from steadfast.util.etcd import EtcdClient

if TYPE_CHECKING:
    from steadfast.kv.ledger.etcd_tx import Tx

_OWNED, _SEALED = BlockState.OWNED.value, BlockState.SEALED.value


class EtcdLeases:
    """Mixed into `EtcdLedger`."""

    keys: Keys
    client: EtcdClient
    clock: Callable[[], float]
    _run: Callable[..., object]

    def _lease_parts(self, tx: Tx, worker: str) -> tuple[LeaseRec | None, int | None]:
        """The worker's lease record and the epoch it holds live (None: lapsed, fenced or released)."""
        raw, alive = tx.get_many([self.keys.lease(worker), self.keys.alive(worker)])
        return (lease_of(raw) if raw is not None else None), (int(alive) if alive is not None else None)

    def _live(self, tx: Tx, worker: str | None, epoch: int | None) -> bool:
        """Whether `worker` still holds, live, the lease of `epoch` (that it wrote a row under)."""
        return worker is not None and self._lease_parts(tx, worker)[1] == epoch

    def _check_lease(self, tx: Tx, worker: str, epoch: int) -> LeaseRec:
        rec, alive = self._lease_parts(tx, worker)
        if rec is None:
            raise FencedError(f"{worker} holds no lease")
        if epoch != rec.epoch:
            raise FencedError(f"{worker} wrote with epoch {epoch}; its current epoch is {rec.epoch}")
        if rec.state != LeaseState.ACTIVE:
            raise FencedError(f"{worker}'s lease (epoch {epoch}) is {rec.state}")
        if alive != epoch:
            raise FencedError(f"{worker}'s lease (epoch {epoch}) expired")
        return rec

    def _next_epoch(self, tx: Tx) -> int:
        epoch = int(tx.get(self.keys.epoch) or b"0") + 1
        tx.put(self.keys.epoch, b"%d" % epoch)
        return epoch

    def _lease(self, worker: str, rec: LeaseRec, alive: int | None) -> Lease:
        live = rec.state == LeaseState.ACTIVE and alive == rec.epoch
        return Lease(worker, rec.epoch, self.clock() + rec.ttl if live else -math.inf, rec.pid, LeaseState(rec.state))

    def acquire_lease(self, worker: str, pid: int, ttl_s: float) -> Lease:
        with self._etcd("granting a lease"):
            etcd_lease, ttl = self.client.lease_grant(max(1, math.ceil(ttl_s)))

        def acquire(tx: Tx) -> int:
            rec, alive = self._lease_parts(tx, worker)
            if rec is not None and rec.state == LeaseState.ACTIVE and alive == rec.epoch:
                raise LeaseHeldError(f"{worker} already holds a live lease")
            left = sum(b.owner == worker and b.state in (_OWNED, _SEALED) for b in self._all_blocks(tx).values())
            if left:
                # A new incarnation never inherits blocks by name: the old one is fenced and reclaimed first.
                raise LedgerError(f"{worker} still holds {left} blocks of an earlier epoch; fence and reclaim first")
            epoch = self._next_epoch(tx)
            tx.put(self.keys.lease(worker), encode(LeaseRec(epoch, pid, LeaseState.ACTIVE.value, ttl, etcd_lease)))
            tx.put(self.keys.alive(worker), b"%d" % epoch, lease=etcd_lease)
            return epoch

        try:
            epoch = self._run("acquire_lease", acquire)
        except BaseException:
            self._revoke(etcd_lease)
            raise
        return Lease(worker, epoch, self.clock() + ttl, pid, LeaseState.ACTIVE)

    def renew_lease(self, worker: str, epoch: int, ttl_s: float) -> Lease:
        rec = self._run("renew_lease", lambda tx: self._check_lease(tx, worker, epoch))
        with self._etcd("renewing a lease"):
            left = self.client.lease_keepalive(rec.etcd_lease)
        if left <= 0:  # it lapsed between the check and the renewal
            raise FencedError(f"{worker}'s lease (epoch {epoch}) expired")
        return Lease(worker, epoch, self.clock() + left, rec.pid, LeaseState.ACTIVE)

    def release_lease(self, worker: str, epoch: int) -> None:
        def release(tx: Tx) -> LeaseRec:
            rec = self._check_lease(tx, worker, epoch)
            rec.state = LeaseState.RELEASED.value
            tx.put(self.keys.lease(worker), encode(rec))
            tx.delete(self.keys.alive(worker))
            return rec

        self._revoke(self._run("release_lease", release).etcd_lease)

    def fence(self, worker: str) -> int:
        def fence(tx: Tx) -> LeaseRec:
            rec, _ = self._lease_parts(tx, worker)
            if rec is None:
                raise LedgerError(f"{worker} has no lease to fence")
            return self._fence(tx, worker, rec)

        rec = self._run("fence", fence)
        self._revoke(rec.etcd_lease)
        return rec.epoch

    def _fence(self, tx: Tx, worker: str, rec: LeaseRec) -> LeaseRec:
        rec.epoch, rec.state = self._next_epoch(tx), LeaseState.FENCED.value
        tx.put(self.keys.lease(worker), encode(rec))
        tx.delete(self.keys.alive(worker))
        return rec

    def lease(self, worker: str) -> Lease | None:
        rec, alive = self._run("lease", lambda tx: self._lease_parts(tx, worker))
        return self._lease(worker, rec, alive) if rec is not None else None

    def leases(self) -> list[Lease]:
        def read(tx: Tx) -> list[Lease]:
            records, alive = tx.scan_many([self.keys.lease_dir, self.keys.alive_dir])
            held = {self.keys.name_in(self.keys.alive_dir, k): int(v) for k, v in alive}
            named = ((self.keys.name_in(self.keys.lease_dir, k), lease_of(v)) for k, v in records)
            return [self._lease(w, rec, held.get(w)) for w, rec in named]

        return sorted(self._run("leases", read), key=lambda lease: lease.worker)
