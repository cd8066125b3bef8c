"""The worker's ledger writes (worker/kv/ledger_sync.py) against a real SQLite ledger: a store that fails a
write for a moment pauses the engine and retries, a fenced write never is retried, and how a request
ended reaches the ledger even when no next step follows."""

from __future__ import annotations

import sqlite3
import time
from collections import deque
from types import SimpleNamespace

import pytest

from steadfast.config import Config
from steadfast.kv.ledger import sqlite_requests as sqlite_ledger  # (where a checkpoint calls `stall`)
from steadfast.kv.ledger.interface import BlockRecord, BlockState, LedgerUnavailableError
from steadfast.kv.ledger.open import open_ledger, sqlite_url
from steadfast.kv.pool.client import LeaseLostError
from steadfast.wire.worker import FinishReason, SamplingParams
from steadfast.worker.core.block_types import BlockEvent
from steadfast.worker.core.request import Request, Status
from steadfast.worker.kv import ledger_sync
from steadfast.worker.kv.ledger_sync import LedgerSync

pytestmark = pytest.mark.unit

NO_BLOCKS = SimpleNamespace(block_table=lambda request_id: [], events=[])


@pytest.fixture
def node(tmp_path):
    """A ledger with a live lease for w0, and w0's LedgerSync on it."""
    url = sqlite_url(tmp_path / "ledger.db")
    ledger = open_ledger(url)
    ledger.format(4)
    epoch = ledger.acquire_lease("w0", 1, ttl_s=60).epoch
    sync = LedgerSync(Config(), SimpleNamespace(worker="w0", epoch=epoch), url, arena=None)
    yield ledger, sync
    sync.lease.stop()
    sync.ledger.close()
    ledger.close()


def fail_commits(monkeypatch, times: int, error: str = "database is locked") -> list[int]:
    """Make the next `times` checkpoint transactions fail inside SQLite's transaction, as a lock or a
    disk fault would; returns the list of hits (one entry per checkpoint transaction reached)."""
    hits: list[int] = []

    def stall(name: str) -> None:
        hits.append(1)
        if len(hits) <= times:
            raise sqlite3.OperationalError(error)

    monkeypatch.setattr(sqlite_ledger, "stall", stall)
    return hits


def running(request_id: str, outputs: list[int]) -> Request:
    r = Request(request_id, [1, 2, 3], SamplingParams(seed=7))
    r.output_ids = list(outputs)
    r.status = Status.RUNNING
    r.num_computed = 3 + len(outputs)
    return r


def test_a_transient_store_error_is_retried_and_the_checkpoint_lands(node, monkeypatch):
    ledger, sync = node
    hits = fail_commits(monkeypatch, 2)
    t0 = time.monotonic()
    sync.checkpoint([running("r", [4, 5])], NO_BLOCKS)
    assert len(hits) == 3  # two failed transactions, then the one that committed
    assert time.monotonic() - t0 >= ledger_sync.RETRY_PAUSE_S * 3  # it paused between them
    got = ledger.request("r")
    assert (got.owner, got.generated_ids, got.phase) == ("w0", [4, 5], "decode")


def test_a_store_failing_for_good_gives_up_after_the_bounded_retry(node, monkeypatch):
    ledger, sync = node
    monkeypatch.setattr(ledger_sync, "RETRY_S", 0.3)
    hits = fail_commits(monkeypatch, 1000, "disk I/O error")
    t0 = time.monotonic()
    with pytest.raises(LedgerUnavailableError, match="disk I/O error"):
        sync.checkpoint([running("r", [4])], NO_BLOCKS)
    assert time.monotonic() - t0 < 1.0 and 2 <= len(hits) <= 4  # never past RETRY_S, a pause at a time
    assert ledger.request("r") is None


def test_a_fenced_write_is_not_retried(node, monkeypatch):
    ledger, sync = node
    ledger.fence("w0")
    hits = fail_commits(monkeypatch, 0)
    t0 = time.monotonic()
    with pytest.raises(LeaseLostError):
        sync.checkpoint([running("r", [4])], NO_BLOCKS)
    assert time.monotonic() - t0 < ledger_sync.RETRY_PAUSE_S and hits == []
    assert sync.lease.lost


