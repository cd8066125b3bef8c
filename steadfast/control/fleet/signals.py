"""What the degradation ladder looks at: latencies over a sliding window, and each worker's load as
the router knows it — from which the TTFT of a new request is predicted before it is admitted.

Pure: no I/O, no clock of its own (callers pass `now`)."""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass, field

from steadfast.config import SchedulerConfig
from steadfast.wire.worker import Priority

# Observations a window keeps at most (one per output token: ~10 s of a busy server), so memory is bounded.
WINDOW_CAP = 50_000


class Window:
    """Values observed over the last `span` seconds, each with the time its story began (`origin`: a
    TTFT's request was admitted then), so a percentile can be taken over what began after a moment."""

    def __init__(self, span: float, cap: int = WINDOW_CAP) -> None:
        self.span = span
        self._items: deque[tuple[float, float, float]] = deque(maxlen=cap)

    def add(self, value: float, now: float, origin: float | None = None) -> None:
        self._items.append((now, value, now if origin is None else origin))

    def _trim(self, now: float) -> None:
        while self._items and self._items[0][0] < now - self.span:
            self._items.popleft()

    def count(self, now: float) -> int:
        self._trim(now)
        return len(self._items)

    def percentile(self, q: float, now: float, since: float = -math.inf) -> float:
        """The `q`-quantile (0..1) of the values in the window that began at or after `since`, by
        nearest rank; 0 when there are none."""
        self._trim(now)
        values = sorted(v for _, v, origin in self._items if origin >= since)
        if not values:
            return 0.0
        return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


@dataclass
class Latencies:
    """Observed TTFT and TPOT of one priority, in seconds."""

    ttft: Window
    tpot: Window

    @classmethod
    def over(cls, span: float) -> Latencies:
        return cls(Window(span), Window(span))


@dataclass
class Queued:
    """A request admitted and waiting for its first token, as the ladder counts it."""

    priority: Priority
    prompt_tokens: int
    worker: int  # where it was placed (or expected to be, before the router sends it)
    admitted_at: float


@dataclass
class Running:
    """A request past its first token: how long it may still run and how much KV it holds then."""

    remaining_tokens: int
    blocks: int


@dataclass
class WorkerLoad:
    """One serving worker as the ladder sees it: its measured step cost (from its status reports) and
    what the router has placed on it."""

    worker_id: int
    base_s: float  # a step's fixed cost
    decode_s: float  # ... and per decoding row (0: not measured yet)
    prefill_s: float  # ... and per prompt token computed
    kv_total: int
    kv_used: int
    running: list[Running] = field(default_factory=list)
    queued: list[Queued] = field(default_factory=list)

    @property
    def measured(self) -> bool:
        return self.decode_s > 0 and self.prefill_s > 0

    def alone(self) -> WorkerLoad:
        """This worker with nothing placed on it and its KV free: what a request would get there alone."""
        return dataclasses.replace(self, kv_used=0, running=[], queued=[])

    @property
    def kv_use(self) -> float:
        return self.kv_used / self.kv_total if self.kv_total else 0.0

    def decode_step_s(self, extra: int = 0) -> float:
        """Expected time of a step that decodes every running request (and `extra` more)."""
        return self.base_s + (len(self.running) + extra) * self.decode_s

    def tpot_s(self, prompt: int, output: int) -> float:
        """Expected time per output token of a new request of `prompt` and `output` tokens placed here, from
        what is known now: each step decodes every request running and queued here, and the prompts queued
        (its own included) are computed within its `output` steps. What arrives later is not known: the
        ladder corrects this by what finished requests measured (`Calibration`)."""
        n = len(self.running) + len(self.queued) + 1
        prefill = sum(q.prompt_tokens for q in self.queued) + prompt
        return self.base_s + n * self.decode_s + prefill * self.prefill_s / max(1, output)


