"""Whether the SLO's latency targets can be met on this hardware at all, and what the ladder judges
latency against when they cannot.

A request served alone takes at least the hardware's solo figures: one decode step a token (TPOT), one
typical prompt's prefill (TTFT), measured by the workers' own step costs, so they follow the machine
(other processes on it slow both). A target under them is not broken by load, and shedding load cannot
meet it: a ladder that judged against it refused single requests on a merely busy machine (25 of 25,
"about 293 ms a token, over the 80 ms target", with nothing queued). Such a target is said once and the
ladder judges against `headroom` x the solo figure instead: what the hardware does with some sharing.

Pure: figures in, state and messages out."""

from __future__ import annotations

import enum
from dataclasses import dataclass

# The solo figures are smoothed over ticks (~5 s at the ladder's 0.5 s), so that one slow step on a
# noisy machine neither declares a target unattainable nor takes that back.
SMOOTHING = 0.1
# Attainable again only once the solo figure is this share of the target: a machine hovering at the
# target does not flip the judged figure (target <-> headroom x solo) every tick.
RECOVER = 0.8


class Latency(enum.Enum):
    TTFT = "TTFT"
    TPOT = "TPOT"


@dataclass
class Figure:
    """One latency's solo figure (smoothed, ms; 0: not measured yet) and whether its target is met alone."""

    solo_ms: float = 0.0
    attainable: bool = True


@dataclass(frozen=True)
class Verdict:
    """A change of attainability, to be said once."""

    latency: Latency
    attainable: bool
    solo_ms: float
    target_ms: float
    judged_ms: float

    def message(self) -> str:
        if self.attainable:
            return (
                f"SLO attainable again on this hardware: {self.latency.value} alone {self.solo_ms:.0f} ms vs "
                f"target {self.target_ms:.0f} ms"
            )
        return (
            f"SLO unattainable on this hardware: {self.latency.value} alone {self.solo_ms:.0f} ms vs target "
            f"{self.target_ms:.0f} ms; the ladder judges against {self.judged_ms:.0f} ms"
        )


class Attainability:
    def __init__(self, headroom: float) -> None:
        self.headroom = headroom
        self.figures = {k: Figure() for k in Latency}

    def observe(self, latency: Latency, solo_ms: float, target_ms: float) -> Verdict | None:
        """Take this tick's solo figure (0: unknown, ignored); a Verdict when attainability changed."""
        if solo_ms <= 0:
            return None
        f = self.figures[latency]
        f.solo_ms = solo_ms if f.solo_ms <= 0 else f.solo_ms + SMOOTHING * (solo_ms - f.solo_ms)
        now = f.solo_ms <= (RECOVER * target_ms if not f.attainable else target_ms)
        if now == f.attainable:
            return None
        f.attainable = now
        return Verdict(latency, now, f.solo_ms, target_ms, self.judged_ms(latency, target_ms))

    def judged_ms(self, latency: Latency, target_ms: float) -> float:
        """What the ladder holds this latency to: the target, or headroom x solo where alone misses it."""
        f = self.figures[latency]
        return target_ms if f.attainable else max(target_ms, self.headroom * f.solo_ms)

    def view(self, targets: dict[Latency, float]) -> dict[str, dict[str, object]]:
        out: dict[str, dict[str, object]] = {}
        for k, target in targets.items():
            f = self.figures[k]
            judged = self.judged_ms(k, target)
            out[k.value.lower()] = {
                "solo_ms": round(f.solo_ms, 1),
                "target_ms": target,
                "judged_ms": round(judged, 1),
                "attainable": f.attainable,
                "message": "" if f.attainable else Verdict(k, False, f.solo_ms, target, judged).message(),
            }
        return out
