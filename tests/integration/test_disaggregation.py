"""Prefill/decode disaggregation on one node: a prefill worker computes the prompt and the first token,
then hands the request's KV blocks to a decode worker by a change of owner in the ledger (no byte
moves); the decode worker streams the rest. Output must equal a mixed worker's, token for token (fp32).

The first test plays the router itself over the real wires (to see which worker sent what and what the
ledger says); the second goes through `steadfast serve` with a prefill and a decode worker.
"""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from steadfast.config import Config
from steadfast.kv.integrity import check_node
from steadfast.kv.pool.client import PoolClient
from steadfast.util.proc import process_gone
from steadfast.wire.worker import AddRequest, Resume, SamplingParams
from tests.chaos.node import Node
from tests.conftest import PROMPTS, wait_until
from tests.integration.server import ServerProcess

pytestmark = pytest.mark.integration

MAX_TOKENS = 32


def config() -> Config:
    return Config().replace(
        model={"dtype": "float32", "device": "cpu"},
        cache={"kv_memory_mb": 192, "pool_grant_batch": 4},
        fault_recovery={"kv_cache": {"snapshot_interval_steps": 4}},
    )


def requests(tokenizer, tag: str = "", max_tokens: int = MAX_TOKENS) -> list[AddRequest]:
    reqs = []
    for i, prompt in enumerate(PROMPTS[:8]):
        ids = tokenizer.encode_chat([{"role": "user", "content": f"{tag}{prompt}"}])
        temp = 0.0 if i % 2 == 0 else 0.8  # greedy and seeded sampling
        reqs.append(AddRequest(f"r{i}", ids, SamplingParams(max_tokens, temp, seed=300 + i, ignore_eos=True)))
    return reqs


def test_prefill_hands_kv_to_decode_worker_and_output_is_exact(tmp_path, small_model, small_model_path, make_engine):
    cfg = config().replace(model={"path": small_model_path})
    reqs = requests(small_model.tokenizer)
    reference = make_engine(cfg, small_model).generate(reqs)
    bs = cfg.cache.block_size

    node = Node(tmp_path, cfg)
    try:
        node.start_pool()
        node.start_worker(0, "prefill", wait=False)  # both load at once
        node.start_worker(1, "decode")
        node.wait_ready(0)
        refused = AddRequest("gone", reqs[0].prompt_ids, reqs[0].params, decode_worker=7)  # worker7 has no lease
        for r in reqs:
            node.send(0, AddRequest(r.request_id, r.prompt_ids, r.params, decode_worker=1))
        node.send(0, refused)
        got: dict[str, list] = {r.request_id: [] for r in [*reqs, refused]}
        handoffs = {}
        while not all(v and v[-1].finish_reason for v in got.values()):
            outs = node.outputs(timeout=60, max_outputs=1)
            assert outs, "no output for a minute"
            for out in outs:
                got[out.request_id].append(out)
                if out.handoff is not None and not out.handoff.error:
                    r = next(x for x in reqs if x.request_id == out.request_id)
                    handoffs[r.request_id] = out.handoff
                    resume = Resume(list(out.token_ids), len(out.text), 0)
                    node.send(1, AddRequest(r.request_id, r.prompt_ids, r.params, resume=resume, handoff=out.handoff))

        for r in reqs:
            rid = r.request_id
            outs = got[rid]
            assert [t for o in outs for t in o.token_ids] == [t for o in reference[rid] for t in o.token_ids], rid
            assert "".join(o.text for o in outs) == "".join(o.text for o in reference[rid]), rid
            h = handoffs[rid]
            assert h.num_computed == len(r.prompt_ids)
            assert len(h.block_ids) == -(-len(r.prompt_ids) // bs)  # every block of the prompt, none recomputed
            assert node.origin[(rid, 0)] == 0  # the first token from the prefill worker...
            assert {node.origin[(rid, o.index)] for o in outs[1:]} == {1}  # ...every other from the decode worker
            assert (outs[1].route, outs[1].adopted_tokens, outs[1].recomputed_tokens) == ("handoff", h.num_computed, 1)
        # Refused (the decode worker named has no lease): the prefill worker decodes it itself, exactly.
        gone = got["gone"]
        assert gone[0].handoff is not None and "no live lease" in gone[0].handoff.error
        assert [t for o in gone for t in o.token_ids] == [t for o in reference["r0"] for t in o.token_ids]
        assert {node.origin[("gone", o.index)] for o in gone} == {0}

        ledger = node.ledger()
        for r in reqs:
            ck = ledger.request(r.request_id)
            # Only the receiver writes it after the handoff (an idle worker's last checkpoint may still be due).
            assert ck.owner == "worker1" and ck.phase in ("decode", "finished"), (ck.owner, ck.phase)
            assert len(ck.generated_ids) > 1
        assert check_node(ledger, node.arena()) == []
    finally:
        node.stop()


SERVE_CONFIG = """
model: {dtype: float32, device: cpu}
cache: {kv_memory_mb: 256}
server: {workers: 0, prefill_workers: 1, decode_workers: 1, standby_workers: 0}
"""


def chat_body(model: str, prompt: str, max_tokens: int = MAX_TOKENS) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }


