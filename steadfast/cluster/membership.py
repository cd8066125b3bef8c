"""The router part's view of the nodes (`serve --role router --join etcd://...`): it polls the nodes'
records in etcd (cluster/members.py) and turns what changed into the supervisor's news the router acts on.

- A worker new in a node's record: `WorkerJoined` (never one this router declared dead: a node that
  comes back lists the workers it had, which were fenced meanwhile).
- A worker gone from a live node's record: `WorkerDied` with the exit code the node wrote (its own
  supervisor reaped it and fenced it through its pool).
- A node whose record is gone (etcd ended its lease: the node did not renew in time, or it left): every
  lease still active in its ledger is fenced first — from then on etcd refuses those workers' writes,
  whatever state their host is in — then each of its workers is `WorkerDied`, and their requests resume
  on other nodes. A fence that fails (etcd without a quorum) is tried again next round; nothing is
  declared dead before its lease is fenced.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable

from steadfast.cluster.members import Members, NodeRecord
from steadfast.kv.ledger.interface import LeaseState, LedgerError
from steadfast.kv.ledger.open import open_ledger
from steadfast.wire.worker import WorkerDied, WorkerJoined

log = logging.getLogger("steadfast.router.membership")

POLL_S = 0.25
TCP_ADDRESS = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):[0-9]{1,5}\Z")  # where a node's worker listens
LEDGER_WAIT_S = 2.0  # a fence's wait for the store; it is tried again next round


class Membership:
    def __init__(
        self,
        members: Members,
        notice: Callable[[WorkerDied | WorkerJoined], Awaitable[None]],
        on_node: Callable[[str], None] = lambda url: None,
    ) -> None:
        """`notice`: the router's handler of supervisor news; `on_node(ledger_url)`: a node seen first."""
        self.members = members
        self._notice = notice
        self._on_node = on_node
        self.known: dict[str, NodeRecord] = {}  # each node as last read
        self.dead: set[int] = set()  # workers declared dead: never taken back
        self.lost: list[tuple[str, float]] = []  # (node, when its loss was acted on), for /admin and tests

    async def run(self) -> None:
        while True:
            try:
                await self.apply(await asyncio.to_thread(self.members.nodes))
            except Exception:  # noqa: BLE001 - etcd unreachable, or one round gone wrong: the next one
                log.exception("the nodes' records not acted on this round")
            await asyncio.sleep(POLL_S)

    async def apply(self, nodes: dict[str, NodeRecord]) -> None:
        """Act on one reading of every node's record."""
        for name, record in nodes.items():
            old = self.known.get(name)
            if old is not None and old.generation != record.generation:
                # It lapsed and registered again between two readings: its earlier workers are lost.
                if not await self._lose(old):
                    continue  # (not fenced yet: next round)
                old = None
            if old is None:
                log.info("node %s joined (ledger %s)", name, self.members.node_ledger_url(name))
                self._on_node(self.members.node_ledger_url(name))
            before = {w.worker_id for w in old.workers} if old is not None else set()
            now = {w.worker_id for w in record.workers}
            codes = {g.worker_id: (g.pid, g.exit_code) for g in record.gone}
            for w in record.workers:
                if w.worker_id not in before and w.worker_id not in self.dead:
                    if TCP_ADDRESS.match(w.address) is None:
                        log.warning("node %s lists worker %d at %r, not tcp://host:port", name, w.worker_id, w.address)
                        continue
                    await self._notice(WorkerJoined(w.worker_id, w.address, w.role, w.like))
            for worker_id in sorted(before - now):
                pid, code = codes.get(worker_id, (0, -1))
                await self._died(worker_id, pid, code)
            self.known[name] = record
        for name in [n for n in self.known if n not in nodes]:
            await self._lose(self.known[name])

    async def _lose(self, record: NodeRecord) -> bool:
        """A node's registration ended: fence what it held, then declare its workers dead; False when the
        fence could not be made (nothing declared: again next round)."""
        if not await asyncio.to_thread(self._fence_node, record):
            return False
        if self.known.get(record.name) is record:
            del self.known[record.name]
        self.lost.append((record.name, time.time()))
        for w in record.workers:
            await self._died(w.worker_id, w.pid, -1)
        return True

    async def _died(self, worker_id: int, pid: int, code: int) -> None:
        if worker_id in self.dead:
            return
        self.dead.add(worker_id)
        await self._notice(WorkerDied(worker_id, pid, code))

    def _fence_node(self, record: NodeRecord) -> bool:
        """Fence every active lease in a lost node's ledger; False if the store did not answer."""
        try:
            # The ledger named after the node, never a URL a record supplies.
            ledger = open_ledger(self.members.node_ledger_url(record.name), timeout_s=LEDGER_WAIT_S)
            try:
                fenced = [lease.worker for lease in ledger.leases() if lease.state == LeaseState.ACTIVE]
                for worker in fenced:
                    ledger.fence(worker)
            finally:
                ledger.close()
        except (LedgerError, OSError) as exc:
            log.warning("node %s is gone but its ledger did not answer (fenced next round): %s", record.name, exc)
            return False
        if not record.workers and not fenced:
            log.info("node %s left", record.name)  # (its workers retired first, releasing their leases)
            return True
        log.error(
            "node %s's membership lapsed: fenced %s; its %d worker(s)' requests move to other nodes",
            record.name,
            ", ".join(fenced) or "nothing (no active lease)",
            len(record.workers),
        )
        return True
