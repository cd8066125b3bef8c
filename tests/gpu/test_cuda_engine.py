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
from steadfast.kv.arena.arena import KVArena, map_arena
from steadfast.kv.arena.spec import arena_spec
from steadfast.kv.integrity import check_node
from steadfast.kv.ledger.open import open_ledger
from steadfast.kv.pool.client import PoolClient
from steadfast.worker.engine import Engine
from steadfast.worker.kv.ledger_sync import LedgerSync
from steadfast.worker.loaded import load_model
from tests.chaos.node import Node
from tests.conftest import PROMPTS
from tests.engine_logits import chat_requests, first_divergence, run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TIE = 1e-3  # logits this close are a tie the two devices may break differently


def test_cuda_engine_on_the_pool_arena_matches_the_cpu(tmp_path):
    base = Config().replace(model={"dtype": "float32"}, cache={"num_blocks": 256})
    cpu_cfg = base.replace(model={"device": "cpu"})
    cpu_loaded = load_model(cpu_cfg)
    path = f"/dev/shm/steadfast-gpu-test-{os.getpid()}-{uuid.uuid4().hex[:6]}.kv"
    cpu_arena = KVArena.create(path, arena_spec(cpu_cfg, cpu_loaded.model_cfg))
    try:
        want, want_rows = run(Engine(cpu_cfg, cpu_loaded, cpu_arena), chat_requests(cpu_loaded.tokenizer, PROMPTS))
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
        got, got_rows = run(engine, chat_requests(cpu_loaded.tokenizer, PROMPTS))
        # The ledger's seals hash the device bytes; a second mapping of the arena agrees with all of it.
        tables = {"worker0": {}}
        problems = check_node(open_ledger(reply.ledger_url), node.arena(), tables)
        assert problems == []
        sync.close(pool, engine.blocks.held_blocks)
    finally:
        node.stop()

    identical = 0
    for rid, tokens in want.items():
        n = first_divergence(tokens, got[rid])
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
