"""Answers to an admitted request: an SSE stream whose event ids are resume points (`Last-Event-ID`),
or one JSON body once the request is done; a client that leaves aborts its request. A stream with
nothing to send for `server.sse_keepalive` gets a comment line (`: keep-alive`), so a request that
waits (queued, moved, a resume waiting its turn) keeps its connection through proxies that drop idle
ones; one with no output at all for the engine client's `idle_limit_s` ends with an error event."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from steadfast.control.fleet.client import EngineDeadError
from steadfast.control.fleet.resume import Resumption, UnknownRequestError
from steadfast.control.http.errors import APIError
from steadfast.control.http.logprobs import Entry, chat_logprobs, completion_logprobs
from steadfast.control.http.openai_models import ChatCompletionRequest, CompletionRequest
from steadfast.control.http.resume_token import body_digest, parse_event_id
from steadfast.control.http.serving import Generation, Prepared, ServingContext, error_output
from steadfast.wire.worker import FinishReason

_json = msgspec.json.Encoder()
KEEP_ALIVE = b": keep-alive\n\n"  # an SSE comment: clients ignore it, proxies see bytes flow
# On a response the degradation ladder touched: its level and what it changed (control/degrade.Notice).
DEGRADATION_HEADER = "X-Steadfast-Degradation"


def sse(data: dict[str, Any] | str, event_id: str = "") -> bytes:
    payload = data.encode() if isinstance(data, str) else _json.encode(data)
    head = f"id: {event_id}\n".encode() if event_id else b""
    return head + b"data: " + payload + b"\n\n"


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


async def until_disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect(gen: Generation, http: Request) -> tuple[str, list[int], list[Entry]] | None:
    """All of a non-streamed request's text, its token ids and their logprobs (where asked), or None if
    the client left first (request aborted)."""

    async def run() -> tuple[str, list[int], list[Entry]]:
        texts: list[str] = []
        ids: list[int] = []
        entries: list[Entry] = []
        async for out in gen.outputs():
            if out is None:
                continue
            if out.finish_reason == FinishReason.ERROR:
                raise error_output(out)
            texts.append(out.text)
            ids.extend(out.token_ids)
            entries.extend(zip(out.token_ids, out.logprobs or (), strict=False))
        return "".join(texts), ids, entries

    work = asyncio.ensure_future(run())
    gone = asyncio.ensure_future(until_disconnected(http))
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


async def respond(
    ctx: ServingContext,
    prepared: Prepared,
    body: CompletionRequest | ChatCompletionRequest,
    http: Request,
    streamer: Callable[[ServingContext, Generation], AsyncIterator[bytes]],
    obj: str,
    choice: Callable[[str, list[Entry] | None], dict[str, Any]],
    ignored: Sequence[str] = (),
) -> Response:
    """Run an admitted request: an SSE stream, or one JSON body once it is done. A stream request
    carrying `Last-Event-ID` continues the request that event belongs to instead of starting anew.
    `ignored`: its fields nobody documents, named in a response header."""
    stream = body.stream
    last_event = http.headers.get("last-event-id")
    if last_event and stream:
        prepared = reconnect(ctx, prepared, last_event, body_digest(body))
    gen = Generation(ctx, prepared)
    headers = ctx.ignored.header(ignored)
    if prepared.notice is not None:
        headers[DEGRADATION_HEADER] = prepared.notice.header()
    if stream:
        return StreamingResponse(streamer(ctx, gen), media_type="text/event-stream", headers=headers)
    result = await collect(gen, http)
    if result is None:
        return Response(status_code=499)  # the client left; its request was aborted
    text, ids, entries = result
    first = {**choice(text, entries if prepared.add.params.logprobs >= 0 else None), "finish_reason": gen.finish_reason}
    if prepared.return_token_ids:
        first["token_ids"] = ids
    body = {
        "id": prepared.request_id,
        "object": obj,
        "created": int(time.time()),
        "model": ctx.model_name,
        "choices": [first],
        "usage": usage(len(prepared.prompt_ids), gen.completion_tokens, gen.cached_tokens),
    }
    return JSONResponse(body, headers=headers)


def reconnect(ctx: ServingContext, prepared: Prepared, last_event: str, digest: bytes) -> Prepared:
    """The request a client continues with `Last-Event-ID`: only with the resume token of that request
    and the body it was sent with, and only within the idempotency window; refused before anything
    is sent or stopped otherwise. Nothing changes here: the stream takes the request over in its turn
    (`EngineClient.generate`), so concurrent resumes of one request each get a definite answer."""
    try:
        point = parse_event_id(last_event)
    except ValueError:
        raise APIError(
            f"Last-Event-ID {last_event!r} is not an id this server sent.",
            param="Last-Event-ID",
            code="invalid_last_event_id",
        ) from None
    if not ctx.signer.valid(point, digest):
        raise APIError(
            "Last-Event-ID does not belong to a request sent with this body: resume with the event id and the "
            "body of the original request.",
            403,
            type_="permission_error",
            param="Last-Event-ID",
            code="invalid_resume_token",
        )
    rid = point.request_id
    try:
        known = ctx.client.known(rid)
    except UnknownRequestError:
        raise APIError(
            f"Request {rid} is unknown here or older than the idempotency window; it cannot be resumed.",
            404,
            type_="not_found_error",
            param="Last-Event-ID",
            code="request_not_found",
        ) from None
    add = Resumption.request(known, point.have_tokens, point.have_chars)
    return Prepared(
        rid,
        add.prompt_ids,
        add,
        prepared.include_usage,
        prepared.return_token_ids,
        point.token,
        point.have_tokens,
        point.have_chars,
        resuming=known,
    )


async def stream(
    ctx: ServingContext, gen: Generation, obj: str, make_choice: Any, first: dict | None
) -> AsyncIterator[bytes]:
    p = gen.p
    created = int(time.time())

    # A request the ladder shortened says so in its first chunk (a resumed stream had it already).
    notice = {"degradation": p.notice.as_dict()} if p.notice is not None and not p.have_tokens else {}

    def chunk(choices: list[dict[str, Any]], event_id: str = "", **extra: Any) -> bytes:
        nonlocal notice
        extra, notice = {**notice, **extra}, {}
        return sse(
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

    outputs = gen.outputs(ctx.keepalive_s)
    asked = p.add.params.logprobs >= 0
    pending: list[Entry] = []  # logprobs of tokens whose text is not sent yet
    try:
        if first is not None and not p.have_tokens:
            yield chunk([{"index": 0, **first, "logprobs": None, "finish_reason": None}])
        async for out in outputs:
            if out is None:  # nothing for keepalive_s
                yield KEEP_ALIVE
                continue
            if out.finish_reason == FinishReason.ERROR:
                yield sse(error_output(out).body())
                break
            pending.extend(zip(out.token_ids, out.logprobs or (), strict=False))
            if out.text or out.finish_reason or (p.return_token_ids and out.token_ids):
                choice = make_choice(out.text, out.finish_reason, pending if asked else None)
                pending = []
                if p.return_token_ids:
                    choice["token_ids"] = out.token_ids
                # The event id says what the client holds after it (tokens, characters): a resume point.
                yield chunk([choice], resume_at(ctx, gen))
        if p.include_usage:
            yield chunk([], usage=usage(len(p.prompt_ids), gen.completion_tokens, gen.cached_tokens))
        yield sse("[DONE]")
    except EngineDeadError as exc:
        yield sse(APIError(str(exc), 503, type_="service_unavailable").body())
    finally:
        await outputs.aclose()


def resume_at(ctx: ServingContext, gen: Generation) -> str:
    p = gen.p
    return ctx.signer.event_id(p.request_id, p.resume_token, gen.completion_tokens, gen.text_chars)


def stream_completion(ctx: ServingContext, gen: Generation) -> AsyncIterator[bytes]:
    def choice(text: str, reason: str | None, entries: list[Entry] | None) -> dict[str, Any]:
        offset = gen.text_chars - len(text)
        lp = None if entries is None else completion_logprobs(ctx.names, entries, offset)
        return {"index": 0, "text": text, "logprobs": lp, "finish_reason": reason}

    return stream(ctx, gen, "text_completion", choice, None)


def stream_chat(ctx: ServingContext, gen: Generation) -> AsyncIterator[bytes]:
    def choice(text: str, reason: str | None, entries: list[Entry] | None) -> dict[str, Any]:
        lp = None if entries is None else chat_logprobs(ctx.names, entries)
        return {"index": 0, "delta": {"content": text} if text else {}, "logprobs": lp, "finish_reason": reason}

    return stream(ctx, gen, "chat.completion.chunk", choice, {"delta": {"role": "assistant", "content": ""}})
