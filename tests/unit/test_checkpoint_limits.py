"""What one request sends stays within the stores' limits, and a row a store refuses is its request's
error alone (issue 47 §2.5, §2.6): stop strings count against the prompt's characters; etcd's
checkpoints stay under its request limit however long the prompts and stop strings, each request's
body written once; SQLite's file and WAL do not grow with every checkpoint; the router lets go of a
finished request's record at the end of the idempotency window, however quiet it is."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from steadfast.control.fleet.client import EngineClient
from steadfast.control.fleet.delivery import Flight, Watermark
from steadfast.control.fleet.resume import Resumption, UnknownRequestError
from steadfast.control.http.api import create_app
from steadfast.control.http.serving import ServingContext
from steadfast.kv.ledger.etcd import EtcdLedger
from steadfast.kv.ledger.etcd_requests import TXN_BYTES
from steadfast.kv.ledger.interface import LedgerError, RequestCheckpoint
from steadfast.kv.ledger.open import open_ledger, sqlite_url
from steadfast.kv.ledger.sqlite import SqliteLedger
from steadfast.kv.ledger.sqlite_rows import ids_blob
from steadfast.model.tokenizer import GGUFTokenizer
from steadfast.util.etcd import Put
from steadfast.wire.worker import AddRequest, FinishReason, SamplingParams
from steadfast.worker.engine import Engine
from steadfast.worker.kv.ledger_sync import LedgerSync
from tests.etcd_cluster import shared_etcd

pytestmark = pytest.mark.unit

ETCD_LIMIT = 3 * 2**19  # etcd's default --max-request-bytes: 1.5 MiB
# The finding's attack: four stop strings of 990,000 characters (about 4 MB of parameters).
HUGE_STOPS = json.dumps({"max_tokens": 16, "stop": ["x" * 990_000] * 4})


class Wall:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# --- stop strings count against the prompt's characters ------------------------------------------


@pytest.fixture(scope="module")
def api(model_path: str):
    tok = GGUFTokenizer.from_gguf(model_path)
    # Enough of a router for a request to reach its admission: one ready worker, nothing pending.
    engine = SimpleNamespace(workers=[SimpleNamespace(ready=True, status=None)], pending=0)
    ctx = ServingContext(engine, tok, "m", 2048, 16, None)  # type: ignore[arg-type]
    with TestClient(create_app(ctx), base_url="http://localhost", raise_server_exceptions=False) as c:
        yield c


@pytest.mark.parametrize("route", ["completions", "chat", "token ids"])
def test_stop_strings_past_the_prompt_limit_are_a_400_naming_stop(api, route):
    prompt = {"prompt": "Hi"}
    if route == "chat":
        prompt = {"messages": [{"role": "user", "content": "Hi"}]}
    elif route == "token ids":
        prompt = {"prompt": [1, 2, 3]}
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    body = {"model": "m", **prompt, "stop": json.loads(HUGE_STOPS)["stop"]}
    raw = json.dumps(body).encode()
    assert len(raw) > 3_960_000  # the attack as found: it fits the default 4 MiB body limit
    r = api.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "stop", "stop_too_long")
    assert "3960000" in error["message"] and "1000000" in error["message"]
    # The prompt's characters count too: a long prompt leaves the stop strings less room.
    body = {"model": "m", "prompt": "y" * 999_990, "stop": ["z" * 11]}
    r = api.post("/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"


# --- etcd: checkpoints under its request limit, each body once ------------------------------------


@pytest.fixture
def etcd_ledger(tmp_path: Path):
    if shutil.which("etcd") is None:
        pytest.skip("etcd (Debian etcd-server) is not installed")
    wall = Wall()
    ledger = EtcdLedger(shared_etcd().endpoints, f"/test{tmp_path}/limits", wall_clock=wall)
    ledger.format(4)
    yield ledger, wall
    ledger.close()


def test_etcd_checkpoints_past_its_request_limit_are_split_and_each_body_written_once(etcd_ledger, monkeypatch):
    ledger, wall = etcd_ledger
    epoch = ledger.acquire_lease("w0", 1, 30).epoch
    sent: list[int] = []  # bytes of keys and values each committed write carried
    txn = ledger.client.txn

    def counting(compare, success, failure=()):  # noqa: ANN001, ANN202 - the client's own signature
        answer = txn(compare, success, failure)
        if answer.succeeded and any(isinstance(op, Put) for op in success):
            sent.append(sum(len(op.key) + len(op.value) for op in success if isinstance(op, Put)))
        return answer

    monkeypatch.setattr(ledger.client, "txn", counting)
    # The load the finding names (40 rows of 8,191-token prompts: 5 bytes a token id past 65535) beside
    # the attack: on the old code, "request is too large" and every request of the worker failed.
    long_prompt = [100_000 + i for i in range(8191)]
    rows = [RequestCheckpoint(f"r{i:02d}", long_prompt, "{}", [7], 1, "decode") for i in range(40)]
    rows.append(RequestCheckpoint("stops", [1, 2, 3], HUGE_STOPS, [7], 1, "decode"))
    ledger.checkpoint("w0", epoch, rows)
    assert sum(sent) > len(HUGE_STOPS) + 40 * 8191 * 5  # all of it went to etcd...
    assert len(sent) >= 7 and max(sent) <= TXN_BYTES < ETCD_LIMIT  # ...in transactions under its limit
    assert ledger.request("stops").params == HUGE_STOPS and ledger.request("stops").prompt_ids == [1, 2, 3]
    assert all(r.prompt_ids == long_prompt for r in ledger.requests() if r.request_id != "stops")
    assert len(ledger.client.get(ledger.keys.body("stops"), prefix=True)) == 16  # in parts of 256 KiB

    # The next checkpoint writes what changed: the rows (40 a transaction), no body again.
    sent.clear()
    ledger.checkpoint(
        "w0", epoch, [RequestCheckpoint(r.request_id, r.prompt_ids, r.params, [7, 8], 2, "finished") for r in rows]
    )
    assert len(sent) == 2 and sum(sent) < 41 * 200
    assert ledger.request("stops").generated_ids == [7, 8] and ledger.request("stops").params == HUGE_STOPS

    # Bodies go with their rows.
    wall.now += 120
    assert ledger.prune_requests(60) == 41
    assert ledger.requests() == [] and ledger.client.get(ledger.keys.body_dir, prefix=True) == []


def test_a_body_still_being_written_is_no_resume_point_and_a_later_checkpoint_finishes_it(etcd_ledger, monkeypatch):
    """A writer gone between a row and its long body's parts: the row says no body yet (a resume finds
    no prompt there), and the request's next checkpoint, its own or a successor's, writes the body."""
    ledger, _ = etcd_ledger
    epoch = ledger.acquire_lease("w0", 1, 30).epoch
    monkeypatch.setattr(ledger, "_put_body", lambda *args: None)  # dies before the parts
    ledger.checkpoint("w0", epoch, [RequestCheckpoint("r", [1, 2], HUGE_STOPS, [5], 1, "decode")])
    got = ledger.request("r")
    assert (got.prompt_ids, got.params, got.generated_ids) == ([], "", [5])
    monkeypatch.undo()
    ledger.checkpoint("w0", epoch, [RequestCheckpoint("r", [1, 2], HUGE_STOPS, [5, 6], 2, "decode")])
    got = ledger.request("r")
    assert (got.prompt_ids, got.params, got.generated_ids) == ([1, 2], HUGE_STOPS, [5, 6])


# --- SQLite: a body once, not once a checkpoint ---------------------------------------------------


def test_sqlite_writes_a_requests_body_once_so_its_file_and_wal_stay_small(tmp_path):
    """Four requests of the attack grew the ledger 139 KB -> 16 MB (+17 MB of WAL): each checkpoint
    wrote the whole row again, stop strings and all."""
    wall = Wall()
    path = tmp_path / "ledger.db"
    ledger = SqliteLedger(str(path), wall_clock=wall)
    try:
        ledger.format(4)
        epoch = ledger.acquire_lease("w0", 1, 30).epoch
        params = json.dumps({"stop": ["x" * 250_000] * 4})  # the most the router now admits: ~1 MB
        for step in range(1, 21):  # a request's checkpoints as it runs
            ledger.checkpoint(
                "w0", epoch, [RequestCheckpoint("r", [1, 2, 3], params, list(range(step)), step, "decode")]
            )
        size = sum(p.stat().st_size for p in tmp_path.glob("ledger.db*"))
        assert size < 3 * len(params), size  # (before: over 5 MB, and growing with every step)
        got = ledger.request("r")
        assert (got.prompt_ids, got.params, got.generated_ids) == ([1, 2, 3], params, list(range(20)))
        ledger.checkpoint("w0", epoch, [RequestCheckpoint("r", [1, 2, 3], params, [0], 1, "finished")])
        wall.now += 120
        assert ledger.prune_requests(60) == 1
        assert ledger.db.execute("SELECT COUNT(*) FROM request_bodies").fetchone()[0] == 0
    finally:
        ledger.close()


def test_sqlite_rows_written_before_bodies_were_kept_apart_still_read_whole(tmp_path):
    ledger = SqliteLedger(str(tmp_path / "old.db"))
    try:
        # A row as the previous release wrote it: prompt and parameters inline, no body row.
        ledger.db.execute(
            "INSERT INTO requests VALUES ('old', ?, '{}', ?, 1, 'w0', 1, 'decode', X'', 5.0)",
            (ids_blob([4, 5]), ids_blob([6])),
        )
        got = ledger.request("old")
        assert (got.prompt_ids, got.params, got.generated_ids) == ([4, 5], "{}", [6])
    finally:
        ledger.close()


# --- a row the store refuses is its request's error alone -----------------------------------------


def greedy(rid: str, ids: list[int]) -> AddRequest:
    return AddRequest(rid, ids, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))


def test_a_row_the_store_refuses_fails_its_request_alone_and_the_others_stream_on(
    tmp_path, small_config, small_model, make_engine, make_arena, monkeypatch
):
    cfg = small_config.replace(cache={"num_blocks": 64}, fault_recovery={"kv_cache": {"snapshot_interval_steps": 1}})
    tok = small_model.tokenizer
    prompts = [tok.encode(p) for p in ("The capital of France is", "def fibonacci(n):", "Once upon a time")]
    reference = make_engine(cfg, small_model).generate([greedy(f"r{i}", p) for i, p in enumerate(prompts)])

    url = sqlite_url(tmp_path / "ledger.db")
    ledger = open_ledger(url)
    arena = make_arena(cfg, small_model)
    ledger.format(arena.spec.num_blocks)
    epoch = ledger.acquire_lease("w0", 1, ttl_s=60).epoch
    ledger.grant("w0", epoch, arena.spec.num_blocks)  # (no pool here: the engine's blocks are all w0's)
    sync = LedgerSync(cfg, SimpleNamespace(worker="w0", epoch=epoch), url, arena)
    try:
        engine = Engine(cfg, small_model, arena, sync=sync)
        refused: list[list[str]] = []
        store = sync.ledger.checkpoint

        def checkpoint(worker, epoch, records):  # noqa: ANN001, ANN202
            ids = [r.request_id for r in records]
            if "bad" in ids:  # what etcd answered the finding's request
                refused.append(ids)
                raise LedgerError(
                    "etcd ledger refused checkpoint: etcd refused /v3/kv/txn: etcdserver: request is too large"
                )
            store(worker, epoch, records)

        monkeypatch.setattr(sync.ledger, "checkpoint", checkpoint)
        got = engine.generate([greedy(f"r{i}", p) for i, p in enumerate(prompts)] + [greedy("bad", prompts[1])])
        assert refused[0] == ["r0", "r1", "r2", "bad"] and refused[1:] == [["bad"]]  # the batch, then it alone
        *tokens, failed = got["bad"]
        assert failed.finish_reason == FinishReason.ERROR and "request is too large" in (failed.error or "")
        assert not failed.retryable and len(tokens) <= 1  # refused at its first checkpoint, after prefill
        for rid, outs in reference.items():  # the others: every token, the same
            assert [t for o in got[rid] for t in o.token_ids] == [t for o in outs for t in o.token_ids]
            assert got[rid][-1].finish_reason == FinishReason.LENGTH
        assert len(refused) == 2  # its row was never tried again
        assert [(r.request_id, r.phase) for r in ledger.requests()] == [(f"r{i}", "finished") for i in range(3)]
        assert not engine.requests
    finally:
        sync.lease.stop()
        sync.ledger.close()
        ledger.close()


# --- the router lets go of a request's record at the end of the window ----------------------------


def test_the_routers_record_of_a_request_is_let_go_at_the_end_of_the_window_however_quiet(tmp_path):
    async def run() -> None:
        client = EngineClient([], f"ipc://{tmp_path}/outputs", 0.05, idempotency_window_s=0.3)
        await client.start()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            stops = tuple(chr(0x1F600 + i) * 250_000 for i in range(4))  # 4 MB of text in Python's strings
            add = AddRequest("r", list(range(1000, 9191)), SamplingParams(max_tokens=64, stop=stops))
            client.resumption_records.retire(Flight(add, asyncio.Queue(), Watermark(-1, list(range(1000, 1064)))))
            del add, stops
            held = tracemalloc.get_traced_memory()[0] - before
            # Only what a resume takes, token ids packed: the stop strings, little more.
            assert held < 4_000_000 + 64_000, held
            assert client.resumption_records.lookup("r").tokens == list(range(1000, 1064))
            await asyncio.sleep(0.6)  # past the window, no other request: the watch loop lets it go
            assert tracemalloc.get_traced_memory()[0] - before < 100_000
            with pytest.raises(UnknownRequestError):
                client.resumption_records.lookup("r")
        finally:
            tracemalloc.stop()
            await client.close()

    asyncio.run(run())


def test_the_window_is_kept_in_order_when_a_request_is_retired_again():
    records = Resumption(10.0)
    for rid in ("a", "b"):
        records.retire(Flight(AddRequest(rid, [1], SamplingParams()), asyncio.Queue(), Watermark(-1, [2])))
    time.sleep(0.2)
    records.retire(Flight(AddRequest("a", [1], SamplingParams()), asyncio.Queue(), Watermark(-1, [2, 3])))
    records.expire(time.monotonic() + 10.0 - 0.1)  # b's window is over, a's (retired again) is not
    assert records.lookup("a").tokens == [2, 3]
    with pytest.raises(UnknownRequestError):
        records.lookup("b")
