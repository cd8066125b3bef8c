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
import time

import torch
import zmq

from steadfast.cluster_keys import ClusterKeys, ClusterSide, guard
from steadfast.config import Config, config_from_dict
from steadfast.env import threads_override, torch_threads, transfer_fault_source
from steadfast.failpoints import stall
from steadfast.ipc import WorkerInbox, WorkerOutbox, die_with_parent, setup_logging
from steadfast.kv.arena import KVArena, map_arena
from steadfast.kv.moves import curve
from steadfast.kv.moves.checks import IncomingLimits
from steadfast.kv.moves.curve import CurveKeys, TransferSide
from steadfast.kv.moves.faults import fault_switch
from steadfast.kv.moves.receiver import KVReceiver
from steadfast.kv.moves.sender import KVSender
from steadfast.kv.pool_client import LeaseLostError, PoolClient
from steadfast.kv.spec import arena_spec
from steadfast.kv.tier import TierFile
from steadfast.protocol import (
    AbortRequest,
    AddRequest,
    Degrade,
    FinishReason,
    Migrate,
    Ping,
    Promote,
    RequestOutput,
    Retire,
    SamplingParams,
    StepOutputs,
    ToWorker,
    WorkerRole,
    WorkerState,
    WorkerStatus,
)
from steadfast.worker.cache_report import CacheReporter
from steadfast.worker.engine import Engine, LoadedModel, load_model
from steadfast.worker.ledger_sync import LedgerSync
from steadfast.worker.startup import StartupPhases, trim_heap
from steadfast.worker.step_cost import StepCost, StepLine
from steadfast.worker.threads import ThreadGovernor

log = logging.getLogger("steadfast.worker")

EXIT_LEASE_LOST = 3
# Two different texts: the second must not find the first's blocks cached.
WARM_UP_TEXTS = ("Steadfast warms up its kernels before it takes traffic. ", "Every stream goes on through a failure. ")
DRAIN_ROUNDS = 8  # reads of the inbox before a step; bounded, so a flood of messages cannot starve the step


