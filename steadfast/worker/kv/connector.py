"""The engine's KV connector: every move of a request's KV to or from another worker, called by the
engine at fixed points of its step (vLLM's KV connector is the shape: the engine stays schedule →
execute → update, and the connector is where KV leaves and arrives).

Moves are move sessions (ARCHITECTURE.md §4, kv/moves/session.py for the protocol):
- same node, prefill → decode (HANDOFF): zero COPY stages; the COMMIT is one ledger transaction
  that makes the blocks the decode worker's. Until it succeeds the request and its blocks are ours;
  if it cannot be done, we keep decoding the request.
- across nodes (TRANSFER): each layer's K/V streamed to the decode node's receiver while the prompt
  is computed, then the COMMIT. The source owns the request and its blocks until the COMMIT is
  acknowledged: the request is paused (not scheduled, blocks held, checkpointed here) meanwhile,
  and only an acknowledged transfer — or a failed one whose fallback moves it — lets it go.
- into this worker: claiming KV a prefill worker handed over or streamed here.

Hook points: `claim` (add), `begin` (add), `layer_hook` (execute), `prompt_done` and `after_step`
(update), `results` (the start of a step), `ended` (a request finished or was aborted here).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from steadfast.config import Config
from steadfast.kv.arena.arena import KVArena
from steadfast.kv.ledger.interface import ReceiverGoneError
from steadfast.kv.moves.messages import MoveKind
from steadfast.kv.moves.packing import layer_span, slots_for
from steadfast.kv.moves.receiver import KVReceiver
from steadfast.kv.moves.sender import KVSender
from steadfast.kv.moves.sender_jobs import TransferOutcome
from steadfast.kv.moves.transport import path_names
from steadfast.util.log import about
from steadfast.wire.worker import AddRequest, Fallback, FinishReason, Handoff, Migrate, RequestOutput, Route
from steadfast.worker.core.block_manager import BlockManager
from steadfast.worker.core.request import Request
from steadfast.worker.core.scheduler import ScheduledStep, Scheduler
from steadfast.worker.kv.ledger_sync import LedgerSync
from steadfast.worker.kv.migration import OutgoingMigrations

log = logging.getLogger("steadfast.worker.engine")


@dataclass
class Outgoing:
    """A move of one of our requests to another worker, not yet acknowledged."""

    request: Request
    kind: MoveKind
    to_worker: int
    num_tokens: int  # tokens of KV it carries (the prompt)
    paused: bool = False  # COMMIT sent: the request waits here, owned, for the outcome
    ended: bool = False  # the request ended here first: the move was given up, its outcome is a formality


class KVConnector:
    def __init__(
        self,
        cfg: Config,
        arena: KVArena,
        blocks: BlockManager,
        scheduler: Scheduler,
        sync: LedgerSync | None,
        sender: KVSender | None = None,
        receiver: KVReceiver | None = None,
    ) -> None:
        self.cfg = cfg
        self.arena, self.blocks, self.scheduler, self.sync = arena, blocks, scheduler, sync
        self.sender = sender  # across nodes, source side
        self.receiver = receiver  # across nodes, destination side
        self.layerwise = cfg.transfer.layerwise  # stream each layer as it is computed, not all at the end
        self._out: dict[str, Outgoing] = {}
        # Live migrations to another node (a sender is the wire out); on this node they are `_give`.
        spec = cfg.speculative
        step_tokens = 1 + (spec.num_draft_tokens if spec.method != "off" else 0)
        self.migrations = (
            OutgoingMigrations(arena, blocks, scheduler, sender, step_tokens) if sender is not None else None
        )
        self._prompts_done: list[tuple[Request, RequestOutput]] = []  # KV to hand over after this step

    @property
    def busy(self) -> bool:
        """Moves in progress: outcomes to hear back from."""
        return bool(self._out) or (self.migrations is not None and self.migrations.busy)

    def paused(self, request_id: str) -> bool:
        """Waiting, owned and not scheduled, for its move's outcome."""
        move = self._out.get(request_id)
        if self.migrations is not None and self.migrations.paused(request_id):
            return True
        return move is not None and move.paused and not move.ended

    # --- add --------------------------------------------------------------------------------------
    def claim(self, request: Request, msg: AddRequest) -> bool:
        """Continue a request whose prompt a prefill worker computed: its KV blocks are ours already
        (handed over in the ledger on this node; written by our receiver from another), the first
        token is in `resume`. False when a transfer's blocks are not here (expired): recompute."""
        assert msg.handoff is not None and msg.resume is not None
        h = msg.handoff
        sealed: list[int] = h.sealed
        if h.path != "same_node":
            key = h.migration or msg.request_id  # a migration's KV is kept under its move's name
            claimed = self.receiver.claim(key) if self.receiver is not None else None
            if claimed is None or claimed != h.block_ids:
                if claimed and self.blocks.cache.source is not None:
                    self.blocks.cache.source.release(claimed)
                log.warning(
                    "request %s: transferred KV not found here; computing the prompt",
                    msg.request_id,
                    extra=about(msg.request_id),
                )
                return False
            sealed = []  # written by our receiver: sealed here as their blocks are named
        request.output_ids = list(msg.resume.output_ids)
        if h.num_computed != request.num_tokens - 1:
            # The KV must cover every token the client holds but the last: else the router and the source
            # disagree on what was delivered, and these blocks belong to another state of the request.
            log.error(
                "request %s: handed KV covers %d tokens, the client holds %d; computing it here",
                msg.request_id,
                h.num_computed,
                request.num_tokens,
            )
            if self.blocks.cache.source is not None:
                self.blocks.cache.source.release(h.block_ids)
            request.output_ids = []
            return False
        held = [b for b in h.block_ids if self.blocks.cache.holds(b)] if h.path == "same_node" else []
        if held:
            # Handed blocks this worker holds already cannot be this request's too: its KV is not trusted,
            # the request is computed here afresh (the worker and its other requests go on).
            log.error(
                "request %s: handed KV blocks %s are held here already; computing the prompt",
                msg.request_id,
                held[:8],
                extra=about(msg.request_id),
            )
            if self.blocks.cache.source is not None:  # the rest came for this request alone: back to the pool
                self.blocks.cache.source.release([b for b in h.block_ids if b not in held])
            request.output_ids = []
            return False
        if self.sync is not None:
            self.sync.received(sealed, self.blocks)
        self.blocks.receive(request.request_id, request.all_ids, h.block_ids, h.num_computed, set(sealed))
        request.num_computed = h.num_computed
        # Its first output says where the KV came from.
        route = Route.HANDOFF if h.path == "same_node" else Route.TRANSFER
        request.recovery = (Route.MIGRATED if h.migration else route, h.num_computed)
        request.resume_tokens = request.num_tokens
        return True

    def refuse(self, msg: AddRequest) -> None:
        """A request handed to us that we reject: blocks handed over in the ledger go back."""
        if msg.handoff is not None and msg.handoff.block_ids and self.blocks.cache.source is not None:
            self.blocks.cache.source.release(msg.handoff.block_ids)

    def begin(self, request: Request, msg: AddRequest) -> None:
        """A prompt to compute here and decode elsewhere: open its move (streamed when across nodes)."""
        if msg.decode_worker < 0 or msg.resume is not None:
            return
        request.decode_worker = msg.decode_worker
        if not msg.kv_paths or self.sender is None:
            return  # on this node: the handoff happens once the prompt is done
        request.kv_paths = list(msg.kv_paths)
        paths = list(zip(path_names(len(msg.kv_paths)), msg.kv_paths, strict=True))
        self.sender.begin(msg.request_id, paths, len(msg.prompt_ids))
        self._out[msg.request_id] = Outgoing(request, MoveKind.TRANSFER, msg.decode_worker, len(msg.prompt_ids))

    # --- execute ----------------------------------------------------------------------------------
    def layer_hook(self, scheduled: ScheduledStep) -> Callable[[int], None] | None:
        """For prefill chunks whose KV goes to another node: a hook the forward pass calls once each
        layer's K/V is in the arena, copying those bytes out to the sender (layer-wise streaming)."""
        sender = self.sender
        spans = [(r, r.num_computed, n) for r, n in scheduled.prefills if r.request_id in self._out]
        if sender is None or not spans:
            return None
        bs = self.blocks.block_size
        jobs = []
        for r, start, n in spans:
            r.kv_given.append((start, n))
            jobs.append((r.request_id, start, n, slots_for(self.blocks.block_table(r.request_id), bs, start, n)))

        def on_layer(layer: int) -> None:
            for rid, start, n, slots in jobs:
                sender.layer(rid, layer, start, n, layer_span(self.arena, layer, slots), self.layerwise)

        return on_layer

    # --- update -----------------------------------------------------------------------------------
    def prompt_done(self, request: Request, out: RequestOutput) -> None:
        """The prompt is computed and its first token sampled: its KV moves after this step."""
        if request.decode_worker >= 0:
            self._prompts_done.append((request, out))

    def after_step(self) -> list[Request]:
        """Run the moves of this step's finished prompts (after its seals and checkpoint, so what is
        handed over is recorded); return the requests that are no longer ours."""
        if self.migrations is not None:
            self.migrations.after_step()
        gone = []
        while self._prompts_done:
            request, out = self._prompts_done.pop()
            if request.request_id in self._out:
                self._commit_transfer(request)
            elif self._hand_off(request, out):
                gone.append(request)
        return gone

    def ended(self, request: Request) -> None:
        """A request ended here (finished, aborted) before its move committed: the move is given up."""
        if self.migrations is not None:
            self.migrations.ended(request)
        move = self._out.get(request.request_id)
        if move is None or move.ended or self.sender is None:
            return
        move.ended = True
        self.sender.abort(request.request_id)  # the receiver lets go of what it reserved
        if move.paused:
            self.blocks.free(request.request_id)

    def destination_lost(self, worker_id: int) -> None:
        """Worker `worker_id` died (the router says so): every move of ours to it is given up now. A
        transfer fails to its fallback (the router recomputes the request elsewhere); a migration's
        request runs on here. Their outcomes come from `results` as any other's."""
        why = f"worker {worker_id} died"
        if self.migrations is not None:
            self.migrations.destination_lost(worker_id, why)
        if self.sender is None:
            return
        for rid, move in self._out.items():
            if move.to_worker == worker_id and not move.ended:
                log.warning("request %s: KV transfer given up: %s", rid, why, extra=about(rid))
                self.sender.give_up(rid, why)

    def results(self) -> tuple[list[RequestOutput], list[Request]]:
        """Outputs for transfers that ended — where the decode worker finds the KV, or, every path
        having failed, that it must compute the prompt itself — and the requests they let go."""
        if self.sender is None:
            return [], []
        migrating = self.migrations.keys() if self.migrations is not None else []
        self.sender.touch([rid for rid, move in self._out.items() if not move.ended] + migrating)
        outputs: list[RequestOutput] = []
        gone: list[Request] = []
        if self.migrations is not None:
            self.migrations.expire()
            outputs, self.migrations.answers = self.migrations.answers, []
        for r in self.sender.results():
            migrated = self.migrations.result(r) if self.migrations is not None else None
            if migrated is not None:
                answer, left = migrated
                if answer is not None:
                    outputs.append(answer)
                if left is not None:
                    if self.sync is not None:
                        self.sync.finished(left)  # here, that is: the destination node's ledger follows it
                    gone.append(left)
                continue
            move = self._out.pop(r.request_id, None)
            to, num_tokens = (move.to_worker, move.num_tokens) if move is not None else (-1, 0)
            failed = r.outcome is TransferOutcome.FAILED  # (an aborted one's request ended here already)
            fallback = (Fallback.RECOMPUTE if self.cfg.transfer.recompute else Fallback.ERROR) if failed else ""
            h = Handoff(
                to,
                r.block_ids,
                num_computed=num_tokens,
                error=r.error,
                seconds=r.seconds,
                path=r.path,
                retries=r.retries,
                fallbacks=r.fallbacks,
                bytes=r.bytes,
                stream_seconds=r.stream_seconds,
                fallback=Fallback(fallback),
            )
            if move is not None and (move.paused or failed) and not move.ended:
                # Acknowledged, or failed for good: the decode worker continues it (with our KV, or
                # computing the prompt), so its blocks here go back (cached for the next prompt like it).
                # Failed before its prompt was done (paths down, its destination gone): it stops here too.
                if not move.paused:
                    self.scheduler.remove(r.request_id)
                self.blocks.free(r.request_id)
                if self.sync is not None:
                    self.sync.finished(move.request)  # here, that is: the decode node's ledger follows it
                gone.append(move.request)
            if failed and not self.cfg.transfer.recompute:
                why = f"KV transfer to worker {to} failed on every path ({r.error}); transfer.recompute is off"
                outputs.append(RequestOutput(r.request_id, [], finish_reason=FinishReason.ERROR, error=why, handoff=h))
            else:
                outputs.append(RequestOutput(r.request_id, [], index=1, handoff=h))
        return outputs, gone

    def _commit_transfer(self, request: Request) -> None:
        """Give the sender whatever it lacks (a prefix found in this worker's cache was never computed
        here), send the COMMIT and pause the request: it stays ours until the outcome is known."""
        assert self.sender is not None
        rid, bs = request.request_id, self.blocks.block_size
        table = self.blocks.block_table(rid)
        gaps, pos = [], 0
        for start, n in sorted(request.kv_given):
            if start > pos:
                gaps.append((pos, start - pos))
            pos = max(pos, start + n)
        if pos < len(request.prompt_ids):
            gaps.append((pos, len(request.prompt_ids) - pos))
        for start, n in gaps:
            slots = slots_for(table, bs, start, n)
            for layer in range(self.arena.spec.num_layers):
                self.sender.layer(rid, layer, start, n, layer_span(self.arena, layer, slots), False)
        self.sender.commit(rid)
        self.scheduler.detach(request)
        self._out[rid].paused = True

    def _hand_off(self, request: Request, out: RequestOutput) -> bool:
        """Give a prefilled request's KV to its decode worker on this node: ownership changes in the
        ledger, no byte moves (blocks another request here shares are copied). True when done; if it
        cannot be done this worker keeps decoding the request: slower for the others, lossless."""
        out.handoff = self._give(request, request.decode_worker, f"{request.request_id}/{MoveKind.HANDOFF}")
        return not out.handoff.error

    def migrate(self, request: Request, msg: Migrate, paused_at: float) -> tuple[RequestOutput | None, bool]:
        """Move a running request to `msg.to_worker` between two steps (the router's live migration). On
        this node its blocks change owner in one ledger transaction and it never runs here again; the
        output's handoff says where the KV went, or why it stayed (the request then simply goes on here).
        Returns that output and whether the request left. Across nodes (`kv_paths`) the copy starts and
        the answer comes later, from `results` (None now)."""
        out = RequestOutput(request.request_id, [], index=len(request.output_ids))
        why = self._unmovable(request)
        if not why and msg.kv_paths:
            if self.migrations is None:
                why = "this worker has no KV wire to another node"
            else:
                self.migrations.begin(request, msg)
                return None, False
        if why:
            out.handoff = Handoff(msg.to_worker, error=why, path="same_node", migration=msg.move)
            return out, False
        h = self._give(request, msg.to_worker, msg.move)
        h.migration, h.paused_at = msg.move, paused_at
        out.handoff = h
        return out, not h.error

    def _unmovable(self, request: Request) -> str:
        """Why a request cannot migrate now, or "" (it is decoding: every token but the last has KV)."""
        if request.request_id in self._out or (self.migrations is not None and request.request_id in self.migrations):
            return "its KV is being moved already"
        if not request.output_ids or request.num_pending != 1 or request not in self.scheduler.running:
            return "not decoding yet (queued, computing its prompt, or preempted); try again shortly"
        return ""

    def _give(self, request: Request, to: int, move: str) -> Handoff:
        """Make a request's KV worker `to`'s on this node, recording the move `move` COMMITTED in the same
        ledger transaction; the Handoff to send on, or one whose `error` says why the request stays."""
        sync = self.sync
        if sync is None:
            return Handoff(to, error="no ledger on this worker: KV cannot change owner", path="same_node")
        sealed: list[int] = []
        copied = 0
        t0 = time.perf_counter()

        def transfer(block_ids: list[int], copies: list[tuple[int, bytes]]) -> None:
            nonlocal copied
            # The move's session collapses into this one transaction (nothing to reserve, no byte to
            # copy): its decision, COMMITTED, is recorded with the new owner.
            sealed.extend(sync.hand_over(block_ids, copies, f"worker{to}", request.request_id, move))
            copied = len(copies)

        try:
            handed = self.blocks.hand_over(request.request_id, self.arena.copy_block, transfer)
        except ReceiverGoneError as exc:
            handed, why = None, str(exc)
        else:
            why = "no free block to copy a shared prefix block into"
        if handed is None:
            log.warning(
                "request %s: KV not handed to worker %d (%s); it stays here",
                request.request_id,
                to,
                why,
                extra=about(request.request_id),
            )
            return Handoff(to, error=why, path="same_node")
        self.scheduler.detach(request)
        sync.handed(self.blocks)
        seconds = time.perf_counter() - t0
        return Handoff(to, handed, sealed, request.num_computed, copied=copied, seconds=seconds, path="same_node")

    def close(self) -> None:
        for side in (self.sender, self.receiver):
            if side is not None:
                side.close()
