"""The KV move's byte layout: what `packing` gathers out of an arena and scatters back, in every dtype an
arena holds, equals the plain definition (torch's gather of the slots, zeros after), with no copy kept of
the arena itself."""

from __future__ import annotations

import pytest
import torch

from steadfast.kv.arena.arena import ArenaSpec, KVArena
from steadfast.kv.moves.packing import layer_span, layer_spans, slots_for, write_span

pytestmark = pytest.mark.unit


def arena(dtype: str, seed: int) -> KVArena:
    spec = ArenaSpec(num_blocks=12, num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype)
    a = KVArena.create_device(spec, "cpu")
    g = torch.Generator().manual_seed(seed)
    a.tensor.copy_(torch.randn(a.tensor.shape, generator=g))
    return a


def reference(a: KVArena, layer: int, slots: torch.Tensor, zeros: int) -> bytes:
    kv = a.tensor[layer]
    two, heads, blocks, bs, dim = kv.shape
    data = kv.reshape(two, heads, blocks * bs, dim).index_select(2, slots)
    data = torch.cat([data, torch.zeros(two, heads, zeros, dim, dtype=data.dtype)], dim=2)
    return data.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("zeros", [0, 3])
def test_gathered_spans_are_the_slots_bytes_in_order_then_zeros(dtype, zeros):
    a = arena(dtype, 1)
    blocks = [7, 2, 9]  # out of order, as a block table is
    slots = slots_for(blocks, 4, 1, 9)
    every = layer_spans(a, slots, zeros)
    for layer in range(3):
        want = reference(a, layer, slots, zeros)
        assert bytes(every[layer]) == want
        assert bytes(layer_span(a, layer, slots, zeros)) == want
    # A copy, not a view of the arena: changing the arena afterwards leaves the spans as they were.
    before = [bytes(s) for s in every]
    a.tensor.zero_()
    assert [bytes(s) for s in every] == before


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_written_span_lands_in_the_named_slots_only(dtype):
    src, dst = arena(dtype, 2), arena(dtype, 3)
    untouched = dst.tensor.clone()
    src_slots, dst_slots = slots_for([3, 4], 4, 0, 7), slots_for([10, 0], 4, 0, 7)
    for layer in range(3):
        write_span(dst, layer, dst_slots, layer_span(src, layer, src_slots))
        assert bytes(layer_span(dst, layer, dst_slots)) == bytes(layer_span(src, layer, src_slots))
    # Every slot not named keeps its bytes (block 0's last slot, and every other block).
    two, heads, dim = 2, 2, 8
    flat = dst.tensor.view(3, two, heads, 12 * 4, dim)
    before = untouched.view(3, two, heads, 12 * 4, dim)
    others = [s for s in range(48) if s not in set(dst_slots.tolist())]
    assert torch.equal(flat[:, :, :, others], before[:, :, :, others])
