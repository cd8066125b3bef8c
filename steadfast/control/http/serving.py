"""Admission of one OpenAI request and the run of it: checks against the model and the workers' KV,
sampling parameters fixed (seed included) at admission, and a generation that keeps the request's
metrics while it runs. No HTTP routing here (api.py), no SSE framing (streams.py)."""

from __future__ import annotations

import asyncio
import functools
import random
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from steadfast.control.fleet.client import RESUMED_ELSEWHERE, EngineClient
from steadfast.control.fleet.resume import Known
from steadfast.control.http.errors import APIError, refusal_error
from steadfast.control.http.fields import IgnoredReport, unknown_fields
from steadfast.control.http.logprobs import TokenNames
from steadfast.control.http.metrics import Metrics
from steadfast.control.http.openai_models import ChatCompletionRequest, CompletionRequest
from steadfast.control.http.resume_token import ResumeSigner, body_digest
from steadfast.control.http.structured import Grammars
from steadfast.control.ladder.degrade import Degradation
from steadfast.control.ladder.plan import Notice, Plan, Refusal
from steadfast.model.tokenizer import GGUFTokenizer
from steadfast.wire.worker import PRIORITIES, AddRequest, Priority, RequestOutput, SamplingParams, TokenLogprob

# Below this a temperature divides logits into overflow: it is greedy (as vLLM's sampling epsilon).
GREEDY_BELOW = 1e-5
T = TypeVar("T")


@dataclass(frozen=True)
class Limits:
    max_messages: int = 1024
    max_prompt_chars: int = 1_000_000
    max_pending_requests: int = 1024
    max_n: int = 8  # choices per request


@dataclass
class ServingContext:
    client: EngineClient
    tokenizer: GGUFTokenizer
    model_name: str
    max_model_len: int
    block_size: int
    metrics: Metrics
    created: int = 0
    signer: ResumeSigner = field(default_factory=ResumeSigner)
    limits: Limits = field(default_factory=Limits)
    degradation: Degradation | None = (
        None  # the ladder (control/ladder/degrade.py); None: no ladder (a bare router in tests)
    )
    # Tokenizing and template rendering run here, never on the event loop that writes every stream.
    tokenize_pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(2, "tokenize"))
    keepalive_s: float = 10.0  # an SSE stream with nothing to send this long gets a comment (server.sse_keepalive)
    ignored: IgnoredReport = field(default_factory=IgnoredReport)

    @functools.cached_property
    def names(self) -> TokenNames:
        return TokenNames(self.tokenizer)

    @functools.cached_property
    def grammars(self) -> Grammars:
        return Grammars(self.tokenizer)

    @functools.cached_property
    def message_tokens(self) -> int:
        """The fewest tokens the chat template spends on one more (empty) message: 0 if it can spend none."""
        encode = self.tokenizer.encode_chat
        costs = []
        for role in ("user", "assistant"):
            one = {"role": role, "content": ""}
            costs.append(len(encode([one, one])) - len(encode([one])))
        return max(0, min(costs))

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, fn, *args)

    def check_pending(self) -> None:
        """429 when as many requests as the limit are admitted and not finished."""
        limit = self.limits.max_pending_requests
        if self.client.pending >= limit:
            raise APIError(
                f"The server has {limit} requests pending, its limit; retry shortly.",
                429,
                type_="rate_limit_error",
                code="too_many_requests",
                headers={"Retry-After": "1"},
            )


@dataclass
class Prepared:
    request_id: str
    prompt_ids: list[int]
    add: AddRequest
    include_usage: bool
    return_token_ids: bool = False
    resume_token: str = ""  # the secret in this request's event ids (resume_token.py)
    # A reconnect (Last-Event-ID): the client holds this many tokens and characters of text already.
    have_tokens: int = 0
    have_chars: int = 0
    notice: Notice | None = None  # shortened by the degradation ladder: what the client is told
    resuming: Known | None = None  # a reconnect: what the router knew of the request when it asked
    choice: int = 0  # which of the request's `n` choices (choices.py)
    prompt_logprobs: list[TokenLogprob] | None = None  # the prompt's, from its first output, where asked


# Shortens a prompt to a token cap: its ids and how many chat messages were dropped (truncate.py).
Cutter = Callable[[int], Awaitable[tuple[list[int], int]]]


