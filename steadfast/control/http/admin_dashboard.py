"""The dashboard's routes: `GET /dashboard` (and its script and style: static, shipped inside the package,
no CDN, nothing in them but code, so they are served to anyone who may reach the router) and `GET
/admin/dashboard?since=T` (the data: behind the guard's admin check like every `/admin` route; the page
asks for the admin key when the router has one)."""

from __future__ import annotations

import math
from importlib import resources
from typing import Annotated, Any

from fastapi import FastAPI, Query
from fastapi.responses import Response

from steadfast.control.http.dashboard import Dashboard
from steadfast.control.http.errors import APIError

# name → media type: the only files served (a fixed set, so no path reaches the file system).
ASSETS = {
    "dashboard.html": "text/html; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
HEADERS = {
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:"
    ),
}


def _asset(name: str) -> bytes:
    return resources.files("steadfast.control.http").joinpath("static", name).read_bytes()


def add_dashboard_routes(app: FastAPI, dashboard: Dashboard) -> None:
    files = {name: _asset(name) for name in ASSETS}  # read once: small, and fixed while the router runs

    def serve(name: str) -> Response:
        return Response(files[name], media_type=ASSETS[name], headers=HEADERS)

    @app.get("/dashboard", response_class=Response, include_in_schema=False)
    async def page() -> Response:
        return serve("dashboard.html")

    @app.get("/dashboard/dashboard.js", response_class=Response, include_in_schema=False)
    async def script() -> Response:
        return serve("dashboard.js")

    @app.get("/dashboard/dashboard.css", response_class=Response, include_in_schema=False)
    async def style() -> Response:
        return serve("dashboard.css")

    @app.get("/admin/dashboard")
    async def state(
        since: Annotated[float, Query(ge=0, description="wall-clock seconds: only points and events after it")] = 0.0,
    ) -> dict[str, Any]:
        """The live picture: latency against the SLO per priority, the level and its history, the chart
        points (one a second) and timeline events after `since`, workers, migrations and takeovers."""
        if not math.isfinite(since):
            raise APIError("since must be a finite number of seconds", 400, param="since")
        return dashboard.state(since)
