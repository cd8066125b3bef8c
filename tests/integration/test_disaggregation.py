"""Prefill/decode disaggregation on one node: a prefill worker computes the prompt and the first token,
then hands the request's KV blocks to a decode worker by a change of owner in the ledger (no byte
moves); the decode worker streams the rest. Output must equal a mixed worker's, token for token (fp32).

The first test plays the router itself over the real wires (to see which worker sent what and what the
ledger says); the second goes through `steadfast serve` with a prefill and a decode worker.
"""

from __future__ import annotations

import json

import httpx
import pytest

from steadfast.config import Config
from steadfast.kv.integrity import check_node
from steadfast.protocol import AddRequest, Resume, SamplingParams
from tests.chaos.node import Node
from tests.conftest import PROMPTS
from tests.integration.server import ServerProcess

pytestmark = pytest.mark.integration

MAX_TOKENS = 32


def config() -> Config:
    return Config().replace(
        model={"dtype": "float32", "device": "cpu"},
        cache={"kv_memory_mb": 192, "pool_grant_batch": 4},
        fault_recovery={"kv_cache": {"snapshot_interval_steps": 4}},
    )


def requests(tokenizer) -> list[AddRequest]:
    reqs = []
    for i, prompt in enumerate(PROMPTS[:8]):
        ids = tokenizer.encode_chat([{"role": "user", "content": prompt}])
        temp = 0.0 if i % 2 == 0 else 0.8  # greedy and seeded sampling
        reqs.append(AddRequest(f"r{i}", ids, SamplingParams(MAX_TOKENS, temp, seed=300 + i, ignore_eos=True)))
    return reqs


def test_prefill_hands_kv_to_decode_worker_and_output_is_exact(tmp_path, fp32_model, make_engine):
    cfg = config()
    reqs = requests(fp32_model.tokenizer)
    reference = make_engine(cfg, fp32_model).generate(reqs)
    bs = cfg.cache.block_size

    node = Node(tmp_path, cfg)
    try:
        node.start_pool()
        node.start_worker(0, "prefill")
        node.start_worker(1, "decode")
        refused = AddRequest("gone", reqs[0].prompt_ids, reqs[0].params, decode_worker=7)  # worker7 has no lease
        for r in reqs:
            node.send(0, AddRequest(r.request_id, r.prompt_ids, r.params, decode_worker=1))
        node.send(0, refused)
        got: dict[str, list] = {r.request_id: [] for r in [*reqs, refused]}
        handoffs = {}
        while not all(v and v[-1].finish_reason for v in got.values()):
            outs = node.outputs(timeout=60, max_tokens=1)
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


def test_serve_with_prefill_and_decode_workers_streams_exact_tokens(tmp_path, fp32_model, make_engine, fp32_config):
    tok = fp32_model.tokenizer
    reqs = [
        AddRequest(f"r{i}", tok.encode_chat([{"role": "user", "content": p}]), SamplingParams(MAX_TOKENS, 0.0))
        for i, p in enumerate(PROMPTS[:8])
    ]
    want = make_engine(fp32_config, fp32_model).generate(reqs)
    server = ServerProcess(tmp_path, SERVE_CONFIG)
    try:
        server.wait_ready()
        roles = sorted(w["role"] for w in httpx.get(server.url + "/admin/workers", timeout=10).json())
        assert roles == ["decode", "prefill"]
        model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        for i, prompt in enumerate(PROMPTS[:8]):
            body = {
                "model": model,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "stream": True,
                "return_token_ids": True,
            }
            tokens = []
            with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        for choice in json.loads(line[6:])["choices"]:
                            tokens.extend(choice.get("token_ids", []))
            assert tokens == [t for o in want[f"r{i}"] for t in o.token_ids], prompt
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        assert 'steadfast_kv_transfers_total{outcome="done",path="same_node"} 8.0' in metrics
    finally:
        server.stop()
