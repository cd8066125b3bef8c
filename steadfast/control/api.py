"""The router's HTTP face: OpenAI-compatible routes, health, metrics and admin.

Every request is validated and tokenized here, before any worker sees it, so bad input costs no
engine time and gets a precise 4xx. A request that was accepted ends with its tokens or an error
the client can see; a client that goes away aborts its request on the worker.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from steadfast.control.engine_client import EngineClient, EngineDeadError, UnknownRequestError
from steadfast.control.errors import APIError, api_error_handler, http_error_handler, validation_error_handler
from steadfast.control.metrics import Metrics
from steadfast.control.openai_models import ChatCompletionRequest, CompletionRequest
from steadfast.model.tokenizer import GGUFTokenizer
from steadfast.protocol import PRIORITIES, AddRequest, RequestOutput, SamplingParams


@dataclass
class ServingContext:
    client: EngineClient
    tokenizer: GGUFTokenizer
    model_name: str
    max_model_len: int
    block_size: int
    metrics: Metrics
    created: int = 0


@dataclass
class Prepared:
    request_id: str
    prompt_ids: list[int]
    add: AddRequest
    include_usage: bool
    return_token_ids: bool = False
    # A reconnect (Last-Event-ID): the client holds this many tokens and characters of text already.
    have_tokens: int = 0
    have_chars: int = 0


def _prepare(
    ctx: ServingContext,
    body: CompletionRequest | ChatCompletionRequest,
    prompt_ids: list[int],
    max_tokens: int | None,
    prefix: str,
) -> Prepared:
    limit = ctx.max_model_len
    if len(prompt_ids) >= limit:
        raise APIError(
            f"This model's maximum context length is {limit} tokens, but your prompt has {len(prompt_ids)} tokens. "
            "Please shorten the prompt.",
            param="messages" if prefix == "chatcmpl" else "prompt",
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
    top_k = body.top_k if body.top_k and body.top_k > 0 else 0
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
    )
    rid = f"{prefix}-{uuid.uuid4().hex}"
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    add = AddRequest(rid, prompt_ids, params, PRIORITIES[body.priority])
    return Prepared(rid, prompt_ids, add, include_usage, body.return_token_ids)


def _check(ctx: ServingContext, body: CompletionRequest | ChatCompletionRequest) -> None:
    if body.model != ctx.model_name:
        raise APIError(
            f"The model '{body.model}' does not exist. This server serves '{ctx.model_name}'.",
            404,
            type_="not_found_error",
            param="model",
            code="model_not_found",
        )
    bad = body.unsupported()
    if bad:
        raise APIError(f"Unsupported parameter '{bad[0]}': {bad[1]}.", param=bad[0], code="unsupported_parameter")


_json = msgspec.json.Encoder()


def _sse(data: dict[str, Any] | str, event_id: str = "") -> bytes:
    payload = data.encode() if isinstance(data, str) else _json.encode(data)
    head = f"id: {event_id}\n".encode() if event_id else b""
    return head + b"data: " + payload + b"\n\n"


def _usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


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

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        m = self.ctx.metrics
        m.request_started()
        m.prompt_tokens.inc(len(self.p.prompt_ids))
        first = True
        try:
            async for out in self.ctx.client.generate(self.p.add, skip_until=self.p.have_tokens):
                now = time.perf_counter()
                if out.token_ids:
                    if first:
                        m.first_token(now - self.arrival)
                        first = False
                    else:
                        m.tpot.observe((now - self.last) / len(out.token_ids))
                    self.last = now
                    self.completion_tokens += len(out.token_ids)
                    self.text_chars += len(out.text)
                    self.cached_tokens = out.num_cached_tokens
                    m.tokens(len(out.token_ids))
                if out.finish_reason is not None:
                    self.finish_reason = out.finish_reason
                    m.requests.labels(out.finish_reason).inc()
                    m.e2e.observe(now - self.arrival)
                yield out
        finally:
            if first:
                m.request_ended_before_first_token()
            if self.finish_reason is None:
                m.requests.labels("abort").inc()


def _error_output(out: RequestOutput) -> APIError:
    return APIError(out.error or "the request failed in the engine", 500, type_="server_error", code="engine_error")


async def _until_disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _collect(gen: Generation, http: Request) -> tuple[str, list[int]] | None:
    """All of a non-streamed request's text, or None if the client left first (request aborted)."""

    async def run() -> tuple[str, list[int]]:
        texts, ids = [], []
        async for out in gen.outputs():
            if out.finish_reason == "error":
                raise _error_output(out)
            texts.append(out.text)
            ids.extend(out.token_ids)
        return "".join(texts), ids

    work = asyncio.ensure_future(run())
    gone = asyncio.ensure_future(_until_disconnected(http))
    done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    if work in done:
        gone.cancel()
        return work.result()
    work.cancel()
    try:
        await work
    except (asyncio.CancelledError, APIError):
        pass
    return None