def stream_tokens(url: str, body: dict, on_token=lambda n: None) -> list[int]:
    """The token ids a streaming client receives; `on_token(count)` after each chunk."""
    tokens: list[int] = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    tokens.extend(choice.get("token_ids", []))
                on_token(len(tokens))
    return tokens


def reference(make_engine, cfg: Config, model, prompts: list[str], max_tokens: int = MAX_TOKENS) -> list:
    tok = model.tokenizer
    reqs = [
        AddRequest(
            f"r{i}",
            tok.encode_chat([{"role": "user", "content": p}]),
            SamplingParams(max_tokens, 0.0, ignore_eos=True),
        )
        for i, p in enumerate(prompts)
    ]
    got = make_engine(cfg, model).generate(reqs)
    return [[t for o in got[f"r{i}"] for t in o.token_ids] for i in range(len(prompts))]


def test_serve_with_prefill_and_decode_workers_streams_exact_tokens(
    tmp_path, small_model, make_engine, small_config, small_model_path
):
    want = reference(make_engine, small_config, small_model, PROMPTS[:8])
    server = ServerProcess(tmp_path, SERVE_CONFIG, model=small_model_path)
    try:
        server.wait_ready()
        roles = sorted(w["role"] for w in httpx.get(server.url + "/admin/workers", timeout=10).json())
        assert roles == ["decode", "prefill"]
        model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        for i, prompt in enumerate(PROMPTS[:8]):
            assert stream_tokens(server.url, chat_body(model, prompt)) == want[i], prompt
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        assert 'steadfast_kv_transfers_total{outcome="done",path="same_node"} 8.0' in metrics
    finally:
        server.stop()


SEPARATE_CONFIG = """
model: {dtype: float32, device: cpu}
cache: {kv_memory_mb: 128}
server: {workers: 0, prefill_workers: 1, decode_workers: 1, decode_node: separate, standby_workers: 1}
"""


