"""Live migration across nodes, through a real `steadfast serve` with `decode_node: separate` (the small
model, fp32): a request prefilled on node 0 and decoding on node 1's decode worker is moved to node 0's
mixed worker and back — its KV copied in rounds while it decodes, then stopped and copied, then committed.
What the client received must equal the in-process engine's stream, token for token; each migration must
have copied bytes over the wire, and both nodes' ledgers must be consistent afterwards.
"""

from __future__ import annotations

import threading

import httpx
import pytest

from steadfast.kv.ledger_url import open_ledger, sibling_ledger_url, sqlite_url
from tests.integration.server import serving
from tests.integration.test_migration import LONG, migrate, reference, stream


@pytest.fixture
def want(small_config, small_model) -> dict[int, list[int]]:
    return reference(small_config, small_model)


pytestmark = pytest.mark.integration


def config(url: str) -> str:
    return (
        "model: {dtype: float32, device: cpu}\n"
        "cache: {kv_memory_mb: 64}\n"
        "server: {workers: 1, prefill_workers: 1, decode_workers: 1, decode_node: separate, standby_workers: 0,"
        " threads_per_worker: 1}\n"
        f"fault_recovery: {{kv_cache: {{ledger_url: '{url}'}}}}\n"
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory, small_model_path):
    tmp = tmp_path_factory.mktemp("migration-nodes")
    url = sqlite_url(str(tmp / "ledger.db"))
    with serving(tmp, config(url), model=small_model_path) as s:
        s.ledger_urls = [url, sibling_ledger_url(url, "-node1")]
        yield s


def roles(server) -> dict[str, int]:
    return {w["role"]: w["id"] for w in httpx.get(server.url + "/admin/workers").json()}


@pytest.mark.parametrize(("i", "times"), [(0, 5), (1, 1)], ids=["greedy-5", "seeded-1"])
def test_a_stream_migrated_across_nodes_is_token_exact(server, want, i, times):
    ids = roles(server)
    mixed, decode = ids["mixed"], ids["decode"]
    done: list[dict] = []

    def move(rid: str) -> None:
        for k in range(times):
            to = mixed if k % 2 == 0 else decode  # it decodes on the decode node first
            done.append(migrate(server, rid, to))

    mover: list[threading.Thread] = []

    def at_token(rid: str, n: int) -> None:
        if n == 2:
            mover.append(threading.Thread(target=move, args=(rid,)))
            mover[0].start()

    _, got, _, finish = stream(server, i, at_token, LONG)
    mover[0].join()
    assert finish == "length" and got == want[i]
    assert len(done) == times
    for k, record in enumerate(done):
        assert record["outcome"] == "committed" and record["path"] in ("primary", "alternate"), record
        assert record["to_worker"] == (mixed if k % 2 == 0 else decode)
        assert record["bytes"] > 0 and record["stages"] >= 2 and record["downtime_ms"] is not None
    for url in server.ledger_urls:
        assert open_ledger(url).check_integrity() == []
