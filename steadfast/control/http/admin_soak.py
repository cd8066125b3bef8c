"""`GET /admin/soak`: the last nemesis soak's report (`steadfast chaos soak --json FILE`, or
`benchmarks/bench_soak.py --out FILE`) named by `server.soak_report`, summarised for the dashboard; and
`GET /admin/soak.png`, its timeline of faults against the clients' gaps, the PNG beside it (same name,
`.png`). Read when asked, so a new soak's report shows without a restart; bounded in size; the path comes
from the config alone, never from a client; behind the admin check like every `/admin` route. Request ids
are shown as tags (a request id and its resume token resume a stream)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response

from steadfast.control.http.errors import APIError
from steadfast.control.http.tags import request_tag

MAX_REPORT_BYTES = 16 * 2**20  # a 60-minute soak's report is ~80 kB (452 faults, its failures)
MAX_PNG_BYTES = 8 * 2**20  # its timeline ~100 kB
SHOWN = 10  # failures and longest gaps shown, at most
SHOWN_CHARS = 300  # of each text a report carries (an error, a fault's description)


# A request id quoted inside a text (an error saying which request): shown as its tag too.
REQUEST_ID = re.compile(r"\b(?:chatcmpl|cmpl)-[0-9a-f]{8,}\b")


def _text(value: Any) -> str:
    return REQUEST_ID.sub(lambda m: request_tag(m.group()), str(value)[:SHOWN_CHARS])


def _number(value: Any) -> float | int | None:
    return value if isinstance(value, int | float) and not isinstance(value, bool) else None


def summary(report: dict[str, Any], when: float, timeline: bool) -> dict[str, Any]:
    """What the dashboard shows of a report: its verdict and figures, faults and gaps by kind, the
    first failures and longest gaps (request ids as tags), each text cut short."""
    kinds = report.get("fault_kinds") or {}
    gaps = report.get("gaps") or {}
    rows = []
    for kind in sorted(set(kinds) | set(gaps)):
        f, g = kinds.get(kind) or {}, gaps.get(kind) or {}
        row = {"kind": _text(kind), "struck": _number(f.get("struck")), "proven": _number(f.get("proven"))}
        rows.append(row | {k: _number(g.get(k)) for k in ("streams", "p50_ms", "p99_ms", "max_ms")})
    tokens = report.get("tokens") or {}
    failures = [
        {
            "request": request_tag(str(x.get("request", ""))),
            "error": _text(x.get("error") or ""),
            "tokens": _text(x.get("tokens", "")),
        }
        for x in (report.get("failures") or [])[:SHOWN]
        if isinstance(x, dict)
    ]
    longest = [
        {
            "gap_ms": _number(x.get("gap_ms")),
            "at_s": _number(x.get("at_s")),
            "request": request_tag(str(x.get("request", ""))),
            "fault": _text(x.get("fault", "")),
        }
        for x in (report.get("longest_gaps") or [])[:SHOWN]
        if isinstance(x, dict)
    ]
    run = report.get("run") or {}
    return {
        "written_at": when,
        "command": _text(run.get("command", "")) if isinstance(run, dict) else "",
        "seed": _number(report.get("seed")),
        "duration_s": _number(report.get("duration_s")),
        "passed": report.get("passed") is True,
        **{k: _number(report.get(k)) for k in ("requests", "exact", "refused", "failed", "reconnects", "faults")},
        "faults_proven": _number(report.get("faults_proven")),
        "tokens": {k: _number(tokens.get(k)) for k in ("lost", "repeated", "changed")},
        "problems": {k: len(report.get(k) or []) for k in ("history_problems", "node_problems", "leaks")},
        "kinds": rows,
        "failures": failures,
        "longest_gaps": longest,
        "timeline": timeline,  # its PNG is beside it: /admin/soak.png
    }


def _read(path: Path, limit: int, what: str) -> bytes:
    try:
        size = path.stat().st_size
        if size > limit:
            raise APIError(
                f"the soak {what} is {size} bytes, over the {limit} this route reads", 500, type_="server_error"
            )
        return path.read_bytes()
    except FileNotFoundError as exc:
        raise APIError(f"no soak {what} where server.soak_report says", 404, type_="not_found_error") from exc
    except OSError as exc:
        raise APIError(f"the soak {what} cannot be read: {exc.strerror}", 500, type_="server_error") from exc


def add_soak_routes(app: FastAPI, report_path: str) -> None:
    """`report_path`: `server.soak_report` (empty: no soak to show, both routes answer 404)."""

    def where() -> Path:
        if not report_path:
            raise APIError(
                "no soak report is configured (server.soak_report)", 404, type_="not_found_error", code="not_found"
            )
        return Path(report_path)

    @app.get("/admin/soak")
    async def soak() -> dict[str, Any]:
        """The last soak's verdict and figures (server.soak_report), for the dashboard's panel."""
        path = where()
        raw = _read(path, MAX_REPORT_BYTES, "report")
        try:
            report = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise APIError(f"the soak report is not JSON: {exc}", 500, type_="server_error") from exc
        if not isinstance(report, dict):
            raise APIError("the soak report is not a JSON object", 500, type_="server_error")
        return summary(report, path.stat().st_mtime, path.with_suffix(".png").is_file())

    @app.get("/admin/soak.png", response_class=Response)
    async def timeline() -> Response:
        """The last soak's timeline: faults against the clients' gaps (the PNG beside the report)."""
        raw = _read(where().with_suffix(".png"), MAX_PNG_BYTES, "timeline")
        return Response(raw, media_type="image/png", headers={"Cache-Control": "no-cache"})