@pytest.mark.chaos
def test_serve_with_a_decode_node_streams_kv_and_survives_its_decode_worker(
    tmp_path, small_model, make_engine, small_config, small_model_path
):
    """`decode_node: separate`: the decode worker has a kvpool, arena and ledger of its own (another
    node), so every request's KV is streamed to it over TCP. Then its decode worker is killed
    mid-stream: the supervisor fences it through that node's pool, and the node's standby adopts its
    KV and finishes the stream, token-exactly."""
    want = reference(make_engine, small_config, small_model, PROMPTS[:5], max_tokens=64)
    server = ServerProcess(tmp_path, SEPARATE_CONFIG, model=small_model_path)
    try:
        server.wait_ready()  # the active workers are; the standbys may still be loading their model

        def every_worker_reported():
            ws = httpx.get(server.url + "/admin/workers", timeout=10).json()
            return ws if len(ws) == 4 and all(w["node"] for w in ws) else None

        workers = wait_until(every_worker_reported, 120, "every worker's first status")
        node = {w["role"] if w["role"] != "standby" else f"standby{w['id']}": w["node"] for w in workers}
        assert len(workers) == 4 and node["prefill"] != node["decode"]  # a standby on each node
        assert sorted(node[k] for k in node if k.startswith("standby")) == sorted([node["prefill"], node["decode"]])
        model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        for i, prompt in enumerate(PROMPTS[:4]):
            assert stream_tokens(server.url, chat_body(model, prompt, 64)) == want[i], prompt
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        assert 'steadfast_kv_transfers_total{outcome="done",path="primary"} 4.0' in metrics
        assert 'steadfast_kv_transfer_bandwidth_bytes_per_second_count{path="primary"} 4.0' in metrics

        decode = next(w for w in workers if w["role"] == "decode")
        killed = []

        def kill_decode_worker(count: int) -> None:
            if count >= 12 and not killed:
                os.kill(decode["pid"], signal.SIGKILL)
                killed.append(count)

        assert stream_tokens(server.url, chat_body(model, PROMPTS[4], 64), kill_decode_worker) == want[4]
        assert killed
        (moved,) = httpx.get(server.url + "/admin/takeovers", timeout=10).json()
        after = {w["id"]: w for w in httpx.get(server.url + "/admin/workers", timeout=10).json()}
        assert moved["from_worker"] == decode["id"] and after[moved["to_worker"]]["node"] == decode["node"]
        assert moved["route"] == "ledger_first" and moved["adopted_tokens"] > 0, moved
        assert after[moved["to_worker"]]["role"] == "decode"
    finally:
        server.stop()


class TwoNodes:
    """Node A (kvpool + prefill workers 0, layer-wise, and 2, send-after-prefill) and node B (its own
    kvpool and arena + decode worker 1), all reporting to the test, which plays the router: it sends
    each request to a prefill worker with worker 1's KV receiver addresses and, on the transfer's
    outcome, sends it on to worker 1. Faults are switched on node A's senders through a file."""

    def __init__(self, tmp_path, cfg: Config) -> None:
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        self.a, self.b = Node(tmp_path / "a", cfg), Node(tmp_path / "b", cfg)
        self.faults = tmp_path / "faults"

    def start(self, monkeypatch, more_decode: tuple[int, ...] = ()) -> list[str]:
        """Pools, then every worker at once (`more_decode`: more decode workers' ids on node B)."""
        monkeypatch.setenv("STEADFAST_TRANSFER_FAULTS_FILE", str(self.faults))  # inherited by the workers
        self.a.start_pool()
        self.b.start_pool()
        self.a.start_worker(0, "prefill", wait=False)
        layerwise = self.a.cfg_json
        self.a.cfg_json = json.dumps(self.a.cfg.replace(transfer={"layerwise": False}).to_dict())
        self.a.start_worker(2, "prefill", wait=False)
        self.a.cfg_json = layerwise
        for worker_id in (1, *more_decode):
            self.b.start_worker(worker_id, "decode", output=self.a.output)
        for worker_id in (0, 2, *more_decode):
            self.a.wait_ready(worker_id)
        status = self.a.wait_status(1, "ready", timeout=120)
        assert status.node != self.a.status[0].node and len(status.kv_addresses) == 2
        return status.kv_addresses

    def run(self, prefill: int, reqs: list[AddRequest], kv_paths: list[str], faults: str = ""):
        """Every request through prefill (node A) → transfer → decode (node B); returns outputs and
        the transfer outcome (Handoff) of each."""
        self.faults.write_text(faults)
        for r in reqs:
            add = AddRequest(r.request_id, r.prompt_ids, r.params, decode_worker=1, kv_paths=kv_paths)
            self.a.send(prefill, add)
        got: dict[str, list] = {r.request_id: [] for r in reqs}
        outcome = {}
        while not all(v and v[-1].finish_reason for v in got.values()):
            outs = self.a.outputs(timeout=90, max_outputs=1)
            assert outs, "no output for 90 s"
            for out in outs:
                r = next(x for x in reqs if x.request_id == out.request_id)
                if out.handoff is not None and not out.token_ids:
                    outcome[r.request_id] = h = out.handoff
                    so_far = got[r.request_id]
                    resume = Resume([t for o in so_far for t in o.token_ids], sum(len(o.text) for o in so_far), 0)
                    handoff = None if h.error else h  # every path failed: worker 1 computes the prompt
                    self.b.send(1, AddRequest(r.request_id, r.prompt_ids, r.params, resume=resume, handoff=handoff))
                    continue
                got[r.request_id].append(out)
        return got, outcome

    def stop(self) -> None:
        self.a.stop()
        self.b.stop()


