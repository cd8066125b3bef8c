"""Placement: which worker takes a request — by role, node, health, KV headroom, and among those the
routing policy's choice (routing.py: KV-aware by default) for a new request.

Pure decisions over the worker registry: nothing here sends a message. A choice that falls on a
standby means "promote it to this role"; the engine client does that. A sick worker takes nothing; a
degraded one (health score over its threshold) only when no other of the role can.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from steadfast.config import HealthConfig, RoutingConfig, SchedulerConfig, TakeoverConfig
from steadfast.control.fleet.health import HealthMonitor
from steadfast.control.fleet.routing import Router
from steadfast.control.fleet.workers import WorkerHandle, WorkerRegistry
from steadfast.wire.worker import Priority, WorkerRole

# Roles that serve a request start to end, in order of preference (a decode worker computes the prompt
# itself when no prefill worker can); a dead decode worker's requests go to another decode worker first.
SERVE_ROLES = (WorkerRole.MIXED, WorkerRole.DECODE, WorkerRole.PREFILL)
DECODE_ROLES = (WorkerRole.DECODE, WorkerRole.MIXED, WorkerRole.PREFILL)


class Placement:
    def __init__(
        self,
        registry: WorkerRegistry,
        takeover: TakeoverConfig,
        max_in_flight: int,
        router: Router | None = None,
        health: HealthMonitor | None = None,
    ) -> None:
        """`router`, `health`: the engine client's (by default: KV-aware routing, health checks on)."""
        self.registry = registry
        self.cfg = takeover
        self.max_in_flight = max_in_flight
        self.router = router or Router(RoutingConfig(), SchedulerConfig(), 16)
        self.health = health or HealthMonitor(HealthConfig())

    def live(self, exclude: int = -1) -> list[WorkerHandle]:
        """Ready workers that may take a request: not draining, not sick."""
        return [w for w in self.registry.live(exclude) if not self.health.excluded(w.worker_id)]

    def pick(
        self,
        exclude: int = -1,
        roles: tuple[WorkerRole, ...] = SERVE_ROLES,
        node: str = "",
        prompt: Sequence[int] = (),
        priority: Priority = Priority.NORMAL,
        request_id: str = "",
    ) -> WorkerHandle | None:
        """A ready worker of the first of `roles` that has one: on `node` if one is there (a dead
        worker's KV is adoptable only on its own node), healthy if one is; for a new request (`prompt`)
        the routing policy's choice among those, else the least loaded. When none has one, a standby
        (of `node` first), which the caller promotes to `roles[0]`."""
        live = self.live(exclude)
        for role in roles:
            candidates = [w for w in live if w.role == role]
            if not candidates:
                continue
            if node:
                candidates = [w for w in candidates if w.node == node] or candidates
            candidates = [w for w in candidates if not self.health.avoid(w.worker_id)] or candidates
            if prompt:
                chosen = self.router.choose(candidates, prompt, priority, request_id)
            else:
                chosen = min(candidates, key=lambda w: (w.load, w.worker_id))
            self.health.placed(chosen.worker_id, request_id)
            return chosen
        return self.standby(node, live)

    def standby(
        self, node: str = "", live: list[WorkerHandle] | None = None, elsewhere: bool = False
    ) -> WorkerHandle | None:
        """A ready standby: of `node` first, or with `elsewhere` of another node first (`node` is
        stopping as a whole, its standbys with it)."""
        standbys = [w for w in (self.live() if live is None else live) if w.role == WorkerRole.STANDBY]
        return min(standbys, key=lambda w: ((w.node == node) == elsewhere, w.worker_id), default=None)

    def decode_target(self) -> WorkerHandle | None:
        """Where a prefilled request decodes: a decode worker with room, by load then KV in use."""
        live = [w for w in self.live() if w.role == WorkerRole.DECODE]
        return min(
            live, key=lambda w: (self.health.avoid(w.worker_id), not self.has_room(w), w.load, w.kv_use), default=None
        )

    def disaggregated(
        self, prompt: Sequence[int] = (), priority: Priority = Priority.NORMAL, request_id: str = ""
    ) -> tuple[WorkerHandle, WorkerHandle] | None:
        """A (prefill, decode) pair for a new request, when this deployment has both ready."""
        if not self.registry.has_role(WorkerRole.PREFILL):
            return None
        prefill = self.pick(roles=(WorkerRole.PREFILL,), prompt=prompt, priority=priority, request_id=request_id)
        decode = self.decode_target() if prefill is not None else None
        return (prefill, decode) if prefill is not None and decode is not None else None

    def has_room(self, w: WorkerHandle, now: float | None = None) -> bool:
        """Whether `w` may take one more new request: it keeps its KV reserve for takeovers, and a
        promoted standby ramps its limit up linearly from 1 over the warm-up period instead of taking
        a full share of load at once."""
        s = w.status
        if s is not None and s.kv_blocks_total:
            if s.kv_blocks_used >= (1 - self.cfg.reserve_fraction) * s.kv_blocks_total:
                return False
        warmup = self.cfg.warmup
        if w.promoted_at is None or warmup <= 0:
            return True
        elapsed = (time.monotonic() if now is None else now) - w.promoted_at
        if elapsed >= warmup:
            return True
        return w.load < max(1, int(self.max_in_flight * elapsed / warmup))

    @property
    def room_wait_s(self) -> float:
        """How long a new request may wait for a worker with room before the least loaded takes it."""
        return max(self.cfg.warmup, self.cfg.reserve_wait)
