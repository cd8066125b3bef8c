"""Live migration of a running request to a worker of another node, the source's side: its KV copied in
rounds while it keeps decoding here, then a short stop-and-copy, then the commit (ARCHITECTURE.md §5).

One move session per migration (`kv/moves/`, run by the KV sender), named after the migration's move
(`<request>/migration-<random>/<path>`), so a request can move there and back. The destination reserves
the blocks the request holds now plus `SLACK_BLOCKS` (it grows while it is copied). Round 1 streams every
full (sealed, never changing) block; each later round what was sealed since the last one; a round goes
out `CHUNK_BLOCKS` at a time, one chunk after each step. Once the rounds have landed and at most
`final_stage_blocks` full blocks are left unsent, or after `max_stages` rounds, the request is paused
(not scheduled; blocks and ownership kept) and the rest goes out with the partial block — padded
with zeros into the last reserved block, so every reserved slot holds this move's bytes — and the COMMIT.
A request about to outgrow its reservation before the rounds converge (its copy slower than its decode:
a busy machine, a slow link) is paused there instead, and its stop-and-copy waits for the rounds to land:
a longer pause, not a failed move. Until the COMMIT is acknowledged and decided the request is ours; any
failure resumes it here, and so does `timeout_s` passing first (the move is aborted): the router hears why,
at once, in every case but one — the request ended here, which its own last output says.

In protocol terms the rounds are the parts of the session's one copy stage, streamed before its manifest
(as a prefill's layers are): the destination verifies them all at the COMMIT.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from steadfast.kv.arena.arena import KVArena
from steadfast.kv.moves.packing import layer_spans, slots_for
from steadfast.kv.moves.sender import KVSender
from steadfast.kv.moves.sender_jobs import TransferOutcome, TransferResult
from steadfast.kv.moves.transport import path_names
from steadfast.wire.worker import Handoff, Migrate, RequestOutput
from steadfast.worker.core.block_manager import BlockManager
from steadfast.worker.core.request import Request
from steadfast.worker.core.scheduler import Scheduler

log = logging.getLogger(__name__)

SLACK_BLOCKS = 2  # reserved beyond what the request holds at the start: it decodes on while it is copied
# Blocks gathered per step: a round of a long context (2048 tokens: 129 blocks, 94 MB in fp32) goes out
# over several steps, each paying ~10 ms of gather, not one step paying ~180 ms (its client's gap).
CHUNK_BLOCKS = 16


@dataclass
class Migrating:
    request: Request
    msg: Migrate
    n_blocks: int  # reserved at the destination
    sent: int = 0  # tokens whose KV went out (every layer), from 0
    rounds: int = 0
    target: int = 0  # the current round's end: the tokens sealed when it began
    parts: int = 0  # frames streamed in the rounds (one per layer and round)
    paused_at: float = 0.0  # set when it stops decoding here: at the stop-and-copy, or held at its reservation
    final: bool = False  # the stop-and-copy and the COMMIT handed to the sender
    ended: bool = False  # given up (the request ended here, or `give_up`): the sender's result is ignored
    started: float = field(default_factory=time.perf_counter)


class OutgoingMigrations:
    def __init__(
        self, arena: KVArena, blocks: BlockManager, scheduler: Scheduler, sender: KVSender, step_tokens: int = 1
    ) -> None:
        self.arena, self.blocks, self.scheduler, self.sender = arena, blocks, scheduler, sender
        self.step_tokens = step_tokens  # the most tokens one step adds to a request (speculation's drafts + 1)
        self.bs = blocks.block_size
        self._moves: dict[str, Migrating] = {}  # by move name (the sender's key)
        self._by_request: dict[str, str] = {}
        self.answers: list[RequestOutput] = []  # migrations given up here, for the router

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_request

    @property
    def busy(self) -> bool:
        return bool(self._moves)

    def paused(self, request_id: str) -> bool:
        m = self._moves.get(self._by_request.get(request_id, ""))
        return m is not None and bool(m.paused_at) and not m.ended

    def keys(self) -> list[str]:
        return [k for k, m in self._moves.items() if not m.ended]

    def begin(self, request: Request, msg: Migrate) -> None:
        """Reserve at the destination and stream every full block now (round 1)."""
        n_blocks = -(-request.num_computed // self.bs) + SLACK_BLOCKS
        m = Migrating(request, msg, n_blocks)
        self._moves[msg.move] = m
        self._by_request[request.request_id] = msg.move
        paths = list(zip(path_names(len(msg.kv_paths)), msg.kv_paths, strict=True))
        self.sender.begin(msg.move, paths, n_blocks * self.bs, probe=True)
        self._round(m)

    def after_step(self) -> None:
        """Another round of what was sealed since the last, or the stop-and-copy and the COMMIT."""
        for m in list(self._moves.values()):
            if m.ended or m.final:
                continue
            held = bool(m.paused_at)
            if not held and (m.request.num_computed < m.sent or m.request not in self.scheduler.running):
                self._give_up(m, "preempted here while its KV was copied")  # its KV freed: it runs on here
                continue
            if not held and m.request.num_computed + self.step_tokens > m.n_blocks * self.bs:
                self._hold(m)  # one more step would outgrow the reservation
                held = True
            full = (m.request.num_computed // self.bs) * self.bs
            left_blocks = (full - m.sent) // self.bs
            round_done = m.sent >= m.target
            last_round = m.rounds >= max(1, m.msg.max_stages) or left_blocks <= m.msg.final_stage_blocks
            if round_done and (held or last_round):
                # Not while a round is still on its way: the pause would wait for all of it.
                if self.sender.landed(m.msg.move, m.parts):
                    self._final(m)
            elif left_blocks:
                self._round(m)

    def expire(self) -> None:
        """Give up every migration past its timeout (asked at every step, run or not: a paused request
        whose copy stalled is in no batch)."""
        now = time.perf_counter()
        for m in self._moves.values():
            if not m.ended and now - m.started > m.msg.timeout_s:
                self._give_up(m, f"not committed within {m.msg.timeout_s:g}s (migration.timeout)")

    def destination_lost(self, worker_id: int, why: str) -> None:
        """The destination died: its migrations are given up now (the request runs on here)."""
        for m in list(self._moves.values()):
            if not m.ended and m.msg.to_worker == worker_id:
                self._give_up(m, why)

    def _round(self, m: Migrating) -> None:
        """The next chunk of the current round, or of a new one (what was sealed since the last)."""
        if m.sent >= m.target:
            m.rounds += 1
            m.target = (m.request.num_computed // self.bs) * self.bs
        upto = min(m.target, m.sent + CHUNK_BLOCKS * self.bs)
        if upto > m.sent:
            self._stream(m, m.sent, upto - m.sent)
            m.parts += self.arena.spec.num_layers
            m.sent = upto

    def _hold(self, m: Migrating) -> None:
        """Stop decoding here (blocks and ownership kept) until the stop-and-copy."""
        self.scheduler.detach(m.request)
        m.paused_at = time.monotonic()
        if not m.final:
            log.info(
                "migration %s: held at the blocks reserved at the destination (%d, round %d): its copy is "
                "slower than its decode",
                m.msg.move,
                m.n_blocks,
                m.rounds,
            )

    def _final(self, m: Migrating) -> None:
        r = m.request
        m.final = True
        if not m.paused_at:
            self._hold(m)
        # The rest, then zeros into the last reserved block (no slot of the move keeps its last owner's
        # bytes): one frame per layer, gathered at once and handed over with the COMMIT in one job.
        end = max(r.num_computed, (m.n_blocks - 1) * self.bs + 1)
        slots = slots_for(self.blocks.block_table(r.request_id), self.bs, m.sent, r.num_computed - m.sent)
        data = layer_spans(self.arena, slots, zeros=end - r.num_computed) if end > m.sent else []
        self.sender.layers(m.msg.move, m.sent, end - m.sent, data, stream=False, commit=True)
        m.sent = end

    def _give_up(self, m: Migrating, why: str) -> None:
        """Abort the move; the request runs on here (scheduled again if it was paused) and the router
        is told why now, whatever the sender is doing."""
        m.ended = True
        self.sender.abort(m.msg.move)
        if m.paused_at:
            self.scheduler.add_running(m.request)
        self.answers.append(self._answer(m, f"KV copy to worker {m.msg.to_worker} given up: {why}"))

    def _answer(self, m: Migrating, error: str, r: TransferResult | None = None) -> RequestOutput:
        """The router's answer; `r`: the sender's result (None: given up before the sender had one)."""
        r = r or TransferResult(m.msg.move, TransferOutcome.ABORTED)
        h = Handoff(
            m.msg.to_worker,
            [] if error else r.block_ids,
            num_computed=m.request.num_computed,
            error=error,
            seconds=time.perf_counter() - m.started,
            path=r.path or "failed",
            retries=r.retries,
            fallbacks=r.fallbacks,
            bytes=r.bytes,
            migration=m.msg.move,
            paused_at=m.paused_at,
            stages=m.rounds + 1,
        )
        return RequestOutput(m.request.request_id, [], index=len(m.request.output_ids), handoff=h)

    def _stream(self, m: Migrating, start: int, count: int) -> None:
        slots = slots_for(self.blocks.block_table(m.request.request_id), self.bs, start, count)
        # One gather of every layer (a chunk is at most CHUNK_BLOCKS blocks), handed over in one job.
        data = layer_spans(self.arena, slots)
        self.sender.layers(m.msg.move, start, count, data, stream=True, commit=False)

    def ended(self, request: Request) -> None:
        """The request ended here before its migration committed: the migration is given up."""
        m = self._moves.get(self._by_request.get(request.request_id, ""))
        if m is not None and not m.ended:
            m.ended = True
            self.sender.abort(m.msg.move)
            if m.paused_at:
                self.blocks.free(request.request_id)

    def result(self, r: TransferResult) -> tuple[RequestOutput | None, Request | None] | None:
        """The outcome of a migration's session (None: `r` is not a migration's). Returns the answer for
        the router and the request when it left (committed there)."""
        m = self._moves.pop(r.request_id, None)
        if m is None:
            return None
        request = m.request
        self._by_request.pop(request.request_id, None)
        if m.ended:
            return None, None  # given up first: the router heard then (or from the request's last output)
        ok = r.outcome is TransferOutcome.OK
        out = self._answer(m, "" if ok else f"KV copy to worker {m.msg.to_worker} failed: {r.error}", r)
        if ok:
            self.blocks.free(request.request_id)
            return out, request
        if m.paused_at:  # it stays: scheduled again at the next step, its blocks untouched
            self.scheduler.add_running(request)
        return out, None