def tokens(outs) -> list[int]:
    return [t for o in outs for t in o.token_ids]


# (case, prefill worker, faults on node A's senders, expected path, expect resends)
CROSS_CASES = [
    ("layerwise", 0, "", "primary", False),
    ("after_prefill", 2, "", "primary", False),
    ("delayed", 0, "delay_s=0.003,path=primary", "primary", False),  # slow wire: late, not lost
    ("drop_and_corrupt", 0, "drop_every=9,corrupt_every=7,path=primary", "primary", True),
    ("primary_dead", 0, "drop_every=1,path=primary", "alternate", True),
    ("every_path_dead", 0, "corrupt_every=1,path=*", "", True),
]


def test_kv_streamed_to_another_node_gives_exact_output(
    tmp_path, small_model, small_model_path, make_engine, monkeypatch
):
    """fp32, greedy and seeded: the same tokens as a mixed worker whatever the transfer went through:
    streamed layer by layer or sent after the prefill; every chunk delayed; chunks dropped and
    corrupted (resent on the same path); the primary path dead (the alternate delivers); every path
    dead (a clear error, and the decode worker computes the prompt). Both pools check clean; no block
    leaked on node B."""
    # The small model: the same wire, layers and faults at a fraction of the compute (the reference is
    # the in-process engine, not transformers).
    cfg = config().replace(
        model={"path": small_model_path}, transfer={"timeout": "400ms", "retries": 6, "backoff": "10ms"}
    )
    nodes = TwoNodes(tmp_path, cfg)
    try:
        kv_paths = nodes.start(monkeypatch)
        for case, prefill, faults, path, resends in CROSS_CASES:
            # Prompts of their own per case: nothing found in a prefix cache from an earlier case.
            reqs = [
                AddRequest(f"{case}-{r.request_id}", r.prompt_ids, r.params)
                # Few tokens: the transfer is the prompt's; decoding past it adds nothing but time.
                for r in requests(small_model.tokenizer, f"({case}) ", max_tokens=12)[:4]
            ]
            reference = make_engine(cfg, small_model).generate(reqs)
            got, outcome = nodes.run(prefill, reqs, kv_paths, faults)
            for r in reqs:
                rid = r.request_id
                assert tokens(got[rid]) == tokens(reference[rid]), rid
                assert "".join(o.text for o in got[rid]) == "".join(o.text for o in reference[rid]), rid
                h = outcome[rid]
                assert h.path == path, (rid, h)
                if path:
                    assert not h.error and h.num_computed == len(r.prompt_ids) and h.bytes > 0, h
                    assert h.fallbacks == (1 if path == "alternate" else 0), h
                else:  # every path failed: a clear error, and the decode worker computed the prompt
                    assert h.fallback == "recompute" and "every path failed" in h.error and h.fallbacks == 2, h
                # Which requests' chunks a `drop_every`/`corrupt_every` hits depends on how their prefills
                # were batched (the count runs across requests): the case as a whole must have resent.
                assert h.retries == 0 or resends, h
                assert nodes.a.origin[(rid, 0)] == prefill
                assert {nodes.a.origin[(rid, o.index)] for o in got[rid][1:]} == {1}, rid
                first = got[rid][1]  # the decode worker's first output: where its KV came from
                if path:  # streamed: only the first token's KV computed there
                    want = ("transfer", len(r.prompt_ids), 1)
                else:  # computed there (less what its prefix cache held: the shared system prompt)
                    want = ("rebuild", 0, len(r.prompt_ids) + 1 - first.num_cached_tokens)
                assert (first.route, first.adopted_tokens, first.recomputed_tokens) == want, (rid, first)
            assert any(outcome[r.request_id].retries > 0 for r in reqs) == resends, (case, outcome)
        # The switch was read for each faulty case's transfers (the drop/corrupt resends and the
        # dead paths show their effect above; a delay shows nowhere else).
        logs = (nodes.a.log_text("worker0") + nodes.a.log_text("worker2")).splitlines()
        for case, _, faults, _, _ in CROSS_CASES:
            armed = [line for line in logs if f"KV transfer of {case}-" in line and "fault switch armed" in line]
            assert len(armed) == (4 if faults else 0), (case, armed)
        assert all("delay_s=0.003" in line for line in logs if "KV transfer of delayed-" in line)
        for node in (nodes.a, nodes.b):
            assert check_node(node.ledger(), node.arena()) == []
        # No block leaked on node B: once the decode worker stops cleanly, its pool has every block back.
        nodes.b.workers[1].terminate()
        nodes.b.workers[1].wait(timeout=30)
        assert all(b.owner is None for b in nodes.b.ledger().blocks())
    finally:
        nodes.stop()


