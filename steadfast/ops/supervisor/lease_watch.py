"""The supervisor's watch over its nodes' leases (ops/supervisor/launcher.py runs it every loop round).

A worker its pool fenced (its lease expired: hung, stopped) can never write again: the supervisor ends
it, so that its death is certain and its requests can move. A lease that lapsed and is still active
`LAPSED_GRACE_S` later is fenced here: its node's pool is not arbitrating (stopped or hung with the rest
of its node; a running pool fences within one renew interval, so they never both do), and its workers'
requests must not wait for it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from steadfast.kv.ledger.interface import LeaseState, Ledger, LedgerUnavailableError
from steadfast.kv.ledger.open import open_ledger

log = logging.getLogger("steadfast.launcher")

LAPSED_GRACE_S = 2.0
LEDGER_WAIT_S = 2.0  # the supervisor's ledger calls wait this long for the store, not the workers' 10 s


@dataclass
class LeaseWatch:
    fenced_here: set[str] = field(default_factory=set)  # workers this supervisor fenced, not their pool
    _ledgers: dict[str, Ledger] = field(default_factory=dict)  # by URL, opened when first needed
    _lapsed: dict[tuple[str, str], float] = field(default_factory=dict)  # (ledger, worker) -> first seen lapsed

    def fenced(self, ledgers: dict[str, str], now: float) -> set[str]:
        """The fenced workers of every node (`ledgers`: name -> ledger URL), after fencing the leases that
        lapsed `LAPSED_GRACE_S` ago. A store that does not answer is logged and read again next round."""
        fenced: set[str] = set()
        for name, url in ledgers.items():
            try:
                if url not in self._ledgers:
                    # A short wait: this runs in the loop that notices deaths, which a store without a
                    # quorum (etcd) must not hold up for long.
                    self._ledgers[url] = open_ledger(url, timeout_s=LEDGER_WAIT_S)
                fenced |= self._fence_lapsed(url, now)
            except LedgerUnavailableError as exc:
                log.warning("%s's ledger unavailable to the supervisor: %s", name, exc)
        return fenced

    def _fence_lapsed(self, url: str, now: float) -> set[str]:
        ledger = self._ledgers[url]
        fenced = set()
        for lease in ledger.leases():
            key = (url, lease.worker)
            if lease.state == LeaseState.ACTIVE and lease.expires < now:
                if now - self._lapsed.setdefault(key, now) < LAPSED_GRACE_S:
                    continue
                ledger.fence(lease.worker)
                self.fenced_here.add(lease.worker)
                log.error("%s's lease lapsed and its pool did not fence it: the supervisor did", lease.worker)
                fenced.add(lease.worker)
            else:
                self._lapsed.pop(key, None)
                if lease.state == LeaseState.FENCED:
                    fenced.add(lease.worker)
        return fenced
