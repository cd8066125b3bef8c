"""Admission of a chat (chat completions and the Responses API alike): its messages and tools rendered
through the chat template and tokenized off the event loop, bounded, and admitted through the ladder; and
the helpers every generating route shares (readiness, priority, character bounds, tokenizing)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from fastapi import Request

from steadfast.control.http import tools
from steadfast.control.http.errors import APIError
from steadfast.control.http.guard import identity_of
from steadfast.control.http.openai_models import ChatCompletionRequest, CompletionRequest
from steadfast.control.http.serving import Prepared, ServingContext, admit
from steadfast.control.http.truncate import cut_chat

Reader = Callable[[int], tools.ToolReader | None]  # a choice's tool-call reader (None: all its text is content)


def ensure_ready(ctx: ServingContext) -> None:
    if not any(w.ready for w in ctx.client.workers):
        raise APIError(
            "No worker is ready to serve; retry shortly.",
            503,
            type_="service_unavailable",
            code="no_worker",
            headers={"Retry-After": "1"},
        )


def check_messages(ctx: ServingContext, count: int) -> None:
    """A 400 for more messages than `server.max_messages`: `context_length_exceeded` where so many could
    not fit the context anyway (the client's real problem)."""
    if count <= ctx.limits.max_messages:
        return
    at_least = count * ctx.message_tokens
    if at_least >= ctx.max_model_len:
        raise APIError(
            f"This model's maximum context length is {ctx.max_model_len} tokens, but your {count} "
            f"messages take at least {at_least} tokens. Please shorten the conversation.",
            param="messages",
            code="context_length_exceeded",
        )
    raise APIError(
        f"This request has {count} messages; the limit is {ctx.limits.max_messages}.",
        param="messages",
        code="too_many_messages",
    )


async def admit_chat(
    ctx: ServingContext, body: ChatCompletionRequest, http: Request, prefix: str, request_id: str = ""
) -> tuple[Prepared, Reader]:
    """The chat admitted (a 4xx otherwise), and the tool-call reader of each of its choices. `request_id`:
    its id (by default a new one of `prefix`)."""
    body.priority = served_priority(body.priority, http)
    check_messages(ctx, len(body.messages))
    tools.check(body)
    native = tools.native(ctx.tokenizer.info.chat_template)
    messages = tools.prompt_messages(body, native)
    offered = tools.offered(body) if native else []
    encode = functools.partial(ctx.tokenizer.encode_chat, tools=offered or None)
    check_chars(ctx, body, tools.prompt_chars(messages, offered), "messages")
    ids = await tokenized(ctx, "messages", encode, messages)
    ensure_ready(ctx)
    ctx.check_pending()

    async def cut(cap: int) -> tuple[list[int], int]:
        return await ctx.off_loop(cut_chat, messages, cap, encode)

    prepared = await admit(ctx, body, ids, body.token_limit, prefix, cut, resuming(body, http), request_id)
    return prepared, tools.readers(body, prepared.request_id)


def served_priority(asked: str, http: Request) -> str:
    """The priority a request is served at: what it asked for, bounded by what its caller may claim (its
    key's highest; without keys, `access.client_priority`). Never refused for asking: served lower."""
    identity = identity_of(http.state)
    return identity.priority(asked) if identity is not None else asked


def resuming(body: CompletionRequest | ChatCompletionRequest, http: Request) -> bool:
    """A streamed request with Last-Event-ID continues an accepted one (streams.reconnect checks it)."""
    return bool(body.stream and http.headers.get("last-event-id"))


def check_chars(ctx: ServingContext, body: CompletionRequest | ChatCompletionRequest, chars: int, param: str) -> None:
    """The prompt's characters and the stop strings' together within `max_prompt_chars`: both travel
    with the request to its worker and into its ledger record."""
    limit = ctx.limits.max_prompt_chars
    stop = sum(len(s) for s in body.stop_list)
    if chars > limit:
        raise APIError(f"The prompt has {chars} characters; the limit is {limit}.", param=param, code="prompt_too_long")
    if chars + stop > limit:
        raise APIError(
            f"The stop sequences have {stop} characters and the prompt {chars}; together they may have {limit}.",
            param="stop",
            code="stop_too_long",
        )


async def tokenized(ctx: ServingContext, param: str, encode: Callable[[Any], list[int]], what: Any) -> list[int]:
    """Token ids of a prompt or of rendered messages, computed off the event loop; text the tokenizer or
    the chat template refuses (a lone surrogate, roles in an order the template rejects) is a 400."""
    try:
        return await ctx.off_loop(encode, what)
    except Exception as exc:
        where = "chat template" if param == "messages" else "tokenizer"
        raise APIError(f"The {where} rejected this {param}: {exc}", param=param) from exc
