"""The kvpool daemon: owns a node's KV arena and is the only writer of block ownership in its ledger.

Workers map the arena and ask the pool for blocks in batches (so their hot path rarely waits on it).
The pool is also the lease arbiter: a lease past its expiry is fenced (epoch bumped) at once, but the
worker's blocks are reclaimed only once its process is confirmed gone on this node (invariant 2).
The daemon keeps no state of its own beyond the arena and the ledger, so when it restarts it simply
re-attaches both and carries on; running workers never notice more than a retried request. It also
deletes request rows nobody will write again once the idempotency window has passed them. No message
crashes it: a malformed one is answered with an error (the sender, a DEALER, waits for a reply).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import msgspec
import zmq

from steadfast.config import Config, config_from_dict
from steadfast.kv.arena.files import make_arena, make_tier, open_arena, tier_spec
from steadfast.kv.arena.grants import Reserved
from steadfast.kv.arena.spec import ArenaSpec
from steadfast.kv.ledger.interface import (
    BlockState,
    FencedError,
    LeaseState,
    LedgerError,
    LedgerUnavailableError,
    RequestCheckpoint,
)
from steadfast.kv.ledger.open import open_ledger
from steadfast.kv.pool.client import Throttled
from steadfast.util.log import about, setup_logging
from steadfast.util.proc import die_with_parent, process_gone
from steadfast.wire.codec import encode
from steadfast.wire.pool import PoolAttach, PoolFence, PoolGrant, PoolRegister, PoolReply, ToPool, decode_to_pool

log = logging.getLogger("steadfast.kvpool")
_junk = Throttled(log)


class KVPool:
    def __init__(
        self, cfg: Config, arena_path: str, ledger_url: str, spec: ArenaSpec, device: str = "cpu", tier_path: str = ""
    ) -> None:
        """`tier_path`: the file of the node's offload tier (`cache.offload_tier`), made here (or
        re-attached after a restart) and owned by the pool like the arena; empty: no tier."""
        self.cfg = cfg
        self.ttl_s = cfg.fault_recovery.lease.lease_timeout_ms / 1000
        self.ledger_url = ledger_url
        self.ledger = open_ledger(ledger_url)
        # On the CPU the arena is a file the pool makes and never maps (its workers do): no torch here.
        self.arena_path, self.spec, self.device_arena = arena_path, spec, None
        if device != "cpu":
            from steadfast.kv.arena.arena import KVArena  # device memory is torch's to allocate and share

            # Device memory dies with its process: a restarted daemon starts a new arena, and whatever
            # the ledger says of the old one's blocks is void.
            self.device_arena, self.arena_path = KVArena.create_device(spec, device), ""
            if self.ledger.blocks():
                self.ledger.arena_replaced()
                log.warning("new device arena: every earlier lease fenced, every block freed")
        elif Path(arena_path).exists():
            self.spec, fd = open_arena(arena_path, os.O_RDWR)  # a restart: the bytes are still there
            log.info("re-attached KV arena %s (%d blocks)", arena_path, self.spec.num_blocks)
        else:
            fd = make_arena(arena_path, spec.nbytes, json.dumps(asdict(spec)), reserve=self._ahead(spec) is None)
            # A ledger that outlives its arena (configured, in etcd or a kept file): a new arena holds none
            # of the bytes it describes, so its leases are fenced and its blocks voided, as for a device.
            if any(b.state != BlockState.FREE for b in self.ledger.blocks()):
                self.ledger.arena_replaced()
                log.warning("new KV arena on a ledger of an earlier one: every earlier lease fenced, every block freed")
        self.ledger.format(self.spec.num_blocks)
        # The arena's memory made as its blocks are handed out (`cache.kv_ahead_mb`), else all reserved.
        self.reserved: Reserved | None = None
        if self.device_arena is None:
            self._reserve(fd)
        self.tier, self.tier_path = (cfg.cache.offload_tier, tier_path) if tier_path else ("", "")
        if self.tier:
            slots = cfg.cache.tier_slots(self.spec.num_blocks)
            make_tier(tier_path, tier_spec(self.spec, slots))
            self.ledger.format_tier(self.tier, slots)
            log.info("offload tier %s: %d blocks in %s", self.tier, slots, tier_path)
        self._reclaimed: set[tuple[str, int]] = set()  # (worker, fenced epoch) already reclaimed
        self.window_s = cfg.fault_recovery.request.idempotency_window
        # A row outlives the window by at most half of it (30 s at most); a scan per tick would cost for nothing.
        self.prune_every_s = min(max(self.window_s / 2, 1.0), 30.0)

    def _ahead(self, spec: ArenaSpec) -> int | None:
        """Blocks made ahead of the highest one handed out; None: the whole arena, reserved at start."""
        blocks = (self.cfg.cache.kv_ahead_mb << 20) // spec.block_bytes
        return max(blocks, self.cfg.cache.pool_grant_batch) if 0 < blocks < spec.num_blocks else None

    def _reserve(self, fd: int) -> None:
        """Made now: the blocks in use (a restart) and `ahead` more; the rest as grants reach them."""
        ahead = self._ahead(self.spec)
        if ahead is None:  # reserved whole when made (a restarted pool: reserved whole now, a no-op if so)
            try:
                os.posix_fallocate(fd, 0, self.spec.nbytes)
            finally:
                os.close(fd)
            return
        self.reserved = Reserved(fd, self.spec, Path(self.arena_path).name)
        used = max((b.block_id + 1 for b in self.ledger.blocks() if b.state != BlockState.FREE), default=0)
        self.reserved.ensure(used + ahead)
        log.info(
            "KV arena %s: %d of %d blocks made (%d ahead of use), the rest as they are granted",
            self.arena_path,
            self.reserved.made,
            self.spec.num_blocks,
            ahead,
        )

    @property
    def made(self) -> int:
        """Blocks of the arena whose memory is made, for the workers' answers (0: all of them)."""
        return self.reserved.made if self.reserved is not None else 0

    def _grant(self, msg: PoolGrant) -> list[int]:
        """Blocks for a worker, only ones whose memory is made: when the made ones run short, more are
        made at once (the background keeps `ahead` blocks made past the highest granted one)."""
        r = self.reserved
        if r is None:
            return self.ledger.grant(msg.worker, msg.epoch, msg.count)
        ids = self.ledger.grant(msg.worker, msg.epoch, msg.count, below=r.made)
        if len(ids) < msg.count and r.made < self.spec.num_blocks:
            # Every block at or past `made` is FREE (none was ever granted): make what is missing.
            r.ensure(r.made + msg.count - len(ids))
            ids += self.ledger.grant(msg.worker, msg.epoch, msg.count - len(ids), below=r.made)
        ahead = self._ahead(self.spec) or 0
        r.want(max(ids, default=0) + 1 + ahead)
        return ids

    def handle(self, msg: ToPool) -> PoolReply:
        try:
            if isinstance(msg, PoolRegister):
                return self._register(msg)
            if isinstance(msg, PoolAttach):
                return self._where(PoolReply(True))
            if isinstance(msg, PoolFence):
                return self._fence_dead(msg)
            if isinstance(msg, PoolGrant):
                return PoolReply(True, msg.epoch, self._grant(msg), made=self.made)
            self.ledger.free(msg.worker, msg.epoch, msg.block_ids)
            return PoolReply(True, msg.epoch)
        except LedgerUnavailableError:
            raise  # the store failed, not the request: the daemon exits and is restarted; workers retry
        except LedgerError as exc:
            return PoolReply(False, error=str(exc), fenced=isinstance(exc, FencedError))

    def _register(self, msg: PoolRegister) -> PoolReply:
        old = self.ledger.lease(msg.worker)
        if old is not None and old.pid != msg.pid and old.state == LeaseState.ACTIVE and process_gone(old.pid):
            # The previous incarnation died without its lease expiring yet: fence it now, it is gone.
            self.ledger.fence(msg.worker)
            old = self.ledger.lease(msg.worker)
        if old is not None and old.state != LeaseState.ACTIVE and process_gone(old.pid):
            self.ledger.reclaim(msg.worker)
        lease = self.ledger.acquire_lease(msg.worker, msg.pid, self.ttl_s)
        log.info("%s (pid %d) registered with epoch %d", msg.worker, msg.pid, lease.epoch)
        return self._where(PoolReply(True, lease.epoch))

    def _fence_dead(self, msg: PoolFence) -> PoolReply:
        """The supervisor reaped this worker: fence and reclaim at once instead of waiting for expiry.
        Invariant 2 still holds: nothing is reassigned before the process is confirmed gone here too."""
        lease = self.ledger.lease(msg.worker)
        if lease is None:
            return PoolReply(True)
        if lease.pid != msg.pid or not process_gone(msg.pid):
            return PoolReply(False, error=f"{msg.worker} is not pid {msg.pid}, or that process still runs")
        epoch = self.ledger.fence(msg.worker) if lease.state == LeaseState.ACTIVE else lease.epoch
        sealed, quarantined = self.ledger.reclaim(msg.worker)
        self._reclaimed.add((msg.worker, epoch))
        log.warning(
            "%s (pid %d) died: fenced at epoch %d, %d sealed blocks kept for adoption, %d quarantined",
            msg.worker,
            msg.pid,
            epoch,
            len(sealed),
            len(quarantined),
        )
        return PoolReply(True, epoch, block_ids=sealed)

    def _where(self, reply: PoolReply) -> PoolReply:
        reply.arena_path = self.arena_path
        reply.ledger_url = self.ledger_url
        reply.tier, reply.tier_path = self.tier, self.tier_path
        reply.made = self.made
        if self.device_arena is not None:
            # A device arena travels as an IPC handle, one per importer (torch counts each of them).
            reply.cuda_ipc = self.device_arena.export_ipc()
        return reply

    def arbitrate(self) -> None:
        """Fence expired leases; reclaim the blocks of fenced workers whose process is gone."""
        now = time.monotonic()
        for lease in self.ledger.leases():
            if lease.state == LeaseState.ACTIVE and lease.expires < now:
                epoch = self.ledger.fence(lease.worker)
                log.warning("lease of %s (pid %d) expired: fenced, epoch now %d", lease.worker, lease.pid, epoch)
                stranded: list[RequestCheckpoint] = []
                with contextlib.suppress(LedgerUnavailableError):  # a log line is not worth a failed round
                    stranded = [r for r in self.ledger.requests(lease.worker) if r.phase != "finished"]
                for r in stranded:
                    what = "request %s: owner %s fenced at token %d; its KV waits for a new owner"
                    log.warning(what, r.request_id, lease.worker, len(r.generated_ids), extra=about(r.request_id))
            elif (
                lease.state in (LeaseState.FENCED, LeaseState.RELEASED)
                and (lease.worker, lease.epoch) not in self._reclaimed
                and process_gone(lease.pid)
            ):
                sealed, quarantined = self.ledger.reclaim(lease.worker)
                self._reclaimed.add((lease.worker, lease.epoch))
                if sealed or quarantined:
                    log.warning(
                        "reclaimed %s: %d sealed kept, %d quarantined", lease.worker, len(sealed), len(quarantined)
                    )

    def prune(self) -> None:
        """Delete request rows past the idempotency window: no router resumes from them any more."""
        try:
            pruned = self.ledger.prune_requests(self.window_s)
        except LedgerUnavailableError as exc:  # upkeep, not a request: the next tick tries again
            log.warning("pruning request rows failed: %s", exc)
            return
        if pruned:
            log.info("pruned %d request rows older than %.0fs", pruned, self.window_s)

    def close(self) -> None:
        self.ledger.close()


