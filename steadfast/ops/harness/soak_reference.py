"""What each request of a soak's catalogue gives undisturbed: the in-process engine, with the served
deployment's model config (same dtype; bf16 needs `model.deterministic` for token identity whatever the
batch), runs them all once."""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass

from steadfast.config import Config
from steadfast.control.http import tools
from steadfast.control.http.openai_models import ChatCompletionRequest
from steadfast.model.grammar import from_json_schema, from_lark
from steadfast.ops.harness.soak import ADJUSTED, LOGPROBS, SCHEMA, Ask
from steadfast.wire.worker import AddRequest, SamplingParams
from steadfast.worker.engine import Engine
from steadfast.worker.loaded import LoadedModel, load_model, private_arena


@dataclass
class Expected:
    # By ask key, each request run to its `max_tokens` (EOS ignored, as sent); an ask of `n` choices: every
    # choice's tokens, choice after choice (choice k is the request with seed + k).
    tokens: dict[int, list[int]]
    logprobs: dict[int, list[float]]  # each token's, for the asks that want them
    # The logprob difference a served run may show: none where every row is computed alike whatever the
    # batch (`model.deterministic`); in fp32 a prefix-cache hit alone moves one by 2.5e-5 (measured).
    tolerance: float


def reference(cfg: Config, asks: list[Ask], loaded: LoadedModel | None = None) -> Expected:
    """What each ask gives undisturbed."""
    loaded = loaded if loaded is not None else load_model(cfg)
    path = f"/dev/shm/steadfast-soak-reference-{os.getpid()}-{uuid.uuid4().hex[:8]}.kv"
    engine = Engine(cfg, loaded, private_arena(cfg, loaded.model_cfg, path))
    try:
        reqs = []
        for a in asks:
            # The prompt and grammar as the router makes them (a tool call's: its tools in the prompt).
            request = ChatCompletionRequest.model_validate(a.body("m"))
            ids = loaded.tokenizer.encode_chat(tools.prompt_messages(request, template_native=False))
            forced = tools.forced(request)
            grammar = (
                from_lark(tools.call_grammar(*forced)) if forced else from_json_schema(SCHEMA) if a.structured else ""
            )
            adjusted = ADJUSTED if a.adjusted else {}
            logprobs = LOGPROBS["top_logprobs"] if a.logprobs else -1
            for k in range(a.n):
                params = SamplingParams(
                    a.max_tokens,
                    a.temperature,
                    seed=(a.seed or 0) + k,
                    ignore_eos=True,
                    logprobs=logprobs,
                    grammar=grammar,
                    **adjusted,
                )
                reqs.append(AddRequest(f"ask{a.key}" + (f"-{k}" if k else ""), ids, params))
        out = engine.generate(reqs)
    finally:
        engine.arena.unlink()
    names = {a.key: [f"ask{a.key}" + (f"-{k}" if k else "") for k in range(a.n)] for a in asks}
    tokens = {a.key: [t for name in names[a.key] for o in out[name] for t in o.token_ids] for a in asks}
    logprobs = {a.key: [lp.logprob for o in out[f"ask{a.key}"] for lp in o.logprobs or ()] for a in asks if a.logprobs}
    return Expected(tokens, logprobs, 0.0 if loaded.model.deterministic else 1e-4)
