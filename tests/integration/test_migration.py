"""Live migration through a real `steadfast serve` (two workers of one node, the small model in bf16 with
`model.deterministic`: issue 21's token identity in the default dtype): a
running stream moved by `POST /admin/requests/{id}/migrate` once, or five times back and forth, and a
worker drained under load. What the official `openai` client received must equal an unmigrated run of
the same request, token for token; the migrations must really have happened (their records, which
worker produced what), and the drained worker must hold no block when it is gone.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from steadfast.kv.ledger.open import open_ledger, sqlite_url
from steadfast.wire.worker import AddRequest, SamplingParams
from tests.conftest import PROMPTS, wait_until
from tests.integration.server import ServerProcess, serving

pytestmark = pytest.mark.integration

TOKENS = 48
DISTINCT = 4  # request bodies: stream i sends body(i % DISTINCT)
LONG = 1024  # a stream moved five times: long enough to still run after five migrations in a row (256 was
# not, on a fast CPU; 512 was not beside two CPU-bound processes: the fifth came after the last token)


def config(tmp: Path) -> str:
    return (
        "model: {dtype: bfloat16, deterministic: true, device: cpu}\n"
        "cache: {kv_memory_mb: 64}\n"
        "server: {workers: 2, standby_workers: 0, threads_per_worker: 1}\n"
        f"fault_recovery: {{kv_cache: {{ledger_url: '{sqlite_url(str(tmp / 'ledger.db'))}'}}}}\n"
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory, small_model_path, small_deterministic_model):  # skipped where the mode cannot run
    tmp = tmp_path_factory.mktemp("migration")
    with serving(tmp, config(tmp), model=small_model_path) as s:
        s.ledger_url = sqlite_url(str(tmp / "ledger.db"))
        yield s


_REFERENCE: dict[int, list[int]] = {}


def reference(small_config, small_model) -> dict[int, list[int]]:
    """What an unmigrated run of `body(i)` gives, from the in-process engine, computed once per session
    (the first two LONG tokens long: a shorter run's are their first ones). The migration modules share it."""
    if not _REFERENCE:
        from steadfast.worker.engine import Engine
        from steadfast.worker.loaded import private_arena

        path = f"/dev/shm/steadfast-test-migration-{os.getpid()}.kv"
        engine = Engine(small_config, small_model, private_arena(small_config, small_model.model_cfg, path))
        try:
            reqs = []
            for i in range(DISTINCT):
                b = body(i)
                tokens = LONG if i < 2 else TOKENS
                params = SamplingParams(tokens, b["temperature"], seed=b.get("seed", 0), ignore_eos=True)
                reqs.append(AddRequest(f"r{i}", small_model.tokenizer.encode(b["prompt"]), params))
            out = engine.generate(reqs)
        finally:
            engine.arena.unlink()  # the file and its spec
        _REFERENCE.update({i: [t for o in out[f"r{i}"] for t in o.token_ids] for i in range(DISTINCT)})
    return _REFERENCE


@pytest.fixture
def want(small_deterministic_config, small_deterministic_model) -> dict[int, list[int]]:
    return reference(small_deterministic_config, small_deterministic_model)


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def body(i: int, tokens: int = TOKENS) -> dict:
    """Greedy for even `i`, seeded sampling for odd."""
    seeded = i % 2 == 1
    b = {
        "prompt": PROMPTS[i % len(PROMPTS)],
        "max_tokens": tokens,
        "temperature": 0.8 if seeded else 0.0,
        "extra_body": {"ignore_eos": True, "return_token_ids": True},
    }
    return b | {"seed": 1000 + i} if seeded else b


def stream(
    server: ServerProcess, i: int, at_token=None, tokens: int = TOKENS
) -> tuple[str, list[int], str, str | None]:
    """One streamed completion; `at_token(rid, tokens_so_far)` runs after each chunk. Returns (request id,
    token ids, text, finish reason)."""
    model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    rid, ids, text, finish = "", [], "", None
    for chunk in client(server).completions.create(model=model, stream=True, **body(i % DISTINCT, tokens)):
        rid = chunk.id
        choice = chunk.choices[0]
        ids += (choice.model_extra or {}).get("token_ids") or []
        text += choice.text or ""
        finish = choice.finish_reason or finish
        if at_token is not None:
            at_token(rid, len(ids))
    return rid, ids, text, finish


def migrate(server: ServerProcess, rid: str, to: int | None, mode: str = "kv") -> dict:
    r = httpx.post(server.url + f"/admin/requests/{rid}/migrate", json={"to": to, "mode": mode}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def stream_moved(server: ServerProcess, i: int, at: int, move) -> tuple[list[int], str | None]:
    """Stream `body(i)` LONG tokens; once its client has `at` tokens, `move(request id)` runs on a thread
    (the server runs ahead of what the client has read). Returns the tokens and the finish reason."""
    mover: list[threading.Thread] = []

    def at_token(rid: str, n: int) -> None:
        if n == at and not mover:
            mover.append(threading.Thread(target=move, args=(rid,)))
            mover[0].start()

    _, got, _, finish = stream(server, i, at_token, LONG)
    mover[0].join()
    return got, finish


def owner(server: ServerProcess) -> int:
    """The worker with a request in flight (these tests run one stream at a time)."""
    rows = httpx.get(server.url + "/admin/workers").json()
    return next(w["id"] for w in rows if w["in_flight"])


@pytest.mark.parametrize("i", [0, 1], ids=["greedy", "seeded"])
@pytest.mark.parametrize("times", [1, 5])
def test_a_stream_migrated_on_its_node_is_token_exact(server, want, i, times):
    """Moved `times` times while it decodes (from a thread, each once the last committed: the server runs
    ahead of what its client has read), back and forth between the two workers."""
    done: list[dict] = []

    def move(rid: str) -> None:
        for _ in range(times):
            source = owner(server)
            done.append(migrate(server, rid, 1 - source) | {"was": source})

    got, finish = stream_moved(server, i, 1, move)
    assert finish == "length" and got == want[i]
    assert len(done) == times
    for k, record in enumerate(done):
        assert record["outcome"] == "committed" and record["path"] == "same_node", record
        assert record["from_worker"] == record["was"] and record["to_worker"] == 1 - record["was"]
        assert record["blocks"] > 0 and record["bytes"] == 0  # ownership moved, no byte copied
        assert record["downtime_ms"] is not None and record["gap_ms"] is not None
        if k:
            assert record["from_worker"] == done[k - 1]["to_worker"]  # back and forth
            assert record["at_token"] > done[k - 1]["at_token"]
    metrics = httpx.get(server.url + "/metrics").text
    assert "steadfast_migration_token_mismatches 0.0" in metrics
    assert 'steadfast_migrations_total{outcome="committed",path="same_node"}' in metrics


def test_a_stream_migrated_by_recompute_is_token_exact(server, want):
    """The baseline without KV moves: the destination computes prompt and delivered tokens again."""
    done: list[dict] = []

    def at_token(rid: str, n: int) -> None:
        if n == 6:
            done.append(migrate(server, rid, 1 - owner(server), "recompute"))

    _, got, _, finish = stream(server, 1, at_token, LONG)
    assert finish == "length" and got == want[1]
    (record,) = done
    assert record["outcome"] == "committed" and record["path"] == "recompute" and record["blocks"] == 0
    assert record["downtime_ms"] is not None


def test_a_migration_that_cannot_start_says_why(server):
    r = httpx.post(server.url + "/admin/requests/nobody/migrate", json={"to": 1})
    assert r.status_code == 404 and "no request" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/admin/requests/x/migrate", json={"to": -1})
    assert r.status_code == 400
    errors = []

    def at_token(rid: str, n: int) -> None:
        if n == 4:
            same = httpx.post(server.url + f"/admin/requests/{rid}/migrate", json={"to": owner(server)})
            errors.append(same)
            errors.append(httpx.post(server.url + f"/admin/requests/{rid}/migrate", json={"to": 99}))

    _, got, _, finish = stream(server, 0, at_token, LONG)
    assert finish == "length" and len(got) == LONG
    assert [e.status_code for e in errors] == [409, 409], [e.text for e in errors]
    assert "already" in errors[0].json()["error"]["message"]


def test_draining_the_busiest_worker_under_load_loses_nothing(server, want):
    """16 streams on two workers; the busier is drained: every stream completes exact, the drained
    worker takes no new request, migrates every one away, holds no block, and exits. (Last in this
    module: it leaves the server one worker.)"""
    n = 16
    got: dict[int, tuple] = {}
    started = threading.Event()
    counts = [0]

    def at_token(rid: str, k: int) -> None:
        if k == 4:
            counts[0] += 1
            if counts[0] == n:
                started.set()

    threads = [
        threading.Thread(target=lambda i=i: got.__setitem__(i, stream(server, i, at_token)[1:])) for i in range(n)
    ]
    for t in threads:
        t.start()
    assert started.wait(120), "the streams did not start"
    rows = httpx.get(server.url + "/admin/workers").json()
    busiest = max(rows, key=lambda w: w["in_flight"])
    assert busiest["in_flight"] > 0
    drained = busiest["id"]
    r = httpx.post(server.url + f"/admin/workers/{drained}/drain", json={})
    assert r.status_code == 202, r.text
    # While it drains, its count of requests only goes down: it got nothing new.
    seen = []
    late = [threading.Thread(target=lambda i=i: got.__setitem__(100 + i, stream(server, i)[1:])) for i in range(2)]
    for t in late:
        t.start()
    while True:
        row = next((w for w in httpx.get(server.url + "/admin/workers").json() if w["id"] == drained), None)
        if row is None or row["state"] in ("dead", "stopping") and row["in_flight"] == 0:
            break
        seen.append(row["in_flight"])
        time.sleep(0.05)
    for t in threads + late:
        t.join()
    assert seen == sorted(seen, reverse=True), seen
    for i in range(n):
        assert got[i][0] == want[i % DISTINCT][:TOKENS] and got[i][2] == "length", i
    for i in range(2):
        assert got[100 + i][0] == want[i][:TOKENS]
    records = httpx.get(server.url + "/admin/migrations").json()
    moved = [r for r in records if r["reason"] == "drain"]
    assert moved and all(r["from_worker"] == drained for r in moved)
    assert {r["outcome"] for r in moved} <= {"committed", "aborted"}, moved  # (aborted: it ended first)
    assert any(r["outcome"] == "committed" for r in moved)
    wait_until(lambda: "drained" in server.output() and server_worker_gone(server, drained), 30, "the retire")
    ledger = open_ledger(server.ledger_url)
    assert not [b for b in ledger.blocks() if b.owner == f"worker{drained}"]
    assert ledger.check_integrity() == []
    assert "ERROR" not in server.output().split("draining worker")[1]


def server_worker_gone(server: ServerProcess, worker_id: int) -> bool:
    return all(w["id"] != worker_id for w in httpx.get(server.url + "/admin/workers").json())