def answer(pool: KVPool, frames: list[bytes]) -> list[bytes]:
    """The frames answering one message off the ROUTER socket (the sender's identity, then one frame).
    A malformed message, or values no call takes (a pid or block id past SQLite's 64-bit integers), is
    answered with an error, never raised. Only the store failing (LedgerUnavailableError) is."""
    ident, *body = frames
    try:
        if len(body) != 1:
            raise ValueError(f"{len(body)} frames after the identity; a request is one")
        reply = pool.handle(decode_to_pool(body[0]))
    except (msgspec.DecodeError, ValueError, OverflowError, TypeError) as exc:
        _junk.warning("malformed request to the kvpool answered with an error: %s", exc)
        reply = PoolReply(False, error=f"malformed request: {exc}")
    return [ident, encode(reply)]


def serve(pool: KVPool, sock: zmq.Socket, stopping: Callable[[], bool]) -> None:
    """Answer workers on `sock` (ROUTER), arbitrate leases every renew interval and prune request rows,
    until `stopping()`."""
    tick = pool.cfg.fault_recovery.lease.renew_interval_ms / 1000
    next_tick = next_prune = time.monotonic()
    while not stopping():
        # At most 100 ms per wait: a SIGTERM (which does not interrupt the poll) is seen that soon.
        if sock.poll(max(1, min(100, int((next_tick - time.monotonic()) * 1000)))):
            sock.send_multipart(answer(pool, sock.recv_multipart()))
        now = time.monotonic()
        if now >= next_tick:
            pool.arbitrate()
            next_tick = time.monotonic() + tick
        if now >= next_prune:
            pool.prune()
            next_prune = now + pool.prune_every_s


