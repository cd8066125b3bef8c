"""Admin routes of the degradation ladder: `GET /admin/degradation` (the level, what it does to each
priority, why, the signals and the history of changes) and `POST /admin/degradation` (an operator's
level, or back to automatic control). Behind the guard's admin check like every `/admin` route."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from steadfast.control.http.errors import APIError
from steadfast.control.http.serving import ServingContext
from steadfast.control.ladder.ladder import Level
from steadfast.control.ladder.view import ladder_view


class LevelBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    level: Annotated[StrictInt, Field(ge=0, le=5)] | Literal["auto"] = Field(
        description="0..5 holds that level until set back to auto"
    )


def add_degradation_routes(app: FastAPI, ctx: ServingContext) -> None:
    def ladder() -> Any:
        if ctx.degradation is None:
            raise APIError("This router runs no degradation ladder.", 404, type_="not_found_error")
        return ctx.degradation

    @app.get("/admin/degradation")
    async def degradation() -> dict[str, Any]:
        return ladder_view(ladder())

    @app.post("/admin/degradation")
    async def set_degradation(body: LevelBody) -> dict[str, Any]:
        d = ladder()
        if body.level == "auto":
            d.set_level(None)
        else:
            d.set_level(Level(body.level))
            await d.tick()  # the workers hear the new orders now, not at the next tick
        return ladder_view(d)
