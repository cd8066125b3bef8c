"""Model runner: turns a scheduled step into the model's flat batch and returns logits to sample."""

from __future__ import annotations

import torch

from steadfast.kv.arena import KVArena
from steadfast.kv.block_manager import BlockManager
from steadfast.model.llama import AttentionBatch, LlamaModel, PrefillChunk
from steadfast.worker.request import Request
from steadfast.worker.scheduler import ScheduledStep


class ModelRunner:
    def __init__(self, model: LlamaModel, arena: KVArena, blocks: BlockManager) -> None:
        self.model = model
        self.arena = arena
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.device = model.device

    def execute(self, step: ScheduledStep) -> tuple[torch.Tensor, list[Request]]:
        """Run the step; return logits `[rows, vocab]` and the request each row samples for."""
        bs = self.block_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        samplers: list[Request] = []
        sample_rows: list[int] = []

        tables = []
        context_lens = []
        for request in step.decodes:
            pos = request.num_computed
            table = self.blocks.block_table(request.request_id)
            tokens.append(request.all_ids[pos])
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            tables.append(table)
            context_lens.append(pos + 1)
            sample_rows.append(len(tokens) - 1)
            samplers.append(request)

        decode_blocks = decode_pad = None
        if tables:
            width = max(len(t) for t in tables)
            # Pad each table to the widest with block 0: its rows are masked out below.
            decode_blocks = self._tensor([b for t in tables for b in (*t, *([0] * (width - len(t))))])
            lens = self._tensor(context_lens)
            decode_pad = torch.arange(width * bs, device=self.device).unsqueeze(0) >= lens.unsqueeze(1)
            decode_pad = decode_pad.view(1, len(tables), 1, -1)

        chunks = []
        for request, n in step.prefills:
            start, pos0 = len(tokens), request.num_computed
            table = self.blocks.block_table(request.request_id)
            ids = request.all_ids
            for pos in range(pos0, pos0 + n):
                tokens.append(ids[pos])
                positions.append(pos)
                slots.append(table[pos // bs] * bs + pos % bs)
            context = pos0 + n
            chunks.append(PrefillChunk(start, n, context, self._tensor(table[: -(-context // bs)])))
            if context == request.num_tokens:  # prompt fully computed: its last row yields a token
                sample_rows.append(len(tokens) - 1)
                samplers.append(request)

        batch = AttentionBatch(
            slots=self._tensor(slots),
            num_decode=len(step.decodes),
            decode_blocks=decode_blocks,
            decode_pad=decode_pad,
            prefills=chunks,
        )
        logits = self.model.forward(
            self._tensor(tokens),
            self._tensor(positions),
            batch,
            self.arena,
            self._tensor(sample_rows),
        )
        return logits.cpu(), samplers  # sampling runs on the CPU: per-request seeded generators live there

    def _tensor(self, values: list[int]) -> torch.Tensor:
        # Built on the CPU, copied once: one small host-to-device transfer per index list.
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)
