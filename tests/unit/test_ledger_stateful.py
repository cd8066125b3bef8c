"""Property-based test of the ledger's block state machine, leases and epochs (hypothesis stateful).

Random sequences of acquire / renew / grant / write / seal / free / clock advance / lease expiry +
fencing / reclaim / request checkpoints and handoffs, with injected crashes inside transactions, must
never break an invariant of ARCHITECTURE.md §2: the ledger's own integrity check and the history checker
stay clean throughout, and each request row is the one a model of its ownership predicts.
Runs once per ledger backend (the `ledger_backend` fixture).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from steadfast.kv.ledger.etcd import EtcdLedger
from steadfast.kv.ledger.history import RecordingLedger, check_history
from steadfast.kv.ledger.interface import BlockState, LeaseState, Ledger, LedgerError, RequestCheckpoint
from steadfast.kv.ledger.open import open_ledger
from steadfast.kv.ledger.sqlite import SqliteLedger
from tests.unit.conftest import lapse, ledger_url_in

pytestmark = pytest.mark.unit

WORKERS = ("w0", "w1", "w2")
REQUESTS = ("r0", "r1")
BLOCKS = 12
TTL = 3.0
STALE = st.sampled_from([False, False, False, True])  # mostly the current epoch, sometimes a stale one


class InjectedCrash(Exception):
    """Stands for the process dying after its writes but before COMMIT."""


def arm_crashes(ledger: Ledger, crash_now: Callable[[], bool]) -> None:
    """Make each of the ledger's transactions ask `crash_now()` after its writes, before COMMIT, and
    raise InjectedCrash there when it says so. It reaches into how each backend commits: SQLite's
    `_tx`; etcd's `_run` (an operation decided, its transaction not sent)."""
    if isinstance(ledger, EtcdLedger):
        run = ledger._run

        def crashing_run(name, fn):
            def decide_then_crash(tx):
                result = fn(tx)
                if tx.writes and crash_now():
                    raise InjectedCrash()
                return result

            return run(name, decide_then_crash)

        ledger._run = crashing_run  # type: ignore[method-assign]
        return
    if not isinstance(ledger, SqliteLedger):
        raise NotImplementedError(f"no crash injection for {type(ledger).__name__}")
    tx = ledger._tx

    @contextmanager
    def crashing_tx():
        with tx() as c:
            yield c
            if crash_now():
                raise InjectedCrash()

    ledger._tx = crashing_tx  # type: ignore[method-assign]


