"""Keeping the ledger true to a worker's KV: seals, unseals, request checkpoints, under its lease.

Per step, before the model writes any KV: check the lease is still surely ours and, in one ledger
transaction, unseal the cached blocks this step will refill. After the step: seal the blocks that
filled (hash of their bytes, chained name of their tokens, so a successor finds them by the tokens
alone). Every `snapshot_interval_steps` steps, checkpoint every request in one transaction (and when
the batch drains, or a request is aborted, so that how requests ended is on record). Any write refused
for a stale epoch raises `LeaseLostError`: the worker must exit. A write the store failed (locked, busy,
an I/O error) is retried for a few seconds, the engine paused meanwhile, before its error is raised.
A checkpoint the store refused (a row past its limits) is written again row by row: a row refused alone
is its request's error (the engine ends that request), the others land; a refusal that no row, or
every one of several, reproduces alone is raised.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Sequence

import msgspec

from steadfast.config import Config
from steadfast.kv.arena.arena import KVArena
from steadfast.kv.ledger.interface import (
    BlockRecord,
    FencedError,
    LedgerError,
    LedgerUnavailableError,
    RequestCheckpoint,
    SlotRecord,
    SlotSeal,
)
from steadfast.kv.ledger.open import open_ledger
from steadfast.kv.moves.messages import MoveOutcome
from steadfast.kv.pool.client import LeaseKeeper, LeaseLostError, PoolClient
from steadfast.util.log import about
from steadfast.wire.worker import FinishReason
from steadfast.worker.core.block_manager import BlockManager
from steadfast.worker.core.request import Request, Status

Named = tuple[int, bytes, bytes]  # a seal: block, hash of its bytes, chained name of its tokens

log = logging.getLogger(__name__)

# A store that fails a write (its transaction did not commit) is retried, the pause doubling from
# RETRY_PAUSE_S up to 1 s, for up to RETRY_S in all: a passing lock or I/O fault pauses the engine
# instead of failing every request in flight.
RETRY_S = 5.0
RETRY_PAUSE_S = 0.05


class LedgerSync:
    def __init__(self, cfg: Config, pool: PoolClient, ledger_url: str, arena: KVArena) -> None:
        lease_cfg = cfg.fault_recovery.lease
        self.worker = pool.worker
        self.epoch = pool.epoch
        self.arena = arena
        self.interval = cfg.fault_recovery.kv_cache.snapshot_interval_steps
        self.ledger = open_ledger(ledger_url)
        self.lease = LeaseKeeper(
            ledger_url,
            self.worker,
            self.epoch,
            lease_cfg.renew_interval_ms / 1000,
            lease_cfg.lease_timeout_ms / 1000,
            lease_cfg.engine_stall_ms / 1000,
        )
        self.lease.start()
        self._sealed_pending: dict[int, bytes] = {}  # filled, to seal: block -> its token name
        self._unseal_pending: dict[int, None] = {}  # sealed, refilled soon: to unseal first (in order)
        self._ledger_sealed: set[int] = set()
        self._finished: list[Request] = []
        self._refused: set[str] = set()  # requests whose rows the store refused: never written again
        self._store_failed = False  # the last write gave up on the store (until one succeeds)
        self.steps = 0
        self.checkpoints = 0
        self.checkpoint_seconds = 0.0  # time inside checkpoint transactions
        self.seal_seconds = 0.0  # time hashing and sealing blocks

    def _write(self, fn, *args, retry: bool = True):  # noqa: ANN001, ANN202 - a ledger method, its arguments, its answer
        deadline = time.monotonic() + (RETRY_S if retry else 0.0)
        pause = RETRY_PAUSE_S
        while True:
            try:
                answer = fn(self.worker, self.epoch, *args)
                self._store_failed = False
                return answer
            except FencedError as exc:  # permanent: never retried
                self.lease.lost = str(exc)
                raise LeaseLostError(str(exc)) from exc
            except LedgerUnavailableError as exc:
                if self.lease.lost:
                    raise LeaseLostError(self.lease.lost) from exc
                if time.monotonic() + pause > deadline:
                    self._store_failed = True
                    raise
                log.warning("ledger %s failed (%s); retrying in %.2fs", getattr(fn, "__name__", fn), exc, pause)
                time.sleep(pause)
                pause = min(2 * pause, 1.0)

    def before_execute(self, blocks: BlockManager) -> None:
        """Called after scheduling, before the forward pass writes KV: blocks evicted for reuse by this
        step are unsealed before any of their bytes change."""
        self.lease.check()
        self._sync_blocks(blocks)

    def _sync_blocks(self, blocks: BlockManager) -> None:
        """Write the block manager's events to the ledger: seal blocks that filled (with the hash of
        their bytes and the chained name of their tokens), unseal cached ones about to be refilled."""
        self._drain(blocks)
        if self._sealed_pending or self._unseal_pending:
            t0 = time.perf_counter()
            # A block both unsealed and sealed here was refilled (brought back from the offload tier, say)
            # since the last sync: unsealed first, then sealed with its new bytes, in one transaction.
            seals = [(b, self.arena.digest(b), name) for b, name in self._sealed_pending.items()]
            unseals = list(self._unseal_pending)
            try:
                self._write(self.ledger.seal_and_unseal, seals, unseals)
            except LedgerUnavailableError:
                raise  # the store failed, past the retries: the worker's error
            except LedgerError as exc:  # the ledger and this worker disagree on some block
                seals = self._one_by_one(seals, unseals, exc)
            self._ledger_sealed.difference_update(unseals)
            self._ledger_sealed.update(b for b, _, _ in seals)
            self._sealed_pending.clear()
            self._unseal_pending.clear()
            self.seal_seconds += time.perf_counter() - t0

    def _one_by_one(self, seals: list[Named], unseals: list[int], failure: LedgerError) -> list[Named]:
        """A refused seal/unseal batch written block by block, so that one block the ledger and this
        worker disagree on never fails the step (and every request in it): an unseal of a block not
        sealed is moot; a seal of one sealed already (ours) is unsealed and sealed with its bytes now.
        A block still refused stays unsealed here: never adopted by anyone. Returns the seals written."""
        log.error("ledger refused a seal batch (%s): writing its %d blocks one by one", failure, len(seals))
        for b in unseals:
            try:
                self._write(self.ledger.seal_and_unseal, [], [b])
            except LedgerUnavailableError:
                raise
            except LedgerError as exc:
                log.error("block %d: unseal refused (%s)", b, exc)
        written = []
        for seal in seals:
            for unseal in ([], [seal[0]]):
                try:
                    self._write(self.ledger.seal_and_unseal, [seal], unseal)
                except LedgerUnavailableError:
                    raise
                except LedgerError as exc:
                    log.error("block %d: seal refused (%s)", seal[0], exc)
                    continue
                written.append(seal)
                break
        return written

    def _drain(self, blocks: BlockManager) -> None:
        """Take the block manager's events into what is to seal and unseal (nothing written). Done before
        anything else changes what this worker knows the ledger holds: a block released to the pool, then
        granted to another worker, sealed there and handed (or left by its death) back to us must not be
        forgotten by its own stale `released` event (the soak's seed 7: sealed twice, the step failed)."""
        while blocks.events:
            event = blocks.events.popleft()
            b = event.block_id
            if event.kind == "stored":
                self._sealed_pending[b] = event.hash
            elif event.kind == "released":  # the pool freed it already: nothing left to seal or unseal
                self._sealed_pending.pop(b, None)
                self._unseal_pending.pop(b, None)
                self._ledger_sealed.discard(b)
            elif b in self._sealed_pending:
                del self._sealed_pending[b]  # evicted before it was ever sealed
            elif b in self._ledger_sealed:
                self._unseal_pending[b] = None

    def adoptable(self, names: list[bytes], cached: Callable[[int], bool]) -> list[tuple[int, int, bytes]] | None:
        """Sealed blocks a dead worker left that may be adopted for a request: (position, block, hash).

        `names` are the chained names of the request's leading full blocks, from the token ids its
        client holds; a block sealed under the same name holds KV of exactly those tokens (the name
        covers every token before it too). Taken: the leading run of SEALED blocks that are nobody's
        and whose bytes still hash to what was sealed. `cached(position)` says this worker already
        holds that block's content: the run goes on past it without adopting. The run stops at the
        first block that is neither (filled after the last seal: recomputed). None when a sealed
        block's bytes disagree with its hash: then nothing of this request is trusted.
        """
        found: dict[bytes, BlockRecord] = {}
        for block in self.ledger.sealed_with_content(names):
            # Nobody's only. One already ours in the ledger that this engine does not hold was handed to
            # us for a request whose handoff is still on its way (a soak, seed 7: adopted for another
            # request of the same prefix, the handoff's claim then found it held and the worker died).
            if block.hash and block.owner is None:
                found.setdefault(block.content or b"", block)
        plan = []
        for pos, name in enumerate(names):
            if cached(pos):
                continue
            block = found.get(name)
            if block is None:
                break
            if self.arena.digest(block.block_id) != block.hash:
                log.error("block %d bytes disagree with their sealed hash", block.block_id)
                return None
            plan.append((pos, block.block_id, block.hash))
        return plan

    def adopt(self, plan: list[tuple[int, bytes]], blocks: BlockManager) -> None:
        """Make verified sealed blocks ours in the ledger (all or none; LedgerError if any was taken)."""
        if plan:
            self._drain(blocks)
            self._write(self.ledger.adopt, plan)
            self._ledger_sealed.update(b for b, _ in plan)

    def hand_over(
        self,
        block_ids: list[int],
        copies: list[tuple[int, bytes]],
        to_worker: str,
        request_id: str = "",
        move: str = "",
    ) -> list[int]:
        """Make a request's blocks `to_worker`'s in the ledger (same-node prefill → decode handoff),
        sealing the fresh copies of shared blocks (block, token name) and recording the move session
        `move` COMMITTED in the same transaction.
        Returns the blocks that are sealed, for the receiver to know. Raises ReceiverGoneError when
        `to_worker` has no live lease, with nothing changed."""
        seals = [(b, self.arena.digest(b), name) for b, name in copies]
        copied = {b for b, _ in copies}
        sealed = [b for b in block_ids if b in self._ledger_sealed or b in copied]
        self._write(self.ledger.hand_over, block_ids, to_worker, seals, request_id, move)
        return sealed

    def handed(self, blocks: BlockManager) -> None:
        """Blocks just handed to another worker: forget them now (their `released` events), not at the next
        step, by which time the same blocks may have come back (a migration there and back) and be sealed."""
        self._sync_blocks(blocks)

    def decide_move(self, session: str, proposal: MoveOutcome) -> MoveOutcome:
        """Record a KV move's decision unless one is (this worker being its destination); the recorded one.
        Called from the receiver's thread: the ledger object serves several threads."""
        return MoveOutcome(self._write(self.ledger.decide_move, session, proposal))

    def received(self, sealed: list[int], blocks: BlockManager) -> None:
        """Blocks handed to this worker that another sealed: ours to unseal when they are reused."""
        self._drain(blocks)
        self._ledger_sealed.update(sealed)

    def finished(self, request: Request) -> None:
        rid = request.request_id
        if rid in self._refused:
            self._refused.discard(rid)
            return  # the store refused its row: nothing of it is written
        if request.finish_reason is FinishReason.ABORT and not self._store_failed:
            # Often stopped for a resume on another worker, which may take the row once it says finished;
            # written now, since an idle worker takes no next step to checkpoint it. One try: a failed
            # step aborts every request, and must not wait on a failing store once per request.
            try:
                self._write(self.ledger.checkpoint, [self._record(request, None)], retry=False)
                return
            except LedgerUnavailableError as exc:
                log.warning("request %s: abort not recorded yet (%s)", rid, exc, extra=about(rid))
            except LedgerError as exc:
                log.error("request %s: the ledger refused its row (%s)", rid, exc, extra=about(rid))
                return
        self._finished.append(request)

    def after_step(
        self, requests: Collection[Request], blocks: BlockManager, prompt_done: bool = False
    ) -> dict[str, str]:
        """`prompt_done`: a request finished its prefill this step. Checkpoint then too, so that its
        prompt's blocks, usually most of its KV, can be adopted however soon its worker dies. Returns
        the requests whose rows the store refused (id -> why): the engine ends each with an error."""
        # A worker fenced while it computed must not hand out what it computed.
        self.lease.check()
        # Sealed now, not at the next step: a block can be adopted as soon as its last token is out.
        self._sync_blocks(blocks)
        self.steps += 1
        # Drained: no next step would write how the last requests ended.
        if prompt_done or self.steps % self.interval == 0 or (self._finished and not requests):
            return self.checkpoint(requests, blocks)
        return {}

    def checkpoint(self, requests: Collection[Request], blocks: BlockManager) -> dict[str, str]:
        """Every request's row; returns those the store refused (id -> why), the others written."""
        t0 = time.perf_counter()
        ended = {r.request_id for r in self._finished}
        records = [self._record(r, blocks) for r in (*requests, *self._finished) if r.request_id not in self._refused]
        refused: dict[str, str] = {}
        if records:
            try:
                self._write(self.ledger.checkpoint, records)
            except LedgerUnavailableError:
                raise  # the store failed, past the retries: the worker's error, not a request's
            except LedgerError as exc:
                refused = self._refused_alone(records, exc)
                self._refused.update(rid for rid in refused if rid not in ended)  # (ended ones are not written again)
            self.checkpoints += 1
            self.checkpoint_seconds += time.perf_counter() - t0
        self._finished.clear()
        return refused

    def _refused_alone(self, records: list[RequestCheckpoint], failure: LedgerError) -> dict[str, str]:
        """Each row of a refused checkpoint written alone: those the store refuses again (id -> why)."""
        refused = {}
        for r in records:
            try:
                self._write(self.ledger.checkpoint, [r])
            except LedgerUnavailableError:
                raise
            except LedgerError as exc:
                refused[r.request_id] = str(exc)
                log.error("request %s: the ledger refused its row: %s", r.request_id, exc, extra=about(r.request_id))
        if not refused or (len(refused) > 1 and len(refused) == len(records)):
            raise failure  # no row is refused alone, or every one is: the store's or this worker's fault
        return refused

    @staticmethod
    def _record(r: Request, blocks: BlockManager | None) -> RequestCheckpoint:
        if r.status is Status.FINISHED:
            phase = "finished"
        elif r.status is Status.WAITING:
            phase = "queued"
        else:
            phase = "prefill" if r.num_computed < len(r.prompt_ids) else "decode"
        return RequestCheckpoint(
            r.request_id,
            r.prompt_ids,
            msgspec.json.encode(r.params).decode(),
            list(r.output_ids),
            delivered=len(r.output_ids),
            phase=phase,
            block_table=list(blocks.block_table(r.request_id)) if blocks is not None else [],
        )

    def close(self, pool: PoolClient | None = None, held: list[int] | None = None) -> None:
        """A clean exit: give the blocks back and release the lease, so nothing waits for expiry."""
        self.lease.stop()
        if pool is not None and not self.lease.lost:
            try:
                pool.release(held or [], attempts=1)  # at shutdown the pool may be gone too: one try
                self.ledger.release_lease(self.worker, self.epoch)
            except Exception as exc:  # the pool's arbiter cleans up after the lease expires anyway
                log.warning("clean release failed (%s); the lease will expire instead", exc)
        self.ledger.close()


class LedgerSlots:
    """The offload tier's slots as the node's ledger records them, written under this worker's lease
    (the offloader's `SlotBook`)."""

    def __init__(self, sync: LedgerSync, tier: str) -> None:
        self.sync = sync
        self.tier = tier

    def reserve(self, count: int) -> list[int]:
        return self.sync._write(self.sync.ledger.reserve_slots, self.tier, count) if count else []

    def store(self, seals: Sequence[SlotSeal]) -> None:
        if seals:
            self.sync._write(self.sync.ledger.store_slots, self.tier, list(seals))

    def free(self, slots: Sequence[int]) -> None:
        if slots:
            self.sync._write(self.sync.ledger.free_slots, self.tier, list(slots))

    def offloaded(self, names: Sequence[bytes]) -> list[SlotRecord]:
        return self.sync.ledger.offloaded_with_content(self.tier, names)

    def adopt(self, slots: Sequence[tuple[int, bytes]]) -> None:
        if slots:
            self.sync._write(self.sync.ledger.adopt_slots, self.tier, list(slots))
