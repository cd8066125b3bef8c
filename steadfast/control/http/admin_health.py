"""Admin routes of health detection and routing: `GET /admin/health` (each worker's standing, score with
its terms, the four layers, and the events: standing and layer changes, evictions, with their reasons)
and `GET /admin/routing` (the policy, the prefix hit rate of routed prompts, each worker's indexed cache,
the latest decisions with every candidate's cached tokens and cost). Behind the guard's admin check."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from steadfast.control.http.serving import ServingContext
from steadfast.control.http.tags import request_tag


def add_health_routes(app: FastAPI, ctx: ServingContext) -> None:
    @app.get("/admin/health")
    async def admin_health() -> dict[str, Any]:
        health = ctx.client.health
        return {
            "enabled": health.cfg.enabled,
            "threshold": health.cfg.threshold,
            "retried_requests": health.retried,
            "workers": {str(w.worker_id): health.view(w.worker_id) for w in ctx.client.workers if not w.dead},
            "events": [
                {"at": e.at, "worker_id": e.worker_id, "what": e.what, "reason": e.reason} for e in health.events
            ],
        }

    @app.get("/admin/routing")
    async def admin_routing() -> dict[str, Any]:
        view = ctx.client.router.view([w.worker_id for w in ctx.client.workers if not w.dead])
        for d in view["decisions"]:  # type: ignore[union-attr]
            d["request"] = request_tag(d.pop("request_id"))  # not the id: with it a stream could be resumed
        return view
