"""Tool calling on chat completions: the tools put before the model, a forced call made a grammar, and
the model's text read back into OpenAI's `tool_calls`.

The model writes each call as a JSON object `{"name": ..., "arguments": {...}}` between `<tool_call>`
and `</tool_call>` (the Hermes form: Qwen2.5, Hermes 2/3 and their tuned offspring write it). A chat
template that writes tools itself in that form gets them (`tools=`, and the history's calls as
`tool_calls` with parsed arguments); any other template gets them in a system message, worded below,
and the history's calls and answers as text in that same form. `tool_choice` `required` or a named
function makes the call a grammar (one or, with `parallel_tool_calls`, more blocks; arguments valid
against the function's `parameters`); `auto` leaves the model free and reads whatever blocks it writes
(one that is not a call of a given tool stays text); `none` puts no tools before the model.

A call's id is made from the request's id, its choice and the call's number, so a stream resumed on
another router (`Last-Event-ID`) or after a takeover names each call as the first run did.
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from steadfast.control.http.errors import APIError
from steadfast.control.http.openai_models import ChatCompletionRequest, ChatMessage, NamedToolChoice

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_ANSWER_OPEN, _ANSWER_CLOSE = "<tool_response>", "</tool_response>"
_ANY_OBJECT: dict[str, Any] = {"type": "object"}
# Inside the grammar: compact JSON, properties in the schema's order (name first), as the prompt shows it.
_COMPACT = {"whitespace_flexible": False}


def native(template: str) -> bool:
    """Whether a chat template writes tools itself, in the form read back here."""
    return "tools" in template and OPEN in template


def _system_text(tools: list[dict[str, Any]]) -> str:
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "You can call functions to help answer. They are described, one JSON object per line, between "
        f"<tools> and </tools>:\n<tools>\n{listed}\n</tools>\n\n"
        "To call one, reply with a JSON object holding its name and its arguments between "
        f'{OPEN} and {CLOSE}, one block per call:\n{OPEN}\n{{"name": "<function name>", "arguments": '
        f"{{<arguments as JSON>}}}}\n{CLOSE}"
    )


def _call_text(name: str, arguments: str) -> str:
    return f'{OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {arguments}}}\n{CLOSE}'


def _arguments(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise APIError(f"'{where}' is not JSON.", param=where) from None


def check(body: ChatCompletionRequest) -> None:
    """A 400 for tool fields that do not fit together (a named tool that is not given, a choice without tools)."""
    choice = body.tool_choice
    names = [t.function.name for t in body.tools or ()]
    if not names and choice not in (None, "none"):
        raise APIError("'tool_choice' is only allowed when 'tools' are given.", param="tool_choice")
    if len(set(names)) != len(names):
        raise APIError("Each tool's function name must be unique.", param="tools")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise APIError(f"'tool_choice' names {choice.function.name!r}, not one of 'tools'.", param="tool_choice")


def offered(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The tools put before the model (none for `tool_choice` `none`)."""
    if not body.tools or body.tool_choice == "none":
        return []
    return [t.model_dump(exclude_none=True) for t in body.tools]


def prompt_messages(body: ChatCompletionRequest, template_native: bool) -> list[dict[str, Any]]:
    """The messages as the chat template is given them: plain text in each, except for a template that
    writes tools itself (which gets the history's calls as `tool_calls`)."""
    tools = offered(body)
    out: list[dict[str, Any]] = []
    for i, m in enumerate(body.messages):
        out.append(_message(m, i, template_native))
    if template_native:
        return out
    merged: list[dict[str, Any]] = []
    for m in out:  # consecutive tool answers are one user turn (templates that check turns alternate)
        if m["role"] == "tool":
            answer = f"{_ANSWER_OPEN}\n{m['content']}\n{_ANSWER_CLOSE}"
            if merged and merged[-1].get("answers"):
                merged[-1]["content"] += "\n" + answer
            else:
                merged.append({"role": "user", "content": answer, "answers": True})
        else:
            merged.append(m)
    for m in merged:
        m.pop("answers", None)
    if tools:
        text = _system_text(tools)
        if merged and merged[0]["role"] in ("system", "developer"):
            merged[0] = {**merged[0], "content": f"{merged[0]['content']}\n\n{text}".lstrip()}
        else:
            merged.insert(0, {"role": "system", "content": text})
    return merged


