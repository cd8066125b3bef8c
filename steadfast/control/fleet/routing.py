"""Routing of a new request among the workers that may take it (ARCHITECTURE.md §5, routing half).

`kv_aware`: each worker's prefix cache is known from its cache events (`CacheIndex`: the chained block
names it holds); a new request goes where its predicted time to first token is least — its prompt's
uncached tokens computed behind what is queued there, by that worker's measured step cost
(`signals.predict_ttft`) — so a multi-turn chat stays where its history is cached while that is
cheaper than the queue, and moves on when it is not. `least_loaded`: fewest requests in flight.
`round_robin`: in turn. Pure: no I/O; every decision is kept for `GET /admin/routing`.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from steadfast.config import SchedulerConfig
from steadfast.config.health import RoutingConfig, RoutingPolicy
from steadfast.control.fleet.signals import WorkerLoad, predict_ttft
from steadfast.control.fleet.workers import WorkerHandle
from steadfast.kv.names import chain
from steadfast.wire.worker import CacheEvents, Priority

# Without a measured step cost, a decoding request is counted as this many prompt tokens of work.
DECODE_AS_TOKENS = 16


class CacheIndex:
    """Which chained block names each worker holds cached, from its `CacheEvents`; bounded per worker
    (past the bound its set is dropped until its next full report)."""

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self._names: dict[int, set[bytes]] = {}
        self.dropped = 0  # indexes dropped for size

    def apply(self, ev: CacheEvents) -> None:
        names = set() if ev.reset else self._names.get(ev.worker_id)
        if names is None:
            return  # dropped: wait for the next full report
        names.difference_update(ev.removed)
        names.update(ev.stored[: self.max_blocks + 1])
        if len(names) > self.max_blocks:
            self._names.pop(ev.worker_id, None)
            self.dropped += 1
            return
        self._names[ev.worker_id] = names

    def forget(self, worker_id: int) -> None:
        self._names.pop(worker_id, None)

    def size(self, worker_id: int) -> int:
        return len(self._names.get(worker_id, ()))

    def cached_blocks(self, worker_id: int, names: Sequence[bytes]) -> int:
        """How many of a prompt's leading blocks (`names`, chained) the worker holds."""
        held = self._names.get(worker_id)
        if not held:
            return 0
        n = 0
        for name in names:
            if name not in held:
                break
            n += 1
        return n

    def cached_tokens(
        self, worker_id: int, prompt: Sequence[int], block_size: int, names: Sequence[bytes] | None = None
    ) -> int:
        """Tokens of `prompt` the worker holds cached, as its cache events told (the last token is always
        computed: it gives the first output's logits). `names`: the prompt's, if chained already."""
        if names is None:
            names = chain(prompt, block_size, len(prompt) // block_size)
        return min(self.cached_blocks(worker_id, names) * block_size, max(0, len(prompt) - 1))


@dataclass
class Candidate:
    worker_id: int
    cached_tokens: int
    cost: float  # kv_aware: predicted seconds to the first token (or token-work units); else the load


@dataclass
class Decision:
    at: float  # wall clock
    request_id: str
    policy: str
    chosen: int
    candidates: list[Candidate]


# Each worker's load as the ladder models it (step cost, queue, running), without the request being placed
# (by its id).
Loads = Callable[[str], dict[int, WorkerLoad]]


class Router:
    def __init__(
        self,
        cfg: RoutingConfig,
        sched: SchedulerConfig,
        block_size: int,
        index: CacheIndex | None = None,
        loads: Loads | None = None,
    ) -> None:
        """`index`: the workers' cached blocks, shared with the ladder (default: a new one); `loads`: the
        ladder's (None: loads unknown, counted by requests in flight)."""
        self.cfg = cfg
        self.policy = cfg.resolved_policy
        self.sched = sched
        self.block_size = block_size
        self.index = index if index is not None else CacheIndex(cfg.max_index_blocks)
        self.decisions: deque[Decision] = deque(maxlen=cfg.history)
        self._turn = itertools.count()
        self.loads = loads
        self.cached_tokens = 0  # prompt tokens found cached where requests were sent
        self.prompt_tokens = 0

    def choose(
        self,
        candidates: list[WorkerHandle],
        prompt: Sequence[int] = (),
        priority: Priority = Priority.NORMAL,
        request_id: str = "",
    ) -> WorkerHandle:
        """One of `candidates` (not empty) for a new request of `prompt`."""
        if len(candidates) == 1 and not prompt:
            return candidates[0]
        names = chain(prompt, self.block_size, len(prompt) // self.block_size)
        if self.policy is RoutingPolicy.ROUND_ROBIN:
            ordered = sorted(candidates, key=lambda w: w.worker_id)
            chosen = ordered[next(self._turn) % len(ordered)]
            scored = [Candidate(w.worker_id, 0, float(w.load)) for w in ordered]
        elif self.policy is RoutingPolicy.LEAST_LOADED or not prompt:
            chosen = min(candidates, key=lambda w: (w.load, w.worker_id))
            scored = [Candidate(w.worker_id, 0, float(w.load)) for w in candidates]
        else:
            scored = self._kv_aware(candidates, prompt, names, priority, request_id)
            by_id = {w.worker_id: w for w in candidates}
            best = min(scored, key=lambda c: (c.cost, -c.cached_tokens, by_id[c.worker_id].load, c.worker_id))
            chosen = by_id[best.worker_id]
        if prompt:
            self.cached_tokens += self.index.cached_blocks(chosen.worker_id, names) * self.block_size
            self.prompt_tokens += len(prompt)
            self.decisions.append(Decision(time.time(), request_id, self.policy.value, chosen.worker_id, scored))
        return chosen

    def _kv_aware(
        self,
        candidates: list[WorkerHandle],
        prompt: Sequence[int],
        names: list[bytes],
        priority: Priority,
        request_id: str,
    ) -> list[Candidate]:
        loads = self.loads(request_id) if self.loads is not None else {}
        measured = all(w.worker_id in loads and loads[w.worker_id].measured for w in candidates)
        scored = []
        for w in candidates:
            cached = self.index.cached_tokens(w.worker_id, prompt, self.block_size, names)
            new = len(prompt) - cached
            load = loads.get(w.worker_id)
            if measured and load is not None:
                cost = predict_ttft(load, new, priority, self.sched, self.block_size)
            elif load is not None:
                queued = sum(q.prompt_tokens for q in load.queued)
                cost = float(new + queued + DECODE_AS_TOKENS * len(load.running))
            else:
                cost = float(new + DECODE_AS_TOKENS * w.load)
            scored.append(Candidate(w.worker_id, cached, cost))
        return scored

    @property
    def hit_rate(self) -> float:
        """Prompt tokens found cached where requests were sent, over all prompt tokens routed."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def view(self, worker_ids: Sequence[int]) -> dict[str, object]:
        return {
            "policy": self.policy.value,
            "prefix_hit_rate": round(self.hit_rate, 4),
            "indexed_blocks": {str(w): self.index.size(w) for w in worker_ids},
            "index_dropped": self.index.dropped,
            "decisions": [
                {
                    "at": d.at,
                    "request_id": d.request_id,
                    "chosen": d.chosen,
                    "candidates": [
                        {"worker_id": c.worker_id, "cached_tokens": c.cached_tokens, "cost": round(c.cost, 4)}
                        for c in d.candidates
                    ],
                }
                for d in list(self.decisions)[-50:]
            ],
        }
