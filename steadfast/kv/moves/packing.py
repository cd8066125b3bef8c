"""Arena byte packing for KV moves: one layer's K and V at a set of token slots, copied out of an arena
into contiguous bytes (the wire's `KVFrame.data` layout) and written back into another arena's slots.

On the CPU both directions are one numpy copy each: a gather (`np.take`) out of the arena and a scatter
into it, the bytes handed on as memoryviews of the gathered array, not copied again. `np.take` over
`index_select` because on these VMs a new page costs ~2 µs at its first touch and numpy's large
allocations are huge-page backed: a 25 MB round gathers in ~3 ms against 10–35 ms (and that copy is on
the engine thread). A device arena goes through torch and one copy to the host.

This module owns the byte layout only: it must never send, receive, checksum or decide which blocks a
transfer uses (the caller names the slots).
"""

from __future__ import annotations

import numpy as np
import torch

from steadfast.kv.arena.arena import KVArena


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    """`t` ([..., dim], contiguous) as uint8 with the last dim in bytes: any dtype, bf16 too, maps to numpy."""
    return t.view(torch.uint8)


def _gather(kv: torch.Tensor, axis: int, slots: torch.Tensor, zeros: int) -> np.ndarray:
    """`kv` ([..., slots, dim] with the slot axis `axis`) at `slots`, then `zeros` zero slots: one array."""
    if kv.device.type == "cpu":
        out = np.take(_bytes_view(kv).numpy(), slots.numpy(), axis=axis)
        if zeros:
            pad = list(out.shape)
            pad[axis] = zeros
            out = np.concatenate([out, np.zeros(pad, np.uint8)], axis=axis)
        return out
    data = kv.index_select(axis, slots.to(kv.device)).cpu()
    if zeros:
        pad = [0, 0] * (data.dim() - 1 - axis) + [0, zeros]
        data = torch.nn.functional.pad(data, pad)
    return _bytes_view(data.contiguous()).numpy()


def _view(a: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(a)).cast("B")


def layer_span(arena: KVArena, layer: int, slots: torch.Tensor, zeros: int = 0) -> memoryview:
    """One layer's K and V at arena `slots` (block * block_size + offset), packed contiguous, followed by
    `zeros` token positions of zeros (a span that runs past the tokens written)."""
    kv = arena.tensor[layer]  # [2, kv_heads, blocks, block_size, dim]
    two, heads, blocks, bs, dim = kv.shape
    return _view(_gather(kv.reshape(two, heads, blocks * bs, dim), 2, slots, zeros))


def layer_spans(arena: KVArena, slots: torch.Tensor, zeros: int = 0) -> list[memoryview]:
    """`layer_span` of every layer, gathered in one operation (a migration's round: all layers at once);
    each a view of the one gathered array."""
    t = arena.tensor  # [layers, 2, kv_heads, blocks, block_size, dim]
    layers, two, heads, blocks, bs, dim = t.shape
    data = _gather(t.view(layers, two, heads, blocks * bs, dim), 3, slots, zeros)
    return [_view(data[layer]) for layer in range(layers)]


def write_span(arena: KVArena, layer: int, slots: torch.Tensor, data: bytes | memoryview) -> None:
    """The inverse of `layer_span`: `data` ([2, kv_heads, len(slots), dim]) into `slots` of `layer`."""
    kv = arena.tensor[layer]
    two, heads, blocks, bs, dim = kv.shape
    if kv.device.type == "cpu":
        dst = _bytes_view(kv).numpy().reshape(two, heads, blocks * bs, -1)
        dst[:, :, slots.numpy(), :] = np.frombuffer(data, np.uint8).reshape(two, heads, len(slots), -1)
        return
    src = torch.frombuffer(bytearray(data), dtype=kv.dtype).view(two, heads, len(slots), dim)
    kv.view(two, heads, blocks * bs, dim).index_copy_(2, slots.to(kv.device), src.to(kv.device))


def slots_for(block_ids: list[int], block_size: int, start: int, count: int) -> torch.Tensor:
    """Arena slots of token positions `start .. start + count` of a request held in `block_ids`."""
    return torch.tensor(
        [block_ids[p // block_size] * block_size + p % block_size for p in range(start, start + count)],
        dtype=torch.long,
    )
