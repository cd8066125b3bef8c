"""Answers to an admitted request: an SSE stream whose event ids are resume points (`Last-Event-ID`),
or one JSON body once the request is done; a client that leaves aborts its request. A stream with
nothing to send for `server.sse_keepalive` gets a comment line (`: keep-alive`), so a request that
waits (queued, moved, a resume waiting its turn) keeps its connection through proxies that drop idle
ones; one with no output at all for the engine client's `idle_limit_s` ends with an error event."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from steadfast.control.fleet.client import EngineDeadError
from steadfast.control.fleet.resume import Resumption, UnknownRequestError
from steadfast.control.http.choices import choice_id, fan_out, merged
from steadfast.control.http.errors import APIError
from steadfast.control.http.logprobs import Entry, chat_logprobs, completion_logprobs, joined
from steadfast.control.http.openai_models import ChatCompletionRequest, CompletionRequest
from steadfast.control.http.resume_token import Held, ResumeSigner, body_digest, parse_event_id
from steadfast.control.http.serving import Generation, Prepared, ServingContext, error_output
from steadfast.control.http.tools import ToolReader
from steadfast.wire.worker import FinishReason, RequestOutput

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


@dataclass
class Choices:
    """What one response serves: the generation of each choice still running and, on a resume, what the
    client already holds of the choices that ended; `request_id` the request's (its choice 0's)."""

    request_id: str
    resume_token: str
    n: int
    gens: list[Generation]
    ended: dict[int, Held] = field(default_factory=dict)
    prompt_tokens: int = 0  # every prompt's, each once (a list of prompts: each its own)
    echo_only: bool = False  # max_tokens 0: the token each choice sampled is dropped, not counted

    def __post_init__(self) -> None:
        # What the client holds of each choice, counted as outputs are sent (the generations run ahead).
        self.sent = [self.ended.get(i, Held(0, 0)) for i in range(self.n)]
        for g in self.gens:
            self.sent[g.p.choice] = Held(g.p.have_tokens, g.p.have_chars)

    def took(self, choice: int, out: RequestOutput) -> int:
        """Count an output of `choice` as sent; the characters the client held before it."""
        held = self.sent[choice]
        self.sent[choice] = Held(held.tokens + len(out.token_ids), held.chars + len(out.text), bool(out.finish_reason))
        return held.chars

    def event_id(self, signer: ResumeSigner) -> str:
        """The resume point after the event it is sent with: what the client holds of each choice."""
        if self.n == 1:
            held = self.sent[0]
            return signer.event_id(self.request_id, self.resume_token, held.tokens, held.chars)
        return signer.choices_event_id(self.request_id, self.resume_token, self.sent)

    @property
    def completion_tokens(self) -> int:
        if self.echo_only:
            return 0
        done = {g.p.choice: g.completion_tokens for g in self.gens}
        return sum(done.get(i, h.tokens) for i, h in enumerate(self.sent))


async def collect(gens: list[Generation], http: Request) -> list[tuple[str, list[int], list[Entry]]] | None:
    """Each choice's text, token ids and their logprobs (where asked), or None if the client left first
    (its requests aborted)."""

    async def run() -> list[tuple[str, list[int], list[Entry]]]:
        texts: list[list[str]] = [[] for _ in gens]
        ids: list[list[int]] = [[] for _ in gens]
        entries: list[list[Entry]] = [[] for _ in gens]
        async for item in merged(gens, None):
            if item is None:
                continue
            i, out = item
            if out.finish_reason == FinishReason.ERROR:
                raise error_output(out)
            texts[i].append(out.text)
            ids[i].extend(out.token_ids)
            entries[i].extend(zip(out.token_ids, out.logprobs or (), strict=False))
        return ["".join(t) for t in texts], ids, entries  # type: ignore[return-value]

    work = asyncio.ensure_future(run())
    gone = asyncio.ensure_future(until_disconnected(http))
    done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    if work in done:
        gone.cancel()
        texts, ids, entries = work.result()
        return list(zip(texts, ids, entries, strict=True))
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
    streamer: Callable[[ServingContext, Choices], AsyncIterator[bytes]],
    obj: str,
    choice: Callable[[int, str, list[Entry] | None, str | None], dict[str, Any]],
    ignored: Sequence[str] = (),
    fanned: Sequence[Prepared] = (),
    best_of: int = 0,
    echo_only: bool = False,
) -> Response:
    """Run an admitted request (each of its choices: `fanned`, else its `n` of `prepared`): an SSE
    stream, or one JSON body once it is done. A stream request carrying `Last-Event-ID` continues the
    request that event belongs to instead of starting anew. `ignored`: its fields nobody documents, named
    in a response header. `best_of` (not streamed): each run of that many choices answered by its `n` of
    highest likelihood."""
    stream = body.stream
    fanned = list(fanned) or fan_out(prepared, body.n)
    prompt_tokens = sum(len(c.prompt_ids) for c in fanned if c.choice % (best_of or body.n) == 0)
    last_event = http.headers.get("last-event-id")
    if last_event and stream:
        served = reconnect(ctx, prepared, len(fanned), last_event, body_digest(body))
    else:
        gens = [Generation(ctx, c) for c in fanned]
        served = Choices(prepared.request_id, prepared.resume_token, len(fanned), gens)
    served.prompt_tokens, served.echo_only = prompt_tokens, echo_only
    headers = ctx.ignored.header(ignored)
    if prepared.notice is not None:
        headers[DEGRADATION_HEADER] = prepared.notice.header()
    if stream:
        return StreamingResponse(streamer(ctx, served), media_type="text/event-stream", headers=headers)
    results = await collect(served.gens, http)
    if results is None:
        return Response(status_code=499)  # the client left; its requests were aborted
    asked = body.logprob_count >= 0
    rows = list(zip(served.gens, results, strict=True))
    if best_of:
        rows = best(rows, best_of, body.n)
    choices = []
    for index, (g, (text, ids, entries)) in enumerate(rows):
        one = choice(index if best_of else g.p.choice, text, entries if asked else None, g.finish_reason)
        if prepared.return_token_ids:
            one["token_ids"] = ids
        choices.append(one)
    cached = served.gens[0].cached_tokens
    answer = {
        "id": prepared.request_id,
        "object": obj,
        "created": int(time.time()),
        "model": ctx.model_name,
        "choices": choices,
        "usage": usage(prompt_tokens, served.completion_tokens, cached),
    }
    return JSONResponse(answer, headers=headers)


Row = tuple[Generation, tuple[str, list[int], list[Entry]]]


def best(rows: list[Row], best_of: int, n: int) -> list[Row]:
    """Of each prompt's `best_of` runs, its `n` of highest total logprob (OpenAI's `best_of`), in that order."""
    kept: list[Row] = []
    for first in range(0, len(rows), best_of):
        runs = rows[first : first + best_of]
        runs.sort(key=lambda r: -sum(lp.logprob for _, lp in r[1][2]))  # (stable: ties keep their order)
        kept += runs[:n]
    return kept


def reconnect(ctx: ServingContext, prepared: Prepared, n: int, last_event: str, digest: bytes) -> Choices:
    """The request a client continues with `Last-Event-ID`: only with the resume token of that request
    and the body it was sent with, and only within the idempotency window; refused before anything
    is sent or stopped otherwise. Nothing changes here: the stream takes each choice over in its turn
    (`EngineClient.generate`), so concurrent resumes of one request each get a definite answer. Choices
    the client saw end are not run again."""
    try:
        point = parse_event_id(last_event)
        if len(point.choices) != n:
            raise ValueError(last_event)
    except ValueError:
        raise APIError(
            f"Last-Event-ID {last_event[:200]!r} is not an id this server sent for this request.",
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
    gens: list[Generation] = []
    ended: dict[int, Held] = {}
    for i, held in enumerate(point.choices):
        if held.finished:
            ended[i] = held
            continue
        try:
            known = ctx.client.known(choice_id(rid, i))
        except UnknownRequestError:
            raise APIError(
                f"Request {rid} is unknown here or older than the idempotency window; it cannot be resumed.",
                404,
                type_="not_found_error",
                param="Last-Event-ID",
                code="request_not_found",
            ) from None
        params = known.add.params
        asked = prepared.add.params.prompt_logprobs
        if not held.tokens and asked >= 0 and params.prompt_logprobs < 0:
            # (a choice that had not sent its echo scores the prompt itself: choice 0's went with its first)
            params = msgspec.structs.replace(params, prompt_logprobs=asked)
        add = Resumption.request(known, held.tokens, held.chars, params)
        resumed = Prepared(
            add.request_id,
            add.prompt_ids,
            add,
            prepared.include_usage,
            prepared.return_token_ids,
            point.token,
            held.tokens,
            held.chars,
            resuming=known,
            choice=i,
        )
        gens.append(Generation(ctx, resumed))
    return Choices(rid, point.token, n, gens, ended)


async def stream(
    ctx: ServingContext, served: Choices, obj: str, make_choice: Any, first: Callable[[int], dict] | None
) -> AsyncIterator[bytes]:
    """The SSE events of a response's choices as they come, interleaved, each chunk one choice's."""
    gens = served.gens
    created = int(time.time())
    base = gens[0].p if gens else None
    resumed = any(g.p.have_tokens or g.p.resuming is not None for g in gens) or bool(served.ended)
    # A request the ladder shortened says so in its first chunk (a resumed stream had it already).
    notice = {"degradation": base.notice.as_dict()} if base and base.notice is not None and not resumed else {}

    def chunk(choices: list[dict[str, Any]], event_id: str = "", **extra: Any) -> bytes:
        nonlocal notice
        extra, notice = {**notice, **extra}, {}
        return sse(
            {
                "id": served.request_id,
                "object": obj,
                "created": created,
                "model": ctx.model_name,
                "choices": choices,
                **extra,
            },
            event_id,
        )

    outputs = merged(gens, ctx.keepalive_s, shared_prefill=not resumed)
    pending: dict[int, list[Entry]] = {i: [] for i in range(len(gens))}  # logprobs of tokens whose text waits
    try:
        if first is not None and not resumed:
            for g in gens:
                yield chunk([{"index": g.p.choice, **first(g.p.choice), "logprobs": None, "finish_reason": None}])
        async for item in outputs:
            if item is None:  # nothing for keepalive_s
                yield KEEP_ALIVE
                continue
            i, out = item
            gen = gens[i]
            if out.finish_reason == FinishReason.ERROR:
                yield sse(error_output(out).body())
                break
            offset = served.took(gen.p.choice, out)
            pending[i].extend(zip(out.token_ids, out.logprobs or (), strict=False))
            if out.text or out.finish_reason or (gen.p.return_token_ids and out.token_ids):
                asked = gen.p.add.params.logprobs >= 0
                choice = make_choice(gen, out.text, offset, out.finish_reason, pending[i] if asked else None)
                if choice is None and not gen.p.return_token_ids:
                    continue
                choice = choice or {"index": gen.p.choice, "delta": {}, "logprobs": None, "finish_reason": None}
                pending[i] = []
                if gen.p.return_token_ids:
                    choice["token_ids"] = out.token_ids
                # The event id says what the client holds after it (tokens, characters): a resume point.
                yield chunk([choice], served.event_id(ctx.signer))
        if base is not None and base.include_usage:
            cached = gens[0].cached_tokens
            yield chunk([], usage=usage(served.prompt_tokens, served.completion_tokens, cached))
        yield sse("[DONE]")
    except EngineDeadError as exc:
        yield sse(APIError(str(exc), 503, type_="service_unavailable").body())
    finally:
        await outputs.aclose()


def stream_completion(
    ctx: ServingContext,
    served: Choices,
    echo: Callable[[int], str] | None = None,
    prompt_part: Callable[[int, Prepared], dict[str, Any] | None] = lambda *_: None,
    echo_only: bool = False,
) -> AsyncIterator[bytes]:
    """`echo`: each choice's prompt text, its first chunk (not counted in its resume points: a resumed
    stream does not send it again); with logprobs, it waits for the first output, which brings the
    prompt's (`prompt_part`). `echo_only`: max_tokens 0, the token each choice sampled dropped."""
    scored = echo is not None and any(g.p.add.params.logprobs >= 0 for g in served.gens)
    echoed: set[int] = set()

    def choice(
        gen: Generation, text: str, offset: int, reason: str | None, entries: list[Entry] | None
    ) -> dict[str, Any]:
        index = gen.p.choice
        shown = echo(index) if echo is not None else ""
        if echo_only:
            text, entries = "", None if entries is None else []
        lp = None if entries is None else completion_logprobs(ctx.names, entries, offset + len(shown))
        if scored and index not in echoed and not gen.p.have_tokens:
            echoed.add(index)
            first = prompt_part(index, gen.p)
            lp = joined(first, lp) if first is not None and lp is not None else lp
            text = shown + text
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": reason}

    first = None if echo is None or scored else lambda i: {"text": echo(i)}
    return stream(ctx, served, "text_completion", choice, first)


