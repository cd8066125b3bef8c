"""Structured outputs a request asks for, in any of the forms clients send, made one llguidance grammar:
OpenAI's `response_format` (`json_object`, `json_schema`), vLLM's `structured_outputs` and `guided_*`,
SGLang's `regex`, `ebnf` and `json_schema`, llama.cpp's `grammar` and `json_schema`.

Every grammar is checked (bounded work: model/grammar.py's limits) off the event loop before the
request is admitted, and a checked one is remembered, so a client sending the same schema again costs a
dictionary lookup. A bad one is a 400 naming the field. One form per request: two are a 400.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from steadfast.control.http import tools
from steadfast.control.http.errors import APIError
from steadfast.control.http.openai_models import ChatCompletionRequest
from steadfast.model import grammar
from steadfast.model.tokenizer import GGUFTokenizer

MAX_SPEC_CHARS = 64 * 1024  # a schema (as JSON), a regex or a grammar: it travels to the worker and the ledger
MAX_SCHEMA_DEPTH = 32
MAX_CHOICES, MAX_CHOICE_CHARS = 256, 1024
MAX_NAME_CHARS = 64
_CACHED = 256  # grammars remembered as checked


@dataclass(frozen=True)
class Asked:
    """One structured output asked for: the field that asked, its kind and what it gave."""

    param: str
    kind: str  # "json", "regex", "choice", "grammar", "tool" (a forced call: its schema, several or not)
    value: Any


def _bad(param: str, why: str) -> APIError:
    return APIError(f"Invalid '{param}': {why}", param=param, code="invalid_structured_output")


def _depth(value: Any) -> int:
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if depth > MAX_SCHEMA_DEPTH:
            break
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        stack.extend((c, depth + 1) for c in children)
    return deepest


def _response_format(value: dict[str, Any]) -> Asked | None:
    kind = value.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return Asked("response_format", "json", {"type": "object"})
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise _bad("response_format", "a 'json_schema' response format needs a 'json_schema' object.")
        name = spec.get("name")
        if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS:
            raise _bad("response_format.json_schema.name", f"a name of 1 to {MAX_NAME_CHARS} characters is required.")
        schema = spec.get("schema", {})
        if not isinstance(schema, dict | bool):
            raise _bad("response_format.json_schema.schema", "the schema must be a JSON object.")
        return Asked("response_format.json_schema.schema", "json", schema)
    raise _bad("response_format", f"the type must be 'text', 'json_object' or 'json_schema', not {str(kind)[:64]!r}.")


# vLLM's `structured_outputs` keys (and its older `guided_*` fields): the kind each asks for.
_VLLM_KINDS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar"}
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
# SGLang's and llama.cpp's top-level fields.
_TOP = {"regex": "regex", "ebnf": "grammar", "grammar": "grammar", "json_schema": "json"}


# Other `structured_outputs` keys of vLLM's: these cannot change the output here (one backend; its JSON
# never has free whitespace), the two after them would and are refused unless neutral.
_SO_NO_EFFECT = {"backend", "_backend", "disable_fallback", "disable_any_whitespace"}
_SO_NEUTRAL = {"disable_additional_properties": False, "whitespace_pattern": None}


def _check_options(so: dict[str, Any]) -> None:
    for key, value in so.items():
        if key in _VLLM_KINDS or key in ("json_object", "structural_tag") or key in _SO_NO_EFFECT:
            continue
        where = f"structured_outputs.{key[:64]}"
        if key in _SO_NEUTRAL:
            if value not in (None, _SO_NEUTRAL[key]):
                raise APIError(
                    f"Unsupported parameter '{where}': not supported by this server.",
                    param=where,
                    code="unsupported_parameter",
                )
            continue
        raise APIError(f"Unknown parameter '{where}'.", param=where, code="unknown_parameter")


def asked_for(body: Any) -> Asked | None:
    """What `body` asks for (None: free text); a 400 for two forms at once or a malformed one."""
    found: list[Asked] = []
    if getattr(body, "response_format", None):
        rf = _response_format(body.response_format)
        if rf is not None:
            found.append(rf)
    so = getattr(body, "structured_outputs", None)
    if so:
        _check_options(so)
        if so.get("json_object"):
            found.append(Asked("structured_outputs.json_object", "json", {"type": "object"}))
        for key, kind in _VLLM_KINDS.items():
            if so.get(key) is not None:
                found.append(Asked(f"structured_outputs.{key}", kind, so[key]))
        if so.get("structural_tag") is not None:
            raise APIError(
                "Unsupported parameter 'structured_outputs.structural_tag': structural tags are not supported.",
                param="structured_outputs.structural_tag",
                code="unsupported_parameter",
            )
    forced = tools.forced(body) if isinstance(body, ChatCompletionRequest) else None
    if forced is not None:
        found.append(Asked("tool_choice", "tool", forced))
    for table in (_GUIDED, _TOP):
        for field, kind in table.items():
            value = getattr(body, field, None)
            if value is not None:
                found.append(Asked(field, kind, value))
    if len(found) > 1:
        names = ", ".join(f"'{a.param}'" for a in found)
        raise APIError(
            f"Only one structured output may be asked for; this request asks for {names}.", param=found[1].param
        )
    return found[0] if found else None


def _text(asked: Asked) -> str:
    """The grammar of `asked`: a 400 for a value of the wrong shape or size."""
    value = asked.value
    if asked.kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise _bad(asked.param, f"the schema is not JSON ({exc}).") from exc
        if not isinstance(value, dict | bool):
            raise _bad(asked.param, "the schema must be a JSON object.")
        if _depth(value) > MAX_SCHEMA_DEPTH:
            raise _bad(asked.param, f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels.")
        if len(json.dumps(value)) > MAX_SPEC_CHARS:
            raise _bad(asked.param, f"the schema is over {MAX_SPEC_CHARS} characters as JSON.")
        return grammar.from_json_schema(value)
    if asked.kind == "tool":
        schema, many = value
        if _depth(schema) > MAX_SCHEMA_DEPTH + 2:  # (the call object and its `arguments` add two levels)
            raise _bad("tools", f"a function's parameters nest deeper than {MAX_SCHEMA_DEPTH} levels.")
        if len(json.dumps(schema)) > MAX_SPEC_CHARS:
            raise _bad("tools", f"the called functions' parameters are over {MAX_SPEC_CHARS} characters as JSON.")
        return grammar.from_lark(tools.call_grammar(schema, many))
    if asked.kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise _bad(asked.param, "a choice is a non-empty list of non-empty strings.")
        if len(value) > MAX_CHOICES or any(len(c) > MAX_CHOICE_CHARS for c in value):
            raise _bad(asked.param, f"at most {MAX_CHOICES} choices of at most {MAX_CHOICE_CHARS} characters each.")
        return grammar.from_choice(value)
    if not isinstance(value, str) or not value:
        raise _bad(asked.param, "a non-empty string is required.")
    if len(value) > MAX_SPEC_CHARS:
        raise _bad(asked.param, f"it is over {MAX_SPEC_CHARS} characters.")
    return grammar.from_regex(value) if asked.kind == "regex" else grammar.from_grammar(value)


def _refused(asked: Asked, why: str) -> APIError:
    if asked.kind == "tool":  # (the grammar is made here: its text would not help; the schema at fault would)
        return _bad(
            "tools", "a function's parameters are not a schema the grammar engine takes: " + why.split("\n")[0][:300]
        )
    return _bad(asked.param, why[:500])


class Grammars:
    """The grammars the router has checked, and the model's vocabulary they are checked against."""

    def __init__(self, tokenizer: GGUFTokenizer) -> None:
        self.tokenizer = tokenizer
        self._vocabulary: Any = None
        self._checked: OrderedDict[str, str] = OrderedDict()  # grammar -> "" (fine) or why not
        self._lock = threading.Lock()

    def _check(self, text: str) -> str:
        with self._lock:
            if self._vocabulary is None:
                self._vocabulary = grammar.ll_tokenizer(self.tokenizer)
        try:
            grammar.check(text, self._vocabulary)
        except grammar.GrammarError as exc:
            return str(exc) or "the grammar is invalid"
        return ""

    async def of(self, body: Any, off_loop: Callable[..., Awaitable[Any]]) -> str:
        """The checked grammar `body` asks for ("": none); a 400 naming the field for a bad one."""
        asked = asked_for(body)
        if asked is None:
            return ""
        try:
            text = _text(asked)
        except grammar.GrammarError as exc:
            raise _refused(asked, str(exc)) from exc
        why = self._checked.get(text)
        if why is None:
            why = await off_loop(self._check, text)
            with self._lock:
                self._checked[text] = why
                while len(self._checked) > _CACHED:
                    self._checked.popitem(last=False)
        if why:
            raise _refused(asked, why)
        return text