def test_an_abort_and_the_last_finish_before_idling_are_written_at_once(node):
    ledger, sync = node
    sync.interval = 1000  # no periodic checkpoint in this test
    aborted = running("gone", [4])
    aborted.status, aborted.finish_reason = Status.FINISHED, FinishReason.ABORT
    sync.finished(aborted)  # from the inbox, outside any step: an idle worker takes no next one
    assert ledger.request("gone").phase == "finished"
    done = running("done", [4, 5])
    sync.after_step([done], NO_BLOCKS)
    assert ledger.request("done") is None  # still running, not checkpoint time
    done.status, done.finish_reason = Status.FINISHED, FinishReason.LENGTH
    sync.finished(done)
    sync.after_step([], NO_BLOCKS)  # the batch drained: nothing else would write how it ended
    assert (ledger.request("done").phase, ledger.request("done").generated_ids) == ("finished", [4, 5])


def test_aborts_after_the_store_failed_wait_for_the_next_checkpoint_instead_of_retrying(node, monkeypatch):
    """A failed step aborts every request in flight: those aborts must not each wait on the store."""
    ledger, sync = node
    sync.interval = 1000
    monkeypatch.setattr(ledger_sync, "RETRY_S", 0.2)
    hits = fail_commits(monkeypatch, 1000)
    with pytest.raises(LedgerUnavailableError):
        sync.checkpoint([running("a", [4])], NO_BLOCKS)
    tried = len(hits)
    t0 = time.monotonic()
    for rid in ("a", "b", "c"):
        aborted = running(rid, [4])
        aborted.status, aborted.finish_reason = Status.FINISHED, FinishReason.ABORT
        sync.finished(aborted)
    assert len(hits) == tried and time.monotonic() - t0 < ledger_sync.RETRY_PAUSE_S
    monkeypatch.setattr(sqlite_ledger, "stall", lambda name: None)  # the store is back
    sync.after_step([], NO_BLOCKS)
    assert [r.phase for r in ledger.requests()] == ["finished"] * 3


def test_a_takeover_adopts_a_dead_workers_blocks_never_those_handed_to_it_for_another_request(node):
    """Found by the soak (seed 7, default model): a migration handed a request's sealed blocks to this
    worker in the ledger; before its handoff reached the engine, a takeover of another request with the
    same prompt prefix looked the names up, found those blocks (ours in the ledger, not held) and
    adopted them; the handoff's claim then found them held and the worker died. Only blocks nobody owns
    (a dead worker's, reclaimed) may be adopted."""
    ledger, sync = node  # w0: the worker taking over
    digests = {}
    sync.arena = SimpleNamespace(digest=lambda block: digests[block])  # bytes intact: they hash as sealed

    def sealed_by(worker: str, pid: int, names: list[bytes]) -> tuple[int, list[int]]:
        epoch = ledger.acquire_lease(worker, pid, ttl_s=60).epoch
        blocks = ledger.grant(worker, epoch, len(names))
        for b in blocks:
            digests[b] = f"hash-{b}".encode()
        ledger.seal(worker, epoch, [(b, digests[b], n) for b, n in zip(blocks, names, strict=True)])
        return epoch, blocks

    names = [b"prefix-block-0", b"prefix-block-1"]
    # w1 migrates a request to w0 on this node: its blocks are w0's in the ledger, the claim on its way.
    epoch, handed = sealed_by("w1", 2, names)
    ledger.hand_over("w1", epoch, handed, "w0", request_id="migrated", move="migrated/migration-1")
    assert {r.owner for r in ledger.sealed_with_content(names)} == {"w0"}
    assert sync.adoptable(names, lambda pos: False) == []  # not adopted for the taken-over request

    # The same prefix left sealed by a dead worker: that is what a takeover adopts.
    epoch, left = sealed_by("w2", 3, names)
    ledger.fence("w2")
    ledger.reclaim("w2")
    plan = sync.adoptable(names, lambda pos: False)
    assert [(pos, block) for pos, block, _ in plan] == [(0, left[0]), (1, left[1])]


def block(ledger, block_id: int) -> BlockRecord:  # noqa: ANN001 - a ledger
    return next(r for r in ledger.blocks() if r.block_id == block_id)