class WorkerLoop:
    def __init__(
        self,
        cfg: Config,
        worker_id: int,
        inbox: WorkerInbox,
        outbox: WorkerOutbox,
        role: WorkerRole,
        threads: ThreadGovernor | None = None,
    ) -> None:
        self.cfg = cfg
        self.threads = threads  # None: a fixed thread count (threads_per_worker, STEADFAST_THREADS)
        self.worker_id = worker_id
        self.inbox = inbox
        self.outbox = outbox
        self.role = role
        self.engine: Engine | None = None
        self.node = ""  # the node's pool address: workers sharing it hand KV over in place
        self.stopping = False  # asked to leave (SIGTERM, Retire): it goes once its requests have moved
        self._leave_by = 0.0  # ...or at this time (monotonic) whatever is left
        self._failpoint = f"worker{worker_id}_step"
        self._last_status = 0.0
        self._last_counts = (0, 0.0, 0)  # engine steps, step seconds, step tokens at the last report
        self.probe = 0  # the router's last Ping, answered in the next report
        self.cache_reporter = CacheReporter(worker_id)

    def status(self, state: WorkerState) -> WorkerStatus:
        e = self.engine
        if e is None:
            return WorkerStatus(self.worker_id, os.getpid(), self.role, state)
        b = e.blocks
        steps0, seconds0, tokens0 = self._last_counts
        self._last_counts = (e.steps, e.step_seconds, e.step_tokens)
        steps = e.steps - steps0
        cost = e.scheduler.cost.line() or StepLine(0.0, 0.0, 0.0)
        return WorkerStatus(
            self.worker_id,
            os.getpid(),
            self.role,
            state,
            kv_blocks_total=b.num_blocks,
            kv_blocks_used=b.num_used,
            kv_blocks_made=e.arena.made_blocks,
            num_running=len(e.scheduler.running),
            num_waiting=e.scheduler.num_waiting,
            prefix_hit_rate=b.prefix_hits / b.prefix_queries if b.prefix_queries else 0.0,
            step_ms=1000 * (e.step_seconds - seconds0) / steps if steps else 0.0,
            step_tokens=(e.step_tokens - tokens0) / steps if steps else 0.0,
            step_base_ms=1000 * cost.base_s,
            step_decode_ms=1000 * cost.decode_s,
            step_prefill_ms=1000 * cost.prefill_s,
            node=self.node,
            kv_addresses=e.kv.receiver.addresses if e.kv.receiver is not None else [],
            kv_blocks_incoming=e.kv.receiver.held_blocks if e.kv.receiver is not None else 0,
            spec_drafted=e.spec.drafted,
            spec_accepted=e.spec.accepted,
            tokens_per_step=e.spec.tokens_per_step,
            degradation_level=e.orders.level,
            ladder_swaps=e.scheduler.ladder_swaps,
            rss_mb=rss_mb(),
            probe=self.probe,
            threads=torch.get_num_threads(),
            **offload_status(e),
            **wire_status(e),
            **transport_status(e),
        )

    def _report(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_status >= self.cfg.server.status_interval_s:
            self._last_status = now
            self.outbox.send(self.status(WorkerState.STOPPING if self.stopping else WorkerState.READY))
            e = self.engine
            if e is not None and (events := self.cache_reporter.events(e.blocks.cached_names(), now)):
                self.outbox.send(events)

    def run(self, engine: Engine) -> None:
        self.engine = engine
        engine.nonfinite_failpoint = f"worker{self.worker_id}_nonfinite"
        self._report(force=True)
        interval_ms = int(self.cfg.server.status_interval_s * 1000)
        while not self._gone(engine):
            if engine.sync is not None:
                if engine.sync.lease.lost:
                    raise LeaseLostError(engine.sync.lease.lost)
                engine.sync.lease.beat()  # the lease lives only while this loop goes round
            # Busy: no wait. Only waiting to hear how KV transfers ended: a short one. Idle: long.
            # (Idle waits are short too: a SIGTERM, which does not interrupt the poll, is seen within them.)
            wait = (1 if engine.only_waiting_on_transfers else 0) if engine.has_work else min(interval_ms, 100)
            if self.inbox.poll(wait):
                # What arrives while these are handled joins the same step: a takeover's requests come
                # one by one as the router resumes each, and adopting the first takes a few ms (its
                # blocks verified); stepping between them would give the first a step of its own
                # (1 + 5 steps before six taken-over requests all had a token again).
                for _ in range(DRAIN_ROUNDS):
                    messages = self.inbox.drain()
                    if not messages:
                        break
                    for msg in messages:
                        self._handle(engine, msg)
            if engine.has_work:
                outputs = self._step(engine)
                if outputs:
                    self.outbox.send(StepOutputs(self.worker_id, outputs, time.monotonic()))
            if self.threads is not None:
                self.threads.tick()
            self._report()
        self._report(force=True)

    def _handle(self, engine: Engine, msg: ToWorker) -> None:
        if isinstance(msg, AddRequest):
            engine.add_request(msg)
        elif isinstance(msg, AbortRequest):
            for request_id in msg.request_ids:
                engine.abort(request_id)
        elif isinstance(msg, Migrate):
            engine.migrate(msg)
            # Its answer goes now: waiting for the next step would keep the request in no batch (and its
            # client waiting) for a whole step of the others.
            if answers := engine.take_pending():
                self.outbox.send(StepOutputs(self.worker_id, answers))
        elif isinstance(msg, Retire):
            log.info("retiring (%s)", msg.reason or "drained")
            self.leave()
            self._report(force=True)  # STOPPING: the router sends it nothing new
        elif isinstance(msg, Promote):
            self.role = msg.role
            self._report(force=True)
        elif isinstance(msg, Ping):
            self.probe = msg.nonce
            self._report(force=True)
        elif isinstance(msg, Degrade):
            if msg != engine.orders:
                log.info("degradation orders: level %d, %s", msg.level, msg)
            engine.degrade(msg)

    def leave(self) -> None:
        """Stop once no request is left here (the router moves them), at the latest after the shutdown timeout."""
        if not self.stopping:  # (also called from the signal handler: sets two fields, sends nothing)
            self._leave_by = time.monotonic() + self.cfg.server.shutdown_timeout
            self.stopping = True

    def _gone(self, engine: Engine) -> bool:
        if not self.stopping:
            return False
        if not engine.requests and not engine.has_work:
            return True
        if time.monotonic() >= self._leave_by:
            log.warning("leaving with %d requests not moved away in time", len(engine.requests))
            return True
        return False

    def _step(self, engine: Engine) -> list[RequestOutput]:
        stall(self._failpoint)  # a fault test's hung engine (unarmed: one lookup)
        try:
            # How KV moves ended, sent before the step: the answers must not wait for the others' forward pass.
            engine.collect_moves()
            if answers := engine.take_pending():
                self.outbox.send(StepOutputs(self.worker_id, answers))
            return engine.step()
        except LeaseLostError:
            raise  # fenced: this process must stop writing at once, not fail requests and go on
        except Exception as exc:  # a bug must not strand requests: fail them loudly, keep serving
            log.exception("engine step failed; failing the requests in flight")
            failed = []
            for request_id in list(engine.requests):
                engine.abort(request_id)
                why = f"engine error: {exc}"
                failed.append(
                    RequestOutput(request_id, [], finish_reason=FinishReason.ERROR, error=why, retryable=True)
                )
            return failed


def rss_mb() -> float:
    """This process's resident memory in MiB (0 where /proc is not there)."""
    try:
        with open("/proc/self/statm") as f:
            resident = int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return 0.0
    return resident * os.sysconf("SC_PAGE_SIZE") / 2**20


def transport_status(e: Engine) -> dict[str, int]:
    """The status report's counts of the KV wire's sending side (the health check's transport layer)."""
    sender = e.kv.sender
    if sender is None:
        return {}
    return {"kv_messages_sent": sender.sent, "kv_resends": sender.resent, "kv_move_timeouts": sender.timeouts}


def wire_status(e: Engine) -> dict[str, dict[str, int]]:
    """The status report's counts of what the KV wire's receiver dropped and refused."""
    if e.kv.receiver is None:
        return {}
    dropped, refused = e.kv.receiver.counts()
    return {"kv_wire_dropped": dropped, "kv_wire_refused": refused}


def offload_status(e: Engine) -> dict[str, int]:
    """The status report's offload-tier and preemption counts."""
    s = e.scheduler
    counts = {
        "swap_preemptions": s.swap_preemptions,
        "recompute_preemptions": s.recompute_preemptions,
        "recomputed_tokens": s.recomputed_tokens,
    }
    if e.offload is not None:
        o = e.offload
        counts.update(kv_blocks_offloaded=len(o.index), offload_written=o.written, offload_fetched=o.fetched)
    return counts


def transfer_side(role: WorkerRole, given: TransferSide | None) -> TransferSide:
    """What this worker does on the KV wire between nodes: what the launcher said (it knows the node);
    a worker started by hand (tests) without it goes by its role."""
    if given is not None:
        return given
    return {WorkerRole.PREFILL: TransferSide.SEND, WorkerRole.DECODE: TransferSide.RECEIVE}.get(role, TransferSide.NONE)


def transfer_keys(cfg: Config, side: TransferSide, paths: list[str] | None) -> dict[TransferSide, CurveKeys]:
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
            k = CurveKeys.load(path)
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
    keys: dict[TransferSide, CurveKeys] | None,
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
        grants = PoolClient(pool_address, pool.worker)
        grants.epoch, grants.on_made = pool.epoch, arena.populate_to
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
    keys = ClusterKeys.load(args.cluster_keys, ClusterSide.NODE) if args.cluster_keys else None
    # Before the inbox binds; kept for the process's life (a CURVE server whose handler is gone admits anyone).
    zap = guard(ctx, keys) if keys is not None else None
    outbox = WorkerOutbox(ctx, args.output, keys)
    inbox = WorkerInbox(ctx, args.input, keys)
    loop = WorkerLoop(cfg, args.worker_id, inbox, outbox, args.role, governor)

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
        pool = PoolClient(args.pool, f"worker{args.worker_id}")
        reply = pool.register(os.getpid())
        arena = map_arena(reply)
        arena.populate_to(reply.made)
        pool.on_made = arena.populate_to
        sync = LedgerSync(cfg, pool, reply.ledger_url, arena)
        log.info("registered with the kvpool as %s, epoch %d", pool.worker, pool.epoch)
        side = transfer_side(args.role, args.transfer_side)
        keys = transfer_keys(cfg, side, args.transfer_keys)
        sender, receiver = _other_nodes(cfg, arena, args.pool, pool, sync, side, keys)
        tier = TierFile.attach(reply.tier, reply.tier_path, arena.spec) if reply.tier_path else None
        engine = Engine(cfg, loaded, arena, source=pool, sync=sync, sender=sender, receiver=receiver, tier=tier)
        loop.node = args.pool
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
