"""Continuous batching: which requests compute how many tokens in the next step.

Each step has a token budget. Running requests go first, highest priority first: a decode takes one
token, an unfinished prefill takes a chunk. Waiting requests are then admitted by (priority, arrival)
into what budget and KV room are left, reusing cached prefix blocks. When a running request needs a
block and none is free, the lowest-priority, latest-arrived running request not yet scheduled this
step is preempted: its blocks are freed and it waits to be recomputed (its output tokens are kept).

With an offload tier, a preempted request's named blocks are swapped out to it first (`Tier.swap_out`), and a
waiting request whose prefix the tier holds waits until those blocks are back (`Tier.ready`): then its
admission finds them cached, and only the tail of its last block is recomputed.

While some client is streaming (a request has produced tokens), the prefill chunks of requests that
have not share what is left of `decode_step_target_ms` beside the decodes, by the worker's own step
times (`StepCost`), at least `prefill_floor_tokens` a step: streams keep a steady pace through a burst
of prompts. A streaming request's own recomputation (after a takeover or a preemption) is not cut: it
is the stall its client feels; nor is a high-priority prompt. From L1 on the degradation ladder sets the
target to the TPOT target (`step_target_ms`).

The degradation ladder's L3 (`offload_from`, `kv_target`, from the router's `Degrade`): while the
worker's KV use is above the target, running requests of that priority or lower are swapped out to the
offload tier (only those the tier has room for: never a recomputing preemption), and waiting ones are
not admitted back above the target; the KV above it is kept for higher priorities.

With speculative decoding a decoding request may bring draft tokens: it is then scheduled to verify
them (one position each, beyond its own token) when budget and KV room allow, else as a plain decode —
drafts never preempt anybody.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from steadfast.config import SchedulerConfig
from steadfast.wire.worker import Priority
from steadfast.worker.core.block_manager import BlockManager
from steadfast.worker.core.request import Request, Status
from steadfast.worker.core.step_cost import StepCost


@dataclass
class ScheduledStep:
    decodes: list[Request] = field(default_factory=list)
    prefills: list[tuple[Request, int]] = field(default_factory=list)  # (request, new tokens)
    preempted: list[Request] = field(default_factory=list)
    verifies: list[tuple[Request, list[int]]] = field(default_factory=list)  # (request, draft tokens)

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills and not self.verifies

    @property
    def num_decode_rows(self) -> int:
        """Requests computing their next token (a verifying one's own row too)."""
        return len(self.decodes) + len(self.verifies)

    @property
    def num_prefill(self) -> int:
        """Prompt tokens computed, and draft tokens verified (rows of a prefill's kind: their cost)."""
        return sum(n for _, n in self.prefills) + sum(len(d) for _, d in self.verifies)

    @property
    def num_tokens(self) -> int:
        return self.num_decode_rows + self.num_prefill


# A decoding request and the step budget left → the draft tokens it would verify (none: a plain decode).
Drafter = Callable[[Request, int], list[int]]
NOBODY = 3  # an `offload_from` no priority reaches


class Tier(Protocol):
    """The offload tier as the scheduler uses it (`worker/kv/offload.py`)."""

    def swap_out(self, request: Request) -> int:
        """A request about to be preempted → how many of its named blocks the tier holds now."""
        ...

    def has_room(self, request: Request) -> bool:
        """A running request → whether the tier has room for all its named blocks now."""
        ...

    def ready(self, request: Request, hits: Sequence[int], others_run: bool) -> bool:
        """A waiting request, its arena prefix hits, whether others run → may it be admitted now (False:
        its KV is on its way back from the tier, or waits for room to come back)."""
        ...


class Scheduler:
    def __init__(
        self,
        cfg: SchedulerConfig,
        blocks: BlockManager,
        drafter: Drafter | None = None,
        tier: Tier | None = None,
        cost: StepCost | None = None,
    ) -> None:
        """`tier`: the offload tier preempted and L3's requests swap out to (None: they recompute);
        `cost`: the step-cost model the budget is planned with (None: the token budget alone)."""
        self.cfg = cfg
        self.blocks = blocks
        self.drafter = drafter
        self.tier = tier
        self.cost = cost
        self.offload_from = NOBODY  # the ladder's L3: priorities swapped out above `kv_target`
        self.kv_target = 1.0
        self.step_target_ms = 0.0  # the ladder's step target (0: cfg.decode_step_target_ms)
        self.ladder_swaps = 0  # running requests swapped out by the ladder
        self.swap_preemptions = 0  # preempted with KV kept in the offload tier
        self.recompute_preemptions = 0  # preempted with nothing kept there
        self.recomputed_tokens = 0  # tokens whose KV a preempted request had, computed again
        self.running: list[Request] = []
        self._waiting: list[tuple[tuple[int, int], Request]] = []  # heap by sort_key
        self._waiting_ids: dict[str, Request] = {}

    @property
    def num_waiting(self) -> int:
        return len(self._waiting_ids)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self._waiting_ids)

    def add(self, request: Request) -> None:
        request.status = Status.WAITING
        self._waiting_ids[request.request_id] = request
        heapq.heappush(self._waiting, (request.sort_key, request))

    def add_running(self, request: Request) -> None:
        """A request whose KV this worker already holds (handed over by a prefill worker)."""
        request.status = Status.RUNNING
        self.running.append(request)

    def detach(self, request: Request) -> None:
        """Take a running request out without freeing its blocks (they were handed to another worker)."""
        self.running.remove(request)

    def remove(self, request_id: str) -> Request | None:
        """Take a request out wherever it is (abort or finish) and free its blocks."""
        request = self._waiting_ids.pop(request_id, None)
        if request is None:
            for r in self.running:
                if r.request_id == request_id:
                    request = r
                    self.running.remove(r)
                    break
        if request is not None:
            self.blocks.free(request_id)
        return request

    def _preempt(self, request: Request) -> None:
        if self.tier is not None and self.tier.swap_out(request):
            self.swap_preemptions += 1
        else:
            self.recompute_preemptions += 1
        self.running.remove(request)
        self.blocks.free(request.request_id)
        request.kv_lost = request.num_computed
        request.num_computed = 0
        request.num_preemptions += 1
        self.add(request)

    def _over_target(self, extra: int = 0) -> bool:
        return self.blocks.num_used + extra > self.kv_target * self.blocks.num_blocks

    def _shed(self, step: ScheduledStep) -> None:
        """L3: swap running requests of `offload_from` priority or lower out to the tier, lowest priority
        and latest first, until KV use is back at the target."""
        if self.tier is None or self.offload_from >= NOBODY:
            return
        victims = [r for r in self.running if r.priority >= self.offload_from and r.status is Status.RUNNING]
        for victim in sorted(victims, key=lambda r: r.sort_key, reverse=True):
            if not self._over_target():
                return
            if self.tier.has_room(victim):
                self._preempt(victim)
                step.preempted.append(victim)
                self.ladder_swaps += 1

    def _held_back(self, request: Request) -> bool:
        """L3: a waiting request of an offloaded priority stays out while it would take KV use over the target."""
        if request.priority < self.offload_from:
            return False
        return self._over_target(self.blocks.blocks_needed(request.num_tokens))

    def _verify(self, request: Request, budget: int, step: ScheduledStep) -> bool:
        """Schedule a decoding request to verify its drafts, if it has some and they fit."""
        if self.drafter is None:
            return False
        drafts = self.drafter(request, budget)
        if not drafts or self.blocks.allocate(request.request_id, request.num_tokens + len(drafts)) is None:
            return False
        step.verifies.append((request, drafts))
        return True

    def _prefill_room(self) -> int | None:
        """Tokens this step's new prompts may take (None: no limit but the budget)."""
        target = self.step_target_ms or self.cfg.decode_step_target_ms
        if self.cost is None or target <= 0:
            return None
        if not any(r.streaming for r in self.running) and not any(r.streaming for r in self._waiting_ids.values()):
            return None  # no client waits on this step for its next token
        decoding = sum(1 for r in self.running if r.status is Status.RUNNING and r.num_pending == 1)
        return self.cost.prefill_room(decoding, target / 1000)

    def _cut(self, request: Request, n: int, pace: list[int] | None) -> int:
        """`n` prefill tokens of `request`, cut to the step's pace: `pace` = [room left, new-prompt
        tokens taken] (None: not paced). A streaming request's recomputation takes what it needs, and so
        does a high-priority prompt (the last to be degraded: its steps' length spreads over every stream's
        tokens, its wait would be its own)."""
        if pace is None or request.streaming or request.priority == Priority.HIGH:
            return n
        room, fresh = pace
        return min(n, max(room, self.cfg.prefill_floor_tokens - fresh))

    @staticmethod
    def _took(request: Request, n: int, pace: list[int] | None) -> None:
        if pace is not None:
            pace[0] -= n
            pace[1] += 0 if request.streaming else n

    def schedule(self) -> ScheduledStep:
        step = ScheduledStep()
        self._shed(step)
        budget = self.cfg.max_num_batched_tokens
        room = self._prefill_room()
        pace = None if room is None else [room, 0]
        scheduled: set[str] = set()
        for request in sorted(self.running, key=lambda r: r.sort_key):
            if request.status is not Status.RUNNING or budget <= 0:
                continue
            n = min(request.num_pending, self.cfg.max_prefill_chunk, budget)
            if request.num_pending == 1 and self._verify(request, budget, step):
                scheduled.add(request.request_id)
                budget -= 1 + len(step.verifies[-1][1])
                if pace is not None:
                    pace[0] -= len(step.verifies[-1][1])  # its drafts lengthen the step as prefill tokens do
                continue
            prefill = request.num_pending > 1
            if prefill:
                n = self._cut(request, n, pace)
                if n <= 0:
                    continue
            while self.blocks.allocate(request.request_id, request.num_computed + n) is None:
                victims = [r for r in self.running if r.request_id not in scheduled]
                victim = max(victims, key=lambda r: r.sort_key)
                self._preempt(victim)
                step.preempted.append(victim)
                if victim is request:
                    break
            if request.status is not Status.RUNNING:
                continue
            scheduled.add(request.request_id)
            budget -= n
            if prefill:
                self._took(request, n, pace)
            if request.num_pending == 1:
                step.decodes.append(request)
            else:
                step.prefills.append((request, n))

        deferred = []  # waiting for their KV to come back from the offload tier, or for prefill room
        while self._waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            _, request = self._waiting[0]
            if request.request_id not in self._waiting_ids or request.status is not Status.WAITING:
                heapq.heappop(self._waiting)  # stale entry of a removed request
                continue
            if pace is not None and not request.streaming and self._cut(request, 1, pace) <= 0:
                deferred.append(heapq.heappop(self._waiting))  # no room for new prompts: not even looked up
                continue
            if self._held_back(request):
                deferred.append(heapq.heappop(self._waiting))
                continue
            own = request.num_preemptions > 0 or request.recovery is not None
            hits = self.blocks.match_prefix(request.all_ids, own)
            if request.params.prompt_logprobs >= 0 and not request.output_ids:  # (cached KV has no logits)
                hits = hits[: len(request.prompt_scores) // self.blocks.block_size]
            if self.tier is not None and not self.tier.ready(request, hits, bool(self.running)):
                deferred.append(heapq.heappop(self._waiting))
                continue
            cached = len(hits) * self.blocks.block_size
            n = min(request.num_tokens - cached, self.cfg.max_prefill_chunk, budget)
            prefill = request.num_tokens - cached > 1
            if prefill:
                n = self._cut(request, n, pace)
                if n <= 0:  # this step's new-prompt room is taken; a streaming one behind may still come in
                    deferred.append(heapq.heappop(self._waiting))
                    continue
            if self.blocks.allocate(request.request_id, cached + n, prefix=hits) is None:
                break
            heapq.heappop(self._waiting)
            del self._waiting_ids[request.request_id]
            if request.num_preemptions == 0:
                request.num_cached = cached
            else:
                self.recomputed_tokens += max(0, request.kv_lost - cached)
                request.kv_lost = 0
            request.num_computed = cached
            request.status = Status.RUNNING
            self.running.append(request)
            budget -= n
            if prefill:
                self._took(request, n, pace)
            if request.num_pending == 1:
                step.decodes.append(request)
            else:
                step.prefills.append((request, n))
        for entry in deferred:
            heapq.heappush(self._waiting, entry)
        return step