@pytest.mark.parametrize("comes_back", ["handed", "adopted"])
def test_a_block_released_and_back_before_the_next_sync_is_unsealed_and_sealed_again_in_order(node, comes_back):
    """Found by the soak (seed 7): an idle worker gave a sealed cached block back to the pool; before its
    next step the block was granted to another worker, sealed there and came back (handed over in a
    migration, or left by that worker's death and adopted). The stale `released` event then made this
    worker forget the block was sealed: when it reused the block it sealed it again without unsealing it
    ("block 545 is SEALED; expected one of ('OWNED',)") and the whole step failed."""
    ledger, sync = node  # w0
    digests: dict[int, bytes] = {}
    sync.arena = SimpleNamespace(digest=lambda block: digests[block])
    events: deque[BlockEvent] = deque()
    blocks = SimpleNamespace(block_table=lambda request_id: [], events=events)

    (b,) = ledger.grant("w0", sync.epoch, 1)
    digests[b] = b"first-bytes"
    events.append(BlockEvent("stored", b, b"name-1"))
    sync.before_execute(blocks)
    assert block(ledger, b).state == BlockState.SEALED

    # Idle, w0 gives it back (evicted from its cache): its events wait for w0's next step.
    events.extend([BlockEvent("removed", b, b"name-1"), BlockEvent("released", b, b"")])
    ledger.free("w0", sync.epoch, [b])  # what the pool does with a release
    epoch1 = ledger.acquire_lease("w1", 2, ttl_s=60).epoch
    assert ledger.grant("w1", epoch1, 1) == [b]
    digests[b] = b"second-bytes"
    ledger.seal("w1", epoch1, [(b, digests[b], b"name-2")])
    if comes_back == "handed":
        ledger.hand_over("w1", epoch1, [b], "w0", request_id="migrated", move="migrated/migration-1")
        sync.received([b], blocks)
    else:
        ledger.fence("w1")
        ledger.reclaim("w1")
        sync.adopt([(b, digests[b])], blocks)
    assert (block(ledger, b).state, block(ledger, b).owner) == (BlockState.SEALED, "w0")

    sync.before_execute(blocks)  # the stale events: nothing to write
    assert block(ledger, b).state == BlockState.SEALED
    # Reused for other tokens: unsealed before its bytes change, sealed again once full.
    events.append(BlockEvent("removed", b, b"name-2"))
    sync.before_execute(blocks)
    assert block(ledger, b).state == BlockState.OWNED
    digests[b] = b"third-bytes"
    events.append(BlockEvent("stored", b, b"name-3"))
    sync.before_execute(blocks)
    assert (block(ledger, b).state, block(ledger, b).hash) == (BlockState.SEALED, b"third-bytes")


def test_a_seal_the_ledger_refuses_for_one_block_never_fails_the_others_or_the_step(node):
    """Should this worker's view of a block disagree with the ledger again (the defect above, or one
    not found yet), that block alone is set right: the batch is written block by block, a block sealed
    already is unsealed and sealed with its bytes now, and an unseal of a block not sealed is moot."""
    ledger, sync = node
    digests: dict[int, bytes] = {}
    sync.arena = SimpleNamespace(digest=lambda block: digests[block])
    events: deque[BlockEvent] = deque()
    blocks = SimpleNamespace(block_table=lambda request_id: [], events=events)
    stale, fresh, other = ledger.grant("w0", sync.epoch, 3)
    digests.update({stale: b"old", fresh: b"fresh", other: b"other"})
    ledger.seal("w0", sync.epoch, [(stale, b"old", b"name-old")])  # sealed, and this worker does not know
    digests[stale] = b"new"
    sync._unseal_pending[other] = None  # an unseal of a block never sealed
    events.extend([BlockEvent("stored", stale, b"name-new"), BlockEvent("stored", fresh, b"name-fresh")])
    sync.before_execute(blocks)  # no raise
    got = {r.block_id: (r.state, r.hash) for r in ledger.blocks() if r.block_id in (stale, fresh, other)}
    assert got == {
        stale: (BlockState.SEALED, b"new"),
        fresh: (BlockState.SEALED, b"fresh"),
        other: (BlockState.OWNED, None),
    }
    events.append(BlockEvent("removed", stale, b"name-new"))  # and it is known sealed from now on
    sync.before_execute(blocks)
    assert block(ledger, stale).state == BlockState.OWNED
