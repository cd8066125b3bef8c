"""Structured logs: STEADFAST_LOG_FORMAT=json gives one JSON object a line, with the request's id as a field
on the lines about one request (the same id in the router's, the workers' and the pools' lines)."""

from __future__ import annotations

import io
import json
import logging
import os

import pytest

from steadfast.util.log import about, setup_logging

pytestmark = pytest.mark.unit


def capture(monkeypatch, fmt: str) -> io.StringIO:
    monkeypatch.setenv("STEADFAST_LOG_FORMAT", fmt)
    out = io.StringIO()
    monkeypatch.setattr("sys.stderr", out)  # logging's StreamHandler writes to sys.stderr as it is now
    setup_logging("worker3")
    return out


def test_json_lines_carry_the_process_the_level_and_the_request_id(monkeypatch):
    out = capture(monkeypatch, "json")
    log = logging.getLogger("steadfast.test")
    log.warning("request %s: moved at token %d", "cmpl-abc", 7, extra=about("cmpl-abc"))
    log.info('no request here: "quoted" and ünïcode')
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert lines[0]["message"] == "request cmpl-abc: moved at token 7" and lines[0]["request_id"] == "cmpl-abc"
    assert (
        lines[0]["process"] == "worker3" and lines[0]["level"] == "WARNING" and lines[0]["logger"] == "steadfast.test"
    )
    assert lines[0]["time"].endswith("+00:00") and isinstance(lines[0]["pid"], int)
    assert "request_id" not in lines[1] and lines[1]["message"] == 'no request here: "quoted" and ünïcode'
    assert lines[2]["level"] == "ERROR" and "ValueError: boom" in lines[2]["exc"]
    logging.getLogger().handlers.clear()


def test_text_is_the_default(monkeypatch):
    out = capture(monkeypatch, "")
    logging.getLogger("steadfast.test").warning("plain %s", "text", extra=about("cmpl-x"))
    line = out.getvalue().strip()
    assert line.endswith(f"worker3[{os.getpid()}] WARNING steadfast.test: plain text")
    logging.getLogger().handlers.clear()