def test_a_worker_dying_mid_transfer_loses_nothing(tmp_path, small_model, small_model_path, make_engine, monkeypatch):
    """Real kills while KV streams between nodes. The prefill worker dies mid-prompt: the decode worker
    computes the request itself and the half-received transfer's blocks go back to its pool. The
    decode worker dies before the commit: every path fails, the request is recomputed on another
    decode worker. Output exact both times; both pools check clean; nothing leaked. (The small model:
    the reference is the in-process engine.)"""
    cfg = config().replace(
        model={"path": small_model_path},
        scheduler={"max_prefill_chunk": 16, "max_num_batched_tokens": 16},  # a long prompt takes many steps
        transfer={"timeout": "400ms", "retries": 1, "backoff": "10ms"},
    )
    long_text = "The lighthouse keeper logged the weather every hour of the long night. " * 140
    ids = small_model.tokenizer.encode_chat([{"role": "user", "content": long_text}])
    reqs = [AddRequest(f"k{i}", ids, SamplingParams(16, 0.0, ignore_eos=True)) for i in range(2)]
    want = make_engine(cfg, small_model).generate(reqs[:1])["k0"]
    nodes = TwoNodes(tmp_path, cfg)
    a, b = nodes.a, nodes.b
    try:
        kv_paths = nodes.start(monkeypatch, more_decode=(3,))

        # 1. The prefill worker is killed while it streams the prompt's layers.
        a.send(0, AddRequest("k0", ids, reqs[0].params, decode_worker=1, kv_paths=kv_paths))
        # Killed once worker 1 holds the transfer's reservation (not after a fixed sleep: on a loaded
        # machine the first layers may not have left yet).
        deadline = time.monotonic() + 60
        while not any(blk.owner == "worker1" for blk in b.ledger().blocks()) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # a few chunks in
        assert not a.outputs(timeout=0.05), "the prompt finished before the kill"
        victim = a.workers[0]
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait()
        assert process_gone(victim.pid)
        PoolClient(a.pool_address, "supervisor").fence_dead("worker0", victim.pid)
        b.send(1, AddRequest("k0", ids, reqs[0].params, resume=Resume([], 0, 0)))  # as the router's takeover
        outs = a.outputs(timeout=120, until_finished={"k0"})
        assert tokens(outs) == tokens(want)
        assert outs[0].route == "rebuild" and a.origin[("k0", 0)] == 1
        # The kill landed mid-transfer: worker 1 had taken chunks in, and gave the blocks back.
        deadline = time.monotonic() + 10
        while "KV transfer of k0 expired" not in b.log_text("worker1") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "KV transfer of k0 expired" in b.log_text("worker1")

        # 2. The decode worker is killed before the commit: the prefill worker's transfer fails on
        # every path and worker 3 computes the prompt.
        a.send(2, AddRequest("k1", ids, reqs[1].params, decode_worker=1, kv_paths=kv_paths))
        time.sleep(1.0)
        victim = b.workers[1]
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait()
        PoolClient(b.pool_address, "supervisor").fence_dead("worker1", victim.pid)
        got: list = []
        while not (got and got[-1].finish_reason):
            for out in a.outputs(timeout=60, max_outputs=1):
                if out.handoff is not None and not out.token_ids:
                    h = out.handoff
                    assert h.fallback == "recompute" and "every path failed" in h.error and h.fallbacks == 2, h
                    resume = Resume(tokens(got), sum(len(o.text) for o in got), 2)
                    b.send(3, AddRequest("k1", ids, reqs[1].params, resume=resume))
                else:
                    got.append(out)
        assert tokens(got) == tokens(want)
        assert a.origin[("k1", 0)] == 2 and {a.origin[("k1", o.index)] for o in got[1:]} == {3}

        for node in (a, b):
            assert check_node(node.ledger(), node.arena()) == []
        b.workers[3].terminate()
        b.workers[3].wait(timeout=30)
        # Node B: the dead worker's blocks reclaimed, the live one's given back on its clean exit.
        assert all(blk.owner is None for blk in b.ledger().blocks())
    finally:
        nodes.stop()


