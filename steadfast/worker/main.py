"""The worker process: a busy loop around one Engine.

Drain inputs (block only when idle) → step → emit outputs, plus a status report every interval.
A failure inside a step fails the requests of that step with an error output instead of dropping them.
SIGTERM, or the router's Retire after a drain, makes the worker leave: with no request it stops after the
current step; with some, it reports STOPPING (the router then migrates them away, and sends new ones
elsewhere) and stops once none is left, or after `server.shutdown_timeout` whatever remains.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal

import torch
import zmq

from steadfast.config import config_from_dict
from steadfast.config.env import threads_override, torch_threads
from steadfast.kv.arena.arena import KVArena, map_arena
from steadfast.kv.arena.spec import arena_spec
from steadfast.kv.arena.tier import TierFile
from steadfast.kv.pool.client import LeaseLostError, PoolClient
from steadfast.util.failpoints import stall
from steadfast.util.log import setup_logging
from steadfast.util.proc import die_with_parent
from steadfast.wire.curve import ClusterSide, KeyFile, TransferSide, guard
from steadfast.wire.queues import WorkerInbox, WorkerOutbox
from steadfast.wire.worker import (
    AddRequest,
    SamplingParams,
    WorkerRole,
    WorkerState,
)
from steadfast.worker.core.step_cost import StepCost
from steadfast.worker.engine import Engine
from steadfast.worker.kv.ledger_sync import LedgerSync
from steadfast.worker.kv.wiring import _other_nodes, transfer_keys, transfer_side
from steadfast.worker.loaded import LoadedModel, load_model
from steadfast.worker.loop import WorkerLoop
from steadfast.worker.startup import StartupPhases, trim_heap
from steadfast.worker.threads import ThreadGovernor

log = logging.getLogger("steadfast.worker")

EXIT_LEASE_LOST = 3
# Two different texts: the second must not find the first's blocks cached.
WARM_UP_TEXTS = ("Steadfast warms up its kernels before it takes traffic. ", "Every stream goes on through a failure. ")
DRAIN_ROUNDS = 8  # reads of the inbox before a step; bounded, so a flood of messages cannot starve the step


def warm_up(engine: Engine) -> None:
    """One short request through the whole engine before reporting ready: the first forward passes
    pay for thread pools, kernel selection and caches, and a standby promoted under a dead worker's
    load must not pay that then. Not in a worker forked from a zygote, which warmed up already (its
    kernels chosen, its caches made): there it would only start the thread pool, which the first step
    starts as cheaply, and it would run just when a replacement is forked, beside the worker that took
    over (both on every core: their threads' spinning barriers stretched its steps to 1.9 s).
    The second of its two requests times the steps afresh (the first pays the one-time costs), so that
    the scheduler knows what a step costs before the first client's."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    sync, engine.sync = engine.sync, None  # not a client's request: no checkpoint of it in the ledger
    try:
        for i, text in enumerate(WARM_UP_TEXTS):
            engine.scheduler.cost = StepCost()
            engine.generate([AddRequest(f"warm-up-{i}", engine.tokenizer.encode(text * 8), params)])
    finally:
        engine.sync = sync


def main(argv: list[str] | None = None, loaded: LoadedModel | None = None) -> None:
    """`argv`: the arguments (default: the command line's); `loaded`: the model already built, in a worker
    forked by its node's zygote (worker/zygote.py), which then only builds its own small state."""
    parser = argparse.ArgumentParser(description="Steadfast worker process")
    parser.add_argument("--config-json", required=True)
    parser.add_argument("--worker-id", type=int, required=True)
    parser.add_argument("--input", required=True, help="ZeroMQ address this worker binds for requests")
    parser.add_argument("--output", required=True, help="ZeroMQ address of the router's output socket")
    parser.add_argument("--arena", help="path of a private KV arena to map (no kvpool)")
    parser.add_argument("--device-arena", action="store_true", help="allocate a private arena in device memory")
    parser.add_argument("--pool", help="ZeroMQ address of the node's kvpool daemon")
    parser.add_argument("--role", type=WorkerRole, choices=list(WorkerRole), default=WorkerRole.MIXED)
    parser.add_argument("--cluster-keys", default="", help="a node part's key file (router queues over TCP)")
    parser.add_argument("--weights-dir", default="", help="folder of the node's weight store (empty: load a copy)")
    parser.add_argument("--transfer-side", type=TransferSide, choices=list(TransferSide), help="KV wire role")
    parser.add_argument(
        "--transfer-keys", action="append", help="file of a side's CURVE keys for the KV wire (0600; repeat for both)"
    )
    args = parser.parse_args(argv)
    die_with_parent()
    setup_logging(f"worker{args.worker_id}")
    cfg = config_from_dict(json.loads(args.config_json))
    fixed = cfg.server.threads_per_worker or threads_override()
    most = fixed or torch_threads(cfg.server.computing_workers)
    torch.set_num_threads(most)
    governor = None if fixed else ThreadGovernor(most, torch.set_num_threads)

    ctx = zmq.Context()
    keys = KeyFile.load(args.cluster_keys, ClusterSide.NODE) if args.cluster_keys else None
    # Before the inbox binds; kept for the process's life (a CURVE server whose handler is gone admits anyone).
    zap = guard(ctx, keys.peers) if keys is not None else None
    outbox = WorkerOutbox(ctx, args.output, keys)
    inbox = WorkerInbox(ctx, args.input, keys)
    loop = WorkerLoop(cfg, args.worker_id, inbox, outbox, args.role, governor, args.pool or "")

    def on_term(signum: int, frame: object) -> None:
        loop.leave()  # its next status report says STOPPING: the router drains it

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    outbox.send(loop.status(WorkerState.LOADING))
    forked = loaded is not None
    phases = StartupPhases("interpreter and imports" if loaded is None else "fork")
    if loaded is None:
        loaded = load_model(cfg, args.weights_dir)
    phases.mark("model")
    sync = None
    if args.pool:
        registrar = PoolClient(args.pool, f"worker{args.worker_id}")
        reply = registrar.register(os.getpid())
        registrar.close()
        arena = map_arena(reply)
        arena.populate_to(reply.made)
        # The worker's client from here on: it makes resident what the pool says it has made.
        pool = PoolClient(args.pool, registrar.worker, epoch=reply.epoch, on_made=arena.populate_to)
        sync = LedgerSync(cfg, pool, reply.ledger_url, arena)
        log.info("registered with the kvpool as %s, epoch %d", pool.worker, pool.epoch)
        side = transfer_side(args.role, args.transfer_side)
        keys = transfer_keys(cfg, side, args.transfer_keys)
        sender, receiver = _other_nodes(cfg, arena, args.pool, pool, sync, side, keys)
        tier = TierFile.attach(reply.tier, reply.tier_path, arena.spec) if reply.tier_path else None
        engine = Engine(cfg, loaded, arena, source=pool, sync=sync, sender=sender, receiver=receiver, tier=tier)
    elif args.device_arena:
        spec = arena_spec(cfg, loaded.model_cfg)
        engine = Engine(cfg, loaded, KVArena.create_device(spec, cfg.model.resolved_device))
    else:
        engine = Engine(cfg, loaded, KVArena.attach(args.arena))
    if cfg.cache.offload_tier != "none" and engine.offload is None:
        log.warning("cache.offload_tier %s needs the kvpool (external_ledger): no offload tier", cfg.cache.offload_tier)
    phases.mark("kv")
    stall(f"worker{args.worker_id}_start")  # a fault test's slow start (unarmed: one lookup)
    if not forked:
        warm_up(engine)
    trim_heap()
    phases.mark("warm-up")
    log.info(
        "ready in %.1fs on %s: %d KV blocks of %d tokens (%s)",
        phases.total,
        engine.arena.device,
        engine.blocks.num_blocks,
        engine.blocks.block_size,
        phases.summary(),
    )
    try:
        loop.run(engine)
    except LeaseLostError as exc:
        log.error("lease lost, every further write would be refused; exiting: %s", exc)
        os._exit(EXIT_LEASE_LOST)  # no clean-up that could write: this process is fenced
    engine.kv.close()
    if engine.offload is not None:
        engine.offload.close()
    if sync is not None:
        sync.close(pool, engine.blocks.held_blocks)
    if zap is not None:
        zap.stop()  # (before its context goes: its pipe is one of the context's sockets)
    ctx.destroy(linger=200)  # (the router reads fast; gone, nothing would reach it anyway)
    # Everything is released and sent: skip the interpreter's teardown of torch and the model (about a
    # second), which a rollout or a shutdown would wait for.
    logging.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
