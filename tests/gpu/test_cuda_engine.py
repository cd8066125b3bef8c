"""The engine on a GPU: the same tokens as on the CPU, with its KV in the pool's device arena.

fp32 on two devices rounds differently, so a greedy token may only differ where the CPU's own top two
logits are a near-tie; everywhere else the tokens must be identical and the logits close. Skipped
without a CUDA device.
"""

from __future__ import annotations

import os
import uuid

import pytest
import torch

from steadfast.config import Config
from steadfast.kv.arena import KVArena, map_arena
from steadfast.kv.integrity import check_node
from steadfast.kv.ledger_url import open_ledger
from steadfast.kv.pool_client import PoolClient
from steadfast.kv.spec import arena_spec
from steadfast.protocol import AddRequest, SamplingParams
from steadfast.worker.engine import Engine, load_model
from steadfast.worker.ledger_sync import LedgerSync
from tests.chaos.node import Node
from tests.conftest import PROMPTS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TIE = 1e-3  # logits this close are a tie the two devices may break differently


def record_logits(engine: Engine) -> dict[str, list[torch.Tensor]]:
    """Capture, per request, the logits row each of its tokens was sampled from."""
    rows: dict[str, list[torch.Tensor]] = {}
    execute = engine.runner.execute

    def recording(step):
        logits, samplers = execute(step)
        for row, request in zip(logits, samplers, strict=True):
            rows.setdefault(request.request_id, []).append(row.clone())
        return logits, samplers

    engine.runner.execute = recording
    return rows


def requests(tokenizer, max_tokens: int = 32) -> list[AddRequest]:
    return [
        AddRequest(f"r{i}", tokenizer.encode_chat([{"role": "user", "content": p}]), SamplingParams(max_tokens, 0.0))
        for i, p in enumerate(PROMPTS)
    ]


def run(engine: Engine, reqs: list[AddRequest]) -> tuple[dict[str, list[int]], dict[str, list[torch.Tensor]]]:
    rows = record_logits(engine)
    out = engine.generate(reqs)
    return {rid: [t for o in outs for t in o.token_ids] for rid, outs in out.items()}, rows


def test_cuda_engine_on_the_pool_arena_matches_the_cpu(tmp_path):
    base = Config().replace(model={"dtype": "float32"}, cache={"num_blocks": 256})
    cpu_cfg = base.replace(model={"device": "cpu"})
    cpu_loaded = load_model(cpu_cfg)
    path = f"/dev/shm/steadfast-gpu-test-{os.getpid()}-{uuid.uuid4().hex[:6]}.kv"
    cpu_arena = KVArena.create(path, arena_spec(cpu_cfg, cpu_loaded.model_cfg))
    try:
        want, want_rows = run(Engine(cpu_cfg, cpu_loaded, cpu_arena), requests(cpu_loaded.tokenizer))
    finally:
        cpu_arena.unlink()

    gpu_cfg = base.replace(model={"device": "cuda"})
    node = Node(tmp_path, gpu_cfg)  # a kvpool daemon with its arena in device memory
    node.start_pool()
    try:
        pool = PoolClient(node.pool_address, "worker0")
        reply = pool.register(os.getpid())
        arena = map_arena(reply)
        assert reply.cuda_ipc is not None and arena.device.type == "cuda"
        sync = LedgerSync(gpu_cfg, pool, reply.ledger_url, arena)
        engine = Engine(gpu_cfg, load_model(gpu_cfg), arena, source=pool, sync=sync)
        got, got_rows = run(engine, requests(cpu_loaded.tokenizer))
        # The ledger's seals hash the device bytes; a second mapping of the arena agrees with all of it.
        tables = {"worker0": {}}
        problems = check_node(open_ledger(reply.ledger_url), node.arena(), tables)
        assert problems == []
        sync.close(pool, engine.blocks.held_blocks)
    finally:
        node.stop()

    identical = 0
    for rid, tokens in want.items():
        n = next((i for i, (a, b) in enumerate(zip(tokens, got[rid], strict=False)) if a != b), None)
        upto = len(tokens) if n is None else n
        for i in range(upto):
            diff = (want_rows[rid][i] - got_rows[rid][i].cpu()).abs().max().item()
            assert diff < 1e-2, f"{rid} token {i}: logits differ by {diff}"
        if n is None:
            assert got[rid] == tokens
            identical += 1
            continue
        top2 = want_rows[rid][n].topk(2).values
        assert (top2[0] - top2[1]).item() < TIE, f"{rid} diverged at token {n} without a near-tie"
    assert identical >= len(want) - 2, f"only {identical} of {len(want)} requests identical"
