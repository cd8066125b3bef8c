"""What each request of a soak's catalogue gives undisturbed: the in-process engine, with the served
deployment's model config (same dtype; bf16 needs `model.deterministic` for token identity whatever the
batch), runs them all once."""

from __future__ import annotations

import os
import uuid

from steadfast.config import Config
from steadfast.ops.harness.soak import Ask
from steadfast.wire.worker import AddRequest, SamplingParams
from steadfast.worker.engine import Engine
from steadfast.worker.loaded import LoadedModel, load_model, private_arena


def reference(cfg: Config, asks: list[Ask], loaded: LoadedModel | None = None) -> dict[int, list[int]]:
    """Token ids by ask key, each request run to its `max_tokens` (EOS ignored, as the soak sends it)."""
    loaded = loaded if loaded is not None else load_model(cfg)
    path = f"/dev/shm/steadfast-soak-reference-{os.getpid()}-{uuid.uuid4().hex[:8]}.kv"
    engine = Engine(cfg, loaded, private_arena(cfg, loaded.model_cfg, path))
    try:
        reqs = []
        for a in asks:
            ids = loaded.tokenizer.encode_chat([{"role": r, "content": c} for r, c in a.messages])
            params = SamplingParams(a.max_tokens, a.temperature, seed=a.seed or 0, ignore_eos=True)
            reqs.append(AddRequest(f"ask{a.key}", ids, params))
        out = engine.generate(reqs)
    finally:
        engine.arena.unlink()
    return {a.key: [t for o in out[f"ask{a.key}"] for t in o.token_ids] for a in asks}
