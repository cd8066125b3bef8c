"""The engine: `step()` is schedule → execute → update. No sockets, no threads: the process loop
(worker/main.py) or a test drives it directly. KV that moves to or from another worker goes through
the KV connector (kv/connector.py), called at fixed points of the step; a takeover's route is
takeover.py's.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable

import torch

from steadfast.config import Config
from steadfast.kv.arena.arena import KVArena
from steadfast.kv.arena.tier import TierFile
from steadfast.kv.moves.receiver import KVReceiver
from steadfast.kv.moves.sender import KVSender
from steadfast.model.grammar import GrammarError
from steadfast.util.failpoints import broken
from steadfast.util.log import about
from steadfast.wire.worker import (
    AddRequest,
    Degrade,
    FinishReason,
    Handoff,
    Migrate,
    RequestOutput,
    Resume,
    TokenLogprob,
)
from steadfast.worker.core.block_cache import BlockSource
from steadfast.worker.core.block_manager import BlockManager
from steadfast.worker.core.detokenizer import Detokenizer
from steadfast.worker.core.grammar import Constraints
from steadfast.worker.core.isolation import NonFiniteLogitsError, find_culprits, without
from steadfast.worker.core.request import Request, Status
from steadfast.worker.core.runner import ModelRunner
from steadfast.worker.core.sampler import Sampled, keep_scores, sample_rows
from steadfast.worker.core.scheduler import ScheduledStep, Scheduler
from steadfast.worker.core.speculation import Speculator
from steadfast.worker.core.step_cost import StepCost
from steadfast.worker.kv.connector import KVConnector
from steadfast.worker.kv.ledger_sync import LedgerSlots, LedgerSync
from steadfast.worker.kv.offload import LocalSlots, Offloader
from steadfast.worker.kv.takeover import recover, report_recovery
from steadfast.worker.loaded import LoadedModel

log = logging.getLogger(__name__)


class Engine:
    def __init__(
        self,
        cfg: Config,
        loaded: LoadedModel,
        arena: KVArena,
        source: BlockSource | None = None,
        sync: LedgerSync | None = None,
        sender: KVSender | None = None,
        receiver: KVReceiver | None = None,
        tier: TierFile | None = None,
    ) -> None:
        """`sender`, `receiver`: KV to and from other nodes (a prefill worker's, a decode worker's);
        `tier`: the node's offload tier, mapped (its slots recorded in the ledger, else known here alone)."""
        if arena.device.type != loaded.model.device.type:
            raise ValueError(f"the KV arena is on {arena.device}, the model on {loaded.model.device}")
        self.cfg = cfg
        self.tokenizer = loaded.tokenizer
        self.max_model_len = loaded.max_model_len
        self.arena = arena
        self.blocks = BlockManager(
            arena.spec.num_blocks,
            arena.spec.block_size,
            cfg.cache.enable_prefix_caching,
            source=source,
            grant_batch=cfg.cache.pool_grant_batch,
            on_evict=self._write_evicted if tier is not None else None,
        )
        self.sync = sync
        self.spec = Speculator(cfg.speculative)
        self.orders = Degrade()  # the degradation ladder's, L0 until the router says otherwise
        self.nonfinite_failpoint = ""  # a fault test's: this worker's logits turn non-finite (failpoints.broken)
        self.offload: Offloader | None = None  # (made after the blocks it copies: `_write_evicted` reaches it)
        if tier is not None:
            book = LedgerSlots(sync, tier.kind) if sync is not None else LocalSlots(tier.num_slots)
            self.offload = Offloader(tier, arena, self.blocks, book, cfg.cache.tier_slots(arena.spec.num_blocks))
        cost = copy.copy(loaded.step_cost) if loaded.step_cost is not None else StepCost()
        self.scheduler = Scheduler(cfg.scheduler, self.blocks, self._drafts, self.offload, cost)
        self.runner = ModelRunner(loaded.model, arena, self.blocks, cfg.scheduler.decode_attention_groups)
        self.kv = KVConnector(cfg, arena, self.blocks, self.scheduler, sync, sender, receiver)
        self.constraints = Constraints(loaded.tokenizer)
        self.requests: dict[str, Request] = {}
        self._detok: dict[str, Detokenizer] = {}
        self._pending: list[RequestOutput] = []  # outputs produced outside a step (rejections, transfers)
        self.steps = 0
        self.last_step_end = time.monotonic()  # when a migrated request last ran here (its downtime starts)
        self._step_start = 0.0
        self.step_seconds = 0.0
        self.step_tokens = 0
        self.generated_tokens = 0

    @property
    def has_work(self) -> bool:
        offloading = self.offload is not None and self.offload.busy
        return self.scheduler.has_work or bool(self._pending) or self.kv.busy or offloading

    @property
    def only_waiting_on_transfers(self) -> bool:
        """Nothing to compute, only KV moves to hear back from: the loop may sleep a little."""
        return not self.scheduler.has_work and not self._pending and self.kv.busy

    def add_request(self, msg: AddRequest) -> None:
        if msg.request_id in self.requests and not self._superseded(msg):
            self._reject(msg, f"request id {msg.request_id} is already in flight")
            return
        total = len(msg.prompt_ids) + msg.params.max_tokens
        if not msg.prompt_ids or len(msg.prompt_ids) >= self.max_model_len:
            self._reject(
                msg, f"prompt of {len(msg.prompt_ids)} tokens does not fit the context of {self.max_model_len}"
            )
            return
        if self.blocks.blocks_needed(min(total, self.max_model_len)) > self.blocks.num_blocks:
            self._reject(msg, f"request needs more KV blocks than this worker has ({self.blocks.num_blocks})")
            return
        request = Request(msg.request_id, msg.prompt_ids, msg.params, msg.priority)
        try:
            self.constraints.attach(request)  # (compiled before any KV is claimed; tokens replayed in _admit)
        except GrammarError as exc:
            self._reject(msg, f"the grammar does not compile: {exc}")
            return
        detok = Detokenizer(self.tokenizer, msg.prompt_ids, msg.params.stop, msg.params.min_tokens)
        resume = msg.resume
        if msg.handoff is not None:
            if self.kv.claim(request, msg):
                detok.restore(request.output_ids, None if msg.resume is None else msg.resume.text_chars)
                self._admit(request, detok)
                self.scheduler.add_running(request)
                return
            resume = resume or Resume([], 0)  # the KV did not arrive after all: compute it here
        self.kv.begin(request, msg)
        if resume is not None and not self._resume(request, detok, msg, resume):
            return
        self._admit(request, detok)
        self.scheduler.add(request)

    def _superseded(self, msg: AddRequest) -> bool:
        """A resume of a request that still runs here (a restarted router stopped the run the ledger
        named, elsewhere): the newest order wins, the run stops and the request continues from what its
        client holds. A plain add with a live id stays refused."""
        if msg.resume is None:
            return False
        rid, at = msg.request_id, len(msg.resume.output_ids)
        log.warning("request %s resumed at token %d while it runs here: the run stops", rid, at, extra=about(rid))
        self.abort(rid)
        return rid not in self.requests

    def take_pending(self) -> list[RequestOutput]:
        """Outputs made outside a step (a migration's answer): sent now rather than after the next step."""
        pending, self._pending = self._pending, []
        return pending

    def _admit(self, request: Request, detok: Detokenizer) -> None:
        if request.output_ids:  # a new owner: its grammar's state from the tokens produced
            self.constraints.attach(request)
        self.requests[request.request_id] = request
        self._detok[request.request_id] = detok

    def _resume(self, request: Request, detok: Detokenizer, msg: AddRequest, resume: Resume) -> bool:
        """Continue a request a dead worker was serving, from what its client already has."""
        done = resume.output_ids
        if len(done) >= msg.params.max_tokens or len(msg.prompt_ids) + len(done) >= self.max_model_len:
            self._reject(msg, f"request {msg.request_id} was already complete when its worker died")
            return False
        t0 = time.perf_counter()
        request.output_ids = list(done)
        detok.restore(done, resume.text_chars)
        request.client_has_text = resume.text_chars > 0
        mode = self.cfg.fault_recovery.kv_cache.recovery_mode
        request.recovery = recover(mode, self.sync, self.blocks, request, self.offload)
        request.resume_tokens = request.num_tokens
        log.info(
            "took over %s from %s at token %d: %s, %d tokens of KV adopted (%.0f ms)",
            request.request_id,
            # (-1: resumed from the ledger's checkpoint by a restarted router, which never knew the worker)
            f"worker {resume.from_worker}" if resume.from_worker >= 0 else "its checkpoint",
            len(done),
            request.recovery[0],
            request.recovery[1],
            1000 * (time.perf_counter() - t0),
        )
        return True

    def _reject(self, msg: AddRequest, why: str) -> None:
        self.kv.refuse(msg)
        out = RequestOutput(
            msg.request_id, [], finish_reason=FinishReason.ERROR, error=why, num_prompt_tokens=len(msg.prompt_ids)
        )
        self._pending.append(out)

    def abort(self, request_id: str) -> None:
        request = self.scheduler.remove(request_id)
        if request is None and self.kv.paused(request_id):  # waiting for its move's outcome: ours still
            request = self.requests.get(request_id)
        if request is not None:
            self._finish(request, FinishReason.ABORT)

    def migrate(self, msg: Migrate) -> None:
        """The router moves one of our running requests to another worker (between two steps)."""
        request = self.requests.get(msg.request_id)
        if request is None:
            # Finished here first (its last output is on its way) or never ours: the router learns the
            # outcome from that output; this answer only ends its migration record.
            out = RequestOutput(msg.request_id, [])
            out.handoff = Handoff(msg.to_worker, error="not running on this worker", migration=msg.move)
            self._pending.append(out)
            return
        out, left = self.kv.migrate(request, msg, self.last_step_end)
        if out is None:
            return  # copied to another node while it runs on; the answer comes with the outcome
        if left:
            self._let_go(request)
            log.info(
                "request %s migrated to worker %d at token %d",
                msg.request_id,
                msg.to_worker,
                out.index,
                extra=about(msg.request_id),
            )
        self._pending.append(out)

    def destination_lost(self, worker_id: int) -> None:
        """Worker `worker_id` died: our KV moves to it are given up (answers come with `collect_moves`)."""
        self.kv.destination_lost(worker_id)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        request.status = Status.FINISHED  # (before the ledger hears of it: its row says finished)
        request.finish_reason = reason
        if self.sync is not None:
            self.sync.finished(request)
        self.kv.ended(request)  # ended before its KV was committed elsewhere: the move is given up
        self._let_go(request)

    def _let_go(self, request: Request) -> None:
        """A request that ends here (finished, or another worker continues it): nothing of it is kept."""
        request.status = Status.FINISHED
        self.spec.forget(request.request_id)
        if self.offload is not None:
            self.offload.forget(request.request_id)
        self.requests.pop(request.request_id, None)
        self._detok.pop(request.request_id, None)

    def _write_evicted(self, named: list[tuple[int, bytes]]) -> None:
        """Cached blocks going back to the pool, which may hand them to another worker at once: the tier
        copies them first."""
        if self.offload is not None:
            self.offload.write_now(named)

    def collect_moves(self) -> None:
        """Hear how KV moves ended (transfers, migrations across nodes): the requests that left are let
        go, and the answers wait in `take_pending` — the loop sends them before the next step, so that
        neither the router nor the request waits for the others' forward pass."""
        moved, gone = self.kv.results()
        for request in gone:
            self._let_go(request)
        self._pending.extend(moved)

    def step(self) -> list[RequestOutput]:
        self.collect_moves()
        if self.offload is not None:
            self.offload.poll()
        outputs, self._pending = self._pending, []
        scheduled = self.scheduler.schedule()
        if scheduled.empty:
            if self.offload is not None:
                self.offload.plan()
            for request in self.kv.after_step():  # a migration holding its only request goes on without steps
                self._let_go(request)
            return outputs
        t0 = time.perf_counter()
        self._step_start = time.monotonic()
        if self.offload is not None:
            self.offload.flush()  # cached blocks this step reuses: out to the tier before they change
        if self.sync is not None:
            self.sync.before_execute(self.blocks)
        hook = self.kv.layer_hook(scheduled)
        timed = True
        try:
            t1 = time.perf_counter()
            sampled = self._compute(scheduled, hook)
            self.spec.time_step(scheduled, time.perf_counter() - t1)
        except Exception as failure:
            timed = False  # the step's time is the failed try's and the probes': not a step's cost
            isolated = self._isolate(scheduled, hook, outputs, failure)
            if isolated is None:
                return outputs
            scheduled, sampled = isolated
        new = self.spec.accept(scheduled.verifies, sampled.rows, sampled.tokens)
        prompt_done = self._advance(scheduled, new)
        keep_scores(sampled.scores)
        for request, produced in new:
            for k, token in enumerate(produced):
                outputs.append(self._append(request, token, sampled.logprob(request.request_id, k)))
                if request.status is Status.FINISHED:
                    break  # a stop inside accepted drafts: what follows it is not output
        self.steps += 1
        if self.sync is not None:
            refused = self.sync.after_step(self.requests.values(), self.blocks, prompt_done)
            for rid, why in refused.items():  # a row the ledger refused is its request's error alone
                self._fail(rid, f"the KV ledger refused this request's checkpoint: {why}", outputs, retryable=False)
        if self.offload is not None:
            self.offload.plan()
        for request in self.kv.after_step():
            self._let_go(request)
        seconds = time.perf_counter() - t0
        if timed:
            self.scheduler.cost.observe(scheduled.num_decode_rows, scheduled.num_prefill, seconds)
        self.step_tokens += scheduled.num_tokens
        self.step_seconds += seconds
        self.last_step_end = time.monotonic()
        return outputs

    def _compute(self, scheduled: ScheduledStep, hook: Callable[[int], None] | None) -> Sampled:
        """The forward pass and the sampling of one step: nothing but the step's KV slots changes."""
        masks = self.constraints.start([*scheduled.decodes, *(r for r, _ in scheduled.prefills)])
        logits, samplers, scorers = self.runner.execute(scheduled, hook)  # (the masks are computed meanwhile)
        if self.nonfinite_failpoint and broken(self.nonfinite_failpoint):
            logits = torch.full_like(logits, float("nan"))
        # A row of NaN or inf (corrupt weights or KV, a numerics fault) would sample garbage: its request
        # fails here instead, and the router retries it elsewhere (the health check's request layer).
        finite = torch.isfinite(logits).all(dim=1)
        if not bool(finite.all()):
            rows = [*samplers, *(r for r, _ in scorers)]
            raise NonFiniteLogitsError({rows[i].request_id for i in (~finite).nonzero().flatten().tolist()})
        drafts = {r.request_id: d for r, d in scheduled.verifies}
        eos = self.tokenizer.info.eos_token_ids
        return sample_rows(logits, samplers, drafts, eos, None if masks is None else masks.result(), scorers)

    def _drafts(self, request: Request, budget: int) -> list[int]:
        """The scheduler's drafter: at most what the budget, `max_tokens` and the context leave; none
        for a priority the degradation ladder took speculation from."""
        if request.priority >= self.orders.speculate_below:
            return []
        return self.spec.drafts_for(request, budget, self.max_model_len)

    def degrade(self, orders: Degrade) -> None:
        """The degradation ladder's orders (router): speculation by priority, L3's offload of low priority."""
        self.orders = orders
        self.scheduler.offload_from = orders.offload_from
        self.scheduler.kv_target = orders.kv_target
        self.scheduler.step_target_ms = orders.step_target_ms

    def _isolate(
        self,
        scheduled: ScheduledStep,
        hook: Callable[[int], None] | None,
        outputs: list[RequestOutput],
        failure: Exception,
    ) -> tuple[ScheduledStep, Sampled] | None:
        """A step failed: find the requests that fail on their own, end them with an error, and compute
        the step again without them, so one request's bad input never costs the others a token. A
        failure no single request reproduces, or that every one of several does, is the engine's own: it is
        raised."""
        culprits = find_culprits(scheduled, failure, lambda alone: self._compute(alone, None))
        for rid, why in culprits.items():
            log.error("request %s failed in a step and was removed from it: %s", rid, why, extra=about(rid))
            self._fail(rid, f"engine error: {why}", outputs, retryable=True)
        rest = without(scheduled, culprits)
        if rest.empty:
            return None
        return rest, self._compute(rest, hook)

    def _fail(self, request_id: str, why: str, outputs: list[RequestOutput], retryable: bool) -> None:
        """End one request with an error output (one already ended here gets none: its end is sent)."""
        request = self.scheduler.remove(request_id)
        if request is None and self.kv.paused(request_id):  # waiting for its move's outcome: ours still
            request = self.requests.get(request_id)
        if request is None:
            return
        outputs.append(RequestOutput(request_id, [], finish_reason=FinishReason.ERROR, error=why, retryable=retryable))
        self._finish(request, FinishReason.ERROR)

    def _advance(self, scheduled: ScheduledStep, new: list[tuple[Request, list[int]]]) -> bool:
        """Count the computed KV; True if some request's prefill is now complete. A verifying request's
        KV counts up to its last confirmed draft; the slots of the rejected ones are rolled back (their
        blocks freed; those kept are overwritten before they are read, and sealed only once full of
        confirmed tokens)."""
        prompt_done = False
        for request in scheduled.decodes:
            request.num_computed += 1
            self.blocks.commit(request.request_id, request.all_ids, request.num_computed)
            prompt_done |= not request.output_ids  # its prompt's last token (the rest was cached): row due now
        produced = {r.request_id: tokens for r, tokens in new}
        for request, _ in scheduled.verifies:
            tokens = produced[request.request_id]
            request.num_computed += len(tokens)  # its last token and the confirmed drafts
            self.blocks.trim(request.request_id, request.num_computed)
            # Named with the tokens they hold: the confirmed drafts are appended to the request after this.
            self.blocks.commit(request.request_id, request.all_ids + tokens, request.num_computed)
        for request, n in scheduled.prefills:
            request.num_computed += n
            self.blocks.commit(request.request_id, request.all_ids, request.num_computed)
            prompt_done |= request.num_computed == request.num_tokens
        return prompt_done

    def _append(self, request: Request, token: int, logprob: TokenLogprob | None = None) -> RequestOutput:
        request.output_ids.append(token)
        self.constraints.advance(request, token)
        self.generated_tokens += 1
        p = request.params
        detok = self._detok[request.request_id]
        reason = None
        if detok.add(token):
            reason = FinishReason.STOP
        elif (not p.ignore_eos and token in self.tokenizer.info.eos_token_ids) or token in p.stop_token_ids:
            reason = FinishReason.STOP
        elif len(request.output_ids) >= p.max_tokens or request.num_tokens >= self.max_model_len:
            reason = FinishReason.LENGTH
        text = detok.take(final=reason is not None)
        out = RequestOutput(
            request.request_id,
            [token],
            text,
            reason,
            num_prompt_tokens=len(request.prompt_ids),
            num_cached_tokens=request.num_cached,
            index=len(request.output_ids) - 1,
            logprobs=None if logprob is None else [logprob],
            prompt_logprobs=request.first_scores(),
        )
        if request.recovery is not None:  # the first token after a takeover reports what it cost
            report_recovery(request, out, self._step_start)
        if reason is not None:
            self.scheduler.remove(request.request_id)
            self._finish(request, reason)
        elif len(request.output_ids) == 1:
            self.kv.prompt_done(request, out)
        return out

    def generate(self, requests: list[AddRequest]) -> dict[str, list[RequestOutput]]:
        """Run requests to completion in this process (tests, `steadfast generate`)."""
        for r in requests:
            self.add_request(r)
        results: dict[str, list[RequestOutput]] = {r.request_id: [] for r in requests}
        while self.has_work:
            for out in self.step():
                results[out.request_id].append(out)
        return results
