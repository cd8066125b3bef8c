"""What one forward pass attends: each new token's K/V slot, and the decode rows, verifications and
prefill chunks of a flat batch (built by `worker/core/runner.py`, read by `llama.LlamaModel.forward`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def kv_rows(block_ids: list[int], strips: int, num_blocks: int) -> list[int]:
    """Where blocks' K/V lie in one layer viewed as `[strips * num_blocks, block_size * head_dim]` rows
    (`strips` = 2 * kv_heads: K then V, head by head): each strip's row of each block, strip-major.

    Gathering rows along the first dimension copies contiguous runs (the fast path of `index_select`);
    selecting the same blocks along the second dimension of `[strips, blocks, ...]` is 1.9x slower.
    """
    return [s * num_blocks + b for s in range(strips) for b in block_ids]


@dataclass
class PrefillChunk:
    start: int  # index of its first token in the flat batch
    length: int  # new tokens in this chunk
    context_len: int  # past + new tokens
    rows: torch.Tensor  # kv_rows of the blocks covering context_len


@dataclass
class DecodeGroup:
    """Decode tokens attended together, each request's KV padded to the group's longest context."""

    count: int  # requests (one token each), consecutive in the flat batch
    rows: torch.Tensor  # kv_rows of the block tables, padded to the widest, flattened
    pad: torch.Tensor  # [1, count, 1, max_blocks * block_size] True = padding, not attended


@dataclass
class PagedDecodes:
    """Decode rows the kernel attends in place, no gather, no padding: one per decoding request, then
    one per verified position (each attending up to its own position)."""

    count: int  # rows, the first of the flat batch
    tables: torch.Tensor  # int32 [count, max_blocks] block tables (entries past a context are not read)
    lens: torch.Tensor  # int32 [count] tokens attended, the new one included


@dataclass
class VerifyGroup:
    """Requests verifying draft tokens, a few query rows each, attended together: each request's KV
    padded to the widest, its rows padded to the most (`width`), one gather and two matmuls per layer
    instead of a prefill chunk's ops per request."""

    count: int  # requests
    width: int  # query rows per request after padding (the most drafts + 1)
    queries: torch.Tensor  # [count * width] flat batch row of each padded query (a pad repeats the last)
    real: torch.Tensor  # [rows] padded index of each real row, in flat-batch order
    rows: torch.Tensor  # kv_rows of the block tables, padded to the widest, flattened
    mask: torch.Tensor  # [1, count, 1, width, max_blocks * block_size] True = not attended


@dataclass
class AttentionBatch:
    """Where each new token's KV goes and what each token attends to."""

    slots: torch.Tensor  # [tokens] block * block_size + offset of each new token's KV
    decodes: list[DecodeGroup] | PagedDecodes  # the first tokens of the batch, group after group
    prefills: list[PrefillChunk]
    verifies: VerifyGroup | None = None  # rows after the decodes' (before the prefills')
