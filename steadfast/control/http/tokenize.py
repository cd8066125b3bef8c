"""`POST /tokenize` and `POST /detokenize`, as vLLM serves them: a prompt or a chat (with its tools) to
token ids (what the model would be given), and ids back to text. Behind the same key as /v1; bounded by the request
limits; the tokenizer runs off the event loop. Never touches a worker."""

from __future__ import annotations

import functools
from typing import Annotated, Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field, StrictBool

from steadfast.control.http import tools
from steadfast.control.http.errors import APIError
from steadfast.control.http.openai_models import MAX_TOOLS, ChatCompletionRequest, ChatMessage, Text, TokenId, Tool
from steadfast.control.http.serving import ServingContext, check_model_name

MAX_DETOKENIZE = 1 << 20  # ids in one call: a 4 MB body holds no more than ~800 k anyway


class _Tokenize(BaseModel):
    model_config = ConfigDict(extra="forbid")  # (a misspelt option would change the count unseen)
    model: Text | None = None
    return_token_strs: StrictBool = False


class TokenizePrompt(_Tokenize):
    prompt: Text
    add_special_tokens: StrictBool = True


class TokenizeChat(_Tokenize):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None  # (as a chat would be given them)
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool = False  # (the template writes the special tokens it wants)


class Detokenize(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Text | None = None
    tokens: Annotated[list[TokenId], Field(max_length=MAX_DETOKENIZE)]


def add_tokenize_routes(app: FastAPI, ctx: ServingContext) -> None:
    @app.post("/tokenize")
    async def tokenize(body: TokenizePrompt | TokenizeChat) -> dict[str, Any]:
        check_model_name(ctx, body.model)
        tok = ctx.tokenizer
        try:
            if isinstance(body, TokenizePrompt):
                if len(body.prompt) > ctx.limits.max_prompt_chars:
                    raise APIError(f"The prompt is over {ctx.limits.max_prompt_chars} characters.", param="prompt")
                ids = await ctx.off_loop(tok.encode, body.prompt, body.add_special_tokens)
            else:
                if body.add_special_tokens:
                    raise APIError(
                        "add_special_tokens is not supported with messages: the chat template writes them.",
                        param="add_special_tokens",
                    )
                if len(body.messages) > ctx.limits.max_messages:
                    raise APIError(f"More than {ctx.limits.max_messages} messages.", param="messages")
                chat = ChatCompletionRequest(model="", messages=body.messages, tools=body.tools)
                native = tools.native(tok.info.chat_template)
                messages = tools.prompt_messages(chat, native)
                offered = tools.offered(chat) if native else []
                if tools.prompt_chars(messages, offered) > ctx.limits.max_prompt_chars:
                    raise APIError(f"The messages are over {ctx.limits.max_prompt_chars} characters.", param="messages")
                encode = functools.partial(tok.encode_chat, tools=offered or None)
                ids = await ctx.off_loop(encode, messages, body.add_generation_prompt)
        except APIError:
            raise
        except Exception as exc:  # the tokenizer's or the template's refusal of this input
            raise APIError(f"This input cannot be tokenized: {exc}") from exc
        out: dict[str, Any] = {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids}
        out["token_strs"] = [tok.token_text(t) for t in ids] if body.return_token_strs else None
        return out

    @app.post("/detokenize")
    async def detokenize(body: Detokenize) -> dict[str, str]:
        check_model_name(ctx, body.model)
        vocab = ctx.tokenizer.vocab_size
        bad = next((t for t in body.tokens if t >= vocab), None)
        if bad is not None:
            raise APIError(f"Token id {bad} is not in [0, {vocab}).", param="tokens")
        return {"prompt": await ctx.off_loop(ctx.tokenizer.decode, body.tokens, False)}  # (special tokens too)
