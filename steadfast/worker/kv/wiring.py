"""This worker's KV wire to other nodes: which side it plays (send, receive, both), its CURVE keys,
the sender and receiver it starts."""

from __future__ import annotations

import logging

from steadfast.config import Config
from steadfast.kv.arena.arena import KVArena
from steadfast.kv.moves.checks import IncomingLimits
from steadfast.kv.moves.faults import fault_switch, transfer_fault_source
from steadfast.kv.moves.receiver import KVReceiver
from steadfast.kv.moves.sender import KVSender
from steadfast.kv.pool.client import PoolClient
from steadfast.wire import curve
from steadfast.wire.curve import KeyFile, TransferSide
from steadfast.wire.worker import (
    WorkerRole,
)
from steadfast.worker.kv.ledger_sync import LedgerSync

log = logging.getLogger("steadfast.worker")


def transfer_side(role: WorkerRole, given: TransferSide | None) -> TransferSide:
    """What this worker does on the KV wire between nodes: what the launcher said (it knows the node);
    a worker started by hand (tests) without it goes by its role."""
    if given is not None:
        return given
    return {WorkerRole.PREFILL: TransferSide.SEND, WorkerRole.DECODE: TransferSide.RECEIVE}.get(role, TransferSide.NONE)


def transfer_keys(cfg: Config, side: TransferSide, paths: list[str] | None) -> dict[TransferSide, KeyFile]:
    """This worker's CURVE keys by side (BOTH: a sender's and a receiver's) from the launcher's files; a
    separate decode node with `transfer.curve` and no keys (or no CURVE in libzmq) is an error at start,
    not an open wire."""
    if side is TransferSide.NONE:
        return {}
    wanted = {TransferSide.SEND, TransferSide.RECEIVE} if side is TransferSide.BOTH else {side}
    if paths:
        curve.require_curve()
        keys = {}
        for path in paths:
            k = KeyFile.load(path)
            if k.side not in wanted:
                raise SystemExit(f"--transfer-keys {path} holds the {k.side} side's keys; this worker's side is {side}")
            keys[k.side] = k
        if set(keys) != wanted:
            raise SystemExit(
                f"--transfer-keys: this worker's side is {side}; keys for {sorted(wanted - set(keys))} missing"
            )
        return keys
    if cfg.transfer.curve and cfg.server.decode_node == "separate":
        raise SystemExit("transfer.curve is on but no --transfer-keys were given: the KV wire would be open")
    log.warning("KV transfers to and from this worker are not authenticated (no --transfer-keys)")
    return {}


def _other_nodes(
    cfg: Config,
    arena: KVArena,
    pool_address: str,
    pool: PoolClient,
    sync: LedgerSync,
    side: TransferSide,
    keys: dict[TransferSide, KeyFile] | None,
) -> tuple[KVSender | None, KVReceiver | None]:
    """KV across nodes: a sender where this worker sends (a prefill for a decode worker elsewhere, a
    migration away), a receiver where it receives (a prefill's KV, a migration's), whose blocks come from
    this node's pool through a client of its own (the receiver works on its own thread). On one node,
    neither: no TCP socket is bound or connected."""
    t = cfg.transfer
    keys = keys or {}
    sender = receiver = None
    faults = fault_switch(transfer_fault_source(t))  # None unless a fault drill is configured
    if side in (TransferSide.SEND, TransferSide.BOTH):
        block_size = arena.spec.block_size
        sender = KVSender(
            arena.spec.num_layers, t.timeout, t.retries, t.backoff, faults, block_size, keys.get(TransferSide.SEND)
        )
    if side in (TransferSide.RECEIVE, TransferSide.BOTH):
        grants = PoolClient(pool_address, pool.worker, epoch=pool.epoch, on_made=arena.populate_to)
        receiver = KVReceiver(
            arena,
            arena.spec.block_size,
            [f"tcp://{t.listen_host}:0"] * t.paths,
            grants.grant,
            grants.release,
            t.timeout,
            sync.lease.check,
            sync.decide_move,
            keys.get(TransferSide.RECEIVE),
            IncomingLimits.of(t, arena.spec.num_blocks),
            faults,
        )
    return sender, receiver
