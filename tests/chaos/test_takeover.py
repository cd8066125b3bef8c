"""Takeover of a killed worker's requests by a fresh worker, at the engine level: the test is the
router (it keeps what each client received) and the supervisor (it reaps, fences and resubmits).

Each case kills a real worker process mid-decode and checks, token by token, that delivered + resumed
output equals a fault-free run, which route was taken, and what the ledger and arena say afterwards.
"""

from __future__ import annotations

import os
import shutil
import signal

import pytest

from steadfast.config import Config
from steadfast.kv.integrity import check_node
from steadfast.kv.ledger.history import check_history, load_journal
from steadfast.kv.ledger.interface import LeaseState
from steadfast.kv.pool.client import PoolClient
from steadfast.util.proc import process_gone
from steadfast.wire.worker import AddRequest, RequestOutput, Resume, SamplingParams
from tests.chaos.node import Node
from tests.conftest import PROMPTS
from tests.etcd_cluster import EtcdCluster

pytestmark = pytest.mark.chaos

MAX_TOKENS = 64  # well past the kill: the small model decodes fast, and the test reads behind the worker
KILL_AFTER = 21  # tokens each request has delivered before the kill (a block and then some)


def config(mode: str, model_path: str) -> Config:
    return Config().replace(
        model={"path": model_path, "dtype": "float32", "device": "cpu"},
        cache={"kv_memory_mb": 192, "pool_grant_batch": 4},
        fault_recovery={"kv_cache": {"snapshot_interval_steps": 4, "recovery_mode": mode}},
    )


def make_requests(tokenizer) -> list[AddRequest]:
    reqs = []
    for i, prompt in enumerate(PROMPTS[:4]):
        ids = tokenizer.encode_chat([{"role": "user", "content": prompt}])
        temp = 0.0 if i % 2 == 0 else 0.8  # greedy and seeded sampling
        reqs.append(AddRequest(f"r{i}", ids, SamplingParams(MAX_TOKENS, temp, seed=1000 + i, ignore_eos=True)))
    return reqs


def joined(outputs: list[RequestOutput]) -> tuple[list[int], str]:
    return [t for o in outputs for t in o.token_ids], "".join(o.text for o in outputs)


@pytest.mark.parametrize(
    ("mode", "corrupt", "route", "store"),
    [
        ("ledger_first", False, "ledger_first", "sqlite"),
        ("ledger_first", True, "rebuild", "sqlite"),
        ("rebuild", False, "rebuild", "sqlite"),
        # The ledger on a 3-member etcd cluster whose leader is killed while the worker decodes (and
        # seals and checkpoints): nothing it wrote is lost, the takeover adopts as on SQLite.
        ("ledger_first", False, "ledger_first", "etcd"),
    ],
)
def test_killed_worker_is_taken_over_token_exactly(
    tmp_path, small_model, small_model_path, make_engine, mode, corrupt, route, store, monkeypatch
):
    cfg = config(mode, small_model_path)
    journal = tmp_path / "journal"  # every process's ledger calls, for the history checker
    journal.mkdir()
    monkeypatch.setenv("STEADFAST_LEDGER_JOURNAL", str(journal))
    reqs = make_requests(small_model.tokenizer)
    reference = make_engine(cfg, small_model).generate(reqs)

    cluster = None
    if store == "etcd":
        if shutil.which("etcd") is None:
            pytest.skip("etcd (Debian etcd-server) is not installed")
        (tmp_path / "etcd").mkdir()
        cluster = EtcdCluster(tmp_path / "etcd").start()
    node = Node(tmp_path, cfg, ledger_url=cluster.ledger_url("/takeover") if cluster else "")
    try:
        node.start_pool()
        victim = node.start_worker(0)
        for r in reqs:
            node.send(0, r)
        got: dict[str, list[RequestOutput]] = {r.request_id: [] for r in reqs}
        leader = None
        while min(len(joined(v)[0]) for v in got.values()) < KILL_AFTER:
            for out in node.outputs(timeout=0.2):
                got[out.request_id].append(out)
            if cluster and leader is None and min(len(joined(v)[0]) for v in got.values()) >= KILL_AFTER // 2:
                leader = cluster.leader()
                assert leader is not None
                cluster.kill(leader)
                assert leader.proc.returncode == -9  # the kill landed, mid-decode
        if cluster:
            assert leader is not None and cluster.wait_leader(15.0) is not leader
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait()
        assert process_gone(victim.pid)
        for out in node.outputs(timeout=0.5):  # whatever it sent before dying was delivered too
            got[out.request_id].append(out)
        assert all(not o.finish_reason for v in got.values() for o in v), "the kill came too late"

        kept = PoolClient(node.pool_address, "supervisor").fence_dead("worker0", victim.pid)
        ledger = node.ledger()
        assert ledger.lease("worker0").state == LeaseState.FENCED and kept  # sealed blocks kept for adoption
        corrupted = None
        if corrupt:
            corrupted = ledger.request("r0").block_table[0]
            arena = node.arena()
            arena.tensor[:, :, :, corrupted] += 1.0  # the bytes no longer match the sealed hash

        node.start_worker(1)
        for r in reqs:
            ids, text = joined(got[r.request_id])
            node.send(1, AddRequest(r.request_id, r.prompt_ids, r.params, resume=Resume(ids, len(text), 0)))
        resumed = {r.request_id: [] for r in reqs}
        for out in node.outputs(timeout=120, until_finished=set(resumed)):
            resumed[out.request_id].append(out)

        for r in reqs:
            rid = r.request_id
            before, after = got[rid], resumed[rid]
            assert after and after[-1].finish_reason == "length", after[-1:]
            first = after[0]
            assert first.index == len(joined(before)[0])  # no token resent, none skipped
            if corrupt and rid != "r0":
                # r0's first block is the corrupt one. A request sharing that content may still adopt
                # the rest of its blocks once the new owner has recomputed the first for r0 (cached).
                assert first.route in ("rebuild", "ledger_first"), (rid, first.route)
            else:
                assert first.route == route, (rid, first.route)
            if first.route == "ledger_first":
                assert first.adopted_tokens >= 16 and first.recomputed_tokens < len(r.prompt_ids) + KILL_AFTER
                if not corrupt:  # blocks are sealed in the step that fills them: only the partial one is redone
                    assert 1 <= first.recomputed_tokens <= cfg.cache.block_size, first.recomputed_tokens
            else:
                assert first.adopted_tokens == 0
            want_ids, want_text = joined(reference[rid])
            assert joined(before + after) == (want_ids, want_text), rid

        problems = check_node(ledger, node.arena())
        if corrupt:
            assert problems == [f"sealed block {corrupted}: its bytes no longer match its hash"]
        else:
            assert problems == []
        # The pool's, both workers' and this test's ledger calls, merged in the store's order: the dead
        # worker's writes, its fencing and reclaim, its successor's adoption, and no invariant broken.
        history = load_journal(journal)
        accepted = {(op.name, op.args[0]) for op in history if op.ok and op.args and isinstance(op.args[0], str)}
        assert {("seal_and_unseal", "worker0"), ("checkpoint", "worker0"), ("fence", "worker0")} <= accepted
        assert ("reclaim", "worker0") in accepted and ("checkpoint", "worker1") in accepted
        if route == "ledger_first" and not corrupt:
            assert ("adopt", "worker1") in accepted
        assert check_history(history) == []
    finally:
        node.stop()
        if cluster:
            cluster.stop()
