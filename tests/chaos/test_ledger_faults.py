"""Faults against real processes: a kvpool daemon and a real worker, the test acting as router.

Each test checks that its fault really happened (process state, exit status, failpoint marker) and
what survived it: ledger consistency, arena bytes, and the tokens a client would have received.
"""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import time

import pytest
import torch

from steadfast.config import Config
from steadfast.kv.integrity import check_node
from steadfast.kv.ledger.history import check_history, load_journal
from steadfast.kv.ledger.interface import BlockState, LeaseState
from steadfast.util.proc import process_gone
from steadfast.wire.worker import AddRequest, SamplingParams
from tests.chaos.node import Node, tokens_of
from tests.conftest import wait_until
from tests.etcd_cluster import shared_etcd

pytestmark = pytest.mark.chaos

FAST_LEASE = {"lease": {"renew_interval_ms": 100, "lease_timeout_ms": 600}}
GREEDY = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)


def config(model_path: str, **fault_recovery) -> Config:
    # fp32: token-exact comparisons hold whatever the batch composition. The small model: every
    # comparison here is with the same worker's own run, not with `transformers`.
    return Config().replace(
        model={"path": model_path, "dtype": "float32"},
        cache={"kv_memory_mb": 192, "pool_grant_batch": 4},
        fault_recovery={**FAST_LEASE, **fault_recovery},
    )


@pytest.fixture
def prompt(model_path):
    from steadfast.model.tokenizer import GGUFTokenizer

    return GGUFTokenizer.from_gguf(model_path).encode_chat([{"role": "user", "content": "Tell me about Rome."}])


def draining(node: Node):
    """Between polls, keep draining the worker's outputs."""
    return lambda: node.outputs(timeout=0.05)


@pytest.mark.parametrize("store", ["sqlite", "etcd"])
def test_worker_stopped_past_its_lease_is_fenced_and_exits(tmp_path, prompt, small_model_path, store, monkeypatch):
    """On etcd the lease ends on etcd's clock (a TTL of 1 s, the 600 ms asked for rounded up) and etcd
    itself refuses the worker's writes when it comes back; on SQLite, the pool's clock and its checks."""
    url = ""
    if store == "etcd":
        if shutil.which("etcd") is None:
            pytest.skip("etcd (Debian etcd-server) is not installed")
        url = shared_etcd().ledger_url(f"/ledger-faults{tmp_path}")
    journal = tmp_path / "journal"  # every process's ledger calls, for the history checker
    journal.mkdir()
    monkeypatch.setenv("STEADFAST_LEDGER_JOURNAL", str(journal))
    node = Node(tmp_path, config(small_model_path, kv_cache={"snapshot_interval_steps": 4}), ledger_url=url)
    try:
        node.start_pool()
        worker = node.start_worker(0)
        node.send(0, AddRequest("long", prompt, GREEDY))
        assert len(tokens_of(node.outputs(timeout=60, max_tokens=24), "long")) >= 24
        ledger = node.ledger()
        epoch = ledger.lease("worker0").epoch
        assert ledger.request("long") is not None  # checkpoints were being written

        os.kill(worker.pid, signal.SIGSTOP)
        stopped = time.time()  # (request rows are stamped with wall-clock time)
        fenced = wait_until(
            lambda: (lease := ledger.lease("worker0")).state == LeaseState.FENCED and lease,
            10,
            "the pool to fence the stopped worker",
            draining(node),
        )
        assert fenced.epoch > epoch and not process_gone(worker.pid)  # fenced, yet its process still exists
        # Nothing of the stopped worker is reassigned while its process lives (invariant 2).
        assert any(b.owner == "worker0" for b in ledger.blocks())
        node.outputs(timeout=0.3)  # whatever it sent before the stop

        os.kill(worker.pid, signal.SIGCONT)
        assert worker.wait(timeout=15) == 3, node.log_text("worker0")
        assert "lease lost" in node.log_text("worker0")
        after = node.outputs(timeout=0.5)
        assert tokens_of(after, "long") == []  # a fenced worker hands out nothing it computed
        row = ledger.request("long")
        assert row.epoch == epoch
        assert max(r.updated_at for r in ledger.requests()) <= stopped  # no checkpoint accepted after the stop
        # Once the process is gone the pool reclaims: partial blocks quarantined, sealed ones kept ownerless.
        wait_until(lambda: not any(b.owner == "worker0" for b in ledger.blocks()), 10, "reclaim")
        states = {b.state for b in ledger.blocks()}
        assert BlockState.QUARANTINED in states
        assert check_node(ledger, node.arena()) == []
        ledger.close()
        # The worker's and the pool's calls in the store's order: the fence, then the worker's own write
        # under its old epoch refused when it came back, and nothing accepted that should not have been.
        history = load_journal(journal)
        fence = next(op.seq for op in history if op.name == "fence" and op.args[0] == "worker0" and op.ok)
        refused = [op for op in history[fence:] if not op.ok and op.args[:2] == ("worker0", epoch)]
        assert refused, [(op.name, op.args[:2], op.ok) for op in history[fence:]]
        assert check_history(history) == []
    finally:
        node.stop()