def run_until_idle(engine, timeout_s: float = 30.0) -> list:
    """Step an in-process engine until nothing is left, transfers included; every output."""
    outputs = []
    deadline = time.monotonic() + timeout_s
    while engine.has_work and time.monotonic() < deadline:
        outputs += engine.step()
        time.sleep(0.01)
    assert not engine.has_work
    return outputs


def test_a_request_ending_before_its_kv_is_committed_lets_the_transfer_go(fp32_model, fp32_config, make_arena):
    """A request whose first token already ends it (max_tokens 1), or that is aborted mid-prompt, never
    commits: the sender gives the transfer up, the receiver frees what it took, nothing keeps the
    worker busy. In one process, with a real sender and receiver over TCP."""
    from steadfast.kv.moves.receiver import KVReceiver
    from steadfast.kv.moves.sender import KVSender
    from steadfast.worker.engine import Engine
    from tests.unit.fake_pool import FakePool

    cfg = fp32_config.replace(scheduler={"max_prefill_chunk": 32, "max_num_batched_tokens": 64})
    other = make_arena(cfg, fp32_model)  # the "other node's" arena
    pool = FakePool(other.spec.num_blocks)
    rx = KVReceiver(other, 16, ["tcp://127.0.0.1:0"], pool.grant, pool.release, timeout_s=5.0)
    tx = KVSender(other.spec.num_layers, 1.0, 0, 0.01)
    engine = Engine(cfg, fp32_model, make_arena(cfg, fp32_model), sender=tx)
    try:
        ids = fp32_model.tokenizer.encode("A lighthouse stands on the rock. " * 20)
        one = AddRequest("one", ids, SamplingParams(1, 0.0), decode_worker=1, kv_paths=rx.addresses)
        cut = AddRequest("cut", ids, SamplingParams(8, 0.0), decode_worker=1, kv_paths=rx.addresses)
        engine.add_request(one)
        engine.add_request(cut)
        engine.step()  # both prompts start (and stream their first layers); neither is done
        assert engine.requests["cut"].num_computed < len(ids)
        engine.abort("cut")
        outputs = run_until_idle(engine)
        assert [o.finish_reason for o in outputs if o.request_id == "one" and o.token_ids] == ["length"]
        aborted = {o.request_id: o.handoff for o in outputs if o.handoff is not None}
        assert set(aborted) == {"one", "cut"}
        assert all(h.error == "aborted" and h.fallback == "" for h in aborted.values())
        deadline = time.monotonic() + 30
        while len(pool.free) < other.spec.num_blocks and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(pool.free) == other.spec.num_blocks  # the receiver gave back what it took
    finally:
        tx.close()
        rx.close()


