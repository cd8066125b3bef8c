"""Messages between the router and workers, and the supervisor's notices to the router: msgspec structs,
tagged, array-like; no pickle on the wire.

Router → worker: AddRequest, AbortRequest, Promote, Migrate, DestinationLost, Retire, Degrade. Worker → router:
StepOutputs, WorkerStatus. Supervisor → router (on the same socket as workers' outputs): WorkerDied, WorkerJoined.
"""

from __future__ import annotations

import enum

import msgspec


class Priority(enum.IntEnum):
    """A request's priority; lower values are served (and protected) first."""

    HIGH = 0
    NORMAL = 1
    LOW = 2

    @property
    def label(self) -> str:
        return self.name.lower()


PRIORITIES = {p.label: int(p) for p in Priority}


class WorkerRole(enum.StrEnum):
    MIXED = "mixed"  # serves a request start to end
    PREFILL = "prefill"  # computes prompts and hands their KV to a decode worker
    DECODE = "decode"  # continues requests whose prompt a prefill worker computed
    STANDBY = "standby"  # loaded and idle: takes over a dead worker's requests, or its role


class WorkerState(enum.StrEnum):
    LOADING = "loading"
    READY = "ready"
    STOPPING = "stopping"


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class Route(enum.StrEnum):
    """How a request came to a worker that did not start it, reported with its first output there."""

    NONE = ""
    LEDGER_FIRST = "ledger_first"  # a dead worker's sealed blocks adopted, the tail recomputed
    REBUILD = "rebuild"  # prompt and delivered tokens computed again
    HANDOFF = "handoff"  # KV handed over in the ledger by a prefill worker of this node
    TRANSFER = "transfer"  # KV streamed from a prefill worker of another node
    MIGRATED = "migrated"  # a running request moved here from another worker, with its KV