class LedgerMachine(RuleBasedStateMachine):
    def __init__(self, backend: str) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="ledger-prop-")
        self.now = 0.0
        self.crash_next = False
        self.inner = open_ledger(ledger_url_in(backend, Path(self.dir), "l"), clock=lambda: self.now)
        # etcd's leases run on etcd's clock: long enough that none lapses but by `lease_lapses`.
        self.ttl = TTL if backend == "sqlite" else 600.0
        arm_crashes(self.inner, self._crash_now)
        self.inner.format(BLOCKS)
        self.ledger = RecordingLedger(self.inner)
        self.epochs: dict[str, list[int]] = {w: [] for w in WORKERS}  # every epoch each worker ever held
        self.rows: dict[str, tuple[str, int, str]] = {}  # the model: request -> (owner, epoch, phase)
        self.accepted = False  # whether the last `_try` call was

    def _crash_now(self) -> bool:
        crash, self.crash_next = self.crash_next, False
        return crash

    def teardown(self) -> None:
        self.inner.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _try(self, fn, *args):
        name = fn.__name__
        self.accepted = False
        try:
            result = fn(*args)
        except (LedgerError, InjectedCrash) as exc:
            event(f"{name}: {type(exc).__name__}")
            return None
        event(f"{name}: accepted")
        self.accepted = True
        return result

    def _runs_elsewhere(self, request: str, worker: str) -> bool:
        """The model's rule: another worker runs `request` while it holds, live, the lease it wrote its row under."""
        if request not in self.rows:
            return False
        owner, epoch, phase = self.rows[request]
        lease = self.inner.lease(owner)
        live = lease is not None and lease.epoch == epoch and lease.state == LeaseState.ACTIVE
        return owner != worker and phase != "finished" and live and self.now <= lease.expires

    def _epoch(self, worker: str, stale: bool) -> int:
        held = self.epochs[worker]
        if not held:
            return 1
        return held[0] if stale else held[-1]

    def _owned(self, worker: str, states: tuple[BlockState, ...]) -> list[int]:
        return [b.block_id for b in self.inner.blocks() if b.owner == worker and b.state in states]

    @rule()
    def crash_inside_next_transaction(self) -> None:
        self.crash_next = True

    @rule(worker=st.sampled_from(WORKERS))
    def acquire(self, worker: str) -> None:
        lease = self._try(self.ledger.acquire_lease, worker, 100, self.ttl)
        if lease is not None:
            self.epochs[worker].append(lease.epoch)

    @rule(worker=st.sampled_from(WORKERS), stale=STALE)
    def renew(self, worker: str, stale: bool) -> None:
        self._try(self.ledger.renew_lease, worker, self._epoch(worker, stale), self.ttl)

    @rule(dt=st.floats(min_value=0.0, max_value=1.5))
    def advance_clock(self, dt: float) -> None:
        self.now += dt

    @rule(worker=st.sampled_from(WORKERS))
    def lease_lapses(self, worker: str) -> None:
        """The store's clock runs out this worker's lease (on etcd, etcd ends it: `advance_clock` moves
        only the clock leases are reported on)."""
        lease = self.inner.lease(worker)
        if lease is not None and lease.state == LeaseState.ACTIVE and lease.expires >= self.now:
            lapse(self.inner, worker, self)

    @rule()
    def expire_and_fence(self) -> None:
        for lease in self.inner.leases():
            if lease.state == LeaseState.ACTIVE and lease.expires < self.now:
                epoch = self._try(self.ledger.fence, lease.worker)
                if epoch is not None:
                    self.epochs[lease.worker].append(epoch)

    @rule(worker=st.sampled_from(WORKERS), stale=STALE, count=st.integers(1, 4))
    def grant(self, worker: str, stale: bool, count: int) -> None:
        self._try(self.ledger.grant, worker, self._epoch(worker, stale), count)

    @rule(worker=st.sampled_from(WORKERS), stale=STALE, block=st.integers(0, BLOCKS - 1))
    def write(self, worker: str, stale: bool, block: int) -> None:
        self._try(self.ledger.authorize_write, worker, self._epoch(worker, stale), block)

    @rule(worker=st.sampled_from(WORKERS), stale=STALE, pick=st.integers(0, BLOCKS))
    def seal(self, worker: str, stale: bool, pick: int) -> None:
        owned = self._owned(worker, (BlockState.OWNED,)) or [pick % BLOCKS]
        block = owned[pick % len(owned)]
        self._try(self.ledger.seal, worker, self._epoch(worker, stale), [(block, b"h%d" % block)])

    @rule(worker=st.sampled_from(WORKERS), stale=STALE, take=st.integers(0, 3))
    def free(self, worker: str, stale: bool, take: int) -> None:
        owned = self._owned(worker, (BlockState.OWNED, BlockState.SEALED))
        self._try(self.ledger.free, worker, self._epoch(worker, stale), owned[: take + 1] if owned else [take])

    @rule(worker=st.sampled_from(WORKERS), stale=STALE, pick=st.integers(0, BLOCKS), forged=st.booleans())
    def adopt(self, worker: str, stale: bool, pick: int, forged: bool) -> None:
        # Mostly an ownerless sealed block with its true hash; sometimes any block, or a wrong hash.
        orphans = [b.block_id for b in self.inner.blocks() if b.state == BlockState.SEALED and b.owner is None]
        block = orphans[pick % len(orphans)] if orphans else pick % BLOCKS
        digest = b"forged" if forged else b"h%d" % block
        self._try(self.ledger.adopt, worker, self._epoch(worker, stale), [(block, digest)])

    @rule(
        worker=st.sampled_from(WORKERS),
        stale=STALE,
        to=st.sampled_from(WORKERS),
        take=st.integers(0, 3),
        request=st.sampled_from(REQUESTS),
    )
    def hand_over(self, worker: str, stale: bool, to: str, take: int, request: str) -> None:
        owned = self._owned(worker, (BlockState.OWNED, BlockState.SEALED))
        blocks = owned[: take + 1] or [take]
        to_epoch = self._try(self.ledger.hand_over, worker, self._epoch(worker, stale), blocks, to, (), request)
        if self.accepted and self.rows.get(request, ("",))[0] == worker:
            self.rows[request] = (to, to_epoch, "transfer")

    @rule(worker=st.sampled_from(WORKERS), stale=STALE, request=st.sampled_from(REQUESTS), done=st.booleans())
    def checkpoint(self, worker: str, stale: bool, request: str, done: bool) -> None:
        epoch, phase = self._epoch(worker, stale), "finished" if done else "decode"
        runs_elsewhere = self._runs_elsewhere(request, worker)
        self._try(self.ledger.checkpoint, worker, epoch, [RequestCheckpoint(request, [1], "{}", [2], 1, phase)])
        if self.accepted and not runs_elsewhere:
            self.rows[request] = (worker, epoch, phase)

    @precondition(lambda self: any(lease.state != LeaseState.ACTIVE for lease in self.inner.leases()))
    @rule(worker=st.sampled_from(WORKERS))
    def reclaim(self, worker: str) -> None:
        self._try(self.ledger.reclaim, worker)

    @invariant()
    def ledger_is_consistent(self) -> None:
        assert self.inner.check_integrity() == []

    @invariant()
    def history_is_clean(self) -> None:
        assert check_history(self.ledger.history) == []

    @invariant()
    def request_rows_are_the_models(self) -> None:
        assert {r.request_id: (r.owner, r.epoch, r.phase) for r in self.inner.requests()} == self.rows

    @invariant()
    def no_block_has_two_owners(self) -> None:
        for b in self.inner.blocks():
            if b.state == BlockState.FREE:
                assert b.owner is None


def test_ledger_state_machine(ledger_backend: str) -> None:
    # etcd answers each call over HTTP (~1 ms, several per step): fewer runs there, the same rules.
    examples = 300 if ledger_backend == "sqlite" else 25
    run_state_machine_as_test(
        lambda: LedgerMachine(ledger_backend),
        settings=settings(max_examples=examples, stateful_step_count=50, deadline=None),
    )
