"""Arena byte packing for KV moves: one layer's K and V at a set of token slots, copied out of an arena
into contiguous bytes (the wire's `KVChunk.data` layout) and written back into another arena's slots.

This module owns the byte layout only: it must never send, receive, checksum or decide which blocks a
transfer uses (the caller names the slots).
"""

from __future__ import annotations

import torch

from steadfast.kv.arena import KVArena


def layer_span(arena: KVArena, layer: int, slots: torch.Tensor, zeros: int = 0) -> bytes:
    """One layer's K and V at arena `slots` (block * block_size + offset), packed contiguous, followed by
    `zeros` token positions of zeros (a span that runs past the tokens written)."""
    kv = arena.tensor[layer]  # [2, kv_heads, blocks, block_size, dim]
    two, heads, blocks, bs, dim = kv.shape
    data = kv.reshape(two, heads, blocks * bs, dim).index_select(2, slots.to(kv.device)).cpu()
    if zeros:
        data = torch.nn.functional.pad(data, (0, 0, 0, zeros))
    return data.view(torch.uint8).numpy().tobytes()


def layer_spans(arena: KVArena, slots: torch.Tensor, zeros: int = 0) -> list[bytes]:
    """`layer_span` of every layer, gathered in one operation (a migration's round: all layers at once)."""
    t = arena.tensor  # [layers, 2, kv_heads, blocks, block_size, dim]
    layers, two, heads, blocks, bs, dim = t.shape
    data = t.view(layers, two, heads, blocks * bs, dim).index_select(3, slots.to(t.device)).cpu()
    if zeros:
        data = torch.nn.functional.pad(data, (0, 0, 0, zeros))
    return [data[layer].view(torch.uint8).numpy().tobytes() for layer in range(layers)]


def write_span(arena: KVArena, layer: int, slots: torch.Tensor, data: bytes) -> None:
    """The inverse of `layer_span`: `data` ([2, kv_heads, len(slots), dim]) into `slots` of `layer`."""
    kv = arena.tensor[layer]
    two, heads, blocks, bs, dim = kv.shape
    src = torch.frombuffer(bytearray(data), dtype=kv.dtype).view(two, heads, len(slots), dim)
    kv.view(two, heads, blocks * bs, dim).index_copy_(2, slots.to(kv.device), src.to(kv.device))


def slots_for(block_ids: list[int], block_size: int, start: int, count: int) -> torch.Tensor:
    """Arena slots of token positions `start .. start + count` of a request held in `block_ids`."""
    return torch.tensor(
        [block_ids[p // block_size] * block_size + p % block_size for p in range(start, start + count)],
        dtype=torch.long,
    )
