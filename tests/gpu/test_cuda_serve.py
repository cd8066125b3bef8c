"""`steadfast serve` on a GPU: kvpool with a device arena, a worker mapping it by IPC handle, HTTP on top.

Skipped without a CUDA device.
"""

from __future__ import annotations

import json
import os
import uuid

import httpx
import pytest
import torch

from steadfast.config import Config
from steadfast.wire.worker import AddRequest, SamplingParams
from steadfast.worker.engine import Engine
from steadfast.worker.loaded import load_model, private_arena
from tests.integration.server import ServerProcess

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

QUESTION = "What is the capital of France?"


def test_serve_on_cuda_streams_what_the_engine_computes(tmp_path):
    server = ServerProcess(tmp_path, "model: {dtype: float32}\ncache: {kv_memory_mb: 256}\n")
    try:
        server.wait_ready()
        body = {
            "model": "any",
            "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 24,
            "temperature": 0,
        }
        models = httpx.get(server.url + "/v1/models").json()["data"]
        body["model"] = models[0]["id"]
        plain = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
        assert plain.status_code == 200, plain.text
        text = plain.json()["choices"][0]["message"]["content"]
        assert plain.json()["usage"]["completion_tokens"] >= 1
        pieces = []
        with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    delta = json.loads(line[6:])["choices"][0]["delta"]
                    pieces.append(delta.get("content") or "")
        assert "".join(pieces) == text
        log = server.output()
        assert "on cuda" in log, log  # the worker's ready line names the arena's device
    finally:
        server.stop()

    # The same request in this process, on the GPU with a private device arena: the same text.
    cfg = Config().replace(model={"dtype": "float32", "device": "cuda"}, cache={"kv_memory_mb": 256})
    loaded = load_model(cfg)
    path = f"/dev/shm/unused-{uuid.uuid4().hex}"
    engine = Engine(cfg, loaded, private_arena(cfg, loaded.model_cfg, path))
    assert engine.arena.device.type == "cuda" and not os.path.exists(path)  # no file for a device arena
    ids = loaded.tokenizer.encode_chat([{"role": "user", "content": QUESTION}])
    out = engine.generate([AddRequest("q", ids, SamplingParams(max_tokens=24, temperature=0.0))])
    assert "".join(o.text for o in out["q"]) == text
