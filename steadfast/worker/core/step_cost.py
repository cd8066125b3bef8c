"""What a step costs on this worker, learnt from its own steps:
time ≈ base + per_decode × decoding rows + per_prefill × prefill tokens.

The scheduler asks it how many prefill tokens fit beside a step's decodes so that the streams already
decoding keep getting a token every `decode_step_target_ms`: a burst of prompts (new requests, or a
takeover recomputing several prefills at once) is then spread over steps instead of stalling every
stream for one long step. The router predicts TTFT and TPOT from it (`control/fleet/signals.py`).

Two slopes, because a decode row and a prompt token do not cost the same: on CPU a step of 16 decode
rows costs ~1.8 ms a row (a matrix product of few rows runs far from the cores' peak), a prompt token
beside it ~0.8 ms (measured on the default model, 2 cores). One slope fitted over both priced a burst's
prompts at the decodes' rate: TTFT predicted twice what it was, and admission refused requests the
worker would have served in time.

A weighted least-squares fit over the recent steps, old steps forgotten geometrically, so that it
follows the machine (other processes, thermal, a changed thread count). A slope the recent steps do not
tell (steady decoding: the same rows every step) stays where it was, and the base takes up the rest:
the step the worker runs is priced right even where its rows' slope is old. (Pulling each fit towards
the last one instead let noise walk a slope away: the same window of steps pulled it again each step.)
"""

from __future__ import annotations

from dataclasses import dataclass

# Weight of one new step against all that came before: ~20 steps of memory.
FORGET = 0.05
# No line until the steps seen differ in size (decode rows + prefill tokens) by this many (std dev);
# after, a slope is refitted only where its own count varies by this many beyond the other's.
MIN_SPREAD = 8.0


@dataclass(frozen=True)
class StepLine:
    """A step's expected seconds: `base_s` + `decode_s` a decoding row + `prefill_s` a prefill token
    (or a draft token verified)."""

    base_s: float
    decode_s: float
    prefill_s: float

    def seconds(self, decodes: int, prefill: int = 0) -> float:
        return self.base_s + decodes * self.decode_s + prefill * self.prefill_s


class StepCost:
    def __init__(self) -> None:
        # Exponentially weighted sums: weight, d, p, t, d², p², dp, dt, pt (d: decode rows, p: prefill
        # tokens, t: seconds).
        self._m = [0.0] * 9
        self._line: StepLine | None = None

    def observe(self, decodes: int, prefill: int, seconds: float) -> None:
        d, p, t = float(decodes), float(prefill), seconds
        keep = 1.0 - FORGET
        for i, x in enumerate((1.0, d, p, t, d * d, p * p, d * p, d * t, p * t)):
            self._m[i] = keep * self._m[i] + FORGET * x
        w, sd, sp, st, sdd, spp, sdp, sdt, spt = self._m
        md, mp, mt = sd / w, sp / w, st / w
        var_d, var_p, cov_dp = sdd / w - md * md, spp / w - mp * mp, sdp / w - md * mp
        cov_dt, cov_pt = sdt / w - md * mt, spt / w - mp * mt
        last = self._line
        if last is None:
            # The first line: one slope for both, once the steps differ enough in size to show one.
            var_n = var_d + 2 * cov_dp + var_p
            if var_n < MIN_SPREAD * MIN_SPREAD:
                return
            slope = (cov_dt + cov_pt) / var_n
            if slope > 0.0:
                self._line = StepLine(max(0.0, mt - slope * (md + mp)), slope, slope)
            return
        # A slope is fitted only on steps that vary in its own count beyond what the other count's
        # variation explains (partial variance); else the last one stands.
        spread = MIN_SPREAD * MIN_SPREAD
        fit_a = var_d - (cov_dp * cov_dp / var_p if var_p > 0 else 0.0) >= spread
        fit_b = var_p - (cov_dp * cov_dp / var_d if var_d > 0 else 0.0) >= spread
        a, b = last.decode_s, last.prefill_s
        if fit_a and fit_b:
            det = var_d * var_p - cov_dp * cov_dp
            a, b = (cov_dt * var_p - cov_pt * cov_dp) / det, (cov_pt * var_d - cov_dt * cov_dp) / det
        elif fit_a:
            a = (cov_dt - b * cov_dp) / var_d
        elif fit_b:
            b = (cov_pt - a * cov_dp) / var_p
        if a <= 0.0 or b <= 0.0:
            a, b = last.decode_s, last.prefill_s  # noise: the slopes stand, the line through the steps
            fit_a = fit_b = False
        base = mt - a * md - b * mp
        if base < 0.0:
            # A slope kept from other steps (the rows' cost through a spell of steady decoding) put the
            # line's foot below zero: that slope takes the difference, the line goes through zero.
            if not fit_a and md > 0 and a + base / md > 0:
                a += base / md
            elif not fit_b and mp > 0 and b + base / mp > 0:
                b += base / mp
            base = 0.0
        self._line = StepLine(base, a, b)

    def line(self) -> StepLine | None:
        """The fitted cost, or None until steps of different sizes were seen. After a run of same-size
        steps (a quiet spell of decodes) the slopes last fitted on varied steps stand: the burst that
        ends the spell is what they are for."""
        return self._line

    def prefill_room(self, decodes: int, target_s: float) -> int | None:
        """Prefill tokens that fit beside `decodes` decoding rows in a step of `target_s` (None: not
        known yet; 0 or less: the decodes alone take the target)."""
        fitted = self._line
        if fitted is None:
            return None
        return int((target_s - fitted.seconds(decodes)) / fitted.prefill_s + 1e-6)  # no 104.99999 -> 104
