"""The router's HTTP face: OpenAI-compatible routes, health, metrics and admin.

Every request is validated and tokenized here, before any worker sees it, so bad input costs no
engine time and gets a precise 4xx. A request that was accepted ends with its tokens or an error
the client can see; a client that goes away aborts its request on the worker.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from steadfast.control.fleet.client import EngineDeadError
from steadfast.control.fleet.health import Standing
from steadfast.control.http import tools
from steadfast.control.http.admin_dashboard import add_dashboard_routes
from steadfast.control.http.admin_health import add_health_routes
from steadfast.control.http.admin_ladder import add_degradation_routes
from steadfast.control.http.admin_moves import add_migration_routes
from steadfast.control.http.admin_soak import add_soak_routes
from steadfast.control.http.chat import (
    admit_chat,
    check_chars,
    ensure_ready,
    resuming,
    served_priority,
    tokenized,
)
from steadfast.control.http.choices import choice_id, fan_out
from steadfast.control.http.dashboard import Dashboard
from steadfast.control.http.errors import (
    APIError,
    ErrorBody,
    api_error_handler,
    http_error_handler,
    validation_error_handler,
)
from steadfast.control.http.guard import Guard, GuardConfig
from steadfast.control.http.logprobs import Entry, chat_logprobs, completion_logprobs, joined, prompt_logprobs
from steadfast.control.http.openai_models import ChatCompletionRequest, CompletionRequest
from steadfast.control.http.responses import add_responses_routes
from steadfast.control.http.resume_token import MAX_CHOICES
from steadfast.control.http.serving import Prepared, ServingContext, admit, check_model, check_model_name
from steadfast.control.http.streams import Choices, respond, stream_chat, stream_completion
from steadfast.control.http.tags import request_tag
from steadfast.control.http.tokenize import add_tokenize_routes
from steadfast.control.http.truncate import cut_prompt

# What every route may answer besides its 200, documented so clients (and schemathesis) know it.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"description": why, "model": ErrorBody}
    for status, why in (
        (400, "invalid request"),
        (401, "missing or wrong API key"),
        (403, "not allowed (admin route from a non-loopback client; wrong resume token)"),
        (404, "unknown model or request"),
        (413, "request body over server.max_body_bytes"),
        (429, "over a limit (pending, connections, a priority's queue) or refused by the ladder; see Retry-After"),
        (500, "the engine failed this request"),
        (503, "no worker ready, or the degradation ladder's circuit breaker is open; see Retry-After"),
    )
}
# A completion is one JSON body, or an SSE stream when `stream` is true.
ANSWERS: dict[int | str, dict[str, Any]] = {
    200: {"description": "the completion", "content": {"application/json": {}, "text/event-stream": {}}}
}


class WorkerHealth(BaseModel):
    id: int
    ready: bool
    # The health check's judgement (control/fleet/health.py): healthy, degraded (score over its threshold:
    # work migrates away), sick (its requests fail or stall: out of rotation), probation.
    standing: str = "healthy"


class Health(BaseModel):
    """What /health answers, ready (200) or not (503): its 503 is not an error body."""

    status: Literal["ok", "unavailable"]
    workers: list[WorkerHealth]


def without_422(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """`app.openapi` without the 422 FastAPI documents for every route with a body: validation errors are
    answered 400 with an error body (errors.py), and a client (or schemathesis) must not expect a 422."""
    full = app.openapi

    def openapi() -> dict[str, Any]:
        schema = full()  # built once, then cached by FastAPI: the removal below is idempotent
        for operations in schema["paths"].values():
            for operation in operations.values():
                operation["responses"].pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        return schema

    return openapi


def create_app(
    ctx: ServingContext, guard: GuardConfig | None = None, dashboard: Dashboard | None = None, soak_report: str = ""
) -> FastAPI:
    app = FastAPI(title="Steadfast", version="0.1.0", responses=ERROR_RESPONSES)
    app.add_middleware(Guard, cfg=guard or GuardConfig())
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    app.openapi = without_422(app)  # type: ignore[method-assign]

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, exc: EngineDeadError) -> Response:
        return APIError(
            str(exc), 503, type_="service_unavailable", code="no_worker", headers={"Retry-After": "1"}
        ).response()

    ctx.created = int(time.time())

    @app.get(
        "/health",
        response_model=Health,
        responses={503: {"description": "not every part of the server is ready", "model": Health}},
    )
    async def health() -> JSONResponse:
        health = ctx.client.health
        workers = [
            {"id": w.worker_id, "ready": w.ready, "standing": health.of(w.worker_id).standing.value}
            for w in ctx.client.workers
            if not w.dead
        ]
        ok = ctx.client.ready
        return JSONResponse(
            {"status": "ok" if ok else "unavailable", "workers": workers}, status_code=200 if ok else 503
        )

    # `response_class=Response` has no media type of its own: the 200 is documented as the text it is,
    # and the error answers keep their JSON.
    @app.get(
        "/metrics",
        response_class=Response,
        responses={200: {"description": "Prometheus text format", "content": {"text/plain": {}}}},
    )
    async def metrics() -> Response:
        m = ctx.metrics
        for w in ctx.client.workers:
            label = str(w.worker_id)
            m.worker_up.labels(label).set(1 if w.ready else 0)
            h = ctx.client.health.of(w.worker_id)
            m.health_score.labels(label).set(h.score.value)
            for standing in Standing:
                m.health_standing.labels(label, standing.value).set(1 if h.standing is standing else 0)
            if w.status is not None:
                m.running.labels(label).set(w.status.num_running)
                m.waiting.labels(label).set(w.status.num_waiting)
                m.kv_used.labels(label).set(w.status.kv_blocks_used)
                m.kv_free.labels(label).set(w.status.kv_blocks_total - w.status.kv_blocks_used)
                m.kv_made.labels(label).set(w.status.kv_blocks_made)
                s = w.status
                m.spec_drafted.labels(label).set(s.spec_drafted)
                m.spec_accepted.labels(label).set(s.spec_accepted)
                m.spec_acceptance.labels(label).set(s.spec_accepted / s.spec_drafted if s.spec_drafted else 0.0)
                m.tokens_per_step.labels(label).set(s.tokens_per_step)
                m.kv_offloaded.labels(label).set(s.kv_blocks_offloaded)
                m.offload_blocks.labels(label, "written").set(s.offload_written)
                m.offload_blocks.labels(label, "fetched").set(s.offload_fetched)
                m.preemptions.labels(label, "swap").set(s.swap_preemptions)
                m.preemptions.labels(label, "recompute").set(s.recompute_preemptions)
                m.recomputed_tokens.labels(label).set(s.recomputed_tokens)
                for reason, n in s.kv_wire_dropped.items():
                    m.wire_dropped.labels(label, reason).set(n)
                for reason, n in s.kv_wire_refused.items():
                    m.wire_refused.labels(label, reason).set(n)
        m.migration_mismatches.set(ctx.client.migrations.mismatches)
        m.health_retries.set(ctx.client.health.retried)
        m.routing_hit_rate.set(ctx.client.router.hit_rate)
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
                    "draining": w.draining,
                    "node": w.node,  # its kvpool's address: workers of one node hand KV over in place
                    "kv_blocks_used": s.kv_blocks_used if s else 0,
                    "kv_blocks_total": s.kv_blocks_total if s else 0,
                    "kv_blocks_made": s.kv_blocks_made if s else 0,  # with memory: the arena grows with use
                    "kv_blocks_incoming": s.kv_blocks_incoming if s else 0,  # held for moves not yet claimed
                    "running": s.num_running if s else 0,
                    "waiting": s.num_waiting if s else 0,
                    "in_flight": w.load,
                    "prefix_hit_rate": s.prefix_hit_rate if s else 0.0,
                    "step_ms": s.step_ms if s else 0.0,
                    "step_tokens": s.step_tokens if s else 0.0,
                    # its measured step cost: base + per decoding row + per prefill token
                    "step_base_ms": s.step_base_ms if s else 0.0,
                    "step_decode_ms": s.step_decode_ms if s else 0.0,
                    "step_prefill_ms": s.step_prefill_ms if s else 0.0,
                    "degradation_level": s.degradation_level if s else 0,  # the ladder's orders it follows
                    "ladder_swaps": s.ladder_swaps if s else 0,  # running requests it swapped out for L3
                    "spec_drafted": s.spec_drafted if s else 0,
                    "spec_accepted": s.spec_accepted if s else 0,
                    "tokens_per_step": s.tokens_per_step if s else 0.0,
                    "kv_blocks_offloaded": s.kv_blocks_offloaded if s else 0,
                    "offload_written": s.offload_written if s else 0,
                    "offload_fetched": s.offload_fetched if s else 0,
                    "swap_preemptions": s.swap_preemptions if s else 0,
                    "recompute_preemptions": s.recompute_preemptions if s else 0,
                    "recomputed_tokens": s.recomputed_tokens if s else 0,
                    "kv_wire_dropped": s.kv_wire_dropped if s else {},
                    "kv_wire_refused": s.kv_wire_refused if s else {},
                    "rss_mb": s.rss_mb if s else 0.0,
                    "threads": s.threads if s else 0,  # it computes with now, fewer while others take cores
                    "liveness": w.liveness.value,  # alive, suspect (probed), silent, dead
                    "health": ctx.client.health.view(w.worker_id),  # standing, score and terms, layers
                    "indexed_blocks": ctx.client.router.index.size(w.worker_id),  # its cache as routing knows it
                }
            )
        return rows

    add_migration_routes(app, ctx)
    add_degradation_routes(app, ctx)
    add_health_routes(app, ctx)
    add_dashboard_routes(app, dashboard or Dashboard(ctx))
    add_soak_routes(app, soak_report)
    add_tokenize_routes(app, ctx)

    @app.get("/admin/takeovers")
    async def admin_takeovers() -> list[dict[str, Any]]:
        """Requests moved off dead workers: from where to where, at which token, by which route, at what cost."""
        return [
            {
                # Not the request id: with it (and its resume token) a stream could be resumed.
                "request": request_tag(t.request_id),
                "from_worker": t.from_worker,
                "to_worker": t.to_worker,
                "at_token": t.at_token,
                "route": t.route,
                "adopted_tokens": t.adopted_tokens,
                "recomputed_tokens": t.recomputed_tokens,
                "first_token_ms": None if t.first_token_s is None else 1000 * t.first_token_s,
                "at": t.wall,  # when it was moved (Unix time)
            }
            for t in ctx.client.takeovers
        ]

    def model_card() -> dict[str, Any]:
        return {
            "id": ctx.model_name,
            "object": "model",
            "created": ctx.created,
            "owned_by": "steadfast",
            "max_model_len": ctx.max_model_len,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        check_model_name(ctx, model_id)
        return model_card()

    @app.post("/v1/completions", responses=ANSWERS)
    async def completions(body: CompletionRequest, http: Request) -> Response:
        ignored = check_model(ctx, body)
        body.priority = served_priority(body.priority, http)
        prompts = prompt_list(body.prompt)
        runs = body.runs
        if len(prompts) * runs > MAX_CHOICES:
            raise APIError(
                f"{len(prompts)} prompts of {runs} runs each are over {MAX_CHOICES} in one request.", param="prompt"
            )
        if runs > body.n and body.stream:
            raise APIError("best_of above n cannot be streamed (the best are known at the end).", param="best_of")
        check_chars(ctx, body, sum(len(p) for p in prompts if isinstance(p, str)), "prompt")
        ids_of = [await prompt_ids(ctx, p) for p in prompts]
        ensure_ready(ctx)
        ctx.check_pending()
        rid = f"cmpl-{uuid.uuid4().hex}"
        resumed = resuming(body, http)
        admitted: list[Prepared] = []
        try:
            for k, ids in enumerate(ids_of):

                async def cut(cap: int, ids: list[int] = ids) -> tuple[list[int], int]:
                    return cut_prompt(ids, cap, ctx.tokenizer.info.bos_token_id), 0

                one = await admit(ctx, body, ids, body.generated, "cmpl", cut, resumed, choice_id(rid, k * runs))
                admitted.append(one)
        except BaseException:
            if ctx.degradation is not None and not resumed:
                for one in admitted:  # (each counted as queued by the ladder until it ends)
                    ctx.degradation.ended(one.request_id)
            raise
        fanned: list[Prepared] = []
        for k, one in enumerate(admitted):
            one.resume_token, one.choice = admitted[0].resume_token, k * runs  # (one request: choice 0's ids)
            if runs > body.n and one.add.params.logprobs < 0:  # (best_of ranks by likelihood)
                one.add = msgspec.structs.replace(one.add, params=msgspec.structs.replace(one.add.params, logprobs=0))
            fanned += fan_out(one, runs, rid, k * runs)
        # `echo`: each choice's text opens with its prompt (as given, or its token ids' text), and with
        # `logprobs` its logprobs with the prompt's (scored by each prompt's first choice).
        echoes = [p if isinstance(p, str) else ctx.tokenizer.decode(p) for p in prompts] if body.echo else []
        zero = body.max_tokens == 0  # (the prompt alone: the token sampled after it is dropped)

        def echo(index: int) -> str:
            return echoes[index // body.n] if echoes else ""  # (best_of's kept choices: n per prompt too)

        def prompt_part(index: int, p: Prepared | None = None) -> dict[str, Any] | None:
            """The prompt's logprobs for choice `index`: its own where it scored the prompt (a resumed
            choice), else its prompt's first choice's."""
            k = index // body.n
            scores = admitted[k].prompt_logprobs if p is None or p.prompt_logprobs is None else p.prompt_logprobs
            return None if scores is None else prompt_logprobs(ctx.names, ids_of[k], scores)

        def choice(index: int, text: str, entries: list[Entry] | None, reason: str | None) -> dict[str, Any]:
            if zero:
                text, entries = "", None if entries is None else []
            lp = None if entries is None else completion_logprobs(ctx.names, entries, len(echo(index)))
            first = prompt_part(index) if lp is not None and echoes else None
            lp = joined(first, lp) if first is not None and lp is not None else lp
            return {"index": index, "text": echo(index) + text, "logprobs": lp, "finish_reason": reason}

        def streamer(ctx: ServingContext, served: Choices) -> AsyncIterator[bytes]:
            return stream_completion(ctx, served, echo if echoes else None, prompt_part, zero)

        best_of = runs if runs > body.n else 0
        first = admitted[0]
        return await respond(
            ctx, first, body, http, streamer, "text_completion", choice, ignored, fanned, best_of, echo_only=zero
        )

    @app.post("/v1/chat/completions", responses=ANSWERS)
    async def chat(body: ChatCompletionRequest, http: Request) -> Response:
        ignored = check_model(ctx, body)
        prepared, reader = await admit_chat(ctx, body, http, "chatcmpl")

        def choice(index: int, text: str, entries: list[Entry] | None, reason: str | None) -> dict[str, Any]:
            lp = None if entries is None else chat_logprobs(ctx.names, entries)
            one = reader(index)
            if one is not None:
                message = tools.message(text, one)
                reason = "tool_calls" if one.calls and reason == "stop" else reason
            else:
                message = {"role": "assistant", "content": text}
            return {"index": index, "message": message, "logprobs": lp, "finish_reason": reason}

        def streamer(ctx: ServingContext, served: Choices) -> AsyncIterator[bytes]:
            return stream_chat(ctx, served, reader)

        return await respond(ctx, prepared, body, http, streamer, "chat.completion", choice, ignored)

    add_responses_routes(app, ctx)

    return app


def prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """The prompts of a completion: a text, texts, token ids, or lists of token ids; each non-empty."""
    if isinstance(prompt, str):
        prompts: list[str | list[int]] = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]  # type: ignore[arg-type]
    else:
        prompts = list(prompt)  # type: ignore[arg-type]
    if not prompts or any(not p for p in prompts):
        raise APIError("'prompt' must not be empty (nor any prompt in it).", param="prompt")
    return prompts


async def prompt_ids(ctx: ServingContext, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        return await tokenized(ctx, "prompt", ctx.tokenizer.encode, prompt)
    vocab = ctx.tokenizer.vocab_size
    if any(t >= vocab for t in prompt):
        raise APIError(f"Token ids in 'prompt' must be in [0, {vocab}).", param="prompt")
    return prompt
