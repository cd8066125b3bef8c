"""What a step costs on this worker, learnt from its own steps: time ≈ base + per_token × tokens.

The scheduler asks it how many prefill tokens fit beside a step's decodes so that the streams already
decoding keep getting a token every `decode_step_target_ms`: a burst of prompts (new requests, or a
takeover recomputing several prefills at once) is then spread over steps instead of stalling every
stream for one long step. A weighted least-squares line over the recent steps, old steps forgotten
geometrically, so that it follows the machine (other processes, thermal, a changed thread count).
"""

from __future__ import annotations

# Weight of one new step against all that came before: ~20 steps of memory.
FORGET = 0.05
# The line is trusted only once the steps it was fitted on differ in size by this many tokens (std dev).
MIN_SPREAD = 8.0


class StepCost:
    def __init__(self) -> None:
        self._w = self._n = self._t = self._nn = self._nt = 0.0
        self._trusted: tuple[float, float] | None = None  # the last line fitted on steps of varied sizes

    def observe(self, tokens: int, seconds: float) -> None:
        keep = 1.0 - FORGET
        self._w = keep * self._w + FORGET
        self._n = keep * self._n + FORGET * tokens
        self._t = keep * self._t + FORGET * seconds
        self._nn = keep * self._nn + FORGET * tokens * tokens
        self._nt = keep * self._nt + FORGET * tokens * seconds
        mean_n, mean_t = self._n / self._w, self._t / self._w
        var = self._nn / self._w - mean_n * mean_n
        if var >= MIN_SPREAD * MIN_SPREAD:
            slope = (self._nt / self._w - mean_n * mean_t) / var
            if slope > 0.0:
                self._trusted = (max(0.0, mean_t - slope * mean_n), slope)
                return
        if self._trusted is not None:
            # Steps of one size tell nothing of the slope: the last one stands, the line through them.
            slope = self._trusted[1]
            self._trusted = (max(0.0, mean_t - slope * mean_n), slope)

    def line(self) -> tuple[float, float] | None:
        """(base seconds, seconds per token), or None until steps of different sizes were seen. After a
        run of same-size steps (a quiet spell of decodes) the last line fitted on varied steps stands:
        the burst that ends the spell is what it is for."""
        return self._trusted

    def prefill_room(self, decode_tokens: int, target_s: float) -> int | None:
        """Prefill tokens that fit beside `decode_tokens` in a step of `target_s` (None: not known yet;
        0 or less: the decodes alone take the target)."""
        fitted = self.line()
        if fitted is None:
            return None
        base, per_token = fitted
        return int((target_s - base) / per_token + 1e-6) - decode_tokens  # no 104.99999 -> 104