def stream_chat(
    ctx: ServingContext, served: Choices, reader: Callable[[int], ToolReader | None] = lambda _: None
) -> AsyncIterator[bytes]:
    """`reader`: each choice's tool-call reader (None: its text is all content). A resumed choice's reader
    first reads, unsent, the text its client holds, so it holds back what the first run held back."""
    readers: dict[int, ToolReader | None] = {}

    def reader_of(gen: Generation) -> ToolReader | None:
        index = gen.p.choice
        if index not in readers:
            readers[index] = one = reader(index)
            resume = gen.p.add.resume
            if one is not None and resume is not None and gen.p.have_chars:
                one.feed(ctx.tokenizer.decode(resume.output_ids)[: gen.p.have_chars])
        return readers[index]

    def choice(
        gen: Generation, text: str, _: int, reason: str | None, entries: list[Entry] | None
    ) -> dict[str, Any] | None:
        lp = None if entries is None else chat_logprobs(ctx.names, entries)
        tool_reader = reader_of(gen)
        calls: list[dict[str, Any]] = []
        if tool_reader is not None:
            text, calls = tool_reader.feed(text)
            if reason is not None:
                rest, more = tool_reader.finish()
                text, calls = text + rest, calls + more
                if tool_reader.calls and reason == FinishReason.STOP:
                    reason = "tool_calls"
            if not text and not calls and reason is None:
                return None  # (all held: its tokens' logprobs ride with the chunk that sends their text)
        delta: dict[str, Any] = {"content": text} if text else {}
        if calls:
            delta["tool_calls"] = calls
        return {"index": gen.p.choice, "delta": delta, "logprobs": lp, "finish_reason": reason}

    return stream(
        ctx, served, "chat.completion.chunk", choice, lambda _: {"delta": {"role": "assistant", "content": ""}}
    )