async def _respond(
    ctx: ServingContext,
    prepared: Prepared,
    stream: bool,
    http: Request,
    streamer: Callable[[ServingContext, Generation], AsyncIterator[bytes]],
    obj: str,
    choice: Callable[[str], dict[str, Any]],
) -> Response:
    """Run an admitted request: an SSE stream, or one JSON body once it is done. A stream request
    carrying `Last-Event-ID` continues the request that event belongs to instead of starting anew."""
    last_event = http.headers.get("last-event-id")
    if last_event and stream:
        prepared = await _reconnect(ctx, prepared, last_event)
    gen = Generation(ctx, prepared)
    if stream:
        return StreamingResponse(streamer(ctx, gen), media_type="text/event-stream")
    result = await _collect(gen, http)
    if result is None:
        return Response(status_code=499)  # the client left; its request was aborted
    text, ids = result
    first = {**choice(text), "finish_reason": gen.finish_reason}
    if prepared.return_token_ids:
        first["token_ids"] = ids
    body = {
        "id": prepared.request_id,
        "object": obj,
        "created": int(time.time()),
        "model": ctx.model_name,
        "choices": [first],
        "usage": _usage(len(prepared.prompt_ids), gen.completion_tokens, gen.cached_tokens),
    }
    return JSONResponse(body)


async def _reconnect(ctx: ServingContext, prepared: Prepared, last_event: str) -> Prepared:
    try:
        rid, tokens, chars = last_event.rsplit(":", 2)
        have_tokens, have_chars = int(tokens), int(chars)
        if have_tokens < 0 or have_chars < 0:
            raise ValueError
    except ValueError:
        raise APIError(
            f"Last-Event-ID {last_event!r} is not an id this server sent ('<request id>:<tokens>:<chars>').",
            param="Last-Event-ID",
            code="invalid_last_event_id",
        ) from None
    try:
        add, skip = await ctx.client.resumption(rid, have_tokens, have_chars)
    except UnknownRequestError:
        raise APIError(
            f"Request {rid} is unknown here or older than the idempotency window; it cannot be resumed.",
            404,
            type_="not_found_error",
            param="Last-Event-ID",
            code="request_not_found",
        ) from None
    return Prepared(rid, add.prompt_ids, add, prepared.include_usage, prepared.return_token_ids, skip, have_chars)