class Fallback(enum.StrEnum):
    """What follows a KV transfer that failed on every path."""

    NONE = ""
    RECOMPUTE = "recompute"  # the decode worker computes the prompt itself
    ERROR = "error"  # the request ends with an error (transfer.recompute is off)


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    speculative: bool = True  # may verify draft tokens, where its worker speculates (same output either way)
    # Appended (array_like: an older checkpoint's shorter array decodes with these neutral defaults).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # >1: tokens of the prompt or output less likely (vLLM's)
    min_p: float = 0.0
    min_tokens: int = 0  # no EOS, stop id or stop string before this many output tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    logprobs: int = -1  # -1: none; else each token's logprob and this many likeliest alternatives (≤ 20)
    grammar: str = ""  # structured outputs: llguidance's grammar (model/grammar.py) every token must follow
    # -1: none; else each prompt token's logprob (the first's excepted) and this many alternatives, sent
    # with the first output (OpenAI's `echo` with `logprobs`)
    prompt_logprobs: int = -1
    # Logprobs of the distribution the token is drawn from (after penalties, bias, the grammar, temperature,
    # top-k/top-p/min-p), not the model's raw one: vLLM's `processed_logprobs`
    processed_logprobs: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def adjusts(self) -> bool:
        """Its logits change before sampling (penalties, bias, min_tokens): rows without stay untouched."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.min_tokens
            or self.logit_bias
        )


class Resume(msgspec.Struct, array_like=True):
    """Continue a request from known output tokens: those of a dead worker's request, or of a client
    reconnecting with Last-Event-ID. `text_chars`: characters of text the client already holds (it may
    hold more than `output_ids` spell when they come from an older checkpoint: the new owner then
    regenerates the rest, and its text is not sent again)."""

    output_ids: list[int]
    text_chars: int
    from_worker: int = -1


class Handoff(msgspec.Struct, array_like=True, omit_defaults=True):
    """A request's KV handed from a prefill worker to a decode worker of the same node: the arena
    blocks (now the decode worker's in the ledger, zero copy) holding the first `num_computed`
    tokens, and which of them are sealed. `error` instead: why nothing was handed (the prefill
    worker then decodes the request itself)."""

    to_worker: int
    block_ids: list[int] = []
    sealed: list[int] = []
    num_computed: int = 0
    error: str = ""
    copied: int = 0  # blocks copied because another request of the prefill worker shares them
    seconds: float = 0.0  # the prefill worker's time to hand over (copies, one ledger transaction)
    # Across nodes: the path that delivered the KV ("primary", "alternate"; "same_node" on one node),
    # resends and paths given up, bytes on the wire. A failed transfer says `fallback: recompute`
    # (the decode worker computes the prompt itself) or `error` (the chain ends: the request fails).
    path: str = ""
    retries: int = 0
    fallbacks: int = 0
    bytes: int = 0
    fallback: Fallback = Fallback.NONE
    stream_seconds: float = 0.0  # first chunk sent → acknowledged (layer-wise: paced by the prefill)
    # A live migration's (the router's Migrate): its move name; empty for a prefill → decode handoff.
    migration: str = ""
    paused_at: float = 0.0  # CLOCK_MONOTONIC when the request last ran at the source (its downtime starts)
    stages: int = 0  # copy stages sent while the request kept running (across nodes)


class AddRequest(msgspec.Struct, tag="add", array_like=True, omit_defaults=True):
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int = 1
    resume: Resume | None = None
    # To a prefill worker: once the prompt is computed and the first token sampled, hand the KV to
    # this decode worker. To a decode worker: the KV handed to it (with `resume` = the first token).
    decode_worker: int = -1
    handoff: Handoff | None = None
    # The decode worker is on another node: stream the KV to these receiver addresses (primary, then
    # alternates) instead of handing blocks over in the ledger.
    kv_paths: list[str] = []


class AbortRequest(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class Migrate(msgspec.Struct, tag="migrate", array_like=True, omit_defaults=True):
    """Move this running request, with its KV, to `to_worker`. On its node the blocks change owner in
    the ledger; with `kv_paths` (the destination's receiver, another node) they are copied in stages
    while it keeps decoding, then it pauses for the last copy. The answer is an output whose `handoff`
    names the migration: where the KV went, or why it stayed (the request then goes on here)."""

    request_id: str
    to_worker: int
    move: str  # the move's name, unique per migration: its decision is recorded once
    kv_paths: list[str] = []
    max_stages: int = 4
    final_stage_blocks: int = 2
    timeout_s: float = 10.0  # not committed by then: given up, and it runs on here


class DestinationLost(msgspec.Struct, tag="lost", array_like=True):
    """Worker `worker_id` died: every move of ours to it (a prefill's KV transfer, a live migration) is
    given up now, not after its session's retries (2 + 4 + 8 + 16 s a path at the default timeout). A
    transfer then fails to its fallback (recomputed elsewhere), a migration's request runs on here."""

    worker_id: int


class Retire(msgspec.Struct, tag="retire", array_like=True):
    """The worker's requests were moved away (a drain): exit once none is left, with code 0, which the
    supervisor takes as a planned stop (it starts no replacement)."""

    reason: str = ""


class Degrade(msgspec.Struct, tag="degrade", array_like=True, omit_defaults=True):
    """The degradation ladder's orders for running work (router → every worker, on each change).
    `speculate_below`: requests of a priority below this value may verify drafts (3: all, 0: none).
    `offload_from`: with an offload tier, running requests of this priority or lower (a larger value)
    are swapped out while the worker's KV use is above `kv_target`, and not admitted back above it
    (3: nobody). `step_target_ms`: while clients stream, prefill chunks are cut so a step takes at most
    this long (0: the worker's own `scheduler.decode_step_target_ms`)."""

    level: int = 0
    speculate_below: int = 3
    offload_from: int = 3
    kv_target: float = 1.0
    step_target_ms: float = 0.0


class Ping(msgspec.Struct, tag="ping", array_like=True):
    """The router's second probe of a worker whose reports stopped: answered with a status report
    carrying `nonce` as soon as the worker's loop runs."""

    nonce: int


class Promote(msgspec.Struct, tag="promote", array_like=True):
    """A standby now takes traffic: it reports the new role, so a restarted router knows it too."""

    role: WorkerRole = WorkerRole.MIXED


class TokenLogprob(msgspec.Struct, array_like=True, omit_defaults=True):
    """One output token's log-probability under the model (its raw log-softmax) and the likeliest
    alternatives', as many as the request asked for."""

    logprob: float
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class RequestOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    token_ids: list[int]
    text: str = ""
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    index: int = 0  # position in the request's output of this output's first token
    # On a taken-over request's first output: how it was recovered and what that cost.
    route: Route = Route.NONE
    adopted_tokens: int = 0  # tokens whose KV was adopted from the dead worker's sealed blocks
    recomputed_tokens: int = 0  # tokens whose KV had to be computed again
    handoff: Handoff | None = None  # from a prefill worker, with the first token: where the KV went
    resumed_at: float = 0.0  # a migrated request's first output: CLOCK_MONOTONIC of the step it ran in
    # An error of this worker's computing, not of the request (an engine error, non-finite logits): the
    # router retries the request once on another worker instead of failing it.
    retryable: bool = False
    logprobs: list[TokenLogprob] | None = None  # one per token of `token_ids`, where the request asked
    prompt_logprobs: list[TokenLogprob] | None = None  # (first output) the prompt's tokens after its first


class StepOutputs(msgspec.Struct, tag="out", array_like=True):
    worker_id: int
    outputs: list[RequestOutput]
    # The worker's CLOCK_MONOTONIC when its step ended (0: not stamped): the health check's token gaps
    # are the worker's own, free of the router's scheduling delays.
    at: float = 0.0


class WorkerStatus(msgspec.Struct, tag="status", array_like=True, omit_defaults=True):
    worker_id: int
    pid: int
    role: WorkerRole
    state: WorkerState
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    num_running: int = 0
    num_waiting: int = 0
    prefix_hit_rate: float = 0.0
    step_ms: float = 0.0  # mean engine step time since the last report
    step_tokens: float = 0.0  # mean tokens computed per step since the last report
    node: str = ""  # which node's KV pool the worker uses: workers of one node hand KV over in place
    kv_addresses: list[str] = []  # where this worker receives KV from other nodes (primary, alternates)
    kv_blocks_incoming: int = 0  # held by its receiver for moves not yet claimed (reserved or committed)
    # Speculative decoding since the worker started: draft tokens verified, accepted; output tokens per
    # decoding request-step (1.0 without speculation).
    spec_drafted: int = 0
    spec_accepted: int = 0
    tokens_per_step: float = 0.0
    # The offload tier and preemption since the worker started: blocks held in the tier now, written
    # out, fetched back; preemptions that swapped KV out or left it to be recomputed; tokens recomputed.
    kv_blocks_offloaded: int = 0
    offload_written: int = 0
    offload_fetched: int = 0
    swap_preemptions: int = 0
    recompute_preemptions: int = 0
    recomputed_tokens: int = 0
    # The KV wire's receiver since the worker started: messages dropped by why (`kv/moves/checks.Drop`:
    # junk, out of its session, unsealed on the data channel...) and moves refused by why (busy, no_room).
    kv_wire_dropped: dict[str, int] = {}
    kv_wire_refused: dict[str, int] = {}
    # Blocks of the node's arena that have memory, as the pool last told this worker (`cache.kv_ahead_mb`:
    # it grows with use); equal to kv_blocks_total where the arena is made whole.
    kv_blocks_made: int = 0
    # What a step costs on this worker, as its scheduler estimates it (`worker/core/step_cost.py`): base +
    # per decoding row + per prefill token, in ms (0: not known yet). What paces prefill beside decodes.
    step_base_ms: float = 0.0
    step_decode_ms: float = 0.0
    step_prefill_ms: float = 0.0
    # The degradation ladder's orders the worker follows (level), and running requests it swapped out
    # to the offload tier for them (L3) since it started.
    degradation_level: int = 0
    ladder_swaps: int = 0
    # Health (control/fleet/health.py): resident memory; KV moves' messages sent and sent again, and sessions
    # that timed out, since the worker started; the last `Ping` nonce answered.
    rss_mb: float = 0.0
    kv_messages_sent: int = 0
    kv_resends: int = 0
    kv_move_timeouts: int = 0
    probe: int = 0
    threads: int = 0  # threads it computes with now (worker/threads.py)


class CacheEvents(msgspec.Struct, tag="cache", array_like=True, omit_defaults=True):
    """Chained block names that entered (`stored`) or left (`removed`) a worker's prefix cache since
    its last CacheEvents; `reset`: `stored` is the whole set (the router drops what it knew first).
    What the router's KV-aware routing indexes."""

    worker_id: int
    stored: list[bytes] = []
    removed: list[bytes] = []
    reset: bool = False


class WorkerDied(msgspec.Struct, tag="died", array_like=True):
    """From the supervisor: this worker's process is gone (reaped) and its lease fenced."""

    worker_id: int
    pid: int
    exit_code: int


class WorkerJoined(msgspec.Struct, tag="joined", array_like=True):
    """From the supervisor: a new worker process listens at `address`."""

    worker_id: int
    address: str
    role: WorkerRole
    like: int = -1  # the worker it replaces in a rollout (StartWorker), else -1


class StartWorker(msgspec.Struct, tag="start", array_like=True):
    """Router → supervisor (a rollout): start a new worker like worker `like` (its role and node). The
    supervisor answers on the router's output socket with WorkerJoined (`like` set)."""

    like: int


ToSupervisor = StartWorker
_to_supervisor = msgspec.msgpack.Decoder(ToSupervisor)


def decode_to_supervisor(data: bytes) -> StartWorker:
    return _to_supervisor.decode(data)


ToWorker = AddRequest | AbortRequest | Promote | Migrate | DestinationLost | Retire | Degrade | Ping
FromWorker = StepOutputs | WorkerStatus | WorkerDied | WorkerJoined | CacheEvents

_to_worker = msgspec.msgpack.Decoder(ToWorker)
_from_worker = msgspec.msgpack.Decoder(FromWorker)


def decode_to_worker(data: bytes) -> ToWorker:
    return _to_worker.decode(data)


def decode_from_worker(data: bytes) -> FromWorker:
    return _from_worker.decode(data)
