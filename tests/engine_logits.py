"""Running an engine to completion while keeping the logits row each token was sampled from: for
comparing two ways of computing the same model (devices, weight formats) token by token."""

from __future__ import annotations

import torch

from steadfast.wire.worker import AddRequest, SamplingParams
from steadfast.worker.engine import Engine


def record_logits(engine: Engine) -> dict[str, list[torch.Tensor]]:
    """Capture, per request, the logits row each of its tokens was sampled from."""
    rows: dict[str, list[torch.Tensor]] = {}
    execute = engine.runner.execute

    def recording(step, *rest):  # noqa: ANN001, ANN002, ANN202 - the runner's own arguments
        logits, samplers, scorers = execute(step, *rest)
        for row, request in zip(logits, samplers, strict=False):  # (the prompt rows that score come after)
            rows.setdefault(request.request_id, []).append(row.float().clone())
        return logits, samplers, scorers

    engine.runner.execute = recording
    return rows


def chat_requests(tokenizer, prompts: list[str], max_tokens: int = 32) -> list[AddRequest]:  # noqa: ANN001
    return [
        AddRequest(f"r{i}", tokenizer.encode_chat([{"role": "user", "content": p}]), SamplingParams(max_tokens, 0.0))
        for i, p in enumerate(prompts)
    ]


def run(engine: Engine, reqs: list[AddRequest]) -> tuple[dict[str, list[int]], dict[str, list[torch.Tensor]]]:
    """Each request's tokens and the logits rows they came from."""
    rows = record_logits(engine)
    out = engine.generate(reqs)
    return {rid: [t for o in outs for t in o.token_ids] for rid, outs in out.items()}, rows


def first_divergence(want: list[int], got: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), None)
