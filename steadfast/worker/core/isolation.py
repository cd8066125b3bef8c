"""Which requests of a failed step fail on their own: each computed alone (probed), or named by the
failure itself (non-finite logits rows). A failure no single request reproduces, or that every one of
several does, is the engine's own, not a request's."""

from __future__ import annotations

from collections.abc import Callable

from steadfast.worker.core.scheduler import ScheduledStep


class NonFiniteLogitsError(RuntimeError):
    """Rows of a step's logits were NaN or infinite: whose requests."""

    def __init__(self, request_ids: set[str]) -> None:
        super().__init__(f"non-finite logits for {len(request_ids)} request(s)")
        self.request_ids = request_ids


def find_culprits(
    scheduled: ScheduledStep, failure: Exception, compute: Callable[[ScheduledStep], object]
) -> dict[str, str]:
    """Request id → why, for the requests of `scheduled` that fail alone (`compute` runs one step);
    raises `failure` again when it is the engine's."""
    culprits: dict[str, str] = {}
    if isinstance(failure, NonFiniteLogitsError):  # the rows say whose: no probing
        culprits = dict.fromkeys(failure.request_ids, str(failure))
    else:
        alone = (
            [(r, ScheduledStep(decodes=[r])) for r in scheduled.decodes]
            + [(r, ScheduledStep(prefills=[(r, n)])) for r, n in scheduled.prefills]
            + [(r, ScheduledStep(verifies=[(r, d)])) for r, d in scheduled.verifies]
        )
        for request, step in alone:
            try:
                compute(step)
            except Exception as exc:
                culprits[request.request_id] = f"{type(exc).__name__}: {exc}"
    every = len(scheduled.decodes) + len(scheduled.prefills) + len(scheduled.verifies)
    if not culprits or (len(culprits) > 1 and len(culprits) == every):
        raise failure  # none fails alone, or every one does: the engine is broken, not a request
    return culprits


def without(scheduled: ScheduledStep, culprits: dict[str, str]) -> ScheduledStep:
    """The step again without the culprits' requests."""
    return ScheduledStep(
        [r for r in scheduled.decodes if r.request_id not in culprits],
        [(r, n) for r, n in scheduled.prefills if r.request_id not in culprits],
        scheduled.preempted,
        [(r, d) for r, d in scheduled.verifies if r.request_id not in culprits],
    )