def main() -> None:
    parser = argparse.ArgumentParser(description="Steadfast kvpool daemon")
    parser.add_argument("--config-json", required=True)
    parser.add_argument("--address", required=True, help="ZeroMQ address to bind for workers")
    parser.add_argument("--arena", required=True)
    parser.add_argument("--ledger", required=True, help="the ledger's URL (sqlite:///path/to/ledger.db)")
    parser.add_argument("--spec-json", required=True, help="arena spec, used when creating it")
    parser.add_argument("--ready-file", help="written once the pool serves")
    parser.add_argument("--device", default="cpu", help="cpu: a /dev/shm file arena; cuda[:N]: device memory")
    parser.add_argument("--tier", default="", help="the offload tier's file (cache.offload_tier), made here")
    args = parser.parse_args()
    die_with_parent()
    setup_logging("kvpool")
    cfg = config_from_dict(json.loads(args.config_json))
    pool = KVPool(cfg, args.arena, args.ledger, ArenaSpec(**json.loads(args.spec_json)), args.device, args.tier)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(args.address)
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    if args.ready_file:
        Path(args.ready_file).write_text(str(os.getpid()))
    serve(pool, sock, lambda: stop["now"])
    pool.close()
    ctx.destroy(linger=0)
    logging.shutdown()
    os._exit(0)  # closed and flushed: the interpreter's teardown (torch) would only delay a shutdown


if __name__ == "__main__":
    main()
