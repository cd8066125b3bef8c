"""OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}` with a fitting status."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from steadfast.control.ladder.plan import Refusal


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """The schema of every error answer (for /openapi.json)."""

    error: ErrorDetail


class APIError(Exception):
    def __init__(
        self,
        message: str,
        status: int = 400,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        # ASCII-escaped: a message that quotes the client's input (a model name holding a lone
        # surrogate) must still be a body we can send.
        content = json.dumps(self.body(), ensure_ascii=True)
        return Response(content, status_code=self.status, headers=self.headers, media_type="application/json")


def refusal_error(refusal: Refusal) -> APIError:
    """The ladder's refusal as the client sees it: 429 rate_limit_error or 503 service_unavailable,
    with Retry-After."""
    kind = "rate_limit_error" if refusal.status == 429 else "service_unavailable"
    headers = {"Retry-After": str(refusal.retry_after)}
    return APIError(refusal.message, refusal.status, type_=kind, code=refusal.code, headers=headers)


# Names pydantic puts in an error's location for the member of a union that failed, not a field.
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _describe(errors: list[Any]) -> tuple[str, str | None]:
    first = errors[0]
    loc = [
        str(p)
        for p in first.get("loc", ())
        if p != "body" and (isinstance(p, int) or (p.isidentifier() and p not in _TYPE_TAGS))
    ]
    param = ".".join(loc) or None
    kind = first.get("type", "")
    if kind == "json_invalid":
        return "We could not parse the JSON body of your request: it is not valid JSON.", None
    if kind == "missing":
        return f"Missing required parameter: '{param}'.", param
    msg = first.get("msg", "invalid value")
    return (f"Invalid value for '{param}': {msg}." if param else f"Invalid request: {msg}."), param


async def validation_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    errors = list(exc.errors())
    if not errors:
        return APIError("Invalid request.").response()
    message, param = _describe(errors)
    # A body that is not a JSON object at all is malformed, not merely invalid.
    return APIError(message, 400, param=param, code="invalid_json" if param is None else None).response()


async def api_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def http_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return APIError(str(exc.detail), exc.status_code, type_=type_).response()