def test_worker_killed_inside_a_checkpoint_transaction_leaves_a_consistent_ledger(tmp_path, prompt, small_model_path):
    # The third checkpoint stalls after writing its rows, before COMMIT: the kill lands inside it.
    cfg = config(small_model_path, kv_cache={"snapshot_interval_steps": 6})
    node = Node(tmp_path, cfg, failpoints="checkpoint_commit=60@3")
    try:
        node.start_pool()
        worker = node.start_worker(0)
        ids = [f"r{i}" for i in range(4)]
        for i, rid in enumerate(ids):
            node.send(0, AddRequest(rid, prompt + [17 + i], GREEDY))
        marker = wait_until(
            lambda: list(node.failpoint_dir.glob("checkpoint_commit.*")),
            120,
            "the worker to reach the failpoint",
            draining(node),
        )
        assert marker[0].name == f"checkpoint_commit.{worker.pid}"
        worker.kill()
        assert worker.wait(timeout=10) == -signal.SIGKILL

        db = sqlite3.connect(node.ledger_path)
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        rows = db.execute("SELECT id, generated, updated FROM requests ORDER BY id").fetchall()
        assert [r[0] for r in rows] == ids
        # All rows come from one committed checkpoint (the second); none from the killed third one.
        assert len({r[2] for r in rows}) == 1
        ledger = node.ledger()
        for rid in ids:
            # Each checkpoint holds exactly a prefix of what the client received for that request.
            saved = ledger.request(rid).generated_ids
            assert saved and saved == tokens_of(node.received, rid)[: len(saved)]
        assert check_node(ledger, node.arena()) == []
        wait_until(lambda: not any(b.owner == "worker0" for b in ledger.blocks()), 15, "fence and reclaim")
        assert ledger.lease("worker0").state == LeaseState.FENCED
        assert check_node(ledger, node.arena()) == []
        ledger.close()
    finally:
        node.stop()


def test_kvpool_restart_keeps_arena_and_running_worker(tmp_path, prompt, small_model_path):
    node = Node(tmp_path, config(small_model_path, kv_cache={"snapshot_interval_steps": 8}))
    try:
        pool = node.start_pool()
        worker = node.start_worker(0)
        short = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
        node.send(0, AddRequest("ref", prompt, short))
        reference = tokens_of(node.outputs(timeout=120, until_finished={"ref"}), "ref")
        assert len(reference) == 120

        other = prompt[:-2] + [504, 3575]  # a different request: no prefix-cache shortcut to its tail
        node.send(0, AddRequest("during", other, short))
        node.send(0, AddRequest("again", prompt, short))
        first = node.outputs(timeout=60, max_tokens=40)
        ledger = node.ledger()
        arena = node.arena()
        sealed = {b.block_id: b.hash for b in ledger.blocks() if b.state == BlockState.SEALED}
        assert sealed, "some blocks must be sealed before the restart"
        before = {b: arena.block(b) for b in sealed}

        pool.kill()
        assert pool.wait(timeout=10) == -signal.SIGKILL
        assert os.path.exists(node.arena_path)
        time.sleep(0.5)  # the worker keeps decoding; a grant it needs now waits for the new daemon
        node.start_pool()
        rest = node.outputs(timeout=120, until_finished={"during", "again"})
        assert "re-attached KV arena" in node.log_text("kvpool")
        assert worker.poll() is None

        # Blocks the worker legitimately unsealed and refilled since are left out; every block that stayed
        # sealed must hold exactly the bytes it held before the daemon died.
        still = {
            b.block_id for b in ledger.blocks() if b.state == BlockState.SEALED and sealed.get(b.block_id) == b.hash
        }
        assert still, "no block stayed sealed across the restart: nothing was compared"
        for b in still:
            assert torch.equal(arena.block(b), before[b]), f"sealed block {b} changed across the restart"
            assert arena.digest(b) == sealed[b]
        got = first + rest
        assert tokens_of(got, "again") == reference  # the same tokens as without a restart
        assert len(tokens_of(got, "during")) == 120
        assert check_node(ledger, node.arena()) == []
        ledger.close()
    finally:
        node.stop()
