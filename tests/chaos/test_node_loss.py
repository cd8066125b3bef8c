"""A node lost across hosts (issue 22): a router part and two node parts, each in a network namespace of
its own ("hosts", tests/hosts.py), their ledgers and their records in a 3-member etcd cluster, the router
and the workers talking over TCP with CURVE. While a stream decodes on one node, that node is lost past
its lease — its whole host frozen (SIGSTOP to every process it runs), or cut off the network (its link
taken down) — and the router must fence the node's workers in its ledger and resume the stream on the
other node: the client must receive exactly the tokens an undisturbed run gives. When the host comes
back, none of its old workers' writes may be accepted — checked on the recorded history of every
process's ledger calls — and the node joins again with new workers. The first test also kills the etcd
leader while the stream runs: nothing may be lost. Then the router process is killed (its clients resume
with Last-Event-ID on the restarted one) and, last, a node part is stopped in order (its stream moves on).
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
from collections.abc import Callable

import httpx
import pytest

from steadfast.kv.ledger.history import check_history, load_journal
from steadfast.ops.harness.chaos import children_named
from tests.chaos.test_crash_recovery import request_specs
from tests.chaos.test_router_restart import ResumingStream
from tests.deployment import Deployment
from tests.integration.test_migration import LONG, reference, stream

pytestmark = pytest.mark.chaos

CONFIG = (
    "model: {dtype: bfloat16, deterministic: true, device: cpu}\n"
    "cache: {kv_memory_mb: 64}\n"
    "server: {workers: 1, standby_workers: 1, threads_per_worker: 1}\n"
    # A node whose supervisor does not renew within 2 s is taken for lost (the lease TTL on etcd's clock).
    "fault_recovery: {lease: {renew_interval_ms: 300, lease_timeout_ms: 2000}}\n"
)


@pytest.fixture
def want(small_deterministic_config, small_deterministic_model) -> dict[int, list[int]]:
    return reference(small_deterministic_config, small_deterministic_model)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, small_model_path, small_deterministic_model):  # skipped where the mode cannot run
    if shutil.which("etcd") is None:
        pytest.skip("etcd (Debian etcd-server) is not installed")
    tmp = tmp_path_factory.mktemp("node-loss")
    journal = tmp / "journal"  # every process's ledger calls, for the history checker
    journal.mkdir()
    d = Deployment(tmp, small_model_path, CONFIG, env={"STEADFAST_LEDGER_JOURNAL": str(journal)}, journal=journal)
    try:
        yield d.start()
    finally:
        d.stop()


def lose_a_node(
    deployment: Deployment, i: int, lose: Callable[[str], None], before: Callable[[int], None] = lambda n: None
) -> tuple[list[int], dict]:
    """Stream `body(i)`; once its client has 16 tokens, `lose(host)` the node decoding it (`before(n)` at
    each token until then). Returns the client's tokens, and the owner (its /admin/workers row) and host."""
    seen: dict = {}

    def at_token(rid: str, n: int) -> None:
        before(n)
        if n == 16:
            owner = next(w for w in deployment.workers() if w["in_flight"])
            seen.update(owner=owner, host=deployment.host_of(owner["pid"]))
            lose(seen["host"])

    _, got, _, finish = stream(deployment, i, at_token, LONG)
    assert finish == "length"
    return got, seen


def check_moved(deployment: Deployment, seen: dict, before: dict[int, dict]) -> None:
    """The move really happened: off the lost node's worker, onto a worker of the other node, by rebuild."""
    owner = seen["owner"]
    takeover = next(t for t in reversed(deployment.admin("/admin/takeovers")) if t["from_worker"] == owner["id"])
    assert before[takeover["to_worker"]]["node"] != owner["node"] and takeover["route"] == "rebuild", takeover
    assert f"node {seen['host']}'s membership lapsed" in deployment.log("router")


def check_comes_back_fenced(deployment: Deployment, seen: dict, before: dict[int, dict]) -> None:
    """The host is back: its old workers end (fenced by the router in its ledger), the node registers again
    with new workers; in its ledger's recorded history each old worker was fenced and nothing of theirs
    was accepted after that, and the history is consistent."""
    node = seen["owner"]["node"]
    old = {w["id"] for w in before.values() if w["node"] == node}
    deployment.wait(
        lambda: {w["id"] for w in deployment.workers() if w["node"] == node} - old,
        60,
        f"node {seen['host']} to come back with new workers",
    )
    threading.Event().wait(1.0)  # (its old workers' last calls, if any, reach the journal)
    history = load_journal(deployment.journal, store=deployment.node_ledger_url(seen["host"]))
    names = {f"worker{i}" for i in old}
    fences = {op.args[0]: op.seq for op in history if op.name == "fence" and op.ok and op.args[0] in names}
    assert set(fences) == names, (fences, names)
    late = [op for op in history if op.ok and op.args and str(op.args[0]) in names and op.seq > fences[op.args[0]]]
    assert [op for op in late if op.name not in ("fence", "fence_dead", "reclaim")] == []
    assert check_history(history) == []
    for host in deployment.nodes:
        assert check_history(load_journal(deployment.journal, store=deployment.node_ledger_url(host))) == []