def create_app(ctx: ServingContext) -> FastAPI:
    app = FastAPI(title="Steadfast", version="0.1.0")
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return APIError(
            str(exc), 503, type_="service_unavailable", code="no_worker", headers={"Retry-After": "1"}
        ).response()

    ctx.created = int(time.time())

    def ensure_ready() -> None:
        if not any(w.ready for w in ctx.client.workers):
            raise APIError(
                "No worker is ready to serve; retry shortly.",
                503,
                type_="service_unavailable",
                code="no_worker",
                headers={"Retry-After": "1"},
            )

    @app.get("/health")
    async def health() -> JSONResponse:
        workers = [{"id": w.worker_id, "ready": w.ready} for w in ctx.client.workers]
        ok = ctx.client.ready
        return JSONResponse(
            {"status": "ok" if ok else "unavailable", "workers": workers}, status_code=200 if ok else 503
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        m = ctx.metrics
        for w in ctx.client.workers:
            label = str(w.worker_id)
            m.worker_up.labels(label).set(1 if w.ready else 0)
            if w.status is not None:
                m.running.labels(label).set(w.status.num_running)
                m.waiting.labels(label).set(w.status.num_waiting)
                m.kv_used.labels(label).set(w.status.kv_blocks_used)
                m.kv_free.labels(label).set(w.status.kv_blocks_total - w.status.kv_blocks_used)
        return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/admin/workers")
    async def admin_workers() -> list[dict[str, Any]]:
        rows = []
        for w in ctx.client.workers:
            s = w.status
            rows.append(
                {
                    "id": w.worker_id,
                    "role": w.role,
                    "pid": s.pid if s else None,
                    "state": "dead" if w.dead else (s.state if s else "starting"),
                    "node": w.node,  # its kvpool's address: workers of one node hand KV over in place
                    "kv_blocks_used": s.kv_blocks_used if s else 0,
                    "kv_blocks_total": s.kv_blocks_total if s else 0,
                    "running": s.num_running if s else 0,
                    "waiting": s.num_waiting if s else 0,
                    "in_flight": w.load,
                    "prefix_hit_rate": s.prefix_hit_rate if s else 0.0,
                    "step_ms": s.step_ms if s else 0.0,
                    "step_tokens": s.step_tokens if s else 0.0,
                }
            )
        return rows

    @app.get("/admin/takeovers")
    async def admin_takeovers() -> list[dict[str, Any]]:
        """Requests moved off dead workers: from where to where, at which token, by which route, at what cost."""
        return [
            {
                "request_id": t.request_id,
                "from_worker": t.from_worker,
                "to_worker": t.to_worker,
                "at_token": t.at_token,
                "route": t.route,
                "adopted_tokens": t.adopted_tokens,
                "recomputed_tokens": t.recomputed_tokens,
                "first_token_ms": None if t.first_token_s is None else 1000 * t.first_token_s,
            }
            for t in ctx.client.takeovers
        ]

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": ctx.model_name,
                    "object": "model",
                    "created": ctx.created,
                    "owned_by": "steadfast",
                    "max_model_len": ctx.max_model_len,
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request) -> Response:
        _check(ctx, body)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(
                    "Only one prompt per request is supported.", param="prompt", code="unsupported_parameter"
                )
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise APIError("'prompt' must not be empty.", param="prompt")
            ids = ctx.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            if not ids:
                raise APIError("'prompt' must not be empty.", param="prompt")
            if any(t < 0 or t >= ctx.tokenizer.vocab_size for t in ids):
                raise APIError(f"Token ids in 'prompt' must be in [0, {ctx.tokenizer.vocab_size}).", param="prompt")
        ensure_ready()
        prepared = _prepare(ctx, body, ids, body.max_tokens, "cmpl")

        def choice(text: str) -> dict[str, Any]:
            return {"index": 0, "text": text, "logprobs": None}

        return await _respond(ctx, prepared, body.stream, http, _stream_completion, "text_completion", choice)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, http: Request) -> Response:
        _check(ctx, body)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            ids = ctx.tokenizer.encode_chat(messages)
        except Exception as exc:  # a template may raise on an order of roles it does not accept
            raise APIError(f"The chat template rejected these messages: {exc}", param="messages") from exc
        ensure_ready()
        prepared = _prepare(ctx, body, ids, body.token_limit, "chatcmpl")

        def choice(text: str) -> dict[str, Any]:
            return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None}

        return await _respond(ctx, prepared, body.stream, http, _stream_chat, "chat.completion", choice)

    return app


async def _stream(
    ctx: ServingContext, gen: Generation, obj: str, make_choice: Any, first: dict | None
) -> AsyncIterator[bytes]:
    p = gen.p
    created = int(time.time())

    def chunk(choices: list[dict[str, Any]], event_id: str = "", **extra: Any) -> bytes:
        return _sse(
            {
                "id": p.request_id,
                "object": obj,
                "created": created,
                "model": ctx.model_name,
                "choices": choices,
                **extra,
            },
            event_id,
        )

    outputs = gen.outputs()
    try:
        if first is not None and not p.have_tokens:
            yield chunk([{"index": 0, **first, "logprobs": None, "finish_reason": None}])
        async for out in outputs:
            if out.finish_reason == "error":
                yield _sse(_error_output(out).body())
                break
            if out.text or out.finish_reason or (p.return_token_ids and out.token_ids):
                choice = make_choice(out.text, out.finish_reason)
                if p.return_token_ids:
                    choice["token_ids"] = out.token_ids
                # The event id says what the client holds after it (tokens, characters): a resume point.
                yield chunk([choice], f"{p.request_id}:{gen.completion_tokens}:{gen.text_chars}")
        if p.include_usage:
            yield chunk([], usage=_usage(len(p.prompt_ids), gen.completion_tokens, gen.cached_tokens))
        yield _sse("[DONE]")
    except EngineDeadError as exc:
        yield _sse(APIError(str(exc), 503, type_="service_unavailable").body())
    finally:
        await outputs.aclose()


def _stream_completion(ctx: ServingContext, gen: Generation) -> AsyncIterator[bytes]:
    def choice(text: str, reason: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}

    return _stream(ctx, gen, "text_completion", choice, None)


def _stream_chat(ctx: ServingContext, gen: Generation) -> AsyncIterator[bytes]:
    def choice(text: str, reason: str | None) -> dict[str, Any]:
        return {"index": 0, "delta": {"content": text} if text else {}, "logprobs": None, "finish_reason": reason}

    return _stream(ctx, gen, "chat.completion.chunk", choice, {"delta": {"role": "assistant", "content": ""}})