def prompt_chars(messages: list[dict[str, Any]], offered_natively: list[dict[str, Any]]) -> int:
    """Characters of what the template is given: the messages' text, and the calls and tools it writes."""
    chars = sum(len(m["content"]) for m in messages)
    chars += sum(len(json.dumps(m["tool_calls"], ensure_ascii=False)) for m in messages if m.get("tool_calls"))
    return chars + (len(json.dumps(offered_natively, ensure_ascii=False)) if offered_natively else 0)


def _message(m: ChatMessage, index: int, template_native: bool) -> dict[str, Any]:
    content = m.text()
    if not m.tool_calls:
        return {"role": m.role, "content": content}
    if m.role != "assistant":
        raise APIError("Only an assistant message may hold 'tool_calls'.", param=f"messages[{index}].tool_calls")
    if template_native:
        calls = [
            {
                "id": c.id,
                "type": "function",
                "function": {
                    "name": c.function.name,
                    "arguments": _arguments(c.function.arguments, f"messages[{index}].tool_calls.arguments"),
                },
            }
            for c in m.tool_calls
        ]
        return {"role": "assistant", "content": content, "tool_calls": calls}
    for c in m.tool_calls:
        _arguments(c.function.arguments, f"messages[{index}].tool_calls.arguments")
    calls_text = "\n".join(_call_text(c.function.name, c.function.arguments.strip()) for c in m.tool_calls)
    return {"role": "assistant", "content": f"{content}\n{calls_text}" if content else calls_text}


def forced(body: ChatCompletionRequest) -> tuple[dict[str, Any], bool] | None:
    """A forced call (`required`, a named function) as the JSON schema of one call and whether several
    may follow one another; None where the model is free."""
    choice = body.tool_choice
    if not body.tools or choice not in ("required",) and not isinstance(choice, NamedToolChoice):
        return None
    tools = body.tools
    if isinstance(choice, NamedToolChoice):
        tools = [t for t in tools if t.function.name == choice.function.name]

    def one(t: Any) -> dict[str, Any]:
        return {
            "type": "object",
            "properties": {"name": {"const": t.function.name}, "arguments": t.function.parameters or _ANY_OBJECT},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }

    schema: dict[str, Any] = one(tools[0]) if len(tools) == 1 else {"anyOf": [one(t) for t in tools]}
    many = not isinstance(choice, NamedToolChoice) and body.parallel_tool_calls is not False
    return schema, many


def call_grammar(schema: dict[str, Any], many: bool) -> str:
    """The Lark grammar of a forced call: one block of `schema`, or one or more blocks a line apart."""
    calls = 'call ("\\n" call)*' if many else "call"
    inside = json.dumps({**schema, "x-guidance": _COMPACT})
    return f"start: {calls}\ncall: {json.dumps(OPEN + chr(10))} %json {inside} {json.dumps(chr(10) + CLOSE)}\n"


def call_id(request_id: str, choice: int, index: int) -> str:
    digest = hashlib.blake2b(f"{request_id}/{choice}/{index}".encode(), digest_size=12).hexdigest()
    return f"call_{digest}"


def _longest_open_prefix(text: str) -> int:
    """Characters at the end of `text` that could begin `<tool_call>`."""
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-k:]):
            return k
    return 0


class _Mode(enum.Enum):
    TEXT = "text"  # content
    BLOCK = "block"  # inside a block, not yet known to be a call
    ARGUMENTS = "arguments"  # a call's arguments, sent as they come
    TAIL = "tail"  # after a call's arguments, up to the block's end


# A call's opening as the forced grammar writes it (and as models mostly do): its name, then its arguments.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_.\-]{1,64})"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')