def test_a_node_stopped_past_its_lease_is_fenced_and_its_stream_finishes_on_another(deployment, want):
    assert deployment.etcd is not None
    before = {w["id"]: w for w in deployment.workers()}
    frozen: list[int] = []

    def freeze(host: str) -> None:
        frozen.extend(deployment.stop_host(host))

    def kill_leader(n: int) -> None:
        if n == 4:  # under load: the etcd leader killed (every ledger and record lives there)
            deployment.etcd.kill(deployment.etcd.wait_leader())

    try:
        got, seen = lose_a_node(deployment, 0, freeze, kill_leader)
    finally:
        deployment.continue_host(frozen)
    assert sum(m.proc.poll() is None for m in deployment.etcd.members) == 2  # the leader was killed
    assert got == want[0]  # every token once, in order, the same as undisturbed
    check_moved(deployment, seen, before)
    check_comes_back_fenced(deployment, seen, before)


def test_a_node_cut_off_the_network_is_fenced_and_its_stream_finishes_on_another(deployment, want):
    """The node runs on, unreachable (its link down): etcd ends its lease; when the link comes back its
    workers find themselves fenced (and whatever they send the router is not theirs to send any more)."""
    assert deployment.hosts is not None
    if deployment.hosts.why_not:
        pytest.skip(f"no network namespaces to cut: {deployment.hosts.why_not}")
    deployment.wait(deployment.ready, 60, "the deployment ready again")
    before = {w["id"]: w for w in deployment.workers()}
    cut: list[str] = []

    def cut_off(host: str) -> None:
        deployment.hosts.cut(host)
        cut.append(host)

    try:
        got, seen = lose_a_node(deployment, 1, cut_off)  # (seeded sampling)
    finally:
        for host in cut:
            deployment.hosts.cut(host, off=False)
    assert got == want[1]
    check_moved(deployment, seen, before)
    check_comes_back_fenced(deployment, seen, before)


def test_the_router_part_killed_mid_stream_its_clients_resume_on_the_restarted_one(deployment):
    """The router process of the router part killed (SIGKILL) mid-stream: its launcher starts it again,
    it learns the nodes' workers from etcd and a client that reconnects with Last-Event-ID gets the rest
    of its stream, every token once, as an undisturbed run's."""
    model = httpx.get(deployment.url + "/v1/models").json()["data"][0]["id"]
    spec = request_specs()[1]  # seeded sampling
    # Long enough to still run when the kill lands: 64 tokens were all sent first once beside two busy loops.
    tokens = 384
    undisturbed = ResumingStream(deployment.url, model, spec, max_tokens=tokens)
    undisturbed.start()
    undisturbed.join(120)
    (router,) = children_named(deployment.parts["router"].pid, "steadfast.control.main")  # (netns exec execs)
    client = ResumingStream(deployment.url, model, spec, max_tokens=tokens)
    client.start()
    deployment.wait(lambda: len(client.tokens) >= 16, 60, "16 tokens")
    os.kill(router, signal.SIGKILL)
    client.join(120)
    assert client.error is None and client.finish == "length" and client.reconnects >= 1
    assert client.counts == sorted(set(client.counts))  # no event twice
    assert client.tokens == undisturbed.tokens and undisturbed.finish == "length"
    assert "router (pid" in deployment.log("router") and "restarting it" in deployment.log("router")


def test_a_node_part_stopped_in_order_hands_its_stream_on_and_leaves(deployment):
    """SIGTERM to a node part while a stream decodes there (the last test: the node stays gone): its
    workers drain — the stream moves to the other node (a standby there promoted if it has no serving
    worker), computed again there: there is no KV wire between hosts — and retire; the node leaves
    without being fenced (nothing was lost), and the client's tokens are those of an undisturbed run."""
    deployment.wait(deployment.ready, 60, "the deployment ready again")
    tokens = 1500  # still decoding when the drain comes (the server runs well ahead of its client)
    _, undisturbed, _, _ = stream(deployment, 0, None, tokens)
    seen: dict = {}

    def at_token(rid: str, n: int) -> None:
        if n == 16:
            owner = next(w for w in deployment.workers() if w["in_flight"])
            seen.update(owner=owner, host=deployment.host_of(owner["pid"]))
            seen["part"] = deployment.parts.pop(seen["host"])
            seen["part"].terminate()

    _, got, _, finish = stream(deployment, 0, at_token, tokens)
    assert finish == "length" and got == undisturbed
    assert seen["part"].wait(timeout=60) == 0
    deployment.wait(lambda: f"node {seen['host']} left" in deployment.log("router"), 10, "the router to see it leave")
    migrations = deployment.admin("/admin/migrations")
    tag = next(m["request"] for m in migrations if m["from_worker"] == seen["owner"]["id"])
    moved = [m for m in migrations if m["request"] == tag]
    # Its last move: to the other node, by recompute (no KV wire between hosts). Before it, possibly one
    # to the stopping node's own standby, promoted before that one said it was stopping too. With two CPU
    # hogs beside the suite that last move was once the health monitor's (reason "health"): the same hand-on.
    last = moved[-1]
    assert last["reason"] in ("drain", "health"), moved
    assert (last["path"], last["outcome"]) == ("recompute", "committed"), moved
    final = next(w for w in deployment.workers() if w["id"] == moved[-1]["to_worker"])
    assert final["node"] != seen["owner"]["node"], (moved, final)
    log = deployment.log("router").split(f"draining worker {seen['owner']['id']}")[-1]
    owner = seen["owner"]["id"]
    assert "membership lapsed" not in log and f"worker {owner} (pid {seen['owner']['pid']}) retired" in log
    assert f"worker {owner} (pid {seen['owner']['pid']}) died" not in log
