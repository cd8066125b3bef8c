"""The worker's busy loop around one Engine: drain inputs (block only when idle) → step → emit outputs,
plus a status report every interval; leaving on SIGTERM or the router's Retire (see worker/main.py)."""

from __future__ import annotations

import logging
import os
import time

import torch

from steadfast.config import Config
from steadfast.kv.ledger.interface import LedgerError
from steadfast.kv.pool.client import LeaseLostError
from steadfast.util.failpoints import stall
from steadfast.wire.queues import WorkerInbox, WorkerOutbox
from steadfast.wire.worker import (
    AbortRequest,
    AddRequest,
    Degrade,
    DestinationLost,
    FinishReason,
    Migrate,
    Ping,
    Promote,
    RequestOutput,
    Retire,
    StepOutputs,
    ToWorker,
    WorkerRole,
    WorkerState,
    WorkerStatus,
)
from steadfast.worker.core.step_cost import StepLine
from steadfast.worker.engine import Engine
from steadfast.worker.status import CacheReporter, offload_status, rss_mb, transport_status, wire_status
from steadfast.worker.threads import ThreadGovernor

log = logging.getLogger("steadfast.worker")

EXIT_LEASE_LOST = 3
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
        node: str = "",
    ) -> None:
        self.cfg = cfg
        self.threads = threads  # None: a fixed thread count (threads_per_worker, STEADFAST_THREADS)
        self.worker_id = worker_id
        self.inbox = inbox
        self.outbox = outbox
        self.role = role
        self.engine: Engine | None = None
        self.node = node  # the node's pool address: workers sharing it hand KV over in place
        self.stopping = False  # asked to leave (SIGTERM, Retire): it goes once its requests have moved
        self._leave_by = 0.0  # ...or at this time (monotonic) whatever is left
        self._failpoint = f"worker{worker_id}_step"
        self._last_status = 0.0
        self._last_counts = (0, 0.0, 0)  # engine steps, step seconds, step tokens at the last report
        self.probe = 0  # the router's last Ping, answered in the next report
        self.cache_reporter = CacheReporter(worker_id)
        self._held: list[RequestOutput] = []  # step outputs not sent yet: the lease was not confirmed

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
            prefix_hit_rate=b.cache.prefix_hits / b.cache.prefix_queries if b.cache.prefix_queries else 0.0,
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
                self._send(engine, self._step(engine))
            elif self._held:
                self._send(engine, [])  # (idle: the held ones are tried again each round)
            if self.threads is not None:
                self.threads.tick()
            self._report()
        self._send(engine, [])
        self._report(force=True)

    def _send(self, engine: Engine, outputs: list[RequestOutput]) -> None:
        """A step's outputs go out only under a lease surely still held (`LeaseKeeper.check`: renewed at
        once past its local term). A worker stopped mid-step past its lease finishes that step when
        continued, and its tokens must not go before it learns it was fenced (seen on etcd: one token out
        ahead of the keeper's refused renewal). A store that cannot answer holds them, in order, to the
        next round."""
        self._held.extend(outputs)
        if not self._held:
            return
        if engine.sync is not None:
            try:
                engine.sync.lease.check()  # LeaseLostError: fenced, nothing goes out
            except LedgerError as exc:
                log.warning("lease not confirmed (%s): %d outputs held", exc, len(self._held))
                return
        self.outbox.send(StepOutputs(self.worker_id, self._held, time.monotonic()))
        self._held = []

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
        elif isinstance(msg, DestinationLost):
            engine.destination_lost(msg.worker_id)
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
