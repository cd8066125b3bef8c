"""Undeclared request fields: a peer's refused unless neutral, OpenAI's no-effect ones accepted, the rest
reported in a bounded header and logged once (control/http/fields.py)."""

from __future__ import annotations

import logging

import pytest
from pydantic import ValidationError

from steadfast.control.http.errors import APIError
from steadfast.control.http.fields import IGNORED_HEADER, IgnoredReport, unknown_fields
from steadfast.control.http.openai_models import ChatCompletionRequest, CompletionRequest
from steadfast.control.http.resume_token import body_digest

pytestmark = pytest.mark.unit

HI = [{"role": "user", "content": "hi"}]


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": HI, **fields})


def test_a_peer_field_is_refused_unless_neutral_and_a_bool_is_not_a_number():
    assert unknown_fields(chat(length_penalty=1.0, typical_p=1, skip_special_tokens=True), chat=True) == []
    for fields, param in [
        ({"length_penalty": 1.1}, "length_penalty"),
        ({"length_penalty": True}, "length_penalty"),  # (True == 1 in Python)
        ({"skip_special_tokens": 1}, "skip_special_tokens"),
        ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
        ({"function_call": "auto"}, "function_call"),
    ]:
        with pytest.raises(APIError) as e:
            unknown_fields(chat(**fields), chat=True)
        assert e.value.param == param and e.value.status == 400


def test_fields_of_one_endpoint_only_and_nested_fields():
    # `add_special_tokens` is vLLM's on both, neutral at False in chat and True in completions.
    done = CompletionRequest.model_validate({"model": "m", "prompt": "x", "add_special_tokens": True})
    assert unknown_fields(done, chat=False) == []
    with pytest.raises(APIError):
        unknown_fields(
            CompletionRequest.model_validate({"model": "m", "prompt": "x", "echo": False, "add_special_tokens": False}),
            chat=False,
        )
    body = chat(
        messages=[{"role": "tool", "content": "42", "tool_call_id": "c1", "cache_control": {}}],
        stream_options={"include_usage": True, "include_obfuscation": False, "novel": 1},
    )
    assert unknown_fields(body, chat=True) == ["stream_options.novel", "messages[0].cache_control"]


def test_openai_no_effect_fields_are_bounded():
    assert unknown_fields(chat(metadata={"k": "v"}, service_tier="flex", prompt_cache_key="p", store=False), True) == []
    for bad in [{"store": True}, {"metadata": {"k": 1}}, {"metadata": {str(i): "v" for i in range(17)}}]:
        with pytest.raises(APIError):
            unknown_fields(chat(**bad), chat=True)


def test_undeclared_fields_hold_valid_unicode_and_do_not_change_the_digest_by_their_order():
    with pytest.raises(ValidationError):
        chat(odd="\ud800")
    a = ChatCompletionRequest.model_validate({"model": "m", "messages": HI, "b": 1, "a": 2})
    b = ChatCompletionRequest.model_validate({"a": 2, "model": "m", "b": 1, "messages": HI})
    assert body_digest(a) == body_digest(b)
    assert body_digest(a) != body_digest(chat(a=2, b=3))


def test_the_report_is_bounded_and_said_once(caplog):
    report = IgnoredReport()
    assert report.header([]) == {}
    names = [f"f{i}" for i in range(20)] + ["bad\r\nname" + "x" * 100]
    with caplog.at_level(logging.WARNING):
        header = report.header(names)[IGNORED_HEADER]
        report.header(names)
    assert header.startswith("f0,f1,") and header.endswith(",+5 more") and "\r" not in header
    assert sum("were ignored" in r.message for r in caplog.records) == 1
