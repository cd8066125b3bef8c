"""`/admin/soak` and `/admin/soak.png` (control/http/admin_soak.py): the last soak's report named by
`server.soak_report`, summarised for the dashboard — read when asked, bounded, request ids as tags — and
a clear error when there is none or it cannot be read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from steadfast.control.http import admin_soak
from steadfast.control.http.errors import APIError, api_error_handler

pytestmark = pytest.mark.unit

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def client(path: str) -> TestClient:
    app = FastAPI()
    app.add_exception_handler(APIError, api_error_handler)
    admin_soak.add_soak_routes(app, path)
    return TestClient(app)


def test_the_last_soak_is_summarised_with_its_timeline_and_no_request_id(tmp_path):
    report = tmp_path / "soak.json"
    shutil.copy(RESULTS / "soak_60min_d5d1a41.json", report)  # a real report: a 60-minute soak's that failed
    c = client(str(report))
    r = c.get("/admin/soak")
    assert r.status_code == 200
    got = r.json()
    full = json.loads(report.read_text())
    assert (got["seed"], got["requests"], got["failed"], got["passed"]) == (7, full["requests"], full["failed"], False)
    assert {k["kind"] for k in got["kinds"]} == set(full["fault_kinds"]) | set(full["gaps"])
    kill = next(k for k in got["kinds"] if k["kind"] == "kill-worker")
    assert kill["struck"] == full["fault_kinds"]["kill-worker"]["struck"]
    assert kill["p99_ms"] == full["gaps"]["kill-worker"]["p99_ms"]
    assert len(got["failures"]) == min(admin_soak.SHOWN, len(full["failures"])) and got["failures"]
    assert "chatcmpl-" not in r.text  # request ids shown as tags only
    assert got["timeline"] is False and c.get("/admin/soak.png").status_code == 404
    shutil.copy(RESULTS / "soak_60min_d5d1a41.png", report.with_suffix(".png"))
    assert c.get("/admin/soak").json()["timeline"] is True
    png = c.get("/admin/soak.png")
    assert png.status_code == 200 and png.headers["content-type"] == "image/png"
    assert png.content[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_passed_soak_says_so_with_no_failures(tmp_path):
    report = tmp_path / "soak.json"
    shutil.copy(RESULTS / "soak_60min.json", report)  # the latest 60-minute soak's: passed
    got = client(str(report)).get("/admin/soak").json()
    assert (got["passed"], got["failed"], got["failures"]) == (True, 0, [])
    assert got["requests"] == json.loads(report.read_text())["requests"] > 1000


def test_no_report_configured_missing_unreadable_or_too_big_is_a_clear_error(tmp_path, monkeypatch):
    assert client("").get("/admin/soak").json()["error"]["message"].startswith("no soak report is configured")
    path = tmp_path / "soak.json"
    missing = client(str(path)).get("/admin/soak")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    path.write_text("{not json")
    bad = client(str(path)).get("/admin/soak")
    assert bad.status_code == 500 and "not JSON" in bad.json()["error"]["message"]
    path.write_text("[1, 2]")
    assert "not a JSON object" in client(str(path)).get("/admin/soak").json()["error"]["message"]
    path.write_text(json.dumps({"seed": 1, "failures": [{"request": "x" * 10_000, "error": "e" * 10_000}]}))
    small = client(str(path)).get("/admin/soak").json()
    assert len(small["failures"][0]["error"]) == admin_soak.SHOWN_CHARS and small["passed"] is False
    monkeypatch.setattr(admin_soak, "MAX_REPORT_BYTES", 100)
    big = client(str(path)).get("/admin/soak")
    assert big.status_code == 500 and "over the 100" in big.json()["error"]["message"]
