"""`POST /v1/responses`: OpenAI's Responses API, stateless. The request is served as the chat it
translates to (responses_input.py), so everything a chat gets — admission, the ladder, takeovers and
migrations on the workers, structured outputs, tool calls — it gets too; here its output is shaped as
Responses answers it: one `response` object, or a stream of typed events (`response.created` …
`response.output_text.delta` … `response.completed`, or `response.incomplete` when `max_output_tokens`
cut it), each with its `sequence_number`.

A stream's events carry resume points as a chat stream's do: a client whose connection broke (a
router's death) sends the request again with `Last-Event-ID` and gets the events after the last one it
received, numbered on, none twice (`_Numbered`).
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from steadfast.control.fleet.client import EngineDeadError
from steadfast.control.http import tools
from steadfast.control.http.chat import admit_chat
from steadfast.control.http.choices import merged
from steadfast.control.http.errors import APIError
from steadfast.control.http.logprobs import Entry, chat_logprobs
from steadfast.control.http.openai_models import ChatCompletionRequest
from steadfast.control.http.responses_input import ResponsesRequest, chat_request, unknown_fields
from steadfast.control.http.resume_token import body_digest, count
from steadfast.control.http.serving import Generation, Prepared, ServingContext, check_model_name, error_output
from steadfast.control.http.streams import DEGRADATION_HEADER, KEEP_ALIVE, Choices, collect, reconnect
from steadfast.wire.worker import FinishReason

_json = msgspec.json.Encoder()
_HEX = frozenset("0123456789abcdef")


def _item_id(prefix: str, response_id: str, index: int) -> str:
    return f"{prefix}_" + hashlib.blake2b(f"{response_id}/{index}".encode(), digest_size=12).hexdigest()


class Shaper:
    """One response's output items as they are made: a message's text, function calls; and the
    `response` object around them."""

    def __init__(
        self, ctx: ServingContext, body: ResponsesRequest, chat: ChatCompletionRequest, p: Prepared, request_id: str
    ) -> None:
        self.ctx, self.body, self.chat, self.p = ctx, body, chat, p
        self.id = request_id.replace("-", "_", 1)
        stamp = request_id.removeprefix("resp-")[:8]
        self.created = int(stamp, 16) if len(stamp) == 8 and all(c in _HEX for c in stamp) else int(time.time())
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being written
        self.logprobs = chat.logprobs

    def response(self, status: str, gen: Generation | None = None, reason: str | None = None) -> dict[str, Any]:
        b = self.body
        out: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if reason == FinishReason.LENGTH else None,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "model": self.ctx.model_name,
            "output": self.output,
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
            "temperature": b.temperature,
            "text": {"format": (b.text or {}).get("format") or {"type": "text"}},
            "tool_choice": b.tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in b.tools or ()],
            "top_p": b.top_p,
            "truncation": "disabled",
            "metadata": b.metadata or {},
            "user": b.user,
            "usage": None,
        }
        if gen is not None:
            out["usage"] = {
                "input_tokens": len(self.p.prompt_ids),
                "input_tokens_details": {"cached_tokens": gen.cached_tokens},
                "output_tokens": gen.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": len(self.p.prompt_ids) + gen.completion_tokens,
            }
        return out

    def text(self, text: str, entries: list[Entry] | None) -> list[dict[str, Any]]:
        """Events for more of the message's text (opening the message first)."""
        events = []
        if self.open is None or self.open["type"] != "message":
            events += self.close("completed")
            self.open = {
                "type": "message",
                "id": _item_id("msg", self.id, len(self.output)),
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            events.append({"type": "response.output_item.added", "output_index": len(self.output), "item": self.open})
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append({"type": "response.content_part.added", **self._at(), "part": part})
            self.open["content"].append(part)
        part = self.open["content"][0]
        part["text"] += text
        lp = chat_logprobs(self.ctx.names, entries)["content"] if entries else []
        part["logprobs"] += lp
        events.append({"type": "response.output_text.delta", **self._at(), "delta": text, "logprobs": lp})
        return events

    def call(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """Events for a call delta: one that names a call opens its item, the others add to its arguments."""
        events = []
        arguments = delta["function"].get("arguments", "")
        if "id" in delta:
            events += self.close("completed")
            self.open = {
                "type": "function_call",
                "id": _item_id("fc", self.id, len(self.output)),
                "call_id": delta["id"],
                "name": delta["function"]["name"],
                "arguments": "",
                "status": "in_progress",
            }
            events.append({"type": "response.output_item.added", "output_index": len(self.output), "item": self.open})
        if arguments and self.open is not None:
            self.open["arguments"] += arguments
            at = {"item_id": self.open["id"], "output_index": len(self.output)}
            events.append({"type": "response.function_call_arguments.delta", **at, "delta": arguments})
        return events

    def close(self, status: str) -> list[dict[str, Any]]:
        """Events that end the item being written."""
        item, self.open = self.open, None
        if item is None:
            return []
        index = len(self.output)
        item["status"] = status
        self.output.append(item)
        if item["type"] == "function_call":
            at = {"item_id": item["id"], "output_index": index}
            done = {"type": "response.function_call_arguments.done", **at, "arguments": item["arguments"]}
            return [done, {"type": "response.output_item.done", "output_index": index, "item": item}]
        part = item["content"][0]
        at = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [
            {"type": "response.output_text.done", **at, "text": part["text"], "logprobs": part["logprobs"]},
            {"type": "response.content_part.done", **at, "part": part},
            {"type": "response.output_item.done", "output_index": index, "item": item},
        ]

    def _at(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.output), "content_index": 0}

    def finished(self, reason: str | None) -> str:
        """The response's status once its generation ended."""
        return "incomplete" if reason == FinishReason.LENGTH else "completed"


def _feed(reader: tools.ToolReader | None, text: str, done: bool) -> tuple[str, list[dict[str, Any]]]:
    if reader is None:
        return text, []
    content, deltas = reader.feed(text)
    if done:
        rest, more = reader.finish()
        content, deltas = content + rest, deltas + more
    return content, deltas


@dataclass(frozen=True)
class ResumeAt:
    """Where a client's Responses stream stopped (its Last-Event-ID): the chat resume point of the text it
    holds, the sequence number the events made after that text are numbered from, and the last one it
    received."""

    point: str
    next_seq: int
    seen: int


def parse_resume(last_event: str) -> ResumeAt:
    """A Responses event id, `<chat event id>/<next>/<seen>`; a 400 unless it has that shape."""
    try:
        point, next_seq, seen = last_event.rsplit("/", 2)
        at = ResumeAt(point, count(next_seq), count(seen))
        if at.seen + 1 < at.next_seq:
            raise ValueError(last_event)
        return at
    except ValueError:
        raise APIError(
            f"Last-Event-ID {last_event[:200]!r} is not an id this server sent for a response.",
            param="Last-Event-ID",
            code="invalid_last_event_id",
        ) from None


class _Numbered:
    """A stream's events numbered and given ids. The events made from one output are written together,
    each with an id: the output's last one says the client holds that output (and that the events made
    after it are numbered from the next); the ones before it say the client holds the text before the
    output and has seen up to that event. A resume regenerates from the text it holds, numbering from
    `next`, and sends only what is past `seen`: the events an output makes are the same whatever the
    outputs' cut, up to its text deltas, so nothing already received is sent again."""

    def __init__(self, ctx: ServingContext, served: Choices, at: ResumeAt | None) -> None:
        self.ctx, self.served = ctx, served
        self.seq = at.next_seq if at is not None else 0
        self.seen = at.seen if at is not None else -1
        self.point = served.event_id(ctx.signer)

    def batch(self, events: list[dict[str, Any]]) -> bytes:
        before, start = self.point, self.seq
        self.point = after = self.served.event_id(self.ctx.signer)
        out = []
        for k, e in enumerate(events):
            seq = e["sequence_number"] = self.seq
            self.seq += 1
            last = k == len(events) - 1
            event_id = f"{after}/{seq + 1}/{seq}" if last else f"{before}/{start}/{seq}"
            if seq > self.seen:
                data = _json.encode(e)
                out.append(f"id: {event_id}\nevent: {e['type']}\n".encode() + b"data: " + data + b"\n\n")
        return b"".join(out)


async def _events(
    shaper: Shaper, served: Choices, reader: tools.ToolReader | None, at: ResumeAt | None
) -> AsyncIterator[bytes]:
    ctx = shaper.ctx
    (gen,) = served.gens
    if at is not None:  # (the text the client holds, through the reader and into the items, unsent)
        resume = gen.p.add.resume
        held = ctx.tokenizer.decode(resume.output_ids)[: gen.p.have_chars] if resume is not None else ""
        text, deltas = _feed(reader, held, False)
        if text:
            shaper.text(text, None)
        for d in deltas:
            shaper.call(d)
    numbered = _Numbered(ctx, served, at)
    if numbered.seq == 0:
        opening = shaper.response("in_progress")
        yield numbered.batch(
            [{"type": "response.created", "response": opening}, {"type": "response.in_progress", "response": opening}]
        )
    outputs = merged([gen], ctx.keepalive_s)
    pending: list[Entry] = []
    try:
        async for item in outputs:
            if item is None:
                yield KEEP_ALIVE
                continue
            _, out = item
            if out.finish_reason == FinishReason.ERROR:
                failure = error_output(out)
                yield _error(numbered, failure.code, failure.message)
                return
            served.took(0, out)
            pending.extend(zip(out.token_ids, out.logprobs or (), strict=False))
            text, deltas = _feed(reader, out.text, out.finish_reason is not None)
            made: list[dict[str, Any]] = []
            if text:
                made += shaper.text(text, pending if shaper.logprobs else None)
                pending = []
            for d in deltas:
                made += shaper.call(d)
            if out.finish_reason is not None:
                status = shaper.finished(out.finish_reason)
                made += shaper.close("incomplete" if status == "incomplete" else "completed")
                final = shaper.response(status, gen, out.finish_reason)
                made.append({"type": f"response.{status}", "response": final})
            if made:
                yield numbered.batch(made)
    except EngineDeadError as exc:
        yield _error(numbered, "no_worker", str(exc))
    finally:
        await outputs.aclose()


def _error(numbered: _Numbered, code: str | None, message: str) -> bytes:
    e = {"type": "error", "code": code, "message": message, "param": None, "sequence_number": numbered.seq}
    return b"event: error\ndata: " + _json.encode(e) + b"\n\n"  # (no id: a resume goes on from before it)


def response_id() -> str:
    """A new response's request id: its creation time (hex seconds) first, so a resumed stream's
    `created_at` is the first one's."""
    return f"resp-{int(time.time()):08x}{uuid.uuid4().hex[:24]}"


def add_responses_routes(app: FastAPI, ctx: ServingContext) -> None:
    @app.post("/v1/responses", responses={200: {"description": "the response, or its event stream"}})
    async def responses(body: ResponsesRequest, http: Request) -> Response:
        check_model_name(ctx, body.model)
        last_event = http.headers.get("last-event-id") if body.stream else None
        at = parse_resume(last_event) if last_event else None
        ignored = unknown_fields(body)
        chat = chat_request(body)
        prepared, reader_of = await admit_chat(ctx, chat, http, "resp", request_id=response_id())
        headers = ctx.ignored.header(ignored)
        if prepared.notice is not None:
            headers[DEGRADATION_HEADER] = prepared.notice.header()
        if at is not None:
            served = reconnect(ctx, prepared, 1, at.point, body_digest(chat))
            reader_of = tools.readers(chat, served.request_id)
        else:
            served = Choices(prepared.request_id, prepared.resume_token, 1, [Generation(ctx, prepared)])
        shaper = Shaper(ctx, body, chat, served.gens[0].p, served.request_id)
        reader = reader_of(0)
        if body.stream:
            stream = _events(shaper, served, reader, at)
            return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
        (gen,) = served.gens
        results = await collect([gen], http)
        if results is None:
            return Response(status_code=499)  # the client left; its request was aborted
        ((text, _, entries),) = results
        content, deltas = _feed(reader, text, True)
        if content:
            shaper.text(content, entries if shaper.logprobs else None)
        for d in tools.gathered(deltas):
            shaper.call(d)
        status = shaper.finished(gen.finish_reason)
        shaper.close("incomplete" if status == "incomplete" else "completed")
        return JSONResponse(shaper.response(status, gen, gen.finish_reason), headers=headers)