def test_a_transfer_to_a_worker_the_router_says_died_fails_to_its_fallback_at_once(fp32_model, fp32_config, make_arena):
    """The decode worker died with two transfers to it under way: one prompt done and waiting for its
    COMMIT's answer, one still computing. Told so (the router's `DestinationLost`), the engine gives
    both up now — no path tried again, though each session would wait 60 s, then 120 s, for an answer
    here — and the router gets each with the recompute fallback; the one still computing stops here
    (the decode side computes it) and nothing of either stays."""
    import zmq

    from steadfast.kv.moves.sender import KVSender
    from steadfast.worker.engine import Engine
    from tests.integration.server import free_port

    cfg = fp32_config.replace(scheduler={"max_prefill_chunk": 32, "max_num_batched_tokens": 64})
    arena = make_arena(cfg, fp32_model)
    tx = KVSender(arena.spec.num_layers, 60.0, 3, 0.01)
    engine = Engine(cfg, fp32_model, arena, sender=tx)
    # The receiver's sockets, taking what comes and answering nothing (as a process gone mid-move).
    paths = [f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"]
    silent = [zmq.Context.instance().socket(zmq.ROUTER) for _ in paths]
    for sock, address in zip(silent, paths, strict=True):
        sock.bind(address)
    try:
        short = fp32_model.tokenizer.encode("A lighthouse stands on the rock.")
        long = fp32_model.tokenizer.encode("A lighthouse stands on the rock. " * 20)
        engine.add_request(AddRequest("done", short, SamplingParams(8, 0.0), decode_worker=1, kv_paths=paths))
        engine.add_request(AddRequest("computing", long, SamplingParams(8, 0.0), decode_worker=1, kv_paths=paths))
        outputs = engine.step()
        deadline = time.monotonic() + 30
        while not engine.kv.paused("done") and time.monotonic() < deadline:
            outputs += engine.step()
        assert engine.kv.paused("done") and engine.requests["computing"].num_computed < len(long)
        engine.destination_lost(1)
        outputs += run_until_idle(engine, timeout_s=30)  # well inside the sessions' first wait
        handed = {o.request_id: o.handoff for o in outputs if o.handoff is not None}
        assert set(handed) == {"done", "computing"}
        for h in handed.values():
            assert h.fallback == "recompute" and "worker 1 died" in h.error and h.to_worker == 1, h
            assert h.fallbacks == 0 and h.retries == 0, h  # no path was tried again
        assert not engine.requests and not any(o.token_ids for o in outputs if o.request_id == "computing")
        assert engine.blocks.num_used == 0  # (blocks cached for a prompt like theirs are free ones)
        engine.blocks.check_integrity()
    finally:
        tx.close()
        for sock in silent:
            sock.close(linger=0)


def test_with_recompute_off_a_transfer_failing_on_every_path_ends_the_request_with_a_clear_error(
    fp32_model, fp32_config, make_arena
):
    """`transfer.recompute: false`: the fallback chain is the paths alone. Nobody listens on either
    path here, so both fail and the request ends with an error that names them, once, and the
    worker is idle again (nothing waits on a transfer)."""
    from steadfast.kv.moves.sender import KVSender
    from steadfast.worker.engine import Engine
    from tests.integration.server import free_port

    cfg = fp32_config.replace(transfer={"recompute": False, "retries": 1, "timeout": "300ms", "backoff": "10ms"})
    arena = make_arena(cfg, fp32_model)
    tx = KVSender(arena.spec.num_layers, 0.3, 1, 0.01)
    engine = Engine(cfg, fp32_model, arena, sender=tx)
    try:
        ids = fp32_model.tokenizer.encode("A lighthouse stands on the rock. " * 4)
        paths = [f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"]
        engine.add_request(AddRequest("r", ids, SamplingParams(8, 0.0), decode_worker=1, kv_paths=paths))
        outputs = run_until_idle(engine)
        ended = [o for o in outputs if o.finish_reason is not None]
        assert [o.finish_reason for o in ended] == ["error"]
        assert "failed on every path" in ended[0].error and "transfer.recompute is off" in ended[0].error
        h = ended[0].handoff
        assert h is not None and h.fallback == "error" and h.fallbacks == 2 and h.retries == 2
    finally:
        tx.close()