async def admit(
    ctx: ServingContext,
    body: CompletionRequest | ChatCompletionRequest,
    prompt_ids: list[int],
    max_tokens: int | None,
    prefix: str,
    cut: Cutter,
    resuming: bool = False,
    request_id: str = "",
) -> Prepared:
    """A new request through the degradation ladder (refused with 429/503, or shortened at L4), then
    prepared. The ladder counts it as queued from here until its first token or its end. A client
    resuming its stream (`resuming`: Last-Event-ID) continues a request accepted before: never refused."""
    rid = request_id or f"{prefix}-{uuid.uuid4().hex}"
    grammar = await ctx.grammars.of(body, ctx.off_loop)
    prepared = prepare(ctx, body, prompt_ids, max_tokens, rid, grammar)  # bad input: a 400 before the ladder
    ladder = ctx.degradation
    if ladder is not None and not resuming:
        tokens = prepared.add.params.max_tokens * body.runs  # (every run decodes its own: best_of's too)
        plan = ladder.plan(rid, Priority[body.priority.upper()], prompt_ids, tokens)
        if isinstance(plan, Refusal):
            raise refusal_error(plan)
        if plan.level:
            try:
                prepared = await shorten(ctx, body, prompt_ids, max_tokens, cut, plan, prepared)
            except BaseException:
                ladder.ended(rid)
                raise
    # Signed once admitted: a refused request's body is never digested (4-5 % of a refusal's router samples).
    prepared.resume_token = ctx.signer.token(rid, body_digest(body))
    return prepared


async def shorten(
    ctx: ServingContext,
    body: CompletionRequest | ChatCompletionRequest,
    prompt_ids: list[int],
    max_tokens: int | None,
    cut: Cutter,
    plan: Plan,
    prepared: Prepared,
) -> Prepared:
    """Admitted at a level of the ladder (`plan.level` > 0): the prompt and max_tokens cut to its caps,
    and the notice the client is told."""
    notice = Notice(int(plan.level))
    if plan.context_cap and len(prompt_ids) > plan.context_cap:
        before = len(prompt_ids)
        prompt_ids, notice.dropped_messages = await cut(plan.context_cap)
        notice.truncated_tokens = before - len(prompt_ids)
    if plan.max_tokens_cap and (max_tokens is None or max_tokens > plan.max_tokens_cap):
        max_tokens = notice.max_tokens = plan.max_tokens_cap
    if notice.truncated_tokens or notice.max_tokens:
        prepared = prepare(ctx, body, prompt_ids, max_tokens, prepared.request_id, prepared.add.params.grammar)
    prepared.notice = notice
    return prepared


def prepare(
    ctx: ServingContext,
    body: CompletionRequest | ChatCompletionRequest,
    prompt_ids: list[int],
    max_tokens: int | None,
    rid: str,
    grammar: str = "",
) -> Prepared:
    limit = ctx.max_model_len
    if len(prompt_ids) >= limit:
        raise APIError(
            f"This model's maximum context length is {limit} tokens, but your prompt has {len(prompt_ids)} tokens. "
            "Please shorten the prompt.",
            param="messages" if rid.startswith("chatcmpl") else "prompt",
            code="context_length_exceeded",
        )
    room = limit - len(prompt_ids)
    if max_tokens is None:
        max_tokens = room
    elif max_tokens > room:
        raise APIError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the prompt, {max_tokens} for the "
            "completion). Please reduce the prompt or max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    capacity = min(
        (w.status.kv_blocks_total for w in ctx.client.workers if w.status and w.status.kv_blocks_total), default=0
    )
    needed = -(-(len(prompt_ids) + max_tokens) // ctx.block_size)
    if capacity and needed > capacity:
        raise APIError(
            f"The request needs {needed} KV blocks ({len(prompt_ids) + max_tokens} tokens) but a worker holds only "
            f"{capacity}. Reduce max_tokens or the prompt.",
            param="max_tokens",
            code="kv_capacity_exceeded",
        )
    temperature = 1.0 if body.temperature is None else float(body.temperature)
    if temperature < GREEDY_BELOW:
        temperature = 0.0
    vocab = ctx.tokenizer.vocab_size
    bad_stop = next((t for t in body.stop_token_ids or () if t >= vocab), None)
    if bad_stop is not None:
        raise APIError(f"Token id {bad_stop} in 'stop_token_ids' is not in [0, {vocab}).", param="stop_token_ids")
    try:
        bias = body.bias(vocab)
    except ValueError as exc:
        raise APIError(f"{exc}.", param="logit_bias") from exc
    # top_k of the vocabulary or more keeps every token: no filter at all.
    top_k = body.top_k if body.top_k and 0 < body.top_k < vocab else 0
    seed = body.seed if body.seed is not None else random.getrandbits(63)  # fixed at admission, kept with it
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=1.0 if body.top_p is None else float(body.top_p),
        top_k=top_k,
        seed=seed & ((1 << 63) - 1),
        stop=body.stop_list,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        speculative=body.speculative,
        presence_penalty=float(body.presence_penalty or 0.0),
        frequency_penalty=float(body.frequency_penalty or 0.0),
        repetition_penalty=1.0 if body.repetition_penalty is None else float(body.repetition_penalty),
        min_p=float(body.min_p or 0.0),
        min_tokens=min(body.min_tokens or 0, max_tokens),  # (the ladder's L4 cap may be under it)
        logit_bias=bias,
        logprobs=body.logprob_count,
        grammar=grammar,
        prompt_logprobs=body.prompt_logprob_count,
        processed_logprobs=body.logprobs_mode == "processed_logprobs",
    )
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    add = AddRequest(rid, prompt_ids, params, PRIORITIES[body.priority])
    return Prepared(rid, prompt_ids, add, include_usage, body.return_token_ids)


