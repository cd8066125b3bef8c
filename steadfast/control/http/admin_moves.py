"""Admin routes that move requests between workers: migrate one request, drain a worker, list the
migrations. Behind the guard's admin check like every `/admin` route; bodies are small and typed."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from steadfast.control.fleet.migration import MigrationError, MigrationMode, MigrationRecord
from steadfast.control.http.errors import APIError, ErrorBody
from steadfast.control.http.serving import ServingContext
from steadfast.control.http.tags import request_tag

WORKER_ID_MAX = 2**31 - 1
# Besides the app-wide errors: what a move that cannot start, or does not finish in time, answers.
CONFLICT = {409: {"description": "the move cannot start now, or the source kept the request", "model": ErrorBody}}
ANSWER_MARGIN_S = 2.0  # past migration.timeout the source gives up and says so: wait for that answer too
TIMEOUT = {504: {"description": "no outcome within migration.timeout (it may still commit)", "model": ErrorBody}}


class MigrateBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    to: int | None = Field(default=None, ge=0, le=WORKER_ID_MAX, description="worker id; absent: the policy picks")
    mode: MigrationMode = Field(
        default=MigrationMode.KV, description="kv: move the KV; recompute: the destination computes it again"
    )


def record_view(r: MigrationRecord) -> dict[str, Any]:
    ms = lambda s: None if s is None else round(1000 * s, 3)  # noqa: E731 - a local formatter
    return {
        # Not the request id: with it (and its resume token) a stream could be resumed.
        "request": request_tag(r.request_id),
        "from_worker": r.from_worker,
        "to_worker": r.to_worker,
        "reason": r.reason,
        "outcome": r.outcome,
        "at_token": r.at_token,
        "path": r.path,
        "stages": r.stages,
        "blocks": r.blocks,
        "bytes": r.bytes,
        "retries": r.retries,
        "downtime_ms": ms(r.downtime_s),
        "gap_ms": ms(r.gap_s),
        "duration_ms": ms(r.seconds),
        "error": r.error,
        "started": r.started,
    }


def add_migration_routes(app: FastAPI, ctx: ServingContext) -> None:
    client = ctx.client

    def fail(exc: MigrationError) -> APIError:
        code = {404: "not_found", 409: "conflict", 503: "no_supervisor"}.get(exc.status, "migration_failed")
        return APIError(
            str(exc), exc.status, type_="invalid_request_error" if exc.status < 500 else "server_error", code=code
        )

    @app.get("/admin/migrations")
    async def migrations() -> list[dict[str, Any]]:
        """Every recent migration: request (tag), from, to, path, stages, bytes, downtime, outcome."""
        return [record_view(r) for r in client.migrations.records]

    @app.post("/admin/requests/{request_id}/migrate", responses={**CONFLICT, **TIMEOUT})
    async def migrate(request_id: str, body: MigrateBody | None = None) -> dict[str, Any]:
        """Move a running request to worker `to` (or the policy's choice) and wait for the outcome, at
        most `migration.timeout` (and 2 s for the source's answer). 200 with the record when it committed;
        409 when it cannot start or the source kept the request; 504 when no outcome came in time."""
        if len(request_id) > 256:
            raise APIError("request id too long", 400, param="request_id")
        try:
            body = body or MigrateBody()
            wait = client.migrations.cfg.timeout + ANSWER_MARGIN_S
            record = await client.starts.migrate_and_wait(request_id, body.to, wait, body.mode)
        except MigrationError as exc:
            raise fail(exc) from None
        view = record_view(record)
        if not record.done:
            why = (
                f"migration of {view['request']} from worker {record.from_worker} to {record.to_worker} still"
                f" {record.outcome.value} after {wait:g}s; GET /admin/migrations shows how it ends"
            )
            raise APIError(why, 504, "server_error")
        if record.outcome != "committed":
            raise APIError(f"request not migrated ({record.outcome}): {record.error}", 409, code="not_migrated")
        return view

    @app.post("/admin/rollout", status_code=202, responses=CONFLICT)
    async def rollout() -> dict[str, Any]:
        """Restart every worker in turn (replacement ready first, then the old one drained and retired).
        Returns at once; `GET /admin/rollout` shows its progress."""
        try:
            return client.maintenance.start_rollout().view()
        except MigrationError as exc:
            raise fail(exc) from None

    @app.get("/admin/rollout")
    async def rollout_state() -> dict[str, Any]:
        """The last rollout: state, each worker's replacement and step, duration; 404 before the first."""
        if client.maintenance.rollout is None:
            raise APIError("no rollout has run", 404, code="not_found")
        return client.maintenance.rollout.view()

    @app.post("/admin/workers/{worker_id}/drain", status_code=202, responses=CONFLICT)
    async def drain(worker_id: int, force: bool = False) -> dict[str, Any]:
        """Stop sending worker `worker_id` new requests, migrate its requests to others, then retire it
        (it exits; the supervisor starts no replacement). Returns at once; `GET /admin/workers` shows it.
        409 for the last worker serving its role unless `force=true` (the service then stops serving)."""
        if not 0 <= worker_id <= WORKER_ID_MAX:
            raise APIError("worker id out of range", 400, param="worker_id")
        try:
            client.maintenance.drain(worker_id, force)
        except MigrationError as exc:
            raise fail(exc) from None
        w = client.registry.get(worker_id)
        return {"worker": worker_id, "draining": True, "requests": w.load if w is not None else 0}