# TTFT predictions shorter than this teach the calibration nothing: their error is mostly what no model
# of the queue sees (the step a request lands in, the router's own latency on a busy machine: measured
# 2-3x predictions of 30-100 ms at c = 32), and a factor learnt from them inflated the long predictions
# that admission refuses on (measured within ~1.2x of theirs) into refusing a burst served in time.
TTFT_LEARN_FROM_S = 0.2


class Calibration:
    """How far measurements are from a model's predictions: a running mean of log(measured / predicted),
    each observation weighing `rate`, the factor held within [`low`, `high`]. `trusted` once `min_samples`
    predictions were checked: before, a fresh server's first requests are judged on a step-cost line from
    its warm-up alone (measured on one thread by the zygote), which can be far off."""

    def __init__(
        self, rate: float = 0.05, low: float = 0.5, high: float = 4.0, min_samples: int = 8, floor: float = 0.0
    ) -> None:
        """`floor`: predictions below it are not learnt from (see TTFT_LEARN_FROM_S)."""
        self.rate, self.low, self.high, self.min_samples, self.floor = rate, low, high, min_samples, floor
        self._log = 0.0
        self.samples = 0

    @property
    def trusted(self) -> bool:
        return self.samples >= self.min_samples

    @property
    def factor(self) -> float:
        return min(self.high, max(self.low, math.exp(self._log)))

    @property
    def refusing_factor(self) -> float:
        """The factor a refusal is judged with: before the model is trusted, the most favourable one (a
        prediction refuses only if it misses even then), so a burst at a fresh server is still shed."""
        return self.factor if self.trusted else self.low

    def learn(self, predicted: float, measured: float) -> None:
        """`predicted`: the model's own figure (not multiplied by the factor)."""
        if predicted > 0 and predicted >= self.floor:
            self._log += self.rate * (math.log(max(measured, 1e-4) / predicted) - self._log)
            self.samples += 1


def predict_ttft(
    w: WorkerLoad,
    prompt_tokens: int,
    priority: Priority,
    sched: SchedulerConfig,
    block_size: int,
    step_target_ms: float = 0.0,
) -> float:
    """Seconds until a new request of `prompt_tokens` and `priority` placed on `w` gets its first token.

    The worker's scheduler serves waiting prompts by priority: those queued at this priority or above
    are computed first, in chunks that share each step with the running decodes (paced to
    `step_target_ms`, else `decode_step_target_ms`, while clients stream; at least `prefill_floor_tokens`;
    a high-priority prompt is not paced), after the step in progress (half done, on average). When the
    KV those prompts need is not free, the wait includes the decodes until enough running requests finish.
    0 while the worker's step cost is unknown (no prediction rather than a guess)."""
    if not w.measured:
        return 0.0
    ahead = [q for q in w.queued if q.priority <= priority]
    tokens = prompt_tokens + sum(q.prompt_tokens for q in ahead)
    # Beside the prefill decode the requests running now, joined by each prompt ahead once computed:
    # half of those, on average over the wait.
    decoding = len(w.running) + len(ahead) // 2
    decode_step = w.decode_step_s(len(ahead) // 2)
    chunk = sched.max_num_batched_tokens - decoding
    target = step_target_ms or sched.decode_step_target_ms
    if decoding and target > 0 and priority != Priority.HIGH:
        room = (target / 1000 - decode_step) / w.prefill_s
        chunk = min(chunk, int(room))
    chunk = max(chunk, sched.prefill_floor_tokens, 1)
    steps = math.ceil(tokens / chunk)
    wait = steps * (decode_step + min(chunk, tokens) * w.prefill_s)
    if w.running:
        wait += w.decode_step_s() / 2
    need = sum(-(-q.prompt_tokens // block_size) for q in ahead) + -(-prompt_tokens // block_size)
    short = need - (w.kv_total - w.kv_used) if w.kv_total else 0
    if short > 0:
        # KV comes free as running requests finish, those with the fewest tokens left first.
        left = 0
        for r in sorted(w.running, key=lambda r: r.remaining_tokens):
            short -= r.blocks
            left = r.remaining_tokens
            if short <= 0:
                break
        wait += left * w.decode_step_s()
    return wait