def check_model_name(ctx: ServingContext, name: str | None) -> None:
    """A 404 for a model this server does not serve (None: not named, this one)."""
    if name is not None and name != ctx.model_name:
        raise APIError(
            f"The model '{name[:256]}' does not exist. This server serves '{ctx.model_name}'.",
            404,
            type_="not_found_error",
            param="model",
            code="model_not_found",
        )


def check_model(ctx: ServingContext, body: CompletionRequest | ChatCompletionRequest) -> list[str]:
    """A 404 for another model, a 400 for a field asking for what is not served; the fields nobody
    documents (ignored, reported in the response)."""
    check_model_name(ctx, body.model)
    if body.n > ctx.limits.max_n:
        raise APIError(f"'n' is {body.n}; this server allows at most {ctx.limits.max_n} choices.", param="n")
    bad = body.unsupported()
    if bad:
        raise APIError(f"Unsupported parameter '{bad[0]}': {bad[1]}.", param=bad[0], code="unsupported_parameter")
    if isinstance(body, ChatCompletionRequest) and body.top_logprobs is not None and not body.logprobs:
        raise APIError("top_logprobs needs logprobs set to true.", param="top_logprobs")
    limit = body.token_limit if isinstance(body, ChatCompletionRequest) else body.max_tokens
    if body.min_tokens and limit is not None and body.min_tokens > limit:
        raise APIError(f"min_tokens ({body.min_tokens}) must not exceed max_tokens ({limit}).", param="min_tokens")
    return unknown_fields(body, isinstance(body, ChatCompletionRequest))


class Generation:
    """Runs one request against the workers and keeps the metrics of its life."""

    def __init__(self, ctx: ServingContext, prepared: Prepared) -> None:
        self.ctx = ctx
        self.p = prepared
        self.arrival = time.perf_counter()
        self.last = self.arrival
        self.completion_tokens = prepared.have_tokens
        self.text_chars = prepared.have_chars
        self.cached_tokens = 0
        self.finish_reason: str | None = None
        self.first_at = 0.0  # when its first token (of this connection) came

    async def outputs(self, quiet_s: float | None = None) -> AsyncIterator[RequestOutput | None]:
        """The request's outputs; a None each time `quiet_s` passes without one (a stream's keep-alive)."""
        m = self.ctx.metrics
        ladder = self.ctx.degradation
        priority = Priority(self.p.add.priority)
        m.request_started()
        m.prompt_tokens.inc(len(self.p.prompt_ids))
        first = True
        try:
            async for out in self.ctx.client.generate(self.p.add, self.p.have_tokens, quiet_s, self.p.resuming):
                if out is None:
                    yield out
                    continue
                now = time.perf_counter()
                if out.token_ids:
                    if first:
                        m.first_token(now - self.arrival)
                        self.first_at = now
                        if ladder is not None and not self.p.have_tokens:
                            ladder.first_token(self.p.request_id, priority, now - self.arrival)
                        first = False
                    else:
                        m.tpot.observe((now - self.last) / len(out.token_ids))
                    self.last = now
                    self.completion_tokens += len(out.token_ids)
                    self.text_chars += len(out.text)
                    self.cached_tokens = out.num_cached_tokens
                    m.tokens(len(out.token_ids))
                if out.prompt_logprobs is not None:
                    self.p.prompt_logprobs = out.prompt_logprobs
                if out.finish_reason is not None:
                    self.finish_reason = out.finish_reason
                    if ladder is not None and self.first_at and self.completion_tokens > self.p.have_tokens + 1:
                        decoded = self.completion_tokens - self.p.have_tokens - 1
                        ladder.finished(self.p.request_id, priority, (now - self.first_at) / decoded, decoded)
                    m.requests.labels(out.finish_reason).inc()
                    m.e2e.observe(now - self.arrival)
                yield out
        finally:
            if ladder is not None:
                ladder.ended(self.p.request_id)
            if first:
                m.request_ended_before_first_token()
            if self.finish_reason is None:
                m.requests.labels("abort").inc()


def error_output(out: RequestOutput) -> APIError:
    if out.error == RESUMED_ELSEWHERE:
        return APIError(out.error, 409, type_="conflict_error", code="resumed_elsewhere")
    return APIError(out.error or "the request failed in the engine", 500, type_="server_error", code="engine_error")