@dataclass
class ToolReader:
    """Reads one choice's text as it comes into content and calls, as OpenAI streams them: a call's
    first delta names it (id, function name), the next ones carry its arguments' text as the model writes
    it. Text that may open a call block, and trailing whitespace (dropped next to a call), wait until they
    are told apart. A block that does not open as a call of one of `names` is read whole when it ends:
    a call if it reads as one, else text."""

    names: frozenset[str]
    make_id: Callable[[int], str]
    calls: int = 0
    _buf: str = ""
    _mode: _Mode = _Mode.TEXT
    _gap: str = ""
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """The content and the call deltas `text` releases."""
        self._buf += text
        content: list[str] = []
        deltas: list[dict[str, Any]] = []
        while self._step(content, deltas):
            pass
        return "".join(content), _joined(deltas)

    def _step(self, content: list[str], deltas: list[dict[str, Any]]) -> bool:
        """One move of the reader; False when it needs more text."""
        if self._mode is _Mode.TEXT:
            at = self._buf.find(OPEN)
            if at < 0:
                ready = self._buf[: len(self._buf) - _longest_open_prefix(self._buf)]
                released = ready.rstrip()
                content.append(released)
                self._buf = self._buf[len(released) :]
                return False
            before = self._buf[:at]
            content.append(before.rstrip())
            self._gap = before[len(before.rstrip()) :]  # (dropped if the block is a call)
            self._buf = self._buf[at + len(OPEN) :]
            self._mode = _Mode.BLOCK
            return True
        if self._mode is _Mode.BLOCK:
            head = _HEAD.match(self._buf)
            if head is not None and head[1] in self.names:
                deltas.append(self._opened(head[1], ""))
                self._buf = self._buf[head.end() :]
                self._mode, self._depth, self._in_string, self._escaped = _Mode.ARGUMENTS, 0, False, False
                return True
            at = self._buf.find(CLOSE)
            if at < 0:
                return False
            block, self._buf = self._buf[:at], self._buf[at + len(CLOSE) :]
            self._mode = _Mode.TEXT
            call = self._whole(block)
            if call is None:
                content.append(self._gap + OPEN + block + CLOSE)
            else:
                deltas.append(call)
            return True
        if self._mode is _Mode.ARGUMENTS:
            end = self._scan()
            part, self._buf = self._buf[:end], self._buf[end:]
            if part:
                deltas.append({"index": self.calls - 1, "function": {"arguments": part}})
            if self._depth or not part:
                return False
            self._mode = _Mode.TAIL
            return True
        at = self._buf.find(CLOSE)
        if at < 0:
            return False
        self._buf = self._buf[at + len(CLOSE) :]
        self._mode = _Mode.TEXT
        return True

    def _scan(self) -> int:
        """Characters of the buffer that belong to the arguments' JSON (all, until its last brace)."""
        for i, ch in enumerate(self._buf):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if not self._depth:
                    return i + 1
        return len(self._buf)

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What is held when the choice ends: a block never closed is a call if it reads as one (a call
        cut short keeps the arguments it sent)."""
        rest, self._buf = self._buf, ""
        mode, self._mode = self._mode, _Mode.TEXT
        if mode is _Mode.BLOCK:
            call = self._whole(rest)
            return ("", [call]) if call is not None else (self._gap + OPEN + rest, [])
        if mode is _Mode.TEXT:
            return (rest if rest.strip() or not self.calls else ""), []
        return "", []

    def _opened(self, name: str, arguments: str) -> dict[str, Any]:
        index = self.calls
        self.calls += 1
        return {
            "index": index,
            "id": self.make_id(index),
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }

    def _whole(self, block: str) -> dict[str, Any] | None:
        """A whole block read as a call, or None."""
        try:
            value = json.loads(block)
        except ValueError:
            return None
        if not isinstance(value, dict) or value.get("name") not in self.names:
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        return self._opened(value["name"], json.dumps(arguments, ensure_ascii=False))


def _joined(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Deltas of one call in a row made one (its arguments' pieces put together)."""
    out: list[dict[str, Any]] = []
    for d in deltas:
        if out and out[-1]["index"] == d["index"]:
            out[-1]["function"]["arguments"] += d["function"]["arguments"]
        else:
            out.append({**d, "function": dict(d["function"])})
    return out


def gathered(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Call deltas put together into whole calls, as a client gathers them."""
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        one = calls.setdefault(d["index"], {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
        one["id"] = d.get("id", one["id"])
        one["function"]["name"] += d["function"].get("name", "")
        one["function"]["arguments"] += d["function"]["arguments"]
    return [calls[i] for i in sorted(calls)]


def readers(body: ChatCompletionRequest, request_id: str) -> Callable[[int], ToolReader | None]:
    """Each choice's reader for a request that offers tools, else None (its text is all content)."""
    given = body.tools and body.tool_choice != "none"  # (as `offered`: none put before the model, none read)
    names = frozenset(t.function.name for t in body.tools or ()) if given else frozenset()

    def reader(choice: int) -> ToolReader | None:
        return ToolReader(names, lambda i: call_id(request_id, choice, i)) if names else None

    return reader


def message(text: str, tool_reader: ToolReader | None) -> dict[str, Any]:
    """A finished choice's assistant message."""
    if tool_reader is None:
        return {"role": "assistant", "content": text}
    content, deltas = tool_reader.feed(text)
    rest, more = tool_reader.finish()
    content, calls = content + rest, gathered(deltas + more)
    out: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
    if calls:
        out["tool_calls"] = calls
    return out
