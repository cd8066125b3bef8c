"""`POST /v1/responses`: OpenAI's Responses API, stateless. The request is served as the chat it
translates to (responses_input.py), so everything a chat gets — admission, the ladder, takeovers and
migrations on the workers, structured outputs, tool calls — it gets too; here its output is shaped as
Responses answers it: one `response` object, or a stream of typed events (`response.created` …
`response.output_text.delta` … `response.completed`, or `response.incomplete` when `max_output_tokens`
cut it), each with its `sequence_number`.

A Responses stream is not resumed with `Last-Event-ID` (its events carry no resume points; a chat
stream's do): a router restart ends it with an error event, and the client asks again.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import AsyncIterator
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
from steadfast.control.http.serving import Generation, Prepared, ServingContext, check_model_name, error_output
from steadfast.control.http.streams import DEGRADATION_HEADER, KEEP_ALIVE, collect
from steadfast.wire.worker import FinishReason

_json = msgspec.json.Encoder()


def _item_id(prefix: str, response_id: str, index: int) -> str:
    return f"{prefix}_" + hashlib.blake2b(f"{response_id}/{index}".encode(), digest_size=12).hexdigest()


class Shaper:
    """One response's output items as they are made: a message's text, function calls; and the
    `response` object around them."""

    def __init__(self, ctx: ServingContext, body: ResponsesRequest, chat: ChatCompletionRequest, p: Prepared) -> None:
        self.ctx, self.body, self.chat, self.p = ctx, body, chat, p
        self.id = p.request_id.replace("-", "_", 1)
        self.created = int(time.time())
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


async def _events(shaper: Shaper, gen: Generation, reader: tools.ToolReader | None) -> AsyncIterator[bytes]:
    seq = 0

    def event(e: dict[str, Any]) -> bytes:
        nonlocal seq
        e["sequence_number"] = seq
        seq += 1
        return b"event: " + e["type"].encode() + b"\ndata: " + _json.encode(e) + b"\n\n"

    yield event({"type": "response.created", "response": shaper.response("in_progress")})
    yield event({"type": "response.in_progress", "response": shaper.response("in_progress")})
    outputs = merged([gen], shaper.ctx.keepalive_s)
    pending: list[Entry] = []
    try:
        async for item in outputs:
            if item is None:
                yield KEEP_ALIVE
                continue
            _, out = item
            if out.finish_reason == FinishReason.ERROR:
                failure = error_output(out)
                yield event({"type": "error", "code": failure.code, "message": failure.message, "param": None})
                return
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
            for e in made:
                yield event(e)
    except EngineDeadError as exc:
        yield event({"type": "error", "code": "no_worker", "message": str(exc), "param": None})
    finally:
        await outputs.aclose()


def add_responses_routes(app: FastAPI, ctx: ServingContext) -> None:
    @app.post("/v1/responses", responses={200: {"description": "the response, or its event stream"}})
    async def responses(body: ResponsesRequest, http: Request) -> Response:
        check_model_name(ctx, body.model)
        if http.headers.get("last-event-id"):
            raise APIError(
                "A Responses stream cannot be resumed with Last-Event-ID (a chat completion stream can).",
                param="Last-Event-ID",
                code="unsupported_parameter",
            )
        ignored = unknown_fields(body)
        chat = chat_request(body)
        prepared, reader_of = await admit_chat(ctx, chat, http, "resp", resumable=False)
        shaper = Shaper(ctx, body, chat, prepared)
        gen = Generation(ctx, prepared)
        reader = reader_of(0)
        headers = ctx.ignored.header(ignored)
        if prepared.notice is not None:
            headers[DEGRADATION_HEADER] = prepared.notice.header()
        if body.stream:
            return StreamingResponse(_events(shaper, gen, reader), media_type="text/event-stream", headers=headers)
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
