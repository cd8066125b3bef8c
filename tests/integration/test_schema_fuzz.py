"""The live server against its own `/openapi.json`: schemathesis generates requests for every operation,
valid and invalid, and every answer must be no 5xx, a documented status and content type, and a body and
headers that fit the schema.

One server (the small model, fp32, a 256-token context) is shared by the module; the schema is loaded from
it lazily, once it is up. Schemathesis's coverage phase (boundary values of every field, each field made
invalid in turn) runs before its random one; a valid body is pointed at the served model only where its
completion is cheap (`aim_at_engine`), which keeps the module at half a minute.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.integration.server import ServerProcess

pytestmark = pytest.mark.integration

# Checked on every answer. Not `positive_data_acceptance`: a request the schema allows may still be refused
# for what it means (a model this server does not serve is a 404, a prompt over the context or an
# unsupported `n` a 400), which the schema cannot say. `negative_data_rejection` stays: a body the schema
# forbids must be a 4xx (ours are 400, see errors.py).
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
    negative_data_rejection,
]
# A generated request that names the served model and asks for at most this many tokens (or for more than
# the context holds, which admission refuses at once) runs on the engine; others are answered before it.
CHEAP_TOKENS = 32
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def server(tmp_path_factory, small_model_path):
    s = ServerProcess(
        tmp_path_factory.mktemp("schema-fuzz"),
        f"model: {{dtype: float32, max_model_len: {MAX_MODEL_LEN}}}\ncache: {{kv_memory_mb: 64}}\n"
        # The ladder off: a burst of fuzzed requests on two busy cores can open its circuit breaker, whose
        # 503 is the right answer to overload (tested in test_degradation.py), not a schema failure.
        "server: {standby_workers: 0}\ndegradation: {enabled: false}\n",
        model=small_model_path,
    )
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def model(server) -> str:
    return httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]


@pytest.fixture(scope="module")
def api_schema(server):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    schema.config.update(base_url=server.url)
    return schema


@pytest.fixture(autouse=True)
def _nodeid_for_schemathesis(request):
    # schemathesis 4.32 renames the test per operation through `Node._nodeid`, which pytest 9.2 dropped.
    if not hasattr(request.node, "_nodeid"):
        request.node._nodeid = request.node.nodeid


# Draining a worker or restarting them all is what these routes are for, not a fault: a fuzzed call would
# leave the module's server without a worker. Their inputs are tested in test_migration.py.
schema = schemathesis.pytest.from_fixture("api_schema").exclude(method="POST", path_regex="drain|rollout")


def aim_at_engine(body: Any, model: str) -> None:
    """Name the served model in a valid body whose completion is cheap, so that it gets past the model
    check to tokenization, admission and the engine (a generated name is never the served one)."""
    if not isinstance(body, dict) or not isinstance(body.get("model"), str):
        return
    limit = body.get("max_completion_tokens")
    if limit is None:
        limit = body.get("max_tokens", 16 if "prompt" in body else None)  # the defaults of openai_models.py
    if isinstance(limit, int) and (limit <= CHEAP_TOKENS or limit >= MAX_MODEL_LEN):
        body["model"] = model


@schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_every_answer_fits_the_schema(case, model, server):
    if case.meta is not None and case.meta.generation.mode.is_positive:
        aim_at_engine(case.body, model)
    try:
        case.call_and_validate(checks=CHECKS, timeout=60)
    finally:
        if case.method.upper() == "POST" and case.path == "/admin/degradation":
            # A forced L5's 503s are right for every later request (what the route is for): the next
            # case starts with the ladder given back to itself.
            httpx.post(server.url + "/admin/degradation", json={"level": "auto"}, timeout=30)


def test_the_server_logged_no_traceback(server):
    """An exception after the status line (inside a stream, in a worker) is no 5xx but must not pass either."""
    assert "Traceback" not in server.output()
