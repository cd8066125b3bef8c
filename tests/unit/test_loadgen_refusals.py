"""The load generator's patient client (`Workload.retry_refused`): a request refused for load (429 with
Retry-After, as Steadfast's admission control answers) is sent again after the delay, its TTFT counted
from the first send; without it, the refusal is the request's failure. Against a small real HTTP server
that refuses each request once, then streams three chunks."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from steadfast.ops.harness.loadgen import LoadGenerator, Workload
from tests.integration.server import free_port

pytestmark = pytest.mark.unit


def app() -> Starlette:
    seen: set[str] = set()

    async def completions(request: Request):  # noqa: ANN202 - a Starlette endpoint
        body = await request.json()
        if body["prompt"] not in seen:
            seen.add(body["prompt"])
            return JSONResponse({"error": {"message": "overloaded"}}, status_code=429, headers={"Retry-After": "0.2"})

        async def chunks():  # noqa: ANN202
            for word in ("a", "b", "c"):
                yield f"data: {json.dumps({'choices': [{'text': word}]})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])


@pytest.fixture
def url():
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app(), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(5)


@pytest.mark.parametrize("patient", [True, False])
def test_a_refused_request_is_sent_again_after_retry_after_when_asked(url, patient):
    work = Workload(concurrency=2, requests=2, output_tokens=[(3, 1.0)], prompts=("one", "two"), retry_refused=patient)
    samples = asyncio.run(LoadGenerator(url, work, model="m").run())
    assert len(samples) == 2
    for s in samples:
        if patient:
            assert s.ok and s.refusals == 1 and s.tokens == 3
            assert s.ttft is not None and s.ttft >= 0.2  # from the first send, the wait included
        else:
            assert not s.ok and s.status == 429 and s.refusals == 0 and "overloaded" in s.error
