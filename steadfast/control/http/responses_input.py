"""The body of `POST /v1/responses` (OpenAI's Responses API, stateless here) and its translation to the chat
request every generating path serves: `instructions` and `input` (text, or items: messages, function calls
and their outputs) made chat messages, `tools` and `tool_choice` made chat's, `text.format` made a
`response_format`, `max_output_tokens` the token limit. What asks for state this server does not keep
(`previous_response_id`, `conversation`, `background`) or for what it cannot do (images, files, hosted tools,
reasoning) is a 400 naming the field."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError

from steadfast.control.http.errors import APIError
from steadfast.control.http.openai_models import (
    INT32_MAX,
    MAX_TOOLS,
    SEED_MAX,
    SEED_MIN,
    TOOL_NAME,
    ChatCompletionRequest,
    JSONObject,
    Number,
    OpenBody,
    Text,
)

MAX_ITEMS = 1024  # input items (as `server.max_messages` bounds a chat's messages)
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# Accepted with no effect: they cannot change what is generated.
_NO_EFFECT = {"service_tier", "prompt_cache_key", "safety_identifier", "stream_options", "prompt_cache_retention"}
# Refused unless null (or their neutral value): state or features not served here.
_REFUSED: dict[str, tuple[Any, ...]] = {
    "previous_response_id": (),
    "conversation": (),
    "background": (False,),
    "prompt": (),
    "max_tool_calls": (),
    "reasoning": ({},),
    "truncation": ("disabled",),
}


class ResponseTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Text
    name: Annotated[str, Field(pattern=TOOL_NAME)] | None = None
    description: Annotated[Text, Field(max_length=8192)] | None = None
    parameters: JSONObject | None = None
    strict: StrictBool | None = None


class ResponsesRequest(OpenBody):
    model: Text
    input: Text | Annotated[list[JSONObject], Field(min_length=1, max_length=MAX_ITEMS)]
    instructions: Text | None = None
    max_output_tokens: Annotated[StrictInt, Field(ge=1, le=INT32_MAX)] | None = None
    temperature: Annotated[Number, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[Number, Field(gt=0.0, le=1.0)] | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    tools: Annotated[list[ResponseTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | JSONObject | None = None
    parallel_tool_calls: StrictBool | None = None
    text: JSONObject | None = None
    include: Annotated[list[Text], Field(max_length=16)] | None = None
    stream: StrictBool = False
    store: StrictBool | None = None  # (nothing is stored: a stored response could not be fetched again anyway)
    metadata: Annotated[dict[Text, Annotated[Text, Field(max_length=512)]], Field(max_length=16)] | None = None
    user: Text | None = None
    # Extensions, as on chat: a seed, top-k, a priority.
    seed: Annotated[StrictInt, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    top_k: Annotated[StrictInt, Field(ge=-1, le=INT32_MAX)] | None = None
    priority: Literal["high", "normal", "low"] = "normal"


def _refuse(param: str, why: str) -> APIError:
    return APIError(f"Unsupported parameter '{param}': {why}.", param=param, code="unsupported_parameter")


def unknown_fields(body: ResponsesRequest) -> list[str]:
    """Undeclared fields nobody documents (to be reported); a 400 for one asking for what is not served."""
    unknown = []
    for name, value in (body.model_extra or {}).items():
        if name in _NO_EFFECT:
            continue
        if name in _REFUSED:
            if value is not None and value not in _REFUSED[name]:
                raise _refuse(name, "not supported by this server (it keeps no state between responses)")
            continue
        unknown.append(name)
    return unknown


def _text_of(content: Any, where: str) -> str:
    """The text of an item's content: a string, or parts of text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(f"'{where}' must be a string or a list of content parts.", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise _refuse(f"{where}[{j}]", f"content of type {str(kind)[:40]!r} is not supported (text only)")
        texts.append(part["text"])
    return "".join(texts)


def _messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return [*messages, {"role": "user", "content": body.input}]
    for i, item in enumerate(body.input):
        kind = item.get("type", "message" if "role" in item else None)
        where = f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(f"'{where}.role' must be user, assistant, system or developer.", param=f"{where}.role")
            messages.append({"role": role, "content": _text_of(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments")},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") and not last["content"]:
                last["tool_calls"].append(call)  # (a turn's calls, one item each: one assistant message)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = _text_of(item.get("output"), f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output})
        else:
            raise _refuse(f"{where}.type", f"input items of type {str(kind)[:40]!r} are not supported")
    return messages


def _tools(body: ResponsesRequest) -> list[dict[str, Any]] | None:
    if body.tools is None:
        return None
    out = []
    for i, t in enumerate(body.tools):
        if t.type != "function":
            raise _refuse(f"tools[{i}].type", f"tools of type {t.type[:40]!r} are not supported (functions only)")
        if t.name is None:
            raise APIError(f"Missing required parameter: 'tools[{i}].name'.", param=f"tools[{i}].name")
        function = {"name": t.name, "description": t.description, "parameters": t.parameters, "strict": t.strict}
        out.append({"type": "function", "function": {k: v for k, v in function.items() if v is not None}})
    return out


def _tool_choice(body: ResponsesRequest) -> Any:
    choice = body.tool_choice
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise _refuse("tool_choice", "a tool choice other than none, auto, required or a function by name")
    return {"type": "function", "function": {"name": choice["name"]}}


def _format(body: ResponsesRequest) -> dict[str, Any] | None:
    text = body.text or {}
    for key in text:
        if key not in ("format", "verbosity"):
            raise APIError(f"Unknown parameter 'text.{key[:40]}'.", param=f"text.{key[:40]}", code="unknown_parameter")
    fmt = text.get("format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise APIError("'text.format.type' must be text, json_object or json_schema.", param="text.format.type")


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request `body` asks for; a 400 naming the Responses field at fault."""
    include = body.include or []
    for i, name in enumerate(include):
        if name != LOGPROBS_INCLUDE:
            raise _refuse(f"include[{i}]", f"{name[:60]!r} is not available here (only {LOGPROBS_INCLUDE!r})")
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": _messages(body),
        "stream": body.stream,
        "priority": body.priority,
        "tools": _tools(body),
        "tool_choice": _tool_choice(body),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": _format(body),
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "seed": body.seed,
        "logprobs": LOGPROBS_INCLUDE in include,
        "top_logprobs": body.top_logprobs,
    }
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise APIError(f"Invalid input ({where}): {first.get('msg', 'invalid value')}.", param="input") from None
