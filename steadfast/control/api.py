"""The router's HTTP face: OpenAI-compatible routes, health, metrics and admin.

Every request is validated and tokenized here, before any worker sees it, so bad input costs no
engine time and gets a precise 4xx. A request that was accepted ends with its tokens or an error
the client can see; a client that goes away aborts its request on the worker.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from steadfast.control.engine_client import EngineDeadError
from steadfast.control.errors import APIError, api_error_handler, http_error_handler, validation_error_handler
from steadfast.control.openai_models import ChatCompletionRequest, CompletionRequest
from steadfast.control.serving import ServingContext, check_model, prepare
from steadfast.control.streams import respond, stream_chat, stream_completion


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
        check_model(ctx, body)
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
        prepared = prepare(ctx, body, ids, body.max_tokens, "cmpl")

        def choice(text: str) -> dict[str, Any]:
            return {"index": 0, "text": text, "logprobs": None}

        return await respond(ctx, prepared, body.stream, http, stream_completion, "text_completion", choice)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, http: Request) -> Response:
        check_model(ctx, body)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            ids = ctx.tokenizer.encode_chat(messages)
        except Exception as exc:  # a template may raise on an order of roles it does not accept
            raise APIError(f"The chat template rejected these messages: {exc}", param="messages") from exc
        ensure_ready()
        prepared = prepare(ctx, body, ids, body.token_limit, "chatcmpl")

        def choice(text: str) -> dict[str, Any]:
            return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None}

        return await respond(ctx, prepared, body.stream, http, stream_chat, "chat.completion", choice)

    return app
